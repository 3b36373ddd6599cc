use kvroute_core::keys::VllmHasher;

use super::*;

fn full<'a>(d: &'a [VllmDigest], t: &'a [u32], extra: &'a [BlockExtraKeys]) -> FullBlocks<'a> {
    FullBlocks {
        digests: d,
        parent: None,
        tokens: t,
        extra,
        lora_name: None,
    }
}

fn digests(n: usize, salt: u32) -> (Vec<VllmDigest>, Vec<u32>) {
    let tokens: Vec<u32> = (0..(n * 4) as u32).map(|t| t + salt * 10_000).collect();
    let d = VllmHasher::new("s")
        .block_digests(&tokens, 4, None)
        .unwrap();
    (d, tokens)
}

fn removed(events: &[KvEvent]) -> Vec<u64> {
    events
        .iter()
        .filter_map(|e| match e {
            KvEvent::BlockRemoved(r) if r.medium.as_deref() == Some("GPU") => {
                Some(r.block_hashes[0].0)
            }
            _ => None,
        })
        .collect()
}

#[test]
fn freed_blocks_stay_cached_until_reused_least_recently_freed_first() {
    let mut pool = BlockPool::new(4, 4, 0);
    let (da, ta) = digests(2, 1);
    let a = pool.allocate(2).unwrap();
    pool.cache_full_blocks(&a, full(&da, &ta, &[None, None]));
    let stored = pool.take_events();
    assert_eq!(stored.len(), 1);
    pool.free(&a);
    assert_eq!(pool.cached_blocks(), 2);
    assert_eq!(pool.usage(), 0.0, "evictable cached blocks count as free");
    // Two never-used blocks are free first; then a's tail (freed first), then a's head.
    let _b = pool.allocate(3).unwrap();
    assert_eq!(removed(&pool.take_events()), vec![da[1].event_u64()]);
    assert!(pool.lookup(&da[0]).is_some());
    assert!(pool.lookup(&da[1]).is_none());
}

#[test]
fn allocation_fails_cleanly_when_blocks_are_in_use() {
    let mut pool = BlockPool::new(4, 2, 0);
    let a = pool.allocate(2).unwrap();
    assert!(pool.allocate(1).is_none());
    pool.free(&a);
    assert!(pool.allocate(2).is_some());
}

#[test]
fn a_hit_block_leaves_the_free_queue() {
    let mut pool = BlockPool::new(4, 2, 0);
    let (d, t) = digests(1, 2);
    let a = pool.allocate(1).unwrap();
    pool.cache_full_blocks(&a, full(&d, &t, &vec![None; d.len()]));
    pool.free(&a);
    let hit = pool.lookup(&d[0]).unwrap();
    pool.touch(hit);
    assert_eq!(pool.free_blocks(), 1);
    assert!(pool.allocate(2).is_none(), "the hit block is in use");
}

#[test]
fn eviction_offloads_to_the_cpu_tier_which_evicts_its_oldest() {
    let mut pool = BlockPool::new(4, 2, 1);
    let (d, t) = digests(2, 3);
    let a = pool.allocate(2).unwrap();
    pool.cache_full_blocks(&a, full(&d, &t, &vec![None; d.len()]));
    pool.free(&a);
    pool.take_events();
    pool.allocate(2).unwrap();
    let events = pool.take_events();
    let cpu_stores = events
        .iter()
        .filter(|e| matches!(e, KvEvent::BlockStored(s) if s.medium.as_deref() == Some("CPU")))
        .count();
    let cpu_removes = events
        .iter()
        .filter(|e| matches!(e, KvEvent::BlockRemoved(r) if r.medium.as_deref() == Some("CPU")))
        .count();
    assert_eq!((cpu_stores, cpu_removes), (2, 1));
    assert_eq!(pool.cpu_blocks(), 1);
    assert!(
        pool.in_cpu(&d[0]),
        "head freed last, evicted last, offloaded last"
    );
}

#[test]
fn reset_is_refused_while_blocks_are_in_use() {
    let mut pool = BlockPool::new(4, 2, 0);
    let a = pool.allocate(1).unwrap();
    assert!(!pool.reset());
    pool.free(&a);
    assert!(pool.reset());
    assert_eq!(pool.take_events(), vec![KvEvent::AllBlocksCleared]);
}

#[test]
fn an_index_fed_the_pools_events_sees_an_offloaded_block_on_the_cpu() {
    use kvroute_core::index::{EndpointId, IndexConfig, KvIndex};
    // The copy exists before the GPU block is freed: the CPU store must come first, or the
    // index (which resolves the placeholder through the GPU block it still knows) cannot
    // place it.
    let mut index = KvIndex::new(IndexConfig {
        block_size: 4,
        capacity: 1 << 10,
    })
    .unwrap();
    let e = EndpointId(0);
    let mut pool = BlockPool::new(4, 2, 2);
    let (d, t) = digests(2, 4);
    let a = pool.allocate(2).unwrap();
    pool.cache_full_blocks(&a, full(&d, &t, &vec![None; d.len()]));
    pool.free(&a);
    index.apply(e, &pool.take_events());
    pool.allocate(2).unwrap();
    index.apply(e, &pool.take_events());
    let stats = index.endpoint_stats(e).unwrap();
    assert_eq!((stats.blocks_gpu, stats.blocks_cpu), (0, 2), "{stats:?}");
    assert_eq!(stats.offload_orphans, 0);
}
