//! Costing only the endpoints that can come near the best, so that a decision's work follows
//! the endpoints that can win, not the fleet's size.
//!
//! An endpoint's cost is at least [`cost::cost_floor`] of what it can hold of the prompt at
//! most, its requests decoding and queued ("busy") and its prefill rate: a bound that grows with
//! `busy` and shrinks with what it holds and its rate. An endpoint that holds none of the
//! prompt's blocks as the cost counts them ([`cost::countable_blocks`]: no trusted index match
//! on any tier, no prediction, no routing history where that is read) differs from every other
//! such endpoint only through its load and rate: [`LoadOrder`] keeps the endpoints
//! ordered by a lower bound of their cost per prompt token then, updated when their load or rate
//! changes. [`schedule_pruned`] costs the session's endpoint, then two streams, each in
//! increasing order of its bound: the endpoints that hold part of the prompt (a short list,
//! sorted by their bound at each decision) and the
//! rest (the load order). A stream ends at the first endpoint whose bound exceeds every cost the
//! decision can still read:
//! - the cost of the `depth`-th best so far (the head of the ranking, ties included: a bound
//!   equal to it is still costed);
//! - the most the balance limit can be (the cheapest's cost plus the tolerance taken of all of
//!   it, [`super::BalanceTolerance::limit_at_most`]), which balancing reads among
//!   the costs that hold at least as much as the cheapest: for the holders always, for the rest
//!   (which hold nothing) only while the cheapest holds nothing.
//!
//! Both only fall as endpoints are costed, so every endpoint left out costs more than both at
//! the end: it is neither in the head of the ranking nor among the near-equal costs, and the
//! winner, reason and head are those of [`super::schedule`]. The walk does not stop before more
//! than `depth` competitors are costed (with fewer, the caller ranks everything as before).
//! Whether every competitor is saturated is a fact about all of them: when none costed is
//! unsaturated, the order's endpoints that may be unsaturated ([`LoadOrder::set_saturated`],
//! kept as their load changes) are viewed until one is; a saturated fleet has none.
//!
//! On a fleet of prefill and decode roles (P/D) the plan also ranks the head of each role
//! ([`super::role_heads`]): an endpoint is costed while its bound can reach the head of a role
//! it can serve, and a stream ends past the highest of the stops. Until `depth` of a role are
//! costed, every endpoint of that role met is. Under P/D the request is held when every
//! competing decoder is saturated: past those costed, the order's decoders that may be
//! unsaturated are viewed until one is.

use super::load_order::LoadOrder;
use super::near_best::{Ranked, Standing, by_cost};
use super::role_heads::{ROLES, rank_role_heads};
use super::{Candidate, Decision, Picker, Profile, RequestInfo, Role, cost, rejection, saturated};
use crate::index::EndpointId;

/// Buffers [`schedule_pruned`] reuses between decisions.
#[derive(Debug, Default)]
pub struct PruneBuffers {
    candidates: Vec<Candidate>,
    standings: Vec<Standing>,
    best: Vec<f64>,
    /// Under P/D, the best costs of each role ([`ROLES`]).
    role_best: [Vec<f64>; 2],
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
    /// Under P/D, the same of each role's competitors ([`ROLES`]); `None` otherwise.
    role_best: Option<&'b mut [Vec<f64>; 2]>,
}

/// Keeps `cost` among `best` (cheapest first) if it is one of the `depth` cheapest.
fn keep_best(best: &mut Vec<f64>, cost: f64, depth: usize) {
    let at = best.partition_point(|b| b.total_cmp(&cost).is_le());
    if at < depth {
        best.insert(at, cost);
        best.truncate(depth);
    }
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
            profile,
            &c,
            self.candidates.len(),
            &cost,
            cached.all,
            self.random,
        );
        if self.cheapest.is_none_or(|b| by_cost(&s, &b).is_lt()) {
            self.cheapest = Some(s);
        }
        keep_best(self.best, s.total, self.depth);
        if let Some(role_best) = self.role_best.as_deref_mut() {
            for (fits, best) in ROLES.iter().zip(role_best.iter_mut()) {
                if fits(c.role) {
                    keep_best(best, s.total, self.depth);
                }
            }
        }
        self.standings.push(s);
        self.candidates.push(c);
    }

    /// The highest cost a decision can still read from an endpoint that holds part of the
    /// prompt (`holds`) or none of it, over the fleet's head and the balance limit (`None`:
    /// any).
    fn stop(&self, profile: &Profile, holds: bool) -> Option<f64> {
        let cheapest = self.cheapest?;
        if self.standings.len() <= self.depth {
            return None;
        }
        let head = self.best[self.depth - 1];
        Some(if holds || cheapest.held.cached == 0 {
            // The cheapest can only get cheaper, and `limit_at_most` of it bounds its limit.
            head.max(profile.balance.limit_at_most(cheapest.total))
        } else {
            head
        })
    }

    /// [`Walk::stop`] for an endpoint whose role `fits` each of [`ROLES`] as `fits` says:
    /// under P/D, also the cost of the `depth`-th best of each role it fits (`None`: any, while
    /// fewer of that role were costed). `fits` all `true`: the highest stop of any endpoint.
    fn stop_for(&self, profile: &Profile, holds: bool, fits: [bool; 2]) -> Option<f64> {
        let fleet = self.stop(profile, holds)?;
        let Some(role_best) = self.role_best.as_deref() else {
            return Some(fleet);
        };
        let mut stop = fleet;
        for (best, _) in role_best.iter().zip(fits).filter(|(_, fits)| *fits) {
            stop = stop.max(*best.get(self.depth - 1)?);
        }
        Some(stop)
    }
}

/// Where a pruned plan looks for its candidates, and how it bounds them.
pub struct PruneScope<'a> {
    /// Every endpoint holding part of the prompt as the profile's cache source counts it
    /// ([`cost::countable_blocks`]), sorted by endpoint, with at least the tokens that source
    /// can count and at least its costed prefill rate. Every other endpoint is bounded as
    /// holding nothing.
    pub holders: &'a [(EndpointId, usize, f64)],
    /// The fleet's load order.
    pub order: &'a LoadOrder,
    /// The request's model and block size: only the endpoints of that order are walked (the
    /// others are rejected by every plan).
    pub serving: (&'a str, usize),
    /// The prior prefill rate of this decision's costed rates.
    pub prior_rate: f64,
    /// On a fleet of prefill and decode roles (P/D), each endpoint's role: the head of each
    /// role is ranked too ([`super::RankBuffers::rank_role_heads`]), and the plan is saturated
    /// when every competing decoder is ([`super::decoders_saturated`]). `None`: whole requests
    /// only.
    pub roles: Option<&'a dyn Fn(EndpointId) -> Role>,
}

/// Ranks the best `depth` (at least 2) endpoints for `request` as [`super::schedule_near_best`]
/// does over every endpoint (and, under P/D, the best `depth` of each role as
/// [`super::RankBuffers::rank_role_heads`] does), costing only those that can matter (see the
/// module's doc): the session's endpoint, the holders and the rest of the order, each while its
/// bound can reach the head, its role's head or the balance limit. `candidate` builds an
/// endpoint's view. `None` when the profile's picker reads every candidate, or when no more
/// than `depth` endpoints compete (rank them all then).
pub fn schedule_pruned(
    profile: &Profile,
    request: &RequestInfo,
    scope: &PruneScope<'_>,
    mut candidate: impl FnMut(EndpointId) -> Candidate,
    random: u64,
    depth: usize,
    buffers: &mut PruneBuffers,
) -> Option<Decision> {
    let depth = depth.max(2);
    // The rest stream leaves the holders out by a binary search.
    debug_assert!(
        scope.holders.is_sorted_by_key(|h| h.0),
        "holders sorted by endpoint"
    );
    if profile.picker != Picker::Cheapest {
        return None;
    }
    let PruneScope {
        holders,
        order,
        serving,
        prior_rate,
        roles,
    } = *scope;
    let PruneBuffers {
        candidates,
        standings,
        best,
        role_best,
        by_floor,
    } = buffers;
    candidates.clear();
    standings.clear();
    best.clear();
    role_best.iter_mut().for_each(Vec::clear);
    let session = request.session_endpoint;
    // The holders by their bound, but those out of the request's order (another model or
    // block size, unhealthy, ejected, gone): every plan rejects them.
    let group = order.group(serving.0, serving.1);
    by_floor.clear();
    let competing = |id: EndpointId| Some(id) != session && order.in_group(id, group);
    by_floor.extend(
        holders
            .iter()
            .filter(|(id, ..)| competing(*id))
            .map(|&(id, held, rate)| {
                let bound = order
                    .busy(id)
                    .and_then(|busy| cost::cost_floor(profile, request, held, busy, rate));
                (bound.unwrap_or(f64::NEG_INFINITY), id)
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
        role_best: roles.is_some().then_some(role_best),
    };
    if let Some(id) = session {
        walk.consider(profile, request, candidate(id));
    }
    let mut held = by_floor.iter().copied().peekable();
    // The rest hold nothing: the whole prompt is uncached (see `LoadOrder` for the key).
    let per_key = match cost::floor_per_token_second(profile, 0.0) {
        Some(_) => request.prompt_tokens as f64 * order.scale(prior_rate) * (1.0 - 1e-9),
        None => f64::NEG_INFINITY,
    };
    let mut rest = order
        .iter_serving(serving.0, serving.1)
        .filter(|&(_, id)| {
            Some(id) != session && holders.binary_search_by_key(&id, |h| h.0).is_err()
        })
        .map(|(key, id)| (key * per_key, id))
        .peekable();
    // A stream ends at its first bound past the highest stop: every later one of it is bounded
    // higher, and the stops only fall. The other stream goes on. Under P/D an endpoint below
    // that but past its own role's stop is passed over.
    let (mut held_done, mut rest_done) = (false, false);
    loop {
        let next_held = held.peek().copied().filter(|_| !held_done);
        let next_rest = rest.peek().copied().filter(|_| !rest_done);
        let take_held = match (next_held, next_rest) {
            (None, None) => break,
            (Some(_), None) => true,
            (None, Some(_)) => false,
            (Some(h), Some(r)) => h.0 <= r.0,
        };
        let (bound, id) = if take_held { next_held } else { next_rest }.expect("one is next");
        let past = |fits| {
            walk.stop_for(profile, take_held, fits)
                .is_some_and(|stop| bound > stop)
        };
        if past([true; 2]) {
            if take_held {
                held_done = true;
            } else {
                rest_done = true;
            }
            continue;
        }
        if take_held {
            held.next();
        } else {
            rest.next();
        }
        let fits = roles.map_or([true; 2], |role_of| ROLES.map(|fits| fits(role_of(id))));
        if !past(fits) {
            walk.consider(profile, request, candidate(id));
        }
    }
    if walk.standings.len() <= depth {
        return None;
    }
    if !walk.any_unsaturated {
        walk.any_unsaturated = order.unsaturated_serving(serving.0, serving.1).any(|id| {
            let c = candidate(id);
            rejection(profile, request, &c).is_none() && !saturated(profile, &c.load)
        });
    }
    let ranked = Ranked {
        all_saturated: !walk.any_unsaturated,
        depth,
        by_endpoint: true,
    };
    let mut decision = ranked.decide(profile, request, walk.candidates, walk.standings);
    if let Some(role_of) = roles {
        rank_role_heads(
            profile,
            request,
            walk.candidates,
            walk.standings,
            &mut decision,
            depth,
        );
        decision.saturated = decision.saturated || {
            let decoders = Decoders {
                profile,
                request,
                order,
                serving,
                role_of,
            };
            decoders.all_saturated(walk.candidates, &mut candidate)
        };
    }
    Some(decision)
}

/// A pruned P/D plan's decoders: whether every competing one is saturated, found from those
/// the walk costed and, past them, the order's.
struct Decoders<'a> {
    profile: &'a Profile,
    request: &'a RequestInfo,
    order: &'a LoadOrder,
    serving: (&'a str, usize),
    role_of: &'a dyn Fn(EndpointId) -> Role,
}

impl Decoders<'_> {
    /// Whether some decoder competes and every competing one is saturated, as
    /// [`super::decoders_saturated`] finds over every candidate: `costed` are the walk's
    /// competitors; past them, the order's decoders that may be unsaturated are viewed until
    /// one is. Whether one competes at all is known from `costed` alone: while fewer than
    /// `depth` decoders are costed, no stream ends ([`Walk::stop_for`]), so every endpoint of
    /// the request's order is met and every decoder met is costed (those outside the order,
    /// and those `rejection` turns away, compete in no plan): none costed means none competes.
    fn all_saturated(
        &self,
        costed: &[Candidate],
        candidate: &mut impl FnMut(EndpointId) -> Candidate,
    ) -> bool {
        let (profile, request) = (self.profile, self.request);
        let mut costed_decoders = costed.iter().filter(|c| c.role.decodes()).peekable();
        if costed_decoders.peek().is_none() {
            return false;
        }
        if costed_decoders.any(|c| !saturated(profile, &c.load)) {
            return false;
        }
        // The costed decoders are saturated: view only the others (a search among the costed,
        // not a scan of them per decoder: an unpruned walk may have costed the whole fleet).
        let (model, block_size) = self.serving;
        let mut costed_ids: Vec<EndpointId> = costed.iter().map(|c| c.endpoint).collect();
        costed_ids.sort_unstable();
        !self
            .order
            .unsaturated_serving(model, block_size)
            .filter(|&id| (self.role_of)(id).decodes() && costed_ids.binary_search(&id).is_err())
            .any(|id| {
                let c = candidate(id);
                rejection(profile, request, &c).is_none() && !saturated(profile, &c.load)
            })
    }
}
