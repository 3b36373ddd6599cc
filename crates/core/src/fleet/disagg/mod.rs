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
//! [`Fleet::transfer_ended`] when its bytes have left the NICs. A decode leg that fails is
//! followed by a pull on the next decoder or the request served aggregated
//! ([`Fleet::decode_leg_failed`]).
//!
//! The transfers in flight are bounded: one whose end is never reported expires (after
//! [`TRANSFER_EXPIRY_FACTOR`] × the link's predicted time for it, at least
//! [`TRANSFER_EXPIRY_FLOOR_S`]) and at most [`MAX_TRANSFERS`] are kept (the oldest dropped);
//! either is counted ([`Fleet::take_transfers_dropped`]) for the caller's metrics.

use std::collections::{HashMap, VecDeque};

use serde::{Deserialize, Serialize};

use super::{EndpointState, Fleet, Plan};
use crate::index::EndpointId;
use crate::schedule::Role;
use crate::schedule::disagg::{
    self, DisaggExplain, LinkBook, LinkLearning, LinkPrior, PdRequest, SideCost,
};

mod decode_retry;

pub use decode_retry::{DecodeRetry, FailedDecodeLeg};

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

/// The most transfers tracked at once. A router's transfers in flight are its P/D requests
/// between the decode leg's connection and its first token: a few per decode endpoint (1,000
/// endpoints with 16 pulls pending on each are this many). Past it the oldest is dropped
/// (counted): the map is bounded whatever its callers forget to report. Each decision and
/// each transfer's start reads them once.
pub const MAX_TRANSFERS: usize = 16_384;

/// A transfer not reported over after this many times the link's predicted time for it (behind
/// the bytes ahead of it) has lost its end (a caller that never reported it): it is dropped,
/// counted, and its bytes no longer count as backlog. Ten times: far past any contention the
/// backlog already prices.
pub const TRANSFER_EXPIRY_FACTOR: f64 = 10.0;

/// ... and never sooner than this, seconds: twice vLLM 0.33's producer lease (30 s), after
/// which the producer has freed the blocks and no pull can still be moving them; a decode leg
/// queued behind other work on its engine may legitimately wait that long before it pulls.
pub const TRANSFER_EXPIRY_FLOOR_S: f64 = 60.0;

/// How often, in seconds of the caller's clock, finished and expired transfers are swept
/// (they stop counting as backlog at once; the sweep only frees their memory).
const SWEEP_EVERY_S: f64 = 1.0;

/// Transfers the fleet stopped tracking without being told they ended, since the last
/// [`Fleet::take_transfers_dropped`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TransfersDropped {
    /// Past their expiry ([`TRANSFER_EXPIRY_FACTOR`], [`TRANSFER_EXPIRY_FLOOR_S`]).
    pub expired: u64,
    /// The oldest, to keep [`MAX_TRANSFERS`].
    pub evicted: u64,
}

/// One dispatched transfer: its pair, its bytes, the bytes queued ahead of it on the busier
/// NIC when it was sent, when it expires, and, for one whose end the caller cannot see, when
/// the link predicts it done.
#[derive(Clone, Copy, Debug)]
struct Transfer {
    prefill: EndpointId,
    decode: EndpointId,
    bytes: f64,
    ahead: f64,
    expires_at: f64,
    predicted_end: Option<f64>,
    /// Its place in the order transfers started, set when tracked (an id may be used again
    /// once its transfer ended).
    serial: u64,
    /// One of its endpoints left the fleet while it was in flight: its slot may belong to
    /// another endpoint by the time it is reported, so its report teaches nothing, and its
    /// bytes no longer queue on anyone's NIC. Kept until its expiry, to recognise that report.
    departed: bool,
}

impl Transfer {
    /// Whether its bytes are still on the NICs at `now`.
    fn queued(&self, now: f64) -> bool {
        !self.departed && self.predicted_end.is_none_or(|end| now < end) && !self.expired(now)
    }

    /// Whether it is past its expiry at `now`.
    fn expired(&self, now: f64) -> bool {
        now >= self.expires_at
    }

    /// Whether its end was lost: past its expiry, and not one whose end the link predicts.
    fn lost(&self, now: f64) -> bool {
        !self.departed && self.predicted_end.is_none() && self.expired(now)
    }
}

/// The fleet's P/D state: the learned links, each NIC's backlog, the transfers in flight and
/// the recent prefill work per endpoint.
#[derive(Clone, Debug)]
pub(super) struct DisaggState {
    config: DisaggConfig,
    links: LinkBook,
    /// Dispatched, unfinished transfers: their bytes are each NIC's backlog.
    transfers: HashMap<u64, Transfer>,
    /// Transfer ids in the order they started, with their serials (some already ended, or
    /// their id used again since): the oldest still tracked is evicted at the cap.
    started: VecDeque<(u64, u64)>,
    /// The serial of the next transfer to start.
    next_serial: u64,
    /// When finished and expired transfers are swept next.
    next_sweep: f64,
    /// Dropped since last taken.
    dropped: TransfersDropped,
    /// The cap on `transfers` ([`MAX_TRANSFERS`]).
    max_transfers: usize,
    /// Per endpoint: decayed prefill seconds sent there, and when last decayed.
    inflow: HashMap<EndpointId, (f64, f64)>,
}

impl DisaggState {
    fn new(config: DisaggConfig) -> Self {
        Self {
            links: LinkBook::new(config.link, config.learning),
            config,
            transfers: HashMap::new(),
            started: VecDeque::new(),
            next_serial: 0,
            next_sweep: f64::NEG_INFINITY,
            dropped: TransfersDropped::default(),
            max_transfers: MAX_TRANSFERS,
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

    /// KV bytes queued on each of `endpoints`' NICs at `now`, in one pass over the transfers
    /// (a decision reads every candidate's).
    fn backlogs_of(&self, endpoints: &[EndpointId], now: f64) -> Vec<f64> {
        let mut bytes = vec![0.0; endpoints.len()];
        for t in self.transfers.values().filter(|t| t.queued(now)) {
            for (e, sum) in endpoints.iter().zip(bytes.iter_mut()) {
                if t.prefill == *e || t.decode == *e {
                    *sum += t.bytes;
                }
            }
        }
        bytes
    }

    /// Forgets transfers that are over at `now`: those predicted done, and those expired
    /// (counted), at most once per [`SWEEP_EVERY_S`].
    fn sweep(&mut self, now: f64) {
        if now < self.next_sweep {
            return;
        }
        self.next_sweep = now + SWEEP_EVERY_S;
        let mut expired = 0;
        self.transfers.retain(|_, t| {
            expired += u64::from(t.lost(now));
            t.queued(now) || (t.departed && !t.expired(now))
        });
        self.dropped.expired += expired;
        self.forget_ended_starts();
    }

    /// Drops from the start order every entry that no longer names a tracked transfer.
    fn forget_ended_starts(&mut self) {
        let transfers = &self.transfers;
        self.started
            .retain(|(id, serial)| transfers.get(id).is_some_and(|t| t.serial == *serial));
    }

    /// Tracks `transfer` as `id`, within the cap.
    fn track(&mut self, id: u64, mut transfer: Transfer, now: f64) {
        self.sweep(now);
        while self.transfers.len() >= self.max_transfers.max(1) {
            let Some((oldest, serial)) = self.started.pop_front() else {
                break;
            };
            // An entry whose id ended (and maybe started again since) names nothing.
            if self
                .transfers
                .get(&oldest)
                .is_none_or(|t| t.serial != serial)
            {
                continue;
            }
            match self.transfers.remove(&oldest) {
                Some(t) if t.lost(now) => self.dropped.expired += 1,
                Some(t) if t.queued(now) => self.dropped.evicted += 1,
                // Over (predicted done), not yet swept.
                _ => {}
            }
        }
        // Ended ids linger in the start order until a sweep: keep it within twice the map.
        if self.started.len() > 2 * self.transfers.len() + 64 {
            self.forget_ended_starts();
        }
        transfer.serial = self.next_serial;
        self.next_serial += 1;
        self.transfers.insert(id, transfer);
        self.started.push_back((id, transfer.serial));
    }

    /// Drops what is kept of an endpoint that left the fleet.
    pub(super) fn forget(&mut self, endpoint: EndpointId) {
        self.links.forget(endpoint);
        self.inflow.remove(&endpoint);
        for t in self.transfers.values_mut() {
            if t.prefill == endpoint || t.decode == endpoint {
                t.departed = true;
            }
        }
    }

    /// Ends `transfer`: its record, if still tracked.
    fn end(&mut self, transfer: u64) -> Option<Transfer> {
        self.transfers.remove(&transfer)
    }
}

impl Fleet {
    /// Turns P/D pricing on with `config` (learned links start over). Plans then rank the
    /// best few of each role ([`crate::schedule::RankBuffers::rank_role_heads`]), not only the
    /// best few overall.
    pub fn enable_disagg(&mut self, config: DisaggConfig) {
        self.disagg = Some(DisaggState::new(config));
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
            .find(|e| self.role_of(*e).decodes())
    }

    /// The endpoints of `plan` that could prefill for `decode`, best-ranked first.
    pub fn prefill_candidates(&self, plan: &Plan, decode: EndpointId) -> Vec<EndpointId> {
        plan.decision
            .ranking
            .iter()
            .copied()
            .filter(|e| *e != decode && self.role_of(*e).prefills())
            .collect()
    }

    /// Each of `endpoints`' side of the choice, as `plan` assessed it (those it did not are
    /// left out), with its NIC backlog and queue inflow at `now`.
    fn side_costs(
        &self,
        state: &DisaggState,
        plan: &Plan,
        endpoints: &[EndpointId],
        now: f64,
    ) -> Vec<SideCost> {
        let assessed: Vec<_> = endpoints
            .iter()
            .filter_map(|e| plan.decision.assessment(*e))
            .collect();
        let ids: Vec<EndpointId> = assessed.iter().map(|a| a.endpoint).collect();
        let backlogs = state.backlogs_of(&ids, now);
        assessed
            .into_iter()
            .zip(backlogs)
            .map(|(a, backlog)| SideCost {
                endpoint: a.endpoint,
                cost: a.cost.clone(),
                cached_tokens: a.cached_tokens,
                link_backlog_bytes: backlog,
                queue_inflow: state.inflow_rate(a.endpoint, now),
            })
            .collect()
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
        plan.decision.assessment(decode)?;
        // The decode endpoint first, then the prefill candidates: every side in one pass.
        let mut endpoints = vec![decode];
        endpoints.extend(self.prefill_candidates(plan, decode));
        let mut sides = self.side_costs(state, plan, &endpoints, now);
        let decode_side = sides.remove(0);
        let prefills = sides;
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
    /// leg, a whole request, or a fallback's second try): the seconds it occupies that
    /// endpoint's steps, as `plan` assessed them there, count as work reaching that endpoint
    /// (the queue inflow a later decode leg's wait is priced with). Nothing when P/D is off or
    /// `endpoint` was not assessed.
    pub fn prefill_sent(&mut self, plan: &Plan, endpoint: EndpointId, now: f64) {
        let Some(a) = plan.decision.assessment(endpoint) else {
            return;
        };
        let seconds = a.cost.stalling_s;
        if let Some(state) = self.disagg.as_mut() {
            state.record_inflow(endpoint, seconds, now);
        }
    }

    /// Transfer `transfer` (any id unique among those in flight) from `prefill` to `decode`
    /// was sent at `now`: the full blocks of its `prompt_tokens` the decode endpoint lacks (it
    /// holds `decode_cached`) queue on both NICs until [`Fleet::transfer_ended`] (or, for one
    /// whose end cannot be seen, [`Fleet::transfer_unobserved`]). Returns its bytes.
    pub fn transfer_started(
        &mut self,
        transfer: u64,
        (prefill, decode): (EndpointId, EndpointId),
        prompt_tokens: usize,
        decode_cached: usize,
        block_size: usize,
        now: f64,
    ) -> f64 {
        let Some(state) = self.disagg.as_mut() else {
            return 0.0;
        };
        let bs = block_size.max(1);
        let tokens = (prompt_tokens / bs).saturating_sub(decode_cached / bs) * bs;
        let bytes = tokens as f64 * state.config.kv_bytes_per_token;
        let [on_prefill, on_decode] = state.backlogs_of(&[prefill, decode], now)[..] else {
            unreachable!("one backlog per endpoint asked")
        };
        let ahead = on_prefill.max(on_decode);
        let predicted_s = state.links.transfer_s(prefill, decode, bytes + ahead, now);
        let sent = Transfer {
            prefill,
            decode,
            bytes,
            ahead,
            expires_at: now + (TRANSFER_EXPIRY_FACTOR * predicted_s).max(TRANSFER_EXPIRY_FLOOR_S),
            predicted_end: None,
            serial: 0,
            departed: false,
        };
        state.track(transfer, sent, now);
        bytes
    }

    /// The caller of transfer `transfer`, started at `now`, will not see when the pull ends (a
    /// non-streamed decode leg: its first byte is its whole answer, long after the pull). Its
    /// bytes leave the NICs when the pair's link predicts the pull done (behind the bytes that
    /// were ahead of it), or at [`Fleet::transfer_ended`] if that comes first; nothing is
    /// learned from it.
    pub fn transfer_unobserved(&mut self, transfer: u64, now: f64) {
        let Some(state) = self.disagg.as_mut() else {
            return;
        };
        let Some(t) = state.transfers.get_mut(&transfer) else {
            return;
        };
        let seconds = state
            .links
            .transfer_s(t.prefill, t.decode, t.bytes + t.ahead, now);
        t.predicted_end = Some(now + seconds);
    }

    /// The transfers dropped without being reported over since the last call (expired, or
    /// evicted at [`MAX_TRANSFERS`]): what the caller counts in its metrics.
    pub fn take_transfers_dropped(&mut self) -> TransfersDropped {
        self.disagg
            .as_mut()
            .map(|state| std::mem::take(&mut state.dropped))
            .unwrap_or_default()
    }

    /// Transfers tracked now (in flight, or over and not yet swept).
    pub fn transfers_tracked(&self) -> usize {
        self.disagg
            .as_ref()
            .map_or(0, |state| state.transfers.len())
    }

    /// Transfer `transfer` is over (or its request ended without one): its bytes leave the
    /// NICs. Returns the bytes that were queued ahead of it.
    pub fn transfer_ended(&mut self, transfer: u64) -> f64 {
        let Some(state) = self.disagg.as_mut() else {
            return 0.0;
        };
        state.end(transfer).map_or(0.0, |t| t.ahead)
    }

    /// Ends transfer `transfer`, reported over `pair`: the bytes that were queued ahead of it,
    /// or `None` when the report must teach nothing (an endpoint of the pair left the fleet
    /// while it was in flight, so its slot may name another endpoint now).
    fn end_reported(
        &mut self,
        transfer: u64,
        (prefill, decode): (EndpointId, EndpointId),
    ) -> Option<f64> {
        let present = |id: EndpointId| self.endpoint(id).is_some_and(EndpointState::present);
        let pair_present = present(prefill) && present(decode);
        let ended = self.disagg.as_mut()?.end(transfer);
        match ended {
            Some(t) if t.departed => None,
            _ if !pair_present => None,
            Some(t) => Some(t.ahead),
            None => Some(0.0),
        }
    }

    /// Transfer `transfer` of `bytes` over `(prefill, decode)` took `seconds` (the engines'
    /// transfer metrics, or the router's leg timings) and ended at `now`: the pair learns from
    /// this transfer's share of the time (the bytes queued ahead of it on a shared NIC are
    /// contention, priced as backlog, not a slow link), and its bytes leave the NICs. A
    /// transfer one of whose endpoints left the fleet while it was in flight teaches nothing
    /// (its slot may name another endpoint by now).
    pub fn observe_transfer(
        &mut self,
        transfer: u64,
        (prefill, decode): (EndpointId, EndpointId),
        bytes: f64,
        seconds: f64,
        now: f64,
    ) {
        let Some(ahead) = self.end_reported(transfer, (prefill, decode)) else {
            return;
        };
        let Some(state) = self.disagg.as_mut() else {
            return;
        };
        let share = bytes / (bytes + ahead).max(1.0);
        state
            .links
            .observe_transfer(prefill, decode, bytes, seconds * share, now);
    }

    /// Transfer `transfer` over `(prefill, decode)` failed at `now`: a strike on the pair
    /// (repeated ones quarantine it), and its bytes leave the NICs; none when one of its
    /// endpoints left the fleet while it was in flight.
    pub fn observe_failure(
        &mut self,
        transfer: u64,
        (prefill, decode): (EndpointId, EndpointId),
        now: f64,
    ) {
        if self.end_reported(transfer, (prefill, decode)).is_none() {
            return;
        }
        if let Some(state) = self.disagg.as_mut() {
            state.links.observe_failure(prefill, decode, now);
        }
    }
}

#[cfg(test)]
mod decode_retry_tests;
#[cfg(test)]
mod naive_tests;
#[cfg(test)]
mod tests;
