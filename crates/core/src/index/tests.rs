use std::collections::{BTreeMap, BTreeSet, HashMap};

use proptest::prelude::*;

use super::*;
use crate::event::{BlockRemoved, BlockStored};
use crate::keys::router_keys;

const BS: usize = 4;

fn index() -> KvIndex {
    KvIndex::new(IndexConfig {
        block_size: BS,
        capacity: 1 << 20,
    })
    .unwrap()
}

/// Engine hashes as an engine with hash seed `seed` would publish them for `tokens`.
fn engine_hashes(seed: u64, tokens: &[u32]) -> Vec<EngineHash> {
    router_keys(tokens, BS, None)
        .unwrap()
        .iter()
        .map(|k| EngineHash(k.0.rotate_left(17) ^ seed))
        .collect()
}

fn stored(seed: u64, tokens: &[u32], from: usize, to: usize, medium: &str) -> KvEvent {
    let hashes = engine_hashes(seed, tokens);
    KvEvent::BlockStored(BlockStored {
        block_hashes: hashes[from..to].to_vec(),
        parent_block_hash: from.checked_sub(1).map(|p| hashes[p]),
        token_ids: tokens[from * BS..to * BS].to_vec(),
        block_size: BS as u32,
        medium: Some(medium.into()),
        ..Default::default()
    })
}

fn removed(seed: u64, tokens: &[u32], blocks: &[usize], medium: &str) -> KvEvent {
    let hashes = engine_hashes(seed, tokens);
    KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: blocks.iter().map(|&b| hashes[b]).collect(),
        medium: Some(medium.into()),
        group_idx: None,
    })
}

fn tokens(n_blocks: usize, salt: u32) -> Vec<u32> {
    (0..(n_blocks * BS) as u32).map(|t| t * 7 + salt).collect()
}

const E0: EndpointId = EndpointId(0);
const E1: EndpointId = EndpointId(1);

#[test]
fn stores_chain_under_their_parents_and_lookup_stops_at_first_miss() {
    let mut ix = index();
    let doc = tokens(6, 1);
    ix.apply(
        E0,
        &[stored(9, &doc, 0, 3, "GPU"), stored(9, &doc, 3, 6, "GPU")],
    );
    ix.apply(E1, &[stored(5, &doc, 0, 2, "GPU")]);
    let keys = router_keys(&doc, BS, None).unwrap();
    let m = ix.lookup(&keys);
    assert_eq!(m.blocks(E0), 6);
    assert_eq!(m.blocks(E1), 2);
    // A hole in the middle ends the prefix even if later blocks are held.
    ix.apply(E0, &[removed(9, &doc, &[2], "GPU")]);
    assert_eq!(ix.lookup(&keys).blocks(E0), 2);
    assert_eq!(ix.endpoint_stats(E0).unwrap().blocks_gpu, 5);
}

#[test]
fn unknown_parent_is_an_orphan_not_a_guess() {
    let mut ix = index();
    let doc = tokens(4, 3);
    ix.apply(E0, &[stored(1, &doc, 2, 4, "GPU")]);
    let stats = ix.endpoint_stats(E0).unwrap();
    assert_eq!(stats.orphan_blocks, 2);
    assert_eq!(ix.block_count(), 0);
}

#[test]
fn restores_are_idempotent_and_one_remove_forgets() {
    let mut ix = index();
    let doc = tokens(2, 0);
    ix.apply(
        E0,
        &[stored(1, &doc, 0, 2, "GPU"), stored(1, &doc, 0, 2, "GPU")],
    );
    assert_eq!(ix.entry_count(), 2);
    assert_eq!(ix.endpoint_stats(E0).unwrap().blocks_gpu, 2);
    ix.apply(E0, &[removed(1, &doc, &[0, 1], "GPU")]);
    assert_eq!(ix.entry_count(), 0);
    assert_eq!(ix.block_count(), 0);
}

#[test]
fn tokenless_tier_events_attach_to_known_blocks_and_blocks_leave_with_their_last_tier() {
    let mut ix = index();
    let doc = tokens(3, 2);
    let hashes = engine_hashes(4, &doc);
    ix.apply(E0, &[stored(4, &doc, 0, 3, "GPU")]);
    let offload = KvEvent::BlockStored(BlockStored {
        block_hashes: vec![hashes[0], hashes[1], EngineHash(12345)],
        medium: Some("cpu".into()),
        block_size: 0,
        ..Default::default()
    });
    ix.apply(E0, &[offload]);
    assert_eq!(ix.endpoint_stats(E0).unwrap().offload_orphans, 1);
    ix.apply(E0, &[removed(4, &doc, &[0, 1], "GPU")]);
    let keys = router_keys(&doc, BS, None).unwrap();
    let m = *ix.lookup(&keys).get(E0).unwrap();
    assert_eq!((m.blocks, m.gpu_blocks, m.cpu_blocks), (3, 1, 2));
    ix.apply(E0, &[removed(4, &doc, &[0], "CPU")]);
    assert_eq!(ix.lookup(&keys).blocks(E0), 0);
    assert!(
        ix.resolve(E0, hashes[0]).is_none(),
        "block left with its last tier"
    );
    assert!(ix.resolve(E0, hashes[1]).is_some());
}

#[test]
fn clear_and_endpoint_removal_drop_only_that_endpoint() {
    let mut ix = index();
    let doc = tokens(3, 5);
    ix.apply(E0, &[stored(1, &doc, 0, 3, "GPU")]);
    ix.apply(E1, &[stored(1, &doc, 0, 3, "GPU")]);
    ix.apply(E0, &[KvEvent::AllBlocksCleared]);
    let keys = router_keys(&doc, BS, None).unwrap();
    assert_eq!(ix.lookup(&keys).blocks(E0), 0);
    assert_eq!(ix.lookup(&keys).blocks(E1), 3);
    assert_eq!(ix.endpoint_stats(E0).unwrap().clears, 1);
    ix.remove_endpoint(E1);
    assert_eq!(ix.block_count(), 0);
    assert_eq!(ix.entry_count(), 0);
}

#[test]
fn refused_events_are_counted_and_change_nothing() {
    let mut ix = index();
    let doc = tokens(2, 0);
    let KvEvent::BlockStored(good) = stored(1, &doc, 0, 2, "GPU") else {
        unreachable!()
    };
    let wrong_size = BlockStored {
        block_size: 16,
        ..good.clone()
    };
    let short_tokens = BlockStored {
        token_ids: good.token_ids[..5].to_vec(),
        ..good.clone()
    };
    let bad_extra = BlockStored {
        extra_keys: Some(vec![None]),
        ..good.clone()
    };
    let other_group = BlockStored {
        group_idx: Some(1),
        ..good.clone()
    };
    for ev in [wrong_size, short_tokens, bad_extra, other_group] {
        ix.apply(E0, &[KvEvent::BlockStored(ev)]);
    }
    let s = ix.endpoint_stats(E0).unwrap();
    assert_eq!(s.block_size_mismatches, 2);
    assert_eq!(s.malformed_blocks, 4);
    assert_eq!(s.ignored_group_blocks, 2);
    assert_eq!(ix.block_count(), 0);
}

/// Before vLLM 0.14 a LoRA adapter's blocks carry its int id only: keyed as the base model's,
/// they would match base-model prompts that the engine, whose hashes include the adapter, does
/// not find. They are counted and left out; a block that names its adapter is indexed.
#[test]
fn lora_blocks_named_by_id_only_are_not_taken_for_the_base_models() {
    let mut ix = index();
    let doc = tokens(2, 0);
    let KvEvent::BlockStored(base) = stored(1, &doc, 0, 2, "GPU") else {
        unreachable!()
    };
    ix.apply(
        E0,
        &[KvEvent::BlockStored(BlockStored {
            lora_id: Some(3),
            ..base.clone()
        })],
    );
    let base_keys = router_keys(&doc, BS, None).unwrap();
    assert_eq!(ix.lookup(&base_keys).blocks(E0), 0);
    assert_eq!(ix.endpoint_stats(E0).unwrap().unnamed_lora_blocks, 2);
    ix.apply(
        E0,
        &[KvEvent::BlockStored(BlockStored {
            lora_id: Some(3),
            lora_name: Some("sql".into()),
            ..base
        })],
    );
    assert_eq!(
        ix.lookup(&base_keys).blocks(E0),
        0,
        "the adapter's, not the base's"
    );
    assert_eq!(ix.block_count(), 2);
}

/// `event` (a BlockStored or BlockRemoved) as group `group`'s, of `kind` when stored.
fn in_group(event: KvEvent, group: i64, kind: &str) -> KvEvent {
    match event {
        KvEvent::BlockStored(e) => KvEvent::BlockStored(BlockStored {
            group_idx: Some(group),
            kv_cache_spec_kind: Some(kind.into()),
            ..e
        }),
        KvEvent::BlockRemoved(e) => KvEvent::BlockRemoved(BlockRemoved {
            group_idx: Some(group),
            ..e
        }),
        other => other,
    }
}

/// A hybrid model whose first layer slides (gpt-oss, Gemma 3): its group 0 is the
/// sliding-window group, which frees a running prompt's early blocks (evicted soon after), and
/// its group 1 the full-attention one. The index follows group 1, so the whole prefix is found
/// however group 0's events begin.
#[test]
fn a_hybrid_models_prefix_is_found_in_its_full_attention_group() {
    let doc = tokens(6, 3);
    let keys = router_keys(&doc, BS, None).unwrap();
    for sliding_first in [true, false] {
        let mut ix = index();
        let sliding = in_group(stored(1, &doc, 0, 6, "GPU"), 0, "sliding_window");
        let full = in_group(stored(1, &doc, 0, 6, "GPU"), 1, "full_attention");
        let events = if sliding_first {
            [sliding, full]
        } else {
            [full, sliding]
        };
        ix.apply(E0, &events);
        // The sliding-window group evicts the blocks that left its window.
        ix.apply(E0, &[in_group(removed(1, &doc, &[0, 1, 2], "GPU"), 0, "")]);
        assert_eq!(
            ix.lookup(&keys).blocks(E0),
            6,
            "sliding first: {sliding_first}"
        );
        let s = ix.endpoint_stats(E0).unwrap();
        assert_eq!(s.ignored_group_blocks, 3 + u64::from(!sliding_first) * 6);
        assert_eq!(
            s.clears,
            u64::from(sliding_first),
            "group 0's blocks dropped once"
        );
        // The full-attention group's own evictions apply.
        ix.apply(E0, &[in_group(removed(1, &doc, &[4, 5], "GPU"), 1, "")]);
        assert_eq!(ix.lookup(&keys).blocks(E0), 4);
    }
}

/// Which group is tracked is the engine's model's: a cleared endpoint (a restart, or a new pod
/// under a freed id) learns it again, and a snapshot carries it, so that a restored hybrid
/// endpoint keeps its blocks when its next batch starts with the sliding-window group's.
#[test]
fn the_tracked_group_is_learned_again_after_a_clear_and_travels_with_a_snapshot() {
    let doc = tokens(6, 3);
    let keys = router_keys(&doc, BS, None).unwrap();
    let hybrid = |seed, doc: &[u32]| {
        [
            in_group(stored(seed, doc, 0, 6, "GPU"), 0, "sliding_window"),
            in_group(stored(seed, doc, 0, 6, "GPU"), 1, "full_attention"),
        ]
    };
    let mut source = index();
    source.apply(E0, &hybrid(1, &doc));
    assert_eq!(source.tracked_group(E0), Some(1));

    // Restored with the peer's choice: the next batch's sliding-window blocks drop nothing.
    let mut restored = index();
    restored.restore(E0, source.endpoint_blocks(E0).collect::<Vec<_>>());
    restored.set_tracked_group(E0, source.tracked_group(E0).unwrap());
    let next = tokens(6, 4);
    restored.apply(E0, &hybrid(1, &next));
    assert_eq!(restored.lookup(&keys).blocks(E0), 6, "restored blocks kept");
    let next_keys = router_keys(&next, BS, None).unwrap();
    assert_eq!(restored.lookup(&next_keys).blocks(E0), 6);

    // The engine restarts as a plain model: its group 0 is tracked again.
    source.apply(E0, &[KvEvent::AllBlocksCleared]);
    assert_eq!(source.tracked_group(E0), None);
    source.apply(
        E0,
        &[in_group(stored(1, &doc, 0, 6, "GPU"), 0, "full_attention")],
    );
    assert_eq!(source.lookup(&keys).blocks(E0), 6);
    assert_eq!(source.tracked_group(E0), Some(0));
}

#[test]
fn lora_name_without_extra_keys_matches_lora_requests() {
    let mut ix = index();
    let doc = tokens(2, 0);
    let KvEvent::BlockStored(mut ev) = stored(1, &doc, 0, 2, "GPU") else {
        unreachable!()
    };
    ev.lora_name = Some("sql-lora".into());
    ix.apply(E0, &[KvEvent::BlockStored(ev)]);
    let extra = crate::keys::request_extra_keys(2, Some("sql-lora"), None);
    let lora_keys = router_keys(&doc, BS, Some(&extra)).unwrap();
    assert_eq!(ix.lookup(&lora_keys).blocks(E0), 2);
    let plain = router_keys(&doc, BS, None).unwrap();
    assert_eq!(
        ix.lookup(&plain).blocks(E0),
        0,
        "base-model requests must not match"
    );
}

/// vLLM's OffloadingConnector describes the blocks it stores on CPU without their extra keys: a
/// salted prompt's blocks keep the key their GPU event gave them (found by engine hash), so the
/// salted request still finds its prefix, now on both tiers, and an unsalted one does not.
#[test]
fn a_self_describing_offload_without_extra_keys_keeps_a_salted_blocks_key() {
    let mut ix = index();
    let doc = tokens(3, 5);
    let salted = crate::keys::request_extra_keys(3, None, Some("tenant-a"));
    let KvEvent::BlockStored(mut gpu) = stored(1, &doc, 0, 3, "GPU") else {
        unreachable!()
    };
    gpu.extra_keys = Some(salted.clone());
    ix.apply(E0, &[KvEvent::BlockStored(gpu)]);
    let salted_keys = router_keys(&doc, BS, Some(&salted)).unwrap();
    assert_eq!(ix.lookup(&salted_keys).blocks(E0), 3);
    ix.apply(E0, &[stored(1, &doc, 0, 3, "CPU")]);
    assert_eq!(ix.lookup(&salted_keys).blocks(E0), 3);
    let s = ix.endpoint_stats(E0).unwrap();
    assert_eq!((s.blocks_gpu, s.blocks_cpu), (3, 3));
    let plain = router_keys(&doc, BS, None).unwrap();
    assert_eq!(
        ix.lookup(&plain).blocks(E0),
        0,
        "no unsalted prefix made up"
    );
    // Evicted from the GPU, the blocks are still found, on CPU.
    ix.apply(E0, &[removed(1, &doc, &[0, 1, 2], "GPU")]);
    let m = *ix.lookup(&salted_keys).get(E0).unwrap();
    assert_eq!((m.blocks, m.cpu_blocks), (3, 3));
}

#[test]
fn many_endpoints_beyond_one_word_of_slots() {
    let mut ix = index();
    let doc = tokens(8, 11);
    for e in 0..150u32 {
        let blocks = (e as usize % 8) + 1;
        ix.apply(
            EndpointId(e),
            &[stored(u64::from(e), &doc, 0, blocks, "GPU")],
        );
    }
    let keys = router_keys(&doc, BS, None).unwrap();
    let m = ix.lookup(&keys);
    for e in 0..150u32 {
        assert_eq!(m.blocks(EndpointId(e)), (e % 8) + 1, "endpoint {e}");
    }
}

#[test]
fn capacity_bounds_the_index_and_drops_the_oldest_first() {
    let mut ix = KvIndex::new(IndexConfig {
        block_size: BS,
        capacity: 100,
    })
    .unwrap();
    let docs: Vec<Vec<u32>> = (0..40).map(|i| tokens(5, 1000 * i)).collect();
    for doc in &docs {
        ix.apply(E0, &[stored(1, doc, 0, 5, "GPU")]);
        assert!(ix.entry_count() <= 100, "{}", ix.entry_count());
    }
    let stats = ix.endpoint_stats(E0).unwrap();
    assert!(stats.capacity_evictions >= 100);
    assert_eq!(stats.blocks_gpu as usize, ix.entry_count());
    let newest = router_keys(&docs[39], BS, None).unwrap();
    let oldest = router_keys(&docs[0], BS, None).unwrap();
    assert_eq!(ix.lookup(&newest).blocks(E0), 5);
    assert_eq!(ix.lookup(&oldest).blocks(E0), 0);
}

// ---------------------------------------------------------------------------------------------
// Differential test against a naive reference model.

/// One endpoint's blocks in the model: engine hash → (router key, references per tier).
type ModelBlocks = HashMap<EngineHash, (RouterKey, BTreeMap<Tier, u32>)>;

/// The obvious implementation: per endpoint, engine hash → (router key, references per tier;
/// GPU stores idempotent, offloaded tiers counted), plus the shared tier per mount.
#[derive(Default)]
struct Model {
    endpoints: HashMap<EndpointId, ModelBlocks>,
    /// Endpoint → the mount it declared.
    mounts: HashMap<EndpointId, &'static str>,
    /// Per endpoint, what it wrote to the shared tier.
    written: HashMap<EndpointId, HashMap<EngineHash, RouterKey>>,
    /// (mount, block) → references.
    shared: HashMap<(&'static str, RouterKey), u32>,
    /// Endpoint → blocks per offloaded chunk, where more than one.
    chunks: HashMap<EndpointId, usize>,
    /// Per chunked endpoint, engine hash → parent hash, while the block is known.
    parents: HashMap<EndpointId, HashMap<EngineHash, EngineHash>>,
    /// Endpoints whose offloaded stores carried tokens (self-describing: removals not chunked).
    described: BTreeSet<EndpointId>,
}

impl Model {
    fn place(&self, e: EndpointId, medium: Option<&str>) -> Result<Tier, &'static str> {
        match (self.mounts.get(&e), medium) {
            (Some(m), Some(md)) if md.eq_ignore_ascii_case("FS") => Err(*m),
            _ => Ok(Tier::from_medium(medium)),
        }
    }

    fn resolve(&self, e: EndpointId, h: &EngineHash, shared: bool) -> Option<RouterKey> {
        let local = self
            .endpoints
            .get(&e)
            .and_then(|m| m.get(h))
            .map(|(k, _)| *k);
        local.or_else(|| {
            shared
                .then(|| self.written.get(&e).and_then(|w| w.get(h)).copied())
                .flatten()
        })
    }

    /// The chunk ending at `tail`, last block first, as far as it resolves.
    fn chain(
        &self,
        e: EndpointId,
        tail: EngineHash,
        chunk: usize,
        shared: bool,
    ) -> Vec<(EngineHash, RouterKey)> {
        let mut out = Vec::new();
        let mut h = tail;
        for i in 0..chunk {
            let Some(k) = self.resolve(e, &h, shared) else {
                break;
            };
            out.push((h, k));
            if i + 1 < chunk {
                match self.parents.get(&e).and_then(|p| p.get(&h)) {
                    Some(p) => h = *p,
                    None => break,
                }
            }
        }
        out
    }

    /// Drops `h`'s parent link once the endpoint neither holds nor wrote it.
    fn forget_parent(&mut self, e: EndpointId, h: &EngineHash) {
        let held = self.endpoints.get(&e).is_some_and(|m| m.contains_key(h));
        let written = self.written.get(&e).is_some_and(|w| w.contains_key(h));
        if !held
            && !written
            && let Some(p) = self.parents.get_mut(&e)
        {
            p.remove(h);
        }
    }

    fn put(
        &mut self,
        e: EndpointId,
        h: EngineHash,
        k: RouterKey,
        place: Result<Tier, &'static str>,
    ) {
        match place {
            Ok(tier) => {
                let map = self.endpoints.entry(e).or_default();
                let tiers = &mut map.entry(h).or_insert((k, BTreeMap::new())).1;
                let n = tiers.entry(tier).or_insert(0);
                *n = if tier == Tier::Gpu { 1 } else { *n + 1 };
            }
            Err(mount) => {
                self.written.entry(e).or_default().insert(h, k);
                *self.shared.entry((mount, k)).or_insert(0) += 1;
            }
        }
    }

    fn apply(&mut self, e: EndpointId, event: &KvEvent) {
        self.endpoints.entry(e).or_default();
        match event {
            KvEvent::AllBlocksCleared => {
                self.endpoints.entry(e).or_default().clear();
                self.written.remove(&e);
                self.parents.remove(&e);
            }
            KvEvent::BlockRemoved(r) => {
                let place = self.place(e, r.medium.as_deref());
                let chunk = match place {
                    Ok(Tier::Gpu) => 1,
                    _ if self.described.contains(&e) => 1,
                    _ => self.chunks.get(&e).copied().unwrap_or(1),
                };
                let named: Vec<EngineHash> = r
                    .block_hashes
                    .iter()
                    .flat_map(|h| self.chain(e, *h, chunk, place.is_err()))
                    .map(|(h, _)| h)
                    .collect();
                for h in &named {
                    match place {
                        Ok(tier) => {
                            let map = self.endpoints.entry(e).or_default();
                            if let Some((_, tiers)) = map.get_mut(h)
                                && let Some(n) = tiers.get_mut(&tier)
                            {
                                *n -= 1;
                                if *n == 0 {
                                    tiers.remove(&tier);
                                }
                                if tiers.is_empty() {
                                    map.remove(h);
                                    self.forget_parent(e, h);
                                }
                            }
                        }
                        Err(mount) => {
                            let Some(k) = self.resolve(e, h, true) else {
                                continue;
                            };
                            if let Some(n) = self.shared.get_mut(&(mount, k)) {
                                *n -= 1;
                                if *n == 0 {
                                    self.shared.remove(&(mount, k));
                                    self.written.entry(e).or_default().remove(h);
                                    self.forget_parent(e, h);
                                }
                            }
                        }
                    }
                }
            }
            KvEvent::BlockStored(s) => {
                let place = self.place(e, s.medium.as_deref());
                if s.token_ids.is_empty() {
                    let chunk = match place {
                        Ok(Tier::Gpu) => 1,
                        _ => self.chunks.get(&e).copied().unwrap_or(1),
                    };
                    for h in &s.block_hashes {
                        for (h, k) in self.chain(e, *h, chunk, place.is_err()) {
                            self.put(e, h, k, place);
                        }
                    }
                    return;
                }
                if place != Ok(Tier::Gpu) {
                    self.described.insert(e);
                }
                let parent = match s.parent_block_hash {
                    None => ROOT_KEY,
                    Some(p) => match self.resolve(e, &p, place.is_err()) {
                        Some(k) => k,
                        None => return,
                    },
                };
                let keys = crate::keys::router_keys_from(parent, &s.token_ids, BS, None).unwrap();
                let mut prev = s.parent_block_hash;
                for (h, k) in s.block_hashes.iter().zip(keys) {
                    if self.chunks.contains_key(&e)
                        && let Some(p) = prev
                    {
                        self.parents.entry(e).or_default().insert(*h, p);
                    }
                    self.put(e, *h, k, place);
                    prev = Some(*h);
                }
            }
        }
    }

    fn lookup(&self, keys: &[RouterKey]) -> Vec<PrefixMatch> {
        let mut out = Vec::new();
        for (&e, map) in &self.endpoints {
            let mut by_key: HashMap<RouterKey, BTreeSet<Tier>> = HashMap::new();
            for (k, tiers) in map.values() {
                by_key.entry(*k).or_default().extend(tiers.keys());
            }
            let mut m = PrefixMatch {
                endpoint: e,
                blocks: 0,
                gpu_blocks: 0,
                cpu_blocks: 0,
                storage_blocks: 0,
                shared_blocks: 0,
            };
            for k in keys {
                match by_key.get(k).and_then(|t| t.first()) {
                    Some(Tier::Gpu) => m.gpu_blocks += 1,
                    Some(Tier::Cpu) => m.cpu_blocks += 1,
                    Some(Tier::Storage) => m.storage_blocks += 1,
                    None => match self.mounts.get(&e) {
                        Some(mount) if self.shared.contains_key(&(*mount, *k)) => {
                            m.shared_blocks += 1;
                        }
                        _ => break,
                    },
                }
                m.blocks += 1;
            }
            if m.blocks > 0 {
                out.push(m);
            }
        }
        out.sort_unstable_by_key(|m| m.endpoint);
        out
    }
}

#[derive(Clone, Debug)]
enum Op {
    Store {
        e: u32,
        doc: usize,
        from: usize,
        to: usize,
        tier: usize,
    },
    Offload {
        e: u32,
        doc: usize,
        block: usize,
        tier: usize,
    },
    Remove {
        e: u32,
        doc: usize,
        block: usize,
        tier: usize,
    },
    Clear {
        e: u32,
    },
    RemoveEndpoint {
        e: u32,
    },
}

/// Documents sharing prefixes: doc i is base (i % 3) for its first (i % 4) + 1 blocks, then its
/// own tokens, so endpoints hold overlapping chains.
fn docs() -> Vec<Vec<u32>> {
    (0..8)
        .map(|i| {
            let shared = (i % 4 + 1) * BS;
            let mut t = tokens(6, (i % 3) as u32 * 100_000);
            for (j, tok) in t.iter_mut().enumerate().skip(shared) {
                *tok = 1_000_000 * (i as u32 + 1) + j as u32;
            }
            t
        })
        .collect()
}

/// Operations over endpoints `0..endpoints` (70: more than one word of slots; a few: the same
/// endpoints store, offload and remove the same blocks often).
fn op_over(endpoints: u32) -> impl Strategy<Value = Op> {
    let e = 0u32..endpoints;
    prop_oneof![
        6 => (e.clone(), 0usize..8, 0usize..6, 1usize..7, 0usize..4).prop_map(|(e, doc, from, len, tier)| {
            let to = (from + len).min(6);
            Op::Store { e, doc, from: from.min(to - 1), to, tier }
        }),
        2 => (e.clone(), 0usize..8, 0usize..6, 1usize..4).prop_map(|(e, doc, block, tier)| Op::Offload { e, doc, block, tier }),
        3 => (e.clone(), 0usize..8, 0usize..6, 0usize..4).prop_map(|(e, doc, block, tier)| Op::Remove { e, doc, block, tier }),
        1 => e.clone().prop_map(|e| Op::Clear { e }),
        1 => e.prop_map(|e| Op::RemoveEndpoint { e }),
    ]
}

const MEDIA: [&str; 4] = ["GPU", "CPU", "STORAGE", "FS"];

/// The shared mount endpoint `e` declares in the differential test: a third mount one shared
/// tier, a third another, the rest none (their `FS` events are local storage).
fn mount_of(e: u32) -> Option<&'static str> {
    [Some("lustre"), Some("nfs"), None][e as usize % 3]
}

fn op() -> impl Strategy<Value = Op> {
    op_over(70)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    #[test]
    fn index_agrees_with_reference_model(ops in proptest::collection::vec(op(), 1..120)) {
        agrees_with_model(&ops)?;
    }

    /// Few endpoints: chunked placeholders, repeats and shared writes meet the same blocks.
    #[test]
    fn index_agrees_with_reference_model_on_a_few_busy_endpoints(ops in proptest::collection::vec(op_over(6), 1..160)) {
        agrees_with_model(&ops)?;
    }
}

/// Long documents sharing prefixes of different lengths (doc i is the base for its first
/// 3 × i blocks), for chains long enough to make runs.
fn long_docs() -> Vec<Vec<u32>> {
    (0..6)
        .map(|i| {
            let mut t = tokens(LONG_DOC, 500_000);
            for (j, tok) in t.iter_mut().enumerate().skip(3 * i * BS) {
                *tok = 2_000_000 * (i as u32 + 1) + j as u32;
            }
            t
        })
        .collect()
}

/// Blocks in each of [`long_docs`].
const LONG_DOC: usize = 24;

/// Endpoints of the runs test: enough of them that a block's holders go wide (more than four),
/// two of them in the second word of slots.
fn runs_endpoint() -> impl Strategy<Value = u32> {
    prop_oneof![0u32..6, 64u32..66]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]
    /// Runs (blocks linked because they have the same holders) never change an answer: a few
    /// endpoints store long chains in pieces (continuing each other, overlapping, on the GPU and
    /// the CPU), remove single blocks from the middle or the end, clear; the books of runs and
    /// wide sets balance after every event, and every prefix of every document is then looked
    /// up, from one block to all of them, and matches the model.
    #[test]
    fn runs_agree_with_model(ops in proptest::collection::vec(prop_oneof![
        6 => (runs_endpoint(), 0usize..6, 0usize..LONG_DOC, 1usize..LONG_DOC, prop_oneof![4 => Just(0usize), 1 => Just(1usize)]).prop_map(|(e, doc, from, len, tier)| {
            let to = (from + len).min(LONG_DOC);
            Op::Store { e, doc, from: from.min(to - 1), to, tier }
        }),
        3 => (runs_endpoint(), 0usize..6, 0usize..LONG_DOC, 0usize..2).prop_map(|(e, doc, block, tier)| Op::Remove { e, doc, block, tier }),
        1 => runs_endpoint().prop_map(|e| Op::Clear { e }),
    ], 1..80)) {
        let docs = long_docs();
        let mut ix = index();
        // Slots in order of registration: the endpoints past 64 sit in a second word of slots.
        for e in 0..66 {
            ix.add_endpoint(EndpointId(e));
        }
        let mut model = Model::default();
        for op in &ops {
            let (e, ev) = match *op {
                Op::Store { e, doc, from, to, tier } => (e, stored(0, &docs[doc], from, to, MEDIA[tier])),
                Op::Remove { e, doc, block, tier } => (e, removed(0, &docs[doc], &[block], MEDIA[tier])),
                Op::Clear { e } => (e, KvEvent::AllBlocksCleared),
                _ => unreachable!("not generated"),
            };
            ix.apply(EndpointId(e), std::slice::from_ref(&ev));
            model.apply(EndpointId(e), &ev);
            if let Err(broken) = ix.wide.check(ix.blocks.iter().map(|b| b.holders)) {
                prop_assert!(false, "{}", broken);
            }
        }
        for doc in &docs {
            let keys = router_keys(doc, BS, None).unwrap();
            for cut in 1..=LONG_DOC {
                prop_assert_eq!(&ix.lookup(&keys[..cut]).matches, &model.lookup(&keys[..cut]), "first {} blocks", cut);
            }
        }
    }
}

/// A conversation stored over many events (a prefill in pieces, then a decode's blocks one at
/// a time) is one run; it stays one while blocks leave it from either end, and lookups are
/// right throughout.
#[test]
fn a_chain_stored_in_pieces_is_one_run() {
    let mut ix = index();
    let doc = tokens(40, 3);
    let keys = router_keys(&doc, BS, None).unwrap();
    let mut events: Vec<KvEvent> = (0..32)
        .step_by(8)
        .map(|from| stored(0, &doc, from, from + 8, "GPU"))
        .collect();
    events.extend((32..40).map(|b| stored(0, &doc, b, b + 1, "GPU")));
    ix.apply(E0, &events);
    assert_eq!(ix.wide.runs(), (1, 1));
    assert_eq!(ix.lookup(&keys).blocks(E0), 40);
    // Another endpoint storing the first half takes it out of the run, from its first block
    // on: the rest is still a chain. Two intact runs.
    ix.apply(E1, &[stored(0, &doc, 0, 20, "GPU")]);
    assert_eq!(ix.wide.runs(), (2, 2));
    assert_eq!(ix.lookup(&keys).blocks(E0), 40);
    assert_eq!(ix.lookup(&keys).blocks(E1), 20);
    // An eviction from the tail keeps it intact too; one from the middle breaks it.
    ix.apply(E0, &[removed(0, &doc, &[39, 38], "GPU")]);
    assert_eq!(ix.wide.runs(), (2, 2));
    assert_eq!(ix.lookup(&keys).blocks(E0), 38);
    assert_eq!(ix.lookup(&keys[..37]).blocks(E0), 37);
    ix.apply(E0, &[removed(0, &doc, &[30], "GPU")]);
    assert_eq!(ix.wide.runs(), (2, 1));
    assert_eq!(ix.lookup(&keys).blocks(E0), 30);
}

/// Blocks held by more than four endpoints (a wide set) make a run too; members leaving it
/// from the middle, either end or all at once keep the set's books and every answer right.
#[test]
fn a_run_of_wide_holders_keeps_its_set() {
    let mut ix = index();
    let doc = tokens(12, 9);
    let keys = router_keys(&doc, BS, None).unwrap();
    let check = |ix: &KvIndex| ix.wide.check(ix.blocks.iter().map(|b| b.holders)).unwrap();
    for e in 0..6 {
        ix.apply(EndpointId(e), &[stored(0, &doc, 0, 12, "GPU")]);
        check(&ix);
    }
    assert_eq!(ix.wide.runs(), (1, 1), "one run of six holders");
    ix.apply(EndpointId(5), &[removed(0, &doc, &[6], "GPU")]);
    check(&ix);
    ix.apply(EndpointId(4), &[removed(0, &doc, &[11, 10], "GPU")]);
    check(&ix);
    ix.apply(EndpointId(3), &[removed(0, &doc, &[0], "GPU")]);
    check(&ix);
    let found = ix.lookup(&keys);
    assert_eq!(
        (0..6)
            .map(|e| found.blocks(EndpointId(e)))
            .collect::<Vec<_>>(),
        [12, 12, 12, 0, 10, 6]
    );
    ix.apply(EndpointId(0), &[KvEvent::AllBlocksCleared]);
    check(&ix);
    ix.remove_endpoint(EndpointId(1));
    check(&ix);
    assert_eq!(ix.lookup(&keys).blocks(EndpointId(2)), 12);
}

fn agrees_with_model(ops: &[Op]) -> Result<(), TestCaseError> {
    {
        let docs = docs();
        let mut ix = Both::new();
        let mut model = Model::default();
        for e in 0..70 {
            // Every fifth endpoint offloads 2-block chunks (placeholders name the last block).
            let chunked = e % 5 == 4;
            if mount_of(e).is_some() || chunked {
                let spec = OffloadSpec {
                    block_size: chunked.then_some(2 * BS),
                    shared: mount_of(e).map(SharedMount::new),
                };
                ix.set_offload(EndpointId(e), &spec);
                model.endpoints.entry(EndpointId(e)).or_default();
            }
            if let Some(mount) = mount_of(e) {
                model.mounts.insert(EndpointId(e), mount);
            }
            if chunked {
                model.chunks.insert(EndpointId(e), 2);
            }
        }
        // Endpoints use one of two hash seeds: engines may or may not share hashing config.
        let seed = |e: u32| u64::from(e % 2) * 0xdead_beef;
        for op in ops {
            match *op {
                Op::Store {
                    e,
                    doc,
                    from,
                    to,
                    tier,
                } => {
                    let ev = stored(seed(e), &docs[doc], from, to, MEDIA[tier]);
                    ix.apply(EndpointId(e), &ev);
                    model.apply(EndpointId(e), &ev);
                }
                Op::Offload {
                    e,
                    doc,
                    block,
                    tier,
                } => {
                    let ev = KvEvent::BlockStored(BlockStored {
                        block_hashes: vec![engine_hashes(seed(e), &docs[doc])[block]],
                        medium: Some(MEDIA[tier].into()),
                        ..Default::default()
                    });
                    ix.apply(EndpointId(e), &ev);
                    model.apply(EndpointId(e), &ev);
                }
                Op::Remove {
                    e,
                    doc,
                    block,
                    tier,
                } => {
                    let ev = removed(seed(e), &docs[doc], &[block], MEDIA[tier]);
                    ix.apply(EndpointId(e), &ev);
                    model.apply(EndpointId(e), &ev);
                }
                Op::Clear { e } => {
                    ix.apply(EndpointId(e), &KvEvent::AllBlocksCleared);
                    model.apply(EndpointId(e), &KvEvent::AllBlocksCleared);
                }
                Op::RemoveEndpoint { e } => {
                    ix.remove_endpoint(EndpointId(e));
                    model.endpoints.remove(&EndpointId(e));
                    model.written.remove(&EndpointId(e));
                    model.mounts.remove(&EndpointId(e));
                    model.chunks.remove(&EndpointId(e));
                    model.parents.remove(&EndpointId(e));
                    model.described.remove(&EndpointId(e));
                }
            }
            let entries: usize = model.endpoints.values().map(HashMap::len).sum();
            prop_assert_eq!(ix.single.entry_count(), entries);
            let words = ix.single.blocks.iter().map(|b| b.holders);
            if let Err(broken) = ix.single.wide.check(words) {
                prop_assert!(false, "{}", broken);
            }
            prop_assert_eq!(ix.sharded.read(|r| r.entry_count()), entries);
        }
        for doc in &docs {
            let keys = router_keys(doc, BS, None).unwrap();
            for cut in [1, 3, 6] {
                let want = model.lookup(&keys[..cut]);
                prop_assert_eq!(&ix.single.lookup(&keys[..cut]).matches, &want);
                prop_assert_eq!(
                    &ix.sharded.lookup(&keys[..cut]),
                    &ix.single.lookup(&keys[..cut])
                );
            }
        }
        for (e, map) in &model.endpoints {
            let stats = ix.single.endpoint_stats(*e).unwrap();
            prop_assert_eq!(Some(stats.clone()), ix.sharded.endpoint_stats(*e));
            let count = |t: Tier| map.values().filter(|(_, ts)| ts.contains_key(&t)).count() as u64;
            prop_assert_eq!(stats.blocks_gpu, count(Tier::Gpu));
            prop_assert_eq!(ix.sharded.gpu_blocks(*e), stats.blocks_gpu, "published");
            prop_assert_eq!(stats.blocks_cpu, count(Tier::Cpu));
            prop_assert_eq!(
                ix.sharded.held_blocks(*e).cpu,
                stats.blocks_cpu,
                "published"
            );
            prop_assert_eq!(stats.blocks_storage, count(Tier::Storage));
        }
        prop_assert_eq!(
            ix.single.shared_tier_stats(),
            ix.sharded.shared_tier_stats()
        );
    }
    Ok(())
}

/// The same operations applied to one index and to a sharded one (two shards: endpoints of
/// each mount sit on both, so the shared tier is seen across shards).
struct Both {
    single: KvIndex,
    sharded: SharedIndex,
}

impl Both {
    fn new() -> Self {
        let config = index().config().clone();
        Self {
            single: index(),
            sharded: SharedIndex::sharded(config, 2).unwrap(),
        }
    }

    fn apply(&mut self, e: EndpointId, event: &KvEvent) {
        self.single.apply(e, std::slice::from_ref(event));
        self.sharded.apply(e, std::slice::from_ref(event));
    }

    fn set_offload(&mut self, e: EndpointId, spec: &OffloadSpec) {
        self.single.set_offload(e, spec).unwrap();
        self.sharded.set_offload(e, spec).unwrap();
    }

    fn remove_endpoint(&mut self, e: EndpointId) {
        self.single.remove_endpoint(e);
        self.sharded.remove_endpoint(e);
    }
}

#[test]
fn an_endpoints_published_gpu_blocks_follow_evictions_made_by_anothers_batch() {
    let config = IndexConfig {
        block_size: BS,
        capacity: 100,
    };
    let ix = SharedIndex::sharded(config, 1).unwrap();
    ix.apply(E0, &[stored(0, &tokens(80, 1), 0, 80, "GPU")]);
    assert_eq!(ix.gpu_blocks(E0), 80);
    // E1's batch takes the index past its capacity: the bound evicts from E0, the largest.
    ix.apply(E1, &[stored(0, &tokens(40, 2), 0, 40, "GPU")]);
    let held = ix.endpoint_stats(E0).unwrap().blocks_gpu;
    assert!(held < 80, "{held}");
    assert_eq!(
        ix.gpu_blocks(E0),
        held,
        "E0's count published after E1's batch"
    );
    assert_eq!(ix.gpu_blocks(E1), 40);
    ix.remove_endpoint(E1);
    assert_eq!(ix.gpu_blocks(E1), 0);
}

#[test]
fn a_sharded_index_needs_a_shard_and_splits_its_capacity() {
    let config = IndexConfig {
        block_size: BS,
        capacity: 100,
    };
    assert_eq!(
        SharedIndex::sharded(config.clone(), 0).unwrap_err(),
        CoreError::InvalidIndexShards(0)
    );
    let ix = SharedIndex::sharded(config, 3).unwrap();
    assert_eq!(ix.shard_count(), 3);
    // 42 entries would not reach one index's high-water mark (90); shard 0's share is 34, so
    // endpoint 0's 40 blocks are cut to that share's mark (27) while endpoint 1 keeps its 2.
    let doc = tokens(40, 1);
    ix.apply(E0, &[stored(0, &doc, 0, 40, "GPU")]);
    ix.apply(E1, &[stored(0, &doc, 0, 2, "GPU")]);
    ix.read(|r| {
        assert_eq!(r.entry_count(), 27 + 2);
        assert_eq!(r.endpoints().count(), 2);
    });
    assert_eq!(ix.endpoint_stats(E0).unwrap().capacity_evictions, 13);
    let keys = router_keys(&doc, BS, None).unwrap();
    // Published as of the last writes, the bound's evictions from E0 included.
    let gpu: Vec<u64> = [E1, EndpointId(7), E0].map(|e| ix.gpu_blocks(e)).to_vec();
    assert_eq!(gpu, vec![2, 0, 27]);
    let held = ix.held_blocks_of([E1, EndpointId(7), E0].into_iter());
    assert_eq!(held.iter().map(|h| h.gpu).collect::<Vec<_>>(), gpu);
    let matches = ix.lookup(&keys);
    assert_eq!(matches.blocks(E1), 2);
    assert_eq!(matches, ix.read(|r| r.lookup(&keys)));
}
