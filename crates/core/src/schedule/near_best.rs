//! Ranking only the near-best candidates: the winner, the reason and the head of the ranking
//! that [`schedule`] gives, with the work per candidate cut to its cost.
//!
//! Every competing candidate's cost is still computed (arithmetic on its state, no
//! allocation): the winner is the cheapest or, among the near-equal costs, balancing's choice
//! (the most room left, then the fewest recent placements), and an idle fleet has hundreds of
//! near-equal endpoints, so no candidate can be skipped without changing some decision. What
//! is no longer done per candidate: the breakdown (an [`Assessment`], each term and tier), and
//! sorting the whole fleet. A plan's ranking is a retry list and only its head is read, so
//! only the best `depth` candidates are ranked and broken down. Pickers other than the
//! cheapest read every candidate (sampling, rotation, the hash ring): for them, and when
//! `depth` covers every competitor, this is [`schedule`] itself.

use std::cmp::Ordering;

use super::picker::{Held, NearEqual, RoomLeft, choose_balanced, tie_key, why_cheaper};
use super::role_heads::rank_role_heads;
use super::{
    Assessment, Candidate, Cost, Decision, Picker, Profile, Reason, RequestInfo, assess, cost,
    rejection, saturated, schedule,
};

/// A competing candidate's standing: what ranking and balancing compare.
#[derive(Clone, Copy, Debug)]
pub(super) struct Standing {
    /// Its position among the candidates.
    pub(super) at: usize,
    /// Its weighted cost, seconds.
    pub(super) total: f64,
    /// Of that, the weighted seconds due to what it would compute ([`Cost::cache_part`]).
    pub(super) computed: f64,
    /// Its random tie-break key.
    pub(super) tie: u64,
    /// Its recent placements (not negative).
    pub(super) placements: f64,
    /// The room the placement leaves ([`Cost::free_blocks_left`]).
    pub(super) room: RoomLeft,
    /// What balancing must not give up of it.
    pub(super) held: Held,
}

impl Standing {
    /// The standing of `c`, at position `at`, whose cost under `profile` is `cost` and that
    /// holds `cached` prompt tokens.
    pub(super) fn of(
        profile: &Profile,
        c: &Candidate,
        at: usize,
        cost: &Cost,
        cached: usize,
        random: u64,
    ) -> Self {
        Standing {
            at,
            total: cost.total_s,
            computed: cost.cache_part(profile),
            tie: tie_key(random, c.endpoint.0),
            placements: c.load.recent_placements.max(0.0),
            room: RoomLeft::of(cost),
            held: Held::new(cached, cost),
        }
    }
}

/// Cost order, exact ties broken at random: the order [`schedule`] ranks in.
pub(super) fn by_cost(a: &Standing, b: &Standing) -> Ordering {
    a.total.total_cmp(&b.total).then(a.tie.cmp(&b.tie))
}

/// Buffers [`schedule_near_best`] reuses: keep one per scheduler, so that a decision allocates
/// nothing per candidate.
#[derive(Debug, Default)]
pub struct RankBuffers {
    standings: Vec<Standing>,
}

impl RankBuffers {
    /// Completes `decision`, which the last [`schedule_near_best`] call made of `candidates`
    /// for `request`, with the best `depth` competitors of each role, for a fleet of prefill and
    /// decode roles (see `schedule/role_heads.rs`): from the costs that call computed, none
    /// computed again. Nothing is added when that call ranked every competitor.
    pub fn rank_role_heads(
        &self,
        profile: &Profile,
        request: &RequestInfo,
        candidates: &[Candidate],
        decision: &mut Decision,
        depth: usize,
    ) {
        let depth = depth.max(2);
        rank_role_heads(
            profile,
            request,
            candidates,
            &self.standings,
            decision,
            depth,
        );
    }
}

/// Ranks the best `depth` (at least 2) of `candidates` for `request` under `profile`: the
/// same winner, reason, saturation and first `depth` of the ranking as [`schedule`], with
/// breakdowns for the ranked candidates only. `random` and `round_robin` as for [`schedule`].
pub fn schedule_near_best(
    profile: &Profile,
    request: &RequestInfo,
    candidates: &[Candidate],
    random: u64,
    round_robin: u64,
    depth: usize,
    buffers: &mut RankBuffers,
) -> Decision {
    let depth = depth.max(2);
    let standings = &mut buffers.standings;
    standings.clear();
    if profile.picker != Picker::Cheapest || candidates.len() <= depth {
        return schedule(profile, request, candidates, random, round_robin);
    }
    let mut all_saturated = true;
    for (at, c) in candidates.iter().enumerate() {
        if rejection(profile, request, c).is_some() {
            continue;
        }
        let (cost, cached) = cost::assess(profile, request, c);
        all_saturated &= saturated(profile, &c.load);
        standings.push(Standing::of(profile, c, at, &cost, cached.all, random));
    }
    if standings.len() <= depth {
        // Every competitor is ranked anyway (and a fleet with none competing reports why).
        standings.clear();
        return schedule(profile, request, candidates, random, round_robin);
    }
    let ranked = Ranked {
        all_saturated,
        depth,
        by_endpoint: false,
    };
    ranked.decide(profile, request, candidates, standings)
}

/// How [`Ranked::decide`] finishes a decision from the competitors' standings.
pub(super) struct Ranked {
    /// Every competitor is saturated.
    pub(super) all_saturated: bool,
    /// Candidates ranked and broken down.
    pub(super) depth: usize,
    /// Breakdowns in endpoint order (else in the candidates' order).
    pub(super) by_endpoint: bool,
}

impl Ranked {
    /// The decision from `standings` (more than `depth` of them) of `candidates`: the winner,
    /// reason and the head of the ranking that [`schedule`] gives when every competitor whose
    /// cost can reach the head or the balance limit has a standing.
    pub(super) fn decide(
        &self,
        profile: &Profile,
        request: &RequestInfo,
        candidates: &[Candidate],
        standings: &mut [Standing],
    ) -> Decision {
        let depth = self.depth;
        let cheapest = *standings
            .iter()
            .min_by(|a, b| by_cost(a, b))
            .expect("more competitors than the depth");
        // Balancing, as `picker::balance`.
        let near_equal =
            NearEqual::around(profile, cheapest.total, cheapest.computed, cheapest.held);
        let near = standings
            .iter()
            .filter(|s| near_equal.admits(s.total, s.held));
        let near_count = near.clone().count();
        let (chosen, all_equal) = choose_balanced(
            &near_equal,
            near.clone().copied(),
            |s| s.placements,
            |s| s.room,
            |a, b| by_cost(&a, &b).is_lt(),
        )
        .expect("the cheapest is near-equal to itself");
        let all_tied = near
            .clone()
            .all(|s| (s.total - cheapest.total).abs() < 1e-12);
        // The head of the cost order.
        standings.select_nth_unstable_by(depth - 1, by_cost);
        let head = &mut standings[..depth];
        head.sort_unstable_by(by_cost);
        let mut ranked: Vec<usize> = head.iter().map(|s| s.at).collect();
        let cost_of = |at: usize| cost::assess(profile, request, &candidates[at]).0;
        let reason = if near_count > 1 && (!all_equal || all_tied) {
            // Balancing's choice moves to the front.
            if let Some(position) = ranked.iter().position(|&at| at == chosen.at) {
                ranked.remove(position);
            } else {
                ranked.pop();
            }
            ranked.insert(0, chosen.at);
            if all_equal {
                Reason::Tie
            } else {
                Reason::Balance
            }
        } else {
            why_cheaper(&cost_of(ranked[0]), &cost_of(ranked[1]))
        };
        let mut broken_down = ranked.clone();
        if self.by_endpoint {
            broken_down.sort_unstable_by_key(|&at| candidates[at].endpoint);
        } else {
            broken_down.sort_unstable();
        }
        let assessments: Vec<Assessment> = broken_down
            .iter()
            .map(|&at| assess(profile, request, &candidates[at]))
            .collect();
        Decision {
            ranking: ranked.iter().map(|&at| candidates[at].endpoint).collect(),
            assessments,
            reason,
            saturated: self.all_saturated,
            copy: None,
        }
    }
}
