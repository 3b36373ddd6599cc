//! Endpoints joining and leaving a running fleet (pods discovered at run time). Ids stay
//! positions: a removed endpoint's slot is taken out of every plan and reused by a later
//! endpoint once nothing dispatched there is still in flight and nothing planned there can
//! still be dispatched (`slot_reuse_after_s` after it left).

use super::{EndpointSpec, EndpointState, Fleet, ensure_index};
use crate::CoreError;
use crate::index::EndpointId;

impl Fleet {
    /// Adds an endpoint at `now` and returns its id: the slot of an endpoint removed at least
    /// `slot_reuse_after_s` ago with nothing in flight, else a new one. It starts healthy,
    /// untrusted until its KV events arrive (when it has them), with nothing cached.
    pub fn add_endpoint(&mut self, spec: EndpointSpec, now: f64) -> Result<EndpointId, CoreError> {
        let index = ensure_index(&mut self.indexes, spec.block_size, &self.config)?.clone();
        self.targets.set_indexes(&self.indexes);
        let offload = spec.offload.clone();
        self.model_priors.serve(&spec.models);
        let settled = self.config.slot_reuse_after_s;
        let free = self.endpoints.iter().position(|e| {
            !e.present && e.inflight == 0 && e.forgotten_at.is_some_and(|at| now - at >= settled)
        });
        let id = match free {
            Some(slot) => {
                let id = EndpointId(slot as u32);
                // Whatever a previous owner left behind (late events) is not this one's.
                self.forget_endpoint(id, now);
                self.endpoints[slot] = EndpointState::new(id, spec);
                self.reported_trust[slot] = None;
                id
            }
            None => {
                let id = EndpointId(self.endpoints.len() as u32);
                self.endpoints.push(EndpointState::new(id, spec));
                self.reported_trust.push(None);
                id
            }
        };
        self.roles_changed();
        // A fresh state: its place in the load order starts from nothing in flight.
        self.load_order.sample_expires(id, None);
        self.load_order.ejected_until(id, None);
        self.load_changed(id);
        // A reused slot's previous owner mounted what it mounted: this one says its own.
        index.set_offload(id, &offload)?;
        Ok(id)
    }

    /// Removes `id` at `now` (pod deleted or no longer ready): everything known of its cache
    /// is forgotten and it is never planned again; requests already dispatched there finish
    /// and are accounted as usual. Returns whether it was present.
    pub fn remove_endpoint(&mut self, id: EndpointId, now: f64) -> bool {
        let present = self.endpoint(id).is_some_and(EndpointState::present);
        if present {
            self.forget_endpoint(id, now);
            if let Some(disagg) = self.disagg.as_mut() {
                disagg.forget(id);
            }
            if let Some(e) = self.endpoints.get_mut(id.0 as usize) {
                e.present = false;
                e.healthy = false;
            }
            self.roles_changed();
            self.load_changed(id);
        }
        present
    }
}
