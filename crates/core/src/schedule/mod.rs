//! Choosing an endpoint: filters, then a cost in seconds per candidate, then a picker.
//!
//! The scheduler is a pure function of the request's features, each candidate endpoint's
//! state (health, load, what it has cached) and a random number. Each candidate's cost is what
//! the engine will spend on this request, in seconds ([`cost`]): waiting behind queued work,
//! prefilling what it does not hold, loading what it holds on slower tiers, the stall the
//! prefill imposes on its running decodes, and the re-prefill others will pay for the cached
//! blocks the placement evicts. The cheapest wins; among near-equal costs (that give
//! up no cached block) the endpoint with the fewest recent placements wins, so new sessions
//! spread evenly without ever outweighing a real cache advantage. The answer ranks every
//! competing candidate best first with the breakdown that `/kvroute/v1/explain` shows, so a
//! retry can take the next one and an operator can see why.

pub mod amortize;
pub mod cost;
pub mod disagg;
mod load_order;
mod near_best;
mod picker;
mod profile;
mod pruned;
pub mod recency;
mod ring;
mod role_heads;

use serde::{Deserialize, Serialize};

use crate::index::{EndpointId, PrefixMatch};
pub use amortize::CopyRent;
pub use cost::Cost;
pub use load_order::LoadOrder;
pub use near_best::{RankBuffers, schedule_near_best};
pub use picker::Picker;
#[cfg(test)]
pub(crate) use picker::tie_key;
pub use profile::{
    BalanceTolerance, CacheSource, CostWeights, Filters, Profile, ProfileName, Saturation,
    TierCosts,
};
pub use pruned::{PruneBuffers, PruneScope, schedule_pruned};
pub use recency::{RecencyPart, RecencyParts};
pub use role_heads::decoders_saturated;

/// What an endpoint is for (prefill/decode disaggregation).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Serves whole requests.
    #[default]
    Both,
    /// Prefill only.
    Prefill,
    /// Decode only.
    Decode,
}

impl Role {
    /// Whether an endpoint of this role can run a decode leg (or a whole request).
    pub fn decodes(self) -> bool {
        matches!(self, Role::Decode | Role::Both)
    }

    /// Whether an endpoint of this role can run a prefill leg.
    pub fn prefills(self) -> bool {
        matches!(self, Role::Prefill | Role::Both)
    }

    /// Whether an endpoint of this role can serve a request that wants `wanted`.
    pub fn serves(self, wanted: Role) -> bool {
        wanted == Role::Both || self == Role::Both || self == wanted
    }
}

/// Load signals of one endpoint. Scraped values are `None` until scraped (or when stale).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct EndpointLoad {
    /// `vllm:num_requests_waiting` at the last scrape.
    pub waiting: Option<f64>,
    /// `vllm:num_requests_running` at the last scrape.
    pub running: Option<f64>,
    /// `vllm:kv_cache_usage_perc` (0–1) at the last scrape.
    pub kv_usage: Option<f64>,
    /// Requests the router has in flight to it (fresher than any scrape).
    pub inflight: u32,
    /// Of those, requests still waiting for their first token.
    pub inflight_prefills: u32,
    /// Uncached prompt tokens of in-flight requests still waiting for their first token.
    pub inflight_prefill_tokens: u64,
    /// Uncached prompt tokens per request recently sent there (`None` until one was): the size
    /// of a scraped waiting request the router did not send itself.
    pub recent_uncached_tokens: Option<f64>,
    /// Requests the router recently placed there for reasons other than its cache (a
    /// time-decayed count): what balancing evens out among near-equal costs.
    pub recent_placements: f64,
    /// Seconds this request would wait there for room in the cache: until enough of the
    /// router's in-flight requests there have ended for its blocks to fit beside the ones they
    /// pin (0 when they fit, or nothing says how long a request runs there).
    pub room_wait_s: f64,
    /// The share of this request's blocks that fit, in whole prefill chunks, in the blocks free
    /// before the last end `room_wait_s` waits for: vLLM admits a prompt chunk by chunk as room
    /// is made, so that share of its prefill runs during the wait (0 where it waits for
    /// nothing, or not one chunk fits before).
    pub room_prefilled_share: f64,
    /// Requests per second that come here and would not fit in its cache beside this one: the
    /// rate of its recent requests times the share of them that would not (0 where its
    /// capacity is unknown, or they all would).
    pub not_fitting_per_s: f64,
    /// Seconds a request runs here from its first token to its end (its own learned figure,
    /// else the fleet's; 0 while neither is known).
    pub decode_s: f64,
}

impl EndpointLoad {
    /// Requests queued ahead of a new one: the larger of the scraped waiting queue and the
    /// router's own requests not yet past prefill (fresher, but blind to other routers).
    pub fn queue(&self) -> f64 {
        self.waiting
            .unwrap_or(0.0)
            .max(f64::from(self.inflight_prefills))
    }

    /// Requests decoding there: the larger of the scraped running count and the router's own
    /// requests past their first token.
    pub fn decoding(&self) -> f64 {
        let own = f64::from(self.inflight.saturating_sub(self.inflight_prefills));
        self.running.unwrap_or(0.0).max(own)
    }
}

/// Whether an endpoint's KV index may be used for this decision.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IndexState {
    /// Events flow and agree with what the engine reports.
    #[default]
    Trusted,
    /// Events are configured but the picture may be stale (silence, lost events, prediction
    /// error): the index is not used.
    Distrusted,
    /// No events are configured for the endpoint: the router's history stands in.
    NoEvents,
}

/// What the router knows an endpoint has cached of this request, in blocks, from each source.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct CacheView {
    /// From the engine's KV events, by tier (`None`: not even the first block).
    pub index: Option<PrefixMatch>,
    /// Whether `index` may be used.
    pub index_state: IndexState,
    /// From the router's own routing history.
    pub history: u32,
    /// From the short-lived overlay of requests just sent there, before their events arrive.
    pub predicted: u32,
    /// GPU blocks it can still fill without evicting a cached block (capacity less what its
    /// index holds and what its in-flight prefills are about to store); `None` when its
    /// capacity is unknown, and then no eviction is charged.
    pub free_blocks: Option<f64>,
    /// Blocks the router's in-flight requests there hold or will hold that `free_blocks` does
    /// not count: each one's last, partial prompt block and the output its requests generate on
    /// average (an engine reports a block only once it is full). How far the room a placement
    /// leaves may be from what `free_blocks` says.
    pub unseen_blocks: f64,
    /// Its GPU cache's capacity in blocks (`None` when unknown): with `free_blocks`, how much
    /// of what it caches the queue ahead of this request evicts before the request is admitted.
    pub capacity_blocks: Option<f64>,
    /// Expected reuses of a block its cache evicts, 0–1: recently, blocks its requests found
    /// cached per block they stored, shrunk toward the fleet's figure while it has stored less
    /// than a cache's worth (see [`cost`]).
    pub block_reuse: f64,
    /// The prompt's cached prefix there split by last use, so that the queue ahead evicts the
    /// blocks used longest ago first. `None` where it was not read: nothing can be lost there
    /// (the queue ahead fits in the free blocks and every recently used block in the cache), no
    /// cache picture is used, or the capacity is unknown; every cached block is then taken as
    /// equally likely to go (which loses nothing when the queue ahead fits).
    pub recency: Option<RecencyParts>,
    /// CPU-tier blocks it can still fill without pushing one out: the tier's capacity less what
    /// its index holds there and what its in-flight prefills will offload there; `None` while
    /// the capacity is unknown (the tier never evicted), and then what it holds there is taken
    /// to stay.
    pub cpu_free_blocks: Option<f64>,
    /// Its CPU tier's capacity in blocks as its events show it (`None`: unknown).
    pub cpu_capacity_blocks: Option<f64>,
    /// As `recency`, against its CPU tier's capacity. `None` where it was not read, or where
    /// nothing can be lost there: the queue ahead's offloads fit in the tier's free blocks, and
    /// the prompt's blocks with every recently used one fit in the tier.
    pub cpu_recency: Option<RecencyParts>,
    /// Its index holds blocks on its own storage: taken as a connector that demotes what its
    /// CPU tier drops there (or wrote it through, as vLLM's multi-tier offloading and LMCache
    /// do), so getting such a block back costs a storage load, not a prefill.
    pub offloads_to_storage: bool,
    /// Its index holds blocks it offloaded to CPU memory: a GPU block evicted there is stored
    /// on (or already in) that tier, so getting it back costs a CPU load, not a prefill.
    pub offloads_to_cpu: bool,
    /// Its offloaded-tier events were recently inconsistent (orphans): what `index` says of
    /// tiers below the GPU is not certain.
    pub tier_uncertain: bool,
}

/// One endpoint as the scheduler sees it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Candidate {
    /// The endpoint.
    pub endpoint: EndpointId,
    /// Passing health checks.
    pub healthy: bool,
    /// Ejected by passive outlier detection (its requests failed).
    pub ejected: bool,
    /// Holds as many requests as its circuit breaker allows.
    pub circuit_open: bool,
    /// Serves the requested model or adapter.
    pub serves_model: bool,
    /// Its role.
    pub role: Role,
    /// Its load.
    pub load: EndpointLoad,
    /// What it has cached of this request.
    pub cache: CacheView,
    /// Prompt tokens per second it prefills (observed, or configured).
    pub prefill_tokens_per_s: f64,
    /// Its tiers' load rates as learned (configured ones stand in until then).
    pub tier_rates: crate::tiers::TierRates,
    /// Share of its cache's capacity holding blocks (0–1; 0 when unknown).
    pub cache_fill: f64,
}

/// The request's features that scheduling uses.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RequestInfo {
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// The endpoint this request's session used last, if any.
    pub session_endpoint: Option<EndpointId>,
    /// The role wanted.
    pub role: Role,
    /// A hash of the prompt's leading tokens, for the `prefix-hash` picker (`None`: not
    /// tokenized, or a picker that reads none).
    pub prefix_key: Option<u64>,
    /// The longest parts of the prompt endpoints hold on their GPUs: what a candidate that
    /// loads the prompt from a lower tier would copy into its GPU a second time.
    pub gpu_copies: cost::GpuCopies,
}

/// Why a candidate was filtered out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Rejection {
    /// Failing health checks.
    Unhealthy,
    /// Ejected for a while because its requests failed (outlier detection).
    Ejected,
    /// As many requests in flight as its circuit breaker allows.
    CircuitOpen,
    /// Does not serve the model.
    WrongModel,
    /// Wrong role.
    WrongRole,
    /// Waiting queue above the limit.
    QueueFull,
    /// KV cache usage above the limit.
    KvCacheFull,
}

/// The breakdown of one candidate.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Assessment {
    /// The endpoint.
    pub endpoint: EndpointId,
    /// Why it was filtered out; `None` if it competed.
    pub rejected: Option<Rejection>,
    /// Prompt tokens it holds on any tier, by the source the profile uses.
    pub cached_tokens: usize,
    /// Of those, tokens on the GPU.
    pub gpu_tokens: usize,
    /// Its prediction counts blocks on tiers below the GPU whose events were inconsistent:
    /// an estimate, not a certain one.
    pub tier_uncertain: bool,
    /// The cost, term by term, in seconds.
    pub cost: Cost,
    /// Predicted time to first token, seconds (queue wait + prefill + tier loading).
    pub predicted_ttft_s: f64,
    /// Whether the endpoint is saturated (flow control).
    pub saturated: bool,
    /// Its recent placements (what balancing compares).
    pub recent_placements: f64,
    /// Requests it is serving: the router's in flight, or the scraped running and waiting
    /// ones, whichever is more (what the `prefix-hash` picker bounds).
    pub requests: f64,
    /// Share of its cache holding blocks (0–1; 0 when unknown).
    pub cache_fill: f64,
}

/// Why the chosen endpoint won.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// It was cheaper mostly because it holds more of the prompt.
    Cache,
    /// It was cheaper mostly because it is less loaded.
    Load,
    /// The session affinity credit decided.
    Session,
    /// Costs were near-equal and it had the fewest recent placements.
    Balance,
    /// Costs and placements were equal: chosen at random among them.
    Tie,
    /// The round-robin picker.
    RoundRobin,
    /// The random picker.
    Random,
    /// The softmax picker's draw.
    Softmax,
    /// The prefix's home on the hash ring, or the next one within the load bound.
    PrefixHash,
    /// No other candidate competed.
    OnlyCandidate,
    /// No candidate passed the filters.
    NoCandidate,
    /// The rent the shared prefix's holders kept paying bought a copy here
    /// ([`amortize`]).
    CopyRent,
}

impl Reason {
    /// The label used in logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Cache => "cache",
            Reason::Load => "load",
            Reason::Session => "session",
            Reason::Balance => "balance",
            Reason::Tie => "tie",
            Reason::RoundRobin => "round_robin",
            Reason::Random => "random",
            Reason::Softmax => "softmax",
            Reason::PrefixHash => "prefix_hash",
            Reason::OnlyCandidate => "only_candidate",
            Reason::NoCandidate => "no_candidate",
            Reason::CopyRent => "copy_rent",
        }
    }
}

/// The scheduler's answer.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Decision {
    /// Candidates that competed, best first (the first is the choice; the rest are fallbacks):
    /// every one from [`schedule`], the best few from [`schedule_near_best`].
    pub ranking: Vec<EndpointId>,
    /// The candidates' breakdowns, in input order: every candidate's from [`schedule`], the
    /// ranked ones' from [`schedule_near_best`].
    pub assessments: Vec<Assessment>,
    /// Why the first was chosen.
    pub reason: Reason,
    /// Every competing candidate is saturated, or none competes but some were left out only
    /// for their load (an open circuit breaker, a filter's queue or KV-cache limit): flow
    /// control may hold the request. Under P/D a fleet's plan reads only its decode-capable
    /// competitors, where the request decodes (`Fleet::plan`).
    pub saturated: bool,
    /// The rent kept for the request's shared prefix, and the copy it bought, if any
    /// ([`amortize`]); `None` where the fleet keeps no rent for it.
    pub copy: Option<CopyRent>,
}

impl Decision {
    /// The chosen endpoint, if any candidate passed the filters.
    pub fn chosen(&self) -> Option<EndpointId> {
        self.ranking.first().copied()
    }

    /// The breakdown of `endpoint`.
    pub fn assessment(&self, endpoint: EndpointId) -> Option<&Assessment> {
        self.assessments.iter().find(|a| a.endpoint == endpoint)
    }
}

/// Each assessed endpoint's predicted time to first token, kept with a request from its plan
/// to its dispatch, where it becomes the fleet dispatch's `predicted_ttft_s` on whichever
/// endpoint the request goes to (the first, or a retry's).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PredictedTtfts(Vec<(EndpointId, f64)>);

impl PredictedTtfts {
    /// The predictions of `decision`.
    pub fn of(decision: &Decision) -> Self {
        Self(
            decision
                .assessments
                .iter()
                .map(|a| (a.endpoint, a.predicted_ttft_s))
                .collect(),
        )
    }

    /// The prediction at `endpoint`, if the plan assessed it.
    pub fn at(&self, endpoint: EndpointId) -> Option<f64> {
        self.0.iter().find(|(e, _)| *e == endpoint).map(|&(_, s)| s)
    }
}

pub(crate) fn rejection(
    profile: &Profile,
    request: &RequestInfo,
    c: &Candidate,
) -> Option<Rejection> {
    if !c.healthy {
        return Some(Rejection::Unhealthy);
    }
    if c.ejected {
        return Some(Rejection::Ejected);
    }
    if !c.serves_model {
        return Some(Rejection::WrongModel);
    }
    if !c.role.serves(request.role) {
        return Some(Rejection::WrongRole);
    }
    if profile
        .filters
        .max_waiting
        .is_some_and(|max| c.load.queue() > max)
    {
        return Some(Rejection::QueueFull);
    }
    if profile
        .filters
        .max_kv_usage
        .is_some_and(|max| c.load.kv_usage.unwrap_or(0.0) > max)
    {
        return Some(Rejection::KvCacheFull);
    }
    if c.circuit_open {
        return Some(Rejection::CircuitOpen);
    }
    None
}

/// Whether an endpoint with `load` is saturated under `profile` (flow control holds a request
/// while every competitor is).
pub(crate) fn saturated(profile: &Profile, load: &EndpointLoad) -> bool {
    let s = &profile.saturation;
    load.queue() >= s.queue
        || (load.kv_usage.unwrap_or(0.0) >= s.kv_usage && load.waiting.unwrap_or(0.0) > 0.0)
}

/// One candidate's breakdown.
pub(crate) fn assess(profile: &Profile, request: &RequestInfo, c: &Candidate) -> Assessment {
    let (cost, cached) = cost::assess(profile, request, c);
    Assessment {
        endpoint: c.endpoint,
        rejected: rejection(profile, request, c),
        cached_tokens: cached.all,
        gpu_tokens: cached.gpu,
        tier_uncertain: c.cache.tier_uncertain && cached.all > cached.gpu,
        predicted_ttft_s: cost.predicted_ttft_s(),
        cost,
        saturated: saturated(profile, &c.load),
        recent_placements: c.load.recent_placements.max(0.0),
        requests: f64::from(c.load.inflight)
            .max(c.load.running.unwrap_or(0.0) + c.load.waiting.unwrap_or(0.0)),
        cache_fill: c.cache_fill,
    }
}

/// Ranks every one of `candidates` for `request` under `profile`. `random` is a uniformly random `u64`
/// (tie-breaking and sampling); `round_robin` a counter the caller increments.
pub fn schedule(
    profile: &Profile,
    request: &RequestInfo,
    candidates: &[Candidate],
    random: u64,
    round_robin: u64,
) -> Decision {
    let assessments: Vec<Assessment> = candidates
        .iter()
        .map(|c| assess(profile, request, c))
        .collect();
    let competing: Vec<usize> = (0..assessments.len())
        .filter(|&i| assessments[i].rejected.is_none())
        .collect();
    // Every competing candidate saturated, or none left but for those too busy for now (open
    // circuit breakers, a waiting queue or KV cache over its filter's limit): flow control may
    // hold the request until one frees up.
    let saturated = if competing.is_empty() {
        assessments.iter().any(|a| {
            matches!(
                a.rejected,
                Some(Rejection::CircuitOpen | Rejection::QueueFull | Rejection::KvCacheFull)
            )
        })
    } else {
        competing.iter().all(|&i| assessments[i].saturated)
    };
    let (ranking, reason) = profile.picker.rank(
        profile,
        request.prefix_key,
        &assessments,
        &competing,
        random,
        round_robin,
    );
    Decision {
        ranking: ranking.iter().map(|&i| assessments[i].endpoint).collect(),
        assessments,
        reason,
        saturated,
        copy: None,
    }
}

#[cfg(test)]
mod tests;
