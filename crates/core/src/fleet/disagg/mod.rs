//! Prefill/decode disaggregation at the fleet level: the one P/D call the live router and the
//! offline simulator both make, on the fleet's own state, with time passed in.
//!
//! [`Fleet::plan_disagg`] takes a plan and its decode pick, builds each side's
//! [`SideCost`] from what the fleet knows (the plan's cost of every endpoint, what each holds of
//! the prompt, the bytes of unfinished transfers on its NIC, the prefill work recently sent to
//! it), and asks [`disagg::decide`] with the fleet's [`LinkBook`]. The caller then reports
//! where the prefill was sent ([`Fleet::prefill_sent`]: the endpoint that computes it, whatever
//! was chosen) and the transfer's life: [`Fleet::transfer_started`] once both legs are sent,
//! [`Fleet::observe_transfer`] with its measured seconds, or [`Fleet::observe_failure`], and
//! [`Fleet::transfer_ended`] when its bytes have left the NICs.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

use super::{Fleet, Plan};
use crate::index::EndpointId;
use crate::schedule::Role;
use crate::schedule::disagg::{
    self, DisaggExplain, LinkBook, LinkLearning, LinkPrior, PdRequest, SideCost,
};

/// How the fleet prices and learns P/D.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct DisaggConfig {
    /// The configured link, before anything is learned.
    pub link: LinkPrior,
    /// How links are learned and quarantined.
    pub learning: LinkLearning,
    /// KV-cache bytes per token of the model.
    pub kv_bytes_per_token: f64,
    /// The fixed cost of a second leg, seconds (the prefill engine's sampling step and one more
    /// round trip).
    pub leg_overhead_s: f64,
}

/// The time constant of the inflow estimate, seconds: a measurement window spanning several
/// prefills and load scrapes, not a decision threshold (the decision prices what it measures).
pub const INFLOW_WINDOW_S: f64 = 5.0;

/// One dispatched transfer: its pair, its bytes, and the bytes queued ahead of it on the busier
/// NIC when it was sent.
#[derive(Clone, Copy, Debug)]
struct Transfer {
    prefill: EndpointId,
    decode: EndpointId,
    bytes: f64,
    ahead: f64,
}

/// The fleet's P/D state: the learned links, each NIC's backlog, the transfers in flight and
/// the recent prefill work per endpoint.
#[derive(Clone, Debug)]
pub(super) struct DisaggState {
    config: DisaggConfig,
    links: LinkBook,
    /// KV bytes of dispatched, unfinished transfers on each endpoint's NIC.
    backlog: HashMap<EndpointId, f64>,
    transfers: HashMap<u64, Transfer>,
    /// Per endpoint: decayed prefill seconds sent there, and when last decayed.
    inflow: HashMap<EndpointId, (f64, f64)>,
}

impl DisaggState {
    fn new(config: DisaggConfig) -> Self {
        Self {
            links: LinkBook::new(config.link, config.learning),
            config,
            backlog: HashMap::new(),
            transfers: HashMap::new(),
            inflow: HashMap::new(),
        }
    }

    fn decayed_inflow(&self, endpoint: EndpointId, now: f64) -> f64 {
        self.inflow.get(&endpoint).map_or(0.0, |(w, at)| {
            w * (-(now - at).max(0.0) / INFLOW_WINDOW_S).exp()
        })
    }

    /// Seconds of work per second reaching `endpoint`.
    fn inflow_rate(&self, endpoint: EndpointId, now: f64) -> f64 {
        self.decayed_inflow(endpoint, now) / INFLOW_WINDOW_S
    }

    fn record_inflow(&mut self, endpoint: EndpointId, seconds: f64, now: f64) {
        let w = self.decayed_inflow(endpoint, now) + seconds.max(0.0);
        self.inflow.insert(endpoint, (w, now));
    }

    fn backlog_of(&self, endpoint: EndpointId) -> f64 {
        self.backlog.get(&endpoint).copied().unwrap_or(0.0)
    }

    /// Drops what is kept of an endpoint that left the fleet.
    pub(super) fn forget(&mut self, endpoint: EndpointId) {
        self.links.forget(endpoint);
        self.inflow.remove(&endpoint);
    }
}

/// Whether an endpoint of `role` can run a decode leg (or a whole request).
pub fn decodes(role: Role) -> bool {
    matches!(role, Role::Decode | Role::Both)
}

/// Whether an endpoint of `role` can run a prefill leg.
pub fn prefills(role: Role) -> bool {
    matches!(role, Role::Prefill | Role::Both)
}

impl Fleet {
    /// Turns P/D pricing on with `config` (learned links start over).
    pub fn enable_disagg(&mut self, config: DisaggConfig) {
        self.disagg = Some(DisaggState::new(config));
        // Pairing reads every prefill endpoint's breakdown, not only the best few.
        self.rank_every_candidate(true);
    }

    /// The P/D configuration, when P/D is on.
    pub fn disagg_config(&self) -> Option<&DisaggConfig> {
        self.disagg.as_ref().map(|d| &d.config)
    }

    /// The learned links, when P/D is on.
    pub fn links(&self) -> Option<&LinkBook> {
        self.disagg.as_ref().map(|d| &d.links)
    }

    fn role_of(&self, id: EndpointId) -> Role {
        self.endpoint(id).map_or(Role::Both, |e| e.spec.role)
    }

    /// The decode pick of `plan`: the best-ranked endpoint that can decode.
    pub fn decode_pick(&self, plan: &Plan) -> Option<EndpointId> {
        plan.decision
            .ranking
            .iter()
            .copied()
            .find(|e| decodes(self.role_of(*e)))
    }

    /// The endpoints of `plan` that could prefill for `decode`, best-ranked first.
    pub fn prefill_candidates(&self, plan: &Plan, decode: EndpointId) -> Vec<EndpointId> {
        plan.decision
            .ranking
            .iter()
            .copied()
            .filter(|e| *e != decode && prefills(self.role_of(*e)))
            .collect()
    }

    fn side_cost(
        &self,
        state: &DisaggState,
        plan: &Plan,
        e: EndpointId,
        now: f64,
    ) -> Option<SideCost> {
        plan.decision.assessment(e).map(|a| SideCost {
            endpoint: e,
            cost: a.cost.clone(),
            cached_tokens: a.cached_tokens,
            link_backlog_bytes: state.backlog_of(e),
            queue_inflow: state.inflow_rate(e, now),
        })
    }

    /// Prices aggregated on `decode` against P/D with every prefill-capable endpoint of `plan`
    /// (see [`disagg::decide`]) at `now`, with the fleet's learned links. Changes nothing: the
    /// caller reports where the prefill is computed once it is sent ([`Fleet::prefill_sent`]),
    /// which may differ from the choice (`pd.mode: always`, a fallback). `None` when P/D is off
    /// or `decode` was not assessed.
    pub fn plan_disagg(
        &self,
        plan: &Plan,
        decode: EndpointId,
        prompt_tokens: usize,
        block_size: usize,
        now: f64,
    ) -> Option<DisaggExplain> {
        let state = self.disagg.as_ref()?;
        let decode_side = self.side_cost(state, plan, decode, now)?;
        let prefills: Vec<SideCost> = self
            .prefill_candidates(plan, decode)
            .into_iter()
            .filter_map(|e| self.side_cost(state, plan, e, now))
            .collect();
        let request = PdRequest {
            prompt_tokens,
            block_size,
            kv_bytes_per_token: state.config.kv_bytes_per_token,
            leg_overhead_s: state.config.leg_overhead_s,
        };
        Some(disagg::decide(
            request,
            &decode_side,
            &prefills,
            &state.links,
            now,
        ))
    }

    /// The prefill of the request `plan` planned was sent to `endpoint` at `now` (a prefill
    /// leg, a whole request, or a fallback's second try): its prefill seconds, as `plan`
    /// assessed them there, count as work reaching that endpoint (the queue inflow a later
    /// decode leg's wait is priced with). Nothing when P/D is off or `endpoint` was not
    /// assessed.
    pub fn prefill_sent(&mut self, plan: &Plan, endpoint: EndpointId, now: f64) {
        let Some(a) = plan.decision.assessment(endpoint) else {
            return;
        };
        let seconds = a.cost.prefill_s + a.cost.tier_load_s;
        if let Some(state) = self.disagg.as_mut() {
            state.record_inflow(endpoint, seconds, now);
        }
    }

    /// Transfer `transfer` (any id unique among those in flight) from `prefill` to `decode`
    /// was sent: the full blocks of its `prompt_tokens` the decode endpoint lacks (it holds
    /// `decode_cached`) queue on both NICs until [`Fleet::transfer_ended`]. Returns its bytes.
    pub fn transfer_started(
        &mut self,
        transfer: u64,
        (prefill, decode): (EndpointId, EndpointId),
        prompt_tokens: usize,
        decode_cached: usize,
        block_size: usize,
    ) -> f64 {
        let Some(state) = self.disagg.as_mut() else {
            return 0.0;
        };
        let bs = block_size.max(1);
        let tokens = (prompt_tokens / bs).saturating_sub(decode_cached / bs) * bs;
        let bytes = tokens as f64 * state.config.kv_bytes_per_token;
        let ahead = state.backlog_of(prefill).max(state.backlog_of(decode));
        for e in [prefill, decode] {
            *state.backlog.entry(e).or_insert(0.0) += bytes;
        }
        let sent = Transfer {
            prefill,
            decode,
            bytes,
            ahead,
        };
        state.transfers.insert(transfer, sent);
        bytes
    }

    /// Transfer `transfer` is over (or its request ended without one): its bytes leave the
    /// NICs. Returns the bytes that were queued ahead of it.
    pub fn transfer_ended(&mut self, transfer: u64) -> f64 {
        let Some(state) = self.disagg.as_mut() else {
            return 0.0;
        };
        let Some(t) = state.transfers.remove(&transfer) else {
            return 0.0;
        };
        for e in [t.prefill, t.decode] {
            if let Some(b) = state.backlog.get_mut(&e) {
                *b = (*b - t.bytes).max(0.0);
                if *b <= 0.0 {
                    state.backlog.remove(&e);
                }
            }
        }
        t.ahead
    }

    /// Transfer `transfer` of `bytes` over `(prefill, decode)` took `seconds` (the engines'
    /// transfer metrics, or the router's leg timings) and ended at `now`: the pair learns from
    /// this transfer's share of the time (the bytes queued ahead of it on a shared NIC are
    /// contention, priced as backlog, not a slow link), and its bytes leave the NICs.
    pub fn observe_transfer(
        &mut self,
        transfer: u64,
        (prefill, decode): (EndpointId, EndpointId),
        bytes: f64,
        seconds: f64,
        now: f64,
    ) {
        let ahead = self.transfer_ended(transfer);
        let Some(state) = self.disagg.as_mut() else {
            return;
        };
        let share = bytes / (bytes + ahead).max(1.0);
        state
            .links
            .observe_transfer(prefill, decode, bytes, seconds * share, now);
    }

    /// Transfer `transfer` over `(prefill, decode)` failed at `now`: a strike on the pair
    /// (repeated ones quarantine it), and its bytes leave the NICs.
    pub fn observe_failure(
        &mut self,
        transfer: u64,
        (prefill, decode): (EndpointId, EndpointId),
        now: f64,
    ) {
        self.transfer_ended(transfer);
        if let Some(state) = self.disagg.as_mut() {
            state.links.observe_failure(prefill, decode, now);
        }
    }
}

#[cfg(test)]
mod tests;
