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

use std::sync::Arc;

use super::Fleet;
use crate::index::{PrefixMatches, SharedIndex};
use crate::keys::RouterKey;

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
        let block_size = block_size.max(1);
        LookupTarget {
            index: self.index_for_block_size(block_size).cloned(),
            block_size,
            epoch: self.cache_epoch,
        }
    }

    /// `lookup`, if it can stand for a lookup under the lock now: read for this block size,
    /// and since then no endpoint's cache picture was dropped.
    pub(super) fn usable_lookup(
        &self,
        lookup: Option<IndexLookup>,
        block_size: usize,
    ) -> Option<PrefixMatches> {
        lookup
            .filter(|l| l.block_size == block_size && l.epoch == self.cache_epoch)
            .map(|l| l.matches)
    }

    /// An endpoint's cache picture was dropped or replaced: lookups read before now are not
    /// used.
    pub(super) fn cache_dropped(&mut self) {
        self.cache_epoch = self.cache_epoch.wrapping_add(1);
    }
}
