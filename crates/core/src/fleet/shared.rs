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
//! Keys are assumed not to collide (64-bit chained hashes), as in the routing history's tree.

use std::collections::VecDeque;

use hashbrown::HashMap;

use crate::history::chain_overlap;
use crate::keys::RouterKey;

#[cfg(test)]
mod tests;

/// Different continuations after which a prefix counts as shared between conversations.
pub const MIN_CONTINUATIONS: u16 = 3;

// A block inside a run has had one continuation, so it never counts as shared.
const _: () = assert!(MIN_CONTINUATIONS > 1);

/// Consecutive blocks of one chain; every block but the last is followed only by the next.
#[derive(Debug, Default)]
struct Run {
    /// Its blocks' keys from `head` on (those before were forgotten).
    keys: Vec<RouterKey>,
    /// Blocks forgotten from the front.
    head: usize,
    /// The last continuation seen after its last block.
    last: u64,
    /// How often that continuation changed (a lower bound on the distinct continuations,
    /// minus one).
    changes: u16,
}

impl Run {
    /// Its blocks still remembered.
    fn live(&self) -> &[RouterKey] {
        &self.keys[self.head..]
    }

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

    /// Forgets its first `count` blocks (fewer than it has).
    fn forget_front(&mut self, count: usize) {
        self.head += count;
        if self.head * 2 > self.keys.len() {
            self.keys.drain(..self.head);
            self.keys.shrink_to(2 * self.keys.len());
            self.head = 0;
        }
    }
}

/// The prefix tree's branch points, as far as the router has seen.
#[derive(Debug)]
pub struct SharedPrefixes {
    capacity: usize,
    /// The runs, in a slab (`free` lists the unused).
    runs: Vec<Run>,
    free: Vec<u32>,
    /// Each run by its first remembered key.
    starts: HashMap<RouterKey, u32>,
    /// Every remembered block, oldest first.
    order: VecDeque<RouterKey>,
}

impl SharedPrefixes {
    /// Remembers at most `capacity` blocks.
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            runs: Vec::new(),
            free: Vec::new(),
            starts: HashMap::new(),
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
            let Some(&id) = self.starts.get(&keys[depth]) else {
                walking = false;
                if depth + 1 < keys.len() {
                    depth = self.add_run(keys, depth);
                }
                continue;
            };
            let run = &mut self.runs[id as usize];
            let through = chain_overlap(&keys[depth..], run.live());
            let end = depth + through;
            if through == run.live().len() {
                if walking && run.shared() {
                    shared = end;
                }
                if let Some(&child) = keys.get(end) {
                    run.follow(child);
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
        while end + 1 < keys.len() && !self.starts.contains_key(&keys[end]) {
            end += 1;
        }
        let id = self.alloc();
        let run = &mut self.runs[id as usize];
        run.keys.extend_from_slice(&keys[depth..end]);
        run.last = keys[end].0;
        self.starts.insert(keys[depth], id);
        self.order.extend(&keys[depth..end]);
        end
    }

    /// Splits run `id` after its first `through` blocks (fewer than it has), whose last is now
    /// followed by `child`.
    fn split(&mut self, id: u32, through: usize, child: RouterKey) {
        let front = &mut self.runs[id as usize];
        let rest_keys = front.keys.split_off(front.head + through);
        // The front keeps no more than twice its keys' allocation (memory follows the blocks).
        front.keys.shrink_to(2 * front.keys.len());
        let (last, changes) = (front.last, front.changes);
        // An inner block had one continuation: `child` is its second.
        front.last = child.0;
        front.changes = 1;
        let first = rest_keys[0];
        let rest = self.alloc();
        let back = &mut self.runs[rest as usize];
        back.keys = rest_keys;
        back.last = last;
        back.changes = changes;
        self.starts.insert(first, rest);
    }

    /// Forgets the oldest blocks beyond the capacity, a run's front at a time.
    fn forget_oldest(&mut self) {
        while self.order.len() > self.capacity {
            let excess = self.order.len() - self.capacity;
            let oldest = self.order[0];
            let Some(id) = self.starts.remove(&oldest) else {
                // Not a run's first block: only after a key collision.
                self.order.pop_front();
                continue;
            };
            let run = &mut self.runs[id as usize];
            let live = run.live();
            let mut count = 1;
            while count < excess.min(live.len()) && self.order[count] == live[count] {
                count += 1;
            }
            self.order.drain(..count);
            if count == live.len() {
                // Freed with its buffer: a reused slot must not keep a long run's allocation.
                run.keys = Vec::new();
                run.head = 0;
                self.free.push(id);
            } else {
                run.forget_front(count);
                let first = run.live()[0];
                self.starts.insert(first, id);
            }
        }
    }

    /// An unused run, cleared.
    fn alloc(&mut self) -> u32 {
        let id = self.free.pop().unwrap_or_else(|| {
            self.runs.push(Run::default());
            (self.runs.len() - 1) as u32
        });
        let run = &mut self.runs[id as usize];
        run.keys.clear();
        run.head = 0;
        run.changes = 0;
        id
    }

    /// Blocks of `keys` shared with other prompts: up to and including the deepest block
    /// after which [`MIN_CONTINUATIONS`] different continuations were seen (0 when none).
    pub fn shared_blocks(&self, keys: &[RouterKey]) -> usize {
        let (mut shared, mut depth) = (0, 0);
        while depth < keys.len() {
            let Some(&id) = self.starts.get(&keys[depth]) else {
                break;
            };
            let run = &self.runs[id as usize];
            let through = chain_overlap(&keys[depth..], run.live());
            if through == run.live().len() && run.shared() {
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
