//! A compact open-addressing hash table for the index's two big maps.
//!
//! Both maps (router key → holders, and per endpoint engine hash → router key) hold 16-byte
//! entries keyed by values that are already hashes, and both are most of the index's memory. A
//! general-purpose table spends a control byte per bucket and runs between 44% and 87.5% full
//! (it doubles); this one keeps entries in one flat array with no per-slot metadata, resizes by
//! a quarter, and stays between 72% and 90% full: the least fill that keeps an unshared entry
//! (two 16-byte slots) within 48 bytes right after a resize, 32 / 0.72 ≈ 44 B plus allocator
//! overhead. Robin Hood linear probing keeps probe sequences short at that load: an entry never
//! sits further from its home slot than the entries it passed, and a search stops as soon as it
//! meets an entry closer to home than it would be.
//! Deletion shifts the following entries back (no tombstones), so a table that churns forever
//! does not degrade.
//!
//! A table resizes in one step, so a large one is kept as parts ([`super::split_table`]) whose
//! steps are short.
//!
//! Slots are addressed by position, so a caller can walk the table incrementally from a saved
//! position (the capacity bound's clock hand) and the lookup can prefetch a key's home slot
//! before it needs it.

/// An entry of a [`FlatTable`]: a key that is already well mixed, and a way to tell an unused
/// slot (the all-default value) from a used one.
pub(crate) trait Slot: Copy + Default {
    /// The entry's key.
    fn key(&self) -> u64;
    /// Whether this slot is unused.
    fn is_vacant(&self) -> bool;
}

/// Load factor above which the table grows.
const MAX_LOAD_PERCENT: usize = 90;
/// Probes before a search starts checking for Robin Hood's early exit.
const EARLY_EXIT_AFTER: usize = 2;
/// Smallest non-zero capacity.
const MIN_CAPACITY: usize = 16;

/// Where an absent key goes in a [`FlatTable`]: slot `at`, vacant, or holding the first entry
/// of the run whose home is later than the key's.
struct Gap {
    at: usize,
    vacant: bool,
}

/// Where [`FlatTable::push_in_home_order`] put its last entry: the end of the table's last
/// run and that entry's home, until an entry wraps past the last slot (then `plain`).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Tail {
    last: Option<(usize, usize)>,
    plain: bool,
}

/// A Robin Hood hash table of [`Slot`]s.
///
/// Aligned to its 32-byte size, so that a [`super::split_table::SplitTable`]'s parts never
/// straddle two cache lines: [`Self::prefetch_header`] fetches one line and gets all of it.
#[derive(Clone, Debug, Default)]
#[repr(align(32))]
pub(crate) struct FlatTable<E> {
    slots: Vec<E>,
    len: usize,
}

/// Spreads a key over 64 bits (keys from tests and some engines are small integers), so that
/// the top bits pick the home slot well.
#[inline]
fn mix(key: u64) -> u64 {
    // Fibonacci hashing: one multiply moves every input bit into the top bits that the range
    // reduction reads.
    key.wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

impl<E: Slot> FlatTable<E> {
    /// Entries held.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Slots allocated (used or not).
    pub(crate) fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// Bytes of the slot array.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<E>()
    }

    #[inline]
    fn home(&self, key: u64) -> usize {
        // Fast range reduction: any capacity, no modulo.
        ((mix(key) as u128 * self.slots.len() as u128) >> 64) as usize
    }

    /// How far the entry at `at` sits from its home slot.
    #[inline]
    fn distance(&self, at: usize) -> usize {
        let home = self.home(self.slots[at].key());
        // Both lie in `0..len`, so the probe distance wraps at most once: one comparison
        // instead of a division (insertion and removal compute this for every slot they pass).
        if at >= home {
            at - home
        } else {
            at + self.slots.len() - home
        }
    }

    #[inline]
    fn next(&self, at: usize) -> usize {
        if at + 1 == self.slots.len() {
            0
        } else {
            at + 1
        }
    }

    /// Where `key`'s entry is, if present.
    #[inline]
    pub(crate) fn find(&self, key: u64) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        let mut at = self.home(key);
        let mut dist = 0;
        loop {
            let slot = &self.slots[at];
            if slot.is_vacant() {
                return None;
            }
            if slot.key() == key {
                return Some(at);
            }
            // Robin Hood invariant: had `key` been here, it would sit before this entry. The
            // check costs a hash of the resident's key, so the first probes (where a present
            // key is usually found) skip it; skipping it never changes the answer.
            if dist >= EARLY_EXIT_AFTER && self.distance(at) < dist {
                return None;
            }
            dist += 1;
            at = self.next(at);
        }
    }

    /// The entry for `key`.
    #[inline]
    pub(crate) fn get(&self, key: u64) -> Option<&E> {
        self.find(key).map(|at| &self.slots[at])
    }

    /// The entry at slot `at`, mutably, if used.
    pub(crate) fn at_mut(&mut self, at: usize) -> Option<&mut E> {
        self.slots.get_mut(at).filter(|e| !e.is_vacant())
    }

    /// The entry for `entry.key()`, inserting `entry` first if the key is absent; the flag says
    /// whether it was inserted.
    #[cfg(test)]
    pub(crate) fn get_or_insert(&mut self, entry: E) -> (&mut E, bool) {
        self.get_or_insert_with(entry.key(), || entry)
    }

    /// The entry for `key`, inserting `make()` (whose key must be `key`) first if the key is
    /// absent; the flag says whether it was inserted. One walk of the probe sequence: where a
    /// search for an absent key stops is where Robin Hood insertion puts it ([`Self::probe`]).
    pub(crate) fn get_or_insert_with(
        &mut self,
        key: u64,
        make: impl FnOnce() -> E,
    ) -> (&mut E, bool) {
        if (self.len + 1) * 100 > self.slots.len() * MAX_LOAD_PERCENT {
            // An insertion would grow the table: a present key must not.
            if let Some(at) = self.find(key) {
                return (&mut self.slots[at], false);
            }
            self.grow();
        }
        match self.probe(key) {
            Ok(at) => (&mut self.slots[at], false),
            Err(gap) => {
                let entry = make();
                debug_assert!(entry.key() == key, "make() must build the entry for `key`");
                let at = self.fill(gap, entry);
                self.len += 1;
                (&mut self.slots[at], true)
            }
        }
    }

    /// Walks `key`'s probe sequence from its home slot (the table must have slots): `Ok` with
    /// the key's slot, or `Err` with where Robin Hood order puts the absent key, the first
    /// vacant slot or the first entry closer to its home (whose home is later). Unlike
    /// [`Self::find`] it checks the order at every slot, as an insertion must.
    #[inline]
    fn probe(&self, key: u64) -> Result<usize, Gap> {
        let mut at = self.home(key);
        let mut dist = 0;
        loop {
            let slot = &self.slots[at];
            if slot.is_vacant() {
                return Err(Gap { at, vacant: true });
            }
            if slot.key() == key {
                return Ok(at);
            }
            if self.distance(at) < dist {
                return Err(Gap { at, vacant: false });
            }
            dist += 1;
            at = self.next(at);
        }
    }

    /// Puts `entry`, absent, where [`Self::probe`] stopped for its key; returns its slot (the
    /// caller counts it in `len`).
    #[inline]
    fn fill(&mut self, gap: Gap, entry: E) -> usize {
        debug_assert!(!entry.is_vacant(), "a vacant entry cannot be inserted");
        if gap.vacant {
            self.slots[gap.at] = entry;
        } else {
            self.shift_in(gap.at, entry);
        }
        gap.at
    }

    /// Puts `entry` at slot `at`, where a search for its key stopped at an entry closer to its
    /// home, moving that entry and the ones after it, up to the next vacant slot, one slot on.
    ///
    /// Robin Hood order keeps each run of used slots sorted by home slot (an entry passes every
    /// entry whose home is not later than its own and stops at the first whose home is later),
    /// so the new entry belongs before every entry from `at` to the end of the run, and moving
    /// them all one slot on keeps the run sorted: a copy, with no distance to compute (the
    /// swapping insertion recomputed one for every slot it passed).
    fn shift_in(&mut self, at: usize, entry: E) {
        let mut end = at;
        while !self.slots[end].is_vacant() {
            end = self.next(end);
        }
        if end > at {
            self.slots.copy_within(at..end, at + 1);
        } else {
            // The run wraps past the last slot: move the part at the start first.
            self.slots.copy_within(0..end, 1);
            let last = self.slots.len() - 1;
            self.slots[0] = self.slots[last];
            self.slots.copy_within(at..last, at + 1);
        }
        self.slots[at] = entry;
    }

    fn grow(&mut self) {
        let capacity = (self.slots.len() + self.slots.len() / 4).max(MIN_CAPACITY);
        let old = std::mem::replace(self, Self::with_capacity(capacity));
        let mut tail = Tail::default();
        for entry in old.into_entries_by_home() {
            self.push_in_home_order(entry, &mut tail);
        }
    }

    fn with_capacity(capacity: usize) -> Self {
        Self {
            slots: vec![E::default(); capacity],
            len: 0,
        }
    }

    /// Removes the entry at slot `at`, shifting the entries after it back. Entries that were
    /// after `at` in probe order may move to `at`.
    pub(crate) fn remove_at(&mut self, at: usize) -> E {
        let removed = self.slots[at];
        let mut hole = at;
        loop {
            let next = self.next(hole);
            if self.slots[next].is_vacant() || self.distance(next) == 0 {
                break;
            }
            self.slots[hole] = self.slots[next];
            hole = next;
        }
        self.slots[hole] = E::default();
        self.len -= 1;
        removed
    }

    /// Removes `key`'s entry.
    #[cfg(test)]
    pub(crate) fn remove(&mut self, key: u64) -> Option<E> {
        self.find(key).map(|at| self.remove_at(at))
    }

    /// Every used entry.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &E> {
        self.slots.iter().filter(|e| !e.is_vacant())
    }

    /// An empty table with room for `entries` at about 80% full (between the load bounds, so it
    /// neither grows at once nor wastes slots).
    pub(crate) fn with_room_for(entries: usize) -> Self {
        if entries == 0 {
            return Self::default();
        }
        Self::with_capacity((entries * 5 / 4 + 1).max(MIN_CAPACITY))
    }

    /// Every used entry, taking them out (the slots are freed), in the order of their home
    /// slots: from the slot after a vacant one round to it, each run of used slots is sorted
    /// by home, and a run that wraps past the last slot comes out whole.
    pub(crate) fn into_entries_by_home(self) -> impl Iterator<Item = E> {
        let start = self.slots.iter().position(Slot::is_vacant).unwrap_or(0);
        let mut slots = self.slots;
        slots.rotate_left(start);
        slots.into_iter().filter(|e| !e.is_vacant())
    }

    /// Inserts `entry`, whose key the caller knows to be absent, into a table it is refilling
    /// from another table's [`Self::into_entries_by_home`] (sized with room for them all, so the
    /// load is not checked).
    ///
    /// A key's home slot grows with its mixed value whatever the capacity, so entries that
    /// arrive in home order belong at the end of the last run: the entry goes to its home if
    /// that lies past the run, else right after it, with no probe and no shift (a plain
    /// insertion walks the last run; refilling this way cut the memory bench's growth p99 by
    /// about a fifth).
    /// Keys that shared a home in the old table may arrive out of order in the new one; those,
    /// and entries that would wrap past the last slot, take the plain insertion.
    pub(crate) fn push_in_home_order(&mut self, entry: E, tail: &mut Tail) {
        let home = self.home(entry.key());
        if !tail.plain {
            let at = match tail.last {
                None => Some(home),
                Some((at, _)) if home > at => Some(home),
                Some((at, last_home)) if home >= last_home => Some(at + 1),
                Some(_) => None,
            };
            if let Some(at) = at.filter(|&at| at < self.slots.len()) {
                debug_assert!(
                    self.slots[at].is_vacant(),
                    "nothing is placed past the tail"
                );
                self.slots[at] = entry;
                self.len += 1;
                tail.last = Some((at, home));
                return;
            }
        }
        debug_assert!(
            self.len < self.slots.len(),
            "a full table cannot take an entry"
        );
        if let Err(gap) = self.probe(entry.key()) {
            self.fill(gap, entry);
            self.len += 1;
        }
        // A plain insertion into the last run moves its end one slot on; one that wrapped past
        // the last slot leaves entries at the start, where the fast path could not see them.
        if let Some((at, last_home)) = tail.last.filter(|_| !tail.plain) {
            if at + 1 >= self.slots.len() {
                tail.plain = true;
            } else if !self.slots[at + 1].is_vacant() {
                tail.last = Some((at + 1, last_home));
            }
        }
    }

    /// Whether every run of used slots is in Robin Hood order: along a run, an entry sits at
    /// most one slot further from its home than the entry before it (homes never go back),
    /// and no run starts with an entry away from its home.
    #[cfg(test)]
    pub(crate) fn is_in_robin_hood_order(&self) -> bool {
        let len = self.slots.len();
        (0..len).all(|at| {
            if self.slots[at].is_vacant() {
                return true;
            }
            let before = (at + len - 1) % len;
            let dist = self.distance(at);
            if self.slots[before].is_vacant() {
                dist == 0
            } else {
                dist <= self.distance(before) + 1
            }
        })
    }

    /// Starts loading this table's header (its array's address and size, which finding a
    /// key's home slot reads) into the CPU caches: one line, the header being 32 bytes aligned.
    #[inline]
    pub(crate) fn prefetch_header(&self) {
        prefetch_line(&self.len);
    }

    /// Starts loading `key`'s home slot into the CPU caches, so that a later [`find`] does not
    /// wait for memory (a cold lookup walks hundreds of keys, each in a random place).
    ///
    /// [`find`]: Self::find
    #[inline]
    pub(crate) fn prefetch(&self, key: u64) {
        if self.slots.is_empty() {
            return;
        }
        prefetch_line(&self.slots[self.home(key)]);
    }
}

/// Starts loading the cache line `value` lives in, without waiting for it.
///
/// On x86-64 this is the `prefetcht0` instruction. The stand-in it replaced, a load handed to
/// `black_box`, also started the access, but a load must complete before the CPU retires it,
/// so a walk issuing sixteen of them ahead filled the reorder buffer and waited; a prefetch
/// retires at once (cold lookups 15–20% faster, `docs/benchmarks.md`). Elsewhere it is that
/// load.
#[inline(always)]
pub(crate) fn prefetch_line<T: Copy>(value: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `_mm_prefetch` is `unsafe` only because it is a `#[target_feature(enable =
    // "sse")]` function taking a raw pointer. SSE is part of the x86-64 baseline, so the
    // instruction exists on every CPU this code can run on; and a prefetch never dereferences
    // its pointer in the language's sense (it cannot fault, and changes no value any load
    // observes), besides which the pointer comes from a live reference.
    #[allow(unsafe_code)]
    unsafe {
        use core::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        _mm_prefetch::<_MM_HINT_T0>(core::ptr::from_ref(value).cast::<i8>());
    }
    #[cfg(not(target_arch = "x86_64"))]
    std::hint::black_box(*value);
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;
    use crate::index::table_testing::{Pair, apply_op};

    /// The first keys whose home is `home` in a table of `table`'s size.
    fn keys_at_home(table: &FlatTable<Pair>, home: usize, count: usize) -> Vec<u64> {
        (1u64..)
            .filter(|&k| table.home(k) == home)
            .take(count)
            .collect()
    }

    /// An insertion into a run that wraps past the last slot moves the entries at both ends
    /// and loses none: the case small random tables reach only by chance.
    #[test]
    fn an_insertion_into_a_run_that_wraps_keeps_every_entry() {
        let mut table = FlatTable::<Pair>::default();
        table.get_or_insert(Pair { key: 0, value: 1 });
        table.remove(0);
        let last = table.capacity() - 1;
        let before_last = keys_at_home(&table, last - 1, 2);
        let at_last = keys_at_home(&table, last, 2);
        // The run: before_last[0] in the second-to-last slot, at_last[0] in the last, at_last[1]
        // wrapped to slot 0. before_last[1] then belongs in the last slot, before both.
        for (value, &key) in [before_last[0], at_last[0], at_last[1], before_last[1]]
            .iter()
            .enumerate()
        {
            let (_, new) = table.get_or_insert(Pair {
                key,
                value: value as u64 + 1,
            });
            assert!(new);
        }
        assert_eq!(table.len(), 4);
        for (value, key) in [before_last[0], at_last[0], at_last[1], before_last[1]]
            .into_iter()
            .enumerate()
        {
            assert_eq!(table.get(key).map(|p| p.value), Some(value as u64 + 1));
        }
        assert_eq!(table.find(before_last[1]), Some(last));
        assert_eq!(table.find(at_last[1]), Some(1), "moved on past the wrap");
        assert!(table.is_in_robin_hood_order());
    }

    proptest! {
        /// The table behaves like a map, whatever the keys (small, clustered or random), and
        /// stays within its load bounds.
        #[test]
        fn behaves_like_a_map(ops in proptest::collection::vec((0u8..3, 0u64..64, 1u64..1000), 0..600),
                              spread in prop_oneof![Just(1u64), Just(1 << 40), Just(0x9e37_79b9_7f4a_7c15)]) {
            let mut table = FlatTable::<Pair>::default();
            let mut model = HashMap::new();
            for (op, k, value) in ops {
                let key = k.wrapping_mul(spread);
                apply_op(&mut table, &mut model, op, key, value)?;
                prop_assert!(table.len() * 100 <= table.capacity() * MAX_LOAD_PERCENT || table.capacity() == 0);
                prop_assert!(table.is_in_robin_hood_order());
            }
            for (key, value) in &model {
                prop_assert_eq!(table.get(*key).map(|p| p.value), Some(*value));
            }
            prop_assert_eq!(table.iter().count(), model.len());
        }

        /// A table refilled in home order from another, of any size with room (ties in the old
        /// table, runs that wrap past the last slot in either), is in Robin Hood order and
        /// holds every entry.
        #[test]
        fn a_refill_in_home_order_keeps_the_order(keys in proptest::collection::hash_set(1u64..5000, 0..200),
                                                  spread in prop_oneof![Just(1u64), Just(0x9e37_79b9_7f4a_7c15)],
                                                  extra in 0usize..300) {
            let mut old = FlatTable::<Pair>::default();
            for &k in &keys {
                old.get_or_insert(Pair { key: k.wrapping_mul(spread), value: k });
            }
            let mut new = FlatTable::<Pair>::with_capacity(keys.len() + 1 + extra);
            let mut tail = Tail::default();
            for entry in old.into_entries_by_home() {
                new.push_in_home_order(entry, &mut tail);
            }
            prop_assert!(new.is_in_robin_hood_order());
            prop_assert_eq!(new.len(), keys.len());
            for &k in &keys {
                prop_assert_eq!(new.get(k.wrapping_mul(spread)).map(|p| p.value), Some(k));
            }
        }
    }
}
