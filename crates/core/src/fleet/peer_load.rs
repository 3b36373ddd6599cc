//! Other router replicas' requests in flight, counted in this replica's load.
//!
//! Each replica counts the requests it sent itself, from dispatch to first token, as queued
//! prefill at their engine (`inflight_prefills`, `inflight_prefill_tokens`), and from first
//! token to end as decoding there (`inflight`): the fresh part of the load its costs read, next
//! to the engines' scraped counts (hundreds of milliseconds old). Behind a round-robin balancer
//! each of `n` replicas sees only `1/n` of that; a burst of requests for one engine then looks
//! short to every replica. With dispatches shared ([`Fleet::peer_prefill_started`]), a peer's
//! request counts here as one of this replica's own: queued prefill until the peer says its
//! first token came ([`Fleet::peer_prefill_done`]), then, if the peer said it will post its end,
//! decoding until it does ([`Fleet::peer_request_ended`]).
//!
//! # Decisions
//! - **Decodes are shared too, when the peer promises its end.** A decode lasts less than a
//!   scrape interval in chat loads (0.3 s against 0.5 s in the demo), so the scraped running
//!   count rarely shows it, and the decode-stall term of a replica that sees a quarter of the
//!   decodes moves a conversation off its cache on noise: measured with 4 replicas, 7–16 of
//!   160 follow-ups per run went to an engine without their history, 4–10 with one replica
//!   (`docs/benchmarks-log.md`, "Sharing decodes"). It costs one more message per request per
//!   peer. A peer that does not say it will post its end (an older build) has its request
//!   released at its first token, as before.
//! - **Unconfirmed load ends.** A peer that crashed, or a lost message, would otherwise inflate
//!   an engine's queue forever: a peer prefill not confirmed within `predicted_ttl_s` (the
//!   longest an unconfirmed routing record stands) is released and counted
//!   ([`PeerLoadStats::expired`]), and so is a decode whose end is not confirmed within
//!   `predicted_ttl_s` of its first token (its own span, not what is left of its prefill's).
//!   Released early, it only costs what sharing would have won.
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

/// One peer request in flight, as counted here.
#[derive(Clone, Copy, Debug)]
struct PeerPrefill {
    endpoint: EndpointId,
    uncached_tokens: u64,
    /// The peer posts its end: after its first token it counts as decoding until then.
    shares_end: bool,
    /// Past its first token: counted as decoding, no longer as queued prefill.
    decoding: bool,
    /// When it is released unconfirmed: `predicted_ttl_s` after its start, then after its
    /// first token.
    until: f64,
}

/// Counters of peer prefills, for operators and tests.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PeerLoadStats {
    /// Peer requests counted now (in their prefill, or decoding).
    pub open: u64,
    /// Peer prefills started (counted) so far.
    pub started: u64,
    /// Prefills confirmed done by their peer (a repeated confirmation counts once).
    pub done: u64,
    /// Requests whose end their peer confirmed.
    pub ended: u64,
    /// Released unconfirmed after `predicted_ttl_s`.
    pub expired: u64,
    /// Released unconfirmed because `MAX_OPEN` were open, or its id was started again.
    pub displaced: u64,
    /// Confirmations (of a first token or an end) naming no open request (it expired first, or
    /// never arrived).
    pub unknown_done: u64,
}

/// The peer prefills a fleet counts, with their deadlines.
#[derive(Debug, Default)]
pub(super) struct PeerLoad {
    open: HashMap<u64, PeerPrefill>,
    /// (deadline, id) in deadline order (each deadline is `predicted_ttl_s` after the moment it
    /// was set, so pushing keeps the order); an entry whose id ended, or whose deadline moved
    /// since, is skipped.
    deadlines: VecDeque<(f64, u64)>,
    stats: PeerLoadStats,
}

impl PeerLoad {
    /// Queues `id`'s deadline. Entries of requests that ended, or whose deadline moved, are
    /// dropped before they outnumber the open requests, so the queue stays within a small
    /// multiple of [`MAX_OPEN`].
    fn push_deadline(&mut self, until: f64, id: u64) {
        self.deadlines.push_back((until, id));
        if self.deadlines.len() > 2 * MAX_OPEN {
            let open = &self.open;
            self.deadlines
                .retain(|&(deadline, id)| open.get(&id).is_some_and(|p| p.until == deadline));
        }
    }
}

impl Fleet {
    /// A peer replica sent request `request` (its id) to `endpoint` at `now`, predicting
    /// `uncached_tokens` of prefill: counted as this replica's own queued prefill there until
    /// [`Self::peer_prefill_done`], then, if `shares_end` (the peer will post its end), as
    /// decoding there until [`Self::peer_request_ended`]; each for `predicted_ttl_s` at most.
    pub fn peer_prefill_started(
        &mut self,
        request: u64,
        endpoint: EndpointId,
        uncached_tokens: u64,
        shares_end: bool,
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
        // Saturating: a figure from the network must not overflow the count (checked by the
        // receiver as well, this is the core's own bound).
        e.inflight_prefill_tokens = e.inflight_prefill_tokens.saturating_add(uncached_tokens);
        self.load_changed(endpoint);
        let until = now + self.config.predicted_ttl_s;
        let load = &mut self.peer_load;
        load.open.insert(
            request,
            PeerPrefill {
                endpoint,
                uncached_tokens,
                shares_end,
                decoding: false,
                until,
            },
        );
        load.push_deadline(until, request);
        load.stats.started += 1;
        load.stats.open = load.open.len() as u64;
    }

    /// The peer's request `request` got its first token (or ended without one) at `now`: its
    /// prefill no longer counts here; it counts as decoding until its end if its peer said it
    /// would post that, else not at all. Returns whether it was counted.
    pub fn peer_prefill_done(&mut self, request: u64, now: f64) -> bool {
        self.expire_peer_prefills(now);
        let until = now + self.config.predicted_ttl_s;
        let counted = match self.peer_load.open.get_mut(&request) {
            // Already decoding: a repeated confirmation changes nothing, and counts nothing.
            Some(p) if p.decoding => return true,
            Some(p) if p.shares_end => {
                p.decoding = true;
                p.until = until;
                let (endpoint, tokens) = (p.endpoint, p.uncached_tokens);
                self.peer_load.push_deadline(until, request);
                if let Some(e) = self.endpoints.get_mut(endpoint.0 as usize) {
                    e.prefill_ended(tokens);
                }
                self.load_changed(endpoint);
                true
            }
            _ => self.release_peer_prefill(request),
        };
        if counted {
            self.peer_load.stats.done += 1;
        } else {
            self.peer_load.stats.unknown_done += 1;
        }
        counted
    }

    /// The peer's request `request` ended at `now` (completed, failed or abandoned): it no
    /// longer counts here, in its prefill or decoding. Returns whether it was counted.
    pub fn peer_request_ended(&mut self, request: u64, now: f64) -> bool {
        self.expire_peer_prefills(now);
        let released = self.release_peer_prefill(request);
        if released {
            self.peer_load.stats.ended += 1;
        } else {
            self.peer_load.stats.unknown_done += 1;
        }
        released
    }

    /// Counters of peer prefills.
    pub fn peer_load_stats(&self) -> &PeerLoadStats {
        &self.peer_load.stats
    }

    /// Releases the peer requests whose deadline passed by `now` (also run by housekeeping).
    pub(super) fn expire_peer_prefills(&mut self, now: f64) {
        while let Some(&(deadline, id)) = self.peer_load.deadlines.front() {
            if deadline > now {
                break;
            }
            self.peer_load.deadlines.pop_front();
            // Its deadline may have moved on since (its first token came): a later entry ends it.
            let due = self.peer_load.open.get(&id).is_some_and(|p| p.until <= now);
            if due && self.release_peer_prefill(id) {
                self.peer_load.stats.expired += 1;
            }
        }
    }

    /// Releases the open peer request whose deadline comes first (deadlines are queued in
    /// order); an entry its request has moved past (a first token pushed it out) is skipped, as
    /// the request's own later entry stands for it.
    fn release_oldest_peer_prefill(&mut self) {
        while let Some((deadline, id)) = self.peer_load.deadlines.pop_front() {
            let current = self
                .peer_load
                .open
                .get(&id)
                .is_some_and(|p| p.until == deadline);
            if current && self.release_peer_prefill(id) {
                self.peer_load.stats.displaced += 1;
                return;
            }
        }
    }

    /// Stops counting the peer request `id`; whether it was counted. (A deadline left behind
    /// for an ended id finds nothing when it comes; one left behind by an id started again or
    /// past its first token finds a later `until`, and is skipped.)
    fn release_peer_prefill(&mut self, id: u64) -> bool {
        let Some(p) = self.peer_load.open.remove(&id) else {
            return false;
        };
        if let Some(e) = self.endpoints.get_mut(p.endpoint.0 as usize) {
            if !p.decoding {
                e.prefill_ended(p.uncached_tokens);
            }
            e.request_ended(p.decoding);
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

    /// `endpoint`'s requests in flight, queued prefills and their uncached tokens at `now`.
    fn in_flight(fleet: &Fleet, endpoint: EndpointId, now: f64) -> (u32, u32, u64) {
        let load = fleet.load(endpoint, now).unwrap();
        (
            load.inflight,
            load.inflight_prefills,
            load.inflight_prefill_tokens,
        )
    }

    /// Peers' figures arrive over the network: two that together pass `u64::MAX` tokens leave
    /// the count at its largest, never wrapped to a small one (which would make a swamped
    /// endpoint look idle) nor panicking.
    #[test]
    fn peer_prefill_tokens_saturate() {
        let mut f = fleet(1);
        let e = EndpointId(0);
        f.peer_prefill_started(1, e, u64::MAX, false, 0.0);
        f.peer_prefill_started(2, e, u64::MAX, false, 0.0);
        assert_eq!(in_flight(&f, e, 0.0), (2, 2, u64::MAX));
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
            fleet.peer_prefill_started(request, e0, 8000, false, 0.0);
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

    /// A peer that posts its ends has its request counted as decoding from its first token to
    /// its end, as this replica counts its own (the decode-stall term reads it).
    #[test]
    fn a_peer_request_that_shares_its_end_counts_as_decoding_until_then() {
        let mut fleet = fleet(2);
        let e0 = EndpointId(0);
        fleet.peer_prefill_started(1, e0, 800, true, 0.0);
        fleet.peer_prefill_started(2, e0, 800, false, 0.0);
        assert!(fleet.peer_prefill_done(1, 0.1));
        assert!(fleet.peer_prefill_done(2, 0.1));
        let load = fleet.load(e0, 0.1).unwrap();
        assert_eq!(
            in_flight(&fleet, e0, 0.1),
            (1, 0, 0),
            "request 1 decoding; request 2's peer does not post ends, so it left at its first token"
        );
        assert_eq!(load.decoding(), 1.0);
        // A repeated first-token message changes nothing, and is not counted again.
        assert!(fleet.peer_prefill_done(1, 0.2));
        assert_eq!(fleet.load(e0, 0.2).unwrap().inflight, 1);
        assert_eq!(fleet.peer_load_stats().done, 2);
        assert!(fleet.peer_request_ended(1, 0.4));
        let load = fleet.load(e0, 0.4).unwrap();
        assert_eq!((load.inflight, load.inflight_prefills), (0, 0));
        let stats = fleet.peer_load_stats();
        assert_eq!((stats.open, stats.ended), (0, 1));
        // An end without a first token releases its prefill.
        fleet.peer_prefill_started(3, e0, 500, true, 1.0);
        assert!(fleet.peer_request_ended(3, 1.1));
        assert_eq!(in_flight(&fleet, e0, 1.1), (0, 0, 0));
        // A decoding request whose end never comes is released `predicted_ttl_s` after its
        // first token, not after its dispatch: a long prefill does not shorten its decode.
        let ttl = FleetConfig::default().predicted_ttl_s;
        fleet.peer_prefill_started(4, e0, 500, true, 2.0);
        fleet.peer_prefill_done(4, 2.0 + ttl - 1.0);
        fleet.housekeeping(2.0 + ttl);
        assert_eq!(fleet.load(e0, 2.0 + ttl).unwrap().inflight, 1);
        fleet.housekeeping(2.0 + 2.0 * ttl - 1.0);
        assert_eq!(fleet.load(e0, 2.0 + 2.0 * ttl).unwrap().inflight, 0);
        assert_eq!(fleet.peer_load_stats().expired, 1);
    }

    #[test]
    fn an_unconfirmed_peer_prefill_is_released_after_the_prediction_ttl_and_counted() {
        let mut fleet = fleet(2);
        let ttl = FleetConfig::default().predicted_ttl_s;
        fleet.peer_prefill_started(7, EndpointId(1), 500, false, 0.0);
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
        fleet.peer_prefill_started(1, e0, 100, false, 0.0);
        fleet.peer_prefill_started(1, e0, 300, false, 0.0);
        let load = fleet.load(e0, 0.0).unwrap();
        assert_eq!(
            (load.inflight_prefills, load.inflight_prefill_tokens),
            (1, 300)
        );
        assert_eq!(fleet.peer_load_stats().displaced, 1);
        for request in 2..=(MAX_OPEN as u64 + 1) {
            fleet.peer_prefill_started(request, e0, 1, false, 0.0);
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
    fn a_full_open_set_releases_the_request_due_first_not_one_whose_first_token_moved_it_on() {
        let mut fleet = fleet(2);
        let (e0, e1) = (EndpointId(0), EndpointId(1));
        // Request 1 starts first, but its first token pushes its deadline past request 2's.
        fleet.peer_prefill_started(1, e0, 100, true, 0.0);
        fleet.peer_prefill_started(2, e1, 100, true, 1.0);
        assert!(fleet.peer_prefill_done(1, 2.0));
        for request in 3..=(MAX_OPEN as u64) {
            fleet.peer_prefill_started(request, e0, 1, true, 2.0);
        }
        assert_eq!(fleet.peer_load_stats().displaced, 0);
        fleet.peer_prefill_started(MAX_OPEN as u64 + 1, e0, 1, true, 2.0);
        assert_eq!(fleet.peer_load_stats().displaced, 1);
        assert_eq!(
            fleet.load(e1, 2.0).unwrap().inflight,
            0,
            "request 2, due first, made room"
        );
        assert!(
            fleet.peer_request_ended(1, 2.0),
            "request 1 is still counted (decoding)"
        );
    }

    #[test]
    fn a_peer_prefill_for_an_absent_endpoint_is_not_counted() {
        let mut fleet = fleet(1);
        fleet.peer_prefill_started(1, EndpointId(5), 100, false, 0.0);
        assert_eq!(fleet.peer_load_stats().started, 0);
    }
}
