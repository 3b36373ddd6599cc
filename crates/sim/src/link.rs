//! The KV link between prefill and decode engines: how many bytes a prompt's KV cache is, how
//! fast a link moves them, and how concurrent transfers share it. Pure (time is a parameter),
//! so the live simulator and an offline simulation run the same model.
//!
//! The presets (bytes per token of a model shape, the links' bandwidths and latencies) are
//! core's ([`kvroute_core::schedule::disagg::presets`]), where their sources are documented.
//!
//! Sharing: each engine has one NIC. A transfer moves at the link's bandwidth divided by the
//! number of transfers on the busier of its two NICs (the producer's and the consumer's), so
//! two pulls into one decode engine each get half, and a degraded pair (`slowdown`) only slows
//! its own transfers.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::SimError;

/// KV-cache bytes per token of a model preset (`llama-3.1-8b`, `llama-3.1-70b`), or a number
/// (core's presets, which the router's configuration names too).
pub fn kv_bytes_per_token(preset: &str) -> Result<u64, SimError> {
    kvroute_core::schedule::disagg::kv_bytes_per_token(preset)
        .map_err(|e| SimError::Config(e.to_string()))
}

/// One link's speed.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct LinkSpec {
    /// Bytes per second one transfer gets alone.
    pub bandwidth_bytes_per_s: f64,
    /// Seconds before the first byte moves.
    pub latency_s: f64,
}

impl LinkSpec {
    /// A preset (`tcp`, `roce-100`, `ib-400`) or `custom:<GB/s>[:<latency ms>]` (core's
    /// presets, which the router's configuration names too).
    pub fn parse(spec: &str) -> Result<Self, SimError> {
        let prior = kvroute_core::schedule::disagg::LinkPrior::parse(spec)
            .map_err(|e| SimError::Config(e.to_string()))?;
        Ok(LinkSpec {
            bandwidth_bytes_per_s: prior.bandwidth_bytes_per_s,
            latency_s: prior.latency_s,
        })
    }

    /// Seconds to move `bytes` alone on the link.
    pub fn transfer_seconds(&self, bytes: u64) -> f64 {
        self.latency_s + bytes as f64 / self.bandwidth_bytes_per_s
    }
}

/// Identifies a transfer on a [`Fabric`].
pub type TransferId = u64;

#[derive(Debug)]
struct Transfer {
    src: String,
    dst: String,
    remaining_bytes: f64,
    /// When the latency phase ends and bytes start to move.
    moving_at: f64,
    slowdown: f64,
}

/// Transfers in progress on a fleet's links, advanced in (engine) seconds.
#[derive(Debug)]
pub struct Fabric {
    spec: LinkSpec,
    now: f64,
    next_id: TransferId,
    transfers: BTreeMap<TransferId, Transfer>,
    /// Finished while starting another, not yet returned by [`Fabric::advance`].
    finished: Vec<TransferId>,
}

/// A transfer finishes when no more than this many bytes remain (floating-point slack).
const DONE_BYTES: f64 = 0.5;

impl Fabric {
    /// An idle fabric whose links are all `spec`.
    pub fn new(spec: LinkSpec) -> Self {
        Self {
            spec,
            now: 0.0,
            next_id: 0,
            transfers: BTreeMap::new(),
            finished: Vec::new(),
        }
    }

    /// The links' speed.
    pub fn spec(&self) -> LinkSpec {
        self.spec
    }

    /// Transfers in progress.
    pub fn active(&self) -> usize {
        self.transfers.len()
    }

    /// Starts moving `bytes` from NIC `src` to NIC `dst` at `now`; `slowdown` ≥ 1 degrades this transfer (a bad link between the pair).
    pub fn start(
        &mut self,
        now: f64,
        src: &str,
        dst: &str,
        bytes: u64,
        slowdown: f64,
    ) -> TransferId {
        self.progress(now);
        let id = self.next_id;
        self.next_id += 1;
        self.transfers.insert(
            id,
            Transfer {
                src: src.to_owned(),
                dst: dst.to_owned(),
                remaining_bytes: bytes as f64,
                moving_at: self.now + self.spec.latency_s * slowdown.max(1.0),
                slowdown: slowdown.max(1.0),
            },
        );
        id
    }

    /// Abandons a transfer (its producer died, its consumer went away).
    pub fn cancel(&mut self, id: TransferId) -> bool {
        self.transfers.remove(&id).is_some()
    }

    /// Bytes per second of each moving transfer now.
    fn rates(&self) -> BTreeMap<TransferId, f64> {
        let moving = || {
            self.transfers
                .iter()
                .filter(|(_, t)| t.moving_at <= self.now)
        };
        let mut per_nic: BTreeMap<&str, usize> = BTreeMap::new();
        for (_, t) in moving() {
            *per_nic.entry(&t.src).or_default() += 1;
            *per_nic.entry(&t.dst).or_default() += 1;
        }
        moving()
            .map(|(id, t)| {
                let sharers = per_nic[t.src.as_str()].max(per_nic[t.dst.as_str()]);
                (
                    *id,
                    self.spec.bandwidth_bytes_per_s / t.slowdown / sharers as f64,
                )
            })
            .collect()
    }

    /// When the next transfer finishes or starts moving, if any transfer is in progress.
    pub fn next_event(&self) -> Option<f64> {
        let rates = self.rates();
        self.transfers
            .iter()
            .map(|(id, t)| match rates.get(id) {
                Some(rate) => self.now + t.remaining_bytes.max(0.0) / rate,
                None => t.moving_at,
            })
            .min_by(f64::total_cmp)
    }

    /// Moves time forward to `now`; returns the transfers that finished since the last call,
    /// in order.
    pub fn advance(&mut self, now: f64) -> Vec<TransferId> {
        self.progress(now);
        std::mem::take(&mut self.finished)
    }

    fn progress(&mut self, now: f64) {
        // Rates change only when a transfer starts moving or finishes: step event to event
        // (at most two events per transfer).
        let mut steps = 2 * self.transfers.len() + 2;
        loop {
            let until = self.next_event().map_or(now, |e| e.min(now)).max(self.now);
            let dt = until - self.now;
            let rates = self.rates();
            for (id, rate) in &rates {
                if let Some(t) = self.transfers.get_mut(id) {
                    t.remaining_bytes -= rate * dt;
                }
            }
            self.now = until;
            // Done: (almost) no bytes left, or less than a nanosecond's worth (the clock's
            // floating-point resolution could not step over it).
            let finished: Vec<TransferId> = self
                .transfers
                .iter()
                .filter(|(id, t)| {
                    let slack = rates.get(id).map_or(0.0, |r| r * 1e-9).max(DONE_BYTES);
                    t.moving_at <= self.now && t.remaining_bytes <= slack
                })
                .map(|(id, _)| *id)
                .collect();
            for id in finished {
                self.transfers.remove(&id);
                self.finished.push(id);
            }
            steps = steps.saturating_sub(1);
            if self.now >= now || steps == 0 {
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_match_the_measured_figures() {
        assert_eq!(kv_bytes_per_token("llama-3.1-8b").unwrap(), 128 * 1024);
        assert_eq!(kv_bytes_per_token("llama-3.1-70b").unwrap(), 320 * 1024);
        assert_eq!(kv_bytes_per_token("4096").unwrap(), 4096);
        assert!(kv_bytes_per_token("gpt-5").is_err());
        // pd-tiers-anchors.md §2: an 8k-token 70B prompt takes ~4.8 s over UCX/TCP, ~217 ms over
        // RoCE-100 and ~54 ms over IB-400.
        let bytes = 8192 * kv_bytes_per_token("70b").unwrap();
        let secs = |l: &str| LinkSpec::parse(l).unwrap().transfer_seconds(bytes);
        assert!((secs("tcp") - 4.88).abs() < 0.05, "{}", secs("tcp"));
        assert!(
            (secs("roce-100") - 0.222).abs() < 0.01,
            "{}",
            secs("roce-100")
        );
        assert!((secs("ib-400") - 0.054).abs() < 0.005, "{}", secs("ib-400"));
        let custom = LinkSpec::parse("custom:2:3").unwrap();
        assert_eq!(custom.bandwidth_bytes_per_s, 2e9);
        assert!((custom.latency_s - 3e-3).abs() < 1e-12);
        for bad in [
            "custom:",
            "custom:0",
            "custom:1:x",
            "fast",
            "custom:1:2:3",
            "custom:1:inf",
            "custom:1:NaN",
        ] {
            assert!(LinkSpec::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn concurrent_transfers_into_one_nic_share_it() {
        let spec = LinkSpec {
            bandwidth_bytes_per_s: 1000.0,
            latency_s: 0.0,
        };
        let mut fabric = Fabric::new(spec);
        let a = fabric.start(0.0, "p0", "d0", 1000, 1.0);
        let b = fabric.start(0.0, "p1", "d0", 1000, 1.0);
        // Each gets half: both finish at 2 s, not 1 s.
        assert!(fabric.advance(1.5).is_empty());
        let done = fabric.advance(2.0 + 1e-9);
        assert_eq!(done, vec![a, b]);
        // Disjoint pairs do not share.
        let c = fabric.start(3.0, "p0", "d0", 1000, 1.0);
        let d = fabric.start(3.0, "p1", "d1", 1000, 1.0);
        assert_eq!(fabric.advance(4.0 + 1e-9), vec![c, d]);
    }

    #[test]
    fn a_finished_transfer_frees_its_share_and_slowdown_degrades_one_pair() {
        let spec = LinkSpec {
            bandwidth_bytes_per_s: 1000.0,
            latency_s: 0.1,
        };
        let mut fabric = Fabric::new(spec);
        let small = fabric.start(0.0, "p0", "d0", 500, 1.0);
        let big = fabric.start(0.0, "p1", "d0", 1500, 1.0);
        // 0.1 s latency, then 500 each at 500 B/s (1 s), then the rest of big alone at 1000 B/s.
        assert_eq!(fabric.next_event(), Some(0.1));
        assert_eq!(fabric.advance(1.1 + 1e-9), vec![small]);
        let end = fabric.next_event().unwrap();
        assert!((end - 2.1).abs() < 1e-3, "{end}");
        assert_eq!(fabric.advance(2.2), vec![big]);
        let slow = fabric.start(3.0, "p0", "d0", 1000, 4.0);
        let end = fabric.next_event().unwrap();
        assert!((end - 3.4).abs() < 1e-9, "latency is degraded too: {end}");
        assert!(fabric.advance(7.0).is_empty());
        assert_eq!(fabric.advance(7.5), vec![slow]);
        assert_eq!(fabric.active(), 0);
    }
}
