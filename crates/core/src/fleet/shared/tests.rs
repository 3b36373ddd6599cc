//! The shared-prefix table against its naive model: one table entry per block, as the fleet
//! kept it before the runs.

use std::collections::{HashMap, VecDeque};

use super::*;

/// The per-block table: each block's last continuation and how often it changed, the oldest
/// blocks forgotten first.
struct PerBlock {
    capacity: usize,
    next: HashMap<RouterKey, (RouterKey, u16)>,
    order: VecDeque<RouterKey>,
}

impl PerBlock {
    fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            next: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    fn shared(changes: u16) -> bool {
        changes + 1 >= MIN_CONTINUATIONS
    }

    fn shared_blocks(&self, keys: &[RouterKey]) -> usize {
        let mut shared = 0;
        for (i, key) in keys.iter().enumerate() {
            match self.next.get(key) {
                Some(&(_, changes)) if Self::shared(changes) => shared = i + 1,
                Some(_) => {}
                None => break,
            }
        }
        shared
    }

    fn record(&mut self, keys: &[RouterKey]) {
        for pair in keys.windows(2) {
            let (key, child) = (pair[0], pair[1]);
            if let Some((last, changes)) = self.next.get_mut(&key) {
                if *last != child {
                    *last = child;
                    *changes = changes.saturating_add(1);
                }
            } else {
                self.next.insert(key, (child, 0));
                self.order.push_back(key);
            }
        }
        while self.order.len() > self.capacity {
            if let Some(old) = self.order.pop_front() {
                self.next.remove(&old);
            }
        }
    }
}

fn keys(ids: &[u64]) -> Vec<RouterKey> {
    ids.iter().map(|&i| RouterKey(i)).collect()
}

/// Chained, as router keys are: a key names its whole prefix.
fn chained(ids: &[u64]) -> Vec<RouterKey> {
    let mut key = 0u64;
    ids.iter()
        .map(|id| {
            key = key.wrapping_mul(31).wrapping_add(id + 1);
            RouterKey(key)
        })
        .collect()
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
    /// Every answer, and the blocks remembered, are the per-block table's: prompts that share
    /// prefixes, fork inside earlier ones, return to old continuations, and a capacity reached
    /// (or not) so that runs are forgotten from the front, whole or in part.
    #[test]
    fn answers_as_the_per_block_table(
        capacity in 1usize..40,
        prompts in proptest::collection::vec(
            (proptest::collection::vec(0u64..3, 0..12), proptest::bool::ANY),
            1..60,
        ),
    ) {
        let (mut runs, mut naive) = (SharedPrefixes::new(capacity), PerBlock::new(capacity));
        for (ids, record) in prompts {
            let keys = chained(&ids);
            let before = naive.shared_blocks(&keys);
            proptest::prop_assert_eq!(runs.shared_blocks(&keys), before);
            if record {
                naive.record(&keys);
                proptest::prop_assert_eq!(runs.record_shared(&keys), before);
            }
            proptest::prop_assert_eq!(runs.len(), naive.next.len());
        }
    }
}

#[test]
fn bounded() {
    let mut s = SharedPrefixes::new(3);
    s.record(&keys(&[1, 2, 3, 4, 5, 6]));
    assert_eq!(s.len(), 3);
}
