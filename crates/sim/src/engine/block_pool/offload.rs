//! The offload tiers below the GPU: host memory (CPU) and local SSD, each an LRU of block
//! contents with its own capacity.
//!
//! The policy is vLLM's OffloadingConnector's: a block is stored in the fastest offload tier
//! that exists when the GPU computes it (write-through); a tier that overflows demotes its
//! least recently used
//! block to the next tier down (CPU -> SSD), and the last tier drops it. A block lives in at
//! most one offload tier. A hit refreshes the block's recency in the tier that holds it (the
//! copy stays there while the GPU holds it again, as vLLM's connectors keep theirs).
//!
//! Each store and removal is published with its tier's medium string (`CPU`, `STORAGE`) and
//! no token ids or parent, as the OffloadingConnector does.

use std::collections::HashMap;

use kvroute_core::event::{BlockRemoved, BlockStored, EngineHash, KvEvent};
use kvroute_core::keys::VllmDigest;

use crate::engine::lru::LruBlocks;

/// An offload tier below the GPU, fastest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OffloadTier {
    /// Host memory.
    Cpu,
    /// Local SSD.
    Ssd,
    /// The fleet's shared filesystem (see [`crate::engine::shared_fs`]); not held here.
    SharedFs,
}

impl OffloadTier {
    /// The engine's own tiers, fastest first.
    pub const LOCAL: [OffloadTier; 2] = [OffloadTier::Cpu, OffloadTier::Ssd];

    /// The medium string events carry for this tier.
    pub fn medium(self) -> &'static str {
        match self {
            OffloadTier::Cpu => "CPU",
            OffloadTier::Ssd => "STORAGE",
            OffloadTier::SharedFs => crate::engine::shared_fs::SHARED_FS_MEDIUM,
        }
    }
}

/// One tier: its capacity and its blocks by recency.
#[derive(Debug, Default)]
struct LruTier {
    capacity: usize,
    blocks: LruBlocks,
}

/// The CPU and SSD tiers of one engine.
#[derive(Debug, Default)]
pub struct OffloadTiers {
    tiers: [LruTier; 2],
    /// Blocks being loaded back to the GPU, with how many loads read each: never evicted
    /// meanwhile, as vLLM's offloading manager holds a reference on a block it loads.
    pinned: HashMap<VllmDigest, usize>,
}

fn stored(digest: &VllmDigest, tier: OffloadTier) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: vec![EngineHash(digest.event_u64())],
        medium: Some(tier.medium().into()),
        ..Default::default()
    })
}

fn removed(digest: &VllmDigest, tier: OffloadTier) -> KvEvent {
    KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: vec![EngineHash(digest.event_u64())],
        medium: Some(tier.medium().into()),
        group_idx: None,
    })
}

impl OffloadTiers {
    /// Tiers of `cpu_blocks` and `ssd_blocks` blocks (0: that tier is absent).
    pub fn new(cpu_blocks: usize, ssd_blocks: usize) -> Self {
        let mut tiers = Self::default();
        tiers.tier_mut(OffloadTier::Cpu).capacity = cpu_blocks;
        tiers.tier_mut(OffloadTier::Ssd).capacity = ssd_blocks;
        tiers
    }

    /// Blocks `tier` can hold.
    pub fn capacity(&self, tier: OffloadTier) -> usize {
        self.tiers.get(tier as usize).map_or(0, |t| t.capacity)
    }

    /// Blocks `tier` holds.
    pub fn len(&self, tier: OffloadTier) -> usize {
        self.tiers.get(tier as usize).map_or(0, |t| t.blocks.len())
    }

    /// Whether no tier holds a block.
    pub fn is_empty(&self) -> bool {
        self.tiers.iter().all(|t| t.blocks.len() == 0)
    }

    /// The tier holding `digest`, if any.
    pub fn find(&self, digest: &VllmDigest) -> Option<OffloadTier> {
        OffloadTier::LOCAL
            .into_iter()
            .find(|t| self.tiers[*t as usize].blocks.contains(digest))
    }

    /// `tier`'s blocks, least recently used first.
    pub fn lru_order(&self, tier: OffloadTier) -> Vec<VllmDigest> {
        self.tiers
            .get(tier as usize)
            .map_or_else(Vec::new, |t| t.blocks.oldest_first().copied().collect())
    }

    fn tier_mut(&mut self, tier: OffloadTier) -> &mut LruTier {
        &mut self.tiers[tier as usize]
    }

    /// Stores a block the GPU computed in the fastest tier that exists, demoting that tier's
    /// overflow downwards. The events describe every move. As vLLM's offloading manager
    /// publishes them, the room is made first: the evictions come before the new block's store
    /// (a tier's events never show it holding more than its capacity). A demoted block's store
    /// below comes before its removal above, so that it is never absent.
    pub fn offload(&mut self, digest: VllmDigest, events: &mut Vec<KvEvent>) {
        let Some(top) = OffloadTier::LOCAL
            .into_iter()
            .find(|t| self.capacity(*t) > 0)
        else {
            return;
        };
        if let Some(held) = self.find(&digest) {
            // Already offloaded (stored when computed before): refreshed, not stored again.
            self.tier_mut(held).blocks.touch(digest);
            return;
        }
        self.tier_mut(top).blocks.touch(digest);
        let mut room = Vec::new();
        self.spill(top, &mut room);
        if self.find(&digest) == Some(top) {
            events.append(&mut room);
            events.push(stored(&digest, top));
        } else {
            // Every other block is being loaded: the new one made room for nothing but itself.
            events.push(stored(&digest, top));
            events.append(&mut room);
        }
    }

    /// Moves `tier`'s least recently used blocks down while it is over capacity, passing over
    /// blocks being loaded: a tier whose every block is being loaded stays over capacity until
    /// the loads end.
    fn spill(&mut self, tier: OffloadTier, events: &mut Vec<KvEvent>) {
        while self.len(tier) > self.capacity(tier) {
            let pinned = &self.pinned;
            let Some(old) = self.tiers[tier as usize]
                .blocks
                .oldest_first()
                .find(|d| !pinned.contains_key(d))
                .copied()
            else {
                return;
            };
            self.tier_mut(tier).blocks.remove(&old);
            let below = OffloadTier::LOCAL
                .into_iter()
                .find(|t| *t > tier && self.capacity(*t) > 0);
            if let Some(below) = below {
                self.tier_mut(below).blocks.touch(old);
                events.push(stored(&old, below));
                events.push(removed(&old, tier));
                self.spill(below, events);
            } else {
                events.push(removed(&old, tier));
            }
        }
    }

    /// A load of `digest` back to the GPU starts: it is not evicted until [`Self::unpin`].
    pub fn pin(&mut self, digest: VllmDigest) {
        *self.pinned.entry(digest).or_default() += 1;
    }

    /// A load of `digest` ended (or was given up); no effect on a block no load pinned.
    pub fn unpin(&mut self, digest: &VllmDigest) {
        if let Some(loads) = self.pinned.get_mut(digest) {
            *loads -= 1;
            if *loads == 0 {
                self.pinned.remove(digest);
            }
        }
    }

    /// Records a hit on `digest` (loaded back to the GPU): refreshes its recency where it is.
    pub fn touch(&mut self, digest: VllmDigest) {
        if let Some(tier) = self.find(&digest) {
            self.tier_mut(tier).blocks.touch(digest);
        }
    }

    /// Drops every block (a prefix-cache reset).
    pub fn clear(&mut self) {
        for tier in &mut self.tiers {
            tier.blocks.clear();
        }
    }
}

#[cfg(test)]
mod tests;
