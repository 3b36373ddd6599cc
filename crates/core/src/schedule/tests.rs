use proptest::prelude::*;

use super::*;
use crate::index::PrefixMatch;
use crate::tiers::{LoadTier, TierLoadMode};

const RATE: f64 = 20_000.0;

fn candidate(id: u32) -> Candidate {
    Candidate {
        endpoint: EndpointId(id),
        healthy: true,
        ejected: false,
        circuit_open: false,
        serves_model: true,
        role: Role::Both,
        load: EndpointLoad::default(),
        cache: CacheView::default(),
        prefill_tokens_per_s: RATE,
        tier_rates: Default::default(),
        cache_fill: 0.0,
    }
}

fn fleet(n: u32) -> Vec<Candidate> {
    (0..n).map(candidate).collect()
}

fn request(prompt_tokens: usize) -> RequestInfo {
    RequestInfo {
        prompt_tokens,
        block_size: 16,
        session_endpoint: None,
        role: Role::Both,
        prefix_key: None,
        gpu_copies: Default::default(),
    }
}

fn gpu_match(id: u32, blocks: u32) -> Option<PrefixMatch> {
    Some(PrefixMatch {
        endpoint: EndpointId(id),
        blocks,
        gpu_blocks: blocks,
        cpu_blocks: 0,
        storage_blocks: 0,
        shared_blocks: 0,
    })
}

/// A match of `blocks` held only in CPU memory.
fn cpu_match(id: u32, blocks: u32) -> Option<PrefixMatch> {
    Some(PrefixMatch {
        cpu_blocks: blocks,
        gpu_blocks: 0,
        ..gpu_match(id, blocks)?
    })
}

/// In-flight prefill work on a candidate: `requests` requests of `tokens` uncached tokens in all.
fn busy(c: &mut Candidate, requests: u32, tokens: u64) {
    c.load.inflight = requests;
    c.load.inflight_prefills = requests;
    c.load.inflight_prefill_tokens = tokens;
}

fn chosen(profile: &Profile, req: &RequestInfo, cands: &[Candidate], random: u64) -> u32 {
    schedule(profile, req, cands, random, 0).chosen().unwrap().0
}

#[test]
fn idle_fleet_goes_where_the_prefix_is() {
    let mut cands = fleet(4);
    cands[2].cache.index = gpu_match(2, 100);
    let d = schedule(&Profile::default(), &request(1700), &cands, 42, 0);
    assert_eq!(d.chosen(), Some(EndpointId(2)));
    assert_eq!(d.reason, Reason::Cache);
    let a = d.assessment(EndpointId(2)).unwrap();
    assert_eq!(a.cached_tokens, 1600);
    assert!((a.cost.prefill_s - 100.0 / RATE).abs() < 1e-12);
    assert!(a.predicted_ttft_s < d.assessment(EndpointId(0)).unwrap().predicted_ttft_s);
}

/// The first round's failure: a follow-up turn sent away from the engine holding 142 of its
/// 168 blocks, at zero load, because the holder had had more placements.
#[test]
fn placements_never_outweigh_a_cache_hit_at_zero_load() {
    let mut cands = fleet(3);
    cands[0].cache.index = gpu_match(0, 142);
    cands[0].load.recent_placements = 50.0;
    let d = schedule(&Profile::default(), &request(168 * 16), &cands, 7, 0);
    assert_eq!(d.chosen(), Some(EndpointId(0)));
    assert_eq!(d.reason, Reason::Cache);
}

#[test]
fn near_equal_costs_go_to_the_fewest_placements() {
    let mut cands = fleet(3);
    for c in &mut cands {
        c.cache.index = gpu_match(c.endpoint.0, 10); // a shared system prompt
    }
    cands[0].load.recent_placements = 3.0;
    cands[1].load.recent_placements = 1.0;
    cands[2].load.recent_placements = 2.0;
    let d = schedule(&Profile::default(), &request(400), &cands, 1, 0);
    assert_eq!(d.chosen(), Some(EndpointId(1)));
    assert_eq!(d.reason, Reason::Balance);
}

/// The first failure of the tenant convergence property: a new tenant's context went to the
/// engine whose cache its blocks overflowed, because the other had had more placements (one hot
/// tenant's questions), though the two costs differed by what the placement evicts.
#[test]
fn balancing_never_evicts_a_block_the_cheapest_keeps() {
    let mut cands = fleet(2);
    for c in &mut cands {
        c.cache.block_reuse = 0.05; // little reuse measured yet: costs stay near-equal
    }
    // A 34-block prompt, held nowhere. Endpoint 0 has room; endpoint 1 stores 4 blocks past its
    // free ones, and has had fewer placements.
    cands[0].cache.free_blocks = Some(100.0);
    cands[0].load.recent_placements = 3.0;
    cands[1].cache.free_blocks = Some(30.0);
    cands[1].load.recent_placements = 1.0;
    let req = request(34 * 16);
    let d = schedule(&Profile::default(), &req, &cands, 3, 0);
    let evicting = d.assessment(EndpointId(1)).unwrap();
    assert_eq!(evicting.cost.evicted_blocks, 4.0);
    let tolerance = Profile::default().balance;
    let cheapest = d.assessment(EndpointId(0)).unwrap().cost.total_s;
    assert!(
        evicting.cost.total_s <= cheapest * (1.0 + tolerance.relative) + tolerance.absolute_s,
        "the costs are near-equal: balancing would decide"
    );
    assert_eq!(d.chosen(), Some(EndpointId(0)));
    assert_eq!(d.reason, Reason::Cache);
    // With room for it, as much as the other has, the endpoint with fewer placements wins as
    // before.
    cands[0].cache.free_blocks = Some(40.0);
    cands[1].cache.free_blocks = Some(40.0);
    let d = schedule(&Profile::default(), &req, &cands, 3, 0);
    assert_eq!(d.chosen(), Some(EndpointId(1)));
    assert_eq!(d.reason, Reason::Balance);
}

/// The convergence property's failure of a CI run (3 engines, 6 tenants; docs/benchmarks-log.md):
/// a new tenant's context went to the engine that two contexts already filled to 65%, because
/// its placements (1.99) were fewer than another's (2.00, the same two at other ages); its cache
/// then held three contexts, and the oldest was evicted between its questions. Near-equal costs
/// that evict nothing go where the placement leaves the most room.
#[test]
fn a_new_working_set_goes_where_it_leaves_the_most_room() {
    let mut cands = fleet(3);
    let placed = [2.00, 1.99, 1.99];
    let free = [64.0, 41.0, 65.0];
    for (c, (placed, free)) in cands.iter_mut().zip(placed.into_iter().zip(free)) {
        c.load.recent_placements = placed;
        c.cache.free_blocks = Some(free);
        c.cache.capacity_blocks = Some(118.0);
    }
    let req = request(38 * 16);
    let d = schedule(&Profile::default(), &req, &cands, 3, 0);
    assert!(d.assessments.iter().all(|a| a.cost.evicted_blocks == 0.0));
    assert_eq!(d.chosen(), Some(EndpointId(2)));
    assert_eq!(d.reason, Reason::Balance);
    let left = |e: u32| d.assessment(EndpointId(e)).unwrap().cost.free_blocks_left;
    assert_eq!(
        (left(0), left(1), left(2)),
        (Some(26.0), Some(3.0), Some(27.0))
    );
    // The cache-blind baseline balances on placements alone, as it always did: the fewest
    // (endpoint 1's, by a hundredth) win there, the most room here.
    let mut fewer = cands.clone();
    fewer[1].load.recent_placements = 1.98;
    let least_load = Profile::named(ProfileName::LeastLoad);
    assert_eq!(chosen(&least_load, &req, &fewer, 3), 1);
    assert_eq!(chosen(&Profile::default(), &req, &fewer, 3), 2);
    // Seven blocks less room is less room while the counts see every block...
    cands[0].cache.free_blocks = Some(58.0);
    cands[0].load.recent_placements = 1.0;
    let d = schedule(&Profile::default(), &req, &cands, 3, 0);
    assert_eq!(d.chosen(), Some(EndpointId(2)));
    // ... and the same room where in-flight requests hold eight blocks no count sees (their
    // last partial blocks and outputs): the fewest placements win among those.
    cands[2].cache.unseen_blocks = 8.0;
    let d = schedule(&Profile::default(), &req, &cands, 3, 0);
    assert_eq!(d.chosen(), Some(EndpointId(0)));
    assert_eq!(d.assessment(EndpointId(2)).unwrap().cost.unseen_blocks, 8.0);
    // Where every cache is full, as in steady state, placements decide.
    for c in &mut cands {
        c.cache.free_blocks = Some(0.0);
    }
    let d = schedule(&Profile::default(), &req, &cands, 3, 0);
    assert_eq!(d.chosen(), Some(EndpointId(0)));
    assert_eq!(d.reason, Reason::Balance);
}

/// The tier counter-case's duplicates: a document held on two engines, on one in GPU memory and
/// on the other partly in CPU memory (it keeps another document too); balancing sent its
/// requests to the second when it had had fewer placements, so both copies stayed warm and each
/// engine kept reloading from CPU memory.
#[test]
fn balancing_never_trades_gpu_memory_for_a_reload() {
    let mut cands = fleet(2);
    cands[0].cache.index = gpu_match(0, 40);
    cands[1].cache.index = Some(PrefixMatch {
        gpu_blocks: 39,
        cpu_blocks: 1,
        ..gpu_match(1, 40).unwrap()
    });
    cands[0].load.recent_placements = 3.0;
    cands[1].load.recent_placements = 1.0;
    let req = request(41 * 16);
    let d = schedule(&Profile::default(), &req, &cands, 3, 0);
    let reloading = d.assessment(EndpointId(1)).unwrap();
    assert!(reloading.cost.tier_load_s > 0.0);
    let cheapest = d.assessment(EndpointId(0)).unwrap().cost.clone();
    let limit = Profile::default()
        .balance
        .limit(cheapest.total_s, cheapest.cache_part(&Profile::default()));
    assert!(
        reloading.cost.total_s <= limit,
        "the costs are near-equal: balancing would decide"
    );
    assert_eq!(d.chosen(), Some(EndpointId(0)));
    assert_eq!(d.reason, Reason::Cache);
    // Both in GPU memory: the endpoint with fewer placements wins as before.
    cands[1].cache.index = gpu_match(1, 40);
    let d = schedule(&Profile::default(), &req, &cands, 3, 0);
    assert_eq!(d.chosen(), Some(EndpointId(1)));
    assert_eq!(d.reason, Reason::Balance);
}

/// The heavy multi-turn load's tail: with every engine saturated, a tolerance of 10% of the
/// whole cost made queues 150 ms apart "equal", and balancing sent the request to the longer one
/// because it had had fewer placements. The tolerance covers what the endpoints would compute,
/// not the queues the router counts.
#[test]
fn a_longer_queue_is_never_balanced_away() {
    let mut cands = fleet(2);
    busy(&mut cands[0], 10, 20_000); // 1.0 s of prefill queued
    busy(&mut cands[1], 10, 21_000); // 1.05 s
    cands[0].load.recent_placements = 5.0;
    cands[1].load.recent_placements = 1.0;
    let d = schedule(&Profile::default(), &request(400), &cands, 3, 0);
    assert_eq!(d.chosen(), Some(EndpointId(0)));
    assert_eq!(d.reason, Reason::Load);
    // Where only what they would compute differs by less than the tolerance, balancing decides.
    let mut cands = fleet(2);
    cands[0].load.recent_placements = 5.0;
    cands[1].load.recent_placements = 1.0;
    cands[1].prefill_tokens_per_s = RATE * 0.95; // a rate observed 5% lower
    let d = schedule(&Profile::default(), &request(4_000), &cands, 3, 0);
    assert_eq!(d.chosen(), Some(EndpointId(1)));
    assert_eq!(d.reason, Reason::Balance);
}

/// Seconds of prefill of `tokens` at the test fleet's rate.
fn prefill(tokens: f64) -> f64 {
    tokens / RATE
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
    let mut parts = RecencyParts::new(0);
    parts.push(RecencyPart {
        from: 0,
        to: 20,
        newer: 100,
    });
    parts.push(RecencyPart {
        from: 20,
        to: 50,
        newer: 390,
    });
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

#[test]
fn filters_remove_unhealthy_wrong_model_and_full_endpoints() {
    let mut cands = fleet(5);
    cands[0].healthy = false;
    cands[1].serves_model = false;
    cands[2].load.waiting = Some(50.0);
    cands[3].load.kv_usage = Some(0.99);
    let mut profile = Profile::default();
    profile.filters.max_waiting = Some(10.0);
    profile.filters.max_kv_usage = Some(0.95);
    let d = schedule(&profile, &request(100), &cands, 1, 0);
    assert_eq!(d.ranking, vec![EndpointId(4)]);
    assert_eq!(d.reason, Reason::OnlyCandidate);
    let reasons: Vec<_> = d.assessments.iter().map(|a| a.rejected).collect();
    assert_eq!(
        reasons,
        vec![
            Some(Rejection::Unhealthy),
            Some(Rejection::WrongModel),
            Some(Rejection::QueueFull),
            Some(Rejection::KvCacheFull),
            None
        ]
    );
    let none = schedule(&profile, &request(100), &cands[..4], 1, 0);
    assert_eq!(none.chosen(), None);
    assert_eq!(none.reason, Reason::NoCandidate);
    // Those left out for their load may take it later: flow control may hold the request.
    assert!(none.saturated);
    // Those that cannot serve it whatever their load leave nothing to wait for.
    let never = schedule(&profile, &request(100), &cands[..2], 1, 0);
    assert_eq!(never.chosen(), None);
    assert!(!never.saturated);
}

#[test]
fn a_distrusted_index_counts_as_empty_and_no_events_uses_history() {
    let mut cands = fleet(3);
    cands[0].cache.index = gpu_match(0, 60);
    cands[0].cache.index_state = IndexState::Distrusted;
    cands[1].cache.history = 30;
    cands[1].cache.index_state = IndexState::NoEvents;
    let d = schedule(&Profile::default(), &request(1000), &cands, 3, 0);
    assert_eq!(d.assessment(EndpointId(0)).unwrap().cached_tokens, 0);
    assert_eq!(d.assessment(EndpointId(1)).unwrap().cached_tokens, 480);
    assert_eq!(d.chosen(), Some(EndpointId(1)));
}

#[test]
fn the_predicted_overlay_covers_the_window_before_events() {
    let mut cands = fleet(2);
    cands[1].cache.predicted = 40;
    let d = schedule(&Profile::default(), &request(1000), &cands, 3, 0);
    assert_eq!(d.chosen(), Some(EndpointId(1)));
}

#[test]
fn approximate_uses_the_history_and_least_load_ignores_caches() {
    let mut cands = fleet(2);
    cands[0].cache.index = gpu_match(0, 50);
    cands[1].cache.history = 50;
    let approx = Profile::named(ProfileName::Approximate);
    assert_eq!(chosen(&approx, &request(1000), &cands, 5), 1);
    busy(&mut cands[1], 1, 100);
    let least = Profile::named(ProfileName::LeastLoad);
    for r in 0..16 {
        assert_eq!(chosen(&least, &request(1000), &cands, r), 0);
    }
}

#[test]
fn ties_are_broken_at_random_and_round_robin_rotates() {
    let cands = fleet(4);
    for profile in [
        Profile::named(ProfileName::Random),
        Profile::named(ProfileName::Precise),
    ] {
        let winners: std::collections::HashSet<_> = (0..64u64)
            .map(|r| {
                chosen(
                    &profile,
                    &request(10),
                    &cands,
                    r.wrapping_mul(0x1234_5678_9abc_def1),
                )
            })
            .collect();
        assert_eq!(winners.len(), 4, "every endpoint wins some ties");
    }
    let rr = Profile::named(ProfileName::RoundRobin);
    let order: Vec<_> = (0..8)
        .map(|i| {
            schedule(&rr, &request(10), &cands, 0, i)
                .chosen()
                .unwrap()
                .0
        })
        .collect();
    assert_eq!(order, vec![0, 1, 2, 3, 0, 1, 2, 3]);
}

#[test]
fn softmax_spreads_among_near_equal_candidates() {
    let mut cands = fleet(2);
    cands[0].cache.index = gpu_match(0, 10);
    cands[1].cache.index = gpu_match(1, 9);
    let profile = Profile {
        picker: Picker::Softmax {
            temperature_s: 0.005,
        },
        ..Profile::default()
    };
    let wins0 = (0..400u64)
        .filter(|r| {
            chosen(
                &profile,
                &request(200),
                &cands,
                r.wrapping_mul(0x9e37_79b9_7f4a_7c15),
            ) == 0
        })
        .count();
    assert!((200..380).contains(&wins0), "{wins0}");
}

#[test]
fn lower_tiers_cost_their_loading_time() {
    let mut cands = fleet(3);
    cands[0].cache.index = cpu_match(0, 50);
    cands[1].cache.index = gpu_match(1, 50);
    let d = schedule(&Profile::default(), &request(1000), &cands, 0, 0);
    assert_eq!(d.chosen(), Some(EndpointId(1)), "a GPU hit beats a CPU hit");
    let cpu = d.assessment(EndpointId(0)).unwrap();
    let none = d.assessment(EndpointId(2)).unwrap();
    assert!(cpu.cost.tier_load_s > 0.0);
    assert!(
        cpu.cost.total_s < none.cost.total_s,
        "loading beats recomputing"
    );
}

#[test]
fn a_hot_prefix_spills_once_the_queue_wait_exceeds_the_prefill_saved() {
    // Endpoint 0 holds 2,000 of the 2,200 tokens: a hit saves 100 ms of prefill.
    let prompt = 2_200;
    let mut cands = fleet(2);
    cands[0].cache.index = gpu_match(0, 125);
    // 30 ms of queued prefill + 2 × 20 ms of queue wait + its 10 ms prefill stalling the 2
    // queued (20 ms): 90 ms < 100 ms saved.
    busy(&mut cands[0], 2, 600);
    let d = schedule(&Profile::default(), &request(prompt), &cands, 0, 0);
    assert_eq!(d.chosen(), Some(EndpointId(0)), "{d:?}");
    busy(&mut cands[0], 4, 1_200); // 60 ms + 80 ms + 40 ms > 100 ms saved
    let d = schedule(&Profile::default(), &request(prompt), &cands, 0, 0);
    assert_eq!(d.chosen(), Some(EndpointId(1)));
    assert_eq!(d.reason, Reason::Load);
}

#[test]
fn explain_splits_the_queue_into_its_parts() {
    // 2 queued requests with 1,000 prefill tokens ahead (50 ms at 20k tokens/s), and a wait for
    // room of 80 ms: the longer of the two, plus 20 ms per queued request.
    let mut cands = fleet(1);
    busy(&mut cands[0], 2, 1_000);
    let profile = Profile::default();
    let rate = cands[0].prefill_tokens_per_s;
    let cost = |cands: &[Candidate]| {
        let d = schedule(&profile, &request(1_000), cands, 0, 0);
        d.assessments[0].cost.clone()
    };
    let waits_for_room = |room_wait_s| {
        let mut cands = cands.clone();
        cands[0].load.room_wait_s = room_wait_s;
        cost(&cands)
    };
    for (room, longer) in [(0.08, 0.08), (0.01, 1_000.0 / rate)] {
        let c = waits_for_room(room);
        assert!((c.queued_prefill_s - 1_000.0 / rate).abs() < 1e-12, "{c:?}");
        assert_eq!(c.room_wait_s, room);
        assert!((c.queued_requests_s - 2.0 * profile.queue_wait_s).abs() < 1e-12);
        assert!(
            (c.queue_s - (longer + c.queued_requests_s)).abs() < 1e-12,
            "{c:?}"
        );
    }
}

#[test]
fn the_stall_counts_running_decodes_and_the_queue_that_forms_behind() {
    let mut cands = fleet(1);
    busy(&mut cands[0], 3, 6_000);
    cands[0].load.running = Some(5.0);
    let d = schedule(&Profile::default(), &request(1_000), &cands, 0, 0);
    // 5 running decodes and 3 queued requests wait for its 1,000 tokens.
    let stall = d.assessments[0].cost.decode_interference_s;
    assert!((stall - 8.0 * 1_000.0 / RATE).abs() < 1e-12, "{stall}");
}

#[test]
fn a_tier_load_stalls_running_decodes_only_where_the_connector_loads_in_the_step() {
    let mut cands = fleet(1);
    cands[0].load.running = Some(5.0);
    cands[0].cache.index = cpu_match(0, 50);
    let stall_and_load = |mode: TierLoadMode| {
        let mut profile = Profile::default();
        profile.tiers.load_mode = mode;
        let d = schedule(&profile, &request(1_000), &cands, 0, 0);
        let c = &d.assessments[0].cost;
        (c.decode_interference_s, c.tier_load_s, c.prefill_s)
    };
    // vLLM's OffloadingConnector loads beside the batch: the 5 decodes wait for the prefill of
    // the 200 uncached tokens only.
    let (stall, load, prefill) = stall_and_load(TierLoadMode::Async);
    assert!(load > 0.0);
    assert!(
        (stall - 5.0 * prefill).abs() < 1e-12,
        "{stall} vs {prefill}"
    );
    // A connector that loads in the step stalls them for the load as well.
    let (stall, load, prefill) = stall_and_load(TierLoadMode::InStep);
    assert!((stall - 5.0 * (prefill + load)).abs() < 1e-12, "{stall}");
}

#[test]
fn decode_interference_steers_cold_prefills_away_from_busy_decoders() {
    let mut cands = fleet(2);
    cands[0].load.running = Some(40.0);
    cands[0].load.inflight = 40;
    let d = schedule(&Profile::default(), &request(4_000), &cands, 0, 0);
    assert_eq!(d.chosen(), Some(EndpointId(1)));
    assert!(
        d.assessment(EndpointId(0))
            .unwrap()
            .cost
            .decode_interference_s
            > 0.0
    );
}

#[test]
fn a_request_that_would_hold_back_others_goes_where_they_fit_beside_it() {
    // Both hold the prompt's 100 blocks, one on its GPU and one in CPU memory, idle: on cache
    // alone the GPU holder wins. Requests that would not fit beside this one come to it at 20
    // per second, and none to the other: while this one runs there (its prefill, then 50 ms
    // of decode) they wait for it.
    let mut cands = fleet(2);
    cands[0].cache.index = gpu_match(0, 100);
    cands[1].cache.index = cpu_match(1, 100);
    for c in &mut cands {
        c.load.decode_s = 0.05;
    }
    cands[0].load.not_fitting_per_s = 20.0;
    let d = schedule(&Profile::default(), &request(1_700), &cands, 0, 0);
    assert_eq!(d.chosen(), Some(EndpointId(1)), "{d:#?}");
    assert_eq!(d.reason, Reason::Load);
    let holder = &d.assessment(EndpointId(0)).unwrap().cost;
    let resident_s = holder.prefill_s + holder.tier_load_s + 0.05;
    assert!((holder.room_blocking_s - 20.0 * resident_s * resident_s / 2.0).abs() < 1e-12);
    assert_eq!(
        d.assessment(EndpointId(1)).unwrap().cost.room_blocking_s,
        0.0
    );
    // Where nothing comes that would not fit, the GPU holder wins again.
    cands[0].load.not_fitting_per_s = 0.0;
    assert_eq!(chosen(&Profile::default(), &request(1_700), &cands, 0), 0);
}

#[test]
fn saturation_is_reported_only_when_every_competitor_is_saturated() {
    let mut cands = fleet(2);
    cands[0].load.waiting = Some(10.0);
    let d = schedule(&Profile::default(), &request(100), &cands, 0, 0);
    assert!(!d.saturated);
    cands[1].load.kv_usage = Some(0.99);
    cands[1].load.waiting = Some(1.0);
    let d = schedule(&Profile::default(), &request(100), &cands, 0, 0);
    assert!(d.saturated);
}

#[test]
fn session_affinity_is_a_credit_in_seconds() {
    let mut cands = fleet(2);
    busy(&mut cands[1], 1, 100);
    let mut req = request(1000);
    req.session_endpoint = Some(EndpointId(1));
    let profile = Profile {
        session_affinity_s: 0.5,
        ..Profile::default()
    };
    let d = schedule(&profile, &req, &cands, 0, 0);
    assert_eq!(d.chosen(), Some(EndpointId(1)));
    assert_eq!(d.reason, Reason::Session);
}

/// A discrete simulation of one hot prefix: every request shares a 2,000-token prefix plus 200
/// unique tokens, at twice the rate one endpoint can serve even with cache hits. Each endpoint
/// prefills its queue serially at 20k tokens/s; it caches the prefix once it has served it.
/// Returns (longest queue seen, share of requests per endpoint).
fn hot_prefix_run(profile: &Profile) -> (usize, Vec<f64>) {
    let (endpoints, prefix, unique, rate_per_s, seconds) =
        (4usize, 2000usize, 200usize, 200.0, 10.0);
    let dt = 1.0 / rate_per_s;
    let mut queues: Vec<Vec<f64>> = vec![Vec::new(); endpoints]; // remaining tokens per request
    let mut holds = vec![false; endpoints];
    holds[0] = true;
    let mut served = vec![0usize; endpoints];
    let mut longest = 0;
    let steps = (seconds * rate_per_s) as usize;
    for step in 0..steps {
        for q in &mut queues {
            let mut budget = RATE * dt;
            while budget > 0.0 && !q.is_empty() {
                let take = q[0].min(budget);
                q[0] -= take;
                budget -= take;
                if q[0] <= 0.0 {
                    q.remove(0);
                }
            }
        }
        let candidates: Vec<Candidate> = (0..endpoints)
            .map(|e| {
                let mut c = candidate(e as u32);
                busy(
                    &mut c,
                    queues[e].len() as u32,
                    queues[e].iter().sum::<f64>() as u64,
                );
                if holds[e] {
                    c.cache.index = gpu_match(e as u32, (prefix / 16) as u32);
                }
                c
            })
            .collect();
        let d = schedule(
            profile,
            &request(prefix + unique),
            &candidates,
            (step as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15),
            step as u64,
        );
        let e = d.chosen().unwrap().0 as usize;
        let cost = if holds[e] { unique } else { prefix + unique };
        queues[e].push(cost as f64);
        holds[e] = true;
        served[e] += 1;
        longest = longest.max(queues.iter().map(Vec::len).max().unwrap());
    }
    (
        longest,
        served.iter().map(|&s| s as f64 / steps as f64).collect(),
    )
}

#[test]
fn a_popular_prefix_does_not_hot_spot_one_endpoint() {
    let (longest, shares) = hot_prefix_run(&Profile::default());
    assert!(
        longest <= 12,
        "queues stay bounded: longest {longest}, shares {shares:?}"
    );
    let busy = shares.iter().filter(|s| **s > 0.15).count();
    assert!(
        busy >= 2,
        "the hot prefix spills to other endpoints: {shares:?}"
    );
}

#[test]
fn without_the_load_weight_a_popular_prefix_melts_one_endpoint() {
    let mut profile = Profile::default();
    profile.weights.load = 0.0;
    let (longest, shares) = hot_prefix_run(&profile);
    assert!(
        longest > 100,
        "prefix-only routing melts one endpoint: {longest}, {shares:?}"
    );
}

fn arb_fleet() -> impl Strategy<Value = Vec<(u32, f64)>> {
    // (cached blocks, recent placements) per endpoint
    proptest::collection::vec((0u32..200, 0.0f64..100.0), 1..12)
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

    /// At zero load a request always goes to an endpoint holding the longest cached prefix,
    /// whatever the placements.
    #[test]
    fn zero_load_always_takes_the_longest_prefix(fleet in arb_fleet(), extra in 1usize..4000, random: u64) {
        let longest = fleet.iter().map(|(b, _)| *b).max().unwrap();
        let prompt = longest as usize * 16 + extra;
        let cands: Vec<Candidate> = fleet.iter().enumerate().map(|(i, (blocks, placements))| {
            let mut c = candidate(i as u32);
            c.cache.index = gpu_match(i as u32, *blocks);
            c.load.recent_placements = *placements;
            c
        }).collect();
        let d = schedule(&Profile::default(), &request(prompt), &cands, random, 0);
        let winner = d.chosen().unwrap().0 as usize;
        prop_assert_eq!(fleet[winner].0, longest, "{:?}", d);
    }

    /// Among equal caches and equal placements, the least-loaded endpoint wins.
    #[test]
    fn equal_caches_go_to_the_least_loaded(queued in proptest::collection::vec(0u64..20_000, 2..10), cached in 0u32..50, random: u64) {
        let cands: Vec<Candidate> = queued.iter().enumerate().map(|(i, q)| {
            let mut c = candidate(i as u32);
            c.cache.index = gpu_match(i as u32, cached);
            busy(&mut c, u32::from(*q > 0), *q);
            c
        }).collect();
        let d = schedule(&Profile::default(), &request(cached as usize * 16 + 500), &cands, random, 0);
        let winner = d.chosen().unwrap().0 as usize;
        prop_assert_eq!(queued[winner], *queued.iter().min().unwrap());
    }

    /// Balancing never gives up a cached block: the winner holds at least as much as a
    /// cheapest candidate, loads no more of it from CPU memory, evicts no more than it, and
    /// costs at most the tolerance more, taken of what that candidate would compute.
    #[test]
    fn balancing_stays_within_the_tolerance(
        fleet in proptest::collection::vec((0u32..100, 0.0f64..20.0, 0u64..5_000, proptest::option::of(0u32..150)), 2..10),
        on_cpu in proptest::collection::vec(0u32..4, 10),
        random: u64,
    ) {
        let cands: Vec<Candidate> = fleet.iter().enumerate().map(|(i, (blocks, placements, q, free))| {
            let mut c = candidate(i as u32);
            // The last few blocks of a match in CPU memory, on some endpoints.
            let cpu = on_cpu[i].min(*blocks);
            c.cache.index = gpu_match(i as u32, *blocks).map(|m| PrefixMatch {
                gpu_blocks: blocks - cpu,
                cpu_blocks: cpu,
                ..m
            });
            c.cache.free_blocks = free.map(f64::from);
            c.cache.block_reuse = 0.5;
            c.load.recent_placements = *placements;
            busy(&mut c, u32::from(*q > 0), *q);
            c
        }).collect();
        let profile = Profile::default();
        let d = schedule(&profile, &request(2_000), &cands, random, 0);
        let winner = d.assessment(d.chosen().unwrap()).unwrap();
        let best = d.assessments.iter().map(|a| a.cost.total_s).fold(f64::INFINITY, f64::min);
        // Exact ties for the cheapest are broken at random: one of them must bound the winner.
        let bounded = d.assessments.iter().filter(|a| a.cost.total_s == best).any(|cheapest| {
            let limit = cheapest.cost.total_s
                + profile.balance.relative * cheapest.cost.cache_part(&profile).min(best).max(0.0)
                + profile.balance.absolute_s;
            winner.cost.total_s <= limit + 1e-12
                && winner.cached_tokens >= cheapest.cached_tokens
                && winner.cost.charged_tier_tokens() <= cheapest.cost.charged_tier_tokens()
                && winner.cost.evicted_blocks <= cheapest.cost.evicted_blocks
        });
        prop_assert!(bounded, "{:?}", d);
    }

    /// Requests arriving faster than any one endpoint serves spread out: no queue grows
    /// without bound while another endpoint idles.
    #[test]
    fn no_queue_grows_while_others_idle(arrivals in proptest::collection::vec((0u32..4, 100usize..3000), 50..300)) {
        let endpoints = 4;
        let mut queued = vec![0u64; endpoints];
        let mut holds: Vec<Option<u32>> = vec![None; endpoints];
        for (step, (group, tokens)) in arrivals.iter().enumerate() {
            // Each endpoint prefills 2,000 tokens between arrivals.
            for q in &mut queued { *q = q.saturating_sub(2_000); }
            let prompt = 2_000 + tokens;
            let cands: Vec<Candidate> = (0..endpoints).map(|e| {
                let mut c = candidate(e as u32);
                busy(&mut c, u32::from(queued[e] > 0), queued[e]);
                if holds[e] == Some(*group) { c.cache.index = gpu_match(e as u32, 125); }
                c
            }).collect();
            let d = schedule(&Profile::default(), &request(prompt), &cands, step as u64, 0);
            let e = d.chosen().unwrap().0 as usize;
            let hit = if holds[e] == Some(*group) { 2_000 } else { 0 };
            queued[e] += (prompt - hit) as u64;
            holds[e] = Some(*group);
            let idle = queued.iter().filter(|q| **q == 0).count();
            let longest = *queued.iter().max().unwrap();
            // A queue may only exceed a few cold prefills while no endpoint idles.
            prop_assert!(idle == 0 || longest <= 4 * 5_000, "{queued:?}");
        }
    }
}

#[test]
fn ejected_endpoints_are_filtered_and_open_circuits_saturate() {
    let mut cands = fleet(3);
    cands[0].ejected = true;
    cands[1].circuit_open = true;
    let d = schedule(&Profile::default(), &request(100), &cands, 1, 0);
    assert_eq!(d.ranking, vec![EndpointId(2)]);
    let reasons: Vec<_> = d.assessments.iter().map(|a| a.rejected).collect();
    assert_eq!(
        reasons,
        vec![Some(Rejection::Ejected), Some(Rejection::CircuitOpen), None]
    );
    assert!(!d.saturated);
    // Nothing left but an open circuit: the request may wait for it.
    let held = schedule(&Profile::default(), &request(100), &cands[..2], 1, 0);
    assert_eq!(held.chosen(), None);
    assert!(held.saturated);
}

#[test]
fn prefix_hash_keeps_a_prefix_home_and_overflows_past_the_load_bound() {
    let profile = Profile::named(ProfileName::PrefixHash);
    let mut cands = fleet(4);
    let with_key = |key: u64| RequestInfo {
        prefix_key: Some(key),
        ..request(1_000)
    };
    // Costs are ignored: a prefix has one home whatever the random input.
    let home = chosen(&profile, &with_key(7), &cands, 1);
    for random in 0..20 {
        assert_eq!(chosen(&profile, &with_key(7), &cands, random), home);
    }
    // Different prefixes spread over the ring.
    let homes: std::collections::HashSet<u32> = (0..64)
        .map(|k| chosen(&profile, &with_key(k), &cands, 0))
        .collect();
    assert_eq!(homes.len(), 4, "{homes:?}");
    // The home above (1 + 0.25) × the mean load: the next endpoint on the ring takes it.
    cands[home as usize].load.inflight = 10;
    for (i, c) in cands.iter_mut().enumerate() {
        if i as u32 != home {
            c.load.inflight = 2;
        }
    }
    let d = schedule(&profile, &with_key(7), &cands, 0, 0);
    assert_ne!(d.chosen(), Some(EndpointId(home)));
    assert_eq!(d.reason, Reason::PrefixHash);
    assert_eq!(d.ranking.len(), 4, "every endpoint stays a fallback");
}

/// One endpoint of a fleet for the near-best property test: (cached blocks, placements, queued
/// prefill tokens, running decodes, free blocks, state: 0 healthy, 1 unhealthy, 2 circuit open,
/// 3 session endpoint; whether the match's last blocks are in CPU memory).
type Shape = (u32, u8, u64, u8, Option<u8>, u8, bool);

fn arb_shape() -> impl Strategy<Value = Shape> {
    (
        prop_oneof![3 => Just(0u32), 1 => 0u32..40],
        0u8..4,
        prop_oneof![2 => Just(0u64), 1 => 0u64..6_000],
        prop_oneof![2 => Just(0u8), 1 => 0u8..8],
        proptest::option::of(0u8..60),
        prop_oneof![8 => Just(0u8), 1 => 1u8..4],
        prop_oneof![3 => Just(false), 1 => Just(true)],
    )
}

fn shaped(i: usize, shape: &Shape) -> Candidate {
    let &(blocks, placements, queued, decoding, free, state, on_cpu) = shape;
    let mut c = candidate(i as u32);
    if blocks > 0 {
        c.cache.index = gpu_match(i as u32, blocks);
    }
    // The match's last blocks in CPU memory: tier loads for balancing to compare.
    if on_cpu && blocks > 0 {
        c.cache.index = cpu_match(i as u32, blocks.min(2)).map(|m| PrefixMatch {
            blocks,
            gpu_blocks: blocks - m.cpu_blocks,
            ..m
        });
    }
    // Few distinct values, so that many costs and placements tie, as in an idle fleet.
    c.load.recent_placements = f64::from(placements) * 0.5;
    busy(&mut c, u32::from(queued > 0), queued);
    c.load.running = Some(f64::from(decoding));
    c.cache.free_blocks = free.map(f64::from);
    c.cache.capacity_blocks = free.map(|_| 100.0);
    c.cache.block_reuse = 0.5;
    c.healthy = state != 1;
    c.circuit_open = state == 2;
    c
}

proptest! {
    /// Ranking only the near-best candidates changes nothing that is read: the same winner,
    /// reason and saturation as ranking every candidate, the same head of the ranking, and the
    /// same breakdowns for the candidates it ranks.
    #[test]
    fn the_near_best_ranking_is_the_head_of_the_exhaustive_one(
        fleet in proptest::collection::vec(arb_shape(), 1..40),
        depth in 2usize..6,
        prompt in 16usize..800,
        relative in prop_oneof![Just(0.05f64), 0.0f64..0.5],
        random: u64,
    ) {
        let cands: Vec<Candidate> = fleet.iter().enumerate().map(|(i, s)| shaped(i, s)).collect();
        let mut req = request(prompt);
        req.session_endpoint = fleet.iter().position(|s| s.5 == 3).map(|i| EndpointId(i as u32));
        let mut profile = Profile::default();
        profile.balance.relative = relative;
        let every = schedule(&profile, &req, &cands, random, 0);
        let mut buffers = RankBuffers::default();
        let near = schedule_near_best(&profile, &req, &cands, random, 0, depth, &mut buffers);
        prop_assert_eq!(near.chosen(), every.chosen());
        prop_assert_eq!(near.reason, every.reason);
        prop_assert_eq!(near.saturated, every.saturated);
        let head = near.ranking.len();
        prop_assert!(head == every.ranking.len() || head == depth);
        prop_assert_eq!(Some(&near.ranking[..]), every.ranking.get(..head));
        for a in &near.assessments {
            prop_assert_eq!(Some(a), every.assessment(a.endpoint));
        }
        for id in &near.ranking {
            prop_assert!(near.assessment(*id).is_some(), "a ranked candidate is broken down");
        }
    }
}

/// Three endpoints and a 1,760-token prompt whose first 1,600 tokens are a shared prefix that
/// only endpoint 0 holds; endpoint 0 has `holder_queue` requests queued (of 64 uncached tokens
/// each) and endpoint 2 `other_queue`. Caches of 1,000 blocks, full (`free` blocks free).
fn shared_prefix_fleet(holder_queue: u32, other_queue: u32, free: f64) -> Vec<Candidate> {
    let mut cands = fleet(3);
    cands[0].cache.index = gpu_match(0, 100);
    busy(&mut cands[0], holder_queue, 64 * u64::from(holder_queue));
    busy(&mut cands[2], other_queue, 64 * u64::from(other_queue));
    for c in &mut cands {
        c.cache.capacity_blocks = Some(1_000.0);
        c.cache.free_blocks = Some(free);
        c.cache.block_reuse = 1.0;
    }
    cands
}

const SHARED: usize = 1_600;

/// Room its hits do not reach, the same on every endpoint.
fn cold(blocks: f64) -> impl Fn(EndpointId) -> Option<f64> {
    move |_| Some(blocks)
}

/// The shared prefix of [`shared_prefix_fleet`]'s prompt with `rent_s` paid.
fn shared(rent_s: f64) -> amortize::SharedPrefix {
    amortize::SharedPrefix {
        tokens: SHARED,
        prompt_tokens: 1_760,
        block_size: 16,
        rent_s,
    }
}

#[test]
fn a_copy_is_bought_once_the_rent_paid_exceeds_what_it_costs() {
    let profile = Profile::default();
    let req = request(1_760);
    let cands = shared_prefix_fleet(2, 0, 1_000.0);
    // Alone, the request stays with the busier holder: the copy's prefill costs more than
    // the wait it saves.
    let mut d = schedule(&profile, &req, &cands, 1, 0);
    assert_eq!(d.chosen(), Some(EndpointId(0)));
    let holder = d.assessment(EndpointId(0)).unwrap().cost.total_s;
    let copy = d.assessment(EndpointId(1)).unwrap().cost.total_s;
    assert!(copy > holder);
    let unpaid = amortize::apply_rent(&profile, &mut d, shared(0.0), 8, cold(0.0)).unwrap();
    assert_eq!(d.chosen(), Some(EndpointId(0)));
    assert!(unpaid.bought.is_none());
    // It pays rent: what a copy would save it wherever the copy went.
    assert!(unpaid.paid_s > 0.0, "{unpaid:?}");
    // Once the rent paid covers the copy's extra cost, the copy is bought where it is cheapest
    // after the credit, and the credit never exceeds the rent.
    let rent = copy - holder + 1e-3;
    let mut d = schedule(&profile, &req, &cands, 1, 0);
    let bought = amortize::apply_rent(&profile, &mut d, shared(rent), 8, cold(0.0)).unwrap();
    let (at, credit) = bought.bought.expect("a copy");
    assert_ne!(at, EndpointId(0));
    assert_eq!(d.chosen(), Some(at));
    assert_eq!(d.reason, Reason::CopyRent);
    assert!(credit <= rent && credit > 0.0, "{bought:?}");
    // Short of it, no copy.
    let mut d = schedule(&profile, &req, &cands, 1, 0);
    let short = amortize::apply_rent(&profile, &mut d, shared(rent / 2.0), 8, cold(0.0));
    assert!(short.unwrap().bought.is_none());
    assert_eq!(d.chosen(), Some(EndpointId(0)));
}

#[test]
fn rent_is_paid_back_while_an_endpoint_lacking_the_prefix_is_busier_than_its_holder() {
    let profile = Profile::default();
    let mut d = schedule(
        &profile,
        &request(1_760),
        &shared_prefix_fleet(2, 4, 1_000.0),
        1,
        0,
    );
    assert_eq!(d.chosen(), Some(EndpointId(0)));
    let outcome = amortize::apply_rent(&profile, &mut d, shared(0.0), 8, cold(0.0)).unwrap();
    // Negative: it pays back what noise may have paid in, so a balanced fleet nets nothing.
    assert!(outcome.paid_s < 0.0, "{outcome:?}");
}

#[test]
fn a_copy_is_not_bought_into_room_the_endpoints_hits_use() {
    let profile = Profile::default();
    let req = request(1_760);
    // Full caches: the copy evicts. Whatever the rent, no copy where every block is reused.
    let cands = shared_prefix_fleet(2, 0, 0.0);
    let mut d = schedule(&profile, &req, &cands, 1, 0);
    let outcome = amortize::apply_rent(&profile, &mut d, shared(1e6), 8, cold(50.0)).unwrap();
    assert!(outcome.bought.is_none());
    assert_eq!(d.chosen(), Some(EndpointId(0)));
    // Where the 100 missing blocks fit in room no hit reaches, it is bought.
    let mut d = schedule(&profile, &req, &cands, 1, 0);
    let outcome = amortize::apply_rent(&profile, &mut d, shared(1e6), 8, cold(100.0)).unwrap();
    assert!(outcome.bought.is_some());
}

#[test]
fn no_copy_is_credited_where_the_capacity_is_unknown() {
    let profile = Profile::default();
    let mut d = schedule(
        &profile,
        &request(1_760),
        &shared_prefix_fleet(2, 0, 1_000.0),
        1,
        0,
    );
    let unknown = |_: EndpointId| None;
    let outcome = amortize::apply_rent(&profile, &mut d, shared(1e6), 8, unknown).unwrap();
    assert!(outcome.bought.is_none());
    assert_eq!(d.chosen(), Some(EndpointId(0)));
}

#[test]
fn a_shared_prefixs_rent_pays_only_for_the_shared_part_of_a_copy() {
    // A new question: endpoint 0 holds its 1,600-token shared prefix and nothing of its own
    // 640 tokens; it is somewhat busy, the others are idle and hold nothing.
    let profile = Profile::default();
    let mut cands = shared_prefix_fleet(1, 0, 1_000.0);
    cands[0].cache.index = gpu_match(0, 100);
    let mut d = schedule(&profile, &request(2_240), &cands, 1, 0);
    assert_eq!(d.chosen(), Some(EndpointId(0)));
    let holder = d.assessment(EndpointId(0)).unwrap().cost.clone();
    let prefix = amortize::SharedPrefix {
        prompt_tokens: 2_240,
        ..shared(1e6)
    };
    let outcome = amortize::apply_rent(&profile, &mut d, prefix, 8, cold(1_000.0)).unwrap();
    let (at, credit) = outcome.bought.expect("a copy, with rent to spare");
    let copy = d.assessment(at).unwrap().cost.clone();
    // What acquiring the prefix adds there: its cost less what it would cost holding what the
    // holder holds (the holder's prefill of the question, its own queue, nothing stalled).
    assert_eq!(copy.decode_interference_s, 0.0);
    assert_eq!(copy.eviction_s, 0.0);
    let adds = copy.total_s - (holder.prefill_s + copy.queue_s);
    // The credit is the shared prefix's share of it (1,600 of the 2,240 tokens it lacks), not
    // all of it: the question's own part is the question's to pay for.
    assert!(
        (credit - adds * 1_600.0 / 2_240.0).abs() < 1e-9,
        "{credit} vs {adds}"
    );
}

#[test]
fn a_shared_prefixs_rent_does_not_pay_for_moving_a_conversations_own_history() {
    // Endpoint 0 holds a conversation: a 320-token system prompt (shared) and 1,440 tokens of
    // its own history. It is somewhat busy; the others hold nothing.
    let profile = Profile::default();
    let mut cands = shared_prefix_fleet(2, 0, 1_000.0);
    cands[0].cache.index = gpu_match(0, 110);
    let mut d = schedule(&profile, &request(1_776), &cands, 1, 0);
    assert_eq!(d.chosen(), Some(EndpointId(0)));
    let system = amortize::SharedPrefix {
        tokens: 320,
        prompt_tokens: 1_776,
        block_size: 16,
        rent_s: 1e6,
    };
    // Whatever the system prompt's requests paid, the history stays where it is.
    let outcome = amortize::apply_rent(&profile, &mut d, system, 8, cold(1_000.0)).unwrap();
    assert!(outcome.bought.is_none(), "{outcome:?}");
    assert_eq!(d.chosen(), Some(EndpointId(0)));
}

#[test]
fn a_copy_is_bought_by_a_new_conversation_not_by_a_later_turn_it_would_uproot() {
    let profile = Profile::default();
    // A later turn: its holder, the busier endpoint, holds the 1,600-token shared prefix and
    // 160 tokens of the conversation's own history. However much rent was paid, it stays
    // with its history, and pays rent.
    let mut cands = shared_prefix_fleet(2, 0, 1_000.0);
    cands[0].cache.index = gpu_match(0, 110);
    let mut d = schedule(&profile, &request(1_776), &cands, 1, 0);
    assert_eq!(d.chosen(), Some(EndpointId(0)));
    let later_turn = amortize::SharedPrefix {
        prompt_tokens: 1_776,
        ..shared(1e6)
    };
    let stays = amortize::apply_rent(&profile, &mut d, later_turn, 8, cold(1_000.0)).unwrap();
    assert!(stays.bought.is_none(), "{stays:?}");
    assert_eq!(d.chosen(), Some(EndpointId(0)));
    assert!(stays.paid_s > 0.0, "{stays:?}");
    // A new conversation under the same prefix finds only the prefix there: it buys the copy.
    let cands = shared_prefix_fleet(2, 0, 1_000.0);
    let mut d = schedule(&profile, &request(1_760), &cands, 1, 0);
    let buys = amortize::apply_rent(&profile, &mut d, shared(1e6), 8, cold(1_000.0)).unwrap();
    assert!(buys.bought.is_some(), "{buys:?}");
    assert_ne!(d.chosen(), Some(EndpointId(0)));
}

#[test]
fn a_holder_reloading_the_prefix_from_cpu_memory_pays_that_reload_as_rent() {
    // Endpoint 0 holds the shared prefix only in CPU memory (an engine keeping more contexts
    // than its GPU memory holds reloads each in turn); no queue anywhere.
    let profile = Profile::default();
    let mut cands = shared_prefix_fleet(0, 0, 1_000.0);
    cands[0].cache.index = cpu_match(0, 100);
    let mut d = schedule(&profile, &request(1_760), &cands, 1, 0);
    assert_eq!(d.chosen(), Some(EndpointId(0)));
    let reload_s = d.assessment(EndpointId(0)).unwrap().cost.tier_load_s;
    assert!(reload_s > 0.0);
    // A copy in room would stay in GPU memory, so the reload is what it saves each request.
    let outcome = amortize::apply_rent(&profile, &mut d, shared(0.0), 8, cold(0.0)).unwrap();
    assert!(outcome.bought.is_none());
    let paid = outcome.paid_s;
    assert!(
        (paid - profile.weights.prefix * reload_s).abs() < 1e-9,
        "{outcome:?}, reload {reload_s}"
    );
    // Where loads run in the step, they stall the running decodes too: that stall is rent as
    // well (a copy in GPU memory stalls them only for its prefill).
    let mut profile = Profile::default();
    profile.tiers.load_mode = TierLoadMode::InStep;
    for c in &mut cands {
        c.load.running = Some(4.0);
    }
    let mut d = schedule(&profile, &request(1_760), &cands, 1, 0);
    assert_eq!(d.chosen(), Some(EndpointId(0)));
    let holder = d.assessment(EndpointId(0)).unwrap().cost.clone();
    assert!(holder.decode_interference_s > 0.0);
    let stall_per_s = holder.decode_interference_s / holder.stalling_s;
    let outcome = amortize::apply_rent(&profile, &mut d, shared(0.0), 8, cold(0.0)).unwrap();
    let expected =
        holder.tier_load_s * (profile.weights.prefix + profile.weights.load * stall_per_s);
    assert!(
        (outcome.paid_s - expected).abs() < 1e-9,
        "{outcome:?}, expected {expected}"
    );
}

proptest! {
    /// What a pruned plan bounds a holder with, `countable_blocks`, is never less than what the
    /// cost counts it holding (`cached`'s `all`), whatever the cache source, the index's state
    /// and tiers, the routing history and the prediction: a holder's bound stays a bound.
    #[test]
    fn the_countable_blocks_bound_what_the_cost_counts(
        source in 0usize..3,
        state in 0usize..3,
        index in proptest::option::of((1u32..60, 0u32..60, 0u32..60, 0u32..60)),
        history in 0u32..60,
        predicted in 0u32..60,
        prompt in 1usize..1_200,
    ) {
        let source = [CacheSource::Precise, CacheSource::Approximate, CacheSource::None][source];
        let state = [IndexState::Trusted, IndexState::NoEvents, IndexState::Distrusted][state];
        let mut c = candidate(0);
        // A match's tiers split its blocks (each tier's share at most what is left).
        c.cache.index = index.map(|(blocks, gpu, cpu, storage)| {
            let gpu = gpu.min(blocks);
            let cpu = cpu.min(blocks - gpu);
            let storage = storage.min(blocks - gpu - cpu);
            PrefixMatch {
                endpoint: EndpointId(0),
                blocks,
                gpu_blocks: gpu,
                cpu_blocks: cpu,
                storage_blocks: storage,
                shared_blocks: blocks - gpu - cpu - storage,
            }
        });
        c.cache.index_state = state;
        c.cache.history = history;
        c.cache.predicted = predicted;
        let profile = Profile { cache: source, ..Profile::default() };
        let req = request(prompt);
        let counted = cost::cached(&profile, &req, &c).all;
        let blocks = cost::countable_blocks(
            source,
            state,
            c.cache.index.map_or(0, |m| m.blocks),
            history,
            predicted,
        );
        prop_assert!(counted <= blocks as usize * req.block_size, "{counted} > {blocks} blocks");
        // Below the prompt, the count is exactly the bound: it is not loose either.
        if (blocks as usize) * req.block_size <= prompt {
            prop_assert_eq!(counted, blocks as usize * req.block_size);
        }
    }
}
