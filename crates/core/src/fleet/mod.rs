//! Everything a routing decision reads, in one place, with time passed in.
//!
//! A [`Fleet`] holds each endpoint's state (health, load samples, in-flight accounting,
//! observed prefill rate, recent placements, index trust), the KV block indexes (one per block
//! size), the routing history, the predicted overlay, session affinity and the flow-control
//! queue. The live router, the Envoy endpoint picker and the offline simulator feed it
//! observations (`observe_load`, `apply_events`, `health_check`, `first_token`, ...) and carry
//! out its plans (`plan`, then `dispatched` once a connection to the engine is made); none of
//! them decides anything itself.

mod admit;
mod block_reuse;
mod copy_rent;
mod costing;
mod decay;
pub mod disagg;
mod endpoint;
pub mod flow;
mod lookup;
mod membership;
mod model_priors;
pub mod outlier;
mod peer_load;
mod pinned;
mod recent_use;
mod restart;
mod retry;
mod rotation;
mod sessions;
mod shared;
mod shared_backlog;
mod tier_learning;
pub mod trust;
mod warm;

use std::cell::OnceCell;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::CoreError;
use crate::event::KvEvent;
use crate::history::RoutingHistory;
use crate::index::{
    EndpointId, EndpointRestore, HeldBlocks, HeldEntry, IndexConfig, KeyLayout, PrefixMatch,
    PrefixMatches, ROUTER_KEY_SCHEME, SharedIndex,
};
use crate::keys::RouterKey;
use crate::schedule::{
    CacheSource, Candidate, Decision, EndpointLoad, IndexState, LoadOrder, Profile, PruneBuffers,
    RankBuffers, RequestInfo, Role, amortize, decoders_saturated, schedule, schedule_near_best,
};
use crate::tiers::{FitSample, LoadTier, TierTokens};
pub use admit::{Admission, HeldTurn};
use copy_rent::CopyRents;
pub use disagg::{DecodeRetry, DisaggConfig, FailedDecodeLeg, TransfersDropped};
pub use endpoint::{
    EndpointSpec, EndpointState, HealthChange, HealthPolicy, LoadMark, LoadSample,
    PREFILL_RATE_SAMPLE_WEIGHT,
};
use endpoint::{PrefillSample, RatePool};
pub use flow::{FlowConfig, FlowQueue, HoldTicket, Shed};
pub use lookup::{IndexLookup, LookupTarget, LookupTargets};
pub use outlier::{Ejection, OutlierPolicy, RetryPolicy, UpstreamOutcome};
pub use peer_load::PeerLoadStats;
pub use restart::{RestartSignals, RestartWatch};
pub use retry::{AttemptFailure, RetryVerdict};
pub use sessions::Sessions;
pub use shared::SharedPrefixes;
pub use shared_backlog::{SharedBacklog, SharedLoad};
pub use trust::{Distrust, Trust, TrustPolicy};
pub use warm::WarmVerdict;

/// The fleet's bounds and thresholds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FleetConfig {
    /// Most (block, endpoint) entries in each KV index.
    pub index_capacity: usize,
    /// Shards of each KV index: endpoints' events are applied by up to this many writers at
    /// once (see [`SharedIndex::sharded`]); a lookup walks every shard holding the prompt.
    pub index_shards: usize,
    /// Seconds the router remembers where it sent a prefix.
    pub history_ttl_s: f64,
    /// Most records in that history: one per block sent to an endpoint, so a block re-sent
    /// with every turn of a conversation counts again each turn. Also bounds the table of
    /// prefixes that conversations share.
    pub history_capacity: usize,
    /// Seconds a just-sent prefix counts as cached before the engine's events arrive.
    pub predicted_ttl_s: f64,
    /// Most (block, endpoint) entries in the predicted overlay.
    pub predicted_capacity: usize,
    /// Seconds a prediction outlives its request's first token (the time the engine's
    /// `BlockStored` needs to arrive).
    pub prediction_grace_s: f64,
    /// Sessions remembered for affinity.
    pub sessions_capacity: usize,
    /// Prefill speed assumed for an endpoint until observed, tokens per second.
    pub default_prefill_tokens_per_s: f64,
    /// Seconds after which a load sample is too old to use.
    pub load_sample_max_age_s: f64,
    /// When an index is distrusted.
    pub trust: TrustPolicy,
    /// When health checks eject and restore endpoints.
    pub health: HealthPolicy,
    /// Flow control under saturation.
    pub flow: FlowConfig,
    /// Passive outlier detection and the per-endpoint circuit breaker.
    pub outlier: OutlierPolicy,
    /// Retries on another endpoint and their budget.
    pub retry: RetryPolicy,
    /// Seconds a removed endpoint's slot (its id) stays unused before a new endpoint takes it:
    /// longer than a request planned there may take to be dispatched (the router's connect
    /// timeout, and a P/D decode leg's wait for its prefill), so that such a request is never
    /// charged to the newcomer.
    pub slot_reuse_after_s: f64,
}

impl Default for FleetConfig {
    fn default() -> Self {
        Self {
            index_capacity: 8 << 20,
            index_shards: 1,
            history_ttl_s: 300.0,
            history_capacity: 4 << 20,
            predicted_ttl_s: 10.0,
            predicted_capacity: 1 << 20,
            prediction_grace_s: 0.25,
            sessions_capacity: 100_000,
            default_prefill_tokens_per_s: 20_000.0,
            load_sample_max_age_s: 5.0,
            trust: TrustPolicy::default(),
            health: HealthPolicy::default(),
            flow: FlowConfig::default(),
            outlier: OutlierPolicy::default(),
            retry: RetryPolicy::default(),
            // A copy of what the router derives from its defaults with P/D on (a 2 s connect
            // timeout, P/D's 30 s prefill deadline, a margin): the router derives its own from
            // its configuration (`RouterConfig::slot_reuse_after_s`); this serves the simulator.
            slot_reuse_after_s: 35.0,
        }
    }
}

impl FleetConfig {
    /// The age past which a load sample is too old, for scrapes sent every `scrape_interval_s`
    /// and answered within `scrape_timeout_s` (a sample dates from when its scrape was sent).
    /// The larger of two spans: four missed scrapes and a second of slack; and the longest gap
    /// between two answers that each came within the deadline (one sent right after the other
    /// answered, at the next interval: timeout + interval + timeout), so that an engine whose
    /// every answer is slow but in time keeps a known load. An answer the router waited for is
    /// never too old to use on arrival. The router and the simulator (whose scrapes answer at
    /// once: timeout 0) both derive it here.
    pub fn load_sample_max_age_for(scrape_interval_s: f64, scrape_timeout_s: f64) -> f64 {
        (scrape_interval_s * 4.0 + 1.0).max(2.0 * scrape_timeout_s + scrape_interval_s)
    }
}

/// A request's features, as the router prepared them.
#[derive(Clone, Debug)]
pub struct RequestFeatures<'a> {
    /// The model (or adapter) it names.
    pub model: &'a str,
    /// Router keys of its prompt's full blocks (empty when not tokenized).
    pub keys: &'a Arc<Vec<RouterKey>>,
    /// Prompt length in tokens (an estimate when not tokenized).
    pub prompt_tokens: usize,
    /// Tokens per block of its model.
    pub block_size: usize,
    /// Its session, if it names one.
    pub session: Option<&'a str>,
    /// The role wanted.
    pub role: Role,
}

/// Candidates a plan ranks and breaks down at least (see [`Fleet::plan`]): the winner and
/// fallbacks enough for any retry policy in use (never fewer than its attempts).
pub const RANKING_DEPTH: usize = 8;

/// Per-endpoint facts behind a plan, for the explain API.
#[derive(Debug, Clone, Serialize)]
pub struct EndpointFacts {
    /// The endpoint (its name is in [`Fleet::endpoint`]'s spec).
    pub endpoint: EndpointId,
    /// Passing health checks.
    pub healthy: bool,
    /// When its outlier ejection ends (router clock, seconds), if one is in force.
    pub ejected_until: Option<f64>,
    /// `None` when its KV index is used, else why not.
    pub index_distrust: Option<Distrust>,
    /// Blocks matched by the index, by tier (before trust is applied).
    pub index_match: Option<PrefixMatch>,
    /// Blocks matched by the router's history.
    pub history_blocks: u32,
    /// Blocks matched by the predicted overlay.
    pub predicted_blocks: u32,
    /// Its load as scored.
    pub load: EndpointLoad,
    /// The prefill rate used, tokens/s.
    pub prefill_tokens_per_s: f64,
}

/// A decision with the context it was made in.
#[derive(Debug, Clone)]
pub struct Plan {
    /// The scheduler's decision.
    pub decision: Decision,
    /// Facts per endpoint, in id order, from [`Fleet::plan_every`] (the explain API); empty
    /// from [`Fleet::plan`], which routes and reads none of them.
    pub facts: Vec<EndpointFacts>,
    /// Per endpoint, the cached tokens the router expects it to report for this request (vLLM
    /// recomputes the last prompt token, so at most the full blocks of all tokens but the
    /// last), from the best trusted source whatever the policy.
    pub predicted_cached: Vec<usize>,
    /// Per endpoint, of `predicted_cached`, the tokens on each tier below the GPU (CPU, own
    /// storage, shared), cut to what the engine can report (slowest tiers first).
    pub predicted_tiers: Vec<TierTokens>,
}

/// One dispatched request's share of an endpoint's load; hand it back to
/// [`Fleet::first_token`] and exactly once to [`Fleet::finished`].
#[derive(Debug, Clone)]
pub struct Dispatch {
    /// Where it went.
    pub endpoint: EndpointId,
    /// Uncached prompt tokens counted into the endpoint's prefill queue.
    pub uncached_tokens: u64,
    /// Cached tokens the router predicted.
    pub predicted_cached: usize,
    /// Prompt length.
    pub prompt_tokens: usize,
    /// When it was dispatched.
    pub dispatched_at: f64,
    /// It counted as a placement (a new conversation or an uncached prompt) at its endpoint.
    pub placement: bool,
    /// Of `predicted_cached`, tokens predicted on each tier below the GPU (read from the
    /// index at dispatch, like [`Plan::predicted_tiers`]). A request with tier tokens teaches
    /// the endpoint's tier load rates rather than its prefill rate.
    pub tier_tokens: TierTokens,
    /// Its tier tokens rely on offloaded-tier events that were recently inconsistent: an
    /// estimate, so it teaches no load rate (and is counted, see
    /// [`TierRates::uncertain_requests`](crate::tiers::TierRates::uncertain_requests)).
    pub tier_uncertain: bool,
    /// Its endpoint's index was trusted at dispatch, so `predicted_cached` was the index's
    /// prediction: only such a request's outcome judges the index (a distrusted index is not
    /// read, and what is predicted without it says nothing of it). Read at dispatch, not at
    /// planning: a held request is planned again when released, so the two differ only if the
    /// verdict changed in the moment between.
    index_trusted: bool,
    /// Seconds its tier loads took, measured at its first token.
    tier_seconds: Option<f64>,
    /// The prefill-rate sample its first token gave, corrected at its end by what the engine
    /// says it found cached.
    prefill_sample: Option<PrefillSample>,
    /// Likewise, the sample it gave its endpoint's first-token line.
    fit_sample: Option<FitSample>,
    /// Its shared-tier load, queued on the mount's backlog until its first token.
    shared_load: Option<SharedLoad>,
    keys: Arc<Vec<RouterKey>>,
    /// The id its blocks are pinned under at its endpoint ([`pinned`]).
    pin: u64,
    /// Its model's slot in the fleet's per-model priors (`None`: a model no endpoint serves).
    model: Option<usize>,
    prefill_done: bool,
    /// No other prefill was in flight there: its time to first token measures the prefill rate.
    rate_sample: bool,
    /// Nothing else at all was in flight there (no decode shared its steps): its time to first
    /// token is clean enough to tell a tier's load time from the rest.
    quiet: bool,
    /// Tokens the engine said it generated ([`Dispatch::output_reported`]).
    output_tokens: Option<usize>,
    /// The time to first token its plan predicted at this endpoint, seconds (queue wait,
    /// prefill, tier loading: [`Assessment::predicted_ttft_s`](crate::schedule::Assessment)),
    /// where the caller planned it; [`Fleet::first_token`] sets the measured time beside it.
    pub predicted_ttft_s: Option<f64>,
}

/// A request's time to first token beside what its plan predicted: how far the cost model's
/// picture of the endpoint is from what the endpoint did (the router exports the difference,
/// `kvroute simulate` summarizes it).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TtftCheck {
    /// Predicted at dispatch, seconds.
    pub predicted_s: f64,
    /// Measured from dispatch to the first token, seconds.
    pub measured_s: f64,
}

impl TtftCheck {
    /// Measured less predicted, seconds: positive when the request waited longer than the
    /// cost model expected. It includes what the prediction leaves out by design (the
    /// network, the engine step that samples the token), so a steady small positive offset is
    /// expected; a growing one says the model's picture of the endpoint is off.
    pub fn error_s(&self) -> f64 {
        self.measured_s - self.predicted_s
    }
}

impl Dispatch {
    /// Whether its first token arrived.
    pub fn prefill_done(&self) -> bool {
        self.prefill_done
    }

    /// The engine reported generating `tokens` for it (its usage's `completion_tokens`): tell
    /// before [`Fleet::finished`], which learns from it how much of the cache a request there
    /// holds by its end.
    pub fn output_reported(&mut self, tokens: usize) {
        self.output_tokens = Some(tokens);
    }
}

/// The fleet's decision state.
#[derive(Debug)]
pub struct Fleet {
    config: FleetConfig,
    profile: Profile,
    endpoints: Vec<EndpointState>,
    /// One index per block size in use, and each endpoint's.
    indexes: Vec<(usize, Arc<SharedIndex>)>,
    history: RoutingHistory,
    predicted: RoutingHistory,
    sessions: Sessions,
    shared: SharedPrefixes,
    /// Rent each shared prefix's requests paid for having too few copies.
    copy_rents: CopyRents,
    /// Whether copies are bought with rent here: the profile chooses by cost from a cache
    /// picture and every present endpoint serves whole requests (see
    /// [`Fleet::apply_copy_rent`]); set again when an endpoint joins or leaves.
    copies_by_rent: bool,
    flow: FlowQueue,
    round_robin: u64,
    retry_budget: outlier::RetryBudget,
    /// The fleet's seeded randomness (see [`Fleet::reseed`]).
    random: crate::random::SeededRandom,
    /// The distrust last reported per endpoint by [`Fleet::trust_changes`].
    reported_trust: Vec<Option<Distrust>>,
    /// Prefill/decode disaggregation's state, when it is on ([`Fleet::enable_disagg`]).
    disagg: Option<disagg::DisaggState>,
    /// Shared-tier loads dispatched and not done, per mount.
    shared_backlog: SharedBacklog,
    /// Each shared filesystem's loads over the current window, from the engines' load
    /// counters: where the filesystem's rate is learned under load.
    mount_windows: crate::load_counters::MountWindows,
    /// Whether [`Fleet::plan`] ranks every candidate (see [`Fleet::rank_every_candidate`]).
    rank_every: bool,
    /// Per-request buffers, kept between plans: the candidates, and the ranking's.
    candidates: Vec<Candidate>,
    rank_buffers: RankBuffers,
    /// Per model, blocks the fleet's requests found cached and stored, recently (the block
    /// reuse an endpoint's own shrinks toward while it has stored less than a cache's worth),
    /// and the decode time of an endpoint where none ended yet.
    model_priors: model_priors::ModelPriors,
    /// Other replicas' prefills in flight, counted in the endpoints' load.
    peer_load: peer_load::PeerLoad,
    /// The present endpoints by a lower bound of their cost per prompt token while they hold
    /// nothing of a prompt (from their busy count and prefill rate), for pruned plans.
    load_order: LoadOrder,
    /// Whether [`Fleet::plan`] costs only the endpoints that can matter (see
    /// [`Fleet::prune_costing`]).
    prune: bool,
    /// Buffers of pruned plans: the scheduler's; the endpoints holding part of the prompt by
    /// any source (`holders`), and of those the ones whose blocks the cost counts, with the
    /// tokens counted and their prefill rate (`holding`, the walk's holders); and the endpoints
    /// whose load sample expired.
    prune_buffers: PruneBuffers,
    holders: Vec<EndpointId>,
    holding: Vec<(EndpointId, usize, f64)>,
    expired_samples: Vec<EndpointId>,
    /// The indexes and the count of dropped cache pictures, shared with callers that walk the
    /// index without the fleet's lock ([`Fleet::lookup_targets`]).
    targets: Arc<LookupTargets>,
    /// Endpoints the last plan viewed and costed.
    last_plan_viewed: usize,
    /// The id the next dispatch pins its blocks under ([`pinned`]).
    next_pin: u64,
}

impl Fleet {
    /// A fleet of `endpoints` (their ids are their positions) under `profile`.
    pub fn new(
        config: FleetConfig,
        profile: Profile,
        endpoints: Vec<EndpointSpec>,
    ) -> Result<Self, CoreError> {
        let mut indexes: Vec<(usize, Arc<SharedIndex>)> = Vec::new();
        for (i, spec) in endpoints.iter().enumerate() {
            let index = ensure_index(&mut indexes, spec.block_size, &config)?;
            index.set_offload(EndpointId(i as u32), &spec.offload)?;
        }
        let endpoints: Vec<EndpointState> = endpoints
            .into_iter()
            .enumerate()
            .map(|(i, spec)| EndpointState::new(EndpointId(i as u32), spec))
            .collect();
        let mut model_priors = model_priors::ModelPriors::default();
        for e in &endpoints {
            model_priors.serve(&e.spec.models);
        }
        let default_rate = config.default_prefill_tokens_per_s;
        let mut fleet = Self {
            history: RoutingHistory::new(config.history_ttl_s, config.history_capacity),
            predicted: RoutingHistory::new(config.predicted_ttl_s, config.predicted_capacity),
            sessions: Sessions::new(config.sessions_capacity),
            shared: SharedPrefixes::new(config.history_capacity),
            copy_rents: CopyRents::default(),
            copies_by_rent: false,
            flow: FlowQueue::new(config.flow.clone()),
            reported_trust: vec![None; endpoints.len()],
            endpoints,
            indexes,
            config,
            profile,
            round_robin: 0,
            retry_budget: outlier::RetryBudget::default(),
            random: crate::random::SeededRandom::default(),
            disagg: None,
            shared_backlog: SharedBacklog::default(),
            mount_windows: Default::default(),
            rank_every: false,
            candidates: Vec::new(),
            rank_buffers: RankBuffers::default(),
            model_priors,
            peer_load: Default::default(),
            load_order: LoadOrder::new(default_rate),
            prune: true,
            prune_buffers: PruneBuffers::default(),
            holders: Vec::new(),
            holding: Vec::new(),
            expired_samples: Vec::new(),
            targets: Arc::default(),
            last_plan_viewed: 0,
            next_pin: 0,
        };
        fleet.roles_changed();
        for at in 0..fleet.endpoints.len() {
            fleet.load_changed(EndpointId(at as u32));
        }
        fleet.targets.set_indexes(&fleet.indexes);
        Ok(fleet)
    }

    /// Whether [`Fleet::plan`] costs only the endpoints that hold part of the prompt and the
    /// least busy of the rest (on by default: the same decisions as costing every endpoint,
    /// see [`crate::schedule::schedule_pruned`]), or every endpoint.
    pub fn prune_costing(&mut self, prune: bool) {
        self.prune = prune;
    }

    /// Makes [`Fleet::plan`] rank and break down every candidate, as [`Fleet::plan_every`]
    /// does: for a caller that reads the whole ranking (pairing prefill with decode endpoints).
    pub fn rank_every_candidate(&mut self, every: bool) {
        self.rank_every = every;
    }

    /// Endpoints the last plan viewed and costed: every endpoint, or with pruning those that
    /// hold part of its prompt and the least busy of the rest.
    pub fn last_plan_viewed(&self) -> usize {
        self.last_plan_viewed
    }

    /// The configuration.
    pub fn config(&self) -> &FleetConfig {
        &self.config
    }

    /// The scheduling profile.
    pub fn profile(&self) -> &Profile {
        &self.profile
    }

    /// Every endpoint, in id order.
    pub fn endpoints(&self) -> &[EndpointState] {
        &self.endpoints
    }

    /// One endpoint.
    pub fn endpoint(&self, id: EndpointId) -> Option<&EndpointState> {
        self.endpoints.get(id.0 as usize)
    }

    /// The index holding blocks of `block_size` tokens, if any endpoint uses that size.
    pub fn index_for_block_size(&self, block_size: usize) -> Option<&Arc<SharedIndex>> {
        self.indexes
            .iter()
            .find(|(bs, _)| *bs == block_size)
            .map(|(_, index)| index)
    }

    /// The index an endpoint's events feed.
    pub fn index_of(&self, id: EndpointId) -> Option<&Arc<SharedIndex>> {
        self.endpoint(id)
            .and_then(|e| self.index_for_block_size(e.spec.block_size))
    }

    /// The routing history (approximate mode).
    pub fn history(&self) -> &RoutingHistory {
        &self.history
    }

    /// The flow-control queue.
    pub fn flow(&self) -> &FlowQueue {
        &self.flow
    }

    /// The flow-control queue, to hold requests in and take them out.
    pub fn flow_mut(&mut self) -> &mut FlowQueue {
        &mut self.flow
    }

    /// Whether `id`'s index may be used at `now`, or why not.
    pub fn trust(&self, id: EndpointId, now: f64) -> Result<(), Distrust> {
        self.endpoint(id).map_or(Err(Distrust::NoEvents), |e| {
            e.trust.verdict(&self.config.trust, now)
        })
    }

    /// Seconds since `id`'s last KV event, if any arrived.
    pub fn events_age(&self, id: EndpointId, now: f64) -> Option<f64> {
        self.endpoint(id).and_then(|e| e.trust.events_age(now))
    }

    /// The endpoint's load as scored at `now`.
    pub fn load(&self, id: EndpointId, now: f64) -> Option<EndpointLoad> {
        self.endpoint(id)
            .map(|e| e.load(now, self.config.load_sample_max_age_s))
    }

    /// Endpoints whose trust changed since the last call: (endpoint, new distrust or `None`
    /// when trusted again). Endpoints without events are not reported.
    pub fn trust_changes(&mut self, now: f64) -> Vec<(EndpointId, Option<Distrust>)> {
        let mut changes = Vec::new();
        for (e, reported) in self.endpoints.iter().zip(self.reported_trust.iter_mut()) {
            let verdict = e.trust.verdict(&self.config.trust, now).err();
            if verdict != *reported && verdict != Some(Distrust::NoEvents) {
                changes.push((e.id, verdict));
            }
            *reported = verdict;
        }
        changes
    }

    /// Plans a request at `now`: every endpoint that can come near the best costed (those
    /// holding part of the prompt the cost counts and the least busy of the rest, see
    /// [`Fleet::prune_costing`]; every endpoint where that cannot be told), the best ranked.
    /// The decision's ranking holds the winner and the next best, [`RANKING_DEPTH`] (or the
    /// retry policy's attempts, if more) in all, and breakdowns for those: the same winner and
    /// head of the ranking as [`Fleet::plan_every`], at a fraction of the work on a large
    /// fleet. `random` is a uniformly random `u64` (ties, sampling).
    pub fn plan(&mut self, request: &RequestFeatures<'_>, random: u64, now: f64) -> Plan {
        self.plan_with(request, None, random, now)
    }

    /// [`Fleet::plan`] with the request's index matches read beforehand, outside whatever
    /// lock guards the fleet ([`Fleet::lookup_targets`] or [`Fleet::lookup_target`], then
    /// [`LookupTarget::run`]); a lookup read
    /// before an endpoint's cache picture was dropped is not used (the index is walked again).
    pub fn plan_with(
        &mut self,
        request: &RequestFeatures<'_>,
        lookup: Option<IndexLookup>,
        random: u64,
        now: f64,
    ) -> Plan {
        let depth = (!self.rank_every).then(|| self.ranking_depth());
        let mut plan = self.plan_ranked(request, lookup, random, now, depth);
        self.apply_copy_rent(request, &mut plan, now, true);
        plan
    }

    /// Plans a request at `now` as [`Fleet::plan`] does, with every candidate ranked and
    /// broken down, and the facts behind each (the explain API).
    pub fn plan_every(&mut self, request: &RequestFeatures<'_>, random: u64, now: f64) -> Plan {
        let mut plan = self.plan_ranked(request, None, random, now, None);
        self.apply_copy_rent(request, &mut plan, now, false);
        plan
    }

    /// An endpoint joined or left (or the fleet was built): whether copies are bought with
    /// rent, which they are under the cheapest picker with a cache picture while every present
    /// endpoint serves whole requests.
    fn roles_changed(&mut self) {
        self.copies_by_rent = self.profile.picker == crate::schedule::Picker::Cheapest
            && self.profile.cache != CacheSource::None
            && self
                .endpoints
                .iter()
                .filter(|e| e.present)
                .all(|e| e.spec.role == Role::Both);
    }

    /// How many candidates a routing plan ranks and breaks down: [`RANKING_DEPTH`], or the retry
    /// policy's attempts if more.
    fn ranking_depth(&self) -> usize {
        RANKING_DEPTH.max(usize::try_from(self.config.retry.max_attempts).unwrap_or(usize::MAX))
    }

    /// Credits a copy of the request's shared prefix with the rent its holders' requests paid
    /// ([`crate::schedule::amortize`]), where the profile chooses by cost from a cache picture
    /// and every endpoint serves whole requests (on a fleet of prefill and decode roles the P/D
    /// decision places the legs). Only the head of the ranking a routing plan breaks down
    /// competes, so that an explanation shows what routing does. `routing`: the plan routes a
    /// request (its dispatch settles the rent), not an explanation.
    fn apply_copy_rent(
        &mut self,
        request: &RequestFeatures<'_>,
        plan: &mut Plan,
        now: f64,
        routing: bool,
    ) {
        let keys = request.keys.as_slice();
        let shared = if self.copies_by_rent {
            self.shared.shared_blocks(keys)
        } else {
            0
        };
        let Some(prefix) = shared.checked_sub(1).and_then(|last| keys.get(last)) else {
            return;
        };
        let bs = request.block_size.max(1);
        let shared_tokens = shared * bs;
        let rent_s = self.copy_rents.rent(prefix.0, now);
        let endpoints = &self.endpoints;
        let cold = |id: EndpointId| {
            let e = endpoints.get(id.0 as usize)?;
            Some(e.reuse.cold_share() * e.capacity_blocks? as f64)
        };
        let head = self.ranking_depth();
        let outcome = amortize::apply_rent(
            &self.profile,
            &mut plan.decision,
            amortize::SharedPrefix {
                tokens: shared_tokens,
                prompt_tokens: request.prompt_tokens,
                block_size: bs,
                rent_s,
            },
            head,
            cold,
        );
        if let (true, Some(outcome)) = (routing, outcome) {
            self.copy_rents
                .plan(prefix.0, shared_tokens, outcome.paid_s, now);
        }
        plan.decision.copy = outcome;
    }

    /// Plans a request by cost, ranking the best `depth` candidates (`None`: every one), with
    /// its index matches from `lookup` when usable.
    fn plan_ranked(
        &mut self,
        request: &RequestFeatures<'_>,
        lookup: Option<IndexLookup>,
        random: u64,
        now: f64,
        depth: Option<usize>,
    ) -> Plan {
        let bs = request.block_size.max(1);
        let keys = request.keys.as_slice();
        // An endpoint not yet observed is assumed as fast as the observed ones serving the same
        // model (a model's engines are mostly uniform; another model's may be ten times faster
        // or slower); the configured rate is the prior when none is observed yet.
        // One pass pools both: the model's endpoints for the costs, the whole fleet for the
        // pruned plan's load order, whose keys must not be set again whenever consecutive
        // requests name models of different speeds (its bound scales to either prior).
        let (mut fleet_pool, mut model_pool) = (RatePool::default(), RatePool::default());
        for e in self.endpoints.iter().filter(|e| e.present) {
            fleet_pool.add(e);
            if e.spec.serves(request.model) {
                model_pool.add(e);
            }
        }
        let model = self.model_priors.slot(request.model);
        let default_rate = self.config.default_prefill_tokens_per_s;
        let prior_rate = model_pool.rate().unwrap_or(default_rate);
        let order_prior = fleet_pool.rate().unwrap_or(default_rate);
        let session_endpoint = request.session.and_then(|s| self.sessions.get(s));
        // Only the cheapest-cost picker can be pruned (the others read every candidate).
        let pruned = self.prune
            && self.profile.picker == crate::schedule::Picker::Cheapest
            && depth.is_some_and(|depth| self.endpoints.len() > depth);
        let index = self.index_for_block_size(bs).cloned();
        let looked_up = self.usable_lookup(lookup, bs);
        let history = self.history.longest_prefixes(keys, now);
        let predicted = self.predicted.longest_prefixes(keys, now);
        let no_matches = PrefixMatches::default();
        let base = costing::PlanInputs {
            model: request.model,
            keys,
            prompt_tokens: request.prompt_tokens,
            block_size: bs,
            index_matches: &no_matches,
            history: &history,
            predicted: &predicted,
            reportable: request.prompt_tokens.saturating_sub(1) / bs,
            prior_rate,
            order_prior,
            prior_reuse: self.model_priors.reuse(model),
            decode_s: self.model_priors.decode_s(model),
            now,
        };
        self.round_robin = self.round_robin.wrapping_add(1);
        // The request's matches: walked before the fleet's lock was taken, else now (one
        // shard's read guard at a time). Each endpoint's fill as its shard last published it:
        // nothing here waits for a writer.
        let walked;
        let index_matches = match (&looked_up, &index) {
            (Some(matches), _) => matches,
            (None, Some(index)) => {
                walked = index.lookup(keys);
                &walked
            }
            (None, None) => &no_matches,
        };
        let info = RequestInfo {
            prompt_tokens: request.prompt_tokens,
            block_size: bs,
            session_endpoint,
            role: request.role,
            gpu_copies: self.gpu_copies(index_matches, request.model, bs, request.role, now),
            prefix_key: self
                .profile
                .picker
                .hashed_prefix_tokens()
                .and_then(|tokens| {
                    // Router keys chain their parents: the last key of the prefix hashes all of it.
                    let blocks = tokens.div_ceil(bs).clamp(1, keys.len().max(1));
                    keys.get(blocks - 1).map(|k| k.0)
                }),
        };
        let held = |id| {
            index
                .as_ref()
                .map_or_else(HeldBlocks::default, |index| index.held_blocks(id))
        };
        if let (true, Some(depth)) = (pruned, depth) {
            let inputs = costing::PlanInputs {
                index_matches,
                ..base
            };
            if let Some(plan) = self.plan_pruned(&inputs, held, &info, random, depth) {
                return plan;
            }
        }
        let ids = self.endpoints.iter().map(|e| e.id);
        let held_blocks: Vec<HeldBlocks> = match &index {
            Some(index) => index.held_blocks_of(ids),
            None => vec![HeldBlocks::default(); self.endpoints.len()],
        };
        let inputs = costing::PlanInputs {
            index_matches,
            ..base
        };
        let mut candidates = std::mem::take(&mut self.candidates);
        candidates.clear();
        self.last_plan_viewed = self.endpoints.len();
        let explain = depth.is_none();
        let mut facts = Vec::with_capacity(if explain { self.endpoints.len() } else { 0 });
        let mut predicted_cached = Vec::with_capacity(self.endpoints.len());
        let mut predicted_tiers = Vec::with_capacity(self.endpoints.len());
        for e in &self.endpoints {
            let view = self.view(&inputs, e, held_blocks[e.id.0 as usize]);
            predicted_cached.push(view.predicted_tokens);
            predicted_tiers.push(view.predicted_tiers);
            if explain {
                facts.push(EndpointFacts {
                    endpoint: e.id,
                    healthy: e.healthy,
                    ejected_until: e.outlier.ejected_until(now),
                    index_distrust: view.verdict.err(),
                    index_match: view.candidate.cache.index,
                    history_blocks: view.candidate.cache.history,
                    predicted_blocks: view.candidate.cache.predicted,
                    load: view.candidate.load.clone(),
                    prefill_tokens_per_s: view.candidate.prefill_tokens_per_s,
                });
            }
            candidates.push(view.candidate);
        }
        let mut decision = match depth {
            Some(depth) => schedule_near_best(
                &self.profile,
                &info,
                &candidates,
                random,
                self.round_robin,
                depth,
                &mut self.rank_buffers,
            ),
            None => schedule(&self.profile, &info, &candidates, random, self.round_robin),
        };
        if let (Some(depth), Some(_)) = (depth, &self.disagg) {
            self.rank_buffers.rank_role_heads(
                &self.profile,
                &info,
                &candidates,
                &mut decision,
                depth,
            );
        }
        if self.disagg.is_some() {
            decision.saturated =
                decoders_saturated(&self.profile, &info, &candidates, decision.saturated);
        }
        self.candidates = candidates;
        Plan {
            decision,
            facts,
            predicted_cached,
            predicted_tiers,
        }
    }

    /// Records that `request` was sent to `endpoint` at `now` (call once the connection to the
    /// engine is made): routing history, predicted overlay, session, placement and in-flight
    /// load. `predicted_cached` is its plan's (empty for a request sent unplanned).
    pub fn dispatched(
        &mut self,
        predicted_cached: &[usize],
        request: &RequestFeatures<'_>,
        endpoint: EndpointId,
        now: f64,
    ) -> Dispatch {
        let slot = endpoint.0 as usize;
        let model = self.model_priors.slot(request.model);
        let predicted = predicted_cached.get(slot).copied().unwrap_or(0);
        // Read before this request enters the predicted overlay; walked at most once, by
        // whichever of the two reads below needs it first.
        let overlay = OnceCell::new();
        let (tier_tokens, tier_uncertain) =
            self.dispatch_tier_tokens(predicted, request, endpoint, now, &overlay);
        let shared_load = self.endpoints.get(slot).and_then(|e| {
            self.shared_backlog.dispatched(
                e.shared_mount(),
                tier_tokens[LoadTier::Shared as usize],
                e.tier_rates.rate(LoadTier::Shared, &self.profile.tiers),
                now,
            )
        });
        // Queued prefill work counts what the engine will compute when it admits the request:
        // the queue ahead may evict part of what is cached now.
        let uncached = request
            .prompt_tokens
            .saturating_sub(self.expected_cached(predicted, request, endpoint, now, &overlay))
            as u64;
        // A placement: a request this endpoint does not hold much more of than the others or
        // than what conversations share (a new conversation, an uncached prompt). Placements
        // are what balancing evens out.
        let bs = request.block_size.max(1);
        // Measured and recorded in one walk (what was shared before this request).
        let shared_blocks = self.shared.record_shared(request.keys);
        // What its plan said its shared prefix's requests pay, settled by whether it went to a
        // holder.
        if let Some(prefix) = shared_blocks
            .checked_sub(1)
            .and_then(|last| request.keys.get(last))
            .filter(|_| self.copies_by_rent)
        {
            self.copy_rents.dispatched(prefix.0, predicted, now);
        }
        let shared = shared_blocks * bs;
        let best_other = predicted_cached
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != slot)
            .map(|(_, c)| *c)
            .max()
            .unwrap_or(0);
        let advantage = predicted.saturating_sub(best_other.max(shared));
        let placement = advantage * 4 < request.prompt_tokens.max(1);
        self.history.record(endpoint, request.keys, now);
        self.predicted.record(endpoint, request.keys, now);
        if let Some(session) = request.session {
            self.sessions.set(session, endpoint);
        }
        self.retry_budget.request(&self.config.retry, now);
        let expects_event = request.prompt_tokens / bs > predicted / bs;
        let mut rate_sample = false;
        let mut quiet = false;
        if let Some(e) = self.endpoints.get_mut(slot) {
            if placement {
                e.note_placement(now);
            }
            let blocks = (request.prompt_tokens / bs) as f64;
            let hits = ((predicted / bs) as f64).min(blocks);
            e.reuse.note(hits, blocks - hits, now);
            // Where in its eviction order it finds them: how much room a copy may take there.
            if let (true, Some(capacity)) = (self.copies_by_rent, e.capacity_blocks) {
                let by_depth =
                    e.recent
                        .hit_depths(&e.pinned, request.keys, hits as usize, capacity);
                e.reuse.note_depths(&by_depth);
            }
            self.model_priors
                .note_reuse(model, hits, blocks - hits, now);
            rate_sample = e.inflight_prefills == 0;
            quiet = e.inflight == 0;
            if tier_uncertain {
                e.tier_rates.uncertain_requests = e.tier_rates.uncertain_requests.saturating_add(1);
            }
            // The earliest its prefill can end: the prefill queued ahead of it, then its own.
            let rate = match e.prefill_rate {
                r if r > 0.0 => r,
                _ => self.config.default_prefill_tokens_per_s.max(1.0),
            };
            let prefill_end =
                now + e.inflight_prefill_tokens.saturating_add(uncached) as f64 / rate;
            e.pinned.pin(
                self.next_pin,
                request.keys.clone(),
                request.prompt_tokens,
                bs,
                prefill_end,
            );
            e.inflight += 1;
            e.inflight_prefills += 1;
            e.inflight_prefill_tokens = e.inflight_prefill_tokens.saturating_add(uncached);
            e.trust.dispatched(expects_event, now);
        }
        let index_trusted = self
            .endpoints
            .get(slot)
            .is_some_and(|e| e.trust.verdict(&self.config.trust, now).is_ok());
        let pin = self.next_pin;
        self.next_pin += 1;
        self.load_changed(endpoint);
        Dispatch {
            endpoint,
            uncached_tokens: uncached,
            predicted_cached: predicted,
            prompt_tokens: request.prompt_tokens,
            dispatched_at: now,
            placement,
            tier_tokens,
            tier_uncertain,
            index_trusted,
            tier_seconds: None,
            prefill_sample: None,
            fit_sample: None,
            shared_load,
            keys: request.keys.clone(),
            pin,
            model,
            prefill_done: false,
            rate_sample,
            quiet,
            output_tokens: None,
            predicted_ttft_s: None,
        }
    }

    /// The blocks of `request`'s prompt the predicted overlay says were just sent to `endpoint`
    /// (not expired at `now`).
    fn overlay_blocks(&self, request: &RequestFeatures<'_>, endpoint: EndpointId, now: f64) -> u32 {
        self.predicted
            .longest_prefixes(request.keys, now)
            .iter()
            .find(|(id, _)| *id == endpoint)
            .map_or(0, |(_, blocks)| *blocks)
    }

    /// Of the `predicted` cached tokens of `request` on `endpoint`, those still cached when the
    /// engine admits it: the queue ahead may evict the rest first (see
    /// [`cost::survival`](crate::schedule::cost::survival)), except the blocks of requests just
    /// sent there, which those use first.
    fn expected_cached(
        &self,
        predicted: usize,
        request: &RequestFeatures<'_>,
        endpoint: EndpointId,
        now: f64,
        overlay: &OnceCell<u32>,
    ) -> usize {
        let Some(e) = self.endpoint(endpoint) else {
            return predicted;
        };
        let (Some(capacity), Some(index)) = (e.capacity_blocks, self.index_of(endpoint)) else {
            return predicted;
        };
        let bs = request.block_size.max(1);
        let held = index.gpu_blocks(endpoint);
        let free = capacity as f64 - held as f64 - (e.inflight_prefill_tokens / bs as u64) as f64;
        let survival = crate::schedule::cost::survival_of(free, capacity as f64);
        if survival >= 1.0 {
            return predicted;
        }
        let overlay_blocks = *overlay.get_or_init(|| self.overlay_blocks(request, endpoint, now));
        let in_use = (overlay_blocks as usize * bs).min(predicted);
        in_use + ((predicted - in_use) as f64 * survival) as usize
    }

    /// A request another router replica sent to `endpoint` at `now` (`placement`: it counted as
    /// a placement there, see [`Dispatch::placement`]): recorded as if sent from here in the
    /// routing history, the predicted overlay, the shared prefixes, the session and the
    /// endpoint's recent placements, so that replicas do not race same-prefix requests or new
    /// conversations onto different (or the same) endpoints. Its in-flight load is counted
    /// apart, until its first token: [`Fleet::peer_prefill_started`].
    pub fn peer_dispatched(
        &mut self,
        request: &RequestFeatures<'_>,
        endpoint: EndpointId,
        placement: bool,
        now: f64,
    ) {
        let Some(e) = self
            .endpoints
            .get_mut(endpoint.0 as usize)
            .filter(|e| e.present)
        else {
            return;
        };
        if placement {
            e.note_placement(now);
        }
        // No first token comes from a peer's request to cut its prediction short: it lasts as
        // long as twice the whole prompt's prefill takes there, plus the grace its events need.
        // Longer, it steers requests to blocks the engine may have evicted since.
        let rate = e
            .observed_prefill_rate()
            .unwrap_or(self.config.default_prefill_tokens_per_s);
        let lifetime = self.config.prediction_grace_s + 2.0 * request.prompt_tokens as f64 / rate;
        self.history.record(endpoint, request.keys, now);
        self.predicted.record(endpoint, request.keys, now);
        self.predicted.shorten(
            endpoint,
            request.keys,
            now + lifetime.min(self.config.predicted_ttl_s),
        );
        self.shared.record(request.keys);
        if let Some(session) = request.session {
            self.sessions.set(session, endpoint);
        }
    }

    fn end_prefill(&mut self, dispatch: &mut Dispatch) -> Option<&mut EndpointState> {
        if dispatch.prefill_done {
            return None;
        }
        dispatch.prefill_done = true;
        if let Some(load) = dispatch.shared_load.take() {
            self.shared_backlog.finished(load);
        }
        let e = self.endpoints.get_mut(dispatch.endpoint.0 as usize)?;
        e.prefill_ended(dispatch.uncached_tokens);
        // Its callers set the endpoint's place in the load order once they are done with it.
        Some(e)
    }

    /// The request's first token arrived at `now` (`ok`: a successful response): its prefill
    /// is done, so from now on the engine's events, not the prediction, say what it holds.
    /// Returns its time to first token beside its plan's prediction, for a successful request
    /// dispatched with one, the first time it is told.
    pub fn first_token(
        &mut self,
        dispatch: &mut Dispatch,
        ok: bool,
        now: f64,
    ) -> Option<TtftCheck> {
        let check = dispatch
            .predicted_ttft_s
            .filter(|p| ok && !dispatch.prefill_done && p.is_finite())
            .map(|predicted_s| TtftCheck {
                predicted_s,
                measured_s: now - dispatch.dispatched_at,
            })
            .filter(|c| c.measured_s.is_finite());
        self.note_first_token(dispatch, ok, now);
        check
    }

    fn note_first_token(&mut self, dispatch: &mut Dispatch, ok: bool, now: f64) {
        let (tokens, seconds, sample) = (
            dispatch.uncached_tokens,
            now - dispatch.dispatched_at,
            dispatch.rate_sample && ok,
        );
        let tiered = dispatch.tier_tokens.iter().any(|&t| t > 0);
        // The shared-tier tokens queued ahead of its load were waited for, not loaded.
        let waited_s = match (dispatch.shared_load, self.endpoint(dispatch.endpoint)) {
            (Some(load), Some(e)) => {
                load.ahead_tokens() / e.tier_rates.rate(LoadTier::Shared, &self.profile.tiers)
            }
            _ => 0.0,
        };
        let Some(e) = self.end_prefill(dispatch) else {
            return;
        };
        e.pinned.first_token(dispatch.pin, now);
        // A tier lesson needs a request that ran alone (under load the decodes batched with it
        // inflate what is left to its loads, and the tier is learned far too slow: measured,
        // docs/benchmarks.md) on a certain tier prediction, and the endpoint's own line of what
        // a request takes without loads (its fixed part and per-token slope, fitted to its
        // untiered requests that ran alone): not the prefill rate, an average that spreads the
        // fixed part over typical prompts and would leave most of it to a tier lesson.
        if sample
            && dispatch.quiet
            && tiered
            && !dispatch.tier_uncertain
            && let Some((fixed, per_token)) = e.tier_rates.baseline.line()
        {
            // The loads are learned once the engine says how much it found cached.
            dispatch.tier_seconds = Some(seconds - fixed - tokens as f64 * per_token - waited_s);
        }
        if ok {
            // Every prefill teaches the prefill rate as before tier lessons (taking a tiered
            // one's loads out, or counting it as unread, measured worse under load).
            dispatch.prefill_sample = e.note_prefill(tokens, seconds, sample);
            if sample && dispatch.quiet && !tiered {
                dispatch.fit_sample = e.tier_rates.baseline.observe(tokens as f64, seconds);
            }
        }
        // Its own prefill rate is part of its key in the load order.
        self.load_changed(dispatch.endpoint);
        if !dispatch.keys.is_empty() {
            let expiry = now + self.config.prediction_grace_s;
            self.predicted
                .shorten(dispatch.endpoint, &dispatch.keys, expiry);
        }
    }

    /// The request ended at `now` (completed, failed, or abandoned by its client);
    /// `reported_cached`: the engine's `cached_tokens`, if it said.
    pub fn finished(&mut self, mut dispatch: Dispatch, reported_cached: Option<usize>, now: f64) {
        let decoding = dispatch.prefill_done;
        self.end_prefill(&mut dispatch);
        if let Some(e) = self.endpoints.get_mut(dispatch.endpoint.0 as usize) {
            e.request_ended(decoding);
            if let Some(ended) = e.pinned.unpin(dispatch.pin, now, dispatch.output_tokens) {
                if let Some(decode_s) = ended.decode_s {
                    self.model_priors.note_decode(dispatch.model, decode_s);
                }
                // Its blocks are in the cache only if it was prefilled (it had a first token)
                // in the engine's present life (sent after what was known of it was forgotten).
                let this_life = e.forgotten_at.is_none_or(|at| dispatch.dispatched_at >= at);
                if ended.decode_s.is_some() && this_life {
                    e.recent.ended(ended.keys, now);
                }
            }
            if let Some(reported) = reported_cached {
                // What it computed by the engine's count: the prompt less what it found cached.
                let computed = dispatch.prompt_tokens.saturating_sub(reported) as u64;
                if let Some(sample) = dispatch.prefill_sample {
                    e.correct_prefill(sample, computed);
                }
                if let Some(sample) = dispatch.fit_sample {
                    e.tier_rates.baseline.correct(sample, computed as f64);
                }
                if dispatch.index_trusted {
                    e.trust.prediction(
                        dispatch.predicted_cached,
                        reported,
                        dispatch.prompt_tokens,
                        &self.config.trust,
                        now,
                    );
                }
                e.tier_rates.note_outcome(
                    dispatch.tier_tokens,
                    dispatch.predicted_cached,
                    reported,
                );
                if let (Some(seconds), Some((_, per_token))) =
                    (dispatch.tier_seconds, e.tier_rates.baseline.line())
                {
                    // Tier tokens the engine recomputed cost the line's per-token time.
                    let rate = 1.0 / per_token;
                    e.tier_rates.observe_reported(
                        dispatch.tier_tokens,
                        seconds,
                        dispatch.predicted_cached,
                        reported,
                        rate,
                        &self.profile.tiers,
                    );
                }
            }
        }
        self.load_changed(dispatch.endpoint);
    }

    /// How a request sent to `id` went at `now` (a refused connection counts, though nothing
    /// was dispatched): consecutive failures eject the endpoint for a while (its cache is not
    /// forgotten: the engine kept it). At most `outlier.max_ejected_fraction` of the fleet is
    /// ejected at once, and one endpoint always may be.
    pub fn upstream_result(
        &mut self,
        id: EndpointId,
        outcome: UpstreamOutcome,
        now: f64,
    ) -> Option<Ejection> {
        // Counting ejections reads every endpoint: only a failure needs it.
        let may_eject = outcome == UpstreamOutcome::Failure && {
            let ejected = self
                .endpoints
                .iter()
                .filter(|e| e.outlier.ejected(now))
                .count();
            let cap =
                (self.config.outlier.max_ejected_fraction * self.endpoints.len() as f64).floor();
            ejected == 0 || (ejected as f64) < cap
        };
        let policy = &self.config.outlier;
        let outlier = &mut self.endpoints.get_mut(id.0 as usize)?.outlier;
        let ejection = outlier.result(outcome, policy, may_eject, now);
        if ejection.is_some() {
            // Out of its model's load order until the ejection ends.
            let until = outlier.ejected_until(now);
            self.load_order.ejected_until(id, until);
            self.load_changed(id);
        }
        ejection
    }

    /// Takes one retry from the fleet's budget at `now`, or says it is spent (see
    /// [`RetryPolicy`]).
    pub fn try_retry(&mut self, now: f64) -> bool {
        self.retry_budget.try_retry(&self.config.retry, now)
    }

    /// A load sample scraped from `id` at an instant, `now` (a simulator's scrape; a scrape
    /// over the network is [`Fleet::observe_scraped_load`]).
    pub fn observe_load(&mut self, id: EndpointId, sample: LoadSample, now: f64) {
        let since = self.load_mark(id, now);
        self.observe_scraped_load(id, sample, since);
    }

    /// Where the router's own accounting of `id` stands at `now`: take it when a scrape of its
    /// load is sent, and give it back with the sample ([`Fleet::observe_scraped_load`]).
    pub fn load_mark(&self, id: EndpointId, now: f64) -> LoadMark {
        self.endpoints
            .get(id.0 as usize)
            .map_or(LoadMark::unknown(now), |e| e.load_mark(now))
    }

    /// A load sample of `id` from a scrape sent when `since` was taken: its counts, less the
    /// router's requests there then and since, are the load of other clients; it ages from
    /// when it was sent.
    pub fn observe_scraped_load(&mut self, id: EndpointId, sample: LoadSample, since: LoadMark) {
        if let Some(e) = self.endpoints.get_mut(id.0 as usize) {
            e.capacity_blocks = sample.num_gpu_blocks.or(e.capacity_blocks);
            e.observe_sample(sample, since);
            let fresh_until = since.at + self.config.load_sample_max_age_s;
            self.load_order.sample_expires(id, Some(fresh_until));
            self.load_changed(id);
        }
    }

    /// A health check of `id` at `now`; an ejection forgets everything known of its cache.
    pub fn health_check(&mut self, id: EndpointId, ok: bool, now: f64) -> Option<HealthChange> {
        let policy = self.config.health.clone();
        let change = self
            .endpoints
            .get_mut(id.0 as usize)
            .filter(|e| e.present)?
            .health_check(ok, &policy);
        if change == Some(HealthChange::Ejected) {
            self.forget_endpoint(id, now);
        }
        if change.is_some() {
            // In or out of its model's load order.
            self.load_changed(id);
        }
        change
    }

    /// One batch of `id`'s KV events arrived at `now`: applies it (see [`Self::events_arrived`]
    /// for applying it outside whatever lock guards the fleet).
    pub fn apply_events(&mut self, id: EndpointId, events: &[KvEvent], now: f64) {
        if let Some(index) = self.events_arrived(id, now) {
            index.apply(id, events);
        }
    }

    /// A batch of `id`'s KV events arrived at `now`: notes it (the index's trust in `id` is
    /// fresh) and returns the index the caller applies it to, `None` when `id` has none.
    ///
    /// The index has its own locks, one per shard, so a concurrent caller applies the batch
    /// after releasing the fleet: planning and every other fleet operation then never wait for
    /// event ingestion, and the endpoints of different shards are applied in parallel. The
    /// note comes first; a plan made in between reads the index a batch behind, as it would
    /// have had the batch arrived a moment later.
    pub fn events_arrived(&mut self, id: EndpointId, now: f64) -> Option<Arc<SharedIndex>> {
        let e = self.endpoints.get_mut(id.0 as usize)?;
        e.trust.events(now);
        self.index_of(id).cloned()
    }

    /// Some of `id`'s events were lost for good at `now`.
    pub fn events_lost(&mut self, id: EndpointId, now: f64) {
        if let Some(e) = self.endpoints.get_mut(id.0 as usize) {
            e.trust.lost(now);
        }
    }

    /// The layout `id`'s router keys are made with (what a snapshot of its blocks carries).
    pub fn key_layout(&self, id: EndpointId) -> Option<KeyLayout> {
        self.endpoint(id).map(|e| KeyLayout {
            key_scheme: ROUTER_KEY_SCHEME,
            block_size: e.spec.block_size,
            offload_block_size: e.spec.offload.block_size,
        })
    }

    /// Restores what a peer replica's index held for `id` (a warm start), as one step: the
    /// snapshot's [`KeyLayout`] is checked against the endpoint's own, and one keyed otherwise
    /// is refused with nothing changed ([`CoreError::KeyLayoutMismatch`]); else the
    /// endpoint's index entries become exactly the snapshot's blocks, its offloaded tiers are
    /// marked uncertain where the peer's were, and the restore counts as its events arriving
    /// at `now` (trusted), or as events lost where the peer did not trust them. Returns the
    /// blocks restored, `None` when `id` is not present (or has no index).
    pub fn restore_endpoint(
        &mut self,
        id: EndpointId,
        restore: EndpointRestore<impl IntoIterator<Item = HeldEntry>>,
        now: f64,
    ) -> Result<Option<usize>, CoreError> {
        let present = self.endpoint(id).is_some_and(EndpointState::present);
        let Some(ours) = self.key_layout(id).filter(|_| present) else {
            return Ok(None);
        };
        ours.check(&restore.layout)?;
        let Some(index) = self.index_of(id).cloned() else {
            return Ok(None);
        };
        let restored = index.write_endpoint(id, |ix| {
            let restored = ix.restore(id, restore.blocks);
            if restore.tier_uncertain {
                ix.mark_tier_uncertain(id);
            }
            if let Some(group) = restore.tracked_group {
                ix.set_tracked_group(id, group);
            }
            restored
        });
        self.cache_dropped();
        // The snapshot stands for the events it reflects: the endpoint has published.
        self.events_arrived(id, now);
        if !restore.trusted {
            self.events_lost(id, now);
        }
        Ok(Some(restored))
    }

    /// Forgets everything known of what `id` holds: its index entries, the history and
    /// predictions of requests sent there, and sessions that went there. The one operation for
    /// an engine restart, a health ejection and a pod that left.
    pub fn forget_endpoint(&mut self, id: EndpointId, now: f64) {
        if let Some(index) = self.index_of(id) {
            index.clear_endpoint(id);
        }
        self.cache_dropped();
        self.history.forget_endpoint(id);
        self.predicted.forget_endpoint(id);
        self.sessions.forget_endpoint(id);
        if let Some(e) = self.endpoints.get_mut(id.0 as usize) {
            e.trust.reset();
            e.reuse = Default::default();
            e.recent.clear();
            e.forgotten_at = Some(now);
        }
    }

    /// Drops expired history and predictions (call now and then).
    pub fn housekeeping(&mut self, now: f64) {
        for e in &mut self.endpoints {
            e.pinned.expire(now - pinned::PIN_MAX_AGE_S);
        }
        self.history.expire(now);
        self.predicted.expire(now);
        self.expire_peer_prefills(now);
    }
}

/// Adds an index for `block_size` to `indexes` unless one exists.
/// The index for `block_size`, made when no endpoint used that size yet.
fn ensure_index<'a>(
    indexes: &'a mut Vec<(usize, Arc<SharedIndex>)>,
    block_size: usize,
    config: &FleetConfig,
) -> Result<&'a Arc<SharedIndex>, CoreError> {
    let position = match indexes.iter().position(|(bs, _)| *bs == block_size) {
        Some(position) => position,
        None => {
            let index_config = IndexConfig {
                block_size,
                capacity: config.index_capacity,
            };
            let index = SharedIndex::sharded(index_config, config.index_shards)?;
            indexes.push((block_size, Arc::new(index)));
            indexes.len() - 1
        }
    };
    Ok(&indexes[position].1)
}

#[cfg(test)]
mod pruning_tests;
#[cfg(test)]
mod tests;
