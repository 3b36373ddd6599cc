//! What a candidate's hits on the tiers below the GPU cost, in seconds ([`tier_load`]): each
//! tier's load time (after the loads queued ahead of it) against recomputing its tokens, or a
//! configured weight.

use serde::Serialize;

use super::{LoadTier, TierCosts, TierRates, TierTokens};

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
}
