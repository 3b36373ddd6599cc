//! The rent each shared prefix's requests paid for having too few copies
//! ([`crate::schedule::amortize`]), kept between requests.
//!
//! An account per shared prefix (named by the router key of its last block), decayed with
//! [`REUSE_TAU_S`]: rent paid minutes ago says little about what the prefix's requests pay now.
//! A plan reads the account and leaves what its request would add pending; the dispatch settles
//! it, once: the rent is added when the request went to a holder (paid back, when negative,
//! down to zero), and the account is emptied when it went where the prefix is copied. A plan that is not dispatched (held by flow
//! control, an explanation) adds nothing. Bounded: past [`MAX_ACCOUNTS`] the accounts worth
//! least are dropped.

use std::collections::HashMap;

use super::block_reuse::REUSE_TAU_S;

/// Accounts kept at most (one per shared prefix with rent on it).
const MAX_ACCOUNTS: usize = 4_096;

/// A plan's effect on its prefix's account, applied when its request is dispatched.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct PendingRent {
    /// The prefix's account.
    pub(super) prefix: u64,
    /// Tokens of the shared prefix (the dispatch settles the account by whether its endpoint
    /// holds them).
    pub(super) shared_tokens: usize,
    /// Rent added if the request goes to an endpoint holding the prefix, seconds; negative
    /// when its holder was cheaper than an endpoint lacking the prefix would have been (the
    /// account never goes below zero).
    pub(super) rent_s: f64,
}

#[derive(Clone, Copy, Debug)]
struct Account {
    rent_s: f64,
    at: f64,
}

impl Account {
    fn at(&self, now: f64) -> f64 {
        self.rent_s * (-(now - self.at).max(0.0) / REUSE_TAU_S).exp()
    }
}

/// Rent accounts by shared prefix, and the last plan's pending effect.
#[derive(Debug, Default)]
pub(super) struct CopyRents {
    accounts: HashMap<u64, Account>,
    pending: Option<PendingRent>,
}

impl CopyRents {
    /// Rent paid for `prefix` so far, as of `now`.
    pub(super) fn rent(&self, prefix: u64, now: f64) -> f64 {
        self.accounts.get(&prefix).map_or(0.0, |a| a.at(now))
    }

    /// The last plan's effect, replacing any earlier plan's that was not dispatched.
    pub(super) fn plan(&mut self, pending: Option<PendingRent>) {
        self.pending = pending;
    }

    /// A request for `prefix` was dispatched at `now` to an endpoint expected to hold
    /// `held_tokens` of it: settles the pending rent if it is this prefix's.
    pub(super) fn dispatched(&mut self, prefix: u64, held_tokens: usize, now: f64) {
        let Some(pending) = self.pending.take().filter(|p| p.prefix == prefix) else {
            return;
        };
        if held_tokens < pending.shared_tokens {
            self.accounts.remove(&prefix);
            return;
        }
        if !pending.rent_s.is_finite() {
            return;
        }
        let rent_s = (self.rent(prefix, now) + pending.rent_s).max(0.0);
        if rent_s <= 0.0 {
            self.accounts.remove(&prefix);
            return;
        }
        if !self.accounts.contains_key(&prefix) && self.accounts.len() >= MAX_ACCOUNTS {
            self.drop_least(now);
        }
        self.accounts.insert(prefix, Account { rent_s, at: now });
    }

    /// Drops the half of the accounts worth least as of `now`.
    fn drop_least(&mut self, now: f64) {
        let mut worth: Vec<f64> = self.accounts.values().map(|a| a.at(now)).collect();
        let half = worth.len() / 2;
        worth.select_nth_unstable_by(half, f64::total_cmp);
        let cut = worth[half];
        self.accounts.retain(|_, a| a.at(now) > cut);
    }

    /// Accounts kept.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.accounts.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pending(prefix: u64, rent_s: f64) -> Option<PendingRent> {
        Some(PendingRent {
            prefix,
            shared_tokens: 100,
            rent_s,
        })
    }

    #[test]
    fn rent_accrues_on_holders_decays_and_a_copy_empties_it() {
        let mut rents = CopyRents::default();
        rents.plan(pending(7, 0.2));
        rents.dispatched(7, 100, 0.0);
        rents.plan(pending(7, 0.3));
        rents.dispatched(7, 120, 0.0);
        assert!((rents.rent(7, 0.0) - 0.5).abs() < 1e-12);
        let later = rents.rent(7, REUSE_TAU_S);
        assert!((later - 0.5 / std::f64::consts::E).abs() < 1e-12);
        // A request whose holder was the cheaper pays back, never below zero.
        rents.plan(pending(7, -0.2));
        rents.dispatched(7, 100, 0.0);
        assert!((rents.rent(7, 0.0) - 0.3).abs() < 1e-12);
        rents.plan(pending(7, -1.0));
        rents.dispatched(7, 100, 0.0);
        assert_eq!(rents.rent(7, 0.0), 0.0);
        rents.plan(pending(7, 0.5));
        rents.dispatched(7, 100, 0.0);
        assert!((rents.rent(7, 0.0) - 0.5).abs() < 1e-12);
        // Sent where the prefix is not: the copy is bought.
        rents.plan(pending(7, 0.3));
        rents.dispatched(7, 40, 1.0);
        assert_eq!(rents.rent(7, 1.0), 0.0);
    }

    #[test]
    fn only_a_dispatched_plan_for_the_same_prefix_counts() {
        let mut rents = CopyRents::default();
        // A plan that was not dispatched, then another prefix's dispatch.
        rents.plan(pending(7, 0.2));
        rents.plan(pending(8, 0.4));
        rents.dispatched(7, 100, 0.0);
        assert_eq!(rents.rent(7, 0.0), 0.0);
        assert_eq!(rents.rent(8, 0.0), 0.0);
        // Settled once.
        rents.plan(pending(8, 0.4));
        rents.dispatched(8, 100, 0.0);
        rents.dispatched(8, 100, 0.0);
        assert!((rents.rent(8, 0.0) - 0.4).abs() < 1e-12);
    }

    #[test]
    fn accounts_stay_bounded() {
        let mut rents = CopyRents::default();
        for prefix in 0..(3 * MAX_ACCOUNTS as u64) {
            rents.plan(pending(prefix, 1.0 + prefix as f64));
            rents.dispatched(prefix, 100, 0.0);
            assert!(rents.len() <= MAX_ACCOUNTS);
        }
        // The most recent, largest account survives.
        let last = 3 * MAX_ACCOUNTS as u64 - 1;
        assert!(rents.rent(last, 0.0) > 0.0);
    }
}
