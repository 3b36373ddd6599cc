//! The `scheduler:` section: a named scheduling policy, optionally adjusted, and the profile it
//! makes.

use kvroute_core::fleet::FleetConfig;
use kvroute_core::schedule::{
    BalanceTolerance, CostWeights, Filters, Picker, Profile, ProfileName, Saturation, TierCosts,
};
use serde::{Deserialize, Serialize};

/// Scheduling settings: a named policy, optionally adjusted.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SchedulerConfig {
    /// `precise` (default), `approximate`, `least-load`, `prefix-hash`, `round-robin` or
    /// `random`.
    #[serde(default = "default_policy")]
    pub policy: ProfileName,
    /// The cost model's weights (prefix against load), replacing the defaults.
    #[serde(default)]
    pub weights: Option<CostWeights>,
    /// Load rates of the slower cache tiers.
    #[serde(default)]
    pub tiers: Option<TierCosts>,
    /// When costs count as equal, so new sessions spread evenly.
    #[serde(default)]
    pub balance: Option<BalanceTolerance>,
    /// Hard limits.
    #[serde(default)]
    pub filters: Filters,
    /// When an endpoint counts as saturated (flow control).
    #[serde(default)]
    pub saturation: Option<Saturation>,
    /// Picker replacing the policy's.
    #[serde(default)]
    pub picker: Option<Picker>,
    /// Seconds each queued request adds to a new request's wait.
    #[serde(default)]
    pub queue_wait_s: Option<f64>,
    /// Seconds taken off the cost of a session's previous endpoint.
    #[serde(default)]
    pub session_affinity_s: Option<f64>,
    /// Prefill speed assumed for every endpoint until observed, tokens per second.
    #[serde(default = "default_prefill_rate")]
    pub prefill_tokens_per_s: f64,
    /// Most prompt tokens the engines prefill in one step: their `--max-num-batched-tokens`. A
    /// request waiting for room in a full cache is admitted a chunk at a time, so the whole
    /// chunks that fit before the room is made are prefilled while it waits.
    #[serde(default = "default_prefill_chunk_tokens")]
    pub prefill_chunk_tokens: usize,
    /// Header whose value names a session.
    #[serde(default = "default_session_header")]
    pub session_header: String,
    /// Header whose integer value is a request's priority in the flow-control queue (higher
    /// leaves first; default 0).
    #[serde(default = "default_priority_header")]
    pub priority_header: String,
}

fn default_policy() -> ProfileName {
    ProfileName::Precise
}

fn default_prefill_rate() -> f64 {
    20_000.0
}

fn default_prefill_chunk_tokens() -> usize {
    FleetConfig::default().prefill_chunk_tokens
}

fn default_session_header() -> String {
    "x-session-id".into()
}

fn default_priority_header() -> String {
    "x-kvroute-priority".into()
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            policy: default_policy(),
            weights: None,
            tiers: None,
            balance: None,
            filters: Filters::default(),
            saturation: None,
            picker: None,
            queue_wait_s: None,
            session_affinity_s: None,
            prefill_tokens_per_s: default_prefill_rate(),
            prefill_chunk_tokens: default_prefill_chunk_tokens(),
            session_header: default_session_header(),
            priority_header: default_priority_header(),
        }
    }
}

impl SchedulerConfig {
    /// The effective scheduling profile.
    pub fn profile(&self) -> Profile {
        let mut profile = Profile::named(self.policy);
        if let Some(w) = &self.weights {
            profile.weights = w.clone();
        }
        if let Some(t) = &self.tiers {
            profile.tiers = t.clone();
        }
        if let Some(b) = &self.balance {
            profile.balance = b.clone();
        }
        if let Some(s) = &self.saturation {
            profile.saturation = s.clone();
        }
        if let Some(p) = &self.picker {
            profile.picker = p.clone();
        }
        if let Some(w) = self.queue_wait_s {
            profile.queue_wait_s = w;
        }
        if let Some(a) = self.session_affinity_s {
            profile.session_affinity_s = a;
        }
        profile.filters = self.filters.clone();
        profile
    }
}
