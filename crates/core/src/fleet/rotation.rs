//! The passthrough rotation: where a request that needs no cache (embeddings, `GET` paths)
//! goes. Every available endpoint (present, healthy, not ejected), starting at one drawn from
//! the fleet's seeded randomness, so that such requests spread evenly and reproducibly.

use super::Fleet;
use crate::index::EndpointId;

impl Fleet {
    /// Every endpoint available at `now`, in id order rotated to start at a random one.
    pub fn passthrough_rotation(&mut self, now: f64) -> Vec<EndpointId> {
        let mut available: Vec<EndpointId> = self
            .endpoints
            .iter()
            .filter(|e| e.present && e.healthy && !e.ejected(now))
            .map(|e| e.id)
            .collect();
        let start = self.random.below(available.len());
        available.rotate_left(start);
        available
    }

    /// Reseeds the fleet's randomness (the live router seeds it once from entropy; the
    /// simulator from its run's seed).
    pub fn reseed(&mut self, seed: u64) {
        self.random = crate::random::SeededRandom::new(seed);
    }

    /// The next draw of the fleet's seeded randomness (for [`Fleet::plan`]'s `random`).
    pub fn next_random(&mut self) -> u64 {
        self.random.next_u64()
    }
}
