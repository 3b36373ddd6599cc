//! The fleet handle: core's [`Fleet`] behind its lock, the clock every observation is stamped
//! with (tokio's, so tests can pause it), and the notification that capacity may have freed up.
//! What changes together: every plan, dispatch and observation goes through here.

use std::sync::Arc;

use kvroute_core::fleet::{
    Dispatch, Fleet, HeldTurn, HoldTicket, LookupTargets, Plan, RequestFeatures,
};
use kvroute_core::index::EndpointId;
use parking_lot::{Mutex, MutexGuard};
use tokio::sync::Notify;
use tokio::time::Instant;

/// Core's fleet, its clock and the capacity notification.
pub(crate) struct FleetHandle {
    fleet: Mutex<Fleet>,
    /// The fleet's indexes and epoch, read without its lock to walk the index first.
    targets: Arc<LookupTargets>,
    started: Instant,
    /// Woken whenever capacity may have freed up (a first token, an end, a scrape): held
    /// requests check again.
    capacity: Notify,
}

impl FleetHandle {
    /// A handle on `fleet`, its clock starting now.
    pub(crate) fn new(fleet: Fleet) -> Self {
        Self {
            targets: fleet.lookup_targets(),
            fleet: Mutex::new(fleet),
            started: Instant::now(),
            capacity: Notify::new(),
        }
    }

    /// The fleet, locked (hold it briefly: every request plans through it).
    pub(crate) fn lock(&self) -> MutexGuard<'_, Fleet> {
        self.fleet.lock()
    }

    /// Seconds since start: the clock every fleet observation is stamped with.
    pub(crate) fn now(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    /// Plans a request now, with core's seeded randomness. Its walk of the KV index runs
    /// before the fleet is locked ([`Fleet::plan_with`]): decisions take the lock once, for
    /// their costing only, and walk the index side by side.
    pub(crate) fn plan(&self, features: &RequestFeatures<'_>) -> Plan {
        let lookup = self.targets.target(features.block_size).run(features.keys);
        let now = self.now();
        let mut fleet = self.lock();
        let random = fleet.next_random();
        fleet.plan_with(features, Some(lookup), random, now)
    }

    /// Plans a request now with every endpoint ranked and broken down (see
    /// [`Fleet::plan_every`]).
    pub(crate) fn plan_every(&self, features: &RequestFeatures<'_>) -> Plan {
        let now = self.now();
        let mut fleet = self.lock();
        let random = fleet.next_random();
        fleet.plan_every(features, random, now)
    }

    /// Polls a held request now (see [`Fleet::poll_held`]).
    pub(crate) fn poll_held(&self, features: &RequestFeatures<'_>, ticket: HoldTicket) -> HeldTurn {
        let now = self.now();
        self.lock().poll_held(ticket, features, now)
    }

    /// Records a dispatch to `endpoint` now (call once connected).
    pub(crate) fn dispatched(
        &self,
        predicted_cached: &[usize],
        features: &RequestFeatures<'_>,
        endpoint: EndpointId,
    ) -> Dispatch {
        let now = self.now();
        self.lock()
            .dispatched(predicted_cached, features, endpoint, now)
    }

    /// Wakes held requests: capacity may have freed up.
    pub(crate) fn capacity_changed(&self) {
        self.capacity.notify_waiters();
    }

    /// Resolves when capacity may have freed up (create before checking, then await).
    pub(crate) fn capacity_notified(&self) -> tokio::sync::futures::Notified<'_> {
        self.capacity.notified()
    }
}
