//! Event sinks: each endpoint's KV-event subscriber, and the sink it feeds (the fleet's index
//! and trust, and the replica journal under the same fleet lock, so that a snapshot's index and
//! sequence number always agree).

use std::sync::{Arc, Weak};

use kvroute_core::event::EventBatch;
use kvroute_core::index::EndpointId;
use kvroute_vllm::subscriber::{EndpointSource, EventSink, spawn_connected_after};

use crate::endpoint::Endpoint;
use crate::service::Router;

/// Feeds the fleet with each endpoint's KV events, restarts and losses, and the replica
/// journal (when kept) with the same batches.
pub(crate) struct FleetSink {
    /// The router whose fleet is fed (weak: the router owns the subscribers that own this).
    router: Weak<Router>,
}

/// The event sink the router's subscribers feed.
pub(crate) fn sink(router: &Arc<Router>) -> Arc<dyn EventSink> {
    Arc::new(FleetSink {
        router: Arc::downgrade(router),
    })
}

impl EventSink for FleetSink {
    fn apply(&self, endpoint: EndpointId, seq: u64, batch: &EventBatch) {
        let Some(router) = self.router.upgrade() else {
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
        if let Some(router) = self.router.upgrade() {
            // Forgets the journal's copy too.
            router.forget_endpoint(endpoint, "the engine restarted");
        }
    }

    fn unfilled_gap(&self, endpoint: EndpointId, _from: u64, _to: u64) {
        if let Some(router) = self.router.upgrade() {
            let now = router.now();
            router.fleet().events_lost(endpoint, now);
        }
    }
}

/// Starts an endpoint's KV-event subscriber (when it has events and none runs yet); with
/// `resume_after`, its first connection replays from the batch after that one.
pub(crate) fn spawn_subscriber(router: &Arc<Router>, e: &Arc<Endpoint>, resume_after: Option<u64>) {
    let Some(events) = &e.config.events else {
        return;
    };
    let mut slot = e.subscriber.lock();
    if slot.is_some() {
        return;
    }
    *slot = Some(spawn_connected_after(
        EndpointSource {
            endpoint: e.id,
            name: e.name.clone(),
            publisher: events.clone(),
            replay: e.config.replay.clone(),
            topic: e.config.topic.clone(),
        },
        sink(router),
        router.config().kv_events.subscriber_config(),
        resume_after,
    ));
}

/// Starts an endpoint's KV-event subscriber afresh, after the fleet forgot what the endpoint
/// held for a reason the subscriber cannot see (an ejection, a restart its `/metrics` revealed):
/// the new subscription replays from the start of the engine's buffer instead of resuming at
/// the old stream's sequence number, which a restarted engine may already have passed. While a
/// replica warms up, its warm-up owns the subscriber.
pub(crate) fn resubscribe(router: &Arc<Router>, e: &Arc<Endpoint>) {
    if router.replica().warming() {
        return;
    }
    drop(e.subscriber.lock().take());
    spawn_subscriber(router, e, None);
}
