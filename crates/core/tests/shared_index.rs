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
    let shared = Arc::new(SharedIndex::new(
        KvIndex::new(IndexConfig::default()).unwrap(),
    ));
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
