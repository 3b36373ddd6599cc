//! The blocks an endpoint's recent requests used, in the order vLLM's cache will evict them.
//!
//! vLLM evicts the cached blocks used longest ago first and never one a running request
//! references. What decides whether a prompt's cached prefix survives the queue ahead is how
//! many **distinct** blocks were used after it (a tenant's context that every question reuses
//! is counted once, however many questions used it), which this counts from the key chains of
//! the router's in-flight requests ([`PinnedBlocks`]) and of the last requests that ended
//! there, kept here.
//!
//! Keys chain their parents, so the distinct blocks of a set of chains kept in lexicographic
//! order is the sum of their lengths less what each shares with its neighbours in that order:
//! a prompt's prefix is split into parts by the newest request that used each, with no set of
//! keys. How many distinct blocks each ended request adds to that count does not depend on the
//! prompt: the longest prefix it shares with a newer ended request is raised as each one ends
//! (one comparison per kept request), the in-flight chains are compared once per request sent
//! or ended in flight, and the result is kept, so that costing every endpoint for every request
//! reads it, rather than walking every endpoint's chains again (measured: 404 µs a decision on
//! 64 endpoints walking them, docs/benchmarks.md).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};

use super::block_reuse::{DEPTH_BUCKETS, depth_bucket};
use super::pinned::{PinnedAt, PinnedBlocks, common_prefix, longest_shared};
use crate::keys::RouterKey;
use crate::schedule::{RecencyPart, RecencyParts};

/// Ended requests kept per endpoint.
const ENDED_KEPT: usize = 128;

/// Keys kept per endpoint over those requests (512K tokens at 16 tokens a block), the newest
/// request's always: the memory the recency costs is bounded by this and one prompt.
const KEYS_KEPT: usize = 32_768;

/// The key chains of the last requests that ended on one endpoint, oldest first.
#[derive(Clone, Debug, Default)]
pub(super) struct RecentUse {
    ended: VecDeque<Arc<Vec<RouterKey>>>,
    /// When each of `ended` ended, in the same order.
    ended_at: VecDeque<f64>,
    /// The longest prefix each of `ended` shares with a newer one, in the same order: raised as
    /// each newer one ends, so the ended chains are never walked again.
    shared_with_newer: VecDeque<u32>,
    /// Keys over `ended`, counted with repeats.
    keys: usize,
    /// The longest chain of `ended` (0 when none).
    longest: usize,
    /// What each ended request adds to the distinct blocks newer than the older ones, for the
    /// in-flight chains of one generation ([`RecentUse::added`]).
    added: AddedCache,
}

/// When a request queued on an endpoint now is expected to be admitted there, for
/// [`RecentUse::parts`].
#[derive(Clone, Copy, Debug)]
pub(super) struct Admission {
    /// The time it is admitted: the plan's time plus its wait for the prefills queued ahead
    /// or for room in the cache.
    pub at: f64,
    /// The decode time to expect where the endpoint has none of its own yet.
    pub fallback_decode_s: Option<f64>,
}

/// [`RecentUse::added`]'s figures for one generation of the in-flight chains, kept between
/// plans: per ended request, newest first, the distinct blocks it adds to those newer than it.
/// Cleared whenever `ended` changes.
#[derive(Debug, Default)]
struct AddedCache(Mutex<Option<(u64, Arc<Added>)>>);

/// [`AddedCache`]'s figures.
#[derive(Debug)]
struct Added {
    /// Per ended request, newest first.
    per_request: Vec<u32>,
    /// Their sum: the distinct blocks of every ended request beyond the in-flight ones.
    total: usize,
}

impl Clone for AddedCache {
    /// A copy computes its figures again when first asked.
    fn clone(&self) -> Self {
        Self::default()
    }
}

impl AddedCache {
    fn clear(&mut self) {
        *self.0.get_mut().unwrap_or_else(PoisonError::into_inner) = None;
    }
}

impl RecentUse {
    /// A request that used `keys` ended at `now` (its blocks are now the newest unpinned ones).
    pub(super) fn ended(&mut self, keys: Arc<Vec<RouterKey>>, now: f64) {
        if keys.is_empty() {
            return;
        }
        self.added.clear();
        for (chain, shared) in self.ended.iter().zip(&mut self.shared_with_newer) {
            *shared = (*shared).max(as_u32(common_prefix(chain, &keys)));
        }
        self.keys += keys.len();
        self.longest = self.longest.max(keys.len());
        self.ended.push_back(keys);
        self.ended_at.push_back(now);
        self.shared_with_newer.push_back(0);
        let mut dropped_longest = false;
        while self.ended.len() > 1 && (self.ended.len() > ENDED_KEPT || self.keys > KEYS_KEPT) {
            let Some(old) = self.ended.pop_front() else {
                break;
            };
            self.ended_at.pop_front();
            self.shared_with_newer.pop_front();
            self.keys -= old.len();
            dropped_longest |= old.len() == self.longest;
        }
        if dropped_longest {
            self.longest = self
                .ended
                .iter()
                .map(|chain| chain.len())
                .max()
                .unwrap_or(0);
        }
    }

    /// Requests per second like the recent ones here that would not fit in a cache of
    /// `capacity` blocks beside a request of `blocks` blocks whose full blocks have `keys`:
    /// the kept requests' rate (one fewer than were kept, over the time since the oldest
    /// ended) times the share of them that would not fit (each needs its blocks and one more
    /// for its last tokens and output, less the prefix it shares with the request). 0 while
    /// fewer than two are kept, and at once when even the longest kept fits beside it.
    pub(super) fn not_fitting_per_s(
        &self,
        keys: &[RouterKey],
        blocks: usize,
        capacity: usize,
        now: f64,
    ) -> f64 {
        let (Some(&oldest), n) = (self.ended_at.front(), self.ended.len()) else {
            return 0.0;
        };
        let span = now - oldest;
        if n < 2 || span <= 0.0 {
            return 0.0;
        }
        if blocks + self.longest < capacity {
            return 0.0;
        }
        let not_fitting = self
            .ended
            .iter()
            .filter(|chain| blocks + chain.len() + 1 - common_prefix(chain, keys) > capacity)
            .count();
        (n - 1) as f64 / span * not_fitting as f64 / n as f64
    }

    /// Ended requests kept.
    #[cfg(test)]
    pub(super) fn ended_count(&self) -> usize {
        self.ended.len()
    }

    /// Forgets every ended request (the engine restarted: its cache is empty).
    pub(super) fn clear(&mut self) {
        self.ended.clear();
        self.ended_at.clear();
        self.shared_with_newer.clear();
        self.keys = 0;
        self.longest = 0;
        self.added.clear();
    }

    /// The first `held` blocks of a prompt with `keys` (cached there) split by last use, for
    /// each cache `(capacity, overflows)` of `caches` that can lose something (see
    /// [`Self::can_lose`]); `None` for the others. The split itself does not depend on the cache,
    /// so it is walked once: the prefix `pinned` pins, then a part per ended request that used
    /// more of it than every newer one, newest first, each with the distinct blocks newer than
    /// it (the in-flight requests' keys, the queue ahead's included; the newer ended requests';
    /// and the blocks running requests pin beyond their prompts).
    ///
    /// The prefix the in-flight requests pin is never lost only as far as a request still
    /// running when this one is admitted (`admission`) pins it; what only requests ending
    /// first pin is a part of its own, the newest, freed with their other blocks (which go
    /// first).
    pub(super) fn parts_for<const N: usize>(
        &self,
        pinned: &PinnedBlocks,
        keys: &[RouterKey],
        held: usize,
        caches: [Option<(usize, bool)>; N],
        admission: &Admission,
    ) -> [Option<RecencyParts>; N] {
        let keys = &keys[..held.min(keys.len())];
        let lose = caches.map(|cache| {
            cache.is_some_and(|(capacity, overflows)| {
                self.can_lose(pinned, keys.len(), capacity, overflows)
            })
        });
        if !lose.contains(&true) {
            return [None; N];
        }
        let newer = pinned.distinct_keys() + pinned.extra_blocks();
        let at = pinned.pinned_at(keys, admission.at, admission.fallback_decode_s);
        let split = self.split(pinned, keys, newer, at).0;
        lose.map(|lose| lose.then_some(split))
    }

    /// [`Self::parts_for`] one cache of `capacity` blocks.
    #[cfg(test)]
    pub(super) fn parts(
        &self,
        pinned: &PinnedBlocks,
        keys: &[RouterKey],
        held: usize,
        capacity: usize,
        overflows: bool,
        admission: &Admission,
    ) -> Option<RecencyParts> {
        let [parts] = self.parts_for(pinned, keys, held, [Some((capacity, overflows))], admission);
        parts
    }

    /// Whether a cache of `capacity` blocks can lose any of `held` blocks of a prompt before it
    /// is admitted: not when the queue ahead fits in its free blocks (`!overflows`) and the
    /// prompt's held blocks, every distinct key in flight or kept and the pinned extra blocks
    /// fit in it together (a block of unknown age then survives too, the queue ahead evicting
    /// nothing).
    fn can_lose(
        &self,
        pinned: &PinnedBlocks,
        held: usize,
        capacity: usize,
        overflows: bool,
    ) -> bool {
        let newer = pinned.distinct_keys() + pinned.extra_blocks();
        if overflows || held + newer + self.keys > capacity {
            // The same bound with the distinct blocks, where requests share what they use (one
            // context under many questions), read from the kept walk.
            return overflows || held + newer + self.added(pinned).total > capacity;
        }
        false
    }

    /// Blocks of the first `held` of a prompt with `keys` found cached there, by depth bucket
    /// in the eviction order of a cache of `capacity` blocks (what [`super::block_reuse`]
    /// counts): the prefix the in-flight requests pin at the top; each part last used by an
    /// ended request from the distinct blocks newer than it on, one block deeper per block;
    /// what no kept request used (older than all of them) spread evenly from the newest depth
    /// it can be at to the end of the cache.
    pub(super) fn hit_depths(
        &self,
        pinned: &PinnedBlocks,
        keys: &[RouterKey],
        held: usize,
        capacity: usize,
    ) -> [f64; DEPTH_BUCKETS] {
        let mut by_depth = [0.0; DEPTH_BUCKETS];
        let keys = &keys[..held.min(keys.len())];
        if keys.is_empty() {
            return by_depth;
        }
        let cap = capacity as f64;
        let (parts, newer, covered) = self.split(
            pinned,
            keys,
            pinned.distinct_keys() + pinned.extra_blocks(),
            PinnedAt::every_pin_holds(pinned.pinned_prefix(keys)),
        );
        by_depth[0] += f64::from(parts.pinned);
        for part in parts.parts() {
            // Its first block is its newest: an ending request frees its blocks last first.
            add_span(
                &mut by_depth,
                f64::from(part.newer),
                f64::from(part.to - part.from),
                cap,
            );
        }
        let older = keys.len().saturating_sub(covered) as f64;
        if older > 0.0 {
            let first = depth_bucket(newer as f64, cap);
            let spread = (DEPTH_BUCKETS - first) as f64;
            for count in &mut by_depth[first..] {
                *count += older / spread;
            }
        }
        by_depth
    }

    /// `keys` split by last use (see [`Self::parts`]), starting from `newer` distinct blocks
    /// newer than every ended request (the in-flight ones'), with the distinct blocks newer
    /// than anything past the walk and the blocks the parts cover. `at`: the prefix the
    /// in-flight requests pin, and how much of it they still pin when the request is admitted.
    fn split(
        &self,
        pinned: &PinnedBlocks,
        keys: &[RouterKey],
        mut newer: usize,
        at: PinnedAt,
    ) -> (RecencyParts, usize, usize) {
        let mut covered = at.held.min(keys.len());
        let mut parts = RecencyParts::new(as_u32(covered));
        let freed = at.pinned.min(keys.len());
        if freed > covered {
            // Freed when the requests pinning it end: the newest part, with the blocks of the
            // requests ending later newer than it.
            let part = RecencyPart {
                from: as_u32(covered),
                to: as_u32(freed),
                newer: as_u32(at.newer_than_freed),
            };
            parts.push(part);
            covered = freed;
        }
        let added = self.added(pinned);
        for (chain, &adds) in self.ended.iter().rev().zip(&added.per_request) {
            if covered >= keys.len() {
                break;
            }
            let shared = common_prefix(chain, keys);
            if shared > covered {
                let part = RecencyPart {
                    from: as_u32(covered),
                    to: as_u32(shared),
                    newer: as_u32(newer),
                };
                if !parts.push(part) {
                    break;
                }
                covered = shared;
            }
            newer += adds as usize;
        }
        (parts, newer, covered)
    }

    /// Per ended request, newest first, the distinct blocks it adds to those newer than it,
    /// with the in-flight chains `pinned` holds: its keys past the longest prefix it shares
    /// with an in-flight chain or a newer ended one. Read from the cache while neither changed.
    fn added(&self, pinned: &PinnedBlocks) -> Arc<Added> {
        let mut cache = self.added.0.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((generation, added)) = cache.as_ref()
            && *generation == pinned.generation()
        {
            return added.clone();
        }
        let per_request: Vec<u32> = self
            .ended
            .iter()
            .rev()
            .zip(self.shared_with_newer.iter().rev())
            .map(|(chain, &shared)| {
                let seen = (shared as usize).max(longest_shared(pinned.chains(), chain));
                as_u32(chain.len() - seen)
            })
            .collect();
        let total = per_request.iter().map(|&n| n as usize).sum();
        let added = Arc::new(Added { per_request, total });
        *cache = Some((pinned.generation(), added.clone()));
        added
    }
}

/// Adds `len` blocks at depths `from` to `from + len` (one each) to `by_depth`, buckets of a
/// cache of `capacity` blocks.
fn add_span(by_depth: &mut [f64; DEPTH_BUCKETS], from: f64, len: f64, capacity: f64) {
    let width = capacity / DEPTH_BUCKETS as f64;
    if !width.is_finite() || width <= 0.0 {
        by_depth[0] += len;
        return;
    }
    let end = from + len;
    for (b, count) in by_depth.iter_mut().enumerate() {
        let lo = b as f64 * width;
        let hi = if b == DEPTH_BUCKETS - 1 {
            f64::INFINITY
        } else {
            lo + width
        };
        let overlap = end.min(hi) - from.max(lo);
        if overlap > 0.0 {
            *count += overlap;
        }
    }
}

fn as_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests;
