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

use hashbrown::HashTable;

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
        (self.0 & WIDE_MARK == WIDE_MARK).then_some(self.0 as u32 as usize)
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

/// The holder sets of blocks with more holders than a packed word takes: an arena of sets of
/// `stride` words each, set `i` at `words[i * stride..]`, word `3w + tier` for slot word `w`.
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
    /// A view of `holders`.
    #[inline]
    pub(crate) fn view(&self, holders: Holders) -> HolderView<'_> {
        match holders.wide_set() {
            Some(set) => HolderView::Wide(&self.words[set * self.stride..][..self.stride]),
            None => HolderView::Packed(holders.0),
        }
    }

    /// Starts loading `holders`' wide set into the CPU caches, if it has one.
    #[inline]
    pub(crate) fn prefetch(&self, holders: Holders) {
        if let Some(set) = holders.wide_set() {
            // One cache line is eight words; a set spans `stride` words.
            for word in (0..self.stride).step_by(8) {
                prefetch_line(&self.words[set * self.stride + word]);
            }
        }
    }

    /// Marks `slot` as holding the block on `tier`; returns whether that was new.
    pub(crate) fn insert(&mut self, holders: &mut Holders, slot: u32, tier: Tier) -> bool {
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

    /// Heap bytes of the arena and its index.
    pub(crate) fn heap_bytes(&self) -> usize {
        (self.words.capacity() + self.scratch.capacity()) * 8
            + (self.users.capacity() + self.free.capacity()) * 4
            + self.by_contents.allocation_size()
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
