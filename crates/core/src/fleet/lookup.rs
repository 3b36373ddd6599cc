//! A plan's index lookup, read before the fleet is locked.
//!
//! The walk of a request's blocks through the KV index is most of a decision's work on a long
//! prompt, and the index has locks of its own (one per shard). A caller that keeps the fleet
//! behind a lock takes a [`LookupTarget`] under it (cheap), walks the index after releasing it
//! ([`LookupTarget::run`]), and plans with the result ([`Fleet::plan_with`]): decisions then
//! hold the fleet's lock only for their costing, and several of them walk the index at once.
//!
//! A lookup is a moment older than the plan that uses it, as if the request had arrived a
//! moment earlier: KV events applied in between are missed for that one decision. What must
//! never be used is a picture of a cache the fleet has since dropped (an endpoint forgotten,
//! restored, or its id given to another): the fleet counts such changes, and a plan whose
//! lookup was read before one walks the index again under the lock.
//!
//! The target itself needs no lock either: [`LookupTargets`], shared with the caller, holds the
//! indexes by block size and the count of dropped pictures. The fleet bumps the count after it
//! changed an index (under the change's own locks), and a target reads the count before its
//! walk: a walk that may have seen an index before a change carries the count from before it,
//! and is refused.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::RwLock;

use super::Fleet;
use crate::index::{PrefixMatches, SharedIndex};
use crate::keys::RouterKey;

/// The fleet's indexes and its count of dropped cache pictures, readable without the fleet's
/// lock ([`Fleet::lookup_targets`]).
#[derive(Debug, Default)]
pub struct LookupTargets {
    /// Cache pictures dropped so far (see the module documentation).
    epoch: AtomicU64,
    /// One index per block size in use (they are only ever added).
    indexes: RwLock<Vec<(usize, Arc<SharedIndex>)>>,
}

impl LookupTargets {
    /// What a lookup of a request of `block_size` needs, read now.
    pub fn target(&self, block_size: usize) -> LookupTarget {
        let block_size = block_size.max(1);
        // Before the index is walked: a change after this read makes the walk stale.
        let epoch = self.epoch.load(Ordering::Acquire);
        let index = self
            .indexes
            .read()
            .iter()
            .find(|(bs, _)| *bs == block_size)
            .map(|(_, index)| index.clone());
        LookupTarget {
            index,
            block_size,
            epoch,
        }
    }

    fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// Records that `indexes` are the fleet's now.
    pub(super) fn set_indexes(&self, indexes: &[(usize, Arc<SharedIndex>)]) {
        *self.indexes.write() = indexes.to_vec();
    }
}

/// What a request's index lookup needs, taken from the fleet under its lock.
#[derive(Clone, Debug)]
pub struct LookupTarget {
    index: Option<Arc<SharedIndex>>,
    block_size: usize,
    epoch: u64,
}

/// A request's index matches, read outside the fleet's lock, for [`Fleet::plan_with`].
#[derive(Clone, Debug)]
pub struct IndexLookup {
    pub(super) matches: PrefixMatches,
    block_size: usize,
    epoch: u64,
}

impl LookupTarget {
    /// Walks the index for `keys` (no fleet lock needed).
    pub fn run(&self, keys: &[RouterKey]) -> IndexLookup {
        IndexLookup {
            matches: self
                .index
                .as_ref()
                .map_or_else(PrefixMatches::default, |index| index.lookup(keys)),
            block_size: self.block_size,
            epoch: self.epoch,
        }
    }
}

impl Fleet {
    /// What a lookup of a request of `block_size` needs (see the module documentation).
    pub fn lookup_target(&self, block_size: usize) -> LookupTarget {
        self.targets.target(block_size)
    }

    /// The fleet's lookup targets, to read without its lock.
    pub fn lookup_targets(&self) -> Arc<LookupTargets> {
        self.targets.clone()
    }

    /// `lookup`, if it can stand for a lookup under the lock now: read for this block size,
    /// and since then no endpoint's cache picture was dropped.
    pub(super) fn usable_lookup(
        &self,
        lookup: Option<IndexLookup>,
        block_size: usize,
    ) -> Option<PrefixMatches> {
        let epoch = self.targets.epoch();
        lookup
            .filter(|l| l.block_size == block_size && l.epoch == epoch)
            .map(|l| l.matches)
    }

    /// An endpoint's cache picture was dropped or replaced (call once the index changed):
    /// lookups read before now are not used.
    pub(super) fn cache_dropped(&mut self) {
        self.targets.epoch.fetch_add(1, Ordering::Release);
    }
}
