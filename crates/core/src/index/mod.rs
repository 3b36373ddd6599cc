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
//! - **Bounded memory.** The index holds at most `capacity` (block, endpoint) entries. When a
//!   batch takes it over, the least recently stored entries (by store order, across all
//!   endpoints) are dropped until it is back to 90% of capacity. A healthy engine never needs
//!   this (its own eviction events keep the index in step); it is the backstop for lost events.
//! - **Group 0 only.** Hybrid models publish per-KV-group events (`group_idx`); the prefix index
//!   tracks group 0, the one every model has, and counts the others as ignored.

mod holders;
mod lookup;
mod shared;

use hashbrown::HashMap;

use crate::CoreError;
use crate::event::{BlockRemoved, BlockStored, EngineHash, KvEvent, Tier};
use crate::keys::{BlockExtraKeys, ExtraKey, ROOT_KEY, RouterKey, router_key};
use holders::Holders;

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

#[derive(Debug)]
struct EndpointState {
    slot: u32,
    /// Engine hash → router key of every block this endpoint holds on any tier.
    blocks: HashMap<EngineHash, RouterKey>,
    stats: EndpointIndexStats,
}

#[derive(Debug, Default)]
struct BlockEntry {
    holders: Holders,
    /// Store-order stamp of the last store, for the capacity bound.
    stored_at: u32,
}

/// The KV block index. Single-threaded; wrap it in a [`SharedIndex`] to share it.
#[derive(Debug)]
pub struct KvIndex {
    config: IndexConfig,
    blocks: HashMap<RouterKey, BlockEntry>,
    endpoints: HashMap<EndpointId, EndpointState>,
    /// Slot → endpoint; `None` for a free slot.
    slots: Vec<Option<EndpointId>>,
    /// (block, endpoint) entries held: the sum of every endpoint's map size.
    entries: usize,
    clock: u32,
}

impl KvIndex {
    /// An empty index.
    pub fn new(config: IndexConfig) -> Result<Self, CoreError> {
        if config.block_size == 0 {
            return Err(CoreError::InvalidBlockSize(0));
        }
        Ok(Self {
            config,
            blocks: HashMap::new(),
            endpoints: HashMap::new(),
            slots: Vec::new(),
            entries: 0,
            clock: 0,
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
                blocks: HashMap::new(),
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
        for (_, key) in state.blocks.drain() {
            if let hashbrown::hash_map::Entry::Occupied(mut entry) = self.blocks.entry(key) {
                for tier in Tier::ALL {
                    entry.get_mut().holders.remove(slot, tier);
                }
                if entry.get().holders.is_empty() {
                    entry.remove();
                }
            }
        }
        let stats = &mut state.stats;
        stats.blocks_gpu = 0;
        stats.blocks_cpu = 0;
        stats.blocks_storage = 0;
        stats.clears += 1;
    }

    fn recount_entries(&mut self) {
        self.entries = self.endpoints.values().map(|s| s.blocks.len()).sum();
    }

    /// Applies one endpoint's events in order.
    pub fn apply(&mut self, endpoint: EndpointId, events: &[KvEvent]) {
        self.add_endpoint(endpoint);
        for event in events {
            match event {
                KvEvent::BlockStored(stored) => self.apply_stored(endpoint, stored),
                KvEvent::BlockRemoved(removed) => self.apply_removed(endpoint, removed),
                KvEvent::AllBlocksCleared => self.clear_endpoint(endpoint),
            }
        }
        if self.entries > self.config.capacity {
            self.evict_oldest();
        }
    }

    fn tick(&mut self) -> u32 {
        if self.clock == u32::MAX {
            self.rebase_clock();
        }
        self.clock += 1;
        self.clock
    }

    /// Keeps store-order stamps meaningful when the 32-bit clock would wrap.
    fn rebase_clock(&mut self) {
        let oldest = self.blocks.values().map(|b| b.stored_at).min().unwrap_or(0);
        for entry in self.blocks.values_mut() {
            entry.stored_at -= oldest;
        }
        self.clock -= oldest;
        if self.clock == u32::MAX {
            // Every stamp is distinct-ish and spans the whole range: halve the resolution.
            for entry in self.blocks.values_mut() {
                entry.stored_at /= 2;
            }
            self.clock /= 2;
        }
    }

    fn apply_stored(&mut self, endpoint: EndpointId, event: &BlockStored) {
        let n = event.block_hashes.len() as u64;
        let block_size = self.config.block_size;
        let stamp = self.tick();
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
                match state.blocks.get(hash) {
                    Some(key) => {
                        let entry = self.blocks.entry(*key).or_default();
                        if entry.holders.insert(slot, tier) {
                            bump(&mut state.stats, tier, true);
                        }
                        entry.stored_at = stamp;
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
            Some(hash) => match state.blocks.get(&hash) {
                Some(key) => *key,
                None => {
                    state.stats.orphan_blocks += n;
                    return;
                }
            },
        };

        for (i, (hash, tokens)) in event
            .block_hashes
            .iter()
            .zip(event.token_ids.chunks_exact(block_size))
            .enumerate()
        {
            let block_extra = extra.as_ref().and_then(|e| e[i].as_deref());
            let key = router_key(parent, tokens, block_extra);
            parent = key;
            match state.blocks.insert(*hash, key) {
                None => self.entries += 1,
                Some(old) if old != key => {
                    // The engine reused a hash for other content (it restarted with another
                    // seed without our noticing, or a hash collided): forget the old block.
                    if let Some(entry) = self.blocks.get_mut(&old) {
                        for t in Tier::ALL {
                            if entry.holders.remove(slot, t) {
                                bump(&mut state.stats, t, false);
                            }
                        }
                        if entry.holders.is_empty() {
                            self.blocks.remove(&old);
                        }
                    }
                }
                Some(_) => {}
            }
            let entry = self.blocks.entry(key).or_default();
            if entry.holders.insert(slot, tier) {
                bump(&mut state.stats, tier, true);
            }
            entry.stored_at = stamp;
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
        for hash in &event.block_hashes {
            let Some(&key) = state.blocks.get(hash) else {
                state.stats.unknown_hashes += 1;
                continue;
            };
            let Some(entry) = self.blocks.get_mut(&key) else {
                // Cannot happen while the maps agree; repair rather than panic.
                state.blocks.remove(hash);
                self.entries -= 1;
                continue;
            };
            if !entry.holders.remove(slot, tier) {
                state.stats.unknown_hashes += 1;
                continue;
            }
            bump(&mut state.stats, tier, false);
            state.stats.blocks_removed += 1;
            if !entry.holders.has_any(slot) {
                state.blocks.remove(hash);
                self.entries -= 1;
            }
            if entry.holders.is_empty() {
                self.blocks.remove(&key);
            }
        }
    }

    /// Drops the least recently stored entries until the index is at 90% of capacity.
    fn evict_oldest(&mut self) {
        let target = self.config.capacity / 10 * 9;
        let excess = self.entries.saturating_sub(target);
        if excess == 0 {
            return;
        }
        // Choose a store-order cutoff that drops about `excess` entries: as many of the oldest
        // blocks as that many entries make on average. A selection, not a sort: O(blocks).
        let mut stamps: Vec<u32> = self.blocks.values().map(|b| b.stored_at).collect();
        if stamps.is_empty() {
            return;
        }
        let per_block = self.entries as f64 / stamps.len() as f64;
        let drop_blocks = ((excess as f64 / per_block).ceil() as usize).clamp(1, stamps.len());
        let (_, &mut cutoff, _) = stamps.select_nth_unstable(drop_blocks - 1);
        for state in self.endpoints.values_mut() {
            let slot = state.slot;
            let blocks = &mut self.blocks;
            let stats = &mut state.stats;
            state.blocks.retain(|_, key| {
                let Some(entry) = blocks.get_mut(key) else {
                    return false;
                };
                if entry.stored_at > cutoff {
                    return true;
                }
                for t in Tier::ALL {
                    if entry.holders.remove(slot, t) {
                        bump(stats, t, false);
                    }
                }
                stats.capacity_evictions += 1;
                false
            });
        }
        self.blocks.retain(|_, entry| !entry.holders.is_empty());
        self.recount_entries();
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
            .get(&key)
            .is_some_and(|b| b.holders.has(state.slot, tier))
    }

    /// The router key an endpoint's engine hash resolves to, if the endpoint holds that block.
    pub fn resolve(&self, endpoint: EndpointId, hash: EngineHash) -> Option<RouterKey> {
        self.endpoints.get(&endpoint)?.blocks.get(&hash).copied()
    }

    /// Approximate heap bytes the index owns (tables and their spilled holder sets).
    pub fn heap_bytes(&self) -> usize {
        // hashbrown reports 7/8 of its buckets as capacity; each bucket has one control byte.
        let table = |cap: usize, entry: usize| {
            let buckets = if cap == 0 {
                0
            } else {
                (cap * 8).div_ceil(7).next_power_of_two()
            };
            buckets * (entry + 1)
        };
        let blocks = table(
            self.blocks.capacity(),
            std::mem::size_of::<(RouterKey, BlockEntry)>(),
        ) + self
            .blocks
            .values()
            .map(|b| b.holders.heap_bytes())
            .sum::<usize>();
        let maps: usize = self
            .endpoints
            .values()
            .map(|s| {
                table(
                    s.blocks.capacity(),
                    std::mem::size_of::<(EngineHash, RouterKey)>(),
                )
            })
            .sum();
        blocks + maps
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
