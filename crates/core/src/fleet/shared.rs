//! Which part of a prompt is shared between conversations: the prefix up to the deepest block
//! after which the router has seen several different continuations (a branch point of the
//! prefix tree).
//!
//! A system prompt is followed by every conversation's first message, so it branches many
//! ways; a conversation's own history is extended, and at most forks once or twice (a
//! regenerated answer, a partial last block completed by the next turn), so it does not count
//! as shared until [`MIN_CONTINUATIONS`] different continuations were seen. The fleet uses it to
//! tell a new conversation (a placement, which balancing evens out) from a follow-up turn.
//! Bounded: the oldest blocks are forgotten first.

use std::collections::VecDeque;

use hashbrown::HashMap;

use crate::keys::RouterKey;

/// Different continuations after which a prefix counts as shared between conversations.
pub const MIN_CONTINUATIONS: u16 = 3;

/// What followed a block: the last continuation seen, and how often the continuation
/// changed (a lower bound on the distinct continuations, minus one).
#[derive(Debug, Clone, Copy)]
struct Next {
    last: RouterKey,
    changes: u16,
}

impl Next {
    fn shared(&self) -> bool {
        self.changes + 1 >= MIN_CONTINUATIONS
    }
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
        self.record_shared(keys);
    }

    /// Records a prompt's block keys, and returns what [`SharedPrefixes::shared_blocks`] said
    /// of them just before: one walk along the keys for both.
    pub fn record_shared(&mut self, keys: &[RouterKey]) -> usize {
        // The walk of `shared_blocks`, read off each block's entry before it is updated (a
        // prompt's chained keys do not repeat, so no entry is read after its update).
        let (mut shared, mut walking) = (0, true);
        for (i, pair) in keys.windows(2).enumerate() {
            let (key, child) = (pair[0], pair[1]);
            if let Some(next) = self.next.get_mut(&key) {
                if walking && next.shared() {
                    shared = i + 1;
                }
                if next.last != child {
                    next.last = child;
                    next.changes = next.changes.saturating_add(1);
                }
            } else {
                walking = false;
                self.next.insert(
                    key,
                    Next {
                        last: child,
                        changes: 0,
                    },
                );
                self.order.push_back(key);
            }
        }
        if walking
            && let Some(last) = keys.last()
            && self.next.get(last).is_some_and(Next::shared)
        {
            shared = keys.len();
        }
        while self.order.len() > self.capacity {
            if let Some(old) = self.order.pop_front() {
                self.next.remove(&old);
            }
        }
        shared
    }

    /// Blocks of `keys` shared with other prompts: up to and including the deepest block
    /// after which [`MIN_CONTINUATIONS`] different continuations were seen (0 when none).
    pub fn shared_blocks(&self, keys: &[RouterKey]) -> usize {
        let mut shared = 0;
        for (i, key) in keys.iter().enumerate() {
            match self.next.get(key) {
                Some(next) if next.shared() => shared = i + 1,
                Some(_) => {}
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
        // Conversations under the system prompt [1, 2].
        s.record(&keys(&[1, 2, 10, 11]));
        s.record(&keys(&[1, 2, 20]));
        assert_eq!(
            s.shared_blocks(&keys(&[1, 2, 40])),
            0,
            "two conversations are few"
        );
        s.record(&keys(&[1, 2, 30]));
        assert_eq!(s.shared_blocks(&keys(&[1, 2, 50])), 2);
        // The first conversation forks once (a regenerated answer) and goes on: its own
        // history is not shared.
        s.record(&keys(&[1, 2, 10, 11, 12]));
        s.record(&keys(&[1, 2, 10, 11, 13, 14]));
        s.record(&keys(&[1, 2, 10, 11, 13, 14, 15]));
        assert_eq!(s.shared_blocks(&keys(&[1, 2, 10, 11, 13, 14, 15, 16])), 2);
    }

    proptest::proptest! {
        /// Recording and measuring in one walk says what measuring, then recording, says.
        #[test]
        fn one_walk_measures_as_the_walk_before_the_record(
            prompts in proptest::collection::vec(proptest::collection::vec(0u64..6, 0..8), 1..40),
        ) {
            let (mut fused, mut apart) = (SharedPrefixes::new(20), SharedPrefixes::new(20));
            for ids in prompts {
                // Chained, as router keys are: a key names its whole prefix.
                let mut chained = Vec::new();
                let mut key = 0u64;
                for id in ids {
                    key = key.wrapping_mul(31).wrapping_add(id + 1);
                    chained.push(key);
                }
                let keys = keys(&chained);
                let before = apart.shared_blocks(&keys);
                apart.record(&keys);
                proptest::prop_assert_eq!(fused.record_shared(&keys), before);
                proptest::prop_assert_eq!(fused.len(), apart.len());
            }
        }
    }

    #[test]
    fn bounded() {
        let mut s = SharedPrefixes::new(3);
        s.record(&keys(&[1, 2, 3, 4, 5, 6]));
        assert_eq!(s.len(), 3);
    }
}
