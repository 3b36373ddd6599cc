//! Longest-prefix lookup: for a request's block keys, how many leading blocks each endpoint
//! holds, and on which tiers.
//!
//! The walk keeps the set of endpoints that hold every block so far as bit-set words and
//! intersects it with each block's holders, stopping when the set is empty. While every active
//! endpoint holds the block on the GPU (the common case) a block costs a few word operations;
//! only mixed-tier blocks are counted per endpoint, and a block whose holders are those of the
//! block before it (the same word: equal wide sets are one set) costs a comparison. When the
//! fleet-wide shared tier holds anything, each block also adds the endpoints mounting a mount
//! that holds it (one hash lookup per block; none while the shared tier is empty).
//!
//! **Runs.** A block that is a member of an intact run (see [`super::holders`]) stands for the
//! members after it as far as the request follows the run: to its last block when that is the
//! request's block at the matching position (no read when the run's last key is known, else
//! one), else up to where the request leaves the run or ends, found by a search of a few rounds
//! of probes ([`run_reach`]). The walk counts those blocks at once without walking them. After
//! a skip of a few blocks or more the next block is most likely another run's first, so the walk
//! reads it alone; at the first block that starts no run it goes back to the pipeline below.

use serde::Serialize;
use smallvec::SmallVec;

use super::holders::{Holders, IntactRun, WORD_BITS};
use super::split_table::PartId;
use super::{EndpointId, KvIndex};
use crate::event::Tier;
use crate::keys::RouterKey;

/// One endpoint's cached prefix of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct PrefixMatch {
    /// The endpoint.
    pub endpoint: EndpointId,
    /// Leading blocks held on any tier.
    pub blocks: u32,
    /// Of those, blocks whose fastest copy is on the GPU.
    pub gpu_blocks: u32,
    /// Of those, blocks whose fastest copy is in CPU memory.
    pub cpu_blocks: u32,
    /// Of those, blocks whose fastest copy is in the endpoint's own storage.
    pub storage_blocks: u32,
    /// Of those, blocks found only on a shared tier the endpoint mounts.
    pub shared_blocks: u32,
}

/// Every endpoint holding at least the first block, sorted by endpoint id.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PrefixMatches {
    /// One entry per endpoint with a non-empty match.
    pub matches: Vec<PrefixMatch>,
    /// Endpoints whose match counts blocks below the GPU while their offloaded-tier events
    /// were recently inconsistent (orphans): those tiers are an estimate. Sorted.
    pub tier_uncertain: Vec<EndpointId>,
}

impl PrefixMatches {
    /// The match for one endpoint (`None`: not even the first block).
    pub fn get(&self, endpoint: EndpointId) -> Option<&PrefixMatch> {
        self.matches.iter().find(|m| m.endpoint == endpoint)
    }

    /// Whether `endpoint`'s match relies on offloaded tiers whose events were recently
    /// inconsistent.
    pub fn tier_uncertain(&self, endpoint: EndpointId) -> bool {
        self.tier_uncertain.binary_search(&endpoint).is_ok()
    }

    /// Leading blocks `endpoint` holds (0 when none).
    pub fn blocks(&self, endpoint: EndpointId) -> u32 {
        self.get(endpoint).map_or(0, |m| m.blocks)
    }
}

/// Per-slot tier counts for blocks walked while not every active endpoint had them on the GPU.
struct TierCounts {
    counts: Vec<[u32; 4]>,
}

/// Index of the shared tier's count in [`TierCounts`].
const SHARED: usize = 3;

/// Keys whose slots are prefetched at a time, one stretch ahead of the walk.
const PREFETCH_AHEAD: usize = 16;
/// Keys in flight in the walk's pipeline: the current stretch and the two ahead.
const PIPELINE: usize = 3 * PREFETCH_AHEAD;

/// The shortest run after which the walk reads the next block alone. Reading alone costs about
/// three dependent reads per run (the block's slot, the run's record, its holder set); the
/// pipeline costs a slot per block, but many of them at once (a cold 512-block walk takes about
/// 0.15 µs a block against 0.3 µs a read alone here). So runs of two blocks are cheaper in the
/// pipeline (512 blocks × 256 endpoints, two-block runs: 123 against 183 µs cold p50), runs of
/// eight alone (512 × 64: 58 against 105 µs), and the line is drawn between them.
const READ_ALONE_AFTER: u32 = 4;

/// The block table's entries for a request's keys, fetched ahead of the walk.
///
/// A pipeline, so that a cold lookup waits for memory about once per stretch of blocks instead
/// of once or twice per block: when the walk reaches a stretch, it finds the table parts of the
/// keys two stretches on and starts fetching their headers; starts fetching the table slots of
/// the next stretch (whose headers came one stretch ago); then finds this stretch's entries
/// (their slots fetched one stretch ago) and starts fetching their wide holder sets or runs.
struct Fetch<'a> {
    index: &'a KvIndex,
    keys: &'a [RouterKey],
    /// The block table's part of each key from the stretch being walked to two stretches
    /// ahead: key `j` at `parts[j % PIPELINE]`.
    parts: [PartId; PIPELINE],
    /// The holders of keys `base..base + PREFETCH_AHEAD`, once `loaded`.
    stretch: [Holders; PREFETCH_AHEAD],
    base: usize,
    loaded: bool,
}

impl<'a> Fetch<'a> {
    fn new(index: &'a KvIndex, keys: &'a [RouterKey]) -> Self {
        let mut fetch = Self {
            index,
            keys,
            parts: [PartId::default(); PIPELINE],
            stretch: [Holders::default(); PREFETCH_AHEAD],
            base: 0,
            loaded: false,
        };
        fetch.restart(0);
        fetch
    }

    /// Keys of the stretch `stretches` stretches after key `at`.
    fn ahead(&self, at: usize, stretches: usize) -> std::ops::Range<usize> {
        let from = (at + stretches * PREFETCH_AHEAD).min(self.keys.len());
        from..self.keys.len().min(from + PREFETCH_AHEAD)
    }

    /// Starts the pipeline over at key `at`: its stretch and the next are located, its own
    /// slots start loading.
    fn restart(&mut self, at: usize) {
        let blocks = &self.index.blocks;
        for j in self.ahead(at, 0).chain(self.ahead(at, 1)) {
            self.parts[j % PIPELINE] = blocks.locate(self.keys[j].0);
        }
        for j in self.ahead(at, 0) {
            blocks.prefetch_in(self.parts[j % PIPELINE], self.keys[j].0);
        }
        self.base = at;
        self.loaded = false;
    }

    /// The holders of key `i`, the key after the last one asked for, or any key after a
    /// restart.
    fn holders(&mut self, i: usize) -> Holders {
        if self.loaded && i == self.base + PREFETCH_AHEAD {
            self.base = i;
            self.loaded = false;
        } else if i < self.base || i >= self.base + PREFETCH_AHEAD {
            self.restart(i);
        }
        if !self.loaded {
            self.load();
        }
        self.stretch[i - self.base]
    }

    /// Moves the pipeline one stage on at the stretch starting at `base`.
    fn load(&mut self) {
        let (blocks, wide) = (&self.index.blocks, &self.index.wide);
        let at = self.base;
        for j in self.ahead(at, 2) {
            self.parts[j % PIPELINE] = blocks.locate(self.keys[j].0);
        }
        for j in self.ahead(at, 1) {
            blocks.prefetch_in(self.parts[j % PIPELINE], self.keys[j].0);
        }
        let own = self.ahead(at, 0);
        for (found, j) in self.stretch.iter_mut().zip(own) {
            *found = blocks
                .get_in(self.parts[j % PIPELINE], self.keys[j].0)
                .map_or_else(Holders::default, |e| e.holders);
            wide.prefetch(*found);
        }
        self.loaded = true;
    }

    /// The holders of key `i` read on their own (no pipeline), their run's record or wide set
    /// prefetched.
    fn one(&self, i: usize) -> Holders {
        let holders = self
            .index
            .blocks
            .get(self.keys[i].0)
            .map_or_else(Holders::default, |e| e.holders);
        self.index.wide.prefetch(holders);
        holders
    }
}

/// Positions probed at once in each round of [`run_reach`]'s search.
const SEARCH_PROBES: usize = 8;

/// The last position of `keys`, from `from` on, whose block is the member of `run` at the
/// matching offset, given that the block at `from` is the member `run` was read from.
///
/// Router keys are chained, so the positions whose block is the matching member are the first
/// ones up to where the request leaves the run (or ends): a search, not a walk. The request
/// that follows the run to its last block (the common case) costs no read when the run's last
/// key is known, else one. One that leaves it (a prompt that ends inside a stored
/// conversation, a re-tokenized answer that differs from the decoded one) costs a few rounds
/// of [`SEARCH_PROBES`] slot reads made at once, instead of a read per block.
fn run_reach(index: &KvIndex, keys: &[RouterKey], from: usize, run: &IntactRun) -> usize {
    let last = from + run.blocks as usize - 1;
    let mut hi = last.min(keys.len() - 1);
    if hi == last
        && let Some(end) = run.end
    {
        if keys[last].0 == end {
            return last;
        }
        hi = last - 1;
    }
    let blocks = &index.blocks;
    // The answer is in `lo..=hi`; `lo`'s block is a member.
    let mut lo = from;
    while lo < hi {
        let span = hi - lo;
        let probes = SEARCH_PROBES.min(span);
        // Probe `k` of `1..=probes`, spread evenly up to `hi` (distinct: `span >= probes`).
        let at = |k: usize| lo + (span * k).div_ceil(probes);
        let mut parts = [PartId::default(); SEARCH_PROBES];
        for k in 1..=probes {
            parts[k - 1] = blocks.locate(keys[at(k)].0);
        }
        for k in 1..=probes {
            blocks.prefetch_in(parts[k - 1], keys[at(k)].0);
        }
        let is_member = |k: usize| {
            let p = at(k);
            blocks
                .get_in(parts[k - 1], keys[p].0)
                .is_some_and(|e| e.holders == run.member((p - from) as u32))
        };
        match (1..=probes).take_while(|&k| is_member(k)).last() {
            Some(k) if k == probes => lo = hi,
            Some(k) => (lo, hi) = (at(k), at(k + 1) - 1),
            None => hi = at(1) - 1,
        }
    }
    lo
}

impl PrefixMatches {
    /// Sorts the answer by endpoint, as one index answers, after [`append_longest_prefixes`]
    /// added one or more indexes' matches (endpoints disjoint).
    pub(super) fn sort(&mut self) {
        self.matches.sort_unstable_by_key(|m| m.endpoint);
        self.tier_uncertain.sort_unstable();
    }
}

/// Appends each of `index`'s endpoints' longest cached prefix of `keys` to `out`, unsorted
/// (see [`PrefixMatches::sort`]): the shards of an index answer into one list. `shards_left`
/// (this one included) sizes the list's one allocation: shards split endpoints evenly.
pub(super) fn append_longest_prefixes(
    index: &KvIndex,
    keys: &[RouterKey],
    shards_left: usize,
    out: &mut PrefixMatches,
) {
    let slots = index.slots.len();
    let words = slots.div_ceil(WORD_BITS);
    // Up to 1,024 endpoints' bits on the stack (the allocator's state is cold after a quiet
    // spell, and every allocation reads it).
    let mut active: SmallVec<[u64; 16]> = (0..words)
        .map(|w| {
            let lo = w * WORD_BITS;
            let hi = (lo + WORD_BITS).min(slots);
            (lo..hi)
                .filter(|&s| index.slots[s].is_some())
                .fold(0u64, |acc, s| acc | 1 << (s % WORD_BITS))
        })
        .collect();
    // One allocation for the answer (each touches the allocator's state, cold after a quiet
    // spell), sized at the first match: a lookup that matches nothing allocates nothing.
    let first = out.matches.len();
    let matches = &mut out.matches;
    let room = active
        .iter()
        .map(|w| w.count_ones() as usize)
        .sum::<usize>()
        * shards_left.max(1);
    // Blocks every then-active endpoint held on the GPU.
    let mut uniform_gpu = 0u32;
    let mut mixed: Option<TierCounts> = None;
    let mut walked = 0u32;
    let mut fetch = Fetch::new(index, keys);

    let mut finish = |slot: usize, len: u32, uniform: u32, mixed: &Option<TierCounts>| {
        let extra = mixed.as_ref().map_or([0; 4], |m| m.counts[slot]);
        if len > 0
            && let Some(endpoint) = index.slots[slot]
        {
            if matches.len() == matches.capacity() {
                matches.reserve(room);
            }
            matches.push(PrefixMatch {
                endpoint,
                blocks: len,
                gpu_blocks: uniform + extra[Tier::Gpu as usize],
                cpu_blocks: extra[Tier::Cpu as usize],
                storage_blocks: extra[Tier::Storage as usize],
                shared_blocks: extra[SHARED],
            });
        }
    };

    // Slots holding the current block through the shared tier (only while it holds anything).
    // The tier's lock is taken only while this index has endpoints mounting it, and then held
    // for the walk (its writers are shared-tier events, rarer than lookups).
    let fleet = (index.mounted > 0).then(|| index.fleet.read());
    let fleet = fleet.as_deref().filter(|f| !f.is_empty());
    let with_shared = fleet.is_some();
    let mut shared = vec![0u64; if with_shared { words } else { 0 }];
    // The holders of the block before, when that block was on every active endpoint's GPU and
    // not reached through the shared tier: a block with the same holders then changes nothing
    // but the count (the blocks of a chain stored by the same endpoints; equal wide sets are
    // one set), so it is counted without reading its set.
    let mut uniform_before: Option<Holders> = None;
    // Whether the last step skipped a run of `READ_ALONE_AFTER` blocks or more: read the next
    // block alone.
    let mut after_run = false;
    let mut i = 0;
    while i < keys.len() && active.iter().any(|&w| w != 0) {
        let holders = if after_run {
            fetch.one(i)
        } else {
            fetch.holders(i)
        };
        // Blocks this step counts: as far as the request follows the run this block is a member
        // of, or one block. (Not with the shared tier, which is looked up block by block.)
        let count = match index.wide.intact_run(holders) {
            Some(run) if run.blocks > 1 && !with_shared => {
                (run_reach(index, keys, i, &run) - i + 1) as u32
            }
            _ => 1,
        };
        // After a run of a few blocks or more, the next block most likely starts another: read
        // it alone. After shorter runs the pipeline is cheaper (see `READ_ALONE_AFTER`).
        after_run = count >= READ_ALONE_AFTER;
        i += count as usize;
        if after_run && i < keys.len() {
            // The next block is read alone: start on its table part's header while this run's
            // holders are read.
            index.blocks.locate(keys[i].0);
        }
        if uniform_before.is_some_and(|u| u.same(holders)) && !with_shared {
            uniform_gpu += count;
            walked += count;
            continue;
        }
        let entry = (!holders.is_empty()).then(|| index.wide.view(holders));
        let any_shared =
            fleet.is_some_and(|f| f.slots_holding(index.shard, keys[i - 1], &mut shared));
        let mut all_gpu = true;
        for (w, word) in active.iter_mut().enumerate() {
            if *word == 0 {
                continue;
            }
            let (mut held, gpu) = entry.map_or((0, 0), |e| {
                let (any, tiers) = e.words(w);
                (any, tiers[Tier::Gpu as usize])
            });
            if any_shared {
                held |= shared[w];
            }
            let mut dropped = *word & !held;
            while dropped != 0 {
                let bit = dropped.trailing_zeros() as usize;
                finish(w * WORD_BITS + bit, walked, uniform_gpu, &mixed);
                dropped &= dropped - 1;
            }
            *word &= held;
            all_gpu &= *word & !gpu == 0;
        }
        uniform_before = (all_gpu && !any_shared).then_some(holders);
        if all_gpu {
            uniform_gpu += count;
        } else if entry.is_some() || any_shared {
            let counts = mixed.get_or_insert_with(|| TierCounts {
                counts: vec![[0; 4]; slots],
            });
            for (w, &word) in active.iter().enumerate() {
                let mut bits = word;
                while bits != 0 {
                    let slot = w * WORD_BITS + bits.trailing_zeros() as usize;
                    // The endpoint's own copy first; else it holds the block through the
                    // shared tier (the only way an active slot can hold it otherwise).
                    match entry.and_then(|e| e.best_tier(slot as u32)) {
                        Some(tier) => counts.counts[slot][tier as usize] += count,
                        None => counts.counts[slot][SHARED] += count,
                    }
                    bits &= bits - 1;
                }
            }
        }
        walked += count;
    }
    for (w, &word) in active.iter().enumerate() {
        let mut bits = word;
        while bits != 0 {
            finish(
                w * WORD_BITS + bits.trailing_zeros() as usize,
                walked,
                uniform_gpu,
                &mixed,
            );
            bits &= bits - 1;
        }
    }
    let uncertain = out.matches[first..]
        .iter()
        .filter(|m| m.blocks > m.gpu_blocks)
        .filter(|m| index.tier_uncertain(m.endpoint))
        .map(|m| m.endpoint);
    out.tier_uncertain.extend(uncertain);
}
