//! The chain tree behind [`RoutingHistory`](super::RoutingHistory): the prompts recorded, as
//! runs of consecutive blocks that every operation so far treated alike (the same holders, with
//! the same expiries), in one flat slab ([`crate::run_slab`]).
//!
//! Router keys chain their parents, so a key names its whole prefix: one table from a run's
//! first key to the run finds where a prompt continues, and one comparison of a run's last key
//! says whether a prompt goes through all of it (a binary search finds where it leaves a run
//! part way). A 512-block prompt that extends a conversation is a handful of runs (the system
//! prompt, each earlier turn), not 512 table entries. An operation on part of a run first
//! splits it there, so a run's blocks always share their holders.
//!
//! Keys are assumed not to collide (64-bit chained hashes): should two chains' keys meet at
//! different places, the colliding part is left out of the tree (a record is cut short there, a
//! removal or a shortening covers the whole run), so the tree stays consistent, and never says a
//! prefix is held that was not sent.

use smallvec::SmallVec;

use crate::index::EndpointId;
use crate::keys::RouterKey;
use crate::run_slab::{self, RunSlab};

/// One run's holders with their expiry times, in endpoint order (an endpoint at most once).
/// Most runs (a conversation's own turns) have one holder, kept inline.
pub(super) type Holders = SmallVec<[(EndpointId, f64); 1]>;

/// No run (the parent of a run that starts at the prompt's first block).
pub(super) const NO_RUN: u32 = u32::MAX;

/// Consecutive blocks of one chain, at depths `start..start + keys().len()`.
pub(super) type Run = run_slab::Run<Chain>;

/// What the tree keeps about a run, besides its keys.
#[derive(Debug)]
pub(super) struct Chain {
    /// The run this one continues ([`NO_RUN`] at depth 0).
    pub(super) parent: u32,
    /// Depth of its first block in the prompt.
    pub(super) start: u32,
    /// Who holds all of its blocks, until when.
    pub(super) holders: Holders,
    /// Runs that continue it.
    children: u32,
    /// Records that end here (their run must stay: see `RoutingHistory`'s entries).
    pins: u32,
}

impl Chain {
    /// A run at depth `start` continuing `parent`, held by nobody yet.
    fn new(parent: u32, start: u32) -> Self {
        Self {
            parent,
            start,
            holders: Holders::new(),
            children: 0,
            pins: 0,
        }
    }

    /// Its expiry for `endpoint`, if `endpoint` holds it.
    pub(super) fn expiry_of(&self, endpoint: EndpointId) -> Option<f64> {
        self.holder_at(endpoint).ok().map(|at| self.holders[at].1)
    }

    fn holder_at(&self, endpoint: EndpointId) -> Result<usize, usize> {
        self.holders.binary_search_by_key(&endpoint, |(e, _)| *e)
    }

    /// Sets `endpoint`'s expiry (adding it as a holder).
    pub(super) fn hold(&mut self, endpoint: EndpointId, expiry: f64) {
        match self.holder_at(endpoint) {
            Ok(at) => self.holders[at].1 = expiry,
            Err(at) => self.holders.insert(at, (endpoint, expiry)),
        }
    }

    /// Brings `endpoint`'s expiry forward to `expiry` if it held the run longer.
    pub(super) fn shorten(&mut self, endpoint: EndpointId, expiry: f64) {
        if let Ok(at) = self.holder_at(endpoint) {
            let held = &mut self.holders[at].1;
            *held = held.min(expiry);
        }
    }

    /// Drops `endpoint` as a holder.
    pub(super) fn release(&mut self, endpoint: EndpointId) {
        if let Ok(at) = self.holder_at(endpoint) {
            self.holders.remove(at);
        }
    }

    fn needed(&self) -> bool {
        !self.holders.is_empty() || self.children > 0 || self.pins > 0
    }
}

impl Run {
    /// Depth just past its last block.
    pub(super) fn end(&self) -> u32 {
        self.info.start + self.keys().len() as u32
    }
}

/// The recorded chains, as runs.
#[derive(Debug, Default)]
pub(super) struct ChainTree {
    runs: RunSlab<Chain>,
}

impl ChainTree {
    /// A run in use.
    pub(super) fn run(&self, id: u32) -> &Run {
        self.runs.get(id)
    }

    /// A run in use, to change its holders.
    pub(super) fn run_mut(&mut self, id: u32) -> &mut Run {
        self.runs.get_mut(id)
    }

    /// Runs in use.
    pub(super) fn len(&self) -> usize {
        self.runs.len()
    }

    /// The run that starts at `depth` of the chain `keys` (`depth < keys.len()`), and how many
    /// of its blocks `keys` goes through (at least one).
    pub(super) fn find(&self, keys: &[RouterKey], depth: usize) -> Option<(u32, usize)> {
        let (id, through) = self.runs.find(keys.get(depth..)?)?;
        if self.run(id).info.start as usize != depth {
            return None; // a collision: not this chain's run
        }
        Some((id, through))
    }

    /// The runs along `keys`, from the first block: each run and how many of its blocks `keys`
    /// goes through.
    pub(super) fn path<'a>(&'a self, keys: &'a [RouterKey]) -> Path<'a> {
        Path {
            tree: self,
            keys,
            depth: 0,
            done: false,
        }
    }

    /// Adds a run for `keys` at `start`, continuing `parent`; `None` if a run already starts
    /// with its first key (a collision).
    pub(super) fn add(&mut self, parent: u32, start: usize, keys: &[RouterKey]) -> Option<u32> {
        let id = self.runs.add(keys, Chain::new(parent, start as u32))?;
        if parent != NO_RUN {
            self.run_mut(parent).info.children += 1;
        }
        Some(id)
    }

    /// Splits run `id` at depth `at` (strictly inside it): a new run takes the blocks before
    /// `at`, with the same holders, and is returned; `id` keeps the rest (so that what refers
    /// to a run by its last block still does). `None` if the rest's first key already starts a
    /// run (a collision): nothing changes.
    pub(super) fn split(&mut self, id: u32, at: u32) -> Option<u32> {
        let run = self.run(id);
        debug_assert!(run.info.start < at && at < run.end());
        let cut = (at - run.info.start) as usize;
        let front = Chain {
            holders: run.info.holders.clone(),
            children: 1,
            ..Chain::new(run.info.parent, run.info.start)
        };
        let prefix = self.runs.split_front_off(id, cut, front)?;
        let back = &mut self.run_mut(id).info;
        back.parent = prefix;
        back.start = at;
        Some(prefix)
    }

    /// One more record ends at run `id`.
    pub(super) fn pin(&mut self, id: u32) {
        self.run_mut(id).info.pins += 1;
    }

    /// One record fewer ends at run `id`; the run and the runs above it go once nothing needs
    /// them.
    pub(super) fn unpin(&mut self, id: u32) {
        let run = self.run_mut(id);
        debug_assert!(
            run.is_live() && run.info.pins > 0,
            "run {id} unpinned without a record ending there"
        );
        let run = &mut run.info;
        run.pins = run.pins.saturating_sub(1);
        self.prune(id);
    }

    /// Removes run `id` if nothing needs it (no holders, no continuation, no record ending
    /// there), then its parent likewise, and so on up.
    pub(super) fn prune(&mut self, mut id: u32) {
        while id != NO_RUN && self.run(id).is_live() && !self.run(id).info.needed() {
            let parent = self.run(id).info.parent;
            self.runs.free(id);
            if parent != NO_RUN {
                let p = &mut self.run_mut(parent).info;
                p.children = p.children.saturating_sub(1);
            }
            id = parent;
        }
    }

    /// Calls `f` on every run in use, then removes those no longer needed.
    pub(super) fn for_each_then_prune(&mut self, f: impl FnMut(&mut Run)) {
        self.runs.for_each_live_mut(f);
        for id in 0..self.runs.slots() {
            self.prune(id);
        }
    }
}

/// The runs along a chain (see [`ChainTree::path`]).
pub(super) struct Path<'a> {
    tree: &'a ChainTree,
    keys: &'a [RouterKey],
    depth: usize,
    done: bool,
}

impl<'a> Iterator for Path<'a> {
    /// A run, the depth it starts at, and how many of its blocks the chain goes through.
    type Item = (&'a Run, usize, usize);

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        let Some((id, through)) = self.tree.find(self.keys, self.depth) else {
            self.done = true;
            return None;
        };
        let run = self.tree.run(id);
        let start = self.depth;
        self.depth += through;
        self.done = through < run.keys().len() || self.depth == self.keys.len();
        Some((run, start, through))
    }
}
