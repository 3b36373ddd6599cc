//! Costing only the endpoints that can come near the best, so that a decision's work follows
//! the endpoints that can win, not the fleet's size.
//!
//! An endpoint's cost is at least [`cost::cost_floor`] of what it can hold of the prompt at
//! most, its requests decoding and queued ("busy") and the fleet's fastest prefill rate: a bound
//! that grows with `busy` and shrinks with what it holds. An endpoint that holds none of the
//! prompt's blocks (no index match on any tier, no routing history, no prediction) differs from
//! every other such endpoint only through its load. [`LoadOrder`] keeps the endpoints ordered by
//! a lower bound of their `busy`, updated when their load changes. [`schedule_pruned`] costs the
//! session's endpoint, then two streams, each in increasing order of its bound: the endpoints
//! that hold part of the prompt (a short list, sorted by their bound at each decision) and the
//! rest (the load order). A stream ends at the first endpoint whose bound exceeds every cost the
//! decision can still read:
//! - the cost of the `depth`-th best so far (the head of the ranking, ties included: a bound
//!   equal to it is still costed);
//! - the balance limit (the cheapest's cost plus the tolerance), which balancing reads among
//!   the costs that hold at least as much as the cheapest: for the holders always, for the rest
//!   (which hold nothing) only while the cheapest holds nothing.
//!
//! Both only fall as endpoints are costed, so every endpoint left out costs more than both at
//! the end: it is neither in the head of the ranking nor among the near-equal costs, and the
//! winner, reason and head are those of [`super::schedule`]. The walk does not stop before more
//! than `depth` competitors are costed (with fewer, the caller ranks everything as before) nor
//! before one of them is unsaturated (whether every competitor is saturated is a fact about all
//! of them).

use std::collections::BTreeSet;

use super::near_best::{Ranked, Standing, balance_limit, by_cost};
use super::{Candidate, Decision, Picker, Profile, RequestInfo, cost, rejection, saturated};
use crate::index::EndpointId;

/// Seconds before a load sample's expiry at which its endpoint's bound stops counting it: far
/// more than the rounding of `at + max_age` against `now - at`.
const EXPIRY_SLACK_S: f64 = 1e-6;

/// An `f64` as a `u64` with the same total order (negative values first).
fn order_bits(x: f64) -> u64 {
    let bits = x.to_bits();
    if bits >> 63 == 1 {
        !bits
    } else {
        bits | 1 << 63
    }
}

/// The inverse of [`order_bits`].
fn from_order_bits(key: u64) -> f64 {
    if key >> 63 == 1 {
        f64::from_bits(key & !(1 << 63))
    } else {
        f64::from_bits(!key)
    }
}

/// The endpoints in increasing order of a lower bound of their busy count (requests decoding
/// and queued, as the scheduler reads them), kept by the fleet as their load changes.
///
/// A bound may count a scraped load sample only while the sample is fresh: the owner says when
/// each counted sample expires ([`LoadOrder::sample_expires`]), and [`LoadOrder::expire`] hands
/// back the endpoints whose sample expired, whose bound must be set again without it. Without
/// its sample an endpoint's busy count is only the router's own, never more than with it, so a
/// bound set while the sample counted stays a lower bound until then.
#[derive(Debug, Default)]
pub struct LoadOrder {
    by_busy: BTreeSet<(u64, u32)>,
    busy_of: Vec<Option<u64>>,
    expiries: BTreeSet<(u64, u32)>,
    expiry_of: Vec<Option<u64>>,
}

impl LoadOrder {
    fn slot(list: &mut Vec<Option<u64>>, endpoint: EndpointId) -> &mut Option<u64> {
        let at = endpoint.0 as usize;
        if list.len() <= at {
            list.resize(at + 1, None);
        }
        &mut list[at]
    }

    /// Sets `endpoint`'s bound to `busy` (placing it in the order).
    pub fn set(&mut self, endpoint: EndpointId, busy: f64) {
        // `+ 0.0` turns a negative zero into zero; a NaN counts as nothing.
        let key = order_bits(if busy.is_nan() { 0.0 } else { busy + 0.0 });
        let old = Self::slot(&mut self.busy_of, endpoint).replace(key);
        if old != Some(key) {
            if let Some(old) = old {
                self.by_busy.remove(&(old, endpoint.0));
            }
            self.by_busy.insert((key, endpoint.0));
        }
    }

    /// Takes `endpoint` out of the order (it is no longer planned).
    pub fn remove(&mut self, endpoint: EndpointId) {
        if let Some(old) = Self::slot(&mut self.busy_of, endpoint).take() {
            self.by_busy.remove(&(old, endpoint.0));
        }
        self.sample_expires(endpoint, None);
    }

    /// The load sample `endpoint`'s bound counts stops being fresh at `at` (`None`: its bound
    /// counts no sample).
    pub fn sample_expires(&mut self, endpoint: EndpointId, at: Option<f64>) {
        let key = at.map(order_bits);
        let old = std::mem::replace(Self::slot(&mut self.expiry_of, endpoint), key);
        if let Some(old) = old {
            self.expiries.remove(&(old, endpoint.0));
        }
        if let Some(key) = key {
            self.expiries.insert((key, endpoint.0));
        }
    }

    /// Whether `endpoint`'s bound may count its load sample.
    pub fn counts_sample(&self, endpoint: EndpointId) -> bool {
        self.expiry_of
            .get(endpoint.0 as usize)
            .is_some_and(Option::is_some)
    }

    /// Stops counting every sample that is stale at `now` (or within a slack of it), and adds
    /// their endpoints to `expired`: set their bounds again.
    pub fn expire(&mut self, now: f64, expired: &mut Vec<EndpointId>) {
        let horizon = order_bits(now + EXPIRY_SLACK_S);
        while let Some(&(key, id)) = self.expiries.first() {
            if key > horizon {
                break;
            }
            self.expiries.pop_first();
            self.expiry_of[id as usize] = None;
            expired.push(EndpointId(id));
        }
    }

    /// `endpoint`'s bound, if it is in the order.
    pub fn busy(&self, endpoint: EndpointId) -> Option<f64> {
        self.busy_of
            .get(endpoint.0 as usize)
            .copied()
            .flatten()
            .map(from_order_bits)
    }

    /// Endpoints in the order.
    pub fn len(&self) -> usize {
        self.by_busy.len()
    }

    /// Whether no endpoint is in the order.
    pub fn is_empty(&self) -> bool {
        self.by_busy.is_empty()
    }

    /// The endpoints, least busy first, with their bounds.
    pub fn iter(&self) -> impl Iterator<Item = (f64, EndpointId)> + '_ {
        self.by_busy
            .iter()
            .map(|&(key, id)| (from_order_bits(key), EndpointId(id)))
    }
}

/// Buffers [`schedule_pruned`] reuses between decisions.
#[derive(Debug, Default)]
pub struct PruneBuffers {
    candidates: Vec<Candidate>,
    standings: Vec<Standing>,
    best: Vec<f64>,
    by_floor: Vec<(f64, EndpointId)>,
}

/// What the walk has found so far.
struct Walk<'b> {
    depth: usize,
    random: u64,
    cheapest: Option<Standing>,
    any_unsaturated: bool,
    candidates: &'b mut Vec<Candidate>,
    standings: &'b mut Vec<Standing>,
    /// The best costs so far, cheapest first, at most `depth` of them.
    best: &'b mut Vec<f64>,
}

impl Walk<'_> {
    /// Costs `c` and, if it competes, keeps its standing.
    fn consider(&mut self, profile: &Profile, request: &RequestInfo, c: Candidate) {
        if rejection(profile, request, &c).is_some() {
            return;
        }
        let (cost, cached) = cost::assess(profile, request, &c);
        self.any_unsaturated |= !saturated(profile, &c.load);
        let s = Standing::of(
            &c,
            self.candidates.len(),
            cost.total_s,
            cached.all,
            self.random,
        );
        if self.cheapest.is_none_or(|b| by_cost(&s, &b).is_lt()) {
            self.cheapest = Some(s);
        }
        let at = self.best.partition_point(|b| b.total_cmp(&s.total).is_le());
        if at < self.depth {
            self.best.insert(at, s.total);
            self.best.truncate(self.depth);
        }
        self.standings.push(s);
        self.candidates.push(c);
    }

    /// The highest cost a decision can still read from an endpoint that holds part of the
    /// prompt (`holds`) or none of it (`None`: any).
    fn stop(&self, profile: &Profile, holds: bool) -> Option<f64> {
        let cheapest = self.cheapest?;
        if self.standings.len() <= self.depth || !self.any_unsaturated {
            return None;
        }
        let head = self.best[self.depth - 1];
        Some(if holds || cheapest.cached == 0 {
            head.max(balance_limit(profile, cheapest.total))
        } else {
            head
        })
    }
}

/// Ranks the best `depth` (at least 2) endpoints for `request` as [`super::schedule_near_best`]
/// does over every endpoint, costing only those that can matter (see the module's doc): the
/// session's endpoint, `holders` (sorted by endpoint: every endpoint holding any part of the
/// prompt by any source, with the most tokens it can hold by any) and the rest of `order`,
/// each while its bound can reach the head or the balance limit. `fastest_rate`: at least
/// every endpoint's prefill rate, tokens/s. `candidate` builds an endpoint's view. `None` when
/// the profile's picker reads every candidate, or when no more than `depth` endpoints compete
/// (rank them all then).
#[allow(clippy::too_many_arguments)]
pub fn schedule_pruned(
    profile: &Profile,
    request: &RequestInfo,
    holders: &[(EndpointId, usize)],
    order: &LoadOrder,
    fastest_rate: f64,
    mut candidate: impl FnMut(EndpointId) -> Candidate,
    random: u64,
    depth: usize,
    buffers: &mut PruneBuffers,
) -> Option<Decision> {
    let depth = depth.max(2);
    if profile.picker != Picker::Cheapest {
        return None;
    }
    let PruneBuffers {
        candidates,
        standings,
        best,
        by_floor,
    } = buffers;
    candidates.clear();
    standings.clear();
    best.clear();
    let session = request.session_endpoint;
    let floor = |held: usize, busy: f64| {
        cost::cost_floor(profile, request, held, busy, fastest_rate).unwrap_or(f64::NEG_INFINITY)
    };
    // The holders by their bound (one not in the order is not present: costed first, and
    // rejected).
    by_floor.clear();
    by_floor.extend(
        holders
            .iter()
            .filter(|(id, _)| Some(*id) != session)
            .map(|&(id, held)| {
                let bound = order
                    .busy(id)
                    .map_or(f64::NEG_INFINITY, |busy| floor(held, busy));
                (bound, id)
            }),
    );
    by_floor.sort_unstable_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let mut walk = Walk {
        depth,
        random,
        cheapest: None,
        any_unsaturated: false,
        candidates,
        standings,
        best,
    };
    if let Some(id) = session {
        walk.consider(profile, request, candidate(id));
    }
    let mut held = by_floor.iter().copied().peekable();
    let mut rest = order
        .iter()
        .filter(|&(_, id)| {
            Some(id) != session && holders.binary_search_by_key(&id, |h| h.0).is_err()
        })
        .map(|(busy, id)| (floor(0, busy), id))
        .peekable();
    loop {
        let next_held = held.peek().copied();
        let next_rest = rest.peek().copied();
        let take_held = match (next_held, next_rest) {
            (None, None) => break,
            (Some(_), None) => true,
            (None, Some(_)) => false,
            (Some(h), Some(r)) => h.0 <= r.0,
        };
        let (bound, id) = if take_held { next_held } else { next_rest }.expect("one is next");
        if walk
            .stop(profile, take_held)
            .is_some_and(|stop| bound > stop)
        {
            // Every later endpoint of this stream is bounded higher, and the stop only falls.
            if take_held {
                held.by_ref().for_each(drop);
            } else {
                break;
            }
            continue;
        }
        if take_held {
            held.next();
        } else {
            rest.next();
        }
        walk.consider(profile, request, candidate(id));
    }
    if walk.standings.len() <= depth {
        return None;
    }
    let ranked = Ranked {
        all_saturated: !walk.any_unsaturated,
        depth,
        by_endpoint: true,
    };
    Some(ranked.decide(profile, request, walk.candidates, walk.standings))
}
