//! What a placement evicts: blocks stored beyond the free ones, second GPU copies of a
//! reloaded prefix, what the queue ahead evicts before admission, and when copying a
//! prefix pays for its prefill and evictions.

use proptest::prelude::*;

use super::*;
use crate::tiers::LoadTier;

/// Seconds of prefill of `tokens` at the test fleet's rate.
fn prefill(tokens: f64) -> f64 {
    tokens / RATE
}

/// A prefix split by last use: `(from, to, newer)` per part, newest first, none pinned.
fn recency_parts(spans: &[(u32, u32, u32)]) -> RecencyParts {
    let mut parts = RecencyParts::new(0);
    for &(from, to, newer) in spans {
        parts.push(RecencyPart { from, to, newer });
    }
    parts
}

/// A fleet where endpoint 0 holds a 608-token shared prefix of a 1,000-token request and every
/// cache is full of blocks reused `reuse` times each; endpoint 0 has `queued` prefill tokens
/// waiting in one request.
fn copy_case(queued: u64, reuse: f64) -> (Vec<Candidate>, RequestInfo) {
    let mut cands = fleet(2);
    cands[0].cache.index = gpu_match(0, 38);
    for c in &mut cands {
        c.cache.free_blocks = Some(0.0);
        c.cache.block_reuse = reuse;
    }
    if queued > 0 {
        busy(&mut cands[0], 1, queued);
    }
    (cands, request(1_000))
}

#[test]
fn a_shared_prefix_is_copied_only_when_the_wait_saved_pays_for_its_prefill_and_evictions() {
    let profile = Profile::default();
    // Copying the prefix to endpoint 1 costs its prefill (608 tokens) and, with every cached
    // block reused, the re-prefill of the 38 blocks it evicts there.
    let copy_s = prefill(608.0) + prefill(38.0 * 16.0);
    let wait_per_token = 1.0 / RATE;
    // The wait saved: the queue's, and the stall its own 392-token prefill would impose on
    // the request queued there.
    let queue_for =
        |wait_s: f64| ((wait_s - profile.queue_wait_s - prefill(392.0)) / wait_per_token) as u64;
    // A wait above the prefill but below prefill plus evictions: the prefix stays.
    let (cands, req) = copy_case(queue_for(prefill(608.0) * 1.5), 1.0);
    assert_eq!(chosen(&profile, &req, &cands, 1), 0);
    // Above both: copying pays.
    let (cands, req) = copy_case(queue_for(copy_s * 1.2), 1.0);
    let d = schedule(&profile, &req, &cands, 1, 0);
    assert_eq!(d.chosen(), Some(EndpointId(1)));
    assert_eq!(d.reason, Reason::Load);
    // The same wait where nothing cached is ever reused: evicting is free, the copy pays at
    // its prefill alone.
    let (cands, req) = copy_case(queue_for(prefill(608.0) * 1.5), 0.0);
    assert_eq!(chosen(&profile, &req, &cands, 1), 1);
}

#[test]
fn eviction_is_charged_only_beyond_the_free_blocks() {
    let mut cands = fleet(2);
    for c in &mut cands {
        c.cache.block_reuse = 0.5;
    }
    cands[0].cache.free_blocks = Some(10.0);
    cands[1].cache.free_blocks = None;
    let d = schedule(&Profile::default(), &request(640), &cands, 1, 0);
    // 40 blocks stored, 10 fit: 30 evicted, each reused half the time.
    let a = d.assessment(EndpointId(0)).unwrap();
    assert!(
        (a.cost.eviction_s - 0.5 * prefill(30.0 * 16.0)).abs() < 1e-12,
        "{a:?}"
    );
    // Unknown capacity: nothing charged.
    assert_eq!(d.assessment(EndpointId(1)).unwrap().cost.eviction_s, 0.0);
    assert_eq!(d.chosen(), Some(EndpointId(1)));
}

/// A block loaded from CPU memory that another endpoint holds on its GPU makes a second GPU
/// copy: in a full cache it pushes out a block others come back for. Priced as free, an engine
/// reloading a document looked as cheap as the one holding it on its GPU, and a document kept
/// warm on two engines made both reload everything they held in turn (the tier counter-case,
/// docs/benchmarks.md). Where no GPU holds it, the request stores it on some GPU wherever it
/// goes, and the load is priced as a block found cached.
#[test]
fn a_reload_that_copies_a_gpu_held_prefix_again_pays_for_what_it_evicts() {
    let mut cands = fleet(3);
    for c in &mut cands {
        c.cache.block_reuse = 0.5;
        c.cache.free_blocks = Some(0.0);
    }
    cands[0].cache.index = cpu_match(0, 50);
    let mut req = request(1_000);
    let costs = |req: &RequestInfo, cands: &[Candidate]| {
        let d = schedule(&Profile::default(), req, cands, 1, 0);
        let cost = |e: u32| d.assessment(EndpointId(e)).unwrap().cost.clone();
        (cost(0), cost(1), d.chosen())
    };
    // No GPU holds it: the CPU holder stores the request's own 12 blocks, not the 50 it loads.
    let (on_cpu, on_none, chosen) = costs(&req, &cands);
    assert_eq!(on_cpu.evicted_blocks, 12.0, "{on_cpu:?}");
    assert_eq!(on_none.evicted_blocks, 62.0, "{on_none:?}");
    assert_eq!(chosen, Some(EndpointId(0)));
    // Endpoint 2 holds it on its GPU: loading it into another GPU evicts as computing it does.
    cands[2].cache.index = gpu_match(2, 50);
    req.gpu_copies.add(EndpointId(2), 50 * 16);
    let (on_cpu, on_none, chosen) = costs(&req, &cands);
    assert_eq!(on_cpu.evicted_blocks, 62.0, "{on_cpu:?}");
    assert_eq!(on_cpu.eviction_s, on_none.eviction_s);
    assert!(
        on_cpu.total_s < on_none.total_s,
        "loading still beats computing"
    );
    assert_eq!(chosen, Some(EndpointId(2)));
    // The GPU holder's own copy is not a second one.
    let d = schedule(&Profile::default(), &req, &cands, 1, 0);
    assert_eq!(
        d.assessment(EndpointId(2)).unwrap().cost.evicted_blocks,
        12.0
    );
}

/// Only a load is a second copy: on an endpoint that recomputes what the queue ahead evicts (no
/// CPU tier), a GPU copy elsewhere no longer than its own GPU match changes nothing it is
/// charged, whatever it loads from a shared tier.
#[test]
fn what_the_queue_ahead_evicts_and_is_recomputed_is_not_a_second_copy() {
    let mut cands = fleet(2);
    holds_50_blocks_under_a_full_queue(&mut cands[0]);
    cands[0].cache.index = Some(PrefixMatch {
        blocks: 60,
        shared_blocks: 10,
        ..gpu_match(0, 50).unwrap()
    });
    cands[0].cache.block_reuse = 1.0;
    busy(&mut cands[0], 2, 200 * 16);
    let mut req = request(1_000);
    let evicted = |req: &RequestInfo| {
        let d = schedule(&Profile::default(), req, &cands, 1, 0);
        d.assessment(EndpointId(0)).unwrap().cost.clone()
    };
    let alone = evicted(&req);
    assert!(alone.evicted_ahead_tokens > 0.0, "{alone:?}");
    req.gpu_copies.add(EndpointId(1), 50 * 16);
    let beside = evicted(&req);
    assert_eq!(beside.evicted_blocks, alone.evicted_blocks, "{beside:?}");
    // A longer GPU copy elsewhere makes its shared-tier load a second copy.
    req.gpu_copies.add(EndpointId(1), 60 * 16);
    assert!(evicted(&req).evicted_blocks > alone.evicted_blocks);
}

#[test]
fn what_the_queue_ahead_offloads_pushes_out_of_a_full_cpu_tier_is_recomputed_or_demoted() {
    // Endpoint 0 holds 50 of a 1,000-token request's 62 blocks in CPU memory; prefills queued
    // ahead compute 200 blocks, which the engine offloads there too.
    let mut cands = fleet(2);
    cands[0].cache.index = cpu_match(0, 50);
    cands[0].cache.offloads_to_cpu = true;
    busy(&mut cands[0], 2, 200 * 16);
    let held = |cands: &[Candidate]| {
        let d = schedule(&Profile::default(), &request(1_000), cands, 1, 0);
        let a = d.assessment(EndpointId(0)).unwrap().clone();
        (a.cost.cpu_lost_ahead_tokens, a.cost.prefill_s, a.cost.tiers)
    };
    // Its CPU tier has never evicted: its capacity is unknown and all 800 tokens load.
    let (lost, prefill_s, tiers) = held(&cands);
    assert_eq!(lost, 0.0);
    assert!((prefill_s - prefill(200.0)).abs() < 1e-12);
    assert_eq!(tiers.tiers[LoadTier::Cpu as usize].tokens, 800);
    // A full 400-block tier that the queue ahead overfills by 200 blocks loses half of what it
    // holds, as a GPU cache does (each cached block equally likely to go): recomputed.
    cands[0].cache.cpu_capacity_blocks = Some(400.0);
    cands[0].cache.cpu_free_blocks = Some(-200.0);
    let (lost, prefill_s, tiers) = held(&cands);
    assert_eq!(lost, 400.0);
    assert!((prefill_s - prefill(200.0 + 400.0)).abs() < 1e-12);
    assert_eq!(tiers.tiers[LoadTier::Cpu as usize].tokens, 400);
    // Where the fleet knows when the prefix was last used, the tier drops by that, least
    // recently used first: its first 40 blocks (100 distinct blocks newer) fit beside what is
    // newer, its last 10 (395 newer) lose 5; 5 of 50 blocks is a tenth of the 800 tokens.
    let parts = recency_parts(&[(0, 40, 100), (40, 50, 395)]);
    cands[0].cache.cpu_recency = Some(parts);
    let (lost, prefill_s, _) = held(&cands);
    assert!((lost - 80.0).abs() < 1e-9, "{lost}");
    assert!((prefill_s - prefill(200.0 + 80.0)).abs() < 1e-12);
    // The tier loses at the positions it drops: where the first 20 of the 50 blocks are on the
    // GPU, the CPU-held 30 are the older part's, of which 395 + 30 − 400 = 25 go (400 tokens,
    // not that share of the whole prefix).
    cands[0].cache.index = Some(PrefixMatch {
        gpu_blocks: 20,
        cpu_blocks: 30,
        ..cpu_match(0, 50).unwrap()
    });
    let parts = recency_parts(&[(0, 20, 100), (20, 50, 395)]);
    cands[0].cache.cpu_recency = Some(parts);
    assert_eq!(held(&cands).0, 400.0);
    cands[0].cache.index = cpu_match(0, 50);
    cands[0].cache.cpu_recency = None;
    // Where it offloads to its own storage too, what the CPU tier drops is demoted there: the
    // lost half loads from storage instead of being recomputed.
    cands[0].cache.offloads_to_storage = true;
    let (lost, prefill_s, tiers) = held(&cands);
    assert_eq!(lost, 400.0);
    assert!((prefill_s - prefill(200.0)).abs() < 1e-12);
    assert_eq!(tiers.tiers[LoadTier::Cpu as usize].tokens, 400);
    assert_eq!(tiers.tiers[LoadTier::Storage as usize].tokens, 400);
    // Room there for what the queue ahead offloads: nothing is lost.
    cands[0].cache.cpu_free_blocks = Some(0.0);
    assert_eq!(held(&cands).0, 0.0);
}

#[test]
fn gpu_copies_name_the_longest_held_elsewhere() {
    let mut copies = cost::GpuCopies::default();
    assert_eq!(copies.elsewhere(EndpointId(0)), 0);
    copies.add(EndpointId(0), 100);
    assert_eq!(
        copies.elsewhere(EndpointId(0)),
        0,
        "its own copy is not elsewhere"
    );
    assert_eq!(copies.elsewhere(EndpointId(1)), 100);
    // The same endpoint again: its longest count, still no other.
    copies.add(EndpointId(0), 150);
    assert_eq!(copies.elsewhere(EndpointId(0)), 0);
    assert_eq!(copies.elsewhere(EndpointId(1)), 150);
    copies.add(EndpointId(1), 150);
    assert_eq!(
        copies.elsewhere(EndpointId(0)),
        150,
        "a tie held by another"
    );
    copies.add(EndpointId(2), 200);
    assert_eq!(copies.elsewhere(EndpointId(2)), 150);
    assert_eq!(copies.elsewhere(EndpointId(0)), 200);
}

/// Candidate `c` (endpoint 0) holds 50 blocks of the prompt on its GPU, in a full 400-block
/// cache whose queue ahead stores 200 blocks beyond the free ones.
fn holds_50_blocks_under_a_full_queue(c: &mut Candidate) {
    c.cache.index = gpu_match(0, 50);
    c.cache.capacity_blocks = Some(400.0);
    c.cache.free_blocks = Some(-200.0);
}

#[test]
fn what_the_queue_ahead_evicts_follows_the_prefix_parts_last_use_where_it_is_known() {
    // Endpoint 0 holds 50 blocks of the prompt in a full 400-block cache: its first 20 were
    // used by the newest request (100 distinct blocks newer), the next 30 long ago (390 newer).
    let mut cands = fleet(1);
    holds_50_blocks_under_a_full_queue(&mut cands[0]);
    let parts = recency_parts(&[(0, 20, 100), (20, 50, 390)]);
    cands[0].cache.recency = Some(parts);
    let d = schedule(&Profile::default(), &request(1_000), &cands, 1, 0);
    let a = d.assessment(EndpointId(0)).unwrap();
    // The old part loses what exceeds the cache (390 + 30 − 400 = 20 blocks), the new one
    // nothing: 320 tokens, not the uniform share's half of 800.
    assert_eq!(a.cost.evicted_ahead_tokens, 20.0 * 16.0, "{a:?}");
    assert!(
        (a.cost.prefill_s - prefill(200.0 + 320.0)).abs() < 1e-12,
        "{a:?}"
    );
}

#[test]
fn a_prefix_the_queue_ahead_evicts_before_admission_counts_as_uncached() {
    // Endpoint 0 holds 50 of a 1,000-token request's 62 blocks, in a full 400-block cache
    // with prefills queued ahead that store 200 blocks: half of what it caches goes before
    // the request is admitted (an engine looks its prefix up only then).
    let mut cands = fleet(2);
    holds_50_blocks_under_a_full_queue(&mut cands[0]);
    busy(&mut cands[0], 2, 200 * 16);
    let d = schedule(&Profile::default(), &request(1_000), &cands, 1, 0);
    let a = d.assessment(EndpointId(0)).unwrap();
    assert!(
        (a.cost.prefill_s - prefill(200.0 + 0.5 * 800.0)).abs() < 1e-12,
        "{a:?}"
    );
    assert_eq!(a.cost.evicted_ahead_tokens, 400.0, "explain shows it");
    // The blocks of requests just sent there are used by them first: they stay.
    cands[0].cache.predicted = 50;
    let d = schedule(&Profile::default(), &request(1_000), &cands, 1, 0);
    let a = d.assessment(EndpointId(0)).unwrap();
    assert!((a.cost.prefill_s - prefill(200.0)).abs() < 1e-12, "{a:?}");
    // On an endpoint that offloads to CPU memory, what the queue ahead evicts is stored
    // there: it is loaded back at the CPU tier's rate, not prefilled again.
    cands[0].cache.predicted = 0;
    cands[0].cache.offloads_to_cpu = true;
    let d = schedule(&Profile::default(), &request(1_000), &cands, 1, 0);
    let a = d.assessment(EndpointId(0)).unwrap();
    assert!((a.cost.prefill_s - prefill(200.0)).abs() < 1e-12, "{a:?}");
    assert_eq!(a.cost.evicted_ahead_tokens, 400.0);
    let reload = a.cost.tiers.tiers[LoadTier::Cpu as usize];
    assert_eq!(reload.tokens, 400, "{a:?}");
    assert!(
        reload.seconds > 0.0 && reload.seconds < reload.recompute_s,
        "{a:?}"
    );
    // Reloaded blocks no other endpoint holds on its GPU are charged as blocks found on the
    // CPU tier are: whoever serves the request stores them on a GPU; recomputed ones are
    // stored again, and evict as much.
    cands[0].cache.block_reuse = 1.0;
    let reloading = schedule(&Profile::default(), &request(1_000), &cands, 1, 0);
    cands[0].cache.offloads_to_cpu = false;
    let recomputing = schedule(&Profile::default(), &request(1_000), &cands, 1, 0);
    let evicts = |d: &Decision| d.assessment(EndpointId(0)).unwrap().cost.eviction_s;
    assert!(
        evicts(&reloading) < evicts(&recomputing),
        "{reloading:?} {recomputing:?}"
    );
    cands[0].cache.block_reuse = 0.0;
    // Room for the queue ahead: nothing is lost.
    cands[0].cache.free_blocks = Some(0.0);
    let d = schedule(&Profile::default(), &request(1_000), &cands, 1, 0);
    let a = d.assessment(EndpointId(0)).unwrap();
    assert!((a.cost.prefill_s - prefill(200.0)).abs() < 1e-12, "{a:?}");
}

proptest! {
    /// Endpoint 0 holds a 608-token shared prefix of a 1,000-token request and has `queued`
    /// prefill tokens waiting; endpoint 1 is idle. The request goes to endpoint 1 (copying the
    /// prefix) exactly when the queue wait it saves (its own, and the stall its prefill would
    /// impose on the request queued there) exceeds the prefix's prefill plus the re-prefill of
    /// the extra blocks the copy evicts there.
    #[test]
    fn a_prefix_is_copied_only_when_the_wait_saved_exceeds_prefill_plus_eviction(
        queued in 0u64..8_000,
        reuse in 0.0f64..1.0,
        free in proptest::array::uniform2(0.0f64..80.0),
    ) {
        let profile = Profile::default();
        let (mut cands, req) = copy_case(queued, reuse);
        cands[0].cache.free_blocks = Some(free[0]);
        cands[1].cache.free_blocks = Some(free[1]);
        let block_s = prefill(16.0);
        let evicted = |stored: f64, free: f64| (stored - free).max(0.0) * block_s * reuse;
        // The wait saved: the queue's, and the stall its own 392-token prefill would impose on
        // the request queued there.
        let wait_saved = if queued > 0 {
            prefill(queued as f64) + profile.queue_wait_s + prefill(392.0)
        } else {
            0.0
        };
        let copy_s = prefill(608.0) + evicted(62.0, free[1]) - evicted(24.0, free[0]);
        prop_assume!((wait_saved - copy_s).abs() > 1e-6);
        let d = schedule(&profile, &req, &cands, 9, 0);
        let copied = d.chosen() == Some(EndpointId(1));
        if copied || wait_saved < copy_s {
            prop_assert_eq!(copied, wait_saved > copy_s, "wait saved {} s, copy {} s", wait_saved, copy_s);
        } else {
            // A copy that pays by less than the balance tolerance is declined only where staying
            // leaves more room, by at least a block (no in-flight request holds blocks the
            // counts do not see): the copy stores 62, the holder 24.
            prop_assert_eq!(d.reason, Reason::Balance, "wait saved {} s, copy {} s", wait_saved, copy_s);
            prop_assert!((free[0] - 24.0).max(0.0) >= (free[1] - 62.0).max(0.0) + 1.0, "{:?}", free);
        }
    }
}
