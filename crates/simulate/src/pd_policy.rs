//! P/D on top of a scheduling profile: the decode endpoint is the profile's best
//! decode-capable pick; then either always disaggregate onto the best prefill-capable endpoint
//! (`pd-always`, what Dynamo and vLLM's proxy do), or price aggregated against every prefill
//! candidate with kvroute-core's decision (`pd-cost`), learning each pair's bandwidth from the
//! transfers the engines report.

use std::cell::RefCell;
use std::collections::HashMap;

use kvroute_core::index::EndpointId;
use kvroute_core::schedule::disagg::{
    self, DisaggChoice, LinkBook, LinkLearning, LinkPrior, PdRequest, SideCost,
};
use kvroute_core::schedule::{Decision, Role};
use kvroute_vllm::nixl::KvRole;

use crate::config::FleetConfig;
use crate::policy::Routing;

/// How a P/D policy decides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PdMode {
    /// Every request with a prefill endpoint available is disaggregated.
    Always,
    /// Per request, the cheaper in predicted seconds.
    Cost,
}

/// The P/D part of a policy.
pub struct PdRouting {
    mode: PdMode,
    roles: Vec<KvRole>,
    links: LinkBook,
    kv_bytes_per_token: f64,
    leg_overhead_s: f64,
    block_size: usize,
    /// KV bytes of dispatched, unfinished transfers on each endpoint's NIC.
    backlog: Vec<f64>,
    /// Each such transfer: its (prefill, decode) endpoints, its bytes, and the bytes queued
    /// ahead of it on the busier NIC when it was sent.
    inflight: HashMap<u64, ((usize, usize), f64, f64)>,
    /// Prefill seconds sent to each endpoint recently (the decode leg's queue inflow).
    inflow: RefCell<Inflow>,
}

/// Prefill seconds sent to each endpoint, decayed exponentially over [`INFLOW_WINDOW_S`]: their
/// rate is the seconds of queued work reaching it per second.
struct Inflow {
    /// Per endpoint: decayed seconds of work, and when last decayed.
    work: Vec<(f64, f64)>,
}

/// The time constant of the inflow estimate, seconds: a measurement window spanning several
/// prefills and load scrapes, not a decision threshold (the decision prices what it measures).
const INFLOW_WINDOW_S: f64 = 5.0;

impl Inflow {
    fn decayed(&self, endpoint: usize, now: f64) -> f64 {
        self.work.get(endpoint).map_or(0.0, |(w, at)| {
            w * (-(now - at).max(0.0) / INFLOW_WINDOW_S).exp()
        })
    }

    /// Seconds of work per second reaching `endpoint`.
    fn rate(&self, endpoint: usize, now: f64) -> f64 {
        self.decayed(endpoint, now) / INFLOW_WINDOW_S
    }

    fn record(&mut self, endpoint: usize, seconds: f64, now: f64) {
        let w = self.decayed(endpoint, now) + seconds.max(0.0);
        if let Some(slot) = self.work.get_mut(endpoint) {
            *slot = (w, now);
        }
    }
}

/// The scheduler's role for a KV role.
pub fn role(kv: KvRole) -> Role {
    match kv {
        KvRole::Producer => Role::Prefill,
        KvRole::Consumer => Role::Decode,
        KvRole::Both => Role::Both,
    }
}

impl PdRouting {
    /// `mode` on `fleet` (`None` when the fleet has no P/D roles).
    pub fn new(mode: PdMode, fleet: &FleetConfig) -> Option<Self> {
        let pd = fleet.pd.as_ref()?;
        Some(Self {
            mode,
            roles: pd.roles.clone(),
            links: LinkBook::new(
                LinkPrior {
                    bandwidth_bytes_per_s: pd.link.bandwidth_bytes_per_s,
                    latency_s: pd.link.latency_s,
                },
                LinkLearning::default(),
            ),
            kv_bytes_per_token: pd.kv_bytes_per_token as f64,
            // The second leg: the producer's sampling step, and one more round trip.
            leg_overhead_s: fleet.engine.latency.step_overhead_s
                + fleet.request_latency_s
                + fleet.response_latency_s,
            block_size: fleet.engine.block_size,
            backlog: vec![0.0; fleet.engines],
            inflight: HashMap::new(),
            inflow: RefCell::new(Inflow {
                work: vec![(0.0, 0.0); fleet.engines],
            }),
        })
    }

    /// Where a request goes, given the profile's decision over every endpoint.
    pub fn choose(&self, decision: &Decision, prompt_tokens: usize, now: f64) -> Option<Routing> {
        let side = |e: EndpointId| {
            decision.assessment(e).map(|a| SideCost {
                endpoint: e,
                cost: a.cost.clone(),
                cached_tokens: a.cached_tokens,
                link_backlog_bytes: self.backlog.get(e.0 as usize).copied().unwrap_or(0.0),
                queue_inflow: self.inflow.borrow().rate(e.0 as usize, now),
            })
        };
        let kv = |e: EndpointId| {
            self.roles
                .get(e.0 as usize)
                .copied()
                .unwrap_or(KvRole::Both)
        };
        let decode = *decision.ranking.iter().find(|e| kv(**e).consumes())?;
        let prefills: Vec<SideCost> = decision
            .ranking
            .iter()
            .filter(|e| **e != decode && kv(**e).produces())
            .filter_map(|e| side(*e))
            .collect();
        let aggregated = Routing::Endpoint(decode.0 as usize);
        let disaggregated = |prefill: EndpointId| Routing::Disaggregated {
            prefill: prefill.0 as usize,
            decode: decode.0 as usize,
        };
        let routing = match self.mode {
            PdMode::Always => prefills
                .first()
                .map_or(aggregated, |p| disaggregated(p.endpoint)),
            PdMode::Cost => {
                let request = PdRequest {
                    prompt_tokens,
                    block_size: self.block_size,
                    kv_bytes_per_token: self.kv_bytes_per_token,
                    leg_overhead_s: self.leg_overhead_s,
                };
                let explain = disagg::decide(request, &side(decode)?, &prefills, &self.links, now);
                match explain.choice {
                    DisaggChoice::Aggregated => aggregated,
                    DisaggChoice::Disaggregated { prefill } => disaggregated(prefill),
                }
            }
        };
        // The prefill lands on the endpoint that computes it: its queue's inflow.
        let computes = match routing {
            Routing::Disaggregated { prefill, .. } => prefill,
            _ => decode.0 as usize,
        };
        if let Some(a) = decision.assessment(EndpointId(computes as u32)) {
            self.inflow
                .borrow_mut()
                .record(computes, a.cost.prefill_s + a.cost.tier_load_s, now);
        }
        Some(routing)
    }

    /// Request `request_id` was disaggregated over `link` (prefill, decode): the blocks of its
    /// `prompt_tokens` the decode endpoint lacks (it holds `decode_cached`) will queue on both
    /// NICs until the transfer ends.
    pub fn dispatched(
        &mut self,
        request_id: u64,
        link: (usize, usize),
        prompt_tokens: usize,
        decode_cached: usize,
    ) {
        let bs = self.block_size.max(1);
        let tokens = (prompt_tokens / bs).saturating_sub(decode_cached / bs) * bs;
        let bytes = tokens as f64 * self.kv_bytes_per_token;
        let ahead = [link.0, link.1]
            .iter()
            .filter_map(|e| self.backlog.get(*e))
            .fold(0.0f64, |a, b| a.max(*b));
        for e in [link.0, link.1] {
            if let Some(b) = self.backlog.get_mut(e) {
                *b += bytes;
            }
        }
        self.inflight.insert(request_id, (link, bytes, ahead));
    }

    /// The request's transfer is over (or it ended without one): its bytes leave the NICs.
    /// Returns the bytes that were queued ahead of it.
    pub fn finished(&mut self, request_id: u64) -> f64 {
        let Some((link, bytes, ahead)) = self.inflight.remove(&request_id) else {
            return 0.0;
        };
        for e in [link.0, link.1] {
            if let Some(b) = self.backlog.get_mut(e) {
                *b = (*b - bytes).max(0.0);
            }
        }
        ahead
    }

    /// Request `request_id`'s transfer over `link` ended: learned, and off the NICs.
    pub fn transferred(
        &mut self,
        request_id: u64,
        link: (usize, usize),
        bytes: u64,
        seconds: f64,
        now: f64,
    ) {
        // The link is learned from this transfer's share of the time: the bytes queued ahead
        // of it on a shared NIC are contention (priced as backlog), not a slow link.
        let ahead = self.finished(request_id);
        let share = bytes as f64 / (bytes as f64 + ahead).max(1.0);
        let (prefill, decode) = link;
        self.links.observe_transfer(
            EndpointId(prefill as u32),
            EndpointId(decode as u32),
            bytes as f64,
            seconds * share,
            now,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_inflow_is_the_recent_work_per_second_and_fades() {
        let mut inflow = Inflow {
            work: vec![(0.0, 0.0); 2],
        };
        assert_eq!(inflow.rate(0, 0.0), 0.0);
        // One window's worth of work in one window: it arrives as fast as it drains.
        for i in 0..50 {
            inflow.record(0, 0.1, f64::from(i) * 0.1);
        }
        let rate = inflow.rate(0, 5.0);
        assert!((0.5..1.0).contains(&rate), "{rate}");
        // Nothing more arrives: it fades, and other endpoints never saw any.
        assert!(inflow.rate(0, 30.0) < 0.01);
        assert_eq!(inflow.rate(1, 5.0), 0.0);
        // Out of range endpoints are ignored.
        inflow.record(7, 1.0, 1.0);
        assert_eq!(inflow.rate(7, 1.0), 0.0);
    }
}
