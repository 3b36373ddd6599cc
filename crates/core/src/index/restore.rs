//! One endpoint's blocks read out of an index ([`KvIndex::endpoint_blocks`]) and restored into
//! another ([`KvIndex::restore`]): how a starting router replica copies a running peer's picture
//! of the fleet's caches without replaying (or keeping) the engines' events.
//!
//! # Decisions
//! - **An entry is what the index already keeps**: the engine hash (how removals name the
//!   block), the router key (how lookups name it), the endpoint's own tiers holding it, whether
//!   the endpoint wrote it to its shared mount, its repeated references on offloaded tiers
//!   (vLLM counts them), and, only while the endpoint's offloaded chunks
//!   span several blocks, the parent hash chunk placeholders are walked by. No tokens: the
//!   router key was made from them once and is all a lookup needs. So a snapshot costs nothing
//!   to keep beside the index (the journal it replaces cost 150–250 B per entry).
//! - **Runs travel**: the entries of a run come in its order, each marked as following the one
//!   before ([`HeldEntry::follows`]), and restore links them again, so a restored index skips
//!   the same runs as its source (a run's holders may differ here until every endpoint is
//!   restored: a run of two endpoints' blocks becomes one again as the second one's entries
//!   link). A peer is trusted with this order as it is with the blocks themselves.
//! - **Uncertainty travels**: an endpoint whose offloaded tiers are uncertain at the source
//!   (recent orphans) is marked so in the copy ([`KvIndex::mark_tier_uncertain`]).
//! - **Restore replaces**: the endpoint's blocks become exactly the entries given; what it held
//!   before is cleared. Entries run through the same store path as events (holder sets, the
//!   shared tier, parent links), and the capacity bound applies afterwards as after a batch.
//! - **Not carried, on purpose**: what the peer learned from event shapes (a chunk
//!   size published by releases before 0.20, self-describing offload payloads): the next event
//!   of that shape teaches it again. A shared-tier block is restored once per endpoint that
//!   wrote it, onto a tier assumed empty (a starting replica's is).
//! - **Keys are checked before they are trusted**: a router key names a block only for the
//!   block size (and offloaded chunk size) it was made with. A snapshot carries its
//!   [`KeyLayout`], and `Fleet::restore_endpoint` refuses one that differs from
//!   the endpoint's own, changing nothing.

use serde::{Deserialize, Serialize};

use super::offload::{Place, Tables, store_block};
use super::runs::RunChain;
use super::{EndpointId, KvIndex};
use crate::CoreError;
use crate::event::{EngineHash, Tier};
use crate::keys::RouterKey;

/// The version of the router key chain ([`crate::keys::router_keys`]) this build makes:
/// bumped whenever a key is computed otherwise, so that replicas of different builds never take
/// each other's keys for their own (a pinned key in this module's tests fails first).
pub const ROUTER_KEY_SCHEME: u32 = 1;

/// What a snapshot's router keys were made with. A peer's keys name the same blocks as this
/// router's only when every field agrees; otherwise the same key means other tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyLayout {
    /// The key chain's version ([`ROUTER_KEY_SCHEME`] of the build that made them).
    pub key_scheme: u32,
    /// Tokens per block (the model's `block_size`).
    pub block_size: usize,
    /// Tokens per offloaded chunk (the connector's `block_size`), when configured.
    #[serde(default)]
    pub offload_block_size: Option<usize>,
}

impl KeyLayout {
    /// Why keys made with `theirs` cannot be restored where keys are made with `self`.
    pub fn check(&self, theirs: &KeyLayout) -> Result<(), CoreError> {
        let mismatch = |field: &'static str, snapshot: Option<usize>, ours: Option<usize>| {
            CoreError::KeyLayoutMismatch {
                field,
                snapshot,
                ours,
            }
        };
        if theirs.key_scheme != self.key_scheme {
            return Err(mismatch(
                "key_scheme",
                Some(theirs.key_scheme as usize),
                Some(self.key_scheme as usize),
            ));
        }
        if theirs.block_size != self.block_size {
            return Err(mismatch(
                "block_size",
                Some(theirs.block_size),
                Some(self.block_size),
            ));
        }
        if theirs.offload_block_size != self.offload_block_size {
            return Err(mismatch(
                "offload_block_size",
                theirs.offload_block_size,
                self.offload_block_size,
            ));
        }
        Ok(())
    }
}

/// One endpoint's part of a peer replica's snapshot, restored in one step by
/// `Fleet::restore_endpoint`.
#[derive(Clone, Debug)]
pub struct EndpointRestore<I> {
    /// What the peer's keys were made with.
    pub layout: KeyLayout,
    /// Every block the peer's index held for the endpoint.
    pub blocks: I,
    /// Whether the peer trusted the endpoint's index.
    pub trusted: bool,
    /// Whether the peer's picture of the endpoint's offloaded tiers was uncertain.
    pub tier_uncertain: bool,
    /// The full-attention KV-cache group the peer learned the endpoint tracks (a hybrid
    /// model's; `None`: not learned, or a peer that does not say).
    pub tracked_group: Option<i64>,
}

/// One block an endpoint holds, as [`KvIndex::endpoint_blocks`] reads it and
/// [`KvIndex::restore`] applies it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct HeldEntry {
    /// The engine's hash of the block.
    pub hash: EngineHash,
    /// The router's key of the block.
    pub key: RouterKey,
    /// The endpoint's own tiers holding it: bit `1 << (tier as u8)` per [`Tier`] (0 when it
    /// is only on the shared tier).
    pub tiers: u8,
    /// Stores on the CPU tier beyond the first not yet matched by removals (offloaded tiers
    /// count references, as vLLM documents).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cpu_repeats: u32,
    /// Stores on the storage tier beyond the first not yet matched by removals.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub storage_repeats: u32,
    /// The endpoint wrote it to the shared tier it mounts.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub shared: bool,
    /// The engine hash before it in its chain, kept only while the endpoint's offloaded chunks
    /// span several blocks (chunk placeholders name a chunk by its last block).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<EngineHash>,
    /// The block is the child of the entry before it in the list, and both had the same holders
    /// at the source (consecutive members of one run): restore links them into a run again, so
    /// lookups skip them as they did there. Absent (false) from peers of builds before this
    /// field.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub follows: bool,
}

impl HeldEntry {
    /// Whether the endpoint holds the block on `tier`.
    pub fn on(&self, tier: Tier) -> bool {
        self.tiers & tier_bit(tier) != 0
    }
}

fn tier_bit(tier: Tier) -> u8 {
    1 << (tier as u8)
}

/// Most repeated references restored per block and tier: a count from a peer is bounded like
/// anything else a peer sends (an engine repeats a store a few times, not thousands).
const MAX_REPEATS: u32 = 1024;

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl KvIndex {
    /// Every block `endpoint` holds (nothing when it is unknown): the members of each run in
    /// the run's order, each marked as following the member before it, then the other blocks in
    /// no particular order. Read it under the same lock as the event sequence it reflects.
    pub fn endpoint_blocks(&self, endpoint: EndpointId) -> impl Iterator<Item = HeldEntry> + '_ {
        let state = self.endpoints.get(&endpoint);
        let offload = state.and_then(|s| s.offload.as_deref());
        let parent_of = move |hash: u64| {
            offload
                .filter(|o| o.wants_parents())
                .and_then(|o| o.parents.get(&hash))
                .map(|&p| EngineHash(p))
        };
        let repeats = move |hash: u64, tier: Tier| {
            offload
                .and_then(|o| o.refs.get(&(hash, tier as u8)))
                .copied()
                .unwrap_or(0)
        };
        let shared_written = offload.map(|o| &o.shared_written);
        // Each entry with its place in a run (run, offset), if its block is in one.
        let mut held: Vec<(Option<(usize, u32)>, HeldEntry)> = state
            .into_iter()
            .flat_map(|s| {
                s.blocks.iter().map(move |held| {
                    let key = held.router_key();
                    let (tiers, position) = self.blocks.get(key.0).map_or((0, None), |b| {
                        let view = self.wide.view(b.holders);
                        let tiers = Tier::ALL
                            .into_iter()
                            .filter(|&t| view.has(s.slot, t))
                            .fold(0, |bits, t| bits | tier_bit(t));
                        (tiers, b.holders.run_position())
                    });
                    let entry = HeldEntry {
                        hash: EngineHash(held.hash),
                        key,
                        tiers,
                        cpu_repeats: repeats(held.hash, Tier::Cpu),
                        storage_repeats: repeats(held.hash, Tier::Storage),
                        shared: shared_written.is_some_and(|w| w.contains_key(&held.hash)),
                        parent: parent_of(held.hash),
                        follows: false,
                    };
                    (position.filter(|_| tiers != 0), entry)
                })
            })
            .collect();
        // Runs first, each in order (stable: the other blocks keep the table's order after them).
        held.sort_by_key(|(position, _)| position.map_or((1, 0, 0), |(run, at)| (0, run, at)));
        for i in 1..held.len() {
            if let (Some((run, at)), Some((before_run, before_at))) = (held[i].0, held[i - 1].0) {
                held[i].1.follows = run == before_run && at == before_at + 1;
            }
        }
        let held = held.into_iter().map(|(_, entry)| entry);
        // Blocks written to the shared tier that the endpoint's own tiers no longer hold.
        let shared_only = state
            .zip(shared_written)
            .into_iter()
            .flat_map(move |(s, written)| {
                written
                    .iter()
                    .filter(move |(hash, _)| s.blocks.get(**hash).is_none())
                    .map(move |(&hash, &key)| HeldEntry {
                        hash: EngineHash(hash),
                        key,
                        tiers: 0,
                        cpu_repeats: 0,
                        storage_repeats: 0,
                        shared: true,
                        parent: parent_of(hash),
                        follows: false,
                    })
            });
        held.chain(shared_only)
    }

    /// Makes `endpoint`'s blocks exactly `blocks` (registering it if new), as read from another
    /// index by [`Self::endpoint_blocks`]. A shared-tier entry is skipped when the endpoint
    /// mounts no shared tier here. Returns the entries restored.
    pub fn restore(
        &mut self,
        endpoint: EndpointId,
        blocks: impl IntoIterator<Item = HeldEntry>,
    ) -> usize {
        if self
            .endpoints
            .get(&endpoint)
            .is_some_and(|s| s.blocks.len() > 0 || s.offload.is_some())
        {
            self.clear_endpoint(endpoint);
        }
        self.add_endpoint(endpoint);
        let state = self.endpoints.get_mut(&endpoint).expect("just registered");
        let mount = state
            .offload
            .as_deref()
            .and_then(|o| o.mount.as_ref())
            .map(|(mount, _)| *mount);
        let mut tables = Tables {
            blocks: &mut self.blocks,
            wide: &mut self.wide,
            fleet: &self.fleet,
            entries: &mut self.entries,
        };
        let mut restored = 0;
        // The run the entries being restored extend (see `HeldEntry::follows`).
        let mut chain = RunChain::start();
        for entry in blocks {
            let parent = entry.parent.map(|p| p.0);
            let last_tier = Tier::ALL.into_iter().rfind(|&t| entry.on(t));
            // An entry stored on no tier of its own here links nothing, nor does the next.
            if !entry.follows || last_tier.is_none() {
                chain = RunChain::start();
            }
            for tier in Tier::ALL.into_iter().filter(|&t| entry.on(t)) {
                let repeats = match tier {
                    Tier::Gpu => 0,
                    Tier::Cpu => entry.cpu_repeats,
                    Tier::Storage => entry.storage_repeats,
                }
                .min(MAX_REPEATS);
                // The first store sets the holder bit; each repeat adds a reference. The last
                // store links the block, with its holders complete, to the entry before it.
                for repeat in 0..=repeats {
                    let link = Some(tier) == last_tier && repeat == repeats;
                    store_block(
                        &mut tables,
                        state,
                        Place::Local(tier),
                        entry.hash.0,
                        entry.key,
                        parent,
                        link.then_some(&mut chain),
                    );
                }
            }
            if let (true, Some(mount)) = (entry.shared, mount) {
                store_block(
                    &mut tables,
                    state,
                    Place::Shared(mount),
                    entry.hash.0,
                    entry.key,
                    parent,
                    None,
                );
            }
            restored += 1;
        }
        self.bound(restored);
        restored
    }

    /// The full-attention KV-cache group learned from `endpoint`'s events, if any: which of a
    /// hybrid model's groups its blocks came from, carried with them in a snapshot.
    pub fn tracked_group(&self, endpoint: EndpointId) -> Option<i64> {
        self.endpoints
            .get(&endpoint)
            .and_then(|s| s.group.learned())
    }

    /// Makes `group` the tracked KV-cache group of `endpoint`, as a peer's snapshot says: its
    /// restored blocks came from that group, and the endpoint's events are read by it.
    pub fn set_tracked_group(&mut self, endpoint: EndpointId, group: i64) {
        self.add_endpoint(endpoint);
        let state = self.endpoints.get_mut(&endpoint).expect("just registered");
        state.group = super::groups::PrefixGroup::learned_from(group);
    }

    /// Marks `endpoint`'s offloaded tiers as uncertain, as recent orphans do (see
    /// [`Self::tier_uncertain`]): what a restored endpoint inherits when its source's tiers
    /// were uncertain, so that a copy never claims more certainty than its source had.
    pub fn mark_tier_uncertain(&mut self, endpoint: EndpointId) {
        self.add_endpoint(endpoint);
        let state = self.endpoints.get_mut(&endpoint).expect("just registered");
        state
            .offload
            .get_or_insert_with(Box::default)
            .note_orphans(1);
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::event::{BlockRemoved, BlockStored, KvEvent};
    use crate::index::{IndexConfig, OffloadSpec, SharedMount};
    use crate::keys::router_keys;

    const BS: usize = 4;
    /// The second key of tokens 0..32 in blocks of 16, under [`ROUTER_KEY_SCHEME`] 1.
    const PINNED_SECOND_KEY: u64 = 0x1b34_090c_b109_fe02;
    const E0: EndpointId = EndpointId(0);
    const E1: EndpointId = EndpointId(1);

    /// Router keys are what replicas exchange: one computed otherwise must come with a new
    /// [`ROUTER_KEY_SCHEME`] (then update the pinned value here).
    #[test]
    fn the_router_key_chain_is_the_one_its_scheme_names() {
        let tokens: Vec<u32> = (0..32).collect();
        let keys = router_keys(&tokens, 16, None).unwrap();
        assert_eq!(ROUTER_KEY_SCHEME, 1);
        assert_eq!(keys.len(), 2);
        assert_eq!(keys[1].0, PINNED_SECOND_KEY, "{:#x}", keys[1].0);
    }

    fn index() -> KvIndex {
        KvIndex::new(IndexConfig {
            block_size: BS,
            capacity: 1 << 20,
        })
        .unwrap()
    }

    fn doc(blocks: usize, salt: u32) -> Vec<u32> {
        (0..(blocks * BS) as u32).map(|t| t * 5 + salt).collect()
    }

    fn hashes(tokens: &[u32]) -> Vec<EngineHash> {
        router_keys(tokens, BS, None)
            .unwrap()
            .iter()
            .map(|k| EngineHash(k.0.rotate_left(13) ^ 0x55))
            .collect()
    }

    fn store(tokens: &[u32], from: usize, to: usize, medium: &str) -> KvEvent {
        let h = hashes(tokens);
        KvEvent::BlockStored(BlockStored {
            block_hashes: h[from..to].to_vec(),
            parent_block_hash: from.checked_sub(1).map(|p| h[p]),
            token_ids: tokens[from * BS..to * BS].to_vec(),
            block_size: BS as u32,
            medium: Some(medium.into()),
            ..Default::default()
        })
    }

    fn placeholder(hashes: Vec<EngineHash>, medium: &str) -> KvEvent {
        KvEvent::BlockStored(BlockStored {
            block_hashes: hashes,
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

    /// A copy of `from`'s picture of `endpoints`, made as a starting replica makes it.
    fn copied(from: &KvIndex, endpoints: &[EndpointId], setup: impl Fn(&mut KvIndex)) -> KvIndex {
        let mut to = index();
        setup(&mut to);
        for &e in endpoints {
            let entries: Vec<HeldEntry> = from.endpoint_blocks(e).collect();
            // Through the wire format the snapshot uses.
            let json = serde_json::to_vec(&entries).unwrap();
            let entries: Vec<HeldEntry> = serde_json::from_slice(&json).unwrap();
            assert_eq!(to.restore(e, entries.clone()), entries.len());
            if from.tier_uncertain(e) {
                to.mark_tier_uncertain(e);
            }
        }
        to
    }

    fn same_lookups(a: &KvIndex, b: &KvIndex, docs: &[Vec<u32>]) {
        for d in docs {
            let keys = router_keys(d, BS, None).unwrap();
            assert_eq!(a.lookup(&keys), b.lookup(&keys), "lookups differ");
        }
        assert_eq!(a.entry_count(), b.entry_count());
        assert_eq!(a.block_count(), b.block_count());
    }

    #[test]
    fn a_restored_endpoint_answers_lookups_and_later_removals_as_the_original() {
        let (a, b) = (doc(6, 1), doc(4, 2));
        let mut original = index();
        original.apply(E0, &[store(&a, 0, 6, "GPU"), store(&b, 0, 4, "GPU")]);
        original.apply(E0, &[placeholder(hashes(&a)[..3].to_vec(), "CPU")]);
        // Block 0 offloaded twice: two references on the CPU tier.
        original.apply(E0, &[placeholder(hashes(&a)[..1].to_vec(), "CPU")]);
        original.apply(E0, &[removal(vec![hashes(&a)[4]], "GPU")]);
        original.apply(E1, &[store(&a, 0, 2, "GPU")]);
        let mut copy = copied(&original, &[E0, E1], |_| {});
        same_lookups(&original, &copy, &[a.clone(), b.clone()]);
        let stats = copy.endpoint_stats(E0).unwrap();
        assert_eq!((stats.blocks_gpu, stats.blocks_cpu), (9, 3));
        // The engines' next events apply to the copy as to the original: removals by hash,
        // stores chained under a restored parent.
        let next = [
            removal(vec![hashes(&a)[1]], "GPU"),
            removal(vec![hashes(&a)[0]], "GPU"),
            // One of block 0's two CPU references: it stays on the CPU tier.
            removal(vec![hashes(&a)[0]], "CPU"),
            store(&a, 4, 5, "GPU"),
        ];
        original.apply(E0, &next);
        copy.apply(E0, &next);
        same_lookups(&original, &copy, &[a.clone(), b]);
        let keys = router_keys(&a, BS, None).unwrap();
        assert_eq!(copy.lookup(&keys).get(E0).map(|m| m.cpu_blocks), Some(2));
        assert_eq!(copy.endpoint_stats(E0).unwrap().orphan_blocks, 0);
    }

    /// A copy links the runs its source had: a conversation stored in pieces, a prefix two
    /// endpoints share, a run broken in the middle, a run of six holders (a wide set). Without
    /// the order marks (a peer of a build without them) the copy answers the same, with no run.
    #[test]
    fn a_copy_skips_the_runs_its_source_skips() {
        let (talk, shared) = (doc(40, 3), doc(12, 9));
        let mut source = index();
        let mut pieces: Vec<KvEvent> = (0..32)
            .step_by(8)
            .map(|b| store(&talk, b, b + 8, "GPU"))
            .collect();
        pieces.extend((32..40).map(|b| store(&talk, b, b + 1, "GPU")));
        source.apply(E0, &pieces);
        source.apply(E1, &[store(&talk, 0, 20, "GPU")]);
        let h = hashes(&talk);
        source.apply(E1, &[removal(vec![h[10]], "GPU")]);
        let all: Vec<EndpointId> = (0..6).map(EndpointId).collect();
        for &e in &all {
            source.apply(e, &[store(&shared, 0, 12, "GPU")]);
        }
        let (used, intact) = source.wide.runs();
        assert!(
            intact >= 2 && used > intact,
            "the source has intact and broken runs: {used}, {intact}"
        );
        let copy = copied(&source, &all, |_| {});
        copy.wide
            .check(copy.blocks.iter().map(|b| b.holders))
            .unwrap();
        // Every run the source skips is skipped in the copy, and the pieces of the broken run
        // (the shared prefix before and after block 10) are runs of their own there: four.
        assert_eq!(copy.wide.runs(), (intact + 2, intact + 2));
        let prefixes = |d: &[u32]| {
            (1..=d.len() / BS)
                .map(|n| d[..n * BS].to_vec())
                .collect::<Vec<_>>()
        };
        same_lookups(&source, &copy, &prefixes(&talk));
        same_lookups(&source, &copy, &prefixes(&shared));

        let mut unordered = index();
        for &e in &all {
            let entries = source.endpoint_blocks(e).map(|entry| HeldEntry {
                follows: false,
                ..entry
            });
            unordered.restore(e, entries.collect::<Vec<_>>());
        }
        assert_eq!(unordered.wide.runs(), (0, 0));
        same_lookups(&source, &unordered, &prefixes(&talk));
        same_lookups(&source, &unordered, &prefixes(&shared));
    }

    #[test]
    fn restore_replaces_what_the_endpoint_held() {
        let (a, b) = (doc(3, 3), doc(3, 4));
        let mut original = index();
        original.apply(E0, &[store(&a, 0, 3, "GPU")]);
        let mut stale = index();
        stale.apply(E0, &[store(&b, 0, 3, "GPU")]);
        stale.restore(E0, original.endpoint_blocks(E0).collect::<Vec<_>>());
        same_lookups(&original, &stale, &[a, b]);
    }

    #[test]
    fn chunk_parents_and_the_shared_tier_survive_the_copy() {
        let a = doc(4, 5);
        let h = hashes(&a);
        let spec = OffloadSpec {
            block_size: Some(2 * BS),
            shared: Some(SharedMount::new("nfs")),
        };
        let setup = |ix: &mut KvIndex| {
            ix.set_offload(E0, &spec).unwrap();
            ix.set_offload(E1, &spec).unwrap();
        };
        let mut original = index();
        setup(&mut original);
        original.apply(E0, &[store(&a, 0, 4, "GPU")]);
        // One chunk (blocks 0 and 1) written to the shared mount, named by its last block.
        original.apply(E0, &[placeholder(vec![h[1]], "FS")]);
        // The GPU forgets block 0 and 1: the shared tier still names them.
        original.apply(E0, &[removal(vec![h[0], h[1]], "GPU")]);
        let mut copy = copied(&original, &[E0], setup);
        same_lookups(&original, &copy, std::slice::from_ref(&a));
        let keys = router_keys(&a, BS, None).unwrap();
        assert_eq!(copy.lookup(&keys).get(E1).map(|m| m.shared_blocks), Some(2));
        // A later CPU placeholder for the second chunk walks the restored parent link.
        let next = [placeholder(vec![h[3]], "CPU")];
        original.apply(E0, &next);
        copy.apply(E0, &next);
        same_lookups(&original, &copy, std::slice::from_ref(&a));
        assert_eq!(copy.endpoint_stats(E0).unwrap().blocks_cpu, 2);
        assert_eq!(copy.endpoint_stats(E0).unwrap().offload_orphans, 0);
    }

    #[test]
    fn the_capacity_bound_holds_after_a_restore() {
        let a = doc(64, 6);
        let mut original = index();
        original.apply(E0, &[store(&a, 0, 64, "GPU")]);
        let mut small = KvIndex::new(IndexConfig {
            block_size: BS,
            capacity: 32,
        })
        .unwrap();
        small.restore(E0, original.endpoint_blocks(E0).collect::<Vec<_>>());
        assert!(small.entry_count() <= 32, "{}", small.entry_count());
    }

    proptest! {
        /// Any history of stores and removals on two tiers and two endpoints: the copy answers
        /// every lookup as the original, and keeps doing so under the same later events.
        #[test]
        fn a_copy_matches_the_original(
            ops in proptest::collection::vec((0usize..2, 0usize..4, 0usize..6, 0usize..3), 1..60),
        ) {
            let docs: Vec<Vec<u32>> = (0..4).map(|d| doc(6, d as u32 * 1000)).collect();
            let event = |&(_, d, at, kind): &(usize, usize, usize, usize)| -> KvEvent {
                let d = &docs[d];
                match kind {
                    0 => store(d, 0, at + 1, "GPU"),
                    1 => placeholder(hashes(d)[..=at].to_vec(), "CPU"),
                    _ => removal(vec![hashes(d)[at]], if at % 2 == 0 { "GPU" } else { "CPU" }),
                }
            };
            let (before, after) = ops.split_at(ops.len() / 2);
            let mut original = index();
            for op in before {
                original.apply(EndpointId(op.0 as u32), &[event(op)]);
            }
            let mut copy = copied(&original, &[E0, E1], |_| {});
            let books = |ix: &KvIndex| ix.wide.check(ix.blocks.iter().map(|b| b.holders));
            prop_assert_eq!(books(&copy), Ok(()));
            same_lookups(&original, &copy, &docs);
            for op in after {
                original.apply(EndpointId(op.0 as u32), &[event(op)]);
                copy.apply(EndpointId(op.0 as u32), &[event(op)]);
                prop_assert_eq!(books(&copy), Ok(()));
            }
            same_lookups(&original, &copy, &docs);
        }
    }
}
