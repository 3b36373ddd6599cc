//! A flat slab of runs: consecutive block keys of one chain, each run with its owner's
//! information (`I`), found by its first key. The routing history's chain tree and the fleet's
//! shared-prefix table both keep prompts this way (this module knows neither).
//!
//! Runs live in one vector and are named by their index (a `u32`); a freed run's slot goes on a
//! free list and is reused (last freed, first reused). Memory follows the keys held: a run's
//! buffer never holds more than twice its keys (a few more for the shortest runs), whatever was
//! cut from it (a split, or keys forgotten from the front), and a freed run gives its buffer
//! back, so a reused slot never keeps a long run's allocation.
//!
//! Router keys chain their parents, so a key names its whole prefix: once a chain leaves
//! another it never meets it again ([`chain_overlap`]). Keys are assumed not to collide (64-bit
//! chained hashes); where two runs would start with the same key, the operation that would make
//! the second is refused (`None`) and nothing changes, so the table of first keys stays exact.

use hashbrown::HashMap;

use crate::keys::RouterKey;

/// Consecutive block keys of one chain, and its owner's information about them.
#[derive(Debug)]
pub(crate) struct Run<I> {
    /// Its keys from `head` on (those before were cut from the front, not yet compacted).
    keys: Vec<RouterKey>,
    head: usize,
    /// In use (not on the free list).
    live: bool,
    /// What the slab's owner keeps about the run.
    pub(crate) info: I,
}

impl<I> Run<I> {
    /// Its keys (never empty while it is in use).
    pub(crate) fn keys(&self) -> &[RouterKey] {
        &self.keys[self.head..]
    }

    /// Whether it is in use.
    pub(crate) fn is_live(&self) -> bool {
        self.live
    }

    /// Cuts its first `count` keys (fewer than it has). The buffer is compacted, to just the
    /// keys left, once more than half of it is cut: cutting one key at a time costs O(1)
    /// amortized, and the buffer never holds more than twice the keys left.
    fn cut_front(&mut self, count: usize) {
        self.head += count;
        if self.head * 2 > self.keys.len() {
            self.compact();
        }
    }

    /// Drops the cut keys from the buffer and gives back the room they took.
    fn compact(&mut self) {
        self.keys.drain(..self.head);
        self.keys.shrink_to_fit();
        self.head = 0;
    }
}

/// Runs in a slab, each found by its first key.
#[derive(Debug)]
pub(crate) struct RunSlab<I> {
    runs: Vec<Run<I>>,
    /// Slots not in use, for reuse (the last freed on top).
    free: Vec<u32>,
    /// Each run in use by its first key.
    starts: HashMap<RouterKey, u32>,
}

impl<I> Default for RunSlab<I> {
    fn default() -> Self {
        Self {
            runs: Vec::new(),
            free: Vec::new(),
            starts: HashMap::new(),
        }
    }
}

impl<I> RunSlab<I> {
    /// Run `id` (in use, or freed: then with no keys).
    pub(crate) fn get(&self, id: u32) -> &Run<I> {
        &self.runs[id as usize]
    }

    /// Run `id`, to change its information.
    pub(crate) fn get_mut(&mut self, id: u32) -> &mut Run<I> {
        &mut self.runs[id as usize]
    }

    /// Runs in use.
    pub(crate) fn len(&self) -> usize {
        self.runs.len() - self.free.len()
    }

    /// Slots ever used: every run's id is below it.
    pub(crate) fn slots(&self) -> u32 {
        self.runs.len() as u32
    }

    /// The run in use that starts with `key`.
    pub(crate) fn starting_with(&self, key: &RouterKey) -> Option<u32> {
        self.starts.get(key).copied()
    }

    /// The run that starts with `chain`'s first key, and how many of its keys `chain` goes
    /// through (at least one); `None` when `chain` is empty or no run starts with its first key.
    pub(crate) fn find(&self, chain: &[RouterKey]) -> Option<(u32, usize)> {
        let id = self.starting_with(chain.first()?)?;
        Some((id, chain_overlap(chain, self.get(id).keys())))
    }

    /// Adds a run of `keys` with `info`; `None` (nothing added) when `keys` is empty or a run
    /// already starts with its first key.
    pub(crate) fn add(&mut self, keys: &[RouterKey], info: I) -> Option<u32> {
        let first = *keys.first()?;
        if self.starts.contains_key(&first) {
            return None;
        }
        let id = self.alloc(info);
        self.runs[id as usize].keys.extend_from_slice(keys);
        self.starts.insert(first, id);
        Some(id)
    }

    /// Splits run `id` after its first `cut` keys (`0 < cut < len`): a new run, with `info`,
    /// takes those first keys and is returned; `id` keeps the rest (so what refers to a run by
    /// its last key still does). `None` (nothing changes) when the rest's first key already
    /// starts a run.
    pub(crate) fn split_front_off(&mut self, id: u32, cut: usize, info: I) -> Option<u32> {
        let keys = self.get(id).keys();
        debug_assert!(0 < cut && cut < keys.len());
        let (first, rest_first) = (keys[0], keys[cut]);
        if self.starts.contains_key(&rest_first) {
            return None;
        }
        let front = self.alloc(info);
        let (front_run, back_run) = pair_mut(&mut self.runs, front as usize, id as usize);
        front_run.keys.extend_from_slice(&back_run.keys()[..cut]);
        back_run.cut_front(cut);
        self.starts.insert(first, front);
        self.starts.insert(rest_first, id);
        Some(front)
    }

    /// Splits run `id` after its first `cut` keys (`0 < cut < len`): `id` keeps those, and a
    /// new run, with `info`, takes the rest and is returned. `None` (nothing changes) when the
    /// rest's first key already starts a run.
    pub(crate) fn split_back_off(&mut self, id: u32, cut: usize, info: I) -> Option<u32> {
        let run = self.get(id);
        debug_assert!(0 < cut && cut < run.keys().len());
        let rest_first = run.keys()[cut];
        if self.starts.contains_key(&rest_first) {
            return None;
        }
        let back = self.alloc(info);
        let run = &mut self.runs[id as usize];
        let rest = run.keys.split_off(run.head + cut);
        // The front keeps just its keys' allocation, not the whole run's.
        run.compact();
        self.runs[back as usize].keys = rest;
        self.starts.insert(rest_first, back);
        Some(back)
    }

    /// Forgets the first `count` keys of run `id` (fewer than it has): it is found by its new
    /// first key from now on.
    pub(crate) fn forget_front(&mut self, id: u32, count: usize) {
        let run = &mut self.runs[id as usize];
        let old_first = run.keys()[0];
        run.cut_front(count);
        let new_first = run.keys()[0];
        if self.starts.get(&old_first) == Some(&id) {
            self.starts.remove(&old_first);
        }
        self.starts.insert(new_first, id);
    }

    /// Frees run `id` (in use) with its buffer; its slot is reused by the next run added.
    pub(crate) fn free(&mut self, id: u32) {
        let run = &mut self.runs[id as usize];
        debug_assert!(run.live, "run {id} freed twice");
        let first = run.keys()[0];
        run.keys = Vec::new();
        run.head = 0;
        run.live = false;
        if self.starts.get(&first) == Some(&id) {
            self.starts.remove(&first);
        }
        self.free.push(id);
    }

    /// Calls `f` on every run in use.
    pub(crate) fn for_each_live_mut(&mut self, mut f: impl FnMut(&mut Run<I>)) {
        for run in self.runs.iter_mut().filter(|r| r.live) {
            f(run);
        }
    }

    /// A slot for a new run with `info` and no keys yet.
    fn alloc(&mut self, info: I) -> u32 {
        let run = Run {
            keys: Vec::new(),
            head: 0,
            live: true,
            info,
        };
        match self.free.pop() {
            Some(id) => {
                self.runs[id as usize] = run;
                id
            }
            None => {
                self.runs.push(run);
                (self.runs.len() - 1) as u32
            }
        }
    }
}

/// How many leading keys two chains that start with the same key share (at least one; both
/// non-empty, `chain[0] == run[0]`). Chained keys: once a chain leaves another it never meets it
/// again, so one comparison says whether the chain goes through all of the shorter, and a
/// binary search finds where it leaves.
pub(crate) fn chain_overlap(chain: &[RouterKey], run: &[RouterKey]) -> usize {
    let common = chain.len().min(run.len());
    if chain[common - 1] == run[common - 1] {
        return common;
    }
    // The first key matches, the last compared does not.
    let (mut same, mut differs) = (0, common - 1);
    while differs - same > 1 {
        let mid = same + (differs - same) / 2;
        if chain[mid] == run[mid] {
            same = mid;
        } else {
            differs = mid;
        }
    }
    same + 1
}

/// Two different elements of a slice, mutably.
fn pair_mut<T>(items: &mut [T], a: usize, b: usize) -> (&mut T, &mut T) {
    debug_assert_ne!(a, b);
    if a < b {
        let (low, high) = items.split_at_mut(b);
        (&mut low[a], &mut high[0])
    } else {
        let (low, high) = items.split_at_mut(a);
        (&mut high[0], &mut low[b])
    }
}

#[cfg(test)]
mod tests;
