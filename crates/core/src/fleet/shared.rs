//! Which part of a prompt is shared between conversations: the prefix up to the deepest block
//! after which the router has seen different continuations (a branch in the prefix tree).
//!
//! A system prompt is followed by every conversation's first message, so it branches; a
//! conversation's own history is only ever extended, so it does not. The scheduler lets a new
//! conversation copy a shared prefix onto an endpoint with fewer conversations (see
//! [`BalanceTolerance`](crate::schedule::BalanceTolerance)); a conversation's own history is
//! never given up that way. Bounded: the oldest blocks are forgotten first.

use std::collections::VecDeque;

use hashbrown::HashMap;

use crate::keys::RouterKey;

/// What followed a block.
#[derive(Debug, Clone, Copy)]
enum Next {
    /// One continuation seen so far.
    One(RouterKey),
    /// At least two different continuations.
    Branched,
}

/// The prefix tree's branch points, as far as the router has seen.
#[derive(Debug)]
pub struct SharedPrefixes {
    capacity: usize,
    next: HashMap<RouterKey, Next>,
    order: VecDeque<RouterKey>,
}

impl SharedPrefixes {
    /// Remembers at most `capacity` blocks.
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            next: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    /// Records a prompt's block keys.
    pub fn record(&mut self, keys: &[RouterKey]) {
        for pair in keys.windows(2) {
            let (key, child) = (pair[0], pair[1]);
            if let Some(next) = self.next.get_mut(&key) {
                if matches!(next, Next::One(seen) if *seen != child) {
                    *next = Next::Branched;
                }
            } else {
                self.next.insert(key, Next::One(child));
                self.order.push_back(key);
            }
        }
        while self.order.len() > self.capacity {
            if let Some(old) = self.order.pop_front() {
                self.next.remove(&old);
            }
        }
    }

    /// Blocks of `keys` shared with other prompts: up to and including the deepest block
    /// after which different continuations were seen (0 when none).
    pub fn shared_blocks(&self, keys: &[RouterKey]) -> usize {
        let mut shared = 0;
        for (i, key) in keys.iter().enumerate() {
            match self.next.get(key) {
                Some(Next::Branched) => shared = i + 1,
                Some(Next::One(_)) => {}
                None => break,
            }
        }
        shared
    }

    /// Blocks remembered.
    pub fn len(&self) -> usize {
        self.next.len()
    }

    /// Whether nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.next.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(ids: &[u64]) -> Vec<RouterKey> {
        ids.iter().map(|&i| RouterKey(i)).collect()
    }

    #[test]
    fn a_system_prompt_branches_and_a_history_does_not() {
        let mut s = SharedPrefixes::new(100);
        // Two conversations under the system prompt [1, 2].
        s.record(&keys(&[1, 2, 10, 11]));
        assert_eq!(s.shared_blocks(&keys(&[1, 2, 10, 11, 12])), 0);
        s.record(&keys(&[1, 2, 20]));
        assert_eq!(s.shared_blocks(&keys(&[1, 2, 30])), 2);
        // The first conversation's next turn only extends its own history.
        s.record(&keys(&[1, 2, 10, 11, 12, 13]));
        assert_eq!(s.shared_blocks(&keys(&[1, 2, 10, 11, 12, 13, 14])), 2);
    }

    #[test]
    fn bounded() {
        let mut s = SharedPrefixes::new(3);
        s.record(&keys(&[1, 2, 3, 4, 5, 6]));
        assert_eq!(s.len(), 3);
    }
}
