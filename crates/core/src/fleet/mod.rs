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
mod lifecycle;
mod lookup;
mod membership;
mod model_priors;
mod observe;
pub mod outlier;
mod peer_load;
mod pinned;
mod plan;
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

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::CoreError;
use crate::history::RoutingHistory;
use crate::index::{EndpointId, IndexConfig, PrefixMatch, SharedIndex};
use crate::keys::RouterKey;
use crate::schedule::{
    Candidate, Decision, EndpointLoad, IndexState, LoadOrder, Profile, PruneBuffers, RankBuffers,
    Role,
};
use crate::tiers::{FitSample, TierTokens};
pub use admit::{Admission, HeldTurn};
use copy_rent::CopyRents;
pub use disagg::{DecodeRetry, DisaggConfig, FailedDecodeLeg, TransfersDropped};
use endpoint::PrefillSample;
pub use endpoint::{
    EndpointSpec, EndpointState, HealthChange, HealthPolicy, LoadMark, LoadSample,
    PREFILL_RATE_SAMPLE_WEIGHT,
};
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
    /// Most prompt tokens an engine prefills in one step (vLLM's `max_num_batched_tokens`). A
    /// request waiting for room in a full cache is admitted a chunk at a time, each chunk once
    /// its blocks fit, so the whole chunks that fit before the room is made are prefilled while
    /// it waits.
    pub prefill_chunk_tokens: usize,
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
            // vLLM's default for an online server.
            prefill_chunk_tokens: 8192,
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
