//! Offloaded tiers in the index: chunk placeholders, reference counts, orphans, LMCache chunks
//! and the shared tier.

use super::*;
use crate::event::{BlockRemoved, BlockStored};
use crate::keys::router_keys;

const BS: usize = 4;
const E0: EndpointId = EndpointId(0);
const E1: EndpointId = EndpointId(1);
const E2: EndpointId = EndpointId(2);

fn index() -> KvIndex {
    KvIndex::new(IndexConfig {
        block_size: BS,
        capacity: 1 << 20,
    })
    .unwrap()
}

fn doc(blocks: usize) -> Vec<u32> {
    (0..(blocks * BS) as u32).map(|t| t * 3 + 11).collect()
}

fn hashes(tokens: &[u32]) -> Vec<EngineHash> {
    router_keys(tokens, BS, None)
        .unwrap()
        .iter()
        .map(|k| EngineHash(k.0.rotate_left(9) ^ 0x77))
        .collect()
}

fn gpu_store(tokens: &[u32]) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: hashes(tokens),
        token_ids: tokens.to_vec(),
        block_size: BS as u32,
        medium: Some("GPU".into()),
        ..Default::default()
    })
}

fn placeholder(hashes: Vec<EngineHash>, medium: &str, block_size: u32) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: hashes,
        block_size,
        medium: Some(medium.into()),
        ..Default::default()
    })
}

fn removal(hashes: Vec<EngineHash>, medium: &str) -> KvEvent {
    KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: hashes,
        medium: Some(medium.into()),
        group_idx: None,
    })
}

fn tiers(ix: &KvIndex, e: EndpointId, tokens: &[u32]) -> PrefixMatch {
    let keys = router_keys(tokens, BS, None).unwrap();
    ix.lookup(&keys).get(e).copied().unwrap_or(PrefixMatch {
        endpoint: e,
        blocks: 0,
        gpu_blocks: 0,
        cpu_blocks: 0,
        storage_blocks: 0,
        shared_blocks: 0,
    })
}

#[test]
fn a_chunk_placeholder_names_its_last_block_and_covers_the_whole_chunk() {
    let mut ix = index();
    let spec = OffloadSpec {
        block_size: Some(4 * BS),
        shared: None,
    };
    ix.set_offload(E0, &spec).unwrap();
    let d = doc(8);
    let h = hashes(&d);
    ix.apply(E0, &[gpu_store(&d)]);
    // 0.24+: one hash per chunk (its last block), block_size 0.
    ix.apply(E0, &[placeholder(vec![h[3], h[7]], "CPU", 0)]);
    ix.apply(E0, &[removal(h.clone(), "GPU")]);
    let m = tiers(&ix, E0, &d);
    assert_eq!((m.blocks, m.cpu_blocks), (8, 8), "{m:?}");
    assert_eq!(ix.endpoint_stats(E0).unwrap().offload_orphans, 0);
    // Removing the second chunk by its last hash removes its four blocks.
    ix.apply(E0, &[removal(vec![h[7]], "CPU")]);
    assert_eq!(tiers(&ix, E0, &d).blocks, 4);
    assert_eq!(ix.entry_count(), 4);
}

#[test]
fn before_0_20_the_chunk_size_comes_from_the_event() {
    let mut ix = index();
    let d = doc(4);
    let h = hashes(&d);
    // The chunk size is learned from the first offload event; configured, parents are kept
    // from the first GPU store.
    ix.set_offload(
        E0,
        &OffloadSpec {
            block_size: Some(2 * BS),
            shared: None,
        },
    )
    .unwrap();
    ix.apply(E0, &[gpu_store(&d)]);
    ix.apply(E0, &[placeholder(vec![h[1], h[3]], "CPU", 2 * BS as u32)]);
    ix.apply(E0, &[removal(h, "GPU")]);
    assert_eq!(tiers(&ix, E0, &d).cpu_blocks, 4);
}

#[test]
fn an_unconfigured_chunk_is_credited_only_as_far_as_it_resolves() {
    let mut ix = index();
    let d = doc(4);
    let h = hashes(&d);
    ix.apply(E0, &[gpu_store(&d)]);
    // 64-token chunks announced, but no parent links were kept: the chunk's last block is
    // known, its first three are orphans (never guessed).
    ix.apply(E0, &[placeholder(vec![h[3]], "CPU", 4 * BS as u32)]);
    assert_eq!(ix.endpoint_stats(E0).unwrap().offload_orphans, 3);
    ix.apply(E0, &[removal(h, "GPU")]);
    assert_eq!(tiers(&ix, E0, &d).blocks, 0, "under-predicts, never over");
}

#[test]
fn repeated_offload_stores_are_reference_counted() {
    let mut ix = index();
    let d = doc(2);
    let h = hashes(&d);
    ix.apply(E0, &[gpu_store(&d)]);
    ix.apply(E0, &[placeholder(h.clone(), "CPU", 0)]);
    ix.apply(E0, &[placeholder(h[..1].to_vec(), "CPU", 0)]);
    assert_eq!(ix.endpoint_stats(E0).unwrap().offload_repeats, 1);
    ix.apply(E0, &[removal(h.clone(), "GPU"), removal(h.clone(), "CPU")]);
    // Block 0 was stored twice on the CPU: one removal leaves it there.
    let m = tiers(&ix, E0, &d);
    assert_eq!((m.blocks, m.cpu_blocks), (1, 1));
    ix.apply(E0, &[removal(h[..1].to_vec(), "CPU")]);
    assert_eq!(tiers(&ix, E0, &d).blocks, 0);
    assert_eq!(ix.entry_count(), 0);
    // A third removal names a block no longer held: an orphan, nothing changes.
    ix.apply(E0, &[removal(h[..1].to_vec(), "CPU")]);
    assert_eq!(ix.endpoint_stats(E0).unwrap().offload_orphans, 1);
}

#[test]
fn a_cpu_tier_shows_its_capacity_when_it_first_evicts() {
    let mut ix = index();
    let d = doc(5);
    let h = hashes(&d);
    ix.apply(E0, &[gpu_store(&d), placeholder(h.clone(), "CPU", 0)]);
    // Five blocks held and none removed: the tier may hold more, its capacity is unknown.
    assert_eq!(ix.cpu_capacity_blocks(E0), 0);
    ix.apply(E0, &[removal(h[4..].to_vec(), "CPU")]);
    assert_eq!(ix.cpu_capacity_blocks(E0), 5);
    // GPU removals say nothing of the CPU tier, and a later eviction from a tier holding fewer
    // (some of its blocks were removed) does not lower what the first one showed.
    ix.apply(
        E0,
        &[removal(h.clone(), "GPU"), removal(h[3..4].to_vec(), "CPU")],
    );
    assert_eq!(ix.cpu_capacity_blocks(E0), 5);
    assert_eq!(ix.endpoint_stats(E0).unwrap().blocks_cpu, 3);
    // A cleared engine (restarted, or another in its slot) shows its tier again.
    ix.apply(E0, &[KvEvent::AllBlocksCleared]);
    assert_eq!(ix.cpu_capacity_blocks(E0), 0);
}

#[test]
fn a_placeholder_naming_an_unknown_hash_is_an_orphan() {
    let mut ix = index();
    ix.apply(E0, &[placeholder(vec![EngineHash(42)], "STORAGE", 0)]);
    let stats = ix.endpoint_stats(E0).unwrap();
    assert_eq!((stats.offload_orphans, stats.blocks_storage), (1, 0));
    assert_eq!(ix.entry_count(), 0);
}

#[test]
fn lmcache_chunks_with_tokens_index_every_block() {
    let mut ix = index();
    let d = doc(8);
    // LMCache: its own chunk hashes over 4-block chunks, tokens included, never a removal.
    let chunk = |i: usize, parent: Option<EngineHash>| {
        KvEvent::BlockStored(BlockStored {
            block_hashes: vec![EngineHash(900 + i as u64)],
            parent_block_hash: parent,
            token_ids: d[i * 4 * BS..(i + 1) * 4 * BS].to_vec(),
            block_size: (4 * BS) as u32,
            medium: Some("cpu".into()),
            ..Default::default()
        })
    };
    ix.apply(E0, &[chunk(0, None), chunk(1, Some(EngineHash(900)))]);
    let m = tiers(&ix, E0, &d);
    assert_eq!((m.blocks, m.cpu_blocks), (8, 8), "{m:?}");
    // The GPU's own events for the same blocks coexist with them.
    ix.apply(E0, &[gpu_store(&d)]);
    assert_eq!(tiers(&ix, E0, &d).gpu_blocks, 8);
    ix.apply(E0, &[removal(hashes(&d), "GPU")]);
    assert_eq!(tiers(&ix, E0, &d).cpu_blocks, 8);
    // A chunk whose size is not a whole number of blocks is refused.
    let mut odd = chunk(0, None);
    if let KvEvent::BlockStored(s) = &mut odd {
        s.block_size = (4 * BS + 1) as u32;
        s.token_ids.push(1);
    }
    ix.apply(E1, &[odd]);
    assert_eq!(ix.endpoint_stats(E1).unwrap().block_size_mismatches, 1);
}

#[test]
fn a_shared_tier_block_is_a_hit_on_every_endpoint_that_mounts_it() {
    let mut ix = index();
    let lustre = OffloadSpec {
        block_size: None,
        shared: Some(SharedMount::new("lustre")),
    };
    ix.set_offload(E0, &lustre).unwrap();
    ix.set_offload(E1, &lustre).unwrap();
    ix.add_endpoint(E2); // mounts nothing
    let d = doc(3);
    let h = hashes(&d);
    ix.apply(E0, &[gpu_store(&d), placeholder(h.clone(), "FS", 0)]);
    let m0 = tiers(&ix, E0, &d);
    assert_eq!(
        (m0.gpu_blocks, m0.shared_blocks),
        (3, 0),
        "its own GPU copy first"
    );
    let m1 = tiers(&ix, E1, &d);
    assert_eq!((m1.blocks, m1.shared_blocks), (3, 3));
    assert_eq!(tiers(&ix, E2, &d).blocks, 0);
    // The writer's GPU forgets the blocks: they stay on the filesystem for both.
    ix.apply(E0, &[removal(h.clone(), "GPU")]);
    assert_eq!(tiers(&ix, E0, &d).shared_blocks, 3);
    assert_eq!(
        ix.entry_count(),
        0,
        "the shared tier holds no per-endpoint entries"
    );
    // A pod restart (cache cleared) does not empty the filesystem.
    ix.apply(E1, &[KvEvent::AllBlocksCleared]);
    assert_eq!(tiers(&ix, E1, &d).shared_blocks, 3);
    // The writer removes one block from the filesystem: the prefix stops there for everyone.
    ix.apply(E0, &[removal(vec![h[1]], "FS")]);
    assert_eq!(tiers(&ix, E1, &d).blocks, 1);
    assert_eq!(ix.shared_tier_stats().blocks, 2);
    // Without a mount, an FS event is the endpoint's own storage.
    ix.apply(E2, &[gpu_store(&d), placeholder(h, "FS", 0)]);
    assert_eq!(ix.endpoint_stats(E2).unwrap().blocks_storage, 3);
}

#[test]
fn an_offload_block_size_must_be_whole_blocks() {
    let mut ix = index();
    let spec = OffloadSpec {
        block_size: Some(BS + 1),
        shared: None,
    };
    assert!(matches!(
        ix.set_offload(E0, &spec),
        Err(CoreError::OffloadBlockSize { .. })
    ));
    let huge = OffloadSpec {
        block_size: Some(BS * 100_000),
        shared: None,
    };
    assert!(ix.set_offload(E0, &huge).is_err());
    // A placeholder claiming a huge chunk is refused, not walked.
    ix.apply(E0, &[placeholder(vec![EngineHash(1)], "CPU", u32::MAX)]);
    assert_eq!(ix.endpoint_stats(E0).unwrap().malformed_blocks, 1);
}

#[test]
fn a_shared_tier_block_written_on_one_shard_is_a_hit_on_the_others() {
    let config = index().config().clone();
    let ix = SharedIndex::sharded(config, 2).unwrap();
    let lustre = OffloadSpec {
        block_size: None,
        shared: Some(SharedMount::new("lustre")),
    };
    ix.set_offload(E0, &lustre).unwrap();
    ix.set_offload(E1, &lustre).unwrap();
    assert_ne!(ix.shard_of(E0), ix.shard_of(E1));
    let d = doc(3);
    let h = hashes(&d);
    let keys = router_keys(&d, BS, None).unwrap();
    ix.apply(E0, &[gpu_store(&d), placeholder(h.clone(), "FS", 0)]);
    let m1 = ix.lookup(&keys).get(E1).copied();
    assert_eq!(m1.map(|m| (m.blocks, m.shared_blocks)), Some((3, 3)));
    assert_eq!(ix.shared_tier_stats().blocks, 3);
    // Removed on the writer's shard: gone for the other shard too.
    ix.apply(E0, &[removal(vec![h[0]], "FS")]);
    assert_eq!(ix.lookup(&keys).blocks(E1), 0);
    // An endpoint forgotten on the other shard no longer mounts the tier.
    ix.remove_endpoint(E1);
    ix.add_endpoint(E1);
    ix.apply(E0, &[placeholder(vec![h[0]], "FS", 0)]);
    assert_eq!(ix.lookup(&keys).blocks(E1), 0);
    assert_eq!(ix.lookup(&keys).blocks(E0), 3);
}
