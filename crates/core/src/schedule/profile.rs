//! Scheduling profiles: which filters, scorer weights and picker to use. The named policies
//! (`round-robin`, `random`, `least-load`, `approximate`, `precise`) are configurations of the
//! same pipeline, so they can be compared on equal terms.

use serde::{Deserialize, Serialize};

use super::picker::Picker;

/// Credit per cached block by tier, relative to recomputing it (GPU 1.0).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TierWeights {
    /// A GPU hit.
    pub gpu: f64,
    /// A CPU-tier hit (costs a transfer).
    pub cpu: f64,
    /// A storage-tier hit (costs a slower transfer).
    pub storage: f64,
}

impl Default for TierWeights {
    fn default() -> Self {
        Self {
            gpu: 1.0,
            cpu: 0.8,
            storage: 0.5,
        }
    }
}

/// Weights of the scorers; 0 turns a scorer off.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScorerWeights {
    /// Share of the prompt cached, from the engines' KV events (and the predicted overlay).
    pub precise_prefix: f64,
    /// Share of the prompt the router itself sent there recently.
    pub approximate_prefix: f64,
    /// Headroom: short queue, free KV cache, few in-flight requests.
    pub load: f64,
    /// Predicted time to first token relative to the best candidate's.
    pub cost: f64,
    /// Stickiness to the session's previous endpoint.
    pub session: f64,
    /// Evenness: fewer recent requests than the others. Breaks the near-ties of requests that
    /// no endpoint holds much of (new conversations), so sessions spread evenly.
    pub balance: f64,
}

impl Default for ScorerWeights {
    fn default() -> Self {
        Profile::named(ProfileName::Precise).weights
    }
}

/// Hard limits that take a candidate out of the running.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Filters {
    /// Skip endpoints with more waiting requests than this.
    pub max_waiting: Option<f64>,
    /// Skip endpoints whose KV cache usage (0–1) is above this.
    pub max_kv_usage: Option<f64>,
}

/// The named policies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ProfileName {
    /// Each endpoint in turn.
    RoundRobin,
    /// A uniformly random endpoint.
    Random,
    /// The least loaded endpoint.
    LeastLoad,
    /// The router's own routing history plus load (no engine events needed).
    Approximate,
    /// The engines' KV events plus load and predicted TTFT (the default).
    Precise,
}

impl std::str::FromStr for ProfileName {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "round-robin" => Ok(Self::RoundRobin),
            "random" => Ok(Self::Random),
            "least-load" => Ok(Self::LeastLoad),
            "approximate" => Ok(Self::Approximate),
            "precise" => Ok(Self::Precise),
            other => Err(format!(
                "unknown policy {other:?}: expected round-robin, random, least-load, approximate or precise"
            )),
        }
    }
}

/// A complete scheduling configuration.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    /// Scorer weights.
    #[serde(default)]
    pub weights: ScorerWeights,
    /// Tier credits for the precise prefix scorer.
    #[serde(default)]
    pub tiers: TierWeights,
    /// Hard limits.
    #[serde(default)]
    pub filters: Filters,
    /// How the winner is picked.
    #[serde(default)]
    pub picker: Picker,
    /// Waiting-queue length at which the load scorer reaches 0.
    #[serde(default = "default_queue_norm")]
    pub queue_norm: f64,
    /// Seconds each queued request adds to a new request's predicted TTFT (the cost scorer):
    /// a request waiting for a batch slot waits behind others' decoding, which prefill
    /// tokens alone do not show.
    #[serde(default = "default_queue_wait")]
    pub queue_wait_s: f64,
}

fn default_queue_norm() -> f64 {
    8.0
}

fn default_queue_wait() -> f64 {
    0.02
}

impl Profile {
    /// The profile behind a named policy.
    pub fn named(name: ProfileName) -> Profile {
        let zero = ScorerWeights {
            precise_prefix: 0.0,
            approximate_prefix: 0.0,
            load: 0.0,
            cost: 0.0,
            session: 0.0,
            balance: 0.0,
        };
        let (weights, picker) = match name {
            ProfileName::RoundRobin => (zero, Picker::RoundRobin),
            ProfileName::Random => (zero, Picker::Max),
            ProfileName::LeastLoad => (ScorerWeights { load: 1.0, ..zero }, Picker::Max),
            ProfileName::Approximate => (
                ScorerWeights {
                    approximate_prefix: 1.0,
                    load: 1.0,
                    cost: 1.0,
                    balance: 4.0,
                    ..zero
                },
                Picker::Max,
            ),
            ProfileName::Precise => (
                ScorerWeights {
                    precise_prefix: 1.0,
                    load: 1.0,
                    cost: 1.0,
                    balance: 4.0,
                    ..zero
                },
                Picker::Max,
            ),
        };
        Profile {
            weights,
            tiers: TierWeights::default(),
            filters: Filters::default(),
            picker,
            queue_norm: default_queue_norm(),
            queue_wait_s: default_queue_wait(),
        }
    }
}

impl Default for Profile {
    fn default() -> Self {
        Profile::named(ProfileName::Precise)
    }
}
