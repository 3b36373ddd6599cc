//! Session → last endpoint, bounded: the oldest sessions are forgotten first.
//!
//! Sessions are kept by a 64-bit hash of the client's session id, not the id itself: the id is
//! a request header of any length, and the table's memory must be bounded by its entry count.

use std::collections::VecDeque;

use hashbrown::HashMap;

use crate::index::EndpointId;

/// The table key of a session id.
fn session_key(session: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(session.as_bytes())
}

/// The last endpoint of each recent session.
#[derive(Debug)]
pub struct Sessions {
    capacity: usize,
    /// Session hash → (endpoint, stamp of the last `set`).
    last: HashMap<u64, (EndpointId, u64)>,
    /// Insertion order with the stamp the entry had then; stale stamps are skipped.
    order: VecDeque<(u64, u64)>,
    stamp: u64,
}

impl Sessions {
    /// At most `capacity` sessions remembered.
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            last: HashMap::new(),
            order: VecDeque::new(),
            stamp: 0,
        }
    }

    /// The endpoint `session` used last.
    pub fn get(&self, session: &str) -> Option<EndpointId> {
        self.last.get(&session_key(session)).map(|(e, _)| *e)
    }

    /// Records that `session` went to `endpoint`.
    pub fn set(&mut self, session: &str, endpoint: EndpointId) {
        self.stamp += 1;
        let key = session_key(session);
        self.last.insert(key, (endpoint, self.stamp));
        self.order.push_back((key, self.stamp));
        while self.last.len() > self.capacity || self.order.len() > 2 * self.capacity {
            let Some((key, stamp)) = self.order.pop_front() else {
                break;
            };
            if self.last.get(&key).is_some_and(|(_, s)| *s == stamp) {
                self.last.remove(&key);
            }
        }
    }

    /// Forgets every session that last went to `endpoint`.
    pub fn forget_endpoint(&mut self, endpoint: EndpointId) {
        self.last.retain(|_, (e, _)| *e != endpoint);
    }

    /// Sessions remembered.
    pub fn len(&self) -> usize {
        self.last.len()
    }

    /// Whether none is remembered.
    pub fn is_empty(&self) -> bool {
        self.last.is_empty()
    }
}
