//! The KV block index: which endpoint holds which prompt blocks, on which tier.
//!
//! Engines name blocks by their own hashes ([`EngineHash`]); requests are cut into blocks named
//! by router keys ([`RouterKey`]). The index keeps, per endpoint, the map from engine hash to
//! router key that `BlockStored` events build (each event carries its tokens and its parent's
//! hash, so the router key chain can be extended), and, per router key, the set of endpoints
//! holding that block per tier. `BlockRemoved` carries only engine hashes; the per-endpoint map
//! resolves them.
//!
//! # Decisions
//! - **Re-stores are idempotent.** vLLM may announce a block again (duplicate blocks, "full"
//!   report mode, offloaded chunks sharing a prefix); a second store never needs a second
//!   remove. The cost is that when an engine holds two copies of a block and evicts one, the
//!   index forgets the block: it under-predicts, which is the safe direction.
//! - **Orphans are never guessed.** A `BlockStored` whose parent hash the endpoint's map does not
//!   know cannot be placed in the chain; it is counted and dropped.
//! - **Bounded memory, without pauses.** The index holds at most `capacity` (block, endpoint)
//!   entries. Past 90% of it, each batch also runs a clock hand over the table of the endpoint
//!   holding the most entries (searched again every 64 sweeps, not every batch: the search
//!   reads every endpoint): an entry stored since the hand last passed gets a second chance,
//!   any other is dropped. The work per batch is a small multiple of the batch's
//!   own size, so readers never wait for a full pass (the old cutoff-stamp pass stopped the
//!   world for 62 ms at 1M entries). Why the largest endpoint: a healthy engine's own eviction
//!   events keep its entries in step, so the bound is the backstop for lost `BlockRemoved`
//!   events, and an endpoint that lost them is the one that grew; within it, the entries not
//!   re-stored lately are the ones its engine most likely evicted. At `capacity` itself the
//!   hand stops giving second chances, so the bound is never exceeded.
//! - **Group 0 only.** Hybrid models publish per-KV-group events (`group_idx`); the prefix index
//!   tracks group 0, the one every model has, and counts the others as ignored.

mod bound;
mod holders;
mod lookup;
mod shared;
mod table;

use hashbrown::HashMap;

use crate::CoreError;
use crate::event::{BlockRemoved, BlockStored, EngineHash, KvEvent, Tier};
use crate::keys::{BlockExtraKeys, ExtraKey, ROOT_KEY, RouterKey, router_key};
use holders::{Holders, WideHolders};
use table::{FlatTable, ShardedTable, Slot};

pub use lookup::{PrefixMatch, PrefixMatches};
pub use shared::SharedIndex;

/// The caller's identifier for an endpoint (one engine, or one data-parallel rank).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub struct EndpointId(pub u32);

/// Settings of a [`KvIndex`].
#[derive(Clone, Debug)]
pub struct IndexConfig {
    /// Tokens per block; events with another block size are refused (counted) rather than
    /// indexed under keys no request would ever produce.
    pub block_size: usize,
    /// Most (block, endpoint) entries the index holds before it drops the oldest.
    pub capacity: usize,
}

impl Default for IndexConfig {
    fn default() -> Self {
        Self {
            block_size: crate::keys::DEFAULT_BLOCK_SIZE,
            capacity: 8 << 20,
        }
    }
}

/// What the index did with one endpoint's events: counters for operators and tests.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct EndpointIndexStats {
    /// Blocks held now, by fastest-first tier (a block on two tiers counts on both).
    pub blocks_gpu: u64,
    /// Blocks held on the CPU tier now.
    pub blocks_cpu: u64,
    /// Blocks held on the storage tier now.
    pub blocks_storage: u64,
    /// Blocks whose store was applied (re-stores included).
    pub blocks_stored: u64,
    /// Blocks whose removal was applied.
    pub blocks_removed: u64,
    /// Blocks in `BlockStored` events whose parent hash was unknown: not indexed.
    pub orphan_blocks: u64,
    /// Removals (or token-less tier stores) naming a hash this endpoint does not hold.
    pub unknown_hashes: u64,
    /// Blocks refused because the event's block size differs from the index's.
    pub block_size_mismatches: u64,
    /// Blocks refused because the event was inconsistent (token count, extra-keys length).
    pub malformed_blocks: u64,
    /// Blocks of KV groups other than 0 (hybrid models), not indexed.
    pub ignored_group_blocks: u64,
    /// Times the endpoint's cache was cleared (`AllBlocksCleared`, restart, removal).
    pub clears: u64,
    /// Entries dropped by the capacity bound.
    pub capacity_evictions: u64,
}

/// One block an endpoint holds: its engine hash (how removals name it) and its router key (how
/// lookups name it), with the clock's referenced bit in the key's top bit (router keys never
/// use it; see [`crate::keys::router_key`]). A zero key marks a vacant slot: no router key is 0.
#[derive(Clone, Copy, Debug, Default)]
struct HeldBlock {
    hash: u64,
    tagged_key: u64,
}

/// Set in [`HeldBlock::tagged_key`] when the block was stored since the clock hand last passed.
const REFERENCED: u64 = 1 << 63;

impl HeldBlock {
    fn router_key(self) -> RouterKey {
        RouterKey(self.tagged_key & !REFERENCED)
    }
}

impl Slot for HeldBlock {
    fn key(&self) -> u64 {
        self.hash
    }
    fn is_vacant(&self) -> bool {
        self.tagged_key == 0
    }
}

/// One block of the block table: its router key and who holds it.
#[derive(Clone, Copy, Debug, Default)]
struct BlockEntry {
    key: u64,
    holders: Holders,
}

impl Slot for BlockEntry {
    fn key(&self) -> u64 {
        self.key
    }
    fn is_vacant(&self) -> bool {
        self.holders.is_empty()
    }
}

#[derive(Debug)]
struct EndpointState {
    slot: u32,
    /// Every block this endpoint holds on any tier, by engine hash.
    blocks: FlatTable<HeldBlock>,
    /// The capacity bound's clock hand: the next slot of `blocks` it looks at.
    hand: usize,
    stats: EndpointIndexStats,
}

/// The KV block index. Single-threaded; wrap it in a [`SharedIndex`] to share it.
#[derive(Debug)]
pub struct KvIndex {
    config: IndexConfig,
    /// Router key → holders, for every block held by at least one endpoint.
    blocks: ShardedTable<BlockEntry>,
    /// Holder sets too large for a block table entry.
    wide: WideHolders,
    endpoints: HashMap<EndpointId, EndpointState>,
    /// Slot → endpoint; `None` for a free slot.
    slots: Vec<Option<EndpointId>>,
    /// (block, endpoint) entries held: the sum of every endpoint's table size.
    entries: usize,
    /// The capacity bound's current victim (the endpoint that held the most entries when last
    /// searched) and the sweeps since.
    victim: Option<(EndpointId, u32)>,
}

/// Marks `slot` as holding `key` on `tier`, adding the block if new; returns whether the
/// (slot, tier) pair was new.
fn add_holder(
    blocks: &mut ShardedTable<BlockEntry>,
    wide: &mut WideHolders,
    key: RouterKey,
    slot: u32,
    tier: Tier,
) -> bool {
    let blocks = blocks.shard_mut(key.0);
    if let Some(entry) = blocks.get_mut(key.0) {
        return wide.insert(&mut entry.holders, slot, tier);
    }
    let mut holders = Holders::default();
    wide.insert(&mut holders, slot, tier);
    blocks.insert_absent(BlockEntry {
        key: key.0,
        holders,
    });
    true
}

/// Clears `slot` on `tier` for `key`, dropping the block once nobody holds it; returns whether
/// it was set, and whether `slot` still holds the block on another tier.
fn drop_holder(
    blocks: &mut ShardedTable<BlockEntry>,
    wide: &mut WideHolders,
    key: RouterKey,
    slot: u32,
    tier: Tier,
) -> (bool, bool) {
    let blocks = blocks.shard_mut(key.0);
    let Some(at) = blocks.find(key.0) else {
        return (false, false);
    };
    let entry = blocks.at_mut(at).expect("found");
    let was = wide.remove(&mut entry.holders, slot, tier);
    if entry.holders.is_empty() {
        blocks.remove_at(at);
        return (was, false);
    }
    (was, wide.view(entry.holders).holds(slot))
}

/// Clears `slot` on every tier of `key`, keeping `stats`' per-tier counts.
fn drop_slot(
    blocks: &mut ShardedTable<BlockEntry>,
    wide: &mut WideHolders,
    key: RouterKey,
    slot: u32,
    stats: &mut EndpointIndexStats,
) {
    for tier in Tier::ALL {
        if drop_holder(blocks, wide, key, slot, tier).0 {
            bump(stats, tier, false);
        }
    }
}

impl KvIndex {
    /// An empty index.
    pub fn new(config: IndexConfig) -> Result<Self, CoreError> {
        if config.block_size == 0 {
            return Err(CoreError::InvalidBlockSize(0));
        }
        Ok(Self {
            config,
            blocks: ShardedTable::default(),
            wide: WideHolders::default(),
            endpoints: HashMap::new(),
            slots: Vec::new(),
            entries: 0,
            victim: None,
        })
    }

    /// The index's settings.
    pub fn config(&self) -> &IndexConfig {
        &self.config
    }

    /// Registers an endpoint (idempotent). Events for unknown endpoints register them too.
    pub fn add_endpoint(&mut self, endpoint: EndpointId) {
        self.state(endpoint);
    }

    fn state(&mut self, endpoint: EndpointId) -> &mut EndpointState {
        let slots = &mut self.slots;
        self.endpoints.entry(endpoint).or_insert_with(|| {
            let slot = match slots.iter().position(Option::is_none) {
                Some(free) => free,
                None => {
                    slots.push(None);
                    slots.len() - 1
                }
            };
            slots[slot] = Some(endpoint);
            EndpointState {
                slot: slot as u32,
                blocks: FlatTable::default(),
                hand: 0,
                stats: EndpointIndexStats::default(),
            }
        })
    }

    /// Forgets an endpoint and everything it held.
    pub fn remove_endpoint(&mut self, endpoint: EndpointId) {
        self.clear_endpoint(endpoint);
        if let Some(state) = self.endpoints.remove(&endpoint) {
            self.slots[state.slot as usize] = None;
        }
    }

    /// Drops every block an endpoint holds (its cache was reset, or it restarted), keeping its
    /// counters.
    pub fn clear_endpoint(&mut self, endpoint: EndpointId) {
        let Some(state) = self.endpoints.get_mut(&endpoint) else {
            return;
        };
        let slot = state.slot;
        self.entries -= state.blocks.len();
        for held in state.blocks.iter() {
            let key = held.router_key();
            for tier in Tier::ALL {
                drop_holder(&mut self.blocks, &mut self.wide, key, slot, tier);
            }
        }
        state.blocks.clear();
        state.hand = 0;
        let stats = &mut state.stats;
        stats.blocks_gpu = 0;
        stats.blocks_cpu = 0;
        stats.blocks_storage = 0;
        stats.clears += 1;
    }

    /// Applies one endpoint's events in order.
    pub fn apply(&mut self, endpoint: EndpointId, events: &[KvEvent]) {
        self.add_endpoint(endpoint);
        let mut blocks = 0;
        for event in events {
            match event {
                KvEvent::BlockStored(stored) => {
                    blocks += stored.block_hashes.len();
                    self.apply_stored(endpoint, stored);
                }
                KvEvent::BlockRemoved(removed) => self.apply_removed(endpoint, removed),
                KvEvent::AllBlocksCleared => self.clear_endpoint(endpoint),
            }
        }
        self.bound(blocks);
    }

    fn apply_stored(&mut self, endpoint: EndpointId, event: &BlockStored) {
        let n = event.block_hashes.len() as u64;
        let block_size = self.config.block_size;
        self.add_endpoint(endpoint);
        let state = self.endpoints.get_mut(&endpoint).expect("just registered");
        let slot = state.slot;
        if event.group_idx.is_some_and(|g| g != 0) {
            state.stats.ignored_group_blocks += n;
            return;
        }
        let tier = Tier::from_medium(event.medium.as_deref());

        if event.token_ids.is_empty() {
            // Offloading placeholders carry no tokens: they add a tier to blocks the endpoint
            // already holds, found by engine hash.
            for hash in &event.block_hashes {
                match state.blocks.get_mut(hash.0) {
                    Some(held) => {
                        held.tagged_key |= REFERENCED;
                        let key = held.router_key();
                        if add_holder(&mut self.blocks, &mut self.wide, key, slot, tier) {
                            bump(&mut state.stats, tier, true);
                        }
                        state.stats.blocks_stored += 1;
                    }
                    None => state.stats.unknown_hashes += 1,
                }
            }
            return;
        }

        if event.block_size as usize != block_size {
            state.stats.block_size_mismatches += n;
            return;
        }
        if event.token_ids.len() as u64 != n * block_size as u64 {
            state.stats.malformed_blocks += n;
            return;
        }
        let extra: Option<Vec<BlockExtraKeys>> = match (&event.extra_keys, &event.lora_name) {
            (Some(per_block), _) if per_block.len() as u64 != n => {
                state.stats.malformed_blocks += n;
                return;
            }
            (Some(per_block), _) => Some(per_block.clone()),
            // Before 0.17 events carry no extra keys, but LoRA blocks were hashed with the
            // adapter name: put it back so LoRA requests find them.
            (None, Some(lora)) => Some(vec![Some(vec![ExtraKey::Str(lora.clone())]); n as usize]),
            (None, None) => None,
        };
        let mut parent = match event.parent_block_hash {
            None => ROOT_KEY,
            Some(hash) => match state.blocks.get(hash.0) {
                Some(held) => held.router_key(),
                None => {
                    state.stats.orphan_blocks += n;
                    return;
                }
            },
        };

        // Keys first, then the tables' slots fetched for the whole batch at once, so that a
        // large index waits for memory about once per batch rather than twice per block.
        let keys: Vec<RouterKey> = event
            .token_ids
            .chunks_exact(block_size)
            .enumerate()
            .map(|(i, tokens)| {
                let block_extra = extra.as_ref().and_then(|e| e[i].as_deref());
                parent = router_key(parent, tokens, block_extra);
                parent
            })
            .collect();
        for (hash, key) in event.block_hashes.iter().zip(&keys) {
            state.blocks.prefetch(hash.0);
            self.blocks.prefetch(key.0);
        }
        for (hash, &key) in event.block_hashes.iter().zip(&keys) {
            let (held, new) = state.blocks.get_or_insert(HeldBlock {
                hash: hash.0,
                tagged_key: key.0 | REFERENCED,
            });
            let old = held.router_key();
            held.tagged_key = key.0 | REFERENCED;
            if new {
                self.entries += 1;
            } else if old != key {
                // The engine reused a hash for other content (it restarted with another seed
                // without our noticing, or a hash collided): forget the old block.
                drop_slot(
                    &mut self.blocks,
                    &mut self.wide,
                    old,
                    slot,
                    &mut state.stats,
                );
            }
            if add_holder(&mut self.blocks, &mut self.wide, key, slot, tier) {
                bump(&mut state.stats, tier, true);
            }
            state.stats.blocks_stored += 1;
        }
    }

    fn apply_removed(&mut self, endpoint: EndpointId, event: &BlockRemoved) {
        self.add_endpoint(endpoint);
        let state = self.endpoints.get_mut(&endpoint).expect("just registered");
        let slot = state.slot;
        if event.group_idx.is_some_and(|g| g != 0) {
            state.stats.ignored_group_blocks += event.block_hashes.len() as u64;
            return;
        }
        let tier = Tier::from_medium(event.medium.as_deref());
        // As for stores: fetch the batch's slots from both tables before working on them.
        for hash in &event.block_hashes {
            state.blocks.prefetch(hash.0);
        }
        let keys: Vec<Option<RouterKey>> = event
            .block_hashes
            .iter()
            .map(|hash| state.blocks.get(hash.0).map(|held| held.router_key()))
            .collect();
        for key in keys.iter().flatten() {
            self.blocks.prefetch(key.0);
        }
        for (hash, key) in event.block_hashes.iter().zip(keys) {
            let Some(key) = key else {
                state.stats.unknown_hashes += 1;
                continue;
            };
            let (was, still_held) = drop_holder(&mut self.blocks, &mut self.wide, key, slot, tier);
            if !was {
                state.stats.unknown_hashes += 1;
                continue;
            }
            bump(&mut state.stats, tier, false);
            state.stats.blocks_removed += 1;
            if !still_held {
                state.blocks.remove(hash.0);
                self.entries -= 1;
            }
        }
    }

    /// Each endpoint's longest cached prefix of a request's blocks, split by tier.
    pub fn lookup(&self, keys: &[RouterKey]) -> PrefixMatches {
        lookup::longest_prefixes(self, keys)
    }

    /// Counters for one endpoint, if it is known.
    pub fn endpoint_stats(&self, endpoint: EndpointId) -> Option<EndpointIndexStats> {
        self.endpoints.get(&endpoint).map(|s| s.stats.clone())
    }

    /// Every known endpoint.
    pub fn endpoints(&self) -> impl Iterator<Item = EndpointId> + '_ {
        self.endpoints.keys().copied()
    }

    /// Distinct blocks (router keys) held by at least one endpoint.
    pub fn block_count(&self) -> usize {
        self.blocks.len()
    }

    /// (block, endpoint) entries held: what the capacity bounds.
    pub fn entry_count(&self) -> usize {
        self.entries
    }

    /// Whether `endpoint` holds the block `key` on `tier` (for tests and diagnostics).
    pub fn holds(&self, endpoint: EndpointId, key: RouterKey, tier: Tier) -> bool {
        let Some(state) = self.endpoints.get(&endpoint) else {
            return false;
        };
        self.blocks
            .get(key.0)
            .is_some_and(|b| self.wide.view(b.holders).has(state.slot, tier))
    }

    /// The router key an endpoint's engine hash resolves to, if the endpoint holds that block.
    pub fn resolve(&self, endpoint: EndpointId, hash: EngineHash) -> Option<RouterKey> {
        let held = self.endpoints.get(&endpoint)?.blocks.get(hash.0)?;
        Some(held.router_key())
    }

    /// Heap bytes the index owns: its tables (allocated slots, used or not) and the wide holder
    /// sets. Allocator overhead is not counted; the memory benchmark measures it.
    pub fn heap_bytes(&self) -> usize {
        self.blocks.heap_bytes()
            + self.wide.heap_bytes()
            + self
                .endpoints
                .values()
                .map(|s| s.blocks.heap_bytes())
                .sum::<usize>()
    }
}

fn bump(stats: &mut EndpointIndexStats, tier: Tier, up: bool) {
    let counter = match tier {
        Tier::Gpu => &mut stats.blocks_gpu,
        Tier::Cpu => &mut stats.blocks_cpu,
        Tier::Storage => &mut stats.blocks_storage,
    };
    if up {
        *counter += 1;
    } else {
        *counter = counter.saturating_sub(1);
    }
}

#[cfg(test)]
mod tests;
