//! Which endpoints hold one block, on which tiers, in eight bytes for the common case.
//!
//! Most blocks are held by one to a few endpoints (a conversation's history lives where it was
//! served). Such a block's holders are packed into one `u64`: four 16-bit lanes, each an endpoint
//! slot (13 bits) and its tier bits (GPU, CPU, storage). A block held by more than four
//! endpoints, or by a slot too large for a lane, moves to a bit set per tier in
//! [`WideHolders`], an arena of equal-sized sets; the packed word then holds a marker and the
//! set's number. Those are mostly shared prefixes (system prompts). A lookup reaches a wide set
//! with one more memory access, at an address it can compute (and prefetch) from the block
//! table entry alone. Blocks with the same holders share one set, so the blocks of a prefix
//! that the same endpoints hold carry the same word: a lookup reads their set once.
//!
//! **Runs.** Consecutive blocks of one chain that an event leaves with the same holders are
//! linked into a [`Run`]: their words name the run and their offset in it, and the run's record
//! holds the holders and the router key of its last block. A member whose holders change
//! leaves the run with a plain word. Members leaving from either end keep the rest a chain (an
//! endpoint storing the run's first blocks too; an engine evicting a chain from its tail); the
//! run is *intact* while its members are every offset between its first and its last. Then a
//! lookup that reads one member and confirms a later one at the matching position of its own
//! keys (the last, or where a search finds the request leaves the run) knows every block in
//! between without reading them: router keys are chained, so the same block at a later position
//! means the same blocks all the way. A member leaving from the middle breaks the run: it stays
//! as the other members' holders until the last leaves.

use hashbrown::HashTable;

use super::chunked::ChunkedVec;
use super::table::prefetch_line;
use crate::event::Tier;

/// Slots per bit-set word.
pub(crate) const WORD_BITS: usize = 64;

/// Lanes in a packed word.
const LANES: usize = 4;
/// Bits per lane.
const LANE_BITS: u32 = 16;
/// Tier bits at the bottom of a lane.
const TIER_BITS: u32 = 3;
/// The largest slot a lane holds; slot 8191 with every tier would read as the marker.
const MAX_LANE_SLOT: u32 = (1 << (LANE_BITS - TIER_BITS)) - 2;
/// The top lane of a word whose holders are in [`WideHolders`] (slot 8191, every tier: no
/// packed lane has it); the low 32 bits then number the set.
const WIDE_MARK: u64 = 0xffff << 48;
/// The top lane of a word naming a [`Run`] member (slot 8191 again, with other tier bits); the
/// next 16 bits are the member's offset in the run, the low 32 number the run.
const RUN_MARK: u64 = 0xfffe << 48;
/// The most blocks linked into one run (offsets are 16 bits); a longer chain starts another.
const MAX_RUN: u32 = 1 << 16;
/// The top lane.
const MARK_MASK: u64 = 0xffff << 48;

fn tier_bit(tier: Tier) -> u16 {
    1 << tier as u16
}

/// One block's holders: packed lanes, or the marker for a wide set. Zero means nobody.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Holders(u64);

impl Holders {
    /// The wide set these holders live in, if any.
    #[inline]
    fn wide_set(self) -> Option<usize> {
        (self.0 & MARK_MASK == WIDE_MARK).then_some(self.0 as u32 as usize)
    }

    /// The run these holders are a member of, if any.
    #[inline]
    pub(crate) fn run(self) -> Option<usize> {
        (self.0 & MARK_MASK == RUN_MARK).then_some(self.0 as u32 as usize)
    }

    /// The run these holders are a member of and the member's offset in it (consecutive
    /// offsets of one run are a block and its child), if any.
    #[inline]
    pub(crate) fn run_position(self) -> Option<(usize, u32)> {
        self.run().map(|run| (run, self.offset()))
    }

    /// The offset in its run of a run member.
    #[inline]
    fn offset(self) -> u32 {
        (self.0 >> 32) as u16 as u32
    }

    /// The member at `offset` of run `run`.
    fn of_run(run: usize, offset: u32) -> Self {
        debug_assert!(run <= u32::MAX as usize && offset < MAX_RUN);
        Self(RUN_MARK | u64::from(offset) << 32 | run as u64)
    }

    /// Whether two words stand for the same holders without reading either: equal words, or
    /// members of the same run.
    #[inline]
    pub(crate) fn same(self, other: Self) -> bool {
        self == other || (self.run().is_some() && self.run() == other.run())
    }

    /// True when no endpoint holds the block on any tier.
    pub(crate) fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The holders of wide set `set`.
    fn wide(set: usize) -> Self {
        Self(WIDE_MARK | set as u64)
    }

    fn lane(self, i: usize) -> u16 {
        (self.0 >> (i as u32 * LANE_BITS)) as u16
    }

    fn set_lane(&mut self, i: usize, lane: u16) {
        let shift = i as u32 * LANE_BITS;
        self.0 = (self.0 & !(0xffff << shift)) | (u64::from(lane) << shift);
    }

    fn lane_of(self, slot: u32) -> Option<usize> {
        (0..LANES).find(|&i| {
            let lane = self.lane(i);
            lane != 0 && u32::from(lane >> TIER_BITS) == slot
        })
    }
}

/// Consecutive blocks of one chain with the same holders: the record their words name.
///
/// Aligned to 32 bytes so that a lookup's one prefetch brings the whole record.
#[derive(Clone, Copy, Debug, Default)]
#[repr(align(32))]
struct Run {
    /// The members' holders: packed, or a wide set of which the run holds one use for all its
    /// members.
    holders: Holders,
    /// The router key of the member linked last (offset `len - 1`).
    end: u64,
    /// Members linked in: a chain of `len` blocks at offsets `0..len`, ending at `end`.
    len: u32,
    /// Members whose word still names the run.
    users: u32,
    /// Offsets `first..last_end` bound the members still in the run: members that left from
    /// either end moved them.
    first: u32,
    last_end: u32,
}

impl Run {
    /// Whether every offset between the first and the last member is still a member.
    fn intact(&self) -> bool {
        self.users == self.last_end - self.first
    }
}

/// What a lookup reading one member of an intact run learns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct IntactRun {
    /// Blocks from the member read to the run's last, both included.
    pub(crate) blocks: u32,
    /// The router key of the run's last member, when the run still ends at the block linked
    /// last; else the lookup confirms the last member by reading it ([`Self::last`], or
    /// [`Self::member`] at any position).
    pub(crate) end: Option<u64>,
    /// The word of the run's last member.
    pub(crate) last: Holders,
    /// The run.
    run: usize,
    /// The offset in the run of the member read.
    offset: u32,
}

impl IntactRun {
    /// The word of the member `ahead` blocks after the one read (`ahead < blocks`): the block
    /// at that position of a request is this member exactly when its word is this one.
    pub(crate) fn member(&self, ahead: u32) -> Holders {
        debug_assert!(ahead < self.blocks);
        Holders::of_run(self.run, self.offset + ahead)
    }
}

/// The holder sets of blocks with more holders than a packed word takes: an arena of sets of
/// `stride` words each, set `i` at `words[i * stride..]`, word `3w + tier` for slot word `w`;
/// and the [`Run`]s linking blocks with the same holders.
///
/// Blocks with the same holders share one set (found by its contents, counted by its users):
/// the blocks of a shared prefix are mostly held by the same endpoints, so a lookup walking
/// them reads one set, not one per block, and the arena holds each distinct set once. A set
/// is never changed while another block uses it: an edit moves the block to the set with the
/// new contents, made if none exists.
#[derive(Clone, Debug, Default)]
pub(crate) struct WideHolders {
    words: Vec<u64>,
    /// Words per set: three per 64 slots, grown (and the arena re-laid) when a slot needs it.
    stride: usize,
    /// Blocks using each set; 0 for a free set.
    users: Vec<u32>,
    /// Sets no block uses, all zero.
    free: Vec<u32>,
    /// The sets in use, found by their contents.
    by_contents: HashTable<u32>,
    /// The contents an edit is building.
    scratch: Vec<u64>,
    /// Runs, by number (in chunks: millions of runs never move); a free run is all zero.
    runs: ChunkedVec<Run>,
    /// Runs no block names.
    free_runs: Vec<u32>,
}

/// A read-only view of one block's holders, for lookups.
#[derive(Clone, Copy, Debug)]
pub(crate) enum HolderView<'a> {
    /// Up to four (slot, tiers) lanes.
    Packed(u64),
    /// Per-tier bit sets, word `3w + tier`.
    Wide(&'a [u64]),
}

impl HolderView<'_> {
    /// Slots (within word `word`) holding the block on the given tiers.
    #[inline]
    fn word(self, word: usize, tiers: u16) -> u64 {
        let (any, per_tier) = self.words(word);
        Tier::ALL
            .iter()
            .filter(|&&t| tiers & tier_bit(t) != 0)
            .fold(0, |acc, &t| acc | per_tier[t as usize])
            & any
    }

    /// Slots (within word `word`) holding the block on any tier, and per tier.
    #[inline]
    pub(crate) fn words(self, word: usize) -> (u64, [u64; 3]) {
        match self {
            HolderView::Packed(packed) => {
                let mut tiers = [0u64; 3];
                for i in 0..LANES {
                    let lane = (packed >> (i as u32 * LANE_BITS)) as u16;
                    let slot = usize::from(lane >> TIER_BITS);
                    if lane != 0 && slot / WORD_BITS == word {
                        let bit = 1 << (slot % WORD_BITS);
                        for (t, tier) in tiers.iter_mut().enumerate() {
                            if lane & (1 << t) != 0 {
                                *tier |= bit;
                            }
                        }
                    }
                }
                (tiers[0] | tiers[1] | tiers[2], tiers)
            }
            HolderView::Wide(words) => match words.get(word * 3..word * 3 + 3) {
                Some(&[gpu, cpu, storage]) => (gpu | cpu | storage, [gpu, cpu, storage]),
                _ => (0, [0; 3]),
            },
        }
    }

    /// Whether `slot` holds the block on any tier.
    pub(crate) fn holds(self, slot: u32) -> bool {
        let slot = slot as usize;
        self.words(slot / WORD_BITS).0 & (1 << (slot % WORD_BITS)) != 0
    }

    /// Whether `slot` holds the block on `tier`.
    pub(crate) fn has(self, slot: u32, tier: Tier) -> bool {
        let slot = slot as usize;
        self.word(slot / WORD_BITS, tier_bit(tier)) & (1 << (slot % WORD_BITS)) != 0
    }

    /// The fastest tier on which `slot` holds the block.
    pub(crate) fn best_tier(self, slot: u32) -> Option<Tier> {
        Tier::ALL.into_iter().find(|&t| self.has(slot, t))
    }
}

impl WideHolders {
    /// The holders a word stands for: a run member's are the run's, never a run again.
    #[inline]
    pub(crate) fn resolve(&self, holders: Holders) -> Holders {
        match holders.run() {
            Some(run) => self.runs[run].holders,
            None => holders,
        }
    }

    /// A view of `holders`.
    #[inline]
    pub(crate) fn view(&self, holders: Holders) -> HolderView<'_> {
        let holders = self.resolve(holders);
        match holders.wide_set() {
            Some(set) => HolderView::Wide(&self.words[set * self.stride..][..self.stride]),
            None => HolderView::Packed(holders.0),
        }
    }

    /// Starts loading what `holders` needs read into the CPU caches: its wide set, or its run's
    /// record (a run's wide set can only be found once the record is read).
    #[inline]
    pub(crate) fn prefetch(&self, holders: Holders) {
        if let Some(run) = holders.run() {
            prefetch_line(&self.runs[run]);
        } else if let Some(set) = holders.wide_set() {
            // One cache line is eight words; a set spans `stride` words.
            for word in (0..self.stride).step_by(8) {
                prefetch_line(&self.words[set * self.stride + word]);
            }
        }
    }

    /// The run `holders` is a member of, if it is intact.
    #[inline]
    pub(crate) fn intact_run(&self, holders: Holders) -> Option<IntactRun> {
        let id = holders.run()?;
        let run = &self.runs[id];
        run.intact().then(|| IntactRun {
            blocks: run.last_end - holders.offset(),
            end: (run.last_end == run.len).then_some(run.end),
            last: Holders::of_run(id, run.last_end - 1),
            run: id,
            offset: holders.offset(),
        })
    }

    /// A new run of no blocks yet with `holders` (plain), to be extended at once.
    pub(crate) fn new_run(&mut self, holders: Holders) -> usize {
        debug_assert!(holders.run().is_none() && !holders.is_empty());
        if let Some(set) = holders.wide_set() {
            // The run's own use, for all its members.
            self.users[set] += 1;
        }
        let run = Run {
            holders,
            ..Run::default()
        };
        match self.free_runs.pop() {
            Some(free) => {
                self.runs[free as usize] = run;
                free as usize
            }
            None => self.runs.push(run),
        }
    }

    /// Links `block` (router key `key`) into run `run` as its new last block, when the run is
    /// intact, ends at `after` (the block's parent) or is empty, has room, and has the block's
    /// holders; returns whether it did.
    pub(crate) fn extend_run(
        &mut self,
        run: usize,
        block: &mut Holders,
        after: u64,
        key: u64,
    ) -> bool {
        let r = &self.runs[run];
        let open = r.len == 0 || (r.intact() && r.last_end == r.len && r.end == after);
        if !open || r.len == MAX_RUN || *block != r.holders {
            return false;
        }
        if let Some(set) = block.wide_set() {
            // The run holds the set for its members: give back the block's own use.
            self.release(set);
        }
        let r = &mut self.runs[run];
        *block = Holders::of_run(run, r.len);
        r.len += 1;
        r.last_end = r.len;
        r.users += 1;
        r.end = key;
        true
    }

    /// The run `holders` (router key `key`) is the last member of, if it is intact and can be
    /// extended.
    pub(crate) fn ends_intact_run(&self, holders: Holders, key: u64) -> Option<usize> {
        let run = holders.run()?;
        let r = &self.runs[run];
        let last = r.len > 0 && holders.offset() == r.len - 1 && r.end == key;
        (last && r.intact() && r.last_end == r.len).then_some(run)
    }

    /// Frees run `run` if no block was linked into it (a run started and then not extended).
    pub(crate) fn drop_if_empty(&mut self, run: usize) {
        if self.runs[run].len == 0 {
            self.free_run(run);
        }
    }

    /// Makes `holders`, a run member, a plain word with the run's holders.
    fn leave_run(&mut self, holders: &mut Holders, run: usize) {
        let r = &mut self.runs[run];
        let plain = r.holders;
        let offset = holders.offset();
        r.users -= 1;
        if offset == r.first {
            r.first += 1;
        } else if offset + 1 == r.last_end {
            r.last_end -= 1;
        }
        if let Some(set) = plain.wide_set() {
            self.users[set] += 1;
        }
        if self.runs[run].users == 0 {
            self.free_run(run);
        }
        *holders = plain;
    }

    fn free_run(&mut self, run: usize) {
        if let Some(set) = self.runs[run].holders.wide_set() {
            self.release(set);
        }
        self.runs[run] = Run::default();
        self.free_runs.push(run as u32);
    }

    /// Marks `slot` as holding the block on `tier`; returns whether that was new.
    pub(crate) fn insert(&mut self, holders: &mut Holders, slot: u32, tier: Tier) -> bool {
        if let Some(run) = holders.run() {
            if self.view(*holders).has(slot, tier) {
                return false;
            }
            self.leave_run(holders, run);
        }
        let (word, bit) = split(slot);
        let at = word * 3 + tier as usize;
        let Some(set) = holders.wide_set() else {
            if let Some(i) = holders.lane_of(slot) {
                let lane = holders.lane(i);
                holders.set_lane(i, lane | tier_bit(tier));
                return lane & tier_bit(tier) == 0;
            }
            if slot <= MAX_LANE_SLOT
                && let Some(i) = (0..LANES).find(|&i| holders.lane(i) == 0)
            {
                holders.set_lane(i, ((slot as u16) << TIER_BITS) | tier_bit(tier));
                return true;
            }
            // A fifth holder, or a slot too large for a lane: the set goes wide.
            self.unpack(*holders, word);
            self.scratch[at] |= bit;
            *holders = Holders::wide(self.intern_scratch());
            return true;
        };
        self.fit(word);
        if self.set_words(set)[at] & bit != 0 {
            return false;
        }
        self.load_scratch(set);
        self.scratch[at] |= bit;
        self.move_to_scratch(holders, set);
        true
    }

    /// Clears `slot` on `tier`; returns whether it was set. A wide set that fits a packed word
    /// again is packed.
    pub(crate) fn remove(&mut self, holders: &mut Holders, slot: u32, tier: Tier) -> bool {
        if let Some(run) = holders.run() {
            if !self.view(*holders).has(slot, tier) {
                return false;
            }
            self.leave_run(holders, run);
        }
        let Some(set) = holders.wide_set() else {
            let Some(i) = holders.lane_of(slot) else {
                return false;
            };
            let lane = holders.lane(i);
            let rest = lane & !tier_bit(tier);
            holders.set_lane(i, if rest & 0b111 == 0 { 0 } else { rest });
            return lane & tier_bit(tier) != 0;
        };
        let (word, bit) = split(slot);
        let at = word * 3 + tier as usize;
        if at >= self.stride || self.set_words(set)[at] & bit == 0 {
            return false;
        }
        self.load_scratch(set);
        self.scratch[at] &= !bit;
        match packed(&self.scratch) {
            Some(packed) => {
                self.release(set);
                *holders = packed;
            }
            None => self.move_to_scratch(holders, set),
        }
        true
    }

    /// The words of set `set`.
    fn set_words(&self, set: usize) -> &[u64] {
        &self.words[set * self.stride..][..self.stride]
    }

    /// Makes every set wide enough for slot word `word`, re-laying the arena if needed.
    fn fit(&mut self, word: usize) {
        let stride = (word + 1) * 3;
        if stride <= self.stride {
            return;
        }
        let sets = self.users.len();
        let mut words = vec![0; sets * stride];
        for set in 0..sets {
            words[set * stride..][..self.stride].copy_from_slice(self.set_words(set));
        }
        self.words = words;
        self.stride = stride;
        // Longer contents hash differently: index the sets in use again.
        self.by_contents.clear();
        for set in 0..sets {
            if self.users[set] > 0 {
                self.index(set);
            }
        }
    }

    /// Puts a packed set's holders in the scratch set, wide enough for slot word `word` too.
    fn unpack(&mut self, holders: Holders, word: usize) {
        let lanes = (0..LANES)
            .map(|i| holders.lane(i))
            .filter(|&lane| lane != 0);
        let widest = lanes
            .clone()
            .map(|lane| split(u32::from(lane >> TIER_BITS)).0)
            .fold(word, usize::max);
        self.fit(widest);
        self.scratch.clear();
        self.scratch.resize(self.stride, 0);
        for lane in lanes {
            let (word, bit) = split(u32::from(lane >> TIER_BITS));
            for tier in Tier::ALL {
                if lane & tier_bit(tier) != 0 {
                    self.scratch[word * 3 + tier as usize] |= bit;
                }
            }
        }
    }

    /// Copies set `set` into the scratch set.
    fn load_scratch(&mut self, set: usize) {
        self.scratch.clear();
        self.scratch
            .extend_from_slice(&self.words[set * self.stride..][..self.stride]);
    }

    /// Moves a block from set `set` to the set with the scratch set's contents.
    fn move_to_scratch(&mut self, holders: &mut Holders, set: usize) {
        let to = match self.find_scratch() {
            Some(existing) => existing,
            None if self.users[set] == 1 => {
                // The block is the set's only user and no set has the new contents: edit in
                // place.
                self.unindex(set);
                self.words[set * self.stride..][..self.stride].copy_from_slice(&self.scratch);
                self.index(set);
                return;
            }
            None => self.add_scratch_set(),
        };
        self.users[to] += 1;
        self.release(set);
        *holders = Holders::wide(to);
    }

    /// The set in use whose contents are the scratch set's.
    fn find_scratch(&self) -> Option<usize> {
        let (words, stride) = (&self.words, self.stride);
        self.by_contents
            .find(contents_hash(&self.scratch), |&s| {
                words[s as usize * stride..][..stride] == self.scratch[..]
            })
            .map(|&s| s as usize)
    }

    /// One more user of the set with the scratch set's contents, made if none exists.
    fn intern_scratch(&mut self) -> usize {
        let set = self
            .find_scratch()
            .unwrap_or_else(|| self.add_scratch_set());
        self.users[set] += 1;
        set
    }

    /// A new set (no users yet) with the scratch set's contents.
    fn add_scratch_set(&mut self) -> usize {
        let set = match self.free.pop() {
            Some(set) => set as usize,
            None => {
                self.words.resize(self.words.len() + self.stride, 0);
                self.users.push(0);
                self.users.len() - 1
            }
        };
        self.words[set * self.stride..][..self.stride].copy_from_slice(&self.scratch);
        self.index(set);
        set
    }

    /// One user fewer of set `set`, freed when it has none.
    fn release(&mut self, set: usize) {
        self.users[set] -= 1;
        if self.users[set] == 0 {
            self.unindex(set);
            self.words[set * self.stride..][..self.stride].fill(0);
            self.free.push(set as u32);
        }
    }

    /// Makes set `set` findable by its contents.
    fn index(&mut self, set: usize) {
        let stride = self.stride;
        let words = &self.words;
        let hash = contents_hash(&words[set * stride..][..stride]);
        self.by_contents.insert_unique(hash, set as u32, |&s| {
            contents_hash(&words[s as usize * stride..][..stride])
        });
    }

    /// Stops finding set `set` by its (current) contents.
    fn unindex(&mut self, set: usize) {
        let hash = contents_hash(self.set_words(set));
        if let Ok(entry) = self.by_contents.find_entry(hash, |&s| s as usize == set) {
            entry.remove();
        }
    }

    /// Distinct wide sets in use.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.users.iter().filter(|&&u| u > 0).count()
    }

    /// Blocks using a wide set.
    #[cfg(test)]
    pub(crate) fn users(&self) -> u64 {
        self.users.iter().map(|&u| u64::from(u)).sum()
    }

    /// Runs in use, and how many of them are intact.
    #[cfg(test)]
    pub(crate) fn runs(&self) -> (usize, usize) {
        let used: Vec<&Run> = self.runs.iter().filter(|r| r.users > 0).collect();
        (used.len(), used.iter().filter(|r| r.intact()).count())
    }

    /// Checks the books against every block's word: each run's users are the words naming it,
    /// at offsets within its bounds, once each; each wide set's users are the plain words
    /// naming it and the runs holding it; no word names a free run.
    #[cfg(test)]
    pub(crate) fn check(&self, words: impl IntoIterator<Item = Holders>) -> Result<(), String> {
        use std::collections::{BTreeMap, BTreeSet};
        let mut members: BTreeMap<usize, BTreeSet<u32>> = BTreeMap::new();
        let mut set_users: BTreeMap<usize, u32> = BTreeMap::new();
        for word in words {
            if let Some(run) = word.run() {
                if !members.entry(run).or_default().insert(word.offset()) {
                    return Err(format!("two words name run {run} offset {}", word.offset()));
                }
            } else if let Some(set) = word.wide_set() {
                *set_users.entry(set).or_default() += 1;
            }
        }
        let free: BTreeSet<usize> = self.free_runs.iter().map(|&r| r as usize).collect();
        for (id, run) in self.runs.iter().enumerate() {
            let named = members.remove(&id).unwrap_or_default();
            if free.contains(&id) || run.users == 0 {
                if !named.is_empty() || !free.contains(&id) {
                    return Err(format!(
                        "run {id}: free {}, named {}",
                        free.contains(&id),
                        named.len()
                    ));
                }
                continue;
            }
            if named.len() != run.users as usize {
                return Err(format!(
                    "run {id}: {} users, {} words",
                    run.users,
                    named.len()
                ));
            }
            if named
                .iter()
                .any(|&o| o < run.first || o >= run.last_end || o >= run.len)
            {
                return Err(format!(
                    "run {id}: a member outside {}..{}",
                    run.first, run.last_end
                ));
            }
            if let Some(set) = run.holders.wide_set() {
                *set_users.entry(set).or_default() += 1;
            }
        }
        if let Some((run, _)) = members.first_key_value() {
            return Err(format!("words name run {run}, past the arena"));
        }
        for (set, &users) in self.users.iter().enumerate() {
            let used = set_users.get(&set).copied().unwrap_or(0);
            if users != used {
                return Err(format!("set {set}: {users} users, used {used} times"));
            }
        }
        Ok(())
    }

    /// Heap bytes of the arena, its index and the runs.
    pub(crate) fn heap_bytes(&self) -> usize {
        (self.words.capacity() + self.scratch.capacity()) * 8
            + (self.users.capacity() + self.free.capacity() + self.free_runs.capacity()) * 4
            + self.by_contents.allocation_size()
            + self.runs.heap_bytes()
    }
}

/// The packed form of a wide set's contents, if it fits one.
fn packed(words: &[u64]) -> Option<Holders> {
    let mut packed = Holders::default();
    let mut lanes = 0;
    for (word, chunk) in words.chunks(3).enumerate() {
        let mut any = chunk.iter().fold(0, |a, w| a | w);
        while any != 0 {
            let slot = (word * WORD_BITS) as u32 + any.trailing_zeros();
            if lanes == LANES || slot > MAX_LANE_SLOT {
                return None;
            }
            let tiers = Tier::ALL
                .iter()
                .filter(|&&t| chunk[t as usize] & (1 << (slot as usize % WORD_BITS)) != 0)
                .fold(0, |acc, &t| acc | tier_bit(t));
            packed.set_lane(lanes, ((slot as u16) << TIER_BITS) | tiers);
            lanes += 1;
            any &= any - 1;
        }
    }
    Some(packed)
}

/// A hash of a set's contents, for [`WideHolders::by_contents`]: a multiply-rotate per word
/// (sets are short and mostly zero words), then a final mix so that the high bits the table
/// keeps as tags depend on every word.
fn contents_hash(words: &[u64]) -> u64 {
    let h = words.iter().fold(0x9e37_79b9_7f4a_7c15_u64, |h, &w| {
        (h ^ w).wrapping_mul(0xbf58_476d_1ce4_e5b9).rotate_left(31)
    });
    let h = (h ^ (h >> 32)).wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 29)
}

fn split(slot: u32) -> (usize, u64) {
    let slot = slot as usize;
    (slot / WORD_BITS, 1u64 << (slot % WORD_BITS))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// Holders behave like a set of (slot, tier) pairs, packed while they fit and wide
        /// otherwise, whatever the order of inserts and removals.
        #[test]
        fn behaves_like_a_set(ops in proptest::collection::vec((any::<bool>(), prop_oneof![0u32..8, 0u32..200, 8185u32..8200], 0usize..3), 0..300)) {
            let mut wide = WideHolders::default();
            let mut holders = Holders::default();
            let mut model = std::collections::HashSet::new();
            for (insert, slot, tier) in ops {
                let tier = Tier::ALL[tier];
                if insert {
                    prop_assert_eq!(wide.insert(&mut holders, slot, tier), model.insert((slot, tier)));
                } else {
                    prop_assert_eq!(wide.remove(&mut holders, slot, tier), model.remove(&(slot, tier)));
                }
                prop_assert_eq!(holders.is_empty(), model.is_empty());
                let view = wide.view(holders);
                for s in [slot, 0, 63, 64, 199, 8190, 8191] {
                    let want_any = Tier::ALL.iter().any(|t| model.contains(&(s, *t)));
                    let (w, bit) = split(s);
                    let (any, tiers) = view.words(w);
                    prop_assert_eq!(any & bit != 0, want_any);
                    for t in Tier::ALL {
                        prop_assert_eq!(tiers[t as usize] & bit != 0, model.contains(&(s, t)));
                    }
                    prop_assert_eq!(view.best_tier(s), Tier::ALL.into_iter().find(|t| model.contains(&(s, *t))));
                }
                let slots: std::collections::HashSet<u32> = model.iter().map(|(s, _)| *s).collect();
                let fits = slots.len() <= LANES && slots.iter().all(|&s| s <= MAX_LANE_SLOT);
                prop_assert_eq!(holders.wide_set().is_none(), fits, "packed exactly when the set fits");
                prop_assert_eq!(wide.len(), usize::from(!fits));
            }
        }

        /// Blocks with the same holders share one wide set, and a set is freed with its last
        /// user: after any edits to several blocks (each edit to some of them at once, as an
        /// endpoint stores or evicts a chain; a slot past the first word re-lays the arena on
        /// the way), each block reads as its own model, equal wide blocks carry the same set,
        /// and the arena holds exactly one set per distinct wide contents.
        #[test]
        fn blocks_with_equal_holders_share_one_set(ops in proptest::collection::vec((1usize..16, any::<bool>(), prop_oneof![8 => 0u32..7, 1 => 60u32..70, 1 => 130u32..133], 0usize..3), 0..300)) {
            let mut wide = WideHolders::default();
            let mut blocks = [Holders::default(); 4];
            let mut models: Vec<std::collections::BTreeSet<(u32, usize)>> = vec![Default::default(); 4];
            for (mask, insert, slot, tier) in ops {
                for block in (0..4).filter(|b| mask & (1 << b) != 0) {
                    if insert {
                        prop_assert_eq!(wide.insert(&mut blocks[block], slot, Tier::ALL[tier]), models[block].insert((slot, tier)));
                    } else {
                        prop_assert_eq!(wide.remove(&mut blocks[block], slot, Tier::ALL[tier]), models[block].remove(&(slot, tier)));
                    }
                }
                for (holders, model) in blocks.iter().zip(&models) {
                    let view = wide.view(*holders);
                    for s in (0..7).chain(60..70).chain(130..133) {
                        for t in 0..3 {
                            prop_assert_eq!(view.has(s, Tier::ALL[t]), model.contains(&(s, t)));
                        }
                    }
                }
                let wide_models: Vec<_> = (0..4).filter(|&b| blocks[b].wide_set().is_some()).collect();
                for &a in &wide_models {
                    for &b in &wide_models {
                        prop_assert_eq!(blocks[a] == blocks[b], models[a] == models[b], "a set per contents");
                    }
                }
                let distinct: std::collections::BTreeSet<_> = wide_models.iter().map(|&b| &models[b]).collect();
                prop_assert_eq!(wide.len(), distinct.len());
                prop_assert_eq!(wide.users(), wide_models.len() as u64);
            }
        }
    }
}
