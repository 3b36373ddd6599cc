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
//! - **One KV-cache group.** Hybrid models publish per-KV-group events (`group_idx`); the prefix
//!   index tracks their full-attention group (group 0 until the events say which,
//!   `groups`) and counts the others as ignored.

mod bound;
mod chunked;
mod fleet_tier;
mod groups;
mod holders;
mod lookup;
mod offload;
mod restore;
mod runs;
mod shared;
mod split_table;
mod table;
#[cfg(test)]
mod table_testing;

use hashbrown::HashMap;

use crate::CoreError;
use crate::event::{BlockRemoved, BlockStored, EngineHash, KvEvent, Tier};
use crate::keys::{ExtraKey, ROOT_KEY, RouterKey, router_key};
use fleet_tier::{FleetTier, SharedFleetTier};
use groups::GroupVerdict;
use holders::{Holders, WideHolders};
use offload::{EndpointOffload, Place, Tables, chunk_chain, remove_block, resolve, store_block};
use runs::RunChain;
use split_table::{Position, SplitTable};
use table::Slot;

pub use fleet_tier::SharedTierStats;
pub use lookup::{PrefixMatch, PrefixMatches};
pub use offload::{OffloadSpec, SharedMount};
pub use restore::{EndpointRestore, HeldEntry, KeyLayout, ROUTER_KEY_SCHEME};
pub use shared::{HeldBlocks, IndexRead, SharedIndex};

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
    /// The most blocks the CPU tier held when the engine removed one from it (0: it never
    /// did): a tier full of blocks evicts its least recently used to store new ones, so this is
    /// its capacity as the events show it, where the engine's metrics do not say.
    pub cpu_blocks_when_full: u64,
    /// Blocks whose store was applied (re-stores included).
    pub blocks_stored: u64,
    /// Blocks whose removal was applied.
    pub blocks_removed: u64,
    /// Blocks in `BlockStored` events whose parent hash was unknown: not indexed.
    pub orphan_blocks: u64,
    /// GPU removals naming a hash this endpoint does not hold.
    pub unknown_hashes: u64,
    /// Blocks named by offloaded-tier events (CPU, storage, shared) that the endpoint's map
    /// cannot resolve: an unknown engine hash, a chunk block whose parent link is gone, or a
    /// removal of a block not held on that tier. Counted, never guessed; a tier picture with
    /// orphans is not certain.
    pub offload_orphans: u64,
    /// Offloaded-tier stores of a block already held on that tier (reference-counted: each
    /// needs its own removal, as vLLM documents).
    pub offload_repeats: u64,
    /// Blocks refused because the event's block size differs from the index's.
    pub block_size_mismatches: u64,
    /// Blocks refused because the event was inconsistent (token count, extra-keys length).
    pub malformed_blocks: u64,
    /// Blocks of KV groups other than the one tracked (hybrid models' sliding-window, Mamba or
    /// second full-attention groups), not indexed.
    pub ignored_group_blocks: u64,
    /// Blocks of a LoRA adapter named only by its int id (`lora_id` without `lora_name`, vLLM
    /// before 0.14): their key cannot be computed without the adapter's name, and keyed as the
    /// base model's they would match base-model prompts that the engine does not find. Not
    /// indexed.
    pub unnamed_lora_blocks: u64,
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
    blocks: SplitTable<HeldBlock>,
    /// The capacity bound's clock hand: the next slot of `blocks` it looks at.
    hand: Position,
    stats: EndpointIndexStats,
    /// Offloaded tiers' bookkeeping, once the endpoint has any.
    offload: Option<Box<EndpointOffload>>,
    /// Which of its KV-cache groups is tracked.
    group: groups::PrefixGroup,
}

/// The KV block index. Single-threaded; wrap it in a [`SharedIndex`] to share it.
#[derive(Debug)]
pub struct KvIndex {
    config: IndexConfig,
    /// Router key → holders, for every block held by at least one endpoint.
    blocks: SplitTable<BlockEntry>,
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
    /// The fleet-wide shared tier: this index's own, or the one its sibling shards share.
    fleet: SharedFleetTier,
    /// This index's shard number in a sharded [`SharedIndex`] (0 when alone): the shared tier
    /// records which shard each mounting slot belongs to.
    shard: u32,
    /// Endpoints of this index that mount a shared tier (lookups skip the tier while none does).
    mounted: usize,
    /// Endpoints the capacity bound evicted from since [`KvIndex::take_evicted_from`] last
    /// took them (their GPU counts changed though no event of theirs was applied).
    evicted_from: Vec<EndpointId>,
}

/// Marks `slot` as holding `key` on `tier`, adding the block if new, and links it into the
/// chain's runs if it is stored as part of one; returns whether the (slot, tier) pair was new.
fn add_holder(
    blocks: &mut SplitTable<BlockEntry>,
    wide: &mut WideHolders,
    key: RouterKey,
    slot: u32,
    tier: Tier,
    runs: Option<&mut RunChain>,
) -> bool {
    let mut inserted = false;
    let (entry, new) = blocks.get_or_insert_with(key.0, || {
        let mut holders = Holders::default();
        inserted = wide.insert(&mut holders, slot, tier);
        BlockEntry {
            key: key.0,
            holders,
        }
    });
    if !new {
        inserted = wide.insert(&mut entry.holders, slot, tier);
    }
    if let Some(runs) = runs
        && let Some(pair) = runs.push(wide, &mut entry.holders, key)
    {
        runs.link_pair(blocks, wide, pair, key);
    }
    inserted
}

/// Clears `slot` on `tier` for `key`, dropping the block once nobody holds it; returns whether
/// it was set, and whether `slot` still holds the block on another tier.
fn drop_holder(
    blocks: &mut SplitTable<BlockEntry>,
    wide: &mut WideHolders,
    key: RouterKey,
    slot: u32,
    tier: Tier,
) -> (bool, bool) {
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
    blocks: &mut SplitTable<BlockEntry>,
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
        let fleet = FleetTier::shared(config.capacity);
        Self::shard(config, fleet, 0)
    }

    /// An empty index serving as shard `shard` of a sharded index whose shards share `fleet`.
    fn shard(config: IndexConfig, fleet: SharedFleetTier, shard: u32) -> Result<Self, CoreError> {
        if config.block_size == 0 {
            return Err(CoreError::InvalidBlockSize(0));
        }
        Ok(Self {
            config,
            blocks: SplitTable::default(),
            wide: WideHolders::default(),
            endpoints: HashMap::new(),
            slots: Vec::new(),
            entries: 0,
            victim: None,
            fleet,
            shard,
            mounted: 0,
            evicted_from: Vec::new(),
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
                blocks: SplitTable::default(),
                hand: Position::default(),
                stats: EndpointIndexStats::default(),
                offload: None,
                group: groups::PrefixGroup::default(),
            }
        })
    }

    /// Forgets an endpoint and everything it held (what it wrote to a shared tier stays there:
    /// the filesystem keeps it).
    pub fn remove_endpoint(&mut self, endpoint: EndpointId) {
        self.clear_endpoint(endpoint);
        if let Some(state) = self.endpoints.remove(&endpoint) {
            self.slots[state.slot as usize] = None;
            if state.offload.as_ref().is_some_and(|o| o.mount.is_some()) {
                self.mounted -= 1;
                self.fleet.write().set_slot(self.shard, state.slot, None);
            }
        }
    }

    /// Declares how `endpoint` offloads (its chunk size, the shared tier it mounts), registering
    /// it if new. Takes effect for the events that follow; what it holds is kept.
    pub fn set_offload(
        &mut self,
        endpoint: EndpointId,
        spec: &OffloadSpec,
    ) -> Result<(), CoreError> {
        let bs = self.config.block_size;
        let chunk_blocks = match spec.block_size {
            None => 1,
            Some(size)
                if size >= bs
                    && size.is_multiple_of(bs)
                    && size / bs <= offload::MAX_CHUNK_BLOCKS =>
            {
                size / bs
            }
            Some(size) => {
                return Err(CoreError::OffloadBlockSize {
                    offload: size,
                    block_size: bs,
                });
            }
        };
        let slot = self.state(endpoint).slot;
        let mount = {
            let mut fleet = self.fleet.write();
            let mount = spec
                .shared
                .as_ref()
                .map(|m| (fleet.mount(&m.name), m.media.clone()));
            fleet.set_slot(self.shard, slot, mount.as_ref().map(|(id, _)| *id));
            mount
        };
        let state = self.endpoints.get_mut(&endpoint).expect("just registered");
        let o = state.offload.get_or_insert_with(Box::default);
        o.chunk_blocks = chunk_blocks;
        let was_mounted = o.mount.is_some();
        o.mount = mount;
        self.mounted = self.mounted + usize::from(o.mount.is_some()) - usize::from(was_mounted);
        Ok(())
    }

    /// Counters of the fleet-wide shared tier.
    pub fn shared_tier_stats(&self) -> SharedTierStats {
        self.fleet.read().stats.clone()
    }

    /// Drops every block an endpoint holds (its cache was reset, or it restarted), keeping its
    /// counters; which of its KV-cache groups is tracked is learned again from its events (a
    /// restarted engine, or a new pod under a freed id, may serve another model).
    pub fn clear_endpoint(&mut self, endpoint: EndpointId) {
        let Some(state) = self.endpoints.get_mut(&endpoint) else {
            return;
        };
        state.group = groups::PrefixGroup::default();
        let slot = state.slot;
        self.entries -= state.blocks.len();
        for held in state.blocks.iter() {
            let key = held.router_key();
            for tier in Tier::ALL {
                drop_holder(&mut self.blocks, &mut self.wide, key, slot, tier);
            }
        }
        state.blocks.clear();
        state.hand = Position::default();
        if let Some(o) = state.offload.as_deref_mut() {
            o.clear();
        }
        let stats = &mut state.stats;
        stats.blocks_gpu = 0;
        stats.blocks_cpu = 0;
        stats.blocks_storage = 0;
        // A restarted engine, or another in its slot, may have another CPU tier: learned again
        // at its first eviction.
        stats.cpu_blocks_when_full = 0;
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
        let bs = self.config.block_size;
        self.add_endpoint(endpoint);
        let state = self.endpoints.get_mut(&endpoint).expect("just registered");
        match state
            .group
            .stored(event.group_idx, event.kv_cache_spec_kind.as_deref())
        {
            GroupVerdict::Index => {}
            GroupVerdict::Ignore => {
                state.stats.ignored_group_blocks += n;
                return;
            }
            GroupVerdict::ClearThenIndex => {
                let learned = state.group;
                self.clear_endpoint(endpoint);
                self.endpoints
                    .get_mut(&endpoint)
                    .expect("just registered")
                    .group = learned;
                return self.apply_stored(endpoint, event);
            }
        }
        let state = self.endpoints.get_mut(&endpoint).expect("just registered");
        let place = EndpointOffload::place(state.offload.as_deref(), event.medium.as_deref());
        let gpu = place == Place::Local(Tier::Gpu);
        if !gpu && state.offload.is_none() {
            state.offload = Some(Box::default());
        }
        let mut tables = Tables {
            blocks: &mut self.blocks,
            wide: &mut self.wide,
            fleet: &self.fleet,
            entries: &mut self.entries,
        };

        if event.token_ids.is_empty() {
            // Offloading placeholders carry no tokens: they add a tier to blocks the endpoint
            // already holds, found by engine hash, one hash per chunk.
            let event_bs = event.block_size as usize;
            if event_bs / bs > offload::MAX_CHUNK_BLOCKS {
                state.stats.malformed_blocks += n;
                return;
            }
            let chunk = match state.offload.as_mut() {
                // Releases before 0.20 publish the offloaded block size: learn the chunk.
                Some(o) if !gpu && event_bs > bs && event_bs.is_multiple_of(bs) => {
                    o.chunk_blocks = event_bs / bs;
                    o.chunk_blocks
                }
                Some(o) if !gpu => o.chunk_blocks.max(1),
                _ => 1,
            };
            for hash in &event.block_hashes {
                if chunk == 1 {
                    match resolve(state, hash.0, place) {
                        Some(key) => {
                            store_block(&mut tables, state, place, hash.0, key, None, None)
                        }
                        None => count_unresolved(state, gpu, 1),
                    }
                    continue;
                }
                let (chain, missing) = chunk_chain(state, hash.0, chunk, place);
                count_unresolved(state, gpu, missing);
                for (h, key) in chain {
                    store_block(&mut tables, state, place, h, key, None, None);
                }
            }
            return;
        }

        // Blocks with their tokens: the GPU's own, an offloading connector's self-describing
        // payload, or LMCache's chunks (several blocks each).
        let event_bs = event.block_size as usize;
        let per_hash = if event_bs == bs {
            1
        } else if !gpu && event_bs > bs && event_bs.is_multiple_of(bs) {
            event_bs / bs
        } else {
            state.stats.block_size_mismatches += n;
            return;
        };
        if event.token_ids.len() as u64 != n * event_bs as u64 {
            state.stats.malformed_blocks += n;
            return;
        }
        if event.lora_name.is_none() && event.lora_id.is_some() {
            state.stats.unnamed_lora_blocks += n;
            return;
        }
        let lora = event
            .lora_name
            .as_ref()
            .map(|lora| vec![ExtraKey::Str(lora.clone())]);
        let per_block = match &event.extra_keys {
            Some(per_block) if per_block.len() as u64 != n => {
                state.stats.malformed_blocks += n;
                return;
            }
            // A chunk's extra keys cannot be spread over its blocks (a cache salt belongs to
            // the first block only): refused rather than guessed.
            Some(per_block) if per_hash > 1 && per_block.iter().any(Option::is_some) => {
                state.stats.malformed_blocks += n;
                return;
            }
            Some(per_block) if per_hash == 1 => Some(per_block),
            _ => None,
        };
        if let Some(o) = state.offload.as_mut()
            && !gpu
        {
            o.described = true;
        }
        let mut parent = match event.parent_block_hash {
            None => ROOT_KEY,
            Some(hash) => match resolve(state, hash.0, place) {
                Some(key) => key,
                None => {
                    state.stats.orphan_blocks += n;
                    return;
                }
            },
        };

        // Keys first, then the tables' slots fetched for the whole batch at once, so that a
        // large index waits for memory about once per batch rather than twice per block.
        let first_parent = parent;
        // vLLM's OffloadingConnector publishes its self-describing payloads without extra keys
        // (deferred), so a block that had some (a cache salt, multimodal hashes) cannot be keyed
        // again from its tokens: a block the endpoint already holds keeps the key its own GPU
        // event gave it, found by engine hash (a key computed without them would replace the
        // right one).
        let keeps_known_key = !gpu && per_hash == 1 && event.extra_keys.is_none();
        let keys: Vec<RouterKey> = event
            .token_ids
            .chunks_exact(bs)
            .enumerate()
            .map(|(i, tokens)| {
                if keeps_known_key && let Some(held) = state.blocks.get(event.block_hashes[i].0) {
                    parent = held.router_key();
                    return parent;
                }
                // Before 0.17 events carry no extra keys, but LoRA blocks were hashed with the
                // adapter name: put it back so LoRA requests find them.
                let block_extra = match per_block {
                    Some(per_block) => per_block[i].as_deref(),
                    None => lora.as_deref(),
                };
                parent = router_key(parent, tokens, block_extra);
                parent
            })
            .collect();
        let hash_of = |i: usize, key: RouterKey| {
            if per_hash == 1 {
                event.block_hashes[i].0
            } else if (i + 1).is_multiple_of(per_hash) {
                event.block_hashes[i / per_hash].0
            } else {
                offload::member_hash(key)
            }
        };
        for (i, key) in keys.iter().enumerate() {
            state.blocks.prefetch(hash_of(i, *key));
            tables.blocks.prefetch(key.0);
        }
        let mut parent_hash = event.parent_block_hash.map(|h| h.0);
        let mut runs = RunChain::after(tables.blocks, tables.wide, first_parent);
        for (i, &key) in keys.iter().enumerate() {
            let hash = hash_of(i, key);
            store_block(
                &mut tables,
                state,
                place,
                hash,
                key,
                parent_hash,
                Some(&mut runs),
            );
            parent_hash = Some(hash);
        }
    }

    fn apply_removed(&mut self, endpoint: EndpointId, event: &BlockRemoved) {
        self.add_endpoint(endpoint);
        let state = self.endpoints.get_mut(&endpoint).expect("just registered");
        if !state.group.removed(event.group_idx) {
            state.stats.ignored_group_blocks += event.block_hashes.len() as u64;
            return;
        }
        let place = EndpointOffload::place(state.offload.as_deref(), event.medium.as_deref());
        let gpu = place == Place::Local(Tier::Gpu);
        // A placeholder removal names a chunk by its last block; a self-describing one names
        // every block.
        let chunk = match state.offload.as_deref() {
            Some(o) if !gpu && !o.described => o.chunk_blocks.max(1),
            _ => 1,
        };
        let mut tables = Tables {
            blocks: &mut self.blocks,
            wide: &mut self.wide,
            fleet: &self.fleet,
            entries: &mut self.entries,
        };
        if chunk == 1 {
            // The common case (every GPU removal): no chain to walk. As for stores: fetch the
            // batch's slots from both tables before working on them.
            for hash in &event.block_hashes {
                state.blocks.prefetch(hash.0);
            }
            let keys: Vec<Option<RouterKey>> = event
                .block_hashes
                .iter()
                .map(|hash| resolve(state, hash.0, place))
                .collect();
            for key in keys.iter().flatten() {
                tables.blocks.prefetch(key.0);
            }
            for (hash, key) in event.block_hashes.iter().zip(keys) {
                if key.is_none() || !remove_block(&mut tables, state, place, hash.0, key) {
                    count_unresolved(state, gpu, 1);
                }
            }
            return;
        }
        for hash in &event.block_hashes {
            let (chain, mut missing) = chunk_chain(state, hash.0, chunk, place);
            for (h, key) in chain {
                if !remove_block(&mut tables, state, place, h, Some(key)) {
                    missing += 1;
                }
            }
            count_unresolved(state, gpu, missing);
        }
    }

    /// Each endpoint's longest cached prefix of a request's blocks, split by tier.
    pub fn lookup(&self, keys: &[RouterKey]) -> PrefixMatches {
        let mut out = PrefixMatches::default();
        self.lookup_into(keys, 1, &mut out);
        out.sort();
        out
    }

    /// [`Self::lookup`]'s matches appended to `out`, unsorted: how a sharded index answers
    /// from every shard into one list. `shards_left`: the shards still to answer, this one
    /// included; `out` makes room for as many answers the size of this one's, once.
    pub(super) fn lookup_into(
        &self,
        keys: &[RouterKey],
        shards_left: usize,
        out: &mut PrefixMatches,
    ) {
        lookup::append_longest_prefixes(self, keys, shards_left, out);
    }

    /// Whether `endpoint`'s offloaded-tier events were recently inconsistent (orphans): what
    /// the index says of its tiers below the GPU is an estimate.
    pub fn tier_uncertain(&self, endpoint: EndpointId) -> bool {
        self.endpoints.get(&endpoint).is_some_and(|s| {
            s.offload
                .as_deref()
                .is_some_and(offload::EndpointOffload::uncertain)
        })
    }

    /// Counters for one endpoint, if it is known.
    pub fn endpoint_stats(&self, endpoint: EndpointId) -> Option<EndpointIndexStats> {
        self.endpoints.get(&endpoint).map(|s| s.stats.clone())
    }

    /// The endpoints the capacity bound evicted from since this was last called.
    pub(super) fn take_evicted_from(&mut self) -> std::vec::Drain<'_, EndpointId> {
        self.evicted_from.drain(..)
    }

    /// One of `endpoint`'s counters (0 when the endpoint is unknown).
    fn counter(&self, endpoint: EndpointId, read: impl Fn(&EndpointIndexStats) -> u64) -> u64 {
        self.endpoints.get(&endpoint).map_or(0, |s| read(&s.stats))
    }

    /// Blocks `endpoint` holds on the GPU now (0 when unknown).
    pub fn gpu_blocks(&self, endpoint: EndpointId) -> u64 {
        self.counter(endpoint, |s| s.blocks_gpu)
    }

    /// Blocks `endpoint` holds in CPU memory now (0 when unknown).
    pub fn cpu_blocks(&self, endpoint: EndpointId) -> u64 {
        self.counter(endpoint, |s| s.blocks_cpu)
    }

    /// Blocks `endpoint` holds on its own storage tier now (0 when unknown).
    pub fn storage_blocks(&self, endpoint: EndpointId) -> u64 {
        self.counter(endpoint, |s| s.blocks_storage)
    }

    /// `endpoint`'s CPU tier capacity in blocks as its events show it (0: unknown, the tier
    /// never removed a block): [`EndpointIndexStats::cpu_blocks_when_full`].
    pub fn cpu_capacity_blocks(&self, endpoint: EndpointId) -> u64 {
        self.counter(endpoint, |s| s.cpu_blocks_when_full)
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
        self.own_heap_bytes() + self.fleet.read().heap_bytes()
    }

    /// [`heap_bytes`](Self::heap_bytes) without the shared tier (which shards share).
    fn own_heap_bytes(&self) -> usize {
        self.blocks.heap_bytes()
            + self.wide.heap_bytes()
            + self
                .endpoints
                .values()
                .map(|s| s.blocks.heap_bytes() + s.offload.as_ref().map_or(0, |o| o.heap_bytes()))
                .sum::<usize>()
    }
}

/// Counts blocks an event named that the endpoint's map could not resolve: unknown hashes on
/// the GPU, orphans (which make the tier picture uncertain for a while) below it.
fn count_unresolved(state: &mut EndpointState, gpu: bool, missing: u64) {
    if gpu {
        state.stats.unknown_hashes += missing;
    } else {
        state.stats.offload_orphans += missing;
        if let Some(o) = state.offload.as_deref_mut() {
            o.note_orphans(missing);
        }
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

#[cfg(test)]
mod offload_tests;
