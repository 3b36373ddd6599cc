//! Test support shared by the flat table's and the split table's tests: an entry type, and one
//! step of the "behaves like a map" property test run against a `HashMap` model.

use std::collections::HashMap;

use proptest::prelude::*;

use super::split_table::SplitTable;
use super::table::{FlatTable, Slot};

/// A key and a non-zero value (zero marks a vacant slot).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct Pair {
    pub(crate) key: u64,
    pub(crate) value: u64,
}

impl Slot for Pair {
    fn key(&self) -> u64 {
        self.key
    }
    fn is_vacant(&self) -> bool {
        self.value == 0
    }
}

/// The map operations the property test drives.
pub(crate) trait MapUnderTest {
    /// See `get_or_insert` on the tables.
    fn get_or_insert(&mut self, entry: Pair) -> (&mut Pair, bool);
    /// Removes `key` by key.
    fn remove(&mut self, key: u64) -> Option<Pair>;
    /// Whether `key` is found, then removes it by the position found.
    fn find_then_remove(&mut self, key: u64) -> (bool, Option<Pair>);
    /// Entries held.
    fn len(&self) -> usize;
}

impl MapUnderTest for FlatTable<Pair> {
    fn get_or_insert(&mut self, entry: Pair) -> (&mut Pair, bool) {
        FlatTable::get_or_insert(self, entry)
    }
    fn remove(&mut self, key: u64) -> Option<Pair> {
        FlatTable::remove(self, key)
    }
    fn find_then_remove(&mut self, key: u64) -> (bool, Option<Pair>) {
        let at = self.find(key);
        (at.is_some(), at.map(|at| self.remove_at(at)))
    }
    fn len(&self) -> usize {
        FlatTable::len(self)
    }
}

impl MapUnderTest for SplitTable<Pair> {
    fn get_or_insert(&mut self, entry: Pair) -> (&mut Pair, bool) {
        SplitTable::get_or_insert(self, entry)
    }
    fn remove(&mut self, key: u64) -> Option<Pair> {
        SplitTable::remove(self, key)
    }
    fn find_then_remove(&mut self, key: u64) -> (bool, Option<Pair>) {
        let at = self.find(key);
        (at.is_some(), at.map(|at| self.remove_at(at)))
    }
    fn len(&self) -> usize {
        SplitTable::len(self)
    }
}

/// Applies operation `op` (0 insert or update, 1 remove by key, else find then remove by
/// position) for `key` to `table` and `model`, checking that both answer alike.
pub(crate) fn apply_op(
    table: &mut impl MapUnderTest,
    model: &mut HashMap<u64, u64>,
    op: u8,
    key: u64,
    value: u64,
) -> Result<(), TestCaseError> {
    match op {
        0 => {
            let (entry, new) = table.get_or_insert(Pair { key, value });
            prop_assert_eq!(new, !model.contains_key(&key));
            entry.value = value;
            model.insert(key, value);
        }
        1 => prop_assert_eq!(table.remove(key).map(|p| p.value), model.remove(&key)),
        _ => {
            let (found, removed) = table.find_then_remove(key);
            prop_assert_eq!(found, model.contains_key(&key));
            prop_assert_eq!(removed.map(|p| p.value), model.remove(&key));
        }
    }
    prop_assert_eq!(table.len(), model.len());
    Ok(())
}
