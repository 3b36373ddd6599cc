use super::*;

const BS: usize = 4;

/// The engine's GPU store of blocks `hashes` (tokens `1..`), chained after `parent`.
fn gpu_store(hashes: &[u64], parent: Option<u64>) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: hashes.iter().map(|&h| EngineHash(h)).collect(),
        parent_block_hash: parent.map(EngineHash),
        token_ids: (0..(hashes.len() * BS) as u32).map(|t| t + 1).collect(),
        block_size: BS as u32,
        medium: Some("GPU".into()),
        ..BlockStored::default()
    })
}

/// The engine's canonical event for `hash` on `medium`: a store or a removal.
fn tier(stored: bool, hash: u64, medium: &str) -> KvEvent {
    if stored {
        KvEvent::BlockStored(BlockStored {
            block_hashes: vec![EngineHash(hash)],
            medium: Some(medium.into()),
            ..BlockStored::default()
        })
    } else {
        KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![EngineHash(hash)],
            medium: Some(medium.into()),
            group_idx: None,
        })
    }
}

fn stores(events: &[KvEvent], medium: &str) -> Vec<BlockStored> {
    events
        .iter()
        .filter_map(|e| match e {
            KvEvent::BlockStored(s) if s.medium.as_deref() == Some(medium) => Some(s.clone()),
            _ => None,
        })
        .collect()
}

fn removals(events: &[KvEvent], medium: &str) -> usize {
    events
        .iter()
        .filter(|e| matches!(e, KvEvent::BlockRemoved(r) if r.medium.as_deref() == Some(medium)))
        .count()
}

#[test]
fn vllm_placeholders_announce_each_store_and_remove_once_per_store() {
    let mut c = ConnectorEvents::new(OffloadEvents::Vllm, BS, 100, "0.33.0");
    // Written through when computed: the GPU's store, then the CPU's placeholder.
    let out = c.shape(vec![gpu_store(&[1, 2], None), tier(true, 2, "CPU")]);
    let cpu = stores(&out, "CPU");
    assert_eq!(cpu.len(), 1);
    assert_eq!(cpu[0].block_size, 0, "0.20+: no size in a placeholder");
    assert!(cpu[0].token_ids.is_empty() && cpu[0].parent_block_hash.is_none());
    // Evicted from the GPU while the CPU holds it: nothing is stored again.
    let out = c.shape(vec![tier(false, 2, "GPU")]);
    assert!(stores(&out, "CPU").is_empty(), "{out:?}");
    assert_eq!(removals(&out, "GPU"), 1);
    // A block stored twice (vLLM's overlapping chunks re-announce shared hashes) is removed
    // once per store, as vLLM documents.
    c.shape(vec![tier(true, 2, "CPU")]);
    let out = c.shape(vec![tier(false, 2, "CPU")]);
    assert_eq!(removals(&out, "CPU"), 2);
    // A shared filesystem's blocks: one store, one removal.
    c.shape(vec![gpu_store(&[3], Some(2)), tier(true, 3, "FS")]);
    let out = c.shape(vec![tier(false, 3, "GPU")]);
    assert!(stores(&out, "FS").is_empty(), "{out:?}");
    assert_eq!(removals(&c.shape(vec![tier(false, 3, "FS")]), "FS"), 1);
}

#[test]
fn releases_before_0_20_name_the_offloaded_block_size() {
    let mut c = ConnectorEvents::new(OffloadEvents::Vllm, BS, 100, "0.13.0");
    c.shape(vec![gpu_store(&[1], None)]);
    let out = c.shape(vec![tier(true, 1, "CPU"), tier(false, 1, "GPU")]);
    assert_eq!(stores(&out, "CPU")[0].block_size, BS as u32);
}

#[test]
fn self_describing_stores_carry_tokens_parent_and_block_size() {
    let mut c = ConnectorEvents::new(OffloadEvents::VllmSelfDescribing, BS, 100, "0.33.0");
    c.shape(vec![gpu_store(&[1, 2], None)]);
    let out = c.shape(vec![tier(true, 2, "STORAGE"), tier(false, 2, "GPU")]);
    let stored = &stores(&out, "STORAGE")[0];
    assert_eq!(stored.block_hashes, vec![EngineHash(2)]);
    assert_eq!(stored.parent_block_hash, Some(EngineHash(1)));
    assert_eq!(stored.token_ids, vec![5, 6, 7, 8]);
    assert_eq!(stored.block_size, BS as u32);
    // Removals fan out to the same hash.
    assert_eq!(
        removals(&c.shape(vec![tier(false, 2, "STORAGE")]), "STORAGE"),
        1
    );
}

#[test]
fn lmcache_stores_on_write_with_its_own_chained_hashes_and_never_removes() {
    let mut c = ConnectorEvents::new(OffloadEvents::Lmcache, BS, 100, "0.33.0");
    let out = c.shape(vec![gpu_store(&[1, 2], None)]);
    let chunks = stores(&out, LMCACHE_MEDIUM);
    assert_eq!(chunks.len(), 2);
    assert!(chunks.iter().all(|s| s.block_size == BS as u32));
    assert_ne!(
        chunks[0].block_hashes,
        vec![EngineHash(1)],
        "not vLLM's hash"
    );
    assert_eq!(chunks[0].parent_block_hash, None);
    assert_eq!(chunks[1].parent_block_hash, Some(chunks[0].block_hashes[0]));
    assert_eq!(chunks[1].token_ids, vec![5, 6, 7, 8]);
    // The engine's tier moves are not published; its GPU events are.
    let out = c.shape(vec![
        tier(true, 2, "CPU"),
        tier(false, 2, "GPU"),
        tier(false, 2, "CPU"),
    ]);
    assert_eq!(out.len(), 1, "{out:?}");
    assert_eq!(removals(&out, "GPU"), 1);
    // The same tokens after the same parent get the same chunk hash.
    let again = ConnectorEvents::new(OffloadEvents::Lmcache, BS, 100, "0.33.0")
        .shape(vec![gpu_store(&[7, 8], None)]);
    assert_eq!(
        stores(&again, LMCACHE_MEDIUM)[1].block_hashes,
        chunks[1].block_hashes
    );
}

#[test]
fn what_is_remembered_is_bounded() {
    let mut c = ConnectorEvents::new(OffloadEvents::VllmSelfDescribing, BS, 8, "0.33.0");
    for i in 0..100u64 {
        c.shape(vec![gpu_store(&[1_000 + i], None)]);
    }
    assert!(
        c.blocks.len() <= 8 && c.order.len() <= 8,
        "{}",
        c.blocks.len()
    );
    // A block whose store was forgotten is published as a placeholder.
    let out = c.shape(vec![tier(true, 1_000, "CPU")]);
    assert!(stores(&out, "CPU")[0].token_ids.is_empty());
}

#[test]
fn shapes_are_named_as_the_flag_takes_them() {
    for (name, shape) in [
        ("vllm", OffloadEvents::Vllm),
        ("vllm-self-describing", OffloadEvents::VllmSelfDescribing),
        ("lmcache", OffloadEvents::Lmcache),
    ] {
        assert_eq!(name.parse::<OffloadEvents>(), Ok(shape));
    }
    assert!("mooncake".parse::<OffloadEvents>().is_err());
}
