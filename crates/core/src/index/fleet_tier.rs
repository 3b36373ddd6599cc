//! The fleet-wide shared tier: blocks on a filesystem (or object store) that several endpoints
//! mount, so that a block one engine wrote there is a (slower) hit on every endpoint mounting it.
//!
//! Blocks are kept per mount by router key, reference-counted (vLLM documents that offloading
//! consumers must count repeated stores and removes of one hash). Endpoints join a mount by
//! configuration (or discovery); a lookup adds, for each block, the slots of every endpoint
//! mounting a mount that holds it.
//!
//! The tier is bounded: at `capacity` blocks it drops the blocks stored longest ago (the order
//! of stores, re-stores refreshing it), counted as evictions. Connectors that never publish
//! removals (LMCache) are bounded that way too.
//!
//! A sharded index ([`super::SharedIndex`]) has one tier for all its shards, behind its own lock
//! (see [`SharedFleetTier`]): an endpoint's slot is a slot of its shard, so the tier records
//! (shard, slot) pairs, and a shard's lookup asks only for its own slots.

use std::collections::VecDeque;

use std::sync::Arc;

use hashbrown::HashMap;
use parking_lot::RwLock;

use super::holders::WORD_BITS;
use crate::keys::RouterKey;

/// A mount's number in the tier.
pub(crate) type MountId = u16;

/// Counters of the shared tier, for operators and tests.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct SharedTierStats {
    /// Blocks held now, over every mount.
    pub blocks: u64,
    /// Mounts known (named by at least one endpoint's configuration).
    pub mounts: u64,
    /// Stores applied (repeats included).
    pub stored: u64,
    /// Removals applied.
    pub removed: u64,
    /// Blocks dropped by the capacity bound.
    pub capacity_evictions: u64,
}

/// One block on the shared tier: which mounts hold it, with their reference counts, and when it
/// was last stored (for the bound).
#[derive(Clone, Debug, Default)]
struct SharedBlock {
    refs: Vec<(MountId, u32)>,
    stamp: u64,
}

/// The shared tier of one index, shared by its shards.
pub(crate) type SharedFleetTier = Arc<RwLock<FleetTier>>;

/// The shared tier of one index.
#[derive(Debug, Default)]
pub(crate) struct FleetTier {
    names: Vec<String>,
    /// Per mount, the (shard, endpoint slot) pairs mounting it.
    slots: Vec<Vec<(u32, u32)>>,
    /// Most blocks held (the index's capacity).
    capacity: usize,
    blocks: HashMap<u64, SharedBlock>,
    /// (key, stamp) in store order; entries whose stamp is stale are skipped.
    order: VecDeque<(u64, u64)>,
    clock: u64,
    pub(crate) stats: SharedTierStats,
}

impl FleetTier {
    /// An empty tier holding at most `capacity` blocks, for the shards to share.
    pub(crate) fn shared(capacity: usize) -> SharedFleetTier {
        Arc::new(RwLock::new(Self {
            capacity,
            ..Self::default()
        }))
    }

    /// The mount named `name`, created if new.
    pub(crate) fn mount(&mut self, name: &str) -> MountId {
        if let Some(i) = self.names.iter().position(|n| n == name) {
            return i as MountId;
        }
        self.names.push(name.to_owned());
        self.slots.push(Vec::new());
        self.stats.mounts = self.names.len() as u64;
        (self.names.len() - 1) as MountId
    }

    /// Makes `slot` of `shard` mount exactly `mount` (or nothing).
    pub(crate) fn set_slot(&mut self, shard: u32, slot: u32, mount: Option<MountId>) {
        for (i, slots) in self.slots.iter_mut().enumerate() {
            slots.retain(|&s| s != (shard, slot));
            if mount == Some(i as MountId) {
                slots.push((shard, slot));
            }
        }
    }

    /// Whether no block is held (lookups then skip the tier).
    pub(crate) fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// One more reference to `key` on `mount`; keeps the tier within its capacity.
    pub(crate) fn store(&mut self, mount: MountId, key: RouterKey) {
        let capacity = self.capacity;
        self.clock += 1;
        let block = self.blocks.entry(key.0).or_default();
        block.stamp = self.clock;
        match block.refs.iter_mut().find(|(m, _)| *m == mount) {
            Some((_, n)) => *n += 1,
            None => block.refs.push((mount, 1)),
        }
        self.order.push_back((key.0, self.clock));
        self.stats.stored += 1;
        while self.blocks.len() > capacity.max(1) {
            let Some((old, stamp)) = self.order.pop_front() else {
                break;
            };
            if self.blocks.get(&old).is_some_and(|b| b.stamp == stamp) {
                self.blocks.remove(&old);
                self.stats.capacity_evictions += 1;
            }
        }
        // Re-stores leave stale entries behind; compact once they outnumber the live ones.
        if self.order.len() > 2 * self.blocks.len() + 64 {
            let blocks = &self.blocks;
            self.order
                .retain(|(k, s)| blocks.get(k).is_some_and(|b| b.stamp == *s));
        }
        self.stats.blocks = self.blocks.len() as u64;
    }

    /// One reference fewer to `key` on `mount`; returns whether there was one, and whether the
    /// mount still holds the block.
    pub(crate) fn remove(&mut self, mount: MountId, key: RouterKey) -> (bool, bool) {
        let Some(block) = self.blocks.get_mut(&key.0) else {
            return (false, false);
        };
        let Some(at) = block.refs.iter().position(|(m, _)| *m == mount) else {
            return (false, false);
        };
        block.refs[at].1 -= 1;
        let left = block.refs[at].1 > 0;
        if !left {
            block.refs.swap_remove(at);
        }
        if block.refs.is_empty() {
            self.blocks.remove(&key.0);
        }
        self.stats.removed += 1;
        self.stats.blocks = self.blocks.len() as u64;
        (true, left)
    }

    /// Whether `mount` holds `key`.
    pub(crate) fn holds(&self, mount: MountId, key: RouterKey) -> bool {
        self.blocks
            .get(&key.0)
            .is_some_and(|b| b.refs.iter().any(|(m, _)| *m == mount))
    }

    /// Sets in `words` (one bit per endpoint slot of `shard`) every slot that mounts a mount
    /// holding `key`; returns whether any was set.
    pub(crate) fn slots_holding(&self, shard: u32, key: RouterKey, words: &mut [u64]) -> bool {
        words.fill(0);
        let Some(block) = self.blocks.get(&key.0) else {
            return false;
        };
        let mut any = false;
        for &(mount, _) in &block.refs {
            for &(_, slot) in self.slots[mount as usize]
                .iter()
                .filter(|(s, _)| *s == shard)
            {
                if let Some(w) = words.get_mut(slot as usize / WORD_BITS) {
                    *w |= 1 << (slot as usize % WORD_BITS);
                    any = true;
                }
            }
        }
        any
    }

    /// Heap bytes of the tier's tables (approximate: hash-table overhead not counted).
    pub(crate) fn heap_bytes(&self) -> usize {
        self.blocks.capacity() * (8 + std::mem::size_of::<SharedBlock>())
            + self
                .blocks
                .values()
                .map(|b| b.refs.capacity() * 8)
                .sum::<usize>()
            + self.order.capacity() * 16
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tier_keeps_the_most_recently_stored_blocks_within_its_capacity() {
        let mut tier = FleetTier {
            capacity: 4,
            ..FleetTier::default()
        };
        let m = tier.mount("lustre");
        for k in 1..=4 {
            tier.store(m, RouterKey(k));
        }
        // Block 1 is stored again: block 2 is now the oldest.
        tier.store(m, RouterKey(1));
        tier.store(m, RouterKey(5));
        assert!(tier.holds(m, RouterKey(1)));
        assert!(!tier.holds(m, RouterKey(2)));
        assert_eq!((tier.stats.blocks, tier.stats.capacity_evictions), (4, 1));
        // Many re-stores leave the order queue bounded.
        for _ in 0..1000 {
            tier.store(m, RouterKey(3));
        }
        assert!(tier.order.len() <= 2 * 4 + 64 + 1);
        // Reference counts: block 3 was stored 1,001 times.
        assert_eq!(tier.remove(m, RouterKey(3)), (true, true));
    }
}
