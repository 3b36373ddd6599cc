//! A [`FlatTable`] kept as parts that split one at a time as it grows, so that no insertion
//! moves more than a part's entries or two, whatever the table's size.
//!
//! A flat table grows in one step: every entry moves at once (an endpoint table of 250k entries
//! paused its batch for 7–9 ms), and the index's lock is held meanwhile. A table kept as two
//! arrays while it grows has no pause, but one whose writes stop mid-growth keeps both (2.25×
//! its slots), which the router's memory budget cannot afford (`docs/benchmarks-log.md`, "Table
//! growth, incremental"). This table grows by linear hashing instead:
//! - its parts are numbered `0..n`, and a key's part is its part hash modulo `2^k`, or modulo
//!   `2^(k+1)` for the low parts already split this round (`2^k ≤ n < 2^(k+1)`);
//! - once the table holds more than its split size in entries per part, the next part in turn
//!   is split in two: its entries are divided between itself and a new last part, each rebuilt
//!   at 80% full;
//! - between splits each part is a flat table that grows by a quarter.
//!
//! So a step moves one part: about the split size in entries, twice that for a part that this
//! round has not reached yet (an insertion that splits a part may also grow its key's own).
//! The parts stay within the flat table's load bounds, and only one part is rebuilt at a time,
//! so the memory per entry is the flat table's. A table of at most the split size is one flat
//! table, as before. The price is more steps, each short: a growing index pauses more batches
//! a little and none for long (`docs/benchmarks-log.md`, "Table growth by parts").
//!
//! Slots are addressed by [`Position`] (a part and a slot in it), for the capacity bound's
//! clock hand.

use super::table::{FlatTable, Slot, Tail};

/// Entries per part above which the next part is split, in the block table and the endpoint
/// tables alike. A part then holds 0.5–2k entries, so a step moves at most a few thousand
/// (tens of microseconds). Larger parts would mean fewer parts' headers for a lookup to read
/// (32 B per thousand entries; prefetched, see [`SplitTable::locate`]), but longer steps, and
/// arrays past the size from which glibc's allocator maps memory of its own: with 8k-entry
/// block parts an index held 48.4 B of RSS per entry, against 46.1 B with these
/// (`docs/benchmarks-log.md`, "Table growth by parts").
pub(crate) const SPLIT_AT: usize = 1024;

/// A slot of a [`SplitTable`]: a part and a slot in that part's array.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Position {
    part: usize,
    slot: usize,
}

impl Position {
    /// The slot after this one in the same part (see [`SplitTable::wrap`]).
    pub(crate) fn next(self) -> Self {
        Self {
            part: self.part,
            slot: self.slot + 1,
        }
    }
}

/// A key's part in a [`SplitTable`], from [`SplitTable::locate`]; valid until the table changes.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct PartId(usize);

/// A hash table of [`Slot`]s that grows one part at a time (see the module doc).
#[derive(Clone, Debug)]
pub(crate) struct SplitTable<E> {
    parts: Vec<FlatTable<E>>,
    len: usize,
    split_at: usize,
}

impl<E: Slot> Default for SplitTable<E> {
    fn default() -> Self {
        Self {
            parts: vec![FlatTable::default()],
            len: 0,
            split_at: SPLIT_AT,
        }
    }
}

/// The bits that choose a key's part: independent of the bits a flat table's home slot uses
/// (the top bits of another multiply), and well mixed in the low bits that linear hashing
/// reads.
#[inline]
fn part_hash(key: u64) -> u64 {
    (key ^ (key >> 29)).wrapping_mul(0xbf58_476d_1ce4_e5b9) >> 24
}

impl<E: Slot> SplitTable<E> {
    /// An empty table that splits a part once it holds more than `split_at` entries per part
    /// (tests use small values to meet splits early).
    #[cfg(test)]
    pub(crate) fn with_split_at(split_at: usize) -> Self {
        Self {
            split_at: split_at.max(1),
            ..Self::default()
        }
    }

    /// Parts at the start of this round of splits: the largest power of two not above the
    /// number of parts. Parts `0..n - round` are split this round, their halves at `round..n`.
    #[inline]
    fn round(&self) -> usize {
        1usize << (usize::BITS - 1 - self.parts.len().leading_zeros())
    }

    /// The part `key` lives in.
    #[inline]
    fn part_of(&self, key: u64) -> usize {
        let round = self.round();
        let h = part_hash(key) as usize;
        let part = h & (round - 1);
        if part < self.parts.len() - round {
            h & (2 * round - 1)
        } else {
            part
        }
    }

    /// Entries held.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Bytes of the parts' slot arrays and headers.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.parts.iter().map(FlatTable::heap_bytes).sum::<usize>()
            + self.parts.capacity() * std::mem::size_of::<FlatTable<E>>()
    }

    /// The entry for `key`.
    #[inline]
    pub(crate) fn get(&self, key: u64) -> Option<&E> {
        self.parts[self.part_of(key)].get(key)
    }

    /// Where `key`'s entry is, if present.
    pub(crate) fn find(&self, key: u64) -> Option<Position> {
        let part = self.part_of(key);
        self.parts[part]
            .find(key)
            .map(|slot| Position { part, slot })
    }

    /// The entry at `at`, mutably, if used.
    pub(crate) fn at_mut(&mut self, at: Position) -> Option<&mut E> {
        self.parts.get_mut(at.part)?.at_mut(at.slot)
    }

    /// Removes the entry at `at` (which must be used). Entries after it in its part may move
    /// to `at`.
    pub(crate) fn remove_at(&mut self, at: Position) -> E {
        self.len -= 1;
        self.parts[at.part].remove_at(at.slot)
    }

    /// Removes `key`'s entry.
    pub(crate) fn remove(&mut self, key: u64) -> Option<E> {
        self.find(key).map(|at| self.remove_at(at))
    }

    /// The entry for `entry.key()`, inserting `entry` first if the key is absent; the flag says
    /// whether it was inserted.
    pub(crate) fn get_or_insert(&mut self, entry: E) -> (&mut E, bool) {
        self.get_or_insert_with(entry.key(), || entry)
    }

    /// The entry for `key`, inserting `make()` (whose key must be `key`) first if the key is
    /// absent; the flag says whether it was inserted. An insertion that takes the table past
    /// its split size in entries per part splits the next part first; the key's own part may
    /// then grow too.
    pub(crate) fn get_or_insert_with(
        &mut self,
        key: u64,
        make: impl FnOnce() -> E,
    ) -> (&mut E, bool) {
        if self.len + 1 > self.parts.len() * self.split_at && self.get(key).is_none() {
            self.split_next();
        }
        let part = self.part_of(key);
        let (entry, new) = self.parts[part].get_or_insert_with(key, make);
        if new {
            self.len += 1;
        }
        (entry, new)
    }

    /// Splits the next part in linear hashing's order: its entries are divided between it and
    /// a new last part, each rebuilt at 80% full.
    fn split_next(&mut self) {
        let n = self.parts.len();
        let round = self.round();
        let splitting = n - round;
        let old = std::mem::take(&mut self.parts[splitting]);
        // With the new part counted, each key goes to `splitting` or `n` (= `splitting + round`).
        let goes_up = |key: u64| part_hash(key) as usize & round != 0;
        let up = old.iter().filter(|e| goes_up(e.key())).count();
        let mut stay = FlatTable::with_room_for(old.len() - up);
        let mut moved = FlatTable::with_room_for(up);
        let (mut stay_tail, mut moved_tail) = (Tail::default(), Tail::default());
        for entry in old.into_entries_by_home() {
            if goes_up(entry.key()) {
                moved.push_in_home_order(entry, &mut moved_tail);
            } else {
                stay.push_in_home_order(entry, &mut stay_tail);
            }
        }
        self.parts[splitting] = stay;
        self.parts.push(moved);
        debug_assert!(
            self.parts[splitting]
                .iter()
                .all(|e| self.part_of(e.key()) == splitting)
                && self.parts[n].iter().all(|e| self.part_of(e.key()) == n)
        );
    }

    /// Every used entry.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &E> {
        self.parts.iter().flat_map(FlatTable::iter)
    }

    /// Removes every entry and frees the slots.
    pub(crate) fn clear(&mut self) {
        self.parts = vec![FlatTable::default()];
        self.len = 0;
    }

    /// Starts loading `key`'s home slot into the CPU caches.
    #[inline]
    pub(crate) fn prefetch(&self, key: u64) {
        self.parts[self.part_of(key)].prefetch(key);
    }

    /// Finds `key`'s part and starts loading its header into the CPU caches, for a walk that
    /// looks at many keys in a pipeline ([`Self::prefetch_in`], then [`Self::get_in`]): the
    /// part is found once per key, and a table of many parts has more headers than the caches
    /// keep after a cold spell.
    #[inline]
    pub(crate) fn locate(&self, key: u64) -> PartId {
        let part = self.part_of(key);
        self.parts[part].prefetch_header();
        PartId(part)
    }

    /// Starts loading `key`'s home slot, in the part [`Self::locate`] found, into the CPU caches.
    #[inline]
    pub(crate) fn prefetch_in(&self, part: PartId, key: u64) {
        self.parts[part.0].prefetch(key);
    }

    /// The entry for `key`, in the part [`Self::locate`] found.
    #[inline]
    pub(crate) fn get_in(&self, part: PartId, key: u64) -> Option<&E> {
        self.parts[part.0].get(key)
    }

    /// `at` if it names a slot, else the first slot of the next part that has slots, or else
    /// the table's first position (which names no slot if part 0 has none: the walk's next step
    /// moves on). A walk by position goes `wrap(at.next())` and passes every slot in turn; parts
    /// split or grown between two of its steps may move entries past it, or back before it.
    pub(crate) fn wrap(&self, at: Position) -> Position {
        let mut at = at;
        while at.part < self.parts.len() && at.slot >= self.parts[at.part].capacity() {
            at = Position {
                part: at.part + 1,
                slot: 0,
            };
        }
        if at.part >= self.parts.len() {
            Position::default()
        } else {
            at
        }
    }

    /// Parts (for tests).
    #[cfg(test)]
    pub(crate) fn parts(&self) -> &[FlatTable<E>] {
        &self.parts
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;
    use crate::index::table_testing::{Pair, apply_op};

    /// Every entry sits in the part its key maps to (a split that put an entry in the wrong
    /// half would make it unfindable), and every part is in Robin Hood order.
    fn entries_in_their_parts(table: &SplitTable<Pair>) -> bool {
        table.parts().iter().enumerate().all(|(i, part)| {
            part.is_in_robin_hood_order() && part.iter().all(|e| table.part_of(e.key) == i)
        })
    }

    proptest! {
        /// The table behaves like a map while its parts split, whatever the keys, and counts
        /// its entries.
        #[test]
        fn behaves_like_a_map(ops in proptest::collection::vec((0u8..3, 0u64..256, 1u64..1000), 0..800),
                              spread in prop_oneof![Just(1u64), Just(1 << 40), Just(0x9e37_79b9_7f4a_7c15)],
                              split_at in 1usize..12) {
            let mut table = SplitTable::<Pair>::with_split_at(split_at);
            let mut model = HashMap::new();
            for (op, k, value) in ops {
                let key = k.wrapping_mul(spread);
                apply_op(&mut table, &mut model, op, key, value)?;
            }
            prop_assert!(entries_in_their_parts(&table));
            for (key, value) in &model {
                prop_assert_eq!(table.get(*key).map(|p| p.value), Some(*value));
            }
            prop_assert_eq!(table.iter().count(), model.len());
            // Parts are only added: one per `split_at` entries the table ever held.
            prop_assert!(table.parts().len() <= model.len().max(1) + 800 / split_at + 1);
        }
    }

    /// What the split buys: a table of a million entries never holds a part much larger than
    /// [`SPLIT_AT`] entries, so no insertion moves more than that, and the parts stay within
    /// the flat table's load bounds, so the memory per entry is the flat table's.
    #[test]
    fn no_part_outgrows_its_share_and_parts_stay_full() {
        let mut table = SplitTable::<Pair>::default();
        let mut largest_part = 0;
        for i in 1..=1_000_000u64 {
            table.get_or_insert(Pair {
                key: i.wrapping_mul(0x2545_f491_4f6c_dd1d),
                value: i,
            });
            if i % 65_536 == 0 {
                largest_part = table
                    .parts()
                    .iter()
                    .map(FlatTable::capacity)
                    .max()
                    .unwrap_or(0)
                    .max(largest_part);
            }
        }
        assert!(entries_in_their_parts(&table));
        assert!(table.parts().len() >= 1_000_000 / SPLIT_AT);
        assert!(
            largest_part <= 3 * SPLIT_AT,
            "a part of {largest_part} slots: a step moves more than a part's share"
        );
        let slots: usize = table.parts().iter().map(FlatTable::capacity).sum();
        let load = table.len() as f64 / slots as f64;
        assert!(
            (0.6..=0.9).contains(&load),
            "{load:.2} full: the parts waste memory"
        );
    }

    /// A walk by position from any slot, wrapping, visits every entry once per round.
    #[test]
    fn a_walk_by_position_visits_every_entry_once_per_round() {
        let mut table = SplitTable::<Pair>::with_split_at(5);
        for i in 1..=200u64 {
            table.get_or_insert(Pair { key: i, value: i });
        }
        assert!(table.parts().len() > 30, "the walk crosses many parts");
        let slots: usize = table.parts().iter().map(FlatTable::capacity).sum();
        let mut at = table.wrap(Position { part: 7, slot: 3 });
        let mut seen = HashMap::new();
        for _ in 0..slots {
            if let Some(entry) = table.at_mut(at) {
                *seen.entry(entry.key).or_insert(0) += 1;
            }
            at = table.wrap(at.next());
        }
        assert_eq!(seen.len(), 200);
        assert!(seen.values().all(|&n| n == 1));
    }
}
