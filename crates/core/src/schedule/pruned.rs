//! Costing only the endpoints that can come near the best, so that a decision's work follows
//! the endpoints that hold part of the prompt, not the fleet's size.
//!
//! An endpoint that holds none of the prompt's blocks (no index match on any tier, no routing
//! history, no prediction) and is not the session's differs from every other such endpoint only
//! through its load: its cost is at least [`cost::floor_without_cache`] of its requests decoding
//! and queued ("busy") and the fleet's fastest prefill rate, a bound that grows with `busy`.
//! [`LoadOrder`] keeps the endpoints ordered by a lower bound of their `busy`, updated when
//! their load changes. [`schedule_pruned`] costs exactly every endpoint that holds part of the
//! prompt (and the session's), then the others in that order, and stops at the first whose
//! bound exceeds every cost the decision can still read:
//! - the cost of the `depth`-th best so far (the head of the ranking, ties included: a bound
//!   equal to it is still costed);
//! - the balance limit (the cheapest's cost plus the tolerance) while the cheapest holds
//!   nothing of the prompt (balancing reads every near-equal cost that holds at least as much
//!   as the cheapest, so it reads the empty ones only then).
//!
//! Every endpoint left out costs more than both, so it is neither in the head of the ranking nor
//! among the near-equal costs, and the winner, reason and head are those of [`super::schedule`].
//! The walk does not stop before more than `depth` competitors are costed (with fewer, the
//! caller ranks everything as before) nor before one of them is unsaturated (whether every
//! competitor is saturated is a fact about all of them).

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

    /// The highest cost a decision can still read (`None`: any).
    fn stop(&self, profile: &Profile) -> Option<f64> {
        let cheapest = self.cheapest?;
        if self.standings.len() <= self.depth || !self.any_unsaturated {
            return None;
        }
        let head = self.best[self.depth - 1];
        Some(if cheapest.cached == 0 {
            head.max(balance_limit(profile, cheapest.total))
        } else {
            head
        })
    }
}

/// Ranks the best `depth` (at least 2) endpoints for `request` as [`super::schedule_near_best`]
/// does over every endpoint, costing only those that can matter (see the module's doc):
/// `holders` (sorted, every endpoint holding any part of the prompt by any source, and the
/// session's), then the rest of `order` while the bound can reach the head or the balance
/// limit. `fastest_rate`: at least every endpoint's prefill rate, tokens/s. `candidate` builds
/// an endpoint's view. `None` when the profile's picker reads every candidate, or when no more
/// than `depth` endpoints compete (rank them all then).
#[allow(clippy::too_many_arguments)]
pub fn schedule_pruned(
    profile: &Profile,
    request: &RequestInfo,
    holders: &[EndpointId],
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
    } = buffers;
    candidates.clear();
    standings.clear();
    best.clear();
    let mut walk = Walk {
        depth,
        random,
        cheapest: None,
        any_unsaturated: false,
        candidates,
        standings,
        best,
    };
    for &id in holders {
        walk.consider(profile, request, candidate(id));
    }
    for (busy, id) in order.iter() {
        if let Some(stop) = walk.stop(profile)
            && cost::floor_without_cache(profile, request, busy, fastest_rate)
                .is_some_and(|floor| floor > stop)
        {
            break;
        }
        if holders.binary_search(&id).is_err() {
            walk.consider(profile, request, candidate(id));
        }
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
