//! Other router replicas' prefills in flight, counted in this replica's load.
//!
//! Each replica counts the requests it sent itself, from dispatch to first token, as queued
//! prefill at their engine (`inflight_prefills`, `inflight_prefill_tokens`): the fresh part of
//! the load its costs read, next to the engines' scraped queues (hundreds of milliseconds old).
//! Behind a round-robin balancer each of `n` replicas sees only `1/n` of that; a burst of
//! requests for one engine then looks short to every replica. With dispatches shared
//! ([`Fleet::peer_prefill_started`]), a peer's request counts here as one of this replica's own
//! until the peer says its first token came ([`Fleet::peer_prefill_done`]).
//!
//! # Decisions
//! - **Only the prefill is shared.** A queued prefill is what makes a new request wait; decodes
//!   show in the engine's scraped running count, and would cost one more message per request.
//! - **Unconfirmed load ends.** A peer that crashed, or a lost message, would otherwise inflate
//!   an engine's queue forever: a peer prefill not confirmed within `predicted_ttl_s` (the
//!   longest an unconfirmed routing record stands) is released and counted
//!   ([`PeerLoadStats::expired`]). Released early, it only costs what sharing would have won.
//! - **Bounded.** At most [`MAX_OPEN`] peer prefills are open; past that the oldest is released
//!   (counted in [`PeerLoadStats::displaced`]).
//! - **Ids are the sender's.** A peer names each request by a random-looking 64-bit id of its
//!   own making. An id started again while open (a collision, or a peer's replay) replaces the
//!   open one, which is released (counted as displaced): never counted twice.

use std::collections::{HashMap, VecDeque};

use serde::Serialize;

use super::Fleet;
use crate::index::EndpointId;

/// Most peer prefills open at once.
pub const MAX_OPEN: usize = 1 << 16;

/// One peer request still in its prefill, as counted here.
#[derive(Clone, Copy, Debug)]
struct PeerPrefill {
    endpoint: EndpointId,
    uncached_tokens: u64,
}

/// Counters of peer prefills, for operators and tests.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PeerLoadStats {
    /// Peer prefills counted now.
    pub open: u64,
    /// Peer prefills started (counted) so far.
    pub started: u64,
    /// Confirmed done by their peer.
    pub done: u64,
    /// Released unconfirmed after `predicted_ttl_s`.
    pub expired: u64,
    /// Released unconfirmed because [`MAX_OPEN`] were open, or its id was started again.
    pub displaced: u64,
    /// Confirmations naming no open prefill (it expired first, or never arrived).
    pub unknown_done: u64,
}

/// The peer prefills a fleet counts, with their deadlines.
#[derive(Debug, Default)]
pub(super) struct PeerLoad {
    open: HashMap<u64, PeerPrefill>,
    /// (deadline, id) in start order; an entry whose id was confirmed since is skipped.
    deadlines: VecDeque<(f64, u64)>,
    stats: PeerLoadStats,
}

impl Fleet {
    /// A peer replica sent request `request` (its id) to `endpoint` at `now`, predicting
    /// `uncached_tokens` of prefill: counted as this replica's own queued prefill there until
    /// [`Self::peer_prefill_done`], or for `predicted_ttl_s` at most.
    pub fn peer_prefill_started(
        &mut self,
        request: u64,
        endpoint: EndpointId,
        uncached_tokens: u64,
        now: f64,
    ) {
        self.expire_peer_prefills(now);
        if !self
            .endpoints
            .get(endpoint.0 as usize)
            .is_some_and(|e| e.present)
        {
            return;
        }
        if self.release_peer_prefill(request) {
            self.peer_load.stats.displaced += 1;
        }
        if self.peer_load.open.len() >= MAX_OPEN {
            self.release_oldest_peer_prefill();
        }
        let e = &mut self.endpoints[endpoint.0 as usize];
        e.inflight += 1;
        e.inflight_prefills += 1;
        e.inflight_prefill_tokens += uncached_tokens;
        self.load_changed(endpoint);
        let load = &mut self.peer_load;
        load.open.insert(
            request,
            PeerPrefill {
                endpoint,
                uncached_tokens,
            },
        );
        load.deadlines
            .push_back((now + self.config.predicted_ttl_s, request));
        // Confirmed prefills leave their deadlines behind: drop them before they outnumber
        // the open ones, so the queue stays within a small multiple of MAX_OPEN.
        if load.deadlines.len() > 2 * MAX_OPEN {
            let open = &load.open;
            load.deadlines.retain(|(_, id)| open.contains_key(id));
        }
        load.stats.started += 1;
        load.stats.open = load.open.len() as u64;
    }

    /// The peer's request `request` got its first token (or ended without one) at `now`: its
    /// prefill no longer counts here. Returns whether it was counted.
    pub fn peer_prefill_done(&mut self, request: u64, now: f64) -> bool {
        self.expire_peer_prefills(now);
        let released = self.release_peer_prefill(request);
        if released {
            self.peer_load.stats.done += 1;
        } else {
            self.peer_load.stats.unknown_done += 1;
        }
        released
    }

    /// Counters of peer prefills.
    pub fn peer_load_stats(&self) -> &PeerLoadStats {
        &self.peer_load.stats
    }

    /// Releases the peer prefills whose deadline passed by `now` (also run by housekeeping).
    pub(super) fn expire_peer_prefills(&mut self, now: f64) {
        while let Some(&(deadline, id)) = self.peer_load.deadlines.front() {
            if deadline > now {
                break;
            }
            self.peer_load.deadlines.pop_front();
            if self.release_peer_prefill(id) {
                self.peer_load.stats.expired += 1;
            }
        }
    }

    fn release_oldest_peer_prefill(&mut self) {
        while let Some((_, id)) = self.peer_load.deadlines.pop_front() {
            if self.release_peer_prefill(id) {
                self.peer_load.stats.displaced += 1;
                return;
            }
        }
    }

    /// Stops counting the peer prefill `id`; whether it was counted. (A deadline left behind
    /// for a confirmed id finds nothing when it comes: an id restarted since gets a deadline
    /// of its own, and the earlier one may end it sooner, the safe direction.)
    fn release_peer_prefill(&mut self, id: u64) -> bool {
        let Some(p) = self.peer_load.open.remove(&id) else {
            return false;
        };
        if let Some(e) = self.endpoints.get_mut(p.endpoint.0 as usize) {
            e.inflight = e.inflight.saturating_sub(1);
            e.inflight_prefills = e.inflight_prefills.saturating_sub(1);
            e.inflight_prefill_tokens = e.inflight_prefill_tokens.saturating_sub(p.uncached_tokens);
        }
        self.load_changed(p.endpoint);
        self.peer_load.stats.open = self.peer_load.open.len() as u64;
        true
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::fleet::{EndpointSpec, FleetConfig, RequestFeatures};
    use crate::keys::router_keys;
    use crate::schedule::{Profile, Role};

    const BS: usize = 16;

    fn fleet(endpoints: usize) -> Fleet {
        let specs = (0..endpoints)
            .map(|i| EndpointSpec {
                name: format!("e{i}"),
                models: vec!["m".into()],
                role: Role::Both,
                has_events: true,
                block_size: BS,
                offload: Default::default(),
            })
            .collect();
        Fleet::new(FleetConfig::default(), Profile::default(), specs).unwrap()
    }

    fn chosen(fleet: &mut Fleet, salt: u32, now: f64) -> Option<EndpointId> {
        let tokens: Vec<u32> = (0..2000u32).map(|t| t.wrapping_mul(31) ^ salt).collect();
        let keys = Arc::new(router_keys(&tokens, BS, None).unwrap());
        let features = RequestFeatures {
            model: "m",
            keys: &keys,
            prompt_tokens: tokens.len(),
            block_size: BS,
            session: None,
            role: Role::Both,
        };
        fleet.plan(&features, 1, now).decision.chosen()
    }

    #[test]
    fn a_peers_queued_prefill_steers_new_requests_elsewhere_until_its_first_token() {
        let mut fleet = fleet(2);
        let e0 = EndpointId(0);
        // Four long prefills a peer sent to e0, none of which this replica sent.
        for request in 1..=4 {
            fleet.peer_prefill_started(request, e0, 8000, 0.0);
        }
        let load = fleet.load(e0, 0.0).unwrap();
        assert_eq!(
            (load.inflight_prefills, load.inflight_prefill_tokens),
            (4, 32_000)
        );
        for salt in 0..8 {
            assert_eq!(chosen(&mut fleet, salt, 0.01), Some(EndpointId(1)));
        }
        for request in 1..=4 {
            assert!(fleet.peer_prefill_done(request, 0.5));
        }
        let load = fleet.load(e0, 0.5).unwrap();
        assert_eq!((load.inflight, load.inflight_prefill_tokens), (0, 0));
        assert_eq!(fleet.peer_load_stats().done, 4);
        assert_eq!(fleet.peer_load_stats().open, 0);
    }

    #[test]
    fn an_unconfirmed_peer_prefill_is_released_after_the_prediction_ttl_and_counted() {
        let mut fleet = fleet(2);
        let ttl = FleetConfig::default().predicted_ttl_s;
        fleet.peer_prefill_started(7, EndpointId(1), 500, 0.0);
        fleet.housekeeping(ttl - 0.1);
        assert_eq!(fleet.load(EndpointId(1), ttl).unwrap().inflight_prefills, 1);
        fleet.housekeeping(ttl);
        let load = fleet.load(EndpointId(1), ttl).unwrap();
        assert_eq!(
            (load.inflight_prefills, load.inflight_prefill_tokens),
            (0, 0)
        );
        assert_eq!(fleet.peer_load_stats().expired, 1);
        // Its confirmation, late, changes nothing and is counted.
        assert!(!fleet.peer_prefill_done(7, ttl + 1.0));
        assert_eq!(fleet.peer_load_stats().unknown_done, 1);
        assert_eq!(fleet.load(EndpointId(1), ttl).unwrap().inflight, 0);
    }

    #[test]
    fn an_id_started_again_is_counted_once_and_the_open_set_is_bounded() {
        let mut fleet = fleet(1);
        let e0 = EndpointId(0);
        fleet.peer_prefill_started(1, e0, 100, 0.0);
        fleet.peer_prefill_started(1, e0, 300, 0.0);
        let load = fleet.load(e0, 0.0).unwrap();
        assert_eq!(
            (load.inflight_prefills, load.inflight_prefill_tokens),
            (1, 300)
        );
        assert_eq!(fleet.peer_load_stats().displaced, 1);
        for request in 2..=(MAX_OPEN as u64 + 1) {
            fleet.peer_prefill_started(request, e0, 1, 0.0);
        }
        let stats = fleet.peer_load_stats().clone();
        assert_eq!(stats.open, MAX_OPEN as u64);
        assert_eq!(stats.displaced, 2, "the oldest went to make room");
        assert_eq!(
            fleet.load(e0, 0.0).unwrap().inflight_prefills,
            MAX_OPEN as u32
        );
    }

    #[test]
    fn a_peer_prefill_for_an_absent_endpoint_is_not_counted() {
        let mut fleet = fleet(1);
        fleet.peer_prefill_started(1, EndpointId(5), 100, 0.0);
        assert_eq!(fleet.peer_load_stats().started, 0);
    }
}
