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

/// Write-through, as vLLM's OffloadingConnector: computed blocks are stored on the CPU tier at
/// once, the head of the prefix left most recent (a full tier drops the tail first), and a
/// later GPU eviction stores nothing more.
#[test]
fn computed_blocks_are_written_through_to_the_cpu_tier() {
    let mut pool = BlockPool::new(4, 3, 2);
    let cpu_events = |events: &[KvEvent]| {
        let stores = events
            .iter()
            .filter(|e| matches!(e, KvEvent::BlockStored(s) if s.medium.as_deref() == Some("CPU")))
            .count();
        let removes = events
            .iter()
            .filter(|e| matches!(e, KvEvent::BlockRemoved(r) if r.medium.as_deref() == Some("CPU")))
            .count();
        (stores, removes)
    };
    let (d, t) = digests(2, 3);
    let a = pool.allocate(2).unwrap();
    pool.cache_full_blocks(&a, full(&d, &t, &vec![None; d.len()]));
    assert_eq!(cpu_events(&pool.take_events()), (2, 0));
    let (e, u) = digests(1, 4);
    let b = pool.allocate(1).unwrap();
    pool.cache_full_blocks(&b, full(&e, &u, &[None]));
    assert_eq!(cpu_events(&pool.take_events()), (1, 1));
    assert!(
        pool.in_cpu(&d[0]) && !pool.in_cpu(&d[1]),
        "the tail went first"
    );
    pool.free(&a);
    pool.free(&b);
    pool.allocate(3).unwrap();
    assert_eq!(
        cpu_events(&pool.take_events()),
        (0, 0),
        "evicting stores nothing"
    );
    assert!(pool.in_cpu(&d[0]) && pool.in_cpu(&e[0]));
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

#[test]
fn block_state_follows_the_blocks_used_not_the_capacity() {
    let mut pool = BlockPool::new(4, 1_000_000, 0);
    assert_eq!(pool.blocks.len(), 0, "nothing allocated up front");
    let a = pool.allocate(3).unwrap();
    assert_eq!(a, vec![0, 1, 2], "never-used blocks are taken in id order");
    assert_eq!(pool.blocks.len(), 3);
    assert_eq!(pool.free_blocks(), 999_997);
    pool.free(&a);
    // Freed without content: reused (tail first) before any never-used block.
    assert_eq!(pool.allocate(2).unwrap(), vec![2, 1]);
    assert_eq!(pool.blocks.len(), 3);
}

/// The pool's allocation order, as it was when every block's state was made up front: one
/// free queue of all blocks, never-used ones queued in id order at the start.
struct EagerModel {
    ref_count: Vec<u32>,
    cached: Vec<bool>,
    stamp_of: Vec<Option<u64>>,
    free: BTreeMap<u64, BlockId>,
    stamp: u64,
    front: u64,
}

impl EagerModel {
    fn new(n: usize) -> Self {
        let mut m = Self {
            ref_count: vec![0; n],
            cached: vec![false; n],
            stamp_of: vec![None; n],
            free: BTreeMap::new(),
            stamp: FRONT,
            front: FRONT,
        };
        for id in 0..n as BlockId {
            m.stamp_of[id as usize] = Some(m.stamp);
            m.free.insert(m.stamp, id);
            m.stamp += 1;
        }
        m
    }

    fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if self.free.len() < n {
            return None;
        }
        let ids: Vec<BlockId> = (0..n).map(|_| self.free.pop_first().unwrap().1).collect();
        for &id in &ids {
            self.stamp_of[id as usize] = None;
            self.ref_count[id as usize] = 1;
            self.cached[id as usize] = false;
        }
        Some(ids)
    }

    fn free(&mut self, ids: &[BlockId]) {
        let mut uncached = Vec::new();
        for &id in ids.iter().rev() {
            let i = id as usize;
            self.ref_count[i] -= 1;
            if self.ref_count[i] == 0 {
                if self.cached[i] {
                    self.stamp_of[i] = Some(self.stamp);
                    self.free.insert(self.stamp, id);
                    self.stamp += 1;
                } else {
                    uncached.push(id);
                }
            }
        }
        for &id in uncached.iter().rev() {
            self.front -= 1;
            self.stamp_of[id as usize] = Some(self.front);
            self.free.insert(self.front, id);
        }
    }
}

proptest::proptest! {
    /// Whatever is allocated, cached and freed, the lazily allocated pool hands out the very
    /// blocks, in the very order, that a pool with every block queued up front would.
    #[test]
    fn lazy_state_allocates_as_an_eager_pool(
        ops in proptest::collection::vec((0usize..6, proptest::bool::ANY, 0usize..8), 1..60),
    ) {
        const CAPACITY: usize = 24;
        let mut pool = BlockPool::new(4, CAPACITY, 0);
        let mut model = EagerModel::new(CAPACITY);
        let mut held: Vec<Vec<BlockId>> = Vec::new();
        let mut salt = 100;
        for (n, cache, pick) in ops {
            if held.is_empty() || n > 0 {
                let got = pool.allocate(n);
                proptest::prop_assert_eq!(&got, &model.allocate(n));
                let Some(ids) = got else { continue };
                if cache && !ids.is_empty() {
                    salt += 1;
                    let (d, t) = digests(ids.len(), salt);
                    pool.cache_full_blocks(&ids, full(&d, &t, &vec![None; d.len()]));
                    for &id in &ids {
                        model.cached[id as usize] = true;
                    }
                }
                held.push(ids);
            }
            if !held.is_empty() && (n == 0 || pick % 2 == 0) {
                let ids = held.swap_remove(pick % held.len());
                pool.free(&ids);
                model.free(&ids);
            }
            proptest::prop_assert_eq!(pool.free_blocks(), model.free.len());
            proptest::prop_assert!(pool.blocks.len() <= CAPACITY);
        }
    }
}
