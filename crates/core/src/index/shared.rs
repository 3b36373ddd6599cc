//! A [`KvIndex`] shared between the request path (many readers) and event ingestion (one
//! writer per endpoint).
//!
//! A reader-writer lock is enough here: writers hold it for one event batch (microseconds), so
//! readers never wait long, and a lookup takes the lock once for the whole prompt.

use parking_lot::RwLock;

use super::{EndpointId, EndpointIndexStats, KvIndex, OffloadSpec, PrefixMatches, SharedTierStats};
use crate::CoreError;
use crate::event::KvEvent;
use crate::keys::RouterKey;

/// A thread-safe handle to one [`KvIndex`]; clone the `Arc` it usually lives in.
#[derive(Debug)]
pub struct SharedIndex {
    inner: RwLock<KvIndex>,
}

impl SharedIndex {
    /// Wraps an index.
    pub fn new(index: KvIndex) -> Self {
        Self {
            inner: RwLock::new(index),
        }
    }

    /// Applies one batch of an endpoint's events atomically with respect to lookups.
    pub fn apply(&self, endpoint: EndpointId, events: &[KvEvent]) {
        self.inner.write().apply(endpoint, events);
    }

    /// Drops everything `endpoint` holds.
    pub fn clear_endpoint(&self, endpoint: EndpointId) {
        self.inner.write().clear_endpoint(endpoint);
    }

    /// Forgets `endpoint`.
    pub fn remove_endpoint(&self, endpoint: EndpointId) {
        self.inner.write().remove_endpoint(endpoint);
    }

    /// Registers `endpoint`.
    pub fn add_endpoint(&self, endpoint: EndpointId) {
        self.inner.write().add_endpoint(endpoint);
    }

    /// Declares how `endpoint` offloads (see [`KvIndex::set_offload`]).
    pub fn set_offload(&self, endpoint: EndpointId, spec: &OffloadSpec) -> Result<(), CoreError> {
        self.inner.write().set_offload(endpoint, spec)
    }

    /// Counters of the fleet-wide shared tier.
    pub fn shared_tier_stats(&self) -> SharedTierStats {
        self.inner.read().shared_tier_stats()
    }

    /// Each endpoint's longest cached prefix of `keys`.
    pub fn lookup(&self, keys: &[RouterKey]) -> PrefixMatches {
        self.inner.read().lookup(keys)
    }

    /// Counters for one endpoint.
    pub fn endpoint_stats(&self, endpoint: EndpointId) -> Option<EndpointIndexStats> {
        self.inner.read().endpoint_stats(endpoint)
    }

    /// Runs `f` with read access to the whole index (diagnostics, tests).
    pub fn read<R>(&self, f: impl FnOnce(&KvIndex) -> R) -> R {
        f(&self.inner.read())
    }
}
