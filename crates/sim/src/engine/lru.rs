//! Blocks by recency, least recently used first: the order an offload tier (CPU, SSD, a shared
//! filesystem) evicts in.

use std::collections::{BTreeMap, HashMap};

use kvroute_core::keys::VllmDigest;

/// A set of blocks ordered by last use.
#[derive(Debug, Default)]
pub(crate) struct LruBlocks {
    by_digest: HashMap<VllmDigest, u64>,
    lru: BTreeMap<u64, VllmDigest>,
    stamp: u64,
}

impl LruBlocks {
    /// Inserts or refreshes `digest`; true when it was not held before.
    pub(crate) fn touch(&mut self, digest: VllmDigest) -> bool {
        let new = match self.by_digest.insert(digest, self.stamp) {
            Some(old) => {
                self.lru.remove(&old);
                false
            }
            None => true,
        };
        self.lru.insert(self.stamp, digest);
        self.stamp += 1;
        new
    }

    /// Removes and returns the least recently used block.
    pub(crate) fn pop_oldest(&mut self) -> Option<VllmDigest> {
        let (_, digest) = self.lru.pop_first()?;
        self.by_digest.remove(&digest);
        Some(digest)
    }

    /// Removes `digest`; true when it was held.
    pub(crate) fn remove(&mut self, digest: &VllmDigest) -> bool {
        let Some(stamp) = self.by_digest.remove(digest) else {
            return false;
        };
        self.lru.remove(&stamp);
        true
    }

    /// Whether it holds `digest`.
    pub(crate) fn contains(&self, digest: &VllmDigest) -> bool {
        self.by_digest.contains_key(digest)
    }

    /// Blocks held.
    pub(crate) fn len(&self) -> usize {
        self.by_digest.len()
    }

    /// The blocks, least recently used first.
    pub(crate) fn oldest_first(&self) -> impl Iterator<Item = &VllmDigest> {
        self.lru.values()
    }

    /// Drops every block.
    pub(crate) fn clear(&mut self) {
        self.by_digest.clear();
        self.lru.clear();
    }
}
