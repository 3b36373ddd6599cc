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
//!
//! It answers exactly as a table of block → (last continuation, changes) would (the naive model
//! its tests hold it to), but keeps the blocks as runs: consecutive blocks of one chain,
//! recorded one after another, each followed only by the next (one continuation ever seen).
//! Only a run's last block can be a branch point, so walking a prompt costs one table
//! operation per run it goes through (the system prompt, each earlier turn), not one per block.
//! A prompt that leaves a run part way splits it there (its last block gets a second
//! continuation); forgetting the oldest blocks trims runs from the front (a run's blocks were
//! recorded in order, so the oldest block always starts its run).
//!
//! The runs live in a [`RunSlab`], as the routing history's do. Keys are assumed not to collide
//! (64-bit chained hashes), as in the routing history's tree.

use std::collections::VecDeque;

use crate::keys::RouterKey;
use crate::run_slab::RunSlab;

#[cfg(test)]
mod tests;

/// Different continuations after which a prefix counts as shared between conversations.
pub const MIN_CONTINUATIONS: u16 = 3;

// A block inside a run has had one continuation, so it never counts as shared.
const _: () = assert!(MIN_CONTINUATIONS > 1);

/// What the table keeps about a run of consecutive blocks of one chain (every block but the
/// last followed only by the next): its last block's continuations.
#[derive(Debug)]
struct Continuations {
    /// The last continuation seen after its last block.
    last: u64,
    /// How often that continuation changed (a lower bound on the distinct continuations,
    /// minus one).
    changes: u16,
}

impl Continuations {
    /// Whether its last block counts as shared.
    fn shared(&self) -> bool {
        self.changes + 1 >= MIN_CONTINUATIONS
    }

    /// Its last block was followed by `child`.
    fn follow(&mut self, child: RouterKey) {
        if self.last != child.0 {
            self.last = child.0;
            self.changes = self.changes.saturating_add(1);
        }
    }
}

/// The prefix tree's branch points, as far as the router has seen.
#[derive(Debug)]
pub struct SharedPrefixes {
    capacity: usize,
    /// The runs, each by its first remembered key.
    runs: RunSlab<Continuations>,
    /// Every remembered block, oldest first.
    order: VecDeque<RouterKey>,
}

impl SharedPrefixes {
    /// Remembers at most `capacity` blocks.
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            runs: RunSlab::default(),
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
        let (mut shared, mut walking, mut depth) = (0, true, 0);
        // A block is remembered with its continuation, so a prompt's last block is not
        // recorded, only read (while the walk has found every block before it).
        while depth < keys.len() && (walking || depth + 1 < keys.len()) {
            let Some((id, through)) = self.runs.find(&keys[depth..]) else {
                walking = false;
                if depth + 1 < keys.len() {
                    depth = self.add_run(keys, depth);
                }
                continue;
            };
            let run = self.runs.get_mut(id);
            let end = depth + through;
            if through == run.keys().len() {
                if walking && run.info.shared() {
                    shared = end;
                }
                if let Some(&child) = keys.get(end) {
                    run.info.follow(child);
                }
            } else if let Some(&child) = keys.get(end) {
                // The prompt leaves the run after its block at `end - 1`: that block's second
                // continuation, so it ends a run from now on.
                self.split(id, through, child);
            }
            depth = end;
        }
        self.forget_oldest();
        shared
    }

    /// Adds the blocks of `keys` from `depth` (not remembered) up to the next remembered one
    /// or the prompt's last, as a new run; returns the depth where it stops.
    fn add_run(&mut self, keys: &[RouterKey], depth: usize) -> usize {
        let mut end = depth + 1;
        while end + 1 < keys.len() && self.runs.starting_with(&keys[end]).is_none() {
            end += 1;
        }
        let continuations = Continuations {
            last: keys[end].0,
            changes: 0,
        };
        // `keys[depth]` starts no run: the walk did not find it.
        if self.runs.add(&keys[depth..end], continuations).is_some() {
            self.order.extend(&keys[depth..end]);
        }
        end
    }

    /// Splits run `id` after its first `through` blocks (fewer than it has), whose last is now
    /// followed by `child`. On a key collision (the rest's first key already starts a run)
    /// nothing changes and the continuation goes unrecorded.
    fn split(&mut self, id: u32, through: usize, child: RouterKey) {
        let front = &self.runs.get(id).info;
        let rest = Continuations {
            last: front.last,
            changes: front.changes,
        };
        if self.runs.split_back_off(id, through, rest).is_some() {
            // An inner block had one continuation: `child` is its second.
            self.runs.get_mut(id).info = Continuations {
                last: child.0,
                changes: 1,
            };
        }
    }

    /// Forgets the oldest blocks beyond the capacity, a run's front at a time.
    fn forget_oldest(&mut self) {
        while self.order.len() > self.capacity {
            let excess = self.order.len() - self.capacity;
            let oldest = self.order[0];
            let Some(id) = self.runs.starting_with(&oldest) else {
                // Not a run's first block: only after a key collision.
                self.order.pop_front();
                continue;
            };
            let live = self.runs.get(id).keys();
            let mut count = 1;
            while count < excess.min(live.len()) && self.order[count] == live[count] {
                count += 1;
            }
            let whole = count == live.len();
            self.order.drain(..count);
            if whole {
                self.runs.free(id);
            } else {
                self.runs.forget_front(id, count);
            }
        }
    }

    /// Blocks of `keys` shared with other prompts: up to and including the deepest block
    /// after which `MIN_CONTINUATIONS` different continuations were seen (0 when none).
    pub fn shared_blocks(&self, keys: &[RouterKey]) -> usize {
        let (mut shared, mut depth) = (0, 0);
        while let Some((id, through)) = self.runs.find(&keys[depth..]) {
            let run = self.runs.get(id);
            if through == run.keys().len() && run.info.shared() {
                shared = depth + through;
            }
            depth += through;
        }
        shared
    }

    /// Blocks remembered.
    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// Whether nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }
}
