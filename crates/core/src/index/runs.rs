//! Linking a stored chain's blocks into runs, so that lookups can skip them (see the module doc
//! of [`super::holders`]).
//!
//! An event stores a chain: its blocks in order, each the child of the one before, the first
//! the child of the event's parent. As each block is stored, [`RunChain::push`] links it to the
//! block before it when both end up with the same holders: into the run that block ends, or
//! into a new run of the two ([`RunChain::link_pair`]). A chain continuing an intact run (the
//! next event of the same prefill, or a decode's next block) extends it, so a conversation's
//! blocks on one endpoint make one run however many events stored them.
//!
//! # Decisions
//! - **Only stores with tokens link runs, and restores of them.** Their blocks are a chain by
//!   construction (each router key is derived from the one before). A peer's snapshot keeps
//!   that proof: it lists a run's members in order and marks each that is the child of the
//!   entry before it ([`super::HeldEntry::follows`]). Token-less tier placeholders name blocks
//!   by engine hash with no proof of order, so they only edit holders (and break the runs they
//!   touch).
//! - **Equal holders means equal words.** Packed lanes in another order, or a wide set and a
//!   run with the same contents, do not link. That misses a few runs and never links unequal
//!   holders.
//! - **The block before is checked again when a run starts.** Storing a block may have edited
//!   it (an engine that reused a hash drops the old block), so a new run checks the word it
//!   changes; extending a run checks the run's record.

use super::BlockEntry;
use super::holders::{Holders, WideHolders};
use super::split_table::SplitTable;
use crate::keys::{ROOT_KEY, RouterKey};

/// What the last block pushed (or the event's parent) offers the next block.
#[derive(Clone, Copy, Debug)]
enum Before {
    /// Nothing to link to: the chain's root, or a block in the middle of a run.
    Nothing,
    /// The last block of intact run `run`.
    RunEnd { key: u64, run: usize },
    /// A block with plain holders `holders`, in no run.
    Plain { key: u64, holders: Holders },
}

/// The state of linking one stored chain.
#[derive(Debug)]
pub(super) struct RunChain {
    before: Before,
}

impl RunChain {
    /// A chain whose first block links to nothing before it (its parent unknown or the root).
    pub(super) fn start() -> Self {
        Self {
            before: Before::Nothing,
        }
    }

    /// A chain whose first block is the child of `parent` ([`ROOT_KEY`]: a chain from the
    /// root).
    pub(super) fn after(
        blocks: &SplitTable<BlockEntry>,
        wide: &WideHolders,
        parent: RouterKey,
    ) -> Self {
        let before = match blocks.get(parent.0).filter(|_| parent != ROOT_KEY) {
            Some(entry) => before_of(wide, parent.0, entry.holders),
            None => Before::Nothing,
        };
        Self { before }
    }

    /// Links block `key` (its word `block`, just stored), the child of the last block pushed
    /// (or of the parent), into the run the block before ends. Returns the block before when
    /// the two start a new run instead: the caller, no longer holding the block's entry,
    /// passes it to [`Self::link_pair`].
    pub(super) fn push(
        &mut self,
        wide: &mut WideHolders,
        block: &mut Holders,
        key: RouterKey,
    ) -> Option<PairToLink> {
        let holders = *block;
        match self.before {
            Before::RunEnd { key: after, run } if wide.extend_run(run, block, after, key.0) => {
                self.before = Before::RunEnd { key: key.0, run };
                None
            }
            Before::Plain {
                key: first,
                holders: before,
            } if holders == before => Some(PairToLink { first, holders }),
            // A link that failed changed nothing: the block offers what its word did.
            _ => {
                self.before = before_of(wide, key.0, holders);
                None
            }
        }
    }

    /// Starts a run of `pair`'s block and its child `second`, which has the same holders.
    pub(super) fn link_pair(
        &mut self,
        blocks: &mut SplitTable<BlockEntry>,
        wide: &mut WideHolders,
        pair: PairToLink,
        second: RouterKey,
    ) {
        self.before = match link_pair(blocks, wide, pair.first, pair.holders, second.0) {
            Some(run) => Before::RunEnd { key: second.0, run },
            None => before_of(wide, second.0, pair.holders),
        };
    }
}

/// A block and its child with the same plain holders, to start a run of.
#[derive(Clone, Copy, Debug)]
pub(super) struct PairToLink {
    first: u64,
    holders: Holders,
}

/// What a block whose word is `holders` offers its child.
fn before_of(wide: &WideHolders, key: u64, holders: Holders) -> Before {
    if holders.is_empty() {
        Before::Nothing
    } else if holders.run().is_none() {
        Before::Plain { key, holders }
    } else {
        match wide.ends_intact_run(holders, key) {
            Some(run) => Before::RunEnd { key, run },
            None => Before::Nothing,
        }
    }
}

/// Starts a run of block `first` (plain `holders` when last seen) and its child `second` (the
/// same holders); returns the run, or `None` when `first` changed since.
fn link_pair(
    blocks: &mut SplitTable<BlockEntry>,
    wide: &mut WideHolders,
    first: u64,
    holders: Holders,
    second: u64,
) -> Option<usize> {
    let at = blocks.find(first)?;
    let run = wide.new_run(holders);
    let parent = blocks.at_mut(at).expect("found");
    if !wide.extend_run(run, &mut parent.holders, 0, first) {
        wide.drop_if_empty(run);
        return None;
    }
    let at = blocks.find(second).expect("stored");
    let child = blocks.at_mut(at).expect("found");
    let linked = wide.extend_run(run, &mut child.holders, first, second);
    debug_assert!(linked, "the child had the parent's holders");
    Some(run)
}
