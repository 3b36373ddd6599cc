//! A shared filesystem tier mounted by a whole fleet (llm-d's filesystem offload): one store of
//! block contents, least recently used out first, that every engine mounting it writes on
//! eviction and loads from on a miss.
//!
//! Loads from all engines share one aggregate bandwidth: each load queues behind the bytes
//! already being read (first come, first served at the aggregate rate), then pays the tier's
//! access latency. Time is a parameter, so the live and the offline simulators share it.
//! Blocks are published with the medium `FS`, which the router's index treats as fleet-wide.

use std::sync::{Arc, Mutex};

use kvroute_core::event::{BlockRemoved, BlockStored, EngineHash, KvEvent};
use kvroute_core::keys::VllmDigest;
use serde::{Deserialize, Serialize};

use super::lru::LruBlocks;

/// The medium string of shared-filesystem events.
pub const SHARED_FS_MEDIUM: &str = "FS";

/// Size and speed of a shared filesystem tier.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SharedFsConfig {
    /// Blocks the filesystem holds.
    pub capacity_blocks: usize,
    /// Bytes per second all concurrent loads share.
    pub bandwidth_bytes_per_s: f64,
    /// Access latency of one load, seconds.
    pub latency_s: f64,
}

impl Default for SharedFsConfig {
    /// A parallel filesystem at ~10 GB/s aggregate with ~1 ms access latency (assumptions in
    /// the range of llm-d's filesystem offload on network storage; set them from a measurement).
    fn default() -> Self {
        Self {
            capacity_blocks: 0,
            bandwidth_bytes_per_s: 10e9,
            latency_s: 1e-3,
        }
    }
}

/// The shared tier's state.
#[derive(Debug)]
pub struct SharedFs {
    config: SharedFsConfig,
    blocks: LruBlocks,
    /// When the bytes already queued finish reading.
    busy_until_s: f64,
    loaded_bytes: u64,
}

/// A fleet's handle on one shared filesystem.
pub type SharedFsHandle = Arc<Mutex<SharedFs>>;

impl SharedFs {
    /// An empty shared tier.
    pub fn new(config: SharedFsConfig) -> Self {
        Self {
            config,
            blocks: LruBlocks::default(),
            busy_until_s: 0.0,
            loaded_bytes: 0,
        }
    }

    /// An empty shared tier behind a handle engines can mount.
    pub fn handle(config: SharedFsConfig) -> SharedFsHandle {
        Arc::new(Mutex::new(Self::new(config)))
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether it holds nothing.
    pub fn is_empty(&self) -> bool {
        self.blocks.len() == 0
    }

    /// Bytes loaded by every engine so far.
    pub fn loaded_bytes(&self) -> u64 {
        self.loaded_bytes
    }

    /// Whether it holds `digest`.
    pub fn contains(&self, digest: &VllmDigest) -> bool {
        self.blocks.contains(digest)
    }

    /// Writes `digest` (refreshes it if present); the writer publishes the store and any
    /// removal the write forces.
    pub fn store(&mut self, digest: VllmDigest, events: &mut Vec<KvEvent>) {
        if self.config.capacity_blocks == 0 || !self.blocks.touch(digest) {
            return;
        }
        events.push(KvEvent::BlockStored(BlockStored {
            block_hashes: vec![EngineHash(digest.event_u64())],
            medium: Some(SHARED_FS_MEDIUM.into()),
            ..Default::default()
        }));
        while self.blocks.len() > self.config.capacity_blocks {
            let Some(old) = self.blocks.pop_oldest() else {
                break;
            };
            events.push(KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![EngineHash(old.event_u64())],
                medium: Some(SHARED_FS_MEDIUM.into()),
                group_idx: None,
            }));
        }
    }

    /// Loads `blocks` (refreshing their recency) totalling `bytes` at time `now_s`; returns the
    /// seconds until they are in GPU memory, queueing behind loads already under way.
    pub fn load(&mut self, blocks: &[VllmDigest], bytes: u64, now_s: f64) -> f64 {
        if blocks.is_empty() {
            return 0.0;
        }
        for digest in blocks {
            if self.blocks.contains(digest) {
                self.blocks.touch(*digest);
            }
        }
        let start = self.busy_until_s.max(now_s);
        self.busy_until_s = start + bytes as f64 / self.config.bandwidth_bytes_per_s;
        self.loaded_bytes += bytes;
        self.busy_until_s - now_s + self.config.latency_s
    }

    /// Drops every block.
    pub fn clear(&mut self) {
        self.blocks.clear();
    }
}

#[cfg(test)]
mod tests {
    use kvroute_core::keys::VllmHasher;

    use super::*;

    fn digest(n: u32) -> VllmDigest {
        VllmHasher::new("s")
            .block_digests(&[n, n, n, n], 4, None)
            .unwrap()[0]
    }

    #[test]
    fn concurrent_loads_share_the_aggregate_bandwidth() {
        let mut fs = SharedFs::new(SharedFsConfig {
            capacity_blocks: 4,
            bandwidth_bytes_per_s: 1000.0,
            latency_s: 0.5,
        });
        let d = [digest(1)];
        let alone = fs.load(&d, 1000, 0.0);
        assert_eq!(alone, 1.5);
        // Two loads starting together: the second waits for the first's bytes.
        let first = fs.load(&d, 1000, 10.0);
        let second = fs.load(&d, 1000, 10.0);
        assert_eq!((first, second), (1.5, 2.5));
        assert_eq!(fs.loaded_bytes(), 3000);
    }

    #[test]
    fn it_holds_its_capacity_and_evicts_the_least_recently_used() {
        let mut fs = SharedFs::new(SharedFsConfig {
            capacity_blocks: 2,
            ..SharedFsConfig::default()
        });
        let mut events = Vec::new();
        fs.store(digest(1), &mut events);
        fs.store(digest(2), &mut events);
        fs.load(&[digest(1)], 1, 0.0);
        fs.store(digest(3), &mut events);
        assert!(fs.contains(&digest(1)) && fs.contains(&digest(3)));
        assert!(!fs.contains(&digest(2)));
        assert_eq!(events.len(), 4, "three stores and one removal: {events:?}");
    }
}
