//! Rent or buy: when copying a shared prefix to another endpoint pays for itself over the
//! requests that follow.
//!
//! Each request's cost ([`super::cost`]) is its own: copying a system prompt, a tenant's
//! context or a document to a second endpoint costs its prefill once, while what the copy
//! saves is spread over every later request for that prefix. Judged one request at a time,
//! a copy never pays when its holder is only somewhat busier than the rest, so the holder
//! stays busier for good: the conversations of a popular system prompt pile onto one engine
//! and stall each other's decodes; an engine that took one document too many at start-up
//! keeps reloading it from CPU memory.
//!
//! This is the ski-rental problem, whose deterministic answer needs no forecast of demand:
//! keep paying the rent until the rent paid equals the price of buying, then buy (for one
//! prefix with a fixed price and rent, never more than twice the cost of the best choice made
//! knowing the future; here both are estimates, so the rule is that answer, not its bound).
//! - **Rent** is what a request for the prefix pays because no other endpoint holds it: its
//!   cost where it goes (a holder), less what it would cost on an endpoint that lacks the
//!   prefix had that endpoint held it in GPU memory (its own queue and stall, the holder's
//!   prefill and eviction; not the holder's loads from CPU memory or storage, which a copy
//!   in room saves). Taken against **every** competing endpoint that lacks it (the worst of
//!   them; of those the plan ranks, the best eight on a large fleet), it is a saving a copy
//!   would bring wherever it went; against the best one it would accrue from mere noise on a
//!   balanced fleet and buy copies that pay for nothing. It is signed: a
//!   request whose holder is cheaper than that pays back (the account never goes below zero),
//!   so what a balanced fleet's noise pays in, it pays back, and only a holder that stays
//!   busier than the rest accrues rent. The fleet keeps each prefix's rent, decayed over the
//!   time its reuse measures look back.
//! - **Buying** is the part of a candidate's cost that acquiring the prefix adds (its prefill
//!   of the missing part, the stall that imposes, what it evicts), in the share of the shared
//!   prefix's tokens among those it lacks: the rent pays for the shared prefix, not for a
//!   request's own part. The rent paid so far is credited against it, never more. Only a
//!   request that prefills its own part wherever it goes buys (a new conversation, a
//!   question): a later turn whose history its holder caches would prefill that history again
//!   with the copy, a cold prefill the latency tail shows, and leave it unused where it was; it
//!   pays rent, and the next new conversation buys.
//! - **Only into room no hit uses.** A copy that displaces blocks the endpoint's requests come
//!   back for moves the problem, it does not solve it (contexts evicting each other is how a
//!   fleet's hit rate collapses). A candidate is credited only where its capacity is known and
//!   the copy fits in its free blocks, or in the part of its cache deeper in the eviction order
//!   than its requests find their hits (`cold_blocks` of [`apply_rent`]: `None` where the
//!   capacity is unknown).

use serde::Serialize;

use super::{Assessment, Decision, Profile, Reason};
use crate::index::EndpointId;

/// A copy of the request's shared prefix bought with the rent its holders kept paying, or the
/// rent this request pays: what `/kvroute/v1/explain` shows.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct CopyRent {
    /// Tokens of the prompt shared with other prompts (the prefix the rent is kept for).
    pub shared_tokens: usize,
    /// Rent paid for it so far, seconds (decayed).
    pub rent_s: f64,
    /// What this request pays if it goes where the plan sends it, seconds: negative when its
    /// holder is cheaper than the busiest competing endpoint lacking the prefix would have been
    /// (0 when it buys a copy).
    pub paid_s: f64,
    /// Where the request goes when that endpoint lacks the prefix (a copy), with the credit
    /// the rent gave it: 0 when the plan copies the prefix on its own cost.
    pub bought: Option<(EndpointId, f64)>,
}

/// The request's shared prefix and what its requests paid so far.
#[derive(Clone, Copy, Debug)]
pub struct SharedPrefix {
    /// Tokens of the prompt shared with other prompts.
    pub tokens: usize,
    /// Tokens of the whole prompt.
    pub prompt_tokens: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Rent paid for it so far, seconds.
    pub rent_s: f64,
}

/// Applies the rent paid so far for the request's shared prefix to `decision`: when the chosen
/// endpoint holds the prefix and a competing candidate among the first `head` of the ranking
/// that lacks it, credited up to the rent against what acquiring the prefix adds to its cost,
/// comes out cheaper than the choice, that candidate is ranked first (a copy is bought),
/// unless the choice also holds a block or more of the request's own part (a later turn's
/// history): the request then pays rent and stays. `cold_blocks` gives the room in an
/// endpoint's cache past the depth where its requests find their hits, in blocks (`None` when
/// its capacity is unknown: no copy that might evict is credited there).
/// Returns the account's outcome; `None` when there is no shared prefix or no choice, or when
/// the choice holds the prefix and no ranked competitor lacks it (no rent to count). When the
/// choice itself lacks the prefix, the plan copies it on its own merits: `bought` names it
/// with no credit.
pub fn apply_rent(
    profile: &Profile,
    decision: &mut Decision,
    prefix: SharedPrefix,
    head: usize,
    cold_blocks: impl Fn(EndpointId) -> Option<f64>,
) -> Option<CopyRent> {
    let shared_tokens = prefix.tokens;
    if shared_tokens == 0 {
        return None;
    }
    let chosen = decision.chosen()?;
    let holder = decision.assessment(chosen)?;
    let rent_s = if prefix.rent_s.is_finite() {
        prefix.rent_s.max(0.0)
    } else {
        0.0
    };
    if holder.cached_tokens < shared_tokens {
        return Some(CopyRent {
            shared_tokens,
            rent_s,
            paid_s: 0.0,
            bought: Some((chosen, 0.0)),
        });
    }
    // A request that finds more than the shared prefix on its holder (a conversation's own
    // history) does not buy the copy: it would prefill that history again where the copy goes
    // and leave it unused where it was. A request that prefills its own part wherever it goes
    // (a new conversation, a question) buys it, and the conversations it starts follow.
    let uproots_own_part = holder.cached_tokens >= shared_tokens + prefix.block_size.max(1);
    let h = &holder.cost;
    let held_cost = h.total_s;
    let mut worst_recurring: Option<f64> = None;
    let mut best: Option<(f64, EndpointId, f64)> = None;
    let ranked = &decision.ranking[..head.min(decision.ranking.len())];
    for a in decision.assessments.iter().filter(|a| {
        a.rejected.is_none()
            && a.endpoint != chosen
            && a.cached_tokens < shared_tokens
            && a.cost.total_s.is_finite()
            && ranked.contains(&a.endpoint)
    }) {
        let recurring = recurring_s(profile, holder, a);
        worst_recurring = Some(worst_recurring.map_or(recurring, |w: f64| w.max(recurring)));
        if uproots_own_part || !fits(a, prefix, &cold_blocks) {
            continue;
        }
        // The rent was paid for the shared prefix: it buys that part of the copy, not the
        // request's own part, which is its own to pay for.
        let missing = prefix.prompt_tokens.saturating_sub(a.cached_tokens).max(1);
        let missing_shared = shared_tokens.saturating_sub(a.cached_tokens);
        let acquire =
            (a.cost.total_s - recurring).max(0.0) * missing_shared as f64 / missing as f64;
        let credit = rent_s.min(acquire);
        let credited = a.cost.total_s - credit;
        if best.is_none_or(|(b, _, _)| credited < b) {
            best = Some((credited, a.endpoint, credit));
        }
    }
    let worst_recurring = worst_recurring.filter(|w| w.is_finite())?;
    if let Some((credited, endpoint, credit)) = best
        && credited < held_cost
    {
        decision.ranking.retain(|e| *e != endpoint);
        decision.ranking.insert(0, endpoint);
        decision.reason = Reason::CopyRent;
        return Some(CopyRent {
            shared_tokens,
            rent_s,
            paid_s: 0.0,
            bought: Some((endpoint, credit)),
        });
    }
    Some(CopyRent {
        shared_tokens,
        rent_s,
        paid_s: held_cost - worst_recurring,
        bought: None,
    })
}

/// What the request would cost on `other` had `other` held what `holder` holds in its GPU
/// memory, weighted as [`super::Cost::total_s`] is: the holder's prefill and eviction, with
/// `other`'s queue and its stall per second of the holder's prefill, less `other`'s session
/// credit. The holder's loads from lower tiers are left out: a copy is credited only where it
/// fits in room no hit uses ([`fits`]), so there it stays in GPU memory, and what the holder
/// pays to load the prefix back (an engine holding more than its GPU memory keeps, reloading
/// each context from CPU memory in turn) is part of the rent a copy saves.
fn recurring_s(profile: &Profile, holder: &Assessment, other: &Assessment) -> f64 {
    let (h, c) = (&holder.cost, &other.cost);
    let w = &profile.weights;
    let stall_per_s = if c.stalling_s > 0.0 {
        c.decode_interference_s / c.stalling_s
    } else {
        0.0
    };
    w.prefix * h.prefill_s
        + w.eviction * h.eviction_s
        + w.load * (c.queue_s + h.prefill_s * stall_per_s)
        - c.session_credit_s
}

/// Whether the missing part of the shared prefix fits on `a` without evicting what its
/// requests come back for: its capacity is known, and the part fits in its free blocks or in
/// its cold room.
fn fits(
    a: &Assessment,
    prefix: SharedPrefix,
    cold_blocks: &impl Fn(EndpointId) -> Option<f64>,
) -> bool {
    let Some(room) = cold_blocks(a.endpoint) else {
        return false;
    };
    if a.cost.evicted_blocks <= 0.0 {
        return true;
    }
    let missing = prefix.tokens.saturating_sub(a.cached_tokens) / prefix.block_size.max(1);
    missing as f64 <= room
}
