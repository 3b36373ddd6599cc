//! The router's own memory of where it sent which block chains, for routing without engine
//! events (approximate mode) and for the window before an engine's `BlockStored` arrives
//! (the predicted overlay).
//!
//! Entries expire after a TTL and the whole history holds at most `capacity` (block, endpoint)
//! entries, the oldest dropped first, so it never grows without bound. Time is passed in.

use std::collections::VecDeque;

use hashbrown::HashMap;
use smallvec::SmallVec;

use crate::index::EndpointId;
use crate::keys::RouterKey;

/// One key's holders and their expiry times.
type Holders = SmallVec<[(EndpointId, f64); 1]>;

/// Where blocks were recently sent.
#[derive(Debug)]
pub struct RoutingHistory {
    ttl_s: f64,
    capacity: usize,
    /// Each key's holders with their expiry, in endpoint order (an endpoint at most once).
    /// Most keys (a conversation's own blocks) have one holder, kept inline: recording a
    /// request's blocks then allocates nothing per block.
    entries: HashMap<RouterKey, Holders>,
    /// Insertion order, for the capacity bound: (key, endpoint, expiry at insertion).
    order: VecDeque<(RouterKey, EndpointId, f64)>,
}

impl RoutingHistory {
    /// A history whose entries live `ttl_s` seconds, holding at most `capacity` entries.
    pub fn new(ttl_s: f64, capacity: usize) -> Self {
        Self {
            ttl_s,
            capacity: capacity.max(1),
            entries: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    /// Records that `keys` were sent to `endpoint` at time `now` (seconds).
    pub fn record(&mut self, endpoint: EndpointId, keys: &[RouterKey], now: f64) {
        let expiry = now + self.ttl_s;
        for key in keys {
            let holders = self.entries.entry(*key).or_default();
            match holders.binary_search_by_key(&endpoint, |(e, _)| *e) {
                Ok(at) => holders[at].1 = expiry,
                Err(at) => holders.insert(at, (endpoint, expiry)),
            }
            self.order.push_back((*key, endpoint, expiry));
        }
        while self.order.len() > self.capacity {
            self.drop_oldest();
        }
    }

    fn drop_oldest(&mut self) {
        let Some((key, endpoint, expiry)) = self.order.pop_front() else {
            return;
        };
        if let Some(holders) = self.entries.get_mut(&key) {
            // Only if this record is still the entry's latest: a newer record keeps it alive.
            if let Ok(at) = holders.binary_search_by_key(&endpoint, |(e, _)| *e)
                && holders[at].1 <= expiry
            {
                holders.remove(at);
            }
            if holders.is_empty() {
                self.entries.remove(&key);
            }
        }
    }

    /// Brings forward the expiry of `endpoint`'s entries for `keys` to `expiry` (never later
    /// than they were): a prediction that the engine's own events are about to confirm or
    /// refute should not outlive them.
    pub fn shorten(&mut self, endpoint: EndpointId, keys: &[RouterKey], expiry: f64) {
        for key in keys {
            if let Some(holders) = self.entries.get_mut(key)
                && let Ok(at) = holders.binary_search_by_key(&endpoint, |(e, _)| *e)
            {
                let x = &mut holders[at].1;
                *x = x.min(expiry);
            }
        }
    }

    /// Drops expired entries (call now and then; lookups ignore expired entries anyway).
    pub fn expire(&mut self, now: f64) {
        while self.order.front().is_some_and(|(_, _, x)| *x <= now) {
            self.drop_oldest();
        }
    }

    /// Forgets everything sent to `endpoint` (it restarted or left).
    pub fn forget_endpoint(&mut self, endpoint: EndpointId) {
        self.entries.retain(|_, holders| {
            holders.retain(|(e, _)| *e != endpoint);
            !holders.is_empty()
        });
        self.order.retain(|(_, e, _)| *e != endpoint);
    }

    /// Each endpoint's longest prefix of `keys` sent to it and not expired at `now`, in endpoint
    /// order.
    pub fn longest_prefixes(&self, keys: &[RouterKey], now: f64) -> Vec<(EndpointId, u32)> {
        let Some(first) = keys.first().and_then(|k| self.entries.get(k)) else {
            return Vec::new();
        };
        // In endpoint order (as holders are), so that each key's holders are matched in
        // O(holders × log active), not O(holders × active): a hot prefix (a shared system
        // prompt) may be held by hundreds of endpoints.
        let mut active: Vec<(EndpointId, u32)> = first
            .iter()
            .filter(|(_, x)| *x > now)
            .map(|(e, _)| (*e, 1))
            .collect();
        for (i, key) in keys.iter().enumerate().skip(1) {
            let Some(holders) = self.entries.get(key) else {
                break;
            };
            let mut any = false;
            // An endpoint appears once among a key's holders.
            for (h, x) in holders {
                if *x <= now {
                    continue;
                }
                if let Ok(at) = active.binary_search_by_key(h, |(e, _)| *e)
                    && active[at].1 == i as u32
                {
                    active[at].1 += 1;
                    any = true;
                }
            }
            if !any {
                break;
            }
        }
        active
    }

    /// Records held, one per block sent to an endpoint (a re-sent block counts again until its
    /// older record is dropped); what the capacity bounds.
    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// Whether the history is empty.
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn keys(n: u64, salt: u64) -> Vec<RouterKey> {
        (0..n).map(|i| RouterKey(i * 1000 + salt)).collect()
    }

    #[test]
    fn remembers_prefixes_until_they_expire() {
        let mut h = RoutingHistory::new(10.0, 100);
        h.record(EndpointId(1), &keys(5, 0), 0.0);
        h.record(EndpointId(2), &keys(2, 0), 5.0);
        assert_eq!(
            h.longest_prefixes(&keys(8, 0), 6.0),
            vec![(EndpointId(1), 5), (EndpointId(2), 2)]
        );
        assert_eq!(
            h.longest_prefixes(&keys(8, 0), 12.0),
            vec![(EndpointId(2), 2)]
        );
        h.expire(20.0);
        assert!(h.is_empty());
    }

    #[test]
    fn shortening_only_brings_expiry_forward() {
        let mut h = RoutingHistory::new(10.0, 100);
        h.record(EndpointId(1), &keys(3, 0), 0.0);
        h.shorten(EndpointId(1), &keys(3, 0), 2.0);
        h.shorten(EndpointId(1), &keys(3, 0), 5.0);
        assert_eq!(
            h.longest_prefixes(&keys(3, 0), 1.0),
            vec![(EndpointId(1), 3)]
        );
        assert_eq!(h.longest_prefixes(&keys(3, 0), 3.0), vec![]);
    }

    #[test]
    fn capacity_drops_the_oldest_records() {
        let mut h = RoutingHistory::new(100.0, 6);
        h.record(EndpointId(1), &keys(4, 0), 0.0);
        h.record(EndpointId(2), &keys(4, 7), 1.0);
        assert_eq!(h.len(), 6);
        assert_eq!(h.longest_prefixes(&keys(4, 0), 2.0), vec![]);
        assert_eq!(
            h.longest_prefixes(&keys(4, 7), 2.0),
            vec![(EndpointId(2), 4)]
        );
    }

    proptest! {
        /// Whatever is recorded, the history never exceeds its capacity and a lookup never
        /// reports more than the keys asked for.
        #[test]
        fn bounded_and_sane(ops in proptest::collection::vec((0u32..4, 1u64..20, 0u64..3, 0.0f64..50.0), 0..60)) {
            let mut h = RoutingHistory::new(5.0, 40);
            for (e, n, salt, t) in ops {
                h.record(EndpointId(e), &keys(n, salt), t);
                if n % 3 == 0 {
                    h.shorten(EndpointId((e + 1) % 4), &keys(n, salt), t + 1.0);
                }
                if n % 7 == 0 {
                    h.expire(t);
                }
                prop_assert!(h.len() <= 40);
                for holders in h.entries.values() {
                    prop_assert!(holders.windows(2).all(|w| w[0].0 < w[1].0), "holders in endpoint order, once each");
                }
                let asked = keys(20, salt);
                let found = h.longest_prefixes(&asked, t);
                for (_, len) in &found {
                    prop_assert!(*len <= 20);
                }
                // Each endpoint's own walk along the keys, as the naive model.
                let naive: Vec<(EndpointId, u32)> = (0..4)
                    .map(|e| {
                        let held = asked
                            .iter()
                            .take_while(|k| {
                                h.entries
                                    .get(*k)
                                    .is_some_and(|hs| hs.iter().any(|(x, at)| x.0 == e && *at > t))
                            })
                            .count();
                        (EndpointId(e), held as u32)
                    })
                    .filter(|(_, n)| *n > 0)
                    .collect();
                prop_assert_eq!(found, naive);
            }
        }
    }
}
