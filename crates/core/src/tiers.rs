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

use serde::{Deserialize, Serialize};

use crate::load_counters::{LoadDelta, LoadWindow, MIN_SAMPLE_TOKENS, TierLoadCounters};

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

/// One endpoint's tiers as observed: learned load rates (tokens per second per tier; `None`
/// until measured) and how often predicted tier hits were found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct TierRates {
    /// Per tier (indexed by [`LoadTier`]): the learned rate alone, as its samples say;
    /// [`TierRates::rate`] weighs it against the configured one for costing.
    pub learned: [Option<f64>; 3],
    /// Samples behind each rate.
    pub samples: [u32; 3],
    /// Tokens predicted on each tier, over every request whose engine reported its cached
    /// tokens: with `found_tokens`, the prediction's accuracy by tier (a metric).
    pub predicted_tokens: [u64; 3],
    /// Of `predicted_tokens`, those the engine's `cached_tokens` confirmed (attributed to the
    /// tiers as the engine's per-tier metrics say, else in proportion, when only some were
    /// found).
    pub found_tokens: [u64; 3],
    /// Tokens the engine itself says it loaded from each tier (its per-tier `/metrics`
    /// counters, summed over scrapes; every request it served, not only this router's).
    pub engine_loaded_tokens: [u64; 3],
    /// Of the tier tokens predicted between two scrapes, the fraction the engine's per-tier
    /// counters say it loaded (a moving average; `None` until measured): how a request that
    /// found only part of its predicted tier tokens is split among its tiers.
    pub engine_found_fraction: [Option<f64>; 3],
    /// Time to first token of the endpoint's uncontended requests that loaded nothing, against
    /// their uncached tokens: what a tiered request would have taken without its loads.
    pub baseline: FirstTokenFit,
    /// Requests dispatched on a tier prediction whose events were recently inconsistent
    /// (orphans): estimates, never taught as load rates.
    pub uncertain_requests: u64,
    /// Shared-tier tokens already queued on the filesystem the endpoint mounts: the loads the
    /// router dispatched there and that are not read yet (the fleet's shared backlog). Not
    /// learned: set on each plan's copy, so a shared load is charged the tokens ahead of it on
    /// the filesystem's aggregate bandwidth.
    pub queued_shared_tokens: f64,
    /// The engine's per-tier counters at the last scrape (`None`: not reported).
    engine_counters: [Option<f64>; 3],
    /// Its per-tier load-time counters at the last scrape (`None`: not reported).
    engine_load_seconds: [Option<f64>; 3],
    /// When it was last scraped.
    scraped_at: Option<f64>,
    /// Its own tiers' loads (CPU memory, storage) over the current window of scrapes.
    #[serde(skip)]
    load_windows: [LoadWindow; 2],
    /// `predicted_tokens` at the last scrape.
    predicted_at_scrape: [u64; 3],
}

/// Time to first token as a line over uncached prompt tokens, `fixed + per_token × tokens`,
/// fitted (least squares, exponentially weighted) to an endpoint's uncontended requests that
/// loaded nothing. The fixed part is what every request pays whatever its size (a step's fixed
/// cost, the decodes batched with it); a request that loads from a tier pays it too, so a
/// tier's load time is its time to first token less this line, not less its tokens at the
/// average prefill rate (which spreads the fixed part over typical prompt sizes and would
/// leave most of it to a request with few uncached tokens, pricing the tier far too slow).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct FirstTokenFit {
    weight: f64,
    sum_tokens: f64,
    sum_seconds: f64,
    sum_tokens_sq: f64,
    sum_tokens_seconds: f64,
    /// Samples taken so far (what places a sample for [`FirstTokenFit::correct`]).
    #[serde(skip)]
    samples: u64,
}

/// A sample [`FirstTokenFit::observe`] took, kept with its request until the engine says how
/// many tokens it computed ([`FirstTokenFit::correct`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FitSample {
    /// The fit's samples taken before it.
    index: u64,
    /// The uncached tokens it assumed, and the seconds to the first token.
    tokens: f64,
    seconds: f64,
}

/// Weight of a new sample in [`FirstTokenFit`] (an exponential forgetting factor of 0.95: the
/// fit follows the endpoint's load over the last few dozen samples).
const FIT_FORGET: f64 = 0.95;
/// Samples before the fit is used.
const FIT_MIN_WEIGHT: f64 = 4.0;

impl FirstTokenFit {
    /// One uncontended request with `tokens` uncached tokens and nothing loaded, first token
    /// after `seconds`. Returns the sample taken, for [`FirstTokenFit::correct`].
    pub fn observe(&mut self, tokens: f64, seconds: f64) -> Option<FitSample> {
        if !tokens.is_finite() || !seconds.is_finite() || tokens < 0.0 || seconds <= 0.0 {
            return None;
        }
        self.weight = self.weight * FIT_FORGET + 1.0;
        self.sum_tokens = self.sum_tokens * FIT_FORGET + tokens;
        self.sum_seconds = self.sum_seconds * FIT_FORGET + seconds;
        self.sum_tokens_sq = self.sum_tokens_sq * FIT_FORGET + tokens * tokens;
        self.sum_tokens_seconds = self.sum_tokens_seconds * FIT_FORGET + tokens * seconds;
        let index = self.samples;
        self.samples += 1;
        Some(FitSample {
            index,
            tokens,
            seconds,
        })
    }

    /// The request that gave `sample` computed `computed` tokens by the engine's count (the
    /// router predicted `sample`'s): the sample is replaced by the right one. Each sum holds
    /// every sample times the forgetting factor to the power of the samples since, so the
    /// replacement is exact whatever came between.
    pub fn correct(&mut self, sample: FitSample, computed: f64) {
        if !computed.is_finite() || computed < 0.0 || computed == sample.tokens {
            return;
        }
        let since = self.samples.saturating_sub(sample.index + 1);
        let kept = FIT_FORGET.powi(since.min(10_000) as i32);
        let (old, new) = (sample.tokens, computed);
        self.sum_tokens += kept * (new - old);
        self.sum_tokens_sq += kept * (new * new - old * old);
        self.sum_tokens_seconds += kept * sample.seconds * (new - old);
    }

    /// `(fixed seconds, seconds per token)`, once the samples span enough sizes to tell them
    /// apart (a spread of at least 10% of the mean size) and the line is physical (a positive
    /// slope, a fixed part not below 0).
    pub fn line(&self) -> Option<(f64, f64)> {
        if self.weight < FIT_MIN_WEIGHT {
            return None;
        }
        let mean_tokens = self.sum_tokens / self.weight;
        let mean_seconds = self.sum_seconds / self.weight;
        let variance = self.sum_tokens_sq / self.weight - mean_tokens * mean_tokens;
        if variance <= (0.1 * mean_tokens).powi(2) {
            return None;
        }
        let covariance = self.sum_tokens_seconds / self.weight - mean_tokens * mean_seconds;
        let per_token = covariance / variance;
        if !per_token.is_finite() || per_token <= 0.0 {
            return None;
        }
        let fixed = (mean_seconds - per_token * mean_tokens).max(0.0);
        Some((fixed, per_token))
    }
}

/// Samples of its own that a tier's configured rate counts as, against its learned one: its
/// first sample weighs as much as the configured rate, its ninth nine tenths (as the prefill
/// rate weighs its first samples against the fleet's, `fleet::endpoint`).
const TIER_RATE_PRIOR_SAMPLES: f64 = 1.0;

/// Weight of a new sample in a learned rate (an exponential moving average).
const LEARNING_RATE: f64 = 0.2;

impl TierRates {
    /// These rates, with `tokens` queued on the shared tier's bandwidth (a plan's view).
    pub fn with_queued_shared(self, tokens: f64) -> Self {
        Self {
            queued_shared_tokens: tokens,
            ..self
        }
    }

    /// The rate used for `tier`: the learned one weighed against the configured one by its
    /// credibility, `n / (n + TIER_RATE_PRIOR_SAMPLES)` for its `n` samples, as seconds per
    /// token (the configured rate alone until one is learned). One load is not yet a tier's
    /// rate: a first read from a cold page cache or a drive's first access can be many times
    /// slower than the rest, and taken outright it prices the tier slower than recomputing,
    /// so it gets no credit and fewer requests go where it would teach the rate again.
    pub fn rate(&self, tier: LoadTier, configured: &TierCosts) -> f64 {
        let prior = configured.tokens_per_s(tier).max(1.0);
        let Some(learned) = self.learned[tier as usize] else {
            return prior;
        };
        let samples = f64::from(self.samples[tier as usize]);
        let credibility = samples / (samples + TIER_RATE_PRIOR_SAMPLES);
        (1.0 / (credibility / learned.max(1.0) + (1.0 - credibility) / prior)).max(1.0)
    }

    /// Learns from one request: `tier_tokens` were loaded from the tiers below the GPU in
    /// `seconds` (time to first token less its recompute at the prefill rate). The seconds are
    /// split among the tiers in proportion to what the current rates predict.
    pub fn observe(&mut self, tier_tokens: TierTokens, seconds: f64, configured: &TierCosts) {
        if !seconds.is_finite() || seconds <= 0.0 {
            return;
        }
        let predicted: Vec<f64> = LoadTier::ALL
            .iter()
            .map(|&t| tier_tokens[t as usize] as f64 / self.rate(t, configured))
            .collect();
        let total: f64 = predicted.iter().sum();
        if total <= 0.0 {
            return;
        }
        for t in LoadTier::ALL {
            let tokens = tier_tokens[t as usize];
            if tokens < MIN_SAMPLE_TOKENS {
                continue;
            }
            let share = seconds * predicted[t as usize] / total;
            self.learn_seconds_per_token(t, share / tokens as f64);
        }
    }

    /// Blends one measure of `tier`'s load time per token into its learned rate. Averaged as
    /// seconds per token, not as a rate: one sample whose share of the time is nearly 0 would
    /// otherwise lift the rate by orders of magnitude (and take dozens of samples to come
    /// back), pricing the tier like the GPU meanwhile.
    pub(crate) fn learn_seconds_per_token(&mut self, tier: LoadTier, sample: f64) {
        if !sample.is_finite() || sample <= 0.0 {
            return;
        }
        let slot = &mut self.learned[tier as usize];
        let seconds_per_token = match *slot {
            None => sample,
            Some(old) => (1.0 - LEARNING_RATE) / old + LEARNING_RATE * sample,
        };
        *slot = Some(1.0 / seconds_per_token);
        self.samples[tier as usize] = self.samples[tier as usize].saturating_add(1);
    }
}

impl TierRates {
    /// Counts one request's tier prediction against what the engine reported: `tier_tokens`
    /// of its `predicted` cached tokens were below the GPU; it reported `reported`.
    pub fn note_outcome(&mut self, tier_tokens: TierTokens, predicted: usize, reported: usize) {
        let tier_total: usize = tier_tokens.iter().sum();
        if tier_total == 0 {
            return;
        }
        let gpu = predicted.saturating_sub(tier_total);
        let found = reported.saturating_sub(gpu).min(tier_total) as f64 / tier_total as f64;
        for (t, &tokens) in tier_tokens.iter().enumerate() {
            self.predicted_tokens[t] += tokens as u64;
            self.found_tokens[t] += (tokens as f64 * found).round() as u64;
        }
    }

    /// Learns from one request once the engine reported `reported` cached tokens: the router
    /// predicted `predicted` cached, `tier_tokens` of them below the GPU, and the request's
    /// time to first token less its predicted recompute was `seconds`. Predicted tier tokens the
    /// engine did not find were recomputed (at `prefill_rate`), not loaded: they are taken out
    /// of both the tokens and the seconds. Nothing is learned when none was loaded.
    pub fn observe_reported(
        &mut self,
        tier_tokens: TierTokens,
        seconds: f64,
        predicted: usize,
        reported: usize,
        prefill_rate: f64,
        configured: &TierCosts,
    ) {
        let tier_total: usize = tier_tokens.iter().sum();
        if tier_total == 0 {
            return;
        }
        let gpu = predicted.saturating_sub(tier_total);
        let loaded = reported.saturating_sub(gpu).min(tier_total);
        if loaded == 0 {
            return;
        }
        let recomputed = (tier_total - loaded) as f64;
        let seconds = seconds - recomputed / prefill_rate.max(1.0);
        let found = self.split_found(tier_tokens, loaded);
        self.observe(found, seconds, configured);
    }

    /// Splits `loaded` of the predicted `tier_tokens` among the tiers: as the engine's
    /// per-tier counters say each tier's predictions were found, else in proportion. Never
    /// more on a tier than was predicted there.
    fn split_found(&self, tier_tokens: TierTokens, loaded: usize) -> TierTokens {
        let tier_total: usize = tier_tokens.iter().sum();
        if loaded >= tier_total {
            return tier_tokens;
        }
        let weights: [f64; 3] = std::array::from_fn(|t| {
            tier_tokens[t] as f64 * self.engine_found_fraction[t].unwrap_or(1.0)
        });
        let total: f64 = weights.iter().sum();
        if total <= 0.0 {
            let scale = loaded as f64 / tier_total as f64;
            return tier_tokens.map(|t| (t as f64 * scale).round() as usize);
        }
        std::array::from_fn(|t| {
            ((loaded as f64 * weights[t] / total).round() as usize).min(tier_tokens[t])
        })
    }

    /// One scrape, at `now`, of the engine's per-tier counters of tokens loaded and of the
    /// seconds its loads took (cumulative; `None`: the engine does not report that tier). Adds
    /// what each tier loaded since the last scrape to `engine_loaded_tokens` and, where enough
    /// tier tokens were predicted meanwhile, learns the fraction the engine found. Where the
    /// engine reports its load time too, learns the rate of its own tiers (CPU memory, storage)
    /// from the two over windows of scrapes ([`crate::load_counters`]) and returns what the
    /// shared tier loaded and since when (the previous scrape), which is the whole filesystem's
    /// to learn from (`None`: nothing to tell). A counter that went backwards (a restart)
    /// starts over.
    pub fn observe_engine_loads(
        &mut self,
        counters: TierLoadCounters,
        now: f64,
    ) -> Option<(LoadDelta, f64)> {
        let mut shared = None;
        for t in LoadTier::ALL {
            let i = t as usize;
            let (Some(tokens), Some(seconds), Some(since)) = (
                counter_delta(counters.tokens[i], self.engine_counters[i]),
                counter_delta(counters.seconds[i], self.engine_load_seconds[i]),
                // The previous scrape's time: none at the first.
                self.scraped_at,
            ) else {
                continue;
            };
            let loaded = LoadDelta { tokens, seconds };
            match t {
                LoadTier::Shared => shared = Some((loaded, since)),
                own => {
                    if let Some(rate) = self.load_windows[i].add(loaded, since, now) {
                        self.learn_seconds_per_token(own, 1.0 / rate);
                    }
                }
            }
        }
        self.engine_load_seconds = counters.seconds.map(|c| c.filter(|v| v.is_finite()));
        self.scraped_at = Some(now);
        self.count_engine_loads(counters.tokens);
        shared
    }

    fn count_engine_loads(&mut self, counters: [Option<f64>; 3]) {
        for (t, (&counter, &last)) in counters.iter().zip(&self.engine_counters).enumerate() {
            let Some(loaded) = counter_delta(counter, last) else {
                continue;
            };
            let loaded = loaded.round() as u64;
            self.engine_loaded_tokens[t] = self.engine_loaded_tokens[t].saturating_add(loaded);
            let predicted = self.predicted_tokens[t].saturating_sub(self.predicted_at_scrape[t]);
            if predicted >= MIN_SAMPLE_TOKENS as u64 {
                let fraction = (loaded as f64 / predicted as f64).min(1.0);
                let slot = &mut self.engine_found_fraction[t];
                *slot = Some(match *slot {
                    None => fraction,
                    Some(old) => (1.0 - LEARNING_RATE) * old + LEARNING_RATE * fraction,
                });
            }
        }
        self.engine_counters = counters.map(|c| c.filter(|v| v.is_finite()));
        self.predicted_at_scrape = self.predicted_tokens;
    }
}

/// What a cumulative counter rose by between two scrapes: `None` where either scrape lacks it,
/// or it is not a number, or it went backwards (the engine restarted: counting starts over).
fn counter_delta(now: Option<f64>, before: Option<f64>) -> Option<f64> {
    match (now, before) {
        (Some(now), Some(before)) if now.is_finite() && now >= before => Some(now - before),
        _ => None,
    }
}

/// Of an endpoint's predicted cached tokens, those on each tier below the GPU: `gpu` tokens
/// on the GPU and `tiers` below it, cut to `reportable` in all (the engine recomputes the
/// last prompt token, so it never reports the whole prompt cached). What is cut comes off the
/// slowest tiers first: an engine frees a prefix's last blocks first, so its tail is what
/// sits lowest.
pub fn reportable_tiers(gpu: usize, tiers: TierTokens, reportable: usize) -> TierTokens {
    let mut room = reportable.saturating_sub(gpu);
    tiers.map(|tokens| {
        let kept = tokens.min(room);
        room -= kept;
        kept
    })
}

/// One tier's part of a candidate's cost.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct TierCharge {
    /// Prompt tokens found (only) on this tier.
    pub tokens: usize,
    /// The load rate used, tokens per second (learned or configured).
    pub tokens_per_s: f64,
    /// Tokens other loads have queued ahead on this tier's bandwidth (the shared tier: what
    /// the router already sent to the filesystem).
    pub queued_tokens: f64,
    /// Seconds charged (for a tier priced by load time: waiting for the queued tokens, then
    /// loading its own).
    pub seconds: f64,
    /// Seconds recomputing these tokens would take at the endpoint's prefill rate.
    pub recompute_s: f64,
    /// Loading is slower than recomputing: no credit (charged the load time).
    pub slower_than_recompute: bool,
    /// A configured weight decided the charge, not the load time.
    pub weighted: bool,
}

/// The tiers' part of a candidate's cost.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct TierLoad {
    /// Per tier below the GPU (indexed by [`LoadTier`]).
    pub tiers: [TierCharge; 3],
    /// Seconds charged in all.
    pub seconds: f64,
}

impl TierLoad {
    /// Tokens loaded from the tiers below the GPU and charged their load time; a tier credited
    /// as the GPU (as a tier-blind profile credits every tier) loads none.
    pub fn charged_tokens(&self) -> usize {
        self.tiers
            .iter()
            .filter(|t| t.seconds > 0.0)
            .map(|t| t.tokens)
            .sum()
    }
}

/// What loading `tokens` from each tier costs on an endpoint that prefills at `prefill_rate`
/// tokens/s, with learned `rates` over the configured `costs`. A shared-tier load waits for
/// the tokens queued ahead of it on the filesystem (`rates.queued_shared_tokens`) at the
/// tier's rate, as a P/D transfer waits for its NIC's backlog: a load that would wait longer
/// than recomputing takes is slower than recomputing, and gets no credit.
pub fn tier_load(
    costs: &TierCosts,
    rates: &TierRates,
    tokens: TierTokens,
    prefill_rate: f64,
) -> TierLoad {
    let prefill_rate = prefill_rate.max(1.0);
    let mut load = TierLoad::default();
    for t in LoadTier::ALL {
        let n = tokens[t as usize];
        if n == 0 {
            continue;
        }
        let rate = rates.rate(t, costs);
        let queued = match t {
            LoadTier::Shared => rates.queued_shared_tokens.max(0.0),
            LoadTier::Cpu | LoadTier::Storage => 0.0,
        };
        let load_s = (n as f64 + queued) / rate;
        let recompute_s = n as f64 / prefill_rate;
        let charge = match costs.weight(t) {
            Some(w) => TierCharge {
                seconds: (1.0 - w.clamp(0.0, 1.0)) * recompute_s,
                weighted: true,
                ..TierCharge::default()
            },
            None => TierCharge {
                seconds: load_s,
                slower_than_recompute: load_s > recompute_s,
                ..TierCharge::default()
            },
        };
        load.tiers[t as usize] = TierCharge {
            tokens: n,
            tokens_per_s: rate,
            queued_tokens: queued,
            recompute_s,
            ..charge
        };
        load.seconds += load.tiers[t as usize].seconds;
    }
    load
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tier_slower_than_recompute_gets_no_credit() {
        let costs = TierCosts::default();
        let rates = TierRates::default();
        // Storage at 40k tokens/s against a 100k tokens/s prefill: loading is slower.
        let load = tier_load(&costs, &rates, [0, 40_000, 0], 100_000.0);
        let storage = load.tiers[LoadTier::Storage as usize];
        assert!(storage.slower_than_recompute);
        assert!(storage.seconds > storage.recompute_s, "{storage:?}");
        // Against a 10k tokens/s prefill the same tier is credited.
        let load = tier_load(&costs, &rates, [0, 40_000, 0], 10_000.0);
        let storage = load.tiers[LoadTier::Storage as usize];
        assert!(!storage.slower_than_recompute);
        assert!(storage.seconds < storage.recompute_s);
    }

    #[test]
    fn a_shared_load_waits_for_the_loads_queued_ahead_on_the_filesystem() {
        let costs = TierCosts::default();
        let mut rates = TierRates::default();
        // 2,500 shared tokens at 25k tokens/s: 0.1 s alone, credited against a 10k tokens/s
        // recompute (0.25 s).
        let alone = tier_load(&costs, &rates, [0, 0, 2_500], 10_000.0);
        let shared = alone.tiers[LoadTier::Shared as usize];
        assert!((shared.seconds - 0.1).abs() < 1e-9, "{shared:?}");
        assert!(!shared.slower_than_recompute);
        // 5,000 tokens already queued on the filesystem: 0.3 s, longer than recomputing.
        rates.queued_shared_tokens = 5_000.0;
        let queued = tier_load(&costs, &rates, [0, 0, 2_500], 10_000.0);
        let shared = queued.tiers[LoadTier::Shared as usize];
        assert!((shared.seconds - 0.3).abs() < 1e-9, "{shared:?}");
        assert!(shared.slower_than_recompute, "{shared:?}");
        assert_eq!(shared.queued_tokens, 5_000.0);
        // Private tiers do not share the filesystem's bandwidth.
        let cpu = tier_load(&costs, &rates, [2_500, 0, 0], 10_000.0);
        assert_eq!(cpu.tiers[LoadTier::Cpu as usize].queued_tokens, 0.0);
    }

    #[test]
    fn weights_override_load_times() {
        let costs = TierCosts {
            cpu_weight: Some(1.0),
            storage_weight: Some(0.25),
            ..TierCosts::default()
        };
        let load = tier_load(&costs, &TierRates::default(), [1000, 1000, 1000], 10_000.0);
        assert_eq!(load.tiers[0].seconds, 0.0, "weight 1: tier-blind");
        assert!((load.tiers[1].seconds - 0.075).abs() < 1e-9);
        assert!(!load.tiers[2].weighted);
    }

    #[test]
    fn outcomes_count_predicted_and_found_tokens_by_tier() {
        let mut rates = TierRates::default();
        // 1,000 on the GPU and 2,000 predicted on CPU + 1,000 on storage; the engine found
        // half of the tier tokens.
        rates.note_outcome([2000, 1000, 0], 4000, 2500);
        assert_eq!(rates.predicted_tokens, [2000, 1000, 0]);
        assert_eq!(rates.found_tokens, [1000, 500, 0]);
        rates.note_outcome([0, 0, 0], 100, 0);
        assert_eq!(
            rates.predicted_tokens,
            [2000, 1000, 0],
            "no tier tokens: nothing counted"
        );
    }

    #[test]
    fn the_first_token_line_recovers_its_fixed_part_and_slope() {
        let mut fit = FirstTokenFit::default();
        for tokens in [300.0, 900.0, 1_500.0] {
            fit.observe(tokens, 0.03 + tokens * 32e-6);
        }
        assert_eq!(fit.line(), None, "too few samples");
        for i in 0..20 {
            let tokens = 200.0 + 100.0 * f64::from(i);
            fit.observe(tokens, 0.03 + tokens * 32e-6);
        }
        let (fixed, per_token) = fit.line().unwrap();
        assert!((fixed - 0.03).abs() < 1e-6, "{fixed}");
        assert!((per_token - 32e-6).abs() < 1e-9, "{per_token}");
        // One size only: the fixed part and the slope cannot be told apart.
        let mut same = FirstTokenFit::default();
        for _ in 0..20 {
            same.observe(500.0, 0.05);
        }
        assert_eq!(same.line(), None);
        same.observe(f64::NAN, 1.0);
        same.observe(10.0, -1.0);
        assert_eq!(same.line(), None, "bad samples are ignored");
    }

    #[test]
    fn a_line_sample_corrected_at_the_end_is_the_sample_taken_right() {
        // Thirty uncontended requests on the line 30 ms + 32 us/token; the sixth was predicted
        // to compute 1,500 tokens where the engine had 1,400 cached: it took 33.2 ms.
        let line = |tokens: f64| 0.03 + tokens * 32e-6;
        let (mut wrong, mut right) = (FirstTokenFit::default(), FirstTokenFit::default());
        let mut taken = None;
        for i in 0..30 {
            let tokens = 200.0 + 100.0 * f64::from(i);
            if i == 5 {
                taken = wrong.observe(1_500.0, line(100.0));
                right.observe(100.0, line(100.0));
            } else {
                wrong.observe(tokens, line(tokens));
                right.observe(tokens, line(tokens));
            }
        }
        let (fixed, per_token) = wrong.line().unwrap();
        assert!(
            (fixed - 0.03).abs() > 1e-4,
            "the wrong sample bends the line: {fixed}"
        );
        wrong.correct(taken.unwrap(), 100.0);
        let ((fixed, per_token_right), (f2, p2)) = (wrong.line().unwrap(), right.line().unwrap());
        assert!((fixed - f2).abs() < 1e-9, "{fixed} against {f2}");
        assert!(
            (per_token_right - p2).abs() < 1e-12,
            "{per_token_right} against {p2}"
        );
        assert!((fixed - 0.03).abs() < 1e-6 && (per_token_right - 32e-6).abs() < 1e-9);
        assert_ne!(per_token, per_token_right);
    }

    #[test]
    fn what_the_engine_cannot_report_comes_off_the_slowest_tiers() {
        assert_eq!(reportable_tiers(0, [512, 256, 256], 1024), [512, 256, 256]);
        assert_eq!(reportable_tiers(0, [512, 256, 256], 1008), [512, 256, 240]);
        assert_eq!(reportable_tiers(600, [512, 256, 0], 1008), [408, 0, 0]);
        assert_eq!(reportable_tiers(2000, [512, 0, 0], 1008), [0, 0, 0]);
    }

    #[test]
    fn a_partial_find_is_split_as_the_engines_tier_counters_say() {
        let costs = TierCosts::default();
        let truth = 60_000.0;
        let mut rates = TierRates::default();
        let tokens = |tokens| TierLoadCounters {
            tokens,
            seconds: [None; 3],
        };
        rates.observe_engine_loads(tokens([Some(0.0), Some(0.0), None]), 0.0);
        // Between two scrapes: 2,000 predicted on CPU and 2,000 on storage; the engine's
        // counters say all the CPU tokens loaded and none of the storage ones.
        rates.note_outcome([2000, 2000, 0], 4000, 2000);
        rates.observe_engine_loads(tokens([Some(2000.0), Some(0.0), None]), 1.0);
        assert_eq!(rates.engine_found_fraction[0], Some(1.0));
        assert_eq!(rates.engine_found_fraction[1], Some(0.0));
        // So a request that found half of its tier tokens found its CPU part: the storage
        // part was recomputed, and the CPU rate is learned from the whole CPU load.
        let prefill = 20_000.0;
        for _ in 0..30 {
            let seconds = 2000.0 / truth + 2000.0 / prefill;
            rates.observe_reported([2000, 2000, 0], seconds, 4000, 2000, prefill, &costs);
        }
        let cpu = rates.rate(LoadTier::Cpu, &costs);
        assert!((cpu - truth).abs() / truth < 0.05, "learned {cpu:.0}");
        assert_eq!(
            rates.samples[1], 0,
            "nothing learned of storage: none loaded"
        );
    }

    #[test]
    fn one_sample_with_almost_no_time_does_not_make_a_tier_as_fast_as_the_gpu() {
        let costs = TierCosts::default();
        let mut rates = TierRates::default();
        let truth = 60_000.0;
        for _ in 0..20 {
            rates.observe([4096, 0, 0], 4096.0 / truth, &costs);
        }
        // Time to first token barely above the recompute estimate: a 1 µs share.
        rates.observe([4096, 0, 0], 1e-6, &costs);
        let got = rates.rate(LoadTier::Cpu, &costs);
        assert!(got < 1.5 * truth, "learned {got:.0}, true {truth:.0}");
    }

    #[test]
    fn one_slow_first_load_does_not_take_a_tiers_credit() {
        // CPU memory really loads at 150k tokens/s (the configured rate), the GPU recomputes
        // at 20k; the first load met a cold moment and took ten times as long.
        let costs = TierCosts::default();
        let mut rates = TierRates::default();
        let truth = costs.tokens_per_s(LoadTier::Cpu);
        let prefill = 20_000.0;
        rates.observe([4096, 0, 0], 10.0 * 4096.0 / truth, &costs);
        let learned = rates.learned[0].unwrap();
        assert!(
            (learned - truth / 10.0).abs() < 1e-6,
            "the sample itself is kept: {learned}"
        );
        let costed = rates.rate(LoadTier::Cpu, &costs);
        assert!(costed > prefill, "still credited: {costed:.0}");
        // Later loads at the true rate take over.
        for _ in 0..40 {
            rates.observe([4096, 0, 0], 4096.0 / truth, &costs);
        }
        let costed = rates.rate(LoadTier::Cpu, &costs);
        assert!((costed - truth).abs() / truth < 0.01, "{costed:.0}");
    }

    #[test]
    fn learned_rates_converge_on_the_true_rates() {
        let costs = TierCosts::default();
        let mut rates = TierRates::default();
        // The engine really loads CPU at 60k tokens/s and storage at 8k (both unlike the
        // configured defaults); requests mix the tiers.
        let truth = [60_000.0, 8_000.0, 15_000.0];
        for i in 0..200 {
            let tokens = [
                1024 + (i % 7) * 512,
                if i % 3 == 0 { 0 } else { 256 + (i % 5) * 128 },
                if i % 4 == 0 { 512 } else { 0 },
            ];
            let seconds: f64 = (0..3).map(|t| tokens[t] as f64 / truth[t]).sum();
            rates.observe(tokens, seconds, &costs);
        }
        for t in LoadTier::ALL {
            let got = rates.rate(t, &costs);
            let want = truth[t as usize];
            assert!(
                (got - want).abs() / want < 0.05,
                "{}: learned {got:.0}, true {want:.0}",
                t.as_str()
            );
        }
    }
}
