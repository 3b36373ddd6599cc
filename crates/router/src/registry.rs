//! The endpoint registry: every endpoint the router knows, by fleet id (a removed one stays
//! until a newcomer takes its slot, as the fleet reuses ids).

use std::sync::Arc;

use kvroute_core::index::EndpointId;
use parking_lot::RwLock;

use crate::endpoint::Endpoint;

/// Every endpoint by id.
pub(crate) struct Registry {
    endpoints: RwLock<Vec<Arc<Endpoint>>>,
}

impl Registry {
    /// A registry of `endpoints`, whose ids are their positions.
    pub(crate) fn new(endpoints: Vec<Arc<Endpoint>>) -> Self {
        Self {
            endpoints: RwLock::new(endpoints),
        }
    }

    /// Every endpoint, in id order.
    pub(crate) fn all(&self) -> Vec<Arc<Endpoint>> {
        self.endpoints.read().clone()
    }

    /// One endpoint (ids come from the fleet, which never names one the registry lacks).
    pub(crate) fn get(&self, id: EndpointId) -> Arc<Endpoint> {
        self.endpoints.read()[id.0 as usize].clone()
    }

    /// The endpoint in `id`'s slot, if the registry has one.
    pub(crate) fn find(&self, id: EndpointId) -> Option<Arc<Endpoint>> {
        self.endpoints.read().get(id.0 as usize).cloned()
    }

    /// Puts `endpoint` in its id's slot: a reused one, or a new one at the end.
    pub(crate) fn put(&self, endpoint: Arc<Endpoint>) {
        let mut endpoints = self.endpoints.write();
        match endpoints.get_mut(endpoint.id.0 as usize) {
            Some(slot) => *slot = endpoint,
            None => endpoints.push(endpoint),
        }
    }

    /// Stops every endpoint's background tasks.
    pub(crate) fn stop_all(&self) {
        for e in self.endpoints.read().iter() {
            e.stop();
        }
    }
}
