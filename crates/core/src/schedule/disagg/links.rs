//! What the router has learned of each (prefill, decode) pair's KV link: its bandwidth, from
//! the transfers it saw, starting from the configured link; and its health, so that a pair whose
//! transfers keep failing or crawling (RDMA silently fallen back to TCP, a bad cable) is
//! quarantined, then re-probed.
//!
//! Learning: each transfer gives seconds per byte (its time less the link latency, over its
//! bytes); the estimate is an exponentially weighted mean of those, so a time prediction is
//! unbiased where a mean of bandwidths would not be. A transfer counts as *degraded* when it
//! took more than `degraded_factor` × what the configured link would take *and* more than
//! `noise_floor_s` seconds beyond it (on a fast link a few milliseconds' prediction is
//! dwarfed by the timing noise of whoever measures it: relative slowness alone would strike a
//! healthy pair); a failure or a degraded transfer is a strike, and `quarantine_after`
//! consecutive strikes quarantine the pair for `quarantine_s` (doubling on each relapse, up to
//! `max_quarantine_s`). When the
//! quarantine ends the pair is *probing*: its estimate restarts from the configured link, so
//! the next request that would gain from it tries it; a good transfer heals it, a strike sends
//! it straight back to quarantine.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use crate::index::EndpointId;

/// The configured link, before anything is learned.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LinkPrior {
    /// Bytes per second.
    pub bandwidth_bytes_per_s: f64,
    /// Seconds before the first byte moves.
    pub latency_s: f64,
}

/// How the link book learns and quarantines.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LinkLearning {
    /// Weight of a new transfer in the estimate (0–1).
    pub weight: f64,
    /// A transfer slower than this many times the configured link's time is a strike (if
    /// also slower than it by more than `noise_floor_s`).
    pub degraded_factor: f64,
    /// Seconds a transfer must take beyond the configured link's time to be a strike, whatever
    /// the factor: the timing noise of a measured transfer (the router times a pull from its
    /// decode leg's first token, which carries an engine step and a queue wait it can only
    /// predict). A slower transfer under it is still learned from (and priced); it only
    /// cannot quarantine the pair.
    pub noise_floor_s: f64,
    /// Consecutive strikes that quarantine a pair.
    pub quarantine_after: u32,
    /// First quarantine, seconds.
    pub quarantine_s: f64,
    /// Longest quarantine, seconds.
    pub max_quarantine_s: f64,
}

impl Default for LinkLearning {
    fn default() -> Self {
        Self {
            weight: 0.3,
            degraded_factor: 4.0,
            noise_floor_s: 0.25,
            quarantine_after: 3,
            quarantine_s: 30.0,
            max_quarantine_s: 600.0,
        }
    }
}

/// Where a pair's bandwidth estimate comes from.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum LinkHealth {
    /// Usable; `samples` transfers learned (0: the configured link).
    Healthy {
        /// Transfers the estimate is learned from.
        samples: u32,
    },
    /// Excluded until `until` (seconds, the caller's clock).
    Quarantined {
        /// When it will be probed.
        until: f64,
    },
    /// Usable again after a quarantine, at the configured link's speed, until a transfer tells.
    Probing,
}

/// One pair's link as a decision prices it: its health and the bandwidth to predict with.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LinkEstimate {
    /// Where the bandwidth comes from.
    pub health: LinkHealth,
    /// Bytes per second (the configured link's unless healthy and learned).
    pub bandwidth_bytes_per_s: f64,
    /// Seconds before the first byte moves (the configured link's).
    pub latency_s: f64,
}

impl LinkEstimate {
    /// Predicted seconds to move `bytes` (none: no time).
    pub fn transfer_s(&self, bytes: f64) -> f64 {
        if bytes <= 0.0 {
            return 0.0;
        }
        self.latency_s + bytes / self.bandwidth_bytes_per_s.max(1.0)
    }
}

#[derive(Clone, Debug)]
struct Pair {
    seconds_per_byte: f64,
    samples: u32,
    strikes: u32,
    /// Set from the first quarantine until a good transfer: before it, quarantined; after it,
    /// probing.
    quarantined_until: Option<f64>,
    next_quarantine_s: f64,
}

/// The learned links of a fleet, per (prefill, decode) pair.
#[derive(Clone, Debug)]
pub struct LinkBook {
    prior: LinkPrior,
    learning: LinkLearning,
    pairs: HashMap<(EndpointId, EndpointId), Pair>,
}

impl LinkBook {
    /// A book where every pair starts at `prior`.
    pub fn new(prior: LinkPrior, learning: LinkLearning) -> Self {
        Self {
            prior,
            learning,
            pairs: HashMap::new(),
        }
    }

    /// The configured link.
    pub fn prior(&self) -> LinkPrior {
        self.prior
    }

    fn prior_seconds_per_byte(&self) -> f64 {
        1.0 / self.prior.bandwidth_bytes_per_s.max(1.0)
    }

    fn pair(&mut self, p: EndpointId, d: EndpointId) -> &mut Pair {
        let fresh = Pair {
            seconds_per_byte: self.prior_seconds_per_byte(),
            samples: 0,
            strikes: 0,
            quarantined_until: None,
            next_quarantine_s: self.learning.quarantine_s,
        };
        self.pairs.entry((p, d)).or_insert(fresh)
    }

    /// The pair's health at `now`.
    pub fn health(&self, p: EndpointId, d: EndpointId, now: f64) -> LinkHealth {
        self.estimate(p, d, now).health
    }

    /// The pair's health and the bandwidth to predict with at `now`, from one look at the pair:
    /// what a decision reads once per option.
    pub fn estimate(&self, p: EndpointId, d: EndpointId, now: f64) -> LinkEstimate {
        let pair = self.pairs.get(&(p, d));
        let health = match pair {
            None => LinkHealth::Healthy { samples: 0 },
            Some(pair) => match pair.quarantined_until {
                Some(until) if now < until => LinkHealth::Quarantined { until },
                Some(_) => LinkHealth::Probing,
                None => LinkHealth::Healthy {
                    samples: pair.samples,
                },
            },
        };
        let bandwidth_bytes_per_s = match (health, pair) {
            (LinkHealth::Healthy { .. }, Some(pair)) => 1.0 / pair.seconds_per_byte.max(1e-15),
            _ => self.prior.bandwidth_bytes_per_s,
        };
        LinkEstimate {
            health,
            bandwidth_bytes_per_s,
            latency_s: self.prior.latency_s,
        }
    }

    /// The bandwidth to predict with, bytes per second (the configured one while probing).
    pub fn bandwidth(&self, p: EndpointId, d: EndpointId, now: f64) -> f64 {
        self.estimate(p, d, now).bandwidth_bytes_per_s
    }

    /// Predicted seconds to move `bytes` from `p` to `d`.
    pub fn transfer_s(&self, p: EndpointId, d: EndpointId, bytes: f64, now: f64) -> f64 {
        self.estimate(p, d, now).transfer_s(bytes)
    }

    /// A transfer of `bytes` from `p` to `d` that took `seconds` (an engine's transfer metrics,
    /// or the router's leg timings).
    pub fn observe_transfer(
        &mut self,
        p: EndpointId,
        d: EndpointId,
        bytes: f64,
        seconds: f64,
        now: f64,
    ) {
        if !(bytes > 0.0 && seconds.is_finite() && seconds >= 0.0) {
            return;
        }
        let learning = self.learning;
        let expected = self.prior.latency_s + bytes * self.prior_seconds_per_byte();
        let degraded = seconds > learning.degraded_factor * expected
            && seconds - expected > learning.noise_floor_s;
        let observed = (seconds - self.prior.latency_s).max(0.0) / bytes;
        let pair = self.pair(p, d);
        if pair.quarantined_until.is_some() {
            // A probe (or a transfer that was in flight when the pair was quarantined) restarts
            // learning from this transfer.
            pair.samples = 0;
        }
        // A transfer no longer than the link's latency says nothing of its bandwidth (and would
        // price every later transfer at the latency alone): it only counts as a good transfer.
        if observed > 0.0 {
            pair.seconds_per_byte = if pair.samples == 0 {
                observed
            } else {
                learning.weight * observed + (1.0 - learning.weight) * pair.seconds_per_byte
            };
            pair.samples = pair.samples.saturating_add(1);
        }
        if degraded {
            self.strike(p, d, now);
        } else {
            let pair = self.pair(p, d);
            pair.strikes = 0;
            pair.quarantined_until = None;
            pair.next_quarantine_s = learning.quarantine_s;
        }
    }

    /// A transfer from `p` to `d` that failed.
    pub fn observe_failure(&mut self, p: EndpointId, d: EndpointId, now: f64) {
        self.strike(p, d, now);
    }

    fn strike(&mut self, p: EndpointId, d: EndpointId, now: f64) {
        let learning = self.learning;
        let prior = self.prior_seconds_per_byte();
        let pair = self.pair(p, d);
        let relapse = match pair.quarantined_until {
            // Already quarantined: a transfer that was in flight adds nothing.
            Some(until) if now < until => return,
            Some(_) => true,
            None => false,
        };
        pair.strikes += 1;
        if relapse || pair.strikes >= learning.quarantine_after {
            pair.quarantined_until = Some(now + pair.next_quarantine_s);
            pair.next_quarantine_s = (pair.next_quarantine_s * 2.0).min(learning.max_quarantine_s);
            pair.strikes = 0;
            // When it is probed, it is probed at the configured speed.
            pair.seconds_per_byte = prior;
            pair.samples = 0;
        }
    }

    /// Forgets an endpoint's pairs (it left the fleet or restarted).
    pub fn forget(&mut self, endpoint: EndpointId) {
        self.pairs
            .retain(|(p, d), _| *p != endpoint && *d != endpoint);
    }
}
