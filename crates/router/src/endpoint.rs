//! What the router needs of each endpoint to talk to it: its name, address, configuration, the
//! last health-check error and its KV-event subscriber. Everything a decision reads about it
//! lives in `kvroute-core`'s [`Fleet`](kvroute_core::fleet::Fleet); the event sink here feeds
//! that fleet.

use std::sync::Weak;

use kvroute_core::event::EventBatch;
use kvroute_core::index::EndpointId;
use kvroute_vllm::subscriber::{EventSink, SubscriberHandle};
use parking_lot::Mutex;
use tokio::task::JoinHandle;

use crate::config::EndpointConfig;
use crate::service::Router;

/// One endpoint, as the router talks to it.
pub struct Endpoint {
    /// Id in the fleet.
    pub id: EndpointId,
    /// Name for logs, metrics and the response header.
    pub name: String,
    /// Its configuration.
    pub config: EndpointConfig,
    /// `host:port` of its HTTP API.
    pub authority: http::uri::Authority,
    /// The last failed health check, for the explain API.
    pub last_health_error: Mutex<Option<String>>,
    /// The KV-event subscriber, when events are configured.
    pub subscriber: Mutex<Option<SubscriberHandle>>,
    /// Its health-check and scrape tasks.
    pub tasks: Mutex<Vec<JoinHandle<()>>>,
}

impl Endpoint {
    /// A new endpoint from its (validated) configuration.
    pub fn new(id: EndpointId, config: EndpointConfig) -> Self {
        let uri: http::Uri = config.url.parse().expect("validated");
        let authority = uri.authority().expect("validated").clone();
        let name = config.name.clone().unwrap_or_else(|| authority.to_string());
        Self {
            id,
            name,
            config,
            authority,
            last_health_error: Mutex::new(None),
            subscriber: Mutex::new(None),
            tasks: Mutex::new(Vec::new()),
        }
    }

    /// Stops its subscriber and background tasks (removed, or the router is shutting down).
    pub fn stop(&self) {
        self.subscriber.lock().take();
        for task in self.tasks.lock().drain(..) {
            task.abort();
        }
    }

    /// Whether its KV-event subscriber is connected (true when it has no events configured):
    /// what a test or a readiness check waits for before sending traffic.
    pub fn events_connected(&self) -> bool {
        self.config.events.is_none()
            || self
                .subscriber
                .lock()
                .as_ref()
                .is_some_and(|s| s.stats().iter().all(|(_, f)| f.connected))
    }
}

/// Feeds the fleet with each endpoint's KV events, restarts and losses.
pub struct TrackingSink {
    /// The router whose fleet is fed (weak: the router owns the subscribers that own this).
    pub router: Weak<Router>,
}

impl EventSink for TrackingSink {
    fn apply(&self, endpoint: EndpointId, _seq: u64, batch: &EventBatch) {
        if let Some(router) = self.router.upgrade() {
            let now = router.now();
            router.fleet().apply_events(endpoint, &batch.events, now);
        }
    }

    fn purge(&self, endpoint: EndpointId) {
        if let Some(router) = self.router.upgrade() {
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
