//! What a hit on a slower tier is worth, in seconds, and how fast each tier loads, learned.
//!
//! A block an endpoint holds in CPU memory, on its own storage or on a shared filesystem it
//! mounts saves recomputing it but costs loading it. The cost model charges each such tier
//! `tokens / load rate` and compares it with `tokens / prefill rate`:
//! - a tier that loads faster than the endpoint recomputes is credited the difference;
//! - a tier slower than recomputing gets **no credit**: it is charged its (longer) load time,
//!   since the engine loads whatever its connector finds, so an endpoint that recomputes wins,
//!   and the breakdown says so (`slower_than_recompute`);
//! - configured weights (llm-d's "CPU 0.8", Dynamo's "host 0.75 / disk 0.25") are an override
//!   only: weight `w` charges `(1 − w) ×` the recompute seconds; weight 1 on every tier is
//!   "tier-blind" routing (every tier credited as GPU).
//!
//! Load rates start from the configured [`TierCosts`] and are learned per endpoint and tier
//! from its requests: a request that found blocks on slower tiers and was the only prefill on
//! its endpoint measures them. Its time to first token, less its uncached tokens at the
//! endpoint's prefill rate, is the load time, shared among its tiers in proportion to what the
//! current rates predict; the engine's reported `cached_tokens` says how many of the predicted
//! tier tokens it really loaded (the rest were recomputed).

mod charge;
mod first_token_fit;
mod rates;

use serde::{Deserialize, Serialize};

pub use charge::{TierCharge, TierLoad, tier_load};
pub use first_token_fit::{FirstTokenFit, FitSample};
pub use rates::{TierRates, reportable_tiers};

/// How fast blocks on slower tiers load, compared with recomputing them (see
/// [`crate::tiers`]): the starting point of each endpoint's learned rates, and optional weights
/// that override the load-time model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TierCosts {
    /// Tokens per second loaded from the CPU tier (a PCIe transfer).
    pub cpu_tokens_per_s: f64,
    /// Tokens per second loaded from the endpoint's own storage (local SSD).
    pub storage_tokens_per_s: f64,
    /// Tokens per second loaded from a shared filesystem the endpoint mounts.
    pub shared_tokens_per_s: f64,
    /// Override: credit a CPU hit as this fraction of its recompute (1: as the GPU; llm-d uses
    /// 0.8). Unset: priced by load time.
    pub cpu_weight: Option<f64>,
    /// Override for the storage tier (Dynamo's disk: 0.25).
    pub storage_weight: Option<f64>,
    /// Override for the shared tier.
    pub shared_weight: Option<f64>,
    /// How the engines' connector loads tier blocks, which says whom a load makes wait.
    pub load_mode: TierLoadMode,
}

/// How an engine's offloading connector loads the blocks a request finds below the GPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TierLoadMode {
    /// Beside the batch (vLLM's OffloadingConnector: `load_kv_async`): the request waits for
    /// its blocks, running decodes do not. A load delays only its own request.
    #[default]
    Async,
    /// In the step that admits the request (LMCache's connector unless configured for
    /// asynchronous loading): every sequence in that step waits for the load too.
    InStep,
}

impl Default for TierCosts {
    fn default() -> Self {
        // About 128 KiB of KV per token for an 8B model: ~20 GB/s of PCIe moves ~150k tokens/s,
        // a fast local NVMe about a quarter of that, a shared filesystem's share per client
        // (a few GB/s) about a sixth.
        Self {
            cpu_tokens_per_s: 150_000.0,
            storage_tokens_per_s: 40_000.0,
            shared_tokens_per_s: 25_000.0,
            cpu_weight: None,
            storage_weight: None,
            shared_weight: None,
            load_mode: TierLoadMode::default(),
        }
    }
}

impl TierCosts {
    /// The configured load rate of `tier`, tokens per second.
    pub fn tokens_per_s(&self, tier: LoadTier) -> f64 {
        match tier {
            LoadTier::Cpu => self.cpu_tokens_per_s,
            LoadTier::Storage => self.storage_tokens_per_s,
            LoadTier::Shared => self.shared_tokens_per_s,
        }
    }

    /// The configured override weight of `tier`, if any.
    pub fn weight(&self, tier: LoadTier) -> Option<f64> {
        match tier {
            LoadTier::Cpu => self.cpu_weight,
            LoadTier::Storage => self.storage_weight,
            LoadTier::Shared => self.shared_weight,
        }
    }

    /// Tier-blind: every tier credited as the GPU (the baseline tier-aware routing is
    /// measured against).
    pub fn blind() -> Self {
        Self {
            cpu_weight: Some(1.0),
            storage_weight: Some(1.0),
            shared_weight: Some(1.0),
            ..Self::default()
        }
    }
}

/// The tiers below the GPU, in [`TierTokens`] order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LoadTier {
    /// Host memory.
    Cpu = 0,
    /// The endpoint's own storage (local SSD).
    Storage = 1,
    /// A shared filesystem or object store the endpoint mounts.
    Shared = 2,
}

impl LoadTier {
    /// Every tier below the GPU, fastest first.
    pub const ALL: [LoadTier; 3] = [LoadTier::Cpu, LoadTier::Storage, LoadTier::Shared];

    /// The name explanations and metrics use.
    pub fn as_str(self) -> &'static str {
        match self {
            LoadTier::Cpu => "cpu",
            LoadTier::Storage => "storage",
            LoadTier::Shared => "shared",
        }
    }
}

/// Prompt tokens per tier below the GPU (indexed by [`LoadTier`]).
pub type TierTokens = [usize; 3];
