//! Each endpoint's tiers as observed ([`TierRates`]): load rates learned from its requests'
//! times to first token and from the engine's per-tier counters, how often predicted tier hits
//! were found, and which of a request's predicted cached tokens the engine can report on each
//! tier ([`reportable_tiers`]).

use serde::Serialize;

use super::{FirstTokenFit, LoadTier, TierCosts, TierTokens};
use crate::load_counters::{LoadDelta, LoadWindow, MIN_SAMPLE_TOKENS, TierLoadCounters};

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

    /// Seconds loading `tier_tokens` takes at the current rates, tier by tier (what the cost
    /// charges for them, before any credit decision).
    pub fn load_seconds(&self, tier_tokens: TierTokens, configured: &TierCosts) -> [f64; 3] {
        LoadTier::ALL.map(|t| tier_tokens[t as usize] as f64 / self.rate(t, configured))
    }

    /// Learns from one request: `tier_tokens` were loaded from the tiers below the GPU in
    /// `seconds` (time to first token less its recompute at the prefill rate). The seconds are
    /// split among the tiers in proportion to what the current rates predict.
    pub fn observe(&mut self, tier_tokens: TierTokens, seconds: f64, configured: &TierCosts) {
        if !seconds.is_finite() || seconds <= 0.0 {
            return;
        }
        let predicted = self.load_seconds(tier_tokens, configured);
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

#[cfg(test)]
mod tests {
    use super::*;

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
