//! What a plan reads of each role on a fleet of prefill and decode roles (P/D): the head of each
//! role, not only the head of the fleet, and whether the decoders are saturated.
//!
//! On a large fleet the head of the cost order may hold a single role (idle dedicated producers
//! are the cheapest whole-request candidates), while the P/D decision pairs the best decoder
//! with the best producers. So a P/D plan ranks and breaks down the best `depth` competitors of
//! each role too, appended to the fleet's head in cost order (each costs at least as much as
//! every candidate ranked after the first, which balancing may have moved to the front). Both
//! the near-best plan ([`super::schedule_near_best`]) and the pruned one
//! ([`super::schedule_pruned`]) finish with [`rank_role_heads`] over the costs they computed: no
//! cost is computed again, only the breakdowns of the few candidates added. Ties are broken as
//! the fleet's ranking breaks them ([`by_cost`]: the request's random key), so that both plans
//! rank the same endpoints and equal idle producers share the work.

use super::near_best::{Standing, by_cost};
use super::{Candidate, Decision, Profile, RequestInfo, Role, assess, rejection, saturated};

/// The roles whose heads a P/D plan ranks: which endpoints can decode, which can prefill.
pub(super) const ROLES: [fn(Role) -> bool; 2] = [Role::decodes, Role::prefills];

/// Completes `decision` (the head of the fleet, ranked and broken down) with the best `depth`
/// of each role among `standings` (the costs of the competitors of `candidates` a plan
/// computed): those not ranked yet are appended in cost order with their breakdowns.
/// `standings` holding no more than the ranking (every competitor ranked) adds nothing.
pub(super) fn rank_role_heads(
    profile: &Profile,
    request: &RequestInfo,
    candidates: &[Candidate],
    standings: &[Standing],
    decision: &mut Decision,
    depth: usize,
) {
    let mut added: Vec<Standing> = Vec::new();
    let mut head: Vec<Standing> = Vec::with_capacity(standings.len());
    for fits in ROLES {
        head.clear();
        head.extend(
            standings
                .iter()
                .filter(|s| fits(candidates[s.at].role))
                .copied(),
        );
        if head.len() > depth {
            head.select_nth_unstable_by(depth - 1, by_cost);
            head.truncate(depth);
        }
        for s in &head {
            let ranked = decision.ranking.contains(&candidates[s.at].endpoint);
            if !ranked && !added.iter().any(|a| a.at == s.at) {
                added.push(*s);
            }
        }
    }
    added.sort_unstable_by(by_cost);
    for s in added {
        let c = &candidates[s.at];
        decision.ranking.push(c.endpoint);
        decision.assessments.push(assess(profile, request, c));
    }
    decision.assessments.sort_by_key(|a| a.endpoint);
}

/// Whether flow control may hold a request under P/D, its plan's verdict over every competitor
/// of `candidates` being `planned`: every competing decode-capable candidate is saturated.
/// Split or whole, the request decodes on a decode-capable endpoint whenever one competes, so
/// idle dedicated producers are no room for it; only when none competes is it served whole
/// where the plan ranks, and the verdict over every competitor stands.
pub fn decoders_saturated(
    profile: &Profile,
    request: &RequestInfo,
    candidates: &[Candidate],
    planned: bool,
) -> bool {
    if planned {
        // Every competitor is saturated, the decode-capable ones too (or none competes).
        return true;
    }
    let mut decoders = candidates
        .iter()
        .filter(|c| c.role.decodes() && rejection(profile, request, c).is_none())
        .peekable();
    decoders.peek().is_some() && decoders.all(|c| saturated(profile, &c.load))
}
