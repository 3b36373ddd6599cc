//! The endpoint names the fleet's present endpoints bear, which per-endpoint series may be
//! keyed by. A departed endpoint's series are removed when it leaves, but a request still in
//! flight there (or its P/D transfer) ends later and would write them again, for good: each
//! rolling update would leak a pod's worth of series. What may outlive an endpoint writes its
//! series through [`PresentNames::while_present`], which skips a name no present endpoint bears;
//! the last endpoint bearing a name removes its series in [`PresentNames::left`] under the same
//! lock, so that no write lands after the removal.

use std::collections::HashMap;

use parking_lot::RwLock;

/// The names present endpoints bear, each with how many bear it.
pub(crate) struct PresentNames {
    /// Series carry endpoint names (`metrics.per_endpoint`); without them, a departed
    /// endpoint's request counts in the aggregates like any other.
    per_endpoint: bool,
    names: RwLock<HashMap<String, usize>>,
}

impl PresentNames {
    /// The names of the endpoints present at start (`per_endpoint`: series carry them).
    pub(crate) fn new<'a>(per_endpoint: bool, names: impl IntoIterator<Item = &'a str>) -> Self {
        let present = Self {
            per_endpoint,
            names: RwLock::default(),
        };
        for name in names {
            present.joined(name);
        }
        present
    }

    /// An endpoint bearing `name` joined the fleet.
    pub(crate) fn joined(&self, name: &str) {
        *self.names.write().entry(name.to_owned()).or_default() += 1;
    }

    /// An endpoint bearing `name` left the fleet: when it was the last, `forget` removes the
    /// name's series, while no write through [`PresentNames::while_present`] can run.
    pub(crate) fn left(&self, name: &str, forget: impl FnOnce()) {
        let mut names = self.names.write();
        let remaining = names.get_mut(name).map(|count| {
            *count = count.saturating_sub(1);
            *count
        });
        if remaining.unwrap_or(0) == 0 {
            names.remove(name);
            forget();
        }
    }

    /// Runs `write` (it writes series keyed by `names`) unless one of `names` is borne by no
    /// present endpoint: its series were removed, or are about to be, and must not come back.
    /// `write` must not come back here.
    pub(crate) fn while_present(&self, names: &[&str], write: impl FnOnce()) {
        if !self.per_endpoint {
            write();
            return;
        }
        let present = self.names.read();
        if names.iter().all(|name| present.contains_key(*name)) {
            write();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    /// Whether `while_present` ran its write for `names`.
    fn writes(present: &PresentNames, names: &[&str]) -> bool {
        let wrote = Cell::new(false);
        present.while_present(names, || wrote.set(true));
        wrote.get()
    }

    #[test]
    fn a_name_is_written_while_an_endpoint_bears_it_and_forgotten_with_the_last() {
        let present = PresentNames::new(true, ["a", "b", "b"]);
        assert!(writes(&present, &["a", "b"]));
        assert!(!writes(&present, &["a", "c"]), "c was never present");
        let forgotten = Cell::new(0);
        present.left("b", || forgotten.set(forgotten.get() + 1));
        assert_eq!(forgotten.get(), 0, "another endpoint still bears b");
        assert!(writes(&present, &["b"]));
        present.left("b", || forgotten.set(forgotten.get() + 1));
        assert_eq!(forgotten.get(), 1);
        assert!(!writes(&present, &["b"]), "b's series must not come back");
        present.joined("b");
        assert!(writes(&present, &["b"]), "b is back: a series of its own");
    }

    #[test]
    fn without_per_endpoint_series_a_departed_endpoint_still_counts_in_the_aggregates() {
        let present = PresentNames::new(false, ["a"]);
        present.left("a", || {});
        assert!(writes(&present, &["a"]));
    }
}
