//! Scheduling profiles: where the cache picture comes from, the cost model's parameters, the
//! filters and the picker. The named policies (`round-robin`, `random`, `least-load`,
//! `prefix-hash`, `approximate`, `precise`) are configurations of the same pipeline, so they
//! can be compared on equal terms.

use serde::{Deserialize, Serialize};

use super::picker::Picker;
pub use crate::tiers::TierCosts;

/// Which picture of what each endpoint holds the cost model uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CacheSource {
    /// The engines' KV events (the index), plus the overlay of requests just sent; an
    /// endpoint without events configured falls back to the router's history.
    #[default]
    Precise,
    /// The router's own routing history (no events needed).
    Approximate,
    /// Ignore caches: every prompt costs its full prefill everywhere (load decides).
    None,
}

/// The cost model's weights: the seed's "prefix weight against load weight", in seconds.
///
/// A candidate's cost is `prefix × (uncached prefill + lower-tier loading) + eviction ×
/// (re-prefill of what the placement evicts) + load × (queue wait + decode interference + room
/// blocking)`, every term in seconds. With every weight 1 the cost is the time the engine will
/// spend before this request's first token, plus the time it makes others lose (the decodes it
/// stalls, the requests that will wait for room beside it, the cached blocks it pushes out that
/// others would have reused); raising `prefix`
/// favours cache over load, raising `load` the reverse.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CostWeights {
    /// Weight of the seconds spent computing (or loading) what is not cached on the GPU.
    pub prefix: f64,
    /// Weight of the seconds spent waiting behind other work, and making others wait (stalled
    /// decodes, requests waiting for room in the cache).
    pub load: f64,
    /// Seconds of stall charged per request that waits for this one's prefill (each running
    /// decode, and as many requests as are queued there), per second of that prefill.
    pub decode_interference: f64,
    /// Weight of the expected seconds of re-prefill the placement causes by evicting cached
    /// blocks that others would have reused (see [`cost`](super::cost)).
    pub eviction: f64,
}

impl Default for CostWeights {
    fn default() -> Self {
        Self {
            prefix: 1.0,
            load: 1.0,
            decode_interference: 1.0,
            eviction: 1.0,
        }
    }
}

/// When costs count as equal, so that new sessions can be spread evenly.
///
/// Among the candidates whose cost is within [`BalanceTolerance::limit`] of the cheapest's, that
/// hold at least as much of the prompt as the cheapest, load no more of it from lower tiers and
/// evict no more cached blocks than it, the one with the fewest recent placements wins.
/// Balancing therefore never gives up a cached block, nor the GPU memory it is found in:
/// copying a prefix onto another endpoint happens only when the cost model says it pays (the
/// queue wait it saves exceeds its prefill plus what the copy evicts there).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BalanceTolerance {
    /// Fraction of what the cheapest would compute (absorbs noise in observed prefill rates).
    pub relative: f64,
    /// Seconds.
    pub absolute_s: f64,
}

impl BalanceTolerance {
    /// The highest cost that counts as equal to the cheapest's `total` seconds, of which
    /// `computed` are due to what it would compute ([`super::Cost::cache_part`]: its prefill,
    /// tier loads and evictions): `total + relative × computed + absolute_s`, the relative share
    /// taken of no more than `total`. The relative share absorbs the noise of the observed
    /// prefill rates in what the endpoints would compute. Load is not in it: queued work is what
    /// the router counts (its requests in flight, the engines' scraped queues), so a difference
    /// in load is never balanced away, and where load dominates the costs (a saturated fleet)
    /// the least-loaded endpoint wins.
    pub fn limit(&self, total: f64, computed: f64) -> f64 {
        total + self.relative * computed.min(total).max(0.0) + self.absolute_s
    }

    /// The most [`Self::limit`] can be for a cheapest that costs at most `total` seconds, whatever
    /// it computes: what pruning may stop at before the cheapest is known.
    pub fn limit_at_most(&self, total: f64) -> f64 {
        total + self.relative * total.max(0.0) + self.absolute_s
    }
}

impl Default for BalanceTolerance {
    fn default() -> Self {
        Self {
            relative: 0.1,
            absolute_s: 0.001,
        }
    }
}

/// Hard limits that take a candidate out of the running.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Filters {
    /// Skip endpoints with more queued requests than this.
    pub max_waiting: Option<f64>,
    /// Skip endpoints whose KV cache usage (0–1) is above this.
    pub max_kv_usage: Option<f64>,
}

/// When an endpoint counts as saturated, for flow control: the router holds a request rather
/// than bind it to an engine queue while every candidate is saturated.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Saturation {
    /// Requests queued at the engine (scraped `num_requests_waiting`, or the router's own
    /// requests not yet past prefill, whichever is larger) at which it is saturated.
    pub queue: f64,
    /// KV cache usage (0–1) at which it is saturated while requests wait there.
    pub kv_usage: f64,
}

impl Default for Saturation {
    fn default() -> Self {
        Self {
            queue: 4.0,
            kv_usage: 0.95,
        }
    }
}

/// The named policies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ProfileName {
    /// Each endpoint in turn.
    RoundRobin,
    /// A uniformly random endpoint.
    Random,
    /// The cheapest endpoint ignoring caches (queue and interference decide).
    LeastLoad,
    /// Consistent hashing with bounded loads over the prompt's first tokens (SGLang's
    /// `prefix_hash`): each prefix has a home endpoint, and overflows along the ring.
    PrefixHash,
    /// The cost model over the router's own routing history (no engine events needed).
    Approximate,
    /// The cost model over the engines' KV events (the default).
    Precise,
}

impl std::str::FromStr for ProfileName {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "round-robin" => Ok(Self::RoundRobin),
            "random" => Ok(Self::Random),
            "least-load" => Ok(Self::LeastLoad),
            "prefix-hash" => Ok(Self::PrefixHash),
            "approximate" => Ok(Self::Approximate),
            "precise" => Ok(Self::Precise),
            other => Err(format!(
                "unknown policy {other:?}: expected round-robin, random, least-load, prefix-hash, approximate or precise"
            )),
        }
    }
}

impl ProfileName {
    /// Every named policy, in the order reports list them.
    pub const ALL: [ProfileName; 6] = [
        ProfileName::RoundRobin,
        ProfileName::Random,
        ProfileName::LeastLoad,
        ProfileName::PrefixHash,
        ProfileName::Approximate,
        ProfileName::Precise,
    ];

    /// The name as configured and printed.
    pub fn as_str(self) -> &'static str {
        match self {
            ProfileName::RoundRobin => "round-robin",
            ProfileName::Random => "random",
            ProfileName::LeastLoad => "least-load",
            ProfileName::PrefixHash => "prefix-hash",
            ProfileName::Approximate => "approximate",
            ProfileName::Precise => "precise",
        }
    }
}

/// A complete scheduling configuration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Profile {
    /// Where the cache picture comes from.
    pub cache: CacheSource,
    /// How the winner is picked.
    pub picker: Picker,
    /// Prefix against load.
    pub weights: CostWeights,
    /// Loading from slower tiers.
    pub tiers: TierCosts,
    /// When costs count as equal (new sessions spread evenly among them).
    pub balance: BalanceTolerance,
    /// Seconds each queued request adds to a new request's wait, besides the queued prefill
    /// tokens: a request waiting for a batch slot also waits behind others' decoding.
    pub queue_wait_s: f64,
    /// Seconds taken off the cost of the endpoint a request's session used last (0: off).
    pub session_affinity_s: f64,
    /// Hard limits.
    pub filters: Filters,
    /// When endpoints count as saturated (flow control).
    pub saturation: Saturation,
}

impl Profile {
    /// The profile behind a named policy.
    pub fn named(name: ProfileName) -> Profile {
        let (cache, picker) = match name {
            ProfileName::RoundRobin => (CacheSource::None, Picker::RoundRobin),
            ProfileName::Random => (CacheSource::None, Picker::Random),
            ProfileName::LeastLoad => (CacheSource::None, Picker::Cheapest),
            ProfileName::PrefixHash => (CacheSource::None, Picker::prefix_hash()),
            ProfileName::Approximate => (CacheSource::Approximate, Picker::Cheapest),
            ProfileName::Precise => (CacheSource::Precise, Picker::Cheapest),
        };
        Profile {
            cache,
            picker,
            weights: CostWeights::default(),
            tiers: TierCosts::default(),
            balance: BalanceTolerance::default(),
            queue_wait_s: 0.02,
            session_affinity_s: 0.0,
            filters: Filters::default(),
            saturation: Saturation::default(),
        }
    }
}

impl Default for Profile {
    fn default() -> Self {
        Profile::named(ProfileName::Precise)
    }
}
