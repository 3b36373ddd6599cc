//! The capacity bound: a clock hand that drops entries a few at a time, so that no batch pays
//! for a pass over the whole index (see the module doc of [`super`] for the policy).

use super::{KvIndex, REFERENCED, drop_slot};

/// Entries the hand visits per block a batch stored, above the high-water mark.
const VISITS_PER_BLOCK: usize = 4;
/// Visits every over-bound batch gets, however small.
const MIN_VISITS: usize = 64;
/// Sweeps between two searches for the endpoint holding the most entries: the search reads
/// every endpoint (1,000 at fleet scale), too much to repeat for every batch.
const RESCAN_EVERY: u32 = 64;

impl KvIndex {
    /// Keeps the index within its capacity after a batch that stored `stored` blocks.
    pub(super) fn bound(&mut self, stored: usize) {
        let capacity = self.config.capacity;
        let high_water = capacity / 10 * 9;
        if self.entries <= high_water {
            return;
        }
        // Second chances while there is room; none once the bound itself is reached.
        let mut visits = MIN_VISITS + VISITS_PER_BLOCK * stored;
        while self.entries > high_water && visits > 0 {
            let before = visits;
            self.sweep_largest(&mut visits, high_water, true);
            if visits == before {
                break;
            }
        }
        while self.entries > capacity {
            let before = self.entries;
            let mut unlimited = usize::MAX;
            self.sweep_largest(&mut unlimited, capacity, false);
            if self.entries == before {
                break;
            }
        }
    }

    /// Moves the clock hand of the endpoint holding the most entries, dropping entries until
    /// the index is down to `target` or `visits` run out. With `second_chance`, an entry stored
    /// since the last pass is spared (and its mark cleared).
    fn sweep_largest(&mut self, visits: &mut usize, target: usize, second_chance: bool) {
        let current = self.victim.and_then(|(id, sweeps)| {
            let len = self.endpoints.get(&id)?.blocks.len();
            (sweeps < RESCAN_EVERY && len > 0).then_some((id, sweeps))
        });
        let (id, sweeps) = match current {
            Some(victim) => victim,
            None => match self.endpoints.iter().max_by_key(|(_, s)| s.blocks.len()) {
                Some((id, _)) => (*id, 0),
                None => return,
            },
        };
        self.victim = Some((id, sweeps + 1));
        let Some(state) = self.endpoints.get_mut(&id) else {
            return;
        };
        let slot = state.slot;
        // At most one entry per endpoint, however long nobody takes them.
        if !self.evicted_from.contains(&id) {
            self.evicted_from.push(id);
        }
        while self.entries > target && *visits > 0 && state.blocks.len() > 0 {
            *visits -= 1;
            state.hand = state.blocks.wrap(state.hand);
            let Some(held) = state.blocks.at_mut(state.hand) else {
                state.hand = state.hand.next();
                continue;
            };
            if second_chance && held.tagged_key & REFERENCED != 0 {
                held.tagged_key &= !REFERENCED;
                state.hand = state.hand.next();
                continue;
            }
            // Removal shifts the next entry into this slot: the hand stays to look at it.
            let gone = state.blocks.remove_at(state.hand);
            let key = gone.router_key();
            if let Some(o) = state.offload.as_deref_mut() {
                o.forget(gone.hash);
            }
            drop_slot(
                &mut self.blocks,
                &mut self.wide,
                key,
                slot,
                &mut state.stats,
            );
            state.stats.capacity_evictions += 1;
            self.entries -= 1;
        }
    }
}
