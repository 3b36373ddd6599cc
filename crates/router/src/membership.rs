//! Membership: endpoints joining and leaving the running router (discovery: a pod became
//! ready, or left), each with its tasks (KV-event subscriber, health checks, load scraping).
//! Discovery reaches it only through [`Membership`].

use std::sync::Arc;

use kvroute_core::index::EndpointId;
use tracing::{info, warn};

use crate::RouterError;
use crate::config::EndpointConfig;
use crate::endpoint::Endpoint;
use crate::service::Router;
use crate::{events, probes};

/// Endpoints joining and leaving while the router runs.
pub trait Membership: Send + Sync {
    /// Adds an endpoint (discovery: a pod became ready) and starts its subscriber, health
    /// checks and scraping. Returns its fleet id.
    fn add_endpoint(&self, config: EndpointConfig) -> Result<EndpointId, RouterError>;

    /// Removes an endpoint (pod deleted or not ready): the fleet forgets it and never plans it
    /// again, and its background tasks stop. Requests in flight there finish. Returns whether
    /// it was present.
    fn remove_endpoint(&self, id: EndpointId) -> bool;

    /// Discovery ignored something (`kind`: the metric label; `detail`: for the log): warned
    /// about and counted, never dropped silently.
    fn ignored(&self, kind: &'static str, detail: &str);
}

impl Membership for Arc<Router> {
    fn add_endpoint(&self, config: EndpointConfig) -> Result<EndpointId, RouterError> {
        let endpoint = self.register(config)?;
        spawn_endpoint_tasks(self, &endpoint);
        info!(endpoint = %endpoint.name, id = endpoint.id.0, "endpoint joined");
        self.capacity_changed();
        Ok(endpoint.id)
    }

    fn remove_endpoint(&self, id: EndpointId) -> bool {
        let Some(endpoint) = self.deregister(id) else {
            return false;
        };
        endpoint.stop();
        self.upstream().forget(endpoint.authority.as_str());
        self.endpoint_series_left(&endpoint.name);
        info!(endpoint = %endpoint.name, id = id.0, "endpoint left");
        true
    }

    fn ignored(&self, kind: &'static str, detail: &str) {
        warn!(kind, detail, "discovery ignored part of the pool or pod");
        self.metrics()
            .discovery_problems
            .get_or_create(&crate::metrics::KindLabel { kind })
            .inc();
    }
}

/// Starts one endpoint's KV-event subscriber (when configured), health checks and scraping;
/// [`Endpoint::stop`] ends them.
pub(crate) fn spawn_endpoint_tasks(router: &Arc<Router>, e: &Arc<Endpoint>) {
    // While a replica warms up, its warm-up subscribes (resuming after its peer's snapshot).
    if !router.replica().warming() {
        events::spawn_subscriber(router, e, None);
    }
    probes::spawn(router, e);
}
