//! Bounds that pruned and near-best plans rely on: the near-best ranking is the head of the
//! exhaustive one, and a holder's countable blocks bound what its cost counts.

use proptest::prelude::*;

use super::*;

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
