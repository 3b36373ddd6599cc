use kvroute_core::event::{BlockRemoved, BlockStored, EngineHash, KvEvent, Tier};
use kvroute_core::index::{EndpointId, IndexConfig, KvIndex};
use kvroute_core::keys::{ExtraKey, router_keys};

use super::Journal;

const BS: usize = 4;
const E: EndpointId = EndpointId(3);

fn tokens(seed: u32, blocks: usize) -> Vec<u32> {
    (0..(blocks * BS) as u32).map(|t| seed * 1000 + t).collect()
}

fn stored(hashes: &[u64], parent: Option<u64>, tokens: Vec<u32>, medium: &str) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: hashes.iter().copied().map(EngineHash).collect(),
        parent_block_hash: parent.map(EngineHash),
        token_ids: tokens,
        block_size: BS as u32,
        medium: Some(medium.into()),
        ..BlockStored::default()
    })
}

fn removed(hashes: &[u64], medium: &str) -> KvEvent {
    KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: hashes.iter().copied().map(EngineHash).collect(),
        medium: Some(medium.into()),
        group_idx: None,
    })
}

fn index(capacity: usize) -> KvIndex {
    KvIndex::new(IndexConfig {
        block_size: BS,
        capacity,
    })
    .unwrap()
}

/// Feeds `batches` to an index and a journal, exports, applies the export to a fresh index,
/// and checks that both indexes answer every lookup of `prompts` alike.
fn round_trip(batches: &[Vec<KvEvent>], prompts: &[Vec<u32>], capacity: usize) -> KvIndex {
    let mut original = index(capacity);
    let mut journal = Journal::default();
    for (seq, batch) in batches.iter().enumerate() {
        original.apply(E, batch);
        journal.apply(E, Some(seq as u64), batch);
    }
    let export = journal.export(E, &original);
    assert_eq!(export.seq, Some(batches.len() as u64 - 1));
    let mut copy = index(capacity);
    copy.apply(E, &export.events);
    for prompt in prompts {
        let keys = router_keys(prompt, BS, None).unwrap();
        assert_eq!(
            original.lookup(&keys).get(E),
            copy.lookup(&keys).get(E),
            "{prompt:?}"
        );
    }
    let (a, b) = (
        original.endpoint_stats(E).unwrap(),
        copy.endpoint_stats(E).unwrap(),
    );
    assert_eq!(
        (a.blocks_gpu, a.blocks_cpu, a.blocks_storage),
        (b.blocks_gpu, b.blocks_cpu, b.blocks_storage)
    );
    assert_eq!(original.entry_count(), copy.entry_count());
    copy
}

#[test]
fn an_export_rebuilds_the_same_index() {
    let a = tokens(1, 3);
    let mut b = a[..2 * BS].to_vec();
    b.extend(tokens(2, 2));
    let batches = vec![
        vec![stored(&[1, 2, 3], None, a.clone(), "GPU")],
        // A branch after two shared blocks, then the first chain's tail evicted.
        vec![stored(&[4, 5], Some(2), b[2 * BS..].to_vec(), "GPU")],
        vec![removed(&[3], "GPU")],
        // Offloaded to CPU, then dropped from the GPU: held on the CPU tier only.
        vec![stored(&[4], None, vec![], "CPU"), removed(&[4], "GPU")],
    ];
    let copy = round_trip(&batches, &[a, b], 1 << 20);
    assert_eq!(copy.endpoint_stats(E).unwrap().blocks_cpu, 1);
}

#[test]
fn a_held_block_whose_parent_was_removed_is_still_placed() {
    let a = tokens(1, 3);
    let batches = vec![
        vec![stored(&[1, 2, 3], None, a.clone(), "GPU")],
        // The middle block goes first: the last one's key was made from it.
        vec![removed(&[2], "GPU")],
    ];
    let copy = round_trip(&batches, std::slice::from_ref(&a), 1 << 20);
    let keys = router_keys(&a, BS, None).unwrap();
    assert!(copy.holds(E, keys[2], Tier::Gpu));
    assert!(!copy.holds(E, keys[1], Tier::Gpu));
}

#[test]
fn what_the_index_dropped_is_not_exported() {
    // A capacity of 10 entries: storing twelve blocks makes the index's bound drop three, down
    // to its high-water mark (90%); `round_trip` checks that the copy holds exactly what the
    // original kept.
    let a = tokens(1, 6);
    let b = tokens(2, 6);
    let batches = vec![
        vec![stored(&[1, 2, 3, 4, 5, 6], None, a.clone(), "GPU")],
        vec![stored(&[7, 8, 9, 10, 11, 12], None, b.clone(), "GPU")],
    ];
    let copy = round_trip(&batches, &[a, b], 10);
    assert_eq!(copy.entry_count(), 9);
}

#[test]
fn extra_keys_and_lora_names_survive() {
    let a = tokens(1, 2);
    let event = KvEvent::BlockStored(BlockStored {
        block_hashes: vec![EngineHash(1), EngineHash(2)],
        token_ids: a.clone(),
        block_size: BS as u32,
        lora_name: Some("adapter".into()),
        ..BlockStored::default()
    });
    let mut original = index(1 << 20);
    let mut journal = Journal::default();
    original.apply(E, std::slice::from_ref(&event));
    journal.apply(E, Some(7), &[event]);
    let mut copy = index(1 << 20);
    copy.apply(E, &journal.export(E, &original).events);
    let extra = vec![Some(vec![ExtraKey::Str("adapter".into())]); 2];
    let keys = router_keys(&a, BS, Some(&extra)).unwrap();
    assert_eq!(copy.lookup(&keys).blocks(E), 2);
}

#[test]
fn a_clear_or_restart_empties_the_export() {
    let mut journal = Journal::default();
    let mut original = index(1 << 20);
    let batch = vec![stored(&[1], None, tokens(1, 1), "GPU")];
    original.apply(E, &batch);
    journal.apply(E, Some(0), &batch);
    journal.apply(E, Some(1), &[KvEvent::AllBlocksCleared]);
    original.apply(E, &[KvEvent::AllBlocksCleared]);
    let export = journal.export(E, &original);
    assert_eq!((export.seq, export.events.len()), (Some(1), 0));
    journal.clear(E);
    assert_eq!(journal.export(E, &original).seq, None);
}

#[test]
fn removed_blocks_nobody_descends_from_are_pruned() {
    let mut journal = Journal::default();
    for i in 0..3000u64 {
        journal.apply(
            E,
            Some(i),
            &[stored(&[i + 1], None, tokens(i as u32, 1), "GPU")],
        );
        journal.apply(E, Some(i), &[removed(&[i + 1], "GPU")]);
    }
    let j = &journal.endpoints[&E];
    assert!(j.blocks.len() <= 1025, "{}", j.blocks.len());
}
