//! [`RecentUse::parts`] against a block-by-block model of vLLM's eviction order.

use std::collections::HashSet;

use proptest::prelude::*;

use super::*;
use crate::schedule::recency::MAX_PARTS;

const BLOCK: usize = 16;

/// An admission on an endpoint where no request has ended yet: nothing says when the in-flight
/// ones end, so every pin holds.
const NO_TIMING: Admission = Admission {
    at: 0.0,
    fallback_decode_s: None,
};

/// A chain of a tree of prompts: a tenant's context, a conversation under it, a turn of that
/// conversation (each key names its whole prefix, as router keys do).
fn chain(
    tenant: u64,
    context: u64,
    conversation: u64,
    turns: u64,
    turn: u64,
    own: u64,
) -> Vec<RouterKey> {
    let mut keys: Vec<RouterKey> = (0..context)
        .map(|i| RouterKey(tenant * 1_000 + i + 1))
        .collect();
    let base = 1_000_000 + tenant * 100_000 + conversation * 1_000;
    keys.extend((0..turns).map(|i| RouterKey(base + i + 1)));
    let base =
        100_000_000 + tenant * 10_000_000 + conversation * 1_000_000 + turns * 10_000 + turn * 100;
    keys.extend((0..own).map(|i| RouterKey(base + i + 1)));
    keys
}

fn a_chain() -> impl Strategy<Value = Vec<RouterKey>> {
    (0u64..3, 0u64..4, 0u64..12, 0u64..4, 0u64..8)
        .prop_map(|(t, c, turns, turn, own)| chain(t, 6 + 4 * t, c, turns, turn, own))
}

/// An endpoint with `inflight` requests pinning their chains (one extra block each) and
/// `ended` ones remembered, oldest first.
fn endpoint(inflight: &[Vec<RouterKey>], ended: &[Vec<RouterKey>]) -> (PinnedBlocks, RecentUse) {
    let mut pinned = PinnedBlocks::default();
    for (id, keys) in inflight.iter().enumerate() {
        pinned.pin(
            id as u64,
            Arc::new(keys.clone()),
            keys.len() * BLOCK + 3,
            BLOCK,
            0.0,
            0.0,
        );
    }
    let mut recent = RecentUse::default();
    for keys in ended {
        recent.ended(Arc::new(keys.clone()), 0.0);
    }
    (pinned, recent)
}

/// Lost blocks of the first `held` of `prompt`, block by block: a block pinned by an in-flight
/// request is never lost; one last used by an ended request is lost when the distinct blocks
/// newer than it (in-flight keys, newer ended requests' keys, the pinned extra blocks) and the
/// blocks of its own stretch before it and itself exceed `capacity`; one used by none of them
/// (or past the [`MAX_PARTS`]th stretch) survives with probability `survival`.
fn lost_by_model(
    inflight: &[Vec<RouterKey>],
    extra_blocks: usize,
    ended: &[Vec<RouterKey>],
    prompt: &[RouterKey],
    held: usize,
    capacity: usize,
    survival: f64,
) -> f64 {
    let pinned: HashSet<RouterKey> = inflight.iter().flatten().copied().collect();
    let mut lost = 0.0;
    let mut stretches = 0;
    let mut stretch: Option<(usize, usize)> = None; // (last user, first block)
    for (j, key) in prompt[..held].iter().enumerate() {
        if pinned.contains(key) {
            continue;
        }
        let Some(user) = (0..ended.len()).rev().find(|&u| ended[u].contains(key)) else {
            lost += 1.0 - survival;
            continue;
        };
        if stretch.is_none_or(|(u, _)| u != user) {
            stretch = Some((user, j));
            stretches += 1;
        }
        if stretches > MAX_PARTS {
            lost += 1.0 - survival;
            continue;
        }
        let first = stretch.map_or(j, |(_, first)| first);
        let mut newer = pinned.clone();
        newer.extend(ended[user + 1..].iter().flatten().copied());
        if newer.len() + extra_blocks + (j - first + 1) > capacity {
            lost += 1.0;
        }
    }
    lost
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn parts_price_every_block_as_the_eviction_order_does(
        inflight in prop::collection::vec(a_chain(), 0..4),
        ended in prop::collection::vec(a_chain(), 0..24),
        prompt in a_chain(),
        held_share in 0.0f64..=1.0,
        capacity in 1usize..120,
        survival in prop::sample::select(vec![0.0, 0.5, 1.0]),
    ) {
        let (pinned, recent) = endpoint(&inflight, &ended);
        let held = (prompt.len() as f64 * held_share).round() as usize;
        let model = lost_by_model(
            &inflight, pinned.extra_blocks(), &ended, &prompt, held, capacity, survival,
        );
        match recent.parts(&pinned, &prompt, held, capacity, true, &NO_TIMING) {
            Some(parts) => {
                let lost = parts.lost(held as u32, capacity as f64, survival);
                prop_assert!((lost - model).abs() < 1e-9, "parts {parts:?}: {lost} against {model}");
            }
            None => prop_assert!(false, "an overflowing queue always walks"),
        }
        // Without an overflowing queue, a walk is skipped only where nothing can be lost.
        if recent.parts(&pinned, &prompt, held, capacity, false, &NO_TIMING).is_none() {
            let model = lost_by_model(
                &inflight, pinned.extra_blocks(), &ended, &prompt, held, capacity, 1.0,
            );
            prop_assert_eq!(model, 0.0);
        }
    }
}

/// An LRU cache of `capacity` blocks, replayed block by block as vLLM runs it: each ended
/// request in turn takes its blocks (a block not cached evicts the free one freed longest ago)
/// and frees them, last block first; then the in-flight requests take theirs and pin them,
/// with `extra_blocks` more. Returns how many leading blocks of `prompt` were cached before the
/// in-flight requests came, and after.
fn lru_replay(
    ended: &[Vec<RouterKey>],
    inflight: &[Vec<RouterKey>],
    extra_blocks: usize,
    prompt: &[RouterKey],
    capacity: usize,
) -> (usize, usize) {
    use std::collections::HashMap;
    // Cached blocks: when each was freed (`None`: in use, never evicted).
    let mut cache: HashMap<RouterKey, Option<u64>> = HashMap::new();
    let mut anonymous = 0; // pinned blocks outside any chain
    let mut clock = 0u64;
    let take =
        |cache: &mut HashMap<RouterKey, Option<u64>>, anonymous: usize, key: Option<RouterKey>| {
            if let Some(k) = key
                && let Some(state) = cache.get_mut(&k)
            {
                *state = None;
                return true;
            }
            if cache.len() + anonymous >= capacity {
                let victim = cache
                    .iter()
                    .filter_map(|(k, freed)| freed.map(|at| (at, *k)))
                    .min();
                let Some((_, victim)) = victim else {
                    return false; // everything is in use: no room
                };
                cache.remove(&victim);
            }
            if let Some(k) = key {
                cache.insert(k, None);
            }
            true
        };
    for chain in ended {
        for key in chain {
            take(&mut cache, anonymous, Some(*key));
        }
        for key in chain.iter().rev() {
            clock += 1;
            if let Some(state) = cache.get_mut(key) {
                *state = Some(clock);
            }
        }
    }
    let cached = |cache: &HashMap<RouterKey, Option<u64>>| {
        prompt.iter().take_while(|k| cache.contains_key(k)).count()
    };
    let before = cached(&cache);
    for key in inflight.iter().flatten() {
        take(&mut cache, anonymous, Some(*key));
    }
    for _ in 0..extra_blocks {
        if take(&mut cache, anonymous, None) {
            anonymous += 1;
        }
    }
    (before, cached(&cache))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Where the window holds every request the cache has seen, the parts' loss is what an LRU
    /// cache replayed block by block loses (a check of the model, independent of its counting).
    #[test]
    fn parts_lose_what_an_lru_cache_replayed_block_by_block_loses(
        inflight in prop::collection::vec(a_chain(), 0..4),
        ended in prop::collection::vec(a_chain(), 1..24),
        prompt in a_chain(),
        capacity in 40usize..160,
    ) {
        let (pinned, recent) = endpoint(&inflight, &ended);
        // The in-flight requests fit in the cache together (else some wait, and which is not
        // this model's question).
        prop_assume!(pinned.blocks() <= capacity);
        let (held, kept) =
            lru_replay(&ended, &inflight, pinned.extra_blocks(), &prompt, capacity);
        let parts = recent
            .parts(&pinned, &prompt, held, capacity, true, &NO_TIMING)
            .expect("an overflowing queue always walks");
        // Past the parts kept, blocks are of unknown age: not this check's.
        prop_assume!(parts.known() as usize >= held);
        let lost = parts.lost(held as u32, capacity as f64, 1.0);
        prop_assert_eq!(lost, held.saturating_sub(kept) as f64, "{:?}", parts);
    }
}

#[test]
fn a_context_every_question_reuses_counts_once() {
    // A tenant's 20-block context, then 30 questions of 2 blocks each under it, ended; the
    // 31st question's prompt holds the context. The prompt-count model saw 30 × 22 = 660
    // blocks used since the context; the distinct blocks are 20 + 60 = 80.
    let context: Vec<RouterKey> = (1..=20).map(RouterKey).collect();
    let question = |q: u64| {
        let mut keys = context.clone();
        keys.extend([RouterKey(1_000 + 2 * q), RouterKey(1_001 + 2 * q)]);
        Arc::new(keys)
    };
    let mut recent = RecentUse::default();
    for q in 0..30 {
        recent.ended(question(q), 0.0);
    }
    let prompt = question(30);
    let parts = recent
        .parts(&PinnedBlocks::default(), &prompt, 20, 100, true, &NO_TIMING)
        .expect("walked");
    // The newest question used the whole context: nothing is newer than it.
    assert_eq!(
        parts.parts(),
        &[RecencyPart {
            from: 0,
            to: 20,
            newer: 0
        }]
    );
    assert_eq!(parts.lost(20, 100.0, 1.0), 0.0);
}

#[test]
fn the_window_keeps_the_newest_requests() {
    let mut recent = RecentUse::default();
    for r in 0..(ENDED_KEPT as u64 + 10) {
        recent.ended(Arc::new(vec![RouterKey(r + 1)]), 0.0);
    }
    assert_eq!(recent.ended.len(), ENDED_KEPT);
    assert_eq!(recent.ended.front().map(|k| k[0]), Some(RouterKey(11)));
    assert_eq!(recent.longest, 1);
    let long = Arc::new(
        (0..KEYS_KEPT as u64)
            .map(|k| RouterKey(10_000 + k))
            .collect::<Vec<_>>(),
    );
    recent.ended(long, 0.0);
    assert_eq!(
        recent.ended.len(),
        1,
        "a chain of the whole budget leaves room for no other"
    );
    assert_eq!(recent.keys, KEYS_KEPT);
    // One longer than the budget is kept alone: the newest request is always known.
    let longer = Arc::new((0..KEYS_KEPT as u64 + 5).map(RouterKey).collect::<Vec<_>>());
    recent.ended(longer, 0.0);
    assert_eq!(recent.ended.len(), 1);
    assert_eq!(recent.keys, KEYS_KEPT + 5);
    assert_eq!(recent.longest, KEYS_KEPT + 5);
    // The longest chain leaves the window: the next longest is what is kept.
    recent.ended(Arc::new(vec![RouterKey(1), RouterKey(2)]), 0.0);
    assert_eq!(recent.ended.len(), 1);
    assert_eq!(recent.longest, 2);
    recent.clear();
    assert!(recent.ended.is_empty());
    assert!(recent.ended_at.is_empty());
    assert_eq!(recent.longest, 0);
}

/// Two tenants' 40-block contexts, each question 2 blocks more; `a_questions` of tenant A then
/// `b_questions` of tenant B ended here, one every 0.1 s from t = 0.
fn two_tenants(
    a_questions: u64,
    b_questions: u64,
) -> (RecentUse, impl Fn(u64, u64) -> Vec<RouterKey>) {
    let question = |tenant: u64, q: u64| {
        let mut keys: Vec<RouterKey> = (0..40).map(|i| RouterKey(tenant * 1_000 + i + 1)).collect();
        keys.extend([
            RouterKey(100_000 + tenant * 1_000 + 2 * q),
            RouterKey(100_001 + tenant * 1_000 + 2 * q),
        ]);
        keys
    };
    let mut recent = RecentUse::default();
    let tenants = std::iter::repeat_n(1, a_questions as usize)
        .chain(std::iter::repeat_n(2, b_questions as usize));
    for (at, tenant) in tenants.enumerate() {
        recent.ended(Arc::new(question(tenant, at as u64)), at as f64 * 0.1);
    }
    (recent, question)
}

#[test]
fn requests_that_would_not_fit_beside_one_are_counted_at_their_rate() {
    // 10 questions of tenant A, then 10 of B, one every 0.1 s: at t = 2.0, 19 over 2 s.
    let (recent, question) = two_tenants(10, 10);
    let a = question(1, 99);
    // A cache of 80 blocks: a 43-block request of A fits beside A's (they share 40 blocks) and
    // not beside B's (43 + 42 + 1 > 80).
    let per_s = recent.not_fitting_per_s(&a, 43, 80, 2.0);
    assert!((per_s - 19.0 / 2.0 * 10.0 / 20.0).abs() < 1e-9, "{per_s}");
    // Of B's kind: A's questions are the ones that would not fit.
    let b = question(2, 99);
    assert!((recent.not_fitting_per_s(&b, 43, 80, 2.0) - per_s).abs() < 1e-9);
    // A cache that holds both: nothing waits.
    assert_eq!(recent.not_fitting_per_s(&a, 43, 90, 2.0), 0.0);
    // The rate falls as time passes with nothing new ending here.
    assert!(recent.not_fitting_per_s(&a, 43, 80, 20.0) < per_s / 5.0);
}

#[test]
fn a_request_of_the_only_kind_here_blocks_nothing() {
    let (recent, question) = two_tenants(20, 0);
    assert_eq!(recent.not_fitting_per_s(&question(1, 99), 43, 80, 2.0), 0.0);
    // Too little seen to say how often requests come: nothing is charged.
    let (one, question) = two_tenants(0, 1);
    assert_eq!(one.not_fitting_per_s(&question(1, 99), 43, 80, 2.0), 0.0);
}

#[test]
fn hits_are_counted_at_their_depth_in_the_eviction_order() {
    // A 16-block context used by the last request that ended, then 32 blocks of other
    // requests' own; a cache of 160 blocks (buckets of 10).
    let context = chain(0, 16, 0, 0, 0, 0);
    let newest = chain(0, 16, 1, 0, 0, 8);
    let others: Vec<Vec<RouterKey>> = (0..4).map(|c| chain(1, 0, c, 0, 0, 8)).collect();
    let mut ended = others.clone();
    ended.push(newest);
    let (pinned, recent) = endpoint(&[], &ended);
    let depths = recent.hit_depths(&pinned, &context, 16, 160);
    // Nothing newer than the newest request: its first 16 blocks are at depths 0 to 16.
    assert_eq!(depths.iter().sum::<f64>(), 16.0);
    assert!((depths[0] - 10.0).abs() < 1e-9, "{depths:?}");
    assert!((depths[1] - 6.0).abs() < 1e-9, "{depths:?}");
    // A context only the oldest request used lies past everything newer: the four others'
    // 8 blocks each, so at depths 32 to 48.
    let ended = [vec![context.clone()], others].concat();
    let (pinned, recent) = endpoint(&[], &ended);
    let depths = recent.hit_depths(&pinned, &context, 16, 160);
    assert_eq!(depths[..3].iter().sum::<f64>(), 0.0, "{depths:?}");
    assert!(
        (depths[3] - 8.0).abs() < 1e-9 && (depths[4] - 8.0).abs() < 1e-9,
        "{depths:?}"
    );
    // Blocks no kept request used: spread from there to the end of the cache.
    let (pinned, recent) = endpoint(&[], &[]);
    let depths = recent.hit_depths(&pinned, &context, 16, 160);
    assert!(depths.iter().all(|&d| (d - 1.0).abs() < 1e-9), "{depths:?}");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// The walk kept between plans is the walk made afresh, whatever changed since: requests
    /// sent there, one in flight ending, more ended.
    #[test]
    fn the_kept_walk_follows_every_change_of_the_requests(
        inflight in prop::collection::vec(a_chain(), 0..4),
        sent in prop::collection::vec(a_chain(), 0..3),
        ended in prop::collection::vec(a_chain(), 0..16),
        ended_later in prop::collection::vec(a_chain(), 0..4),
        prompt in a_chain(),
        capacity in 1usize..120,
    ) {
        let (mut pinned, mut recent) = endpoint(&inflight, &ended);
        let held = prompt.len();
        let parts = |pinned: &PinnedBlocks, recent: &RecentUse| {
            (
                recent.parts(pinned, &prompt, held, capacity, true, &NO_TIMING),
                recent.hit_depths(pinned, &prompt, held, capacity),
            )
        };
        parts(&pinned, &recent);
        for (i, keys) in sent.iter().enumerate() {
            pinned.pin(100 + i as u64, Arc::new(keys.clone()), keys.len() * BLOCK + 3, BLOCK, 0.0, 0.0);
            parts(&pinned, &recent);
        }
        if !inflight.is_empty() {
            pinned.unpin(0, 1.0, None);
        }
        for keys in &ended_later {
            parts(&pinned, &recent);
            recent.ended(Arc::new(keys.clone()), 1.0);
        }
        let still: Vec<Vec<RouterKey>> = inflight.iter().skip(1).chain(&sent).cloned().collect();
        let all_ended: Vec<Vec<RouterKey>> = ended.iter().chain(&ended_later).cloned().collect();
        let (fresh_pinned, fresh_recent) = endpoint(&still, &all_ended);
        prop_assert_eq!(parts(&pinned, &recent), parts(&fresh_pinned, &fresh_recent));
    }
}

/// The traced case: a 246-block cache; tenant A's 186-block context pinned by a request of A
/// about to end, and two requests of tenant B queued ahead, each filling most of the cache.
/// A new request of A is admitted after them: the context is freed at the first one's end and
/// then evicted by B's blocks.
#[test]
fn a_prefix_pinned_only_by_a_request_ending_first_is_lost_to_the_queue_ahead() {
    let tenant = |t: u64, len: u64, own: u64| {
        let mut keys: Vec<RouterKey> = (0..len).map(|i| RouterKey(t * 10_000 + i + 1)).collect();
        keys.extend((0..8).map(|i| RouterKey(t * 10_000 + 5_000 + own * 10 + i)));
        Arc::new(keys)
    };
    let mut pinned = PinnedBlocks::default();
    // A request that ran here for 0.15 s after its first token: the decode time learned.
    pinned.pin(9, tenant(3, 4, 0), 300, BLOCK, 0.0, 0.0);
    pinned.first_token(9, 0.05);
    pinned.unpin(9, 0.2, Some(32));
    // Tenant A's request: first token at 0.95, so expected to end at 1.1.
    pinned.pin(1, tenant(1, 186, 1), 194 * BLOCK, BLOCK, 0.9, 0.0);
    pinned.first_token(1, 0.95);
    // Tenant B's two requests, queued (their prefills can end at 1.2 and 1.5 at the earliest).
    pinned.pin(2, tenant(2, 220, 2), 228 * BLOCK, BLOCK, 1.2, 0.0);
    pinned.pin(3, tenant(2, 220, 3), 228 * BLOCK, BLOCK, 1.5, 0.0);
    let recent = RecentUse::default();
    let prompt = tenant(1, 186, 4);
    let walk = |at: f64| {
        recent
            .parts(
                &pinned,
                &prompt,
                186,
                246,
                true,
                &Admission {
                    at,
                    fallback_decode_s: None,
                },
            )
            .expect("an overflowing queue walks")
    };
    // Admitted while A's request still runs: the context is pinned then, and found.
    assert_eq!(walk(1.05).lost(186, 246.0, 1.0), 0.0);
    // Admitted after B's requests (1.6 s): the context is the newest freed part, with B's
    // 236 distinct blocks and their 4 output blocks newer than it (A's request's own 8 blocks
    // and its output go before it), in a 246-block cache: all but 6 are lost.
    let late = walk(1.6);
    assert_eq!(late.pinned, 0);
    assert_eq!(late.lost(186, 246.0, 1.0), 180.0);
}

/// [`lost_by_model`] where the in-flight requests end at known times (`ends`, each expected
/// to end at its time) and the request is admitted at `admitted_at`: a block a request still
/// running then pins is never lost; one only requests ending first pin is freed when the
/// last of those pinning more than what stays pinned ends, and lost when the distinct blocks
/// of the requests ending after that (keys and one extra block each) and its stretch up to it
/// exceed `capacity`; an ended request's block is priced as before, every in-flight block
/// newer than it. Blocks of unknown age survive.
fn lost_by_timed_model(
    inflight: &[(Vec<RouterKey>, f64)],
    admitted_at: f64,
    ended: &[Vec<RouterKey>],
    prompt: &[RouterKey],
    capacity: usize,
) -> f64 {
    let contains = |chain: &[RouterKey], j: usize| chain.get(j) == Some(&prompt[j]);
    let held = (0..prompt.len())
        .take_while(|&j| {
            inflight
                .iter()
                .any(|(c, end)| *end > admitted_at && contains(c, j))
        })
        .count();
    let pinned = (0..prompt.len())
        .take_while(|&j| inflight.iter().any(|(c, _)| contains(c, j)))
        .count();
    let mut lost = 0.0;
    if pinned > held {
        let freed_at = inflight
            .iter()
            .filter(|(c, _)| contains(c, held))
            .map(|(_, end)| *end)
            .fold(f64::NEG_INFINITY, f64::max);
        let later: Vec<&Vec<RouterKey>> = inflight
            .iter()
            .filter(|(_, end)| *end > freed_at)
            .map(|(c, _)| c)
            .collect();
        let distinct: HashSet<RouterKey> = later.iter().flat_map(|c| c.iter().copied()).collect();
        let newer = distinct.len() + later.len();
        for j in held..pinned {
            if newer + (j - held + 1) > capacity {
                lost += 1.0;
            }
        }
    }
    let chains: Vec<Vec<RouterKey>> = inflight.iter().map(|(c, _)| c.clone()).collect();
    let rest = lost_by_model(
        &chains,
        chains.len(),
        ended,
        prompt,
        prompt.len(),
        capacity,
        1.0,
    );
    lost + rest
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn a_prefix_freed_before_admission_is_priced_as_the_eviction_order_does(
        inflight in prop::collection::vec((a_chain(), 0u32..10), 1..5),
        ended in prop::collection::vec(a_chain(), 0..12),
        prompt in a_chain(),
        admitted in 0u32..12,
        capacity in 1usize..120,
    ) {
        // Each in-flight request's prefill can end at a tenth of a second times its draw; it
        // runs 0.05 s past that, so no end falls on the admission.
        const DECODE_S: f64 = 0.05;
        let timed: Vec<(Vec<RouterKey>, f64)> = inflight
            .iter()
            .map(|(c, t)| (c.clone(), f64::from(*t) * 0.1 + DECODE_S))
            .collect();
        let mut pinned = PinnedBlocks::default();
        for (id, (keys, t)) in inflight.iter().enumerate() {
            pinned.pin(
                id as u64,
                Arc::new(keys.clone()),
                keys.len() * BLOCK + 3,
                BLOCK,
                f64::from(*t) * 0.1, 0.0,
            );
        }
        let mut recent = RecentUse::default();
        for keys in &ended {
            recent.ended(Arc::new(keys.clone()), 0.0);
        }
        let admission = Admission {
            at: f64::from(admitted) * 0.1,
            fallback_decode_s: Some(DECODE_S),
        };
        let parts = recent
            .parts(&pinned, &prompt, prompt.len(), capacity, true, &admission)
            .expect("an overflowing queue always walks");
        // The model counts stretches past the last part kept as of unknown age only for the
        // ended requests': keep to prompts whose parts are all kept.
        prop_assume!(parts.known() as usize >= prompt.len() || parts.parts().len() < MAX_PARTS);
        let lost = parts.lost(prompt.len() as u32, capacity as f64, 1.0);
        let model = lost_by_timed_model(&timed, admission.at, &ended, &prompt, capacity);
        prop_assert!((lost - model).abs() < 1e-9, "parts {parts:?}: {lost} against {model}");
    }
}
