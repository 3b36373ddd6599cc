//! A KV-cache block pool with vLLM's rules.
//!
//! Blocks hold `block_size` tokens. Only full blocks get a hash and enter the prefix cache.
//! Blocks used by running requests are reference-counted; a block whose count drops to zero
//! stays cached and joins the free queue, and allocation takes the least recently freed block
//! first, evicting its cached content (one `BlockRemoved` per block, as vLLM emits). A request
//! frees its blocks tail first, so the tail of a sequence is evicted before its shared head.
//!
//! With offload tiers, each block is written through to the CPU tier (or to the SSD tier when
//! there is no CPU tier) when it enters the prefix cache, as vLLM's OffloadingConnector stores
//! every newly full block of a scheduled request (and LMCache stores on write): a block evicted
//! from the GPU later survives there if the tier still holds it. See [`offload`] for the
//! policy below the GPU. A pool that mounts the fleet's shared filesystem
//! writes each block there when it is computed (as llm-d's filesystem offload stores every
//! block, so other engines can load it at once) and again on eviction if the filesystem has
//! dropped it meanwhile, and finds blocks other engines wrote.
//!
//! Block state is allocated as blocks are first used, so a pool's memory follows the blocks it
//! has held, not its capacity: a fleet of large caches that a trace fills only in part stays
//! small. Blocks never used yet are free, hold nothing, and are taken in id order after the
//! blocks freed without cached content and before any cached block is evicted, exactly as
//! if they had all been queued at the start.

use std::collections::{BTreeMap, HashMap};

use kvroute_core::event::{BlockRemoved, BlockStored, EngineHash, KvEvent};
use kvroute_core::keys::{BlockExtraKeys, VllmDigest};

pub mod offload;

pub use offload::{OffloadTier, OffloadTiers};

use super::shared_fs::{SharedFs, SharedFsHandle};

/// Where the free queue's stamps start: the back counts up from here, the front down.
const FRONT: u64 = 1 << 63;

/// Index of a GPU block.
pub type BlockId = u32;

#[derive(Debug, Clone, Default)]
struct Block {
    ref_count: u32,
    /// Set while the block's content is in the prefix cache.
    digest: Option<VllmDigest>,
    /// Position in the free queue while `ref_count == 0`.
    free_stamp: Option<u64>,
}

/// The GPU pool, its prefix cache, and the optional offload tiers.
#[derive(Debug)]
pub struct BlockPool {
    block_size: usize,
    /// Blocks in the pool.
    capacity: usize,
    /// The state of the blocks used so far: ids `0..blocks.len()`. Ids from `blocks.len()` to
    /// `capacity` were never used: free, without content, and not in `free`.
    blocks: Vec<Block>,
    /// The free queue of blocks used so far, taken from its lowest stamp: blocks without
    /// cached content at the front (stamps below `FRONT`, most recently freed first), then (the
    /// never-used blocks, in id order, and then) cached ones by the order they were freed (least
    /// recently freed first).
    free: BTreeMap<u64, BlockId>,
    stamp: u64,
    front_stamp: u64,
    /// Content → the blocks holding it. Two running requests can compute the same block; the
    /// content stays cached (and announced once) until its last copy is evicted.
    cached: HashMap<VllmDigest, Vec<BlockId>>,
    offload: OffloadTiers,
    /// The fleet's shared filesystem, when mounted.
    shared: Option<SharedFsHandle>,
    /// Events produced since the last [`BlockPool::take_events`].
    events: Vec<KvEvent>,
}

/// What a newly full run of blocks is: their digests, parent, tokens and extra hash keys.
#[derive(Clone, Copy, Debug)]
pub struct FullBlocks<'a> {
    /// Digest of each block.
    pub digests: &'a [VllmDigest],
    /// Digest of the block before the first (`None` at the start of a sequence).
    pub parent: Option<&'a VllmDigest>,
    /// The blocks' tokens, concatenated.
    pub tokens: &'a [u32],
    /// Each block's extra hash keys (published in events as vLLM 0.17+ does).
    pub extra: &'a [BlockExtraKeys],
    /// LoRA adapter name, if any.
    pub lora_name: Option<&'a str>,
}

impl FullBlocks<'_> {
    fn stored_event(&self, start: usize, end: usize, block_size: usize) -> KvEvent {
        let parent = if start == 0 {
            self.parent
        } else {
            Some(&self.digests[start - 1])
        };
        let extra = &self.extra[start..end];
        KvEvent::BlockStored(BlockStored {
            block_hashes: self.digests[start..end]
                .iter()
                .map(|d| EngineHash(d.event_u64()))
                .collect(),
            parent_block_hash: parent.map(|p| EngineHash(p.event_u64())),
            token_ids: self.tokens[start * block_size..end * block_size].to_vec(),
            block_size: block_size as u32,
            medium: Some("GPU".into()),
            lora_name: self.lora_name.map(str::to_owned),
            // As vLLM publishes them: one entry per block (nil without extra keys), group 0
            // (the one full-attention group of a plain model).
            extra_keys: Some(extra.to_vec()),
            group_idx: Some(0),
            ..Default::default()
        })
    }
}

fn removed_event(digest: &VllmDigest, medium: &str) -> KvEvent {
    KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: vec![EngineHash(digest.event_u64())],
        medium: Some(medium.into()),
        // vLLM's GPU pool names its group (0 for a plain model); offloading tiers do not.
        group_idx: (medium == "GPU").then_some(0),
    })
}

impl BlockPool {
    /// A pool of `gpu_blocks` blocks and a CPU tier of `cpu_blocks` (0: no CPU tier).
    pub fn new(block_size: usize, gpu_blocks: usize, cpu_blocks: usize) -> Self {
        Self::with_tiers(block_size, gpu_blocks, OffloadTiers::new(cpu_blocks, 0))
    }

    /// A pool of `gpu_blocks` blocks above the given (empty) offload tiers. Nothing is
    /// allocated per block until the block is first used.
    pub fn with_tiers(block_size: usize, gpu_blocks: usize, offload: OffloadTiers) -> Self {
        Self {
            block_size,
            // Block ids are `u32`: a larger pool is capped there.
            capacity: gpu_blocks.min(BlockId::MAX as usize),
            blocks: Vec::new(),
            free: BTreeMap::new(),
            stamp: FRONT,
            front_stamp: FRONT,
            cached: HashMap::new(),
            offload,
            shared: None,
            events: Vec::new(),
        }
    }

    /// Blocks never used yet (all free).
    fn unused(&self) -> usize {
        self.capacity - self.blocks.len()
    }

    /// The next block to allocate, off the free queue: one freed without cached content, else
    /// one never used, else the least recently freed cached one.
    fn take_free(&mut self) -> Option<BlockId> {
        let front = self.free.first_key_value().map(|(&stamp, _)| stamp);
        if front.is_some_and(|stamp| stamp < FRONT) || self.unused() == 0 {
            return self.free.pop_first().map(|(_, id)| id);
        }
        // Below the capacity, which fits a block id.
        let id = self.blocks.len() as BlockId;
        self.blocks.push(Block::default());
        Some(id)
    }

    fn push_free(&mut self, id: BlockId) {
        let stamp = self.stamp;
        self.stamp += 1;
        self.blocks[id as usize].free_stamp = Some(stamp);
        self.free.insert(stamp, id);
    }

    /// Puts a block at the front of the free queue: taken before any other.
    fn push_free_front(&mut self, id: BlockId) {
        self.front_stamp -= 1;
        let stamp = self.front_stamp;
        self.blocks[id as usize].free_stamp = Some(stamp);
        self.free.insert(stamp, id);
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the GPU pool.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Whether block `id` is free (no request holds it; cached content may still be hit).
    pub fn is_free(&self, id: BlockId) -> bool {
        self.blocks[id as usize].free_stamp.is_some()
    }

    /// Blocks that can be allocated now (free, cached or not).
    pub fn free_blocks(&self) -> usize {
        self.free.len() + self.unused()
    }

    /// vLLM's `kv_cache_usage_perc`: 1 - free/total, where evictable cached blocks count as free.
    pub fn usage(&self) -> f64 {
        if self.capacity == 0 {
            return 0.0;
        }
        1.0 - self.free_blocks() as f64 / self.capacity as f64
    }

    /// Distinct block contents in the GPU prefix cache.
    pub fn cached_blocks(&self) -> usize {
        self.cached.len()
    }

    /// Blocks held by the CPU tier.
    pub fn cpu_blocks(&self) -> usize {
        self.offload.len(OffloadTier::Cpu)
    }

    /// Blocks held by an offload tier.
    pub fn offloaded_blocks(&self, tier: OffloadTier) -> usize {
        self.offload.len(tier)
    }

    /// The GPU block caching `digest`, if any.
    pub fn lookup(&self, digest: &VllmDigest) -> Option<BlockId> {
        self.cached.get(digest).and_then(|ids| ids.first().copied())
    }

    /// Whether the CPU tier holds `digest`.
    pub fn in_cpu(&self, digest: &VllmDigest) -> bool {
        self.offload.find(digest) == Some(OffloadTier::Cpu)
    }

    /// The fastest offload tier holding `digest`, if any (the shared filesystem last).
    pub fn offloaded_in(&self, digest: &VllmDigest) -> Option<OffloadTier> {
        self.offload.find(digest).or_else(|| {
            self.shared
                .as_ref()
                .filter(|s| lock(s).contains(digest))
                .map(|_| OffloadTier::SharedFs)
        })
    }

    /// Mounts the fleet's shared filesystem: evicted blocks are written there too.
    pub fn mount_shared(&mut self, shared: SharedFsHandle) {
        self.shared = Some(shared);
    }

    /// The mounted shared filesystem.
    pub fn shared(&self) -> Option<&SharedFsHandle> {
        self.shared.as_ref()
    }

    /// Takes a reference on a cached block (a prefix hit), pulling it off the free queue.
    pub fn touch(&mut self, id: BlockId) {
        let block = &mut self.blocks[id as usize];
        if let Some(stamp) = block.free_stamp.take() {
            self.free.remove(&stamp);
        }
        block.ref_count += 1;
    }

    /// Allocates `n` fresh blocks, evicting the least recently freed cached content; `None`
    /// (and nothing changed) when fewer than `n` are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if self.free_blocks() < n {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let id = self.take_free().expect("counted above");
            let block = &mut self.blocks[id as usize];
            block.free_stamp = None;
            block.ref_count = 1;
            if let Some(digest) = block.digest.take() {
                let holders = self
                    .cached
                    .get_mut(&digest)
                    .expect("cached blocks are mapped");
                holders.retain(|&h| h != id);
                if holders.is_empty() {
                    self.cached.remove(&digest);
                    if let Some(shared) = &self.shared {
                        lock(shared).store(digest, &mut self.events);
                    }
                    self.events.push(removed_event(&digest, "GPU"));
                }
            }
            out.push(id);
        }
        Some(out)
    }

    /// Records an offload-tier hit (loaded back to the GPU): refreshes its recency.
    pub fn touch_offloaded(&mut self, digest: VllmDigest) {
        self.offload.touch(digest);
    }

    /// A request's blocks were looked up: those the offload tiers hold are refreshed there, its
    /// last block first so that the head of its prefix is the most recent, as vLLM's
    /// OffloadingConnector touches every block of a request it looks up.
    pub fn touch_offloaded_request(&mut self, digests: &[VllmDigest]) {
        if self.offload.is_empty() {
            return;
        }
        for digest in digests.iter().rev() {
            self.offload.touch(*digest);
        }
    }

    /// A load of offloaded `digest` to the GPU starts: the tier keeps it until it ends.
    pub fn pin_offloaded(&mut self, digest: VllmDigest) {
        self.offload.pin(digest);
    }

    /// A load of offloaded `digest` ended or was given up.
    pub fn unpin_offloaded(&mut self, digest: &VllmDigest) {
        self.offload.unpin(digest);
    }

    /// Registers newly full blocks in the prefix cache: `blocks.digests[i]` is the content of
    /// `ids[i]`. Content already cached in another block gains a holder but is not announced
    /// again.
    pub fn cache_full_blocks(&mut self, ids: &[BlockId], blocks: FullBlocks<'_>) {
        let mut run_start: Option<usize> = None;
        for (i, (&id, digest)) in ids.iter().zip(blocks.digests).enumerate() {
            if self.blocks[id as usize].digest.is_some() {
                // Already registered (cannot happen for fresh blocks; kept safe).
                if let Some(start) = run_start.take() {
                    self.events
                        .push(blocks.stored_event(start, i, self.block_size));
                }
                continue;
            }
            self.blocks[id as usize].digest = Some(*digest);
            let holders = self.cached.entry(*digest).or_default();
            holders.push(id);
            if holders.len() == 1 {
                run_start.get_or_insert(i);
            } else if let Some(start) = run_start.take() {
                self.events
                    .push(blocks.stored_event(start, i, self.block_size));
            }
        }
        if let Some(start) = run_start {
            self.events
                .push(blocks.stored_event(start, ids.len(), self.block_size));
        }
        // Written through to the local tiers and the shared filesystem after the GPU stores,
        // in prefix order, so that an index resolving the tiers' events already knows each
        // block's key and parent. A block a tier holds already is refreshed there, not stored
        // again.
        let stored: Vec<VllmDigest> = ids
            .iter()
            .zip(blocks.digests)
            .filter(|(id, digest)| {
                self.cached
                    .get(digest)
                    .is_some_and(|h| h.first() == Some(id))
            })
            .map(|(_, digest)| *digest)
            .collect();
        for digest in &stored {
            self.offload.offload(*digest, &mut self.events);
            if let Some(shared) = &self.shared {
                lock(shared).store(*digest, &mut self.events);
            }
        }
        // Then refreshed last block first, so that the prefix's head is the tiers' most recent,
        // as vLLM's offloading manager touches a request's blocks after storing them.
        for digest in stored.iter().rev() {
            self.offload.touch(*digest);
        }
    }

    /// Drops one reference on each block, tail first, so that a sequence's tail is evicted
    /// before its head.
    pub fn free(&mut self, ids: &[BlockId]) {
        // As vLLM 0.32's `free_blocks`: cached blocks join the back of the queue (least recently
        // freed evicted first); blocks that hold no cached content go to the front, in order,
        // so they are reused before any cached block is evicted.
        let mut uncached = Vec::new();
        for &id in ids.iter().rev() {
            let block = &mut self.blocks[id as usize];
            debug_assert!(block.ref_count > 0, "double free of block {id}");
            block.ref_count = block.ref_count.saturating_sub(1);
            if block.ref_count == 0 {
                if block.digest.is_some() {
                    self.push_free(id);
                } else {
                    uncached.push(id);
                }
            }
        }
        for &id in uncached.iter().rev() {
            self.push_free_front(id);
        }
    }

    /// Empties the prefix cache (vLLM's `reset_prefix_cache`); refused while blocks are in use.
    pub fn reset(&mut self) -> bool {
        if self.free_blocks() != self.capacity {
            return false;
        }
        for block in &mut self.blocks {
            block.digest = None;
        }
        self.cached.clear();
        self.offload.clear();
        self.events.push(KvEvent::AllBlocksCleared);
        true
    }

    /// The KV events produced since the last call.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }
}

/// Locks the shared tier; a poisoned lock (a panicked holder) still holds consistent data,
/// since every update completes before it returns.
pub(crate) fn lock(shared: &SharedFsHandle) -> std::sync::MutexGuard<'_, SharedFs> {
    shared
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests;
