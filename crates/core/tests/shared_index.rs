//! The shared index under concurrent writers (one per endpoint) and readers.

use std::sync::Arc;

use kvroute_core::event::{BlockRemoved, BlockStored, EngineHash, KvEvent};
use kvroute_core::index::{EndpointId, IndexConfig, KvIndex, SharedIndex};
use kvroute_core::keys::router_keys;

const BS: usize = 16;

fn doc(i: u32) -> Vec<u32> {
    // Every document shares its first 4 blocks, then diverges.
    (0..(BS as u32 * 12))
        .map(|t| if t < 64 { t } else { t + 1000 * (i + 1) })
        .collect()
}

/// The events endpoint `e` publishes: store each doc, then evict the tails of odd docs.
fn events_for(e: u32) -> Vec<Vec<KvEvent>> {
    let mut batches = Vec::new();
    for i in 0..20u32 {
        let tokens = doc(i);
        let hashes: Vec<EngineHash> = router_keys(&tokens, BS, None)
            .unwrap()
            .iter()
            .map(|k| EngineHash(k.0 ^ u64::from(e)))
            .collect();
        batches.push(vec![KvEvent::BlockStored(BlockStored {
            block_hashes: hashes.clone(),
            parent_block_hash: None,
            token_ids: tokens,
            block_size: BS as u32,
            medium: Some("GPU".into()),
            ..Default::default()
        })]);
        if i % 2 == 1 {
            batches.push(vec![KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: hashes[8..].to_vec(),
                medium: Some("GPU".into()),
                group_idx: None,
            })]);
        }
    }
    batches
}

#[test]
fn concurrent_writers_and_readers_end_where_sequential_application_ends() {
    for shards in 1..=3 {
        writers_and_readers_on(shards);
    }
}

/// Eight writers (one per endpoint) and two readers on an index of `shards` shards.
fn writers_and_readers_on(shards: usize) {
    let shared = Arc::new(SharedIndex::sharded(IndexConfig::default(), shards).unwrap());
    let mut sequential = KvIndex::new(IndexConfig::default()).unwrap();
    for e in 0..8 {
        for batch in events_for(e) {
            sequential.apply(EndpointId(e), &batch);
        }
    }
    let probe = router_keys(&doc(3), BS, None).unwrap();
    std::thread::scope(|scope| {
        for e in 0..8u32 {
            let shared = shared.clone();
            scope.spawn(move || {
                for batch in events_for(e) {
                    shared.apply(EndpointId(e), &batch);
                }
            });
        }
        for _ in 0..2 {
            let shared = shared.clone();
            let probe = probe.clone();
            scope.spawn(move || {
                for _ in 0..2_000 {
                    // A reader sees whole batches only: doc 3's prefix is 0, 4 (shared head
                    // through another doc), 8 (after its eviction) or 12 blocks, never between.
                    for m in shared.lookup(&probe).matches {
                        assert!([4, 8, 12].contains(&m.blocks), "torn read: {m:?}");
                    }
                }
            });
        }
    });
    for e in 0..8 {
        assert_eq!(
            shared.lookup(&probe).get(EndpointId(e)).copied(),
            sequential.lookup(&probe).get(EndpointId(e)).copied()
        );
        assert_eq!(
            shared.endpoint_stats(EndpointId(e)),
            sequential.endpoint_stats(EndpointId(e))
        );
    }
    assert_eq!(shared.lookup(&probe).blocks(EndpointId(0)), 8);
}

/// One endpoint's step in the concurrent property test.
#[derive(Clone, Debug)]
enum Step {
    /// Store document `doc` whole.
    Store(u32),
    /// Remove document `doc`'s blocks from `from` on.
    RemoveTail(u32, usize),
}

/// The events of one step on endpoint `e` (whose engine hashes are the router keys xor `e`).
fn step_events(e: u32, step: &Step) -> Vec<KvEvent> {
    let hashes = |doc: u32| -> Vec<EngineHash> {
        router_keys(&self::doc(doc), BS, None)
            .unwrap()
            .iter()
            .map(|k| EngineHash(k.0 ^ u64::from(e)))
            .collect()
    };
    match *step {
        Step::Store(d) => vec![KvEvent::BlockStored(BlockStored {
            block_hashes: hashes(d),
            parent_block_hash: None,
            token_ids: doc(d),
            block_size: BS as u32,
            medium: Some("GPU".into()),
            ..Default::default()
        })],
        Step::RemoveTail(d, from) => vec![KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: hashes(d)[from..].to_vec(),
            medium: Some("GPU".into()),
            group_idx: None,
        })],
    }
}

const DOCS: u32 = 12;
const ENDPOINTS: u32 = 4;

fn step() -> impl proptest::strategy::Strategy<Value = Step> {
    use proptest::prelude::*;
    prop_oneof![
        3 => (0..DOCS).prop_map(Step::Store),
        1 => (0..DOCS, 1usize..12).prop_map(|(d, from)| Step::RemoveTail(d, from)),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(24))]

    /// Writers (one per endpoint, on one to three shards) store and remove while the capacity
    /// bound evicts and readers look up. Readers only ever see well-formed answers; afterwards the index is within its
    /// capacity, its counters agree with its contents, and it holds nothing the engines do not
    /// (eviction only forgets; it never invents or misplaces a block).
    #[test]
    fn concurrent_ingest_eviction_and_lookups_stay_consistent(
        schedules in proptest::collection::vec(proptest::collection::vec(step(), 1..40), ENDPOINTS as usize),
        capacity in 20usize..200,
        shards in 1usize..4,
    ) {
        let config = IndexConfig { block_size: BS, capacity };
        let shared = Arc::new(SharedIndex::sharded(config, shards).unwrap());
        let unbounded = || KvIndex::new(IndexConfig { block_size: BS, capacity: 1 << 20 }).unwrap();
        let mut engines = unbounded();
        // The most entries each shard can ever hold at once, however the writers interleave.
        let mut peak = vec![0; shards];
        for (e, schedule) in schedules.iter().enumerate() {
            let mut alone = unbounded();
            let mut most = 0;
            for step in schedule {
                let events = step_events(e as u32, step);
                engines.apply(EndpointId(e as u32), &events);
                alone.apply(EndpointId(e as u32), &events);
                most = most.max(alone.entry_count());
            }
            peak[shared.shard_of(EndpointId(e as u32))] += most;
        }
        // Each shard bounds itself to its share of the capacity.
        let share = |s: usize| capacity / shards + usize::from(s < capacity % shards);
        let never_evicts = peak.iter().enumerate().all(|(s, &p)| p <= share(s) / 10 * 9);
        let probes: Vec<_> = (0..DOCS).map(|d| router_keys(&doc(d), BS, None).unwrap()).collect();
        std::thread::scope(|scope| {
            for (e, schedule) in schedules.iter().enumerate() {
                let shared = shared.clone();
                scope.spawn(move || {
                    for step in schedule {
                        shared.apply(EndpointId(e as u32), &step_events(e as u32, step));
                    }
                });
            }
            for r in 0..2 {
                let (shared, probes) = (shared.clone(), &probes);
                scope.spawn(move || {
                    for i in 0..300 {
                        let probe = &probes[(i * 5 + r) % probes.len()];
                        let found = shared.lookup(probe);
                        assert!(found.matches.windows(2).all(|w| w[0].endpoint < w[1].endpoint));
                        for m in &found.matches {
                            assert!(m.blocks as usize <= probe.len() && m.blocks > 0, "{m:?}");
                            assert_eq!(m.gpu_blocks, m.blocks, "GPU-only events: {m:?}");
                        }
                    }
                });
            }
        });
        shared.read(|index| {
            assert!(index.entry_count() <= capacity, "{} > {capacity}", index.entry_count());
            let held: u64 = (0..ENDPOINTS)
                .filter_map(|e| index.endpoint_stats(EndpointId(e)))
                .map(|s| s.blocks_gpu)
                .sum();
            assert_eq!(held as usize, index.entry_count(), "counters agree with contents");
            for e in (0..ENDPOINTS).map(EndpointId) {
                let counted = index.endpoint_stats(e).map_or(0, |s| s.blocks_gpu);
                assert_eq!(shared.gpu_blocks(e), counted, "{e:?}'s published count");
            }
        });
        for probe in &probes {
            let (got, truth) = (shared.lookup(probe), engines.lookup(probe));
            for m in &got.matches {
                assert!(m.blocks <= truth.blocks(m.endpoint), "index {m:?} beyond the engine's {:?}", truth.get(m.endpoint));
            }
            if never_evicts {
                assert_eq!(&got, &truth, "under the high-water mark nothing is evicted");
            }
        }
    }
}
