//! Picking the winner among costed candidates.

use serde::{Deserialize, Serialize};

use super::ring;
use super::{Assessment, CacheSource, Cost, Profile, Reason};

/// How the winner is chosen.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Picker {
    /// The cheapest; among near-equal costs that give up no cached block (held for the request,
    /// held in GPU memory rather than loaded from a lower tier, or evicted by it), the one left
    /// the most free blocks, then the fewest recent placements; exact ties at random.
    #[default]
    Cheapest,
    /// Sample the winner with probability ∝ exp(−(cost − cheapest) / temperature_s): spreads
    /// load among near-equal choices, useful when several routers share a fleet.
    Softmax {
        /// Seconds of cost difference that make a choice e times less likely.
        temperature_s: f64,
    },
    /// Each competing candidate in turn, ignoring costs.
    RoundRobin,
    /// A uniformly random competing candidate.
    Random,
    /// Consistent hashing with bounded loads over the prompt's first `prefix_tokens` tokens
    /// (SGLang's `prefix_hash`): the prefix's home is the first endpoint clockwise from its hash
    /// on a ring of virtual nodes; an endpoint whose requests would exceed `(1 + epsilon)` ×
    /// the fleet's mean is skipped for the next one on the ring. Costs are ignored.
    PrefixHash {
        /// Leading prompt tokens hashed (rounded up to whole blocks).
        prefix_tokens: usize,
        /// Load bound above the mean (0.25: an endpoint takes at most 1.25 × the mean).
        epsilon: f64,
    },
}

impl Picker {
    /// The `prefix-hash` policy's picker with SGLang's defaults: the first 256 tokens, a bound
    /// of 1.25 × the mean load.
    pub fn prefix_hash() -> Picker {
        Picker::PrefixHash {
            prefix_tokens: 256,
            epsilon: 0.25,
        }
    }

    /// Leading prompt tokens the picker hashes (`None`: it reads no prefix).
    pub fn hashed_prefix_tokens(&self) -> Option<usize> {
        match self {
            Picker::PrefixHash { prefix_tokens, .. } => Some(*prefix_tokens),
            _ => None,
        }
    }
}

/// A deterministic per-candidate shuffle key from the random input.
pub(crate) fn tie_key(random: u64, endpoint: u32) -> u64 {
    let mut x = random ^ (u64::from(endpoint).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x
}

/// A uniform draw in [0, 1) from the random input.
fn unit(random: u64) -> f64 {
    (random >> 11) as f64 / (1u64 << 53) as f64
}

impl Picker {
    /// Indices of `competing` candidates, best first, and why the first won.
    pub(super) fn rank(
        &self,
        profile: &Profile,
        prefix_key: Option<u64>,
        assessments: &[Assessment],
        competing: &[usize],
        random: u64,
        round_robin: u64,
    ) -> (Vec<usize>, Reason) {
        let mut order = competing.to_vec();
        order.sort_by(|&a, &b| {
            let (x, y) = (&assessments[a], &assessments[b]);
            x.cost
                .total_s
                .total_cmp(&y.cost.total_s)
                .then_with(|| tie_key(random, x.endpoint.0).cmp(&tie_key(random, y.endpoint.0)))
        });
        match order.len() {
            0 => return (order, Reason::NoCandidate),
            1 => return (order, Reason::OnlyCandidate),
            _ => {}
        }
        match self {
            Picker::Cheapest => balance(profile, assessments, order),
            Picker::PrefixHash { epsilon, .. } => {
                // Without a key (an untokenized prompt) the random input stands in for it.
                let key = prefix_key.unwrap_or(random);
                (
                    ring::rank(assessments, competing, key, *epsilon),
                    Reason::PrefixHash,
                )
            }
            Picker::RoundRobin => {
                let mut by_id = competing.to_vec();
                by_id.sort_by_key(|&i| assessments[i].endpoint);
                let shift = (round_robin % by_id.len() as u64) as usize;
                by_id.rotate_left(shift);
                (by_id, Reason::RoundRobin)
            }
            Picker::Random => {
                order.sort_by_key(|&i| tie_key(random, assessments[i].endpoint.0));
                (order, Reason::Random)
            }
            Picker::Softmax { temperature_s } => {
                let t = temperature_s.max(1e-9);
                let best = assessments[order[0]].cost.total_s;
                let weights: Vec<f64> = order
                    .iter()
                    .map(|&i| (-(assessments[i].cost.total_s - best) / t).exp())
                    .collect();
                let sum: f64 = weights.iter().sum();
                let mut target = unit(random) * sum;
                let mut pick = order.len() - 1;
                for (k, w) in weights.iter().enumerate() {
                    if target < *w {
                        pick = k;
                        break;
                    }
                    target -= w;
                }
                let chosen = order.remove(pick);
                order.insert(0, chosen);
                (order, Reason::Softmax)
            }
        }
    }
}

/// The candidates balancing may choose among, around the cheapest: those whose cost is within
/// the tolerance of its ([`super::BalanceTolerance::limit`]), that hold at least as much of the
/// prompt, that load no more of it from lower tiers, and that evict no more cached blocks, where
/// the profile reads a cache and weighs evictions (the cache-blind baselines balance as they
/// always did). So balancing gives up no cached block: neither one the request would find, nor
/// one the placement pushes out of a cache, where others may find it, nor the GPU memory a block
/// is found in (a request balanced onto an endpoint that reloads the prefix from CPU memory keeps
/// a second, thrashing copy of it warm there). Evictions are compared as counts, not priced
/// reuse: a block evicted now is gone whatever its reuse estimate, and a count carries no
/// estimate's noise.
#[derive(Clone, Copy, Debug)]
pub(super) struct NearEqual {
    limit: f64,
    held: Held,
    weighs_cache_room: bool,
}

/// What balancing must not give up, of one candidate: the prompt tokens it holds, those of them
/// it loads from lower tiers ([`Cost::charged_tier_tokens`]: tokens, not seconds, so that noise
/// in the learned load rates decides nothing), and the cached blocks its placement evicts.
#[derive(Clone, Copy, Debug)]
pub(super) struct Held {
    /// Prompt tokens held.
    pub(super) cached: usize,
    /// Of those, tokens loaded from lower tiers at a charge.
    pub(super) tier_tokens: usize,
    /// Cached blocks the placement evicts.
    pub(super) evicted: f64,
}

impl Held {
    /// What a candidate holding `cached` prompt tokens at `cost` holds and evicts.
    pub(super) fn new(cached: usize, cost: &Cost) -> Self {
        Self {
            cached,
            tier_tokens: cost.charged_tier_tokens(),
            evicted: cost.evicted_blocks,
        }
    }

    /// What `a` holds and evicts.
    pub(super) fn of(a: &Assessment) -> Self {
        Self::new(a.cached_tokens, &a.cost)
    }
}

impl NearEqual {
    /// The test around the cheapest candidate under `profile`: its weighted cost `total`, of
    /// which `computed` is what it would compute ([`Cost::cache_part`]), and what it `held`.
    pub(super) fn around(profile: &Profile, total: f64, computed: f64, held: Held) -> Self {
        Self {
            limit: profile.balance.limit(total, computed),
            held,
            weighs_cache_room: profile.cache != CacheSource::None && profile.weights.eviction > 0.0,
        }
    }

    /// Whether a candidate of weighted cost `total` that holds and evicts what `held` says is
    /// near-equal to the cheapest.
    pub(super) fn admits(&self, total: f64, held: Held) -> bool {
        total <= self.limit
            && held.cached >= self.held.cached
            && held.tier_tokens <= self.held.tier_tokens
            && (!self.weighs_cache_room || held.evicted <= self.held.evicted + 1e-9)
    }

    /// The room a candidate's placement leaves and the blocks it may be overstated by, where
    /// the profile reads a cache and weighs evictions and the room is known, as balancing
    /// compares them ([`choose_balanced`]); `None` otherwise: the cache-blind baselines balance
    /// on placements alone, as they always did.
    fn room(&self, left: RoomLeft) -> Option<(f64, f64)> {
        let blocks = left.blocks.filter(|_| self.weighs_cache_room)?;
        Some((blocks, left.unseen))
    }
}

/// The room a candidate's placement leaves, as balancing compares it.
#[derive(Clone, Copy, Debug)]
pub(super) struct RoomLeft {
    /// GPU blocks the placement leaves free ([`Cost::free_blocks_left`]; `None`: unknown).
    pub(super) blocks: Option<f64>,
    /// Blocks by which `blocks` may overstate the room: those the router's in-flight requests
    /// hold or will hold unseen by its free-block count ([`Cost::unseen_blocks`]).
    pub(super) unseen: f64,
}

impl RoomLeft {
    /// The room a placement at `cost` leaves.
    pub(super) fn of(cost: &Cost) -> Self {
        Self {
            blocks: cost.free_blocks_left,
            unseen: cost.unseen_blocks,
        }
    }
}

/// Balancing's choice among the near-equal candidates `near` ([`NearEqual`]): of those the
/// placement leaves the most free blocks (`room_left`; every candidate when one's is unknown or
/// the profile is cache-blind, [`NearEqual::room`]), the fewest recent `placements`, the
/// `cheaper` first. With whether every candidate was equal in room and placements (the cost
/// order decides then). `None` when `near` is empty.
///
/// Room is compared only as far as it is known: rooms closer than the blocks the candidates'
/// in-flight requests hold or will hold unseen by the free-block count ([`RoomLeft::unseen`],
/// the most of any, at least one block) are the same room. A count that does not see a
/// request's last partial block and its output cannot tell two rooms apart by less (a
/// two-block difference, of blocks still being written, decided an early placement on the
/// small matrix and lost a light cell's p90 there).
pub(super) fn choose_balanced<T: Copy>(
    near_equal: &NearEqual,
    near: impl Iterator<Item = T> + Clone,
    placements: impl Fn(T) -> f64,
    room_left: impl Fn(T) -> RoomLeft,
    cheaper: impl Fn(T, T) -> bool,
) -> Option<(T, bool)> {
    let room = |t: T| near_equal.room(room_left(t));
    let known = near
        .clone()
        .map(room)
        .try_fold((f64::NEG_INFINITY, 1.0_f64), |(most, band), r| {
            r.map(|(blocks, unseen)| (most.max(blocks), band.max(unseen)))
        });
    let roomiest = |t: T| {
        known.is_none_or(|(most, band)| room(t).is_some_and(|(blocks, _)| blocks > most - band))
    };
    let chosen = near.clone().filter(|&t| roomiest(t)).reduce(|best, t| {
        match placements(t).total_cmp(&placements(best)) {
            std::cmp::Ordering::Less => t,
            std::cmp::Ordering::Equal if cheaper(t, best) => t,
            _ => best,
        }
    })?;
    let all_equal = near
        .clone()
        .all(|t| roomiest(t) && (placements(t) - placements(chosen)).abs() < 1e-9);
    Some((chosen, all_equal))
}

/// The cheapest-first `order`, with the winner moved forward from among the near-equal
/// candidates ([`NearEqual`]): the one the placement leaves the most free blocks
/// ([`Cost::free_blocks_left`], [`choose_balanced`]), where every one's is known and the
/// profile reads a cache ([`NearEqual::room`]); of those, the fewest recent placements. A new
/// working set placed where it fills the cache evicts the blocks of the others there at their
/// next requests, though the placement itself evicts nothing; where every cache is full, as in
/// steady state, each is left no room and placements alone decide.
fn balance(
    profile: &Profile,
    assessments: &[Assessment],
    mut order: Vec<usize>,
) -> (Vec<usize>, Reason) {
    let cheapest = &assessments[order[0]];
    let near_equal = NearEqual::around(
        profile,
        cheapest.cost.total_s,
        cheapest.cost.cache_part(profile),
        Held::of(cheapest),
    );
    let near: Vec<usize> = order
        .iter()
        .copied()
        .filter(|&i| near_equal.admits(assessments[i].cost.total_s, Held::of(&assessments[i])))
        .collect();
    if near.len() > 1 {
        // `near` is in cost order: among equal room and placements the cheaper (then random)
        // wins.
        let ((_, chosen), all_equal) = choose_balanced(
            &near_equal,
            near.iter().copied().enumerate(),
            |(_, i)| assessments[i].recent_placements,
            |(_, i)| RoomLeft::of(&assessments[i].cost),
            |(a, _), (b, _)| a < b,
        )
        .expect("near is not empty");
        let reason = if !all_equal {
            Reason::Balance
        } else if near
            .iter()
            .all(|&i| (assessments[i].cost.total_s - cheapest.cost.total_s).abs() < 1e-12)
        {
            Reason::Tie
        } else {
            // Placements and room were equal: the cheapest of the near-equal ones won on its
            // cost.
            let reason = why_cheaper(&assessments[order[0]].cost, &assessments[order[1]].cost);
            return (order, reason);
        };
        let at = order
            .iter()
            .position(|&i| i == chosen)
            .expect("chosen comes from order");
        let chosen = order.remove(at);
        order.insert(0, chosen);
        return (order, reason);
    }
    let reason = why_cheaper(&assessments[order[0]].cost, &assessments[order[1]].cost);
    (order, reason)
}

/// Whether the winner (cost `w`) beat the runner-up (cost `r`) mostly through what it holds,
/// its headroom, or the session credit.
pub(super) fn why_cheaper(w: &Cost, r: &Cost) -> Reason {
    let cache_gain =
        (r.prefill_s + r.tier_load_s + r.eviction_s) - (w.prefill_s + w.tier_load_s + w.eviction_s);
    let load_gain = (r.queue_s + r.decode_interference_s + r.room_blocking_s)
        - (w.queue_s + w.decode_interference_s + w.room_blocking_s);
    let session_gain = w.session_credit_s - r.session_credit_s;
    if session_gain > cache_gain.max(load_gain) && session_gain > 0.0 {
        Reason::Session
    } else if cache_gain >= load_gain && cache_gain > 0.0 {
        Reason::Cache
    } else if load_gain > 0.0 {
        Reason::Load
    } else {
        Reason::Tie
    }
}
