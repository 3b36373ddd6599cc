//! Event sinks: each endpoint's KV-event subscriber, and the sink it feeds (the fleet's index
//! and trust, and the replica journal).
//!
//! A batch is applied to the index outside the fleet's lock: the index has a lock per shard,
//! so event ingestion never stalls a decision (which plans under the fleet's lock) and the
//! shards' endpoints are applied in parallel. The endpoint's own ingest lock
//! ([`Endpoint::ingest`]) orders a batch with the endpoint's removal and with a snapshot of it,
//! which the fleet's lock did before.

use std::sync::{Arc, Weak};

use kvroute_core::event::EventBatch;
use kvroute_core::fleet::Fleet;
use kvroute_core::index::EndpointId;
use kvroute_vllm::subscriber::{EndpointSource, EventSink, spawn_connected_after};
use tracing::debug;

use crate::endpoint::Endpoint;
use crate::service::Router;

/// Feeds the fleet with one endpoint's KV events, restarts and losses, and notes each batch's
/// sequence number in the replica journal (when kept). A batch that arrives after its endpoint left
/// (the subscriber is stopped at removal, but a batch may be on its way) is dropped and
/// counted: it must never reach the endpoint that took the id over.
pub(crate) struct FleetSink {
    /// The router whose fleet is fed (weak: the router owns the subscribers that own this).
    router: Weak<Router>,
    /// The endpoint whose subscriber feeds this sink.
    endpoint: Weak<Endpoint>,
}

/// The event sink `endpoint`'s subscriber feeds.
pub(crate) fn sink(router: &Arc<Router>, endpoint: &Arc<Endpoint>) -> Arc<dyn EventSink> {
    Arc::new(FleetSink {
        router: Arc::downgrade(router),
        endpoint: Arc::downgrade(endpoint),
    })
}

impl FleetSink {
    /// Whether this sink's endpoint is still the present one under its id (call under the
    /// fleet's lock, which registration holds while it fills the registry).
    fn current(&self, router: &Router, fleet: &Fleet, id: EndpointId) -> bool {
        self.endpoint
            .upgrade()
            .is_some_and(|e| e.id == id && router.is_current(fleet, &e))
    }
}

impl FleetSink {
    /// The router, while this sink's endpoint is still the one under `id` (a departed
    /// endpoint's restart or loss must not make the fleet forget the one that took its id).
    fn current_router(&self, id: EndpointId) -> Option<Arc<Router>> {
        let router = self.router.upgrade()?;
        let current = self.current(&router, &router.fleet(), id);
        current.then_some(router)
    }
}

impl EventSink for FleetSink {
    fn apply(&self, endpoint: EndpointId, seq: u64, batch: &EventBatch) {
        let Some(router) = self.router.upgrade() else {
            return;
        };
        let late = || {
            debug!(
                id = endpoint.0,
                seq, "dropping a KV-event batch that arrived after its endpoint left"
            );
            router.metrics().late_event_batches.inc();
        };
        let Some(own) = self.endpoint.upgrade() else {
            return late();
        };
        let _ingest = own.ingest.lock();
        let now = router.now();
        let index = {
            let mut fleet = router.fleet();
            if !self.current(&router, &fleet, endpoint) {
                drop(fleet);
                return late();
            }
            fleet.events_arrived(endpoint, now)
        };
        if let Some(index) = index {
            index.apply(endpoint, &batch.events);
        }
        if let Some(mut journal) = router.replica().journal() {
            journal.apply(endpoint, seq);
        }
    }

    fn purge(&self, endpoint: EndpointId) {
        if let Some(router) = self.current_router(endpoint) {
            // Forgets the journal's position too.
            router.forget_endpoint(endpoint, "the engine restarted");
        }
    }

    fn unfilled_gap(&self, endpoint: EndpointId, _from: u64, _to: u64) {
        if let Some(router) = self.current_router(endpoint) {
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
        sink(router, e),
        router.config().kv_events.subscriber_config(),
        resume_after,
    ));
}

/// Starts `e`'s KV-event subscriber as [`spawn_subscriber`] does, only while `e` is the present
/// endpoint in its slot: one removed meanwhile (its tasks already stopped) would keep a
/// subscriber nothing stops. Presence is checked under `e`'s ingest lock, which removal takes
/// before it marks `e` gone, and held until the subscriber is in place for removal to stop.
pub(crate) fn spawn_subscriber_while_present(
    router: &Arc<Router>,
    e: &Arc<Endpoint>,
    resume_after: Option<u64>,
) {
    // Nothing to start: spare the locks (the warm-up asks every endpoint every few ms).
    if e.config.events.is_none() || e.subscriber.lock().is_some() {
        return;
    }
    let _ingest = e.ingest.lock();
    if router.is_current(&router.fleet(), e) {
        spawn_subscriber(router, e, resume_after);
    }
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

#[cfg(test)]
mod tests {
    use kvroute_core::event::{BlockStored, EngineHash, KvEvent};

    use super::*;
    use crate::config::{EndpointConfig, RouterConfig};

    fn endpoint(port: u16) -> EndpointConfig {
        let yaml = format!("{{url: 'http://127.0.0.1:{port}', events: 'tcp://127.0.0.1:{port}'}}");
        serde_yaml_ng::from_str(&yaml).unwrap()
    }

    fn stored() -> EventBatch {
        EventBatch {
            ts: 0.0,
            events: vec![KvEvent::BlockStored(BlockStored {
                block_hashes: vec![EngineHash(7)],
                token_ids: (0..16).collect(),
                block_size: 16,
                ..Default::default()
            })],
            data_parallel_rank: None,
        }
    }

    /// A router of one endpoint with KV events (id 0).
    fn router() -> Arc<Router> {
        let yaml = "models: [{name: m}]\nendpoints:\n  - {url: 'http://127.0.0.1:1', events: 'tcp://127.0.0.1:1'}\n";
        Arc::new(Router::new(RouterConfig::from_yaml(yaml).unwrap()).unwrap())
    }

    #[test]
    fn a_batch_waiting_for_the_index_leaves_the_fleet_free_for_decisions() {
        use std::sync::mpsc;
        use std::time::Duration;

        let router = router();
        let id = EndpointId(0);
        let index = router.fleet().index_of(id).cloned().unwrap();
        // Hold the endpoint's shard, as a long batch of another endpoint on it would.
        let (held_tx, held_rx) = mpsc::channel();
        let (release_tx, release_rx) = mpsc::channel::<()>();
        let holder = std::thread::spawn(move || {
            index.write_endpoint(id, |_| {
                held_tx.send(()).unwrap();
                release_rx.recv().unwrap();
            })
        });
        held_rx.recv().unwrap();
        let applier = std::thread::spawn({
            let sink = sink(&router, &router.endpoint(id));
            move || sink.apply(id, 1, &stored())
        });
        // The batch is noted under the fleet's lock, then waits for the shard: meanwhile the
        // fleet must be free (a decision would plan under it).
        let (seen_tx, seen_rx) = mpsc::channel();
        let watcher = std::thread::spawn({
            let router = router.clone();
            move || {
                while router.fleet().events_age(id, router.now()).is_none() {
                    std::thread::yield_now();
                }
                seen_tx.send(()).unwrap();
            }
        });
        let noted = seen_rx.recv_timeout(Duration::from_secs(10));
        release_tx.send(()).unwrap();
        for thread in [holder, applier, watcher] {
            thread.join().unwrap();
        }
        assert!(
            noted.is_ok(),
            "the fleet stayed locked while the batch waited for the index"
        );
        let held = router.index_stats(id).map_or(0, |s| s.blocks_gpu);
        assert_eq!(held, 1, "the batch was applied once the shard was free");
    }

    #[test]
    fn a_forget_waits_for_a_batch_already_being_applied_so_none_of_it_survives_the_forget() {
        use std::time::Duration;
        use tokio::time::Instant;

        let router = router();
        let id = EndpointId(0);
        let endpoint = router.endpoint(id);
        let index = router.fleet().index_of(id).cloned().unwrap();
        // A batch found current and being applied holds its endpoint's ingest lock throughout.
        let applying = endpoint.ingest.lock();
        let forget = std::thread::spawn({
            let router = router.clone();
            move || router.forget_endpoint(id, "the engine restarted")
        });
        // The forget must wait for the batch: give it every chance to overtake (it must not).
        let started = Instant::now();
        while !forget.is_finished() && started.elapsed() < Duration::from_millis(200) {
            std::thread::yield_now();
        }
        index.apply(id, &stored().events);
        drop(applying);
        forget.join().unwrap();
        let held = router.index_stats(id).map_or(0, |s| s.blocks_gpu);
        assert_eq!(held, 0, "a block of the batch outlived the forget");
    }

    // Paused: the fleet's clock is tokio's, so the wait for the free slot takes no real time.
    #[tokio::test(start_paused = true)]
    async fn a_late_batch_of_a_departed_endpoint_never_reaches_the_one_that_took_its_id() {
        let yaml = "models: [{name: m}]\nendpoints:\n  - {url: 'http://127.0.0.1:1', events: 'tcp://127.0.0.1:1'}\nlimits: {connect_timeout_ms: 1}\n";
        let router = Arc::new(Router::new(RouterConfig::from_yaml(yaml).unwrap()).unwrap());
        let id = EndpointId(0);
        let departed = sink(&router, &router.endpoint(id));
        assert!(router.deregister(id).is_some());
        // Its id is free once nothing planned there can still be dispatched: that span of time
        // is the condition itself, so the paused clock is moved on by it (and a millisecond:
        // the check is on float seconds, which an exact boundary could miss by an ulp).
        let settle = std::time::Duration::from_secs_f64(router.config().slot_reuse_after_s());
        tokio::time::advance(settle + std::time::Duration::from_millis(1)).await;
        let newcomer = router.register(endpoint(2)).unwrap();
        assert_eq!(newcomer.id, id, "the newcomer takes the free slot");
        departed.apply(id, 1, &stored());
        let held = router.index_stats(id).map_or(0, |s| s.blocks_gpu);
        assert_eq!(held, 0, "the departed endpoint's batch was dropped");
        assert_eq!(router.metrics().late_event_batches.get(), 1);
        sink(&router, &newcomer).apply(id, 1, &stored());
        let held = router.index_stats(id).map_or(0, |s| s.blocks_gpu);
        assert_eq!(held, 1, "the newcomer's own batch is applied");
        departed.purge(id);
        let held = router.index_stats(id).map_or(0, |s| s.blocks_gpu);
        assert_eq!(
            held, 1,
            "nor does the departed endpoint's restart forget the newcomer"
        );
    }
}
