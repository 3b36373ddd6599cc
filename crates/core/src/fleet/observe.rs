//! Observations fed to the fleet: load samples, health checks, KV events, endpoints restored
//! or forgotten, and housekeeping.

use std::sync::Arc;

use super::{EndpointState, Fleet, HealthChange, LoadMark, LoadSample, pinned};
use crate::CoreError;
use crate::event::KvEvent;
use crate::index::{
    EndpointId, EndpointRestore, HeldEntry, KeyLayout, ROUTER_KEY_SCHEME, SharedIndex,
};

impl Fleet {
    /// A load sample scraped from `id` at an instant, `now` (a simulator's scrape; a scrape
    /// over the network is [`Fleet::observe_scraped_load`]).
    pub fn observe_load(&mut self, id: EndpointId, sample: LoadSample, now: f64) {
        let since = self.load_mark(id, now);
        self.observe_scraped_load(id, sample, since);
    }

    /// Where the router's own accounting of `id` stands at `now`: take it when a scrape of its
    /// load is sent, and give it back with the sample ([`Fleet::observe_scraped_load`]).
    pub fn load_mark(&self, id: EndpointId, now: f64) -> LoadMark {
        self.endpoints
            .get(id.0 as usize)
            .map_or(LoadMark::unknown(now), |e| e.load_mark(now))
    }

    /// A load sample of `id` from a scrape sent when `since` was taken: its counts, less the
    /// router's requests there then and since, are the load of other clients; it ages from
    /// when it was sent.
    pub fn observe_scraped_load(&mut self, id: EndpointId, sample: LoadSample, since: LoadMark) {
        if let Some(e) = self.endpoints.get_mut(id.0 as usize) {
            e.capacity_blocks = sample.num_gpu_blocks.or(e.capacity_blocks);
            e.observe_sample(sample, since);
            let fresh_until = since.at + self.config.load_sample_max_age_s;
            self.load_order.sample_expires(id, Some(fresh_until));
            self.load_changed(id);
        }
    }

    /// A health check of `id` at `now`; an ejection forgets everything known of its cache.
    pub fn health_check(&mut self, id: EndpointId, ok: bool, now: f64) -> Option<HealthChange> {
        let policy = self.config.health.clone();
        let change = self
            .endpoints
            .get_mut(id.0 as usize)
            .filter(|e| e.present)?
            .health_check(ok, &policy);
        if change == Some(HealthChange::Ejected) {
            self.forget_endpoint(id, now);
        }
        if change.is_some() {
            // In or out of its model's load order.
            self.load_changed(id);
        }
        change
    }

    /// One batch of `id`'s KV events arrived at `now`: applies it (see [`Self::events_arrived`]
    /// for applying it outside whatever lock guards the fleet).
    pub fn apply_events(&mut self, id: EndpointId, events: &[KvEvent], now: f64) {
        if let Some(index) = self.events_arrived(id, now) {
            index.apply(id, events);
        }
    }

    /// A batch of `id`'s KV events arrived at `now`: notes it (the index's trust in `id` is
    /// fresh) and returns the index the caller applies it to, `None` when `id` has none.
    ///
    /// The index has its own locks, one per shard, so a concurrent caller applies the batch
    /// after releasing the fleet: planning and every other fleet operation then never wait for
    /// event ingestion, and the endpoints of different shards are applied in parallel. The
    /// note comes first; a plan made in between reads the index a batch behind, as it would
    /// have had the batch arrived a moment later.
    pub fn events_arrived(&mut self, id: EndpointId, now: f64) -> Option<Arc<SharedIndex>> {
        let e = self.endpoints.get_mut(id.0 as usize)?;
        e.trust.events(now);
        self.index_of(id).cloned()
    }

    /// Some of `id`'s events were lost for good at `now`.
    pub fn events_lost(&mut self, id: EndpointId, now: f64) {
        if let Some(e) = self.endpoints.get_mut(id.0 as usize) {
            e.trust.lost(now);
        }
    }

    /// The layout `id`'s router keys are made with (what a snapshot of its blocks carries).
    pub fn key_layout(&self, id: EndpointId) -> Option<KeyLayout> {
        self.endpoint(id).map(|e| KeyLayout {
            key_scheme: ROUTER_KEY_SCHEME,
            block_size: e.spec.block_size,
            offload_block_size: e.spec.offload.block_size,
        })
    }

    /// Restores what a peer replica's index held for `id` (a warm start), as one step: the
    /// snapshot's [`KeyLayout`] is checked against the endpoint's own, and one keyed otherwise
    /// is refused with nothing changed ([`CoreError::KeyLayoutMismatch`]); else the
    /// endpoint's index entries become exactly the snapshot's blocks, its offloaded tiers are
    /// marked uncertain where the peer's were, and the restore counts as its events arriving
    /// at `now` (trusted), or as events lost where the peer did not trust them. Returns the
    /// blocks restored, `None` when `id` is not present (or has no index).
    pub fn restore_endpoint(
        &mut self,
        id: EndpointId,
        restore: EndpointRestore<impl IntoIterator<Item = HeldEntry>>,
        now: f64,
    ) -> Result<Option<usize>, CoreError> {
        let present = self.endpoint(id).is_some_and(EndpointState::present);
        let Some(ours) = self.key_layout(id).filter(|_| present) else {
            return Ok(None);
        };
        ours.check(&restore.layout)?;
        let Some(index) = self.index_of(id).cloned() else {
            return Ok(None);
        };
        let restored = index.write_endpoint(id, |ix| {
            let restored = ix.restore(id, restore.blocks);
            if restore.tier_uncertain {
                ix.mark_tier_uncertain(id);
            }
            if let Some(group) = restore.tracked_group {
                ix.set_tracked_group(id, group);
            }
            restored
        });
        self.cache_dropped();
        // The snapshot stands for the events it reflects: the endpoint has published.
        self.events_arrived(id, now);
        if !restore.trusted {
            self.events_lost(id, now);
        }
        Ok(Some(restored))
    }

    /// Forgets everything known of what `id` holds: its index entries, the history and
    /// predictions of requests sent there, and sessions that went there. The one operation for
    /// an engine restart, a health ejection and a pod that left.
    pub fn forget_endpoint(&mut self, id: EndpointId, now: f64) {
        if let Some(index) = self.index_of(id) {
            index.clear_endpoint(id);
        }
        self.cache_dropped();
        self.history.forget_endpoint(id);
        self.predicted.forget_endpoint(id);
        self.sessions.forget_endpoint(id);
        if let Some(e) = self.endpoints.get_mut(id.0 as usize) {
            e.trust.reset();
            e.reuse = Default::default();
            e.recent.clear();
            e.forgotten_at = Some(now);
        }
    }

    /// Drops expired history and predictions (call now and then).
    pub fn housekeeping(&mut self, now: f64) {
        for e in &mut self.endpoints {
            e.pinned.expire(now - pinned::PIN_MAX_AGE_S);
        }
        self.history.expire(now);
        self.predicted.expire(now);
        self.expire_peer_prefills(now);
    }
}
