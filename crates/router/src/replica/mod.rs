//! Several router replicas serving one fleet, active-active: each subscribes to every engine's
//! KV events; a starting one copies a running peer's index before it reports ready.
//!
//! Warm start, in order (see [`warm`]):
//! 1. ask each peer in `replicas.peers` for a snapshot (`GET /kvroute/v1/snapshot` on its
//!    admin listener): per endpoint, the events that rebuild its index and the sequence number
//!    of the last engine batch they reflect;
//! 2. apply it, then subscribe to each engine resuming after that sequence: the engine's replay
//!    buffer fills the few batches published since, so nothing is lost or applied twice;
//! 3. report ready (`/health` on the API listener) once every subscriber caught up; after
//!    `replicas.warm_timeout_s`, ready anyway with the endpoints not caught up untrusted.
//!
//! Without a peer that answers, step 2 subscribes from the start of each engine's replay buffer.

mod journal;
pub mod share;
mod snapshot;
pub mod warm;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use kvroute_core::event::EventBatch;
use kvroute_core::index::EndpointId;
use kvroute_vllm::subscriber::EventSink;
use parking_lot::{Mutex, MutexGuard};

pub use journal::{Export, Journal};
pub use snapshot::{EndpointSnapshot, Snapshot, snapshot};
pub use warm::{WarmStatus, ready, status};

use crate::config::ReplicasConfig;
use crate::endpoint::TrackingSink;
use crate::service::Router;

/// A replica's own state: the journal it answers peers' snapshots from, and its warm-up.
pub struct ReplicaState {
    journal: Option<Mutex<Journal>>,
    warming: AtomicBool,
    status: Mutex<WarmStatus>,
}

impl ReplicaState {
    /// The state for `config`: a journal and a warm-up when it names peers.
    pub fn new(config: &ReplicasConfig) -> Self {
        let peers = !config.peers.is_empty();
        Self {
            journal: peers.then(|| Mutex::new(Journal::default())),
            warming: AtomicBool::new(peers),
            status: Mutex::new(if peers {
                WarmStatus::Warming
            } else {
                WarmStatus::NotConfigured
            }),
        }
    }

    /// The journal, when this replica keeps one (it has peers).
    pub fn journal(&self) -> Option<MutexGuard<'_, Journal>> {
        self.journal.as_ref().map(Mutex::lock)
    }

    /// Whether this replica keeps a journal (it has peers), so it can answer their snapshots.
    pub fn keeps_journal(&self) -> bool {
        self.journal.is_some()
    }

    /// Whether the warm-up is still running (readiness fails meanwhile).
    pub fn warming(&self) -> bool {
        self.warming.load(Ordering::Acquire)
    }

    /// How the warm-up went.
    pub fn status(&self) -> WarmStatus {
        self.status.lock().clone()
    }

    fn finish(&self, status: WarmStatus) {
        *self.status.lock() = status;
        self.warming.store(false, Ordering::Release);
    }
}

/// Feeds the fleet with each endpoint's events, as [`TrackingSink`] does, and the journal with
/// the same batches under the same fleet lock, so that a snapshot's index and sequence number
/// always agree.
pub struct ReplicaSink {
    tracking: TrackingSink,
}

/// The event sink the router's subscribers feed.
pub fn sink(router: &Arc<Router>) -> Arc<dyn EventSink> {
    Arc::new(ReplicaSink {
        tracking: TrackingSink {
            router: Arc::downgrade(router),
        },
    })
}

impl EventSink for ReplicaSink {
    fn apply(&self, endpoint: EndpointId, seq: u64, batch: &EventBatch) {
        let Some(router) = self.tracking.router.upgrade() else {
            return;
        };
        let now = router.now();
        let mut fleet = router.fleet();
        fleet.apply_events(endpoint, &batch.events, now);
        if let Some(mut journal) = router.replica().journal() {
            journal.apply(endpoint, Some(seq), &batch.events);
        }
        drop(fleet);
    }

    fn purge(&self, endpoint: EndpointId) {
        self.tracking.purge(endpoint);
        if let Some(router) = self.tracking.router.upgrade()
            && let Some(mut journal) = router.replica().journal()
        {
            journal.clear(endpoint);
        }
    }

    fn unfilled_gap(&self, endpoint: EndpointId, from: u64, to: u64) {
        self.tracking.unfilled_gap(endpoint, from, to);
    }
}
