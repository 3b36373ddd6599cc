//! How often the blocks an endpoint caches are used again, and how deep in its eviction order
//! its requests find them.
//!
//! Counted per request at dispatch: the blocks it is expected to find cached and the blocks it
//! stores (what the eviction cost reads), and where in the cache's eviction order (least
//! recently used last) it finds the cached ones. The depths say how much of the cache its
//! requests come back for; what lies deeper is room a copy of a shared prefix may take
//! without evicting anything they reuse ([`crate::schedule::amortize`]).

/// Time constant of the recent block reuse an endpoint's eviction cost reads, seconds: long
/// enough to span many requests and a conversation's think times, short enough to follow a
/// change of workload within a minute or two.
pub const REUSE_TAU_S: f64 = 60.0;

/// Depth buckets: each a sixteenth of the cache's capacity.
pub(super) const DEPTH_BUCKETS: usize = 16;

/// Share of an endpoint's hits the room past them may hold: its requests find 99% of their
/// cached blocks above that depth (the tail the latency targets read is the same 1%). Chosen,
/// not fitted: 0.999 routes identically on the scheduler matrix and the P/D sweep; 0.95 lets
/// copies into room that hits still use and loses a matrix cell (docs/benchmarks.md).
const HIT_DEPTH_QUANTILE: f64 = 0.99;

/// The depth bucket of a block with `newer` distinct blocks used after it, in a cache of
/// `capacity` blocks.
pub(super) fn depth_bucket(newer: f64, capacity: f64) -> usize {
    if capacity.is_nan() || newer.is_nan() || capacity <= 0.0 || newer <= 0.0 {
        return 0;
    }
    ((newer / capacity * DEPTH_BUCKETS as f64) as usize).min(DEPTH_BUCKETS - 1)
}

/// Blocks an endpoint's (or a model group's) requests found cached, and blocks they stored,
/// both decayed with [`REUSE_TAU_S`]; and the cached ones by depth.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct BlockReuse {
    hits: f64,
    stored: f64,
    requests: f64,
    hits_by_depth: [f64; DEPTH_BUCKETS],
    at: f64,
}

impl BlockReuse {
    fn decayed(&self, now: f64) -> f64 {
        (-(now - self.at).max(0.0) / REUSE_TAU_S).exp()
    }

    /// A request found `hits` blocks cached and stored `stored` new ones at `now`.
    pub(super) fn note(&mut self, hits: f64, stored: f64, now: f64) {
        let d = self.decayed(now);
        self.hits = self.hits * d + hits;
        self.stored = self.stored * d + stored;
        self.requests = self.requests * d + 1.0;
        for count in &mut self.hits_by_depth {
            *count *= d;
        }
        self.at = now;
    }

    /// The blocks the request [`Self::note`] just counted were found at these depth buckets.
    pub(super) fn note_depths(&mut self, by_depth: &[f64; DEPTH_BUCKETS]) {
        for (count, hits) in self.hits_by_depth.iter_mut().zip(by_depth) {
            *count += hits.max(0.0);
        }
    }

    /// Share of the cache past the depth above which its requests find
    /// [`HIT_DEPTH_QUANTILE`] of their cached blocks, 0–1 (0 before any hit is counted: no
    /// room is known to be free of reuse).
    pub(super) fn cold_share(&self) -> f64 {
        let total: f64 = self.hits_by_depth.iter().sum();
        if total.is_nan() || total <= 0.0 {
            return 0.0;
        }
        let mut deeper = 0.0;
        for b in (0..DEPTH_BUCKETS).rev() {
            deeper += self.hits_by_depth[b];
            if deeper > (1.0 - HIT_DEPTH_QUANTILE) * total {
                return (DEPTH_BUCKETS - 1 - b) as f64 / DEPTH_BUCKETS as f64;
            }
        }
        0.0
    }

    /// Blocks stored per request, recently (`None` before the first request).
    pub(super) fn stored_per_request(&self) -> Option<f64> {
        (self.requests > 0.0).then(|| self.stored / self.requests)
    }

    /// Expected reuses of a block the cache evicts, 0–1: blocks found cached per block stored
    /// (how often a stored block was reused before its eviction), capped at one re-prefill.
    pub(super) fn per_evicted_block(&self) -> f64 {
        if self.hits <= 0.0 {
            0.0
        } else {
            (self.hits / self.stored.max(f64::MIN_POSITIVE)).min(1.0)
        }
    }

    /// [`Self::per_evicted_block`] of an endpoint with `capacity` GPU blocks, shrunk toward
    /// `prior` (the fleet's, for the request's model) by a cache's worth of blocks, as of `now`:
    /// `(hits + capacity × prior) / (stored + capacity)`, both counts decayed over
    /// [`REUSE_TAU_S`]. Until an endpoint has stored about its capacity, nothing it stored has
    /// had to be evicted, so its own hits per stored block do not yet say how often a block is
    /// reused before eviction (a new tenant's first question finds nothing, however often its
    /// context will be reused); once it has stored several caches' worth recently, its own
    /// measure stands. An endpoint that stores less than a cache's worth per [`REUSE_TAU_S`]
    /// leans on the fleet's figure for as long: its own rests on too few evictions. Unknown
    /// capacity: its own measure.
    pub(super) fn per_evicted_block_toward(
        &self,
        prior: f64,
        capacity: Option<usize>,
        now: f64,
    ) -> f64 {
        let Some(capacity) = capacity.filter(|c| *c > 0) else {
            return self.per_evicted_block();
        };
        let d = self.decayed(now);
        let weight = capacity as f64;
        let prior = if prior.is_finite() {
            prior.clamp(0.0, 1.0)
        } else {
            0.0
        };
        let shrunk = (self.hits * d + weight * prior) / (self.stored * d + weight);
        shrunk.clamp(0.0, 1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_hits_at(buckets: &[(usize, f64)]) -> BlockReuse {
        let mut reuse = BlockReuse::default();
        let mut by_depth = [0.0; DEPTH_BUCKETS];
        for &(b, hits) in buckets {
            by_depth[b] = hits;
        }
        reuse.note(by_depth.iter().sum(), 10.0, 0.0);
        reuse.note_depths(&by_depth);
        reuse
    }

    #[test]
    fn the_room_past_where_hits_are_found_is_cold() {
        // A hot context found at the top, nothing deeper than a quarter of the cache.
        let reuse = with_hits_at(&[(0, 900.0), (3, 100.0)]);
        assert!((reuse.cold_share() - 12.0 / 16.0).abs() < 1e-12);
        // A hit now and then at the very end leaves no cold room.
        let reuse = with_hits_at(&[(0, 900.0), (DEPTH_BUCKETS - 1, 20.0)]);
        assert_eq!(reuse.cold_share(), 0.0);
        // One stray hit in a thousand does not.
        let reuse = with_hits_at(&[(0, 999.0), (DEPTH_BUCKETS - 1, 1.0)]);
        assert!((reuse.cold_share() - 15.0 / 16.0).abs() < 1e-12);
        assert_eq!(BlockReuse::default().cold_share(), 0.0);
    }

    #[test]
    fn depth_counts_age_with_the_reuse_counts() {
        let mut reuse = with_hits_at(&[(DEPTH_BUCKETS - 1, 100.0)]);
        assert_eq!(reuse.cold_share(), 0.0);
        // Minutes later the deep hits have faded against fresh ones at the top.
        reuse.note(1_000.0, 0.0, 10.0 * REUSE_TAU_S);
        let mut top = [0.0; DEPTH_BUCKETS];
        top[0] = 1_000.0;
        reuse.note_depths(&top);
        assert!((reuse.cold_share() - 15.0 / 16.0).abs() < 1e-12);
    }

    #[test]
    fn depth_buckets_are_shares_of_the_capacity() {
        assert_eq!(depth_bucket(0.0, 1_600.0), 0);
        assert_eq!(depth_bucket(99.0, 1_600.0), 0);
        assert_eq!(depth_bucket(100.0, 1_600.0), 1);
        assert_eq!(depth_bucket(5_000.0, 1_600.0), DEPTH_BUCKETS - 1);
        assert_eq!(depth_bucket(10.0, 0.0), 0);
    }
}
