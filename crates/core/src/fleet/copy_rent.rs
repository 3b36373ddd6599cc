//! The rent each shared prefix's requests paid for having too few copies
//! ([`crate::schedule::amortize`]), kept between requests.
//!
//! An account per shared prefix (named by the router key of its last block), decayed with
//! [`REUSE_TAU_S`]: rent paid minutes ago says little about what the prefix's requests pay now.
//! A routing plan records what a request for the prefix pays where it goes (its latest plan's
//! figure, not added up: a request planned again while held, or one whose connection failed,
//! pays nothing); a dispatch settles it: the rent is added when the request went to a holder
//! (paid back, when negative, down to zero), and the account is emptied when it went where the
//! prefix is not, a copy. Requests planned side by side settle with the latest figure, each
//! once. Bounded: past [`MAX_ACCOUNTS`] the half worth least is dropped.

use std::collections::HashMap;

use super::block_reuse::REUSE_TAU_S;

/// Accounts kept at most (one per shared prefix planned recently).
const MAX_ACCOUNTS: usize = 4_096;

#[derive(Clone, Copy, Debug)]
struct Account {
    /// Rent paid so far, as of `at`.
    rent_s: f64,
    at: f64,
    /// What a request going to a holder pays, as its latest plan put it (negative: paid back).
    paid_s: f64,
    /// Tokens of the shared prefix: a dispatch to an endpoint holding fewer is a copy.
    shared_tokens: usize,
}

impl Account {
    fn rent_at(&self, now: f64) -> f64 {
        self.rent_s * (-(now - self.at).max(0.0) / REUSE_TAU_S).exp()
    }
}

/// Rent accounts by shared prefix.
#[derive(Debug, Default)]
pub(super) struct CopyRents {
    accounts: HashMap<u64, Account>,
}

impl CopyRents {
    /// Rent paid for `prefix` so far, as of `now`.
    pub(super) fn rent(&self, prefix: u64, now: f64) -> f64 {
        self.accounts.get(&prefix).map_or(0.0, |a| a.rent_at(now))
    }

    /// A routing plan for `prefix`, `shared_tokens` long, at `now`: a request that goes to a
    /// holder pays `paid_s`.
    pub(super) fn plan(&mut self, prefix: u64, shared_tokens: usize, paid_s: f64, now: f64) {
        let paid_s = if paid_s.is_finite() { paid_s } else { 0.0 };
        if let Some(account) = self.accounts.get_mut(&prefix) {
            account.paid_s = paid_s;
            account.shared_tokens = shared_tokens;
            return;
        }
        if self.accounts.len() >= MAX_ACCOUNTS {
            self.drop_least(now);
        }
        self.accounts.insert(
            prefix,
            Account {
                rent_s: 0.0,
                at: now,
                paid_s,
                shared_tokens,
            },
        );
    }

    /// A request for `prefix` was dispatched at `now` to an endpoint expected to hold
    /// `held_tokens` of it: settles what its plan said it pays.
    pub(super) fn dispatched(&mut self, prefix: u64, held_tokens: usize, now: f64) {
        let Some(account) = self.accounts.get_mut(&prefix) else {
            return;
        };
        let rent_s = if held_tokens < account.shared_tokens {
            0.0
        } else {
            (account.rent_at(now) + account.paid_s).max(0.0)
        };
        account.rent_s = rent_s;
        account.at = now;
    }

    /// Drops the half of the accounts worth least as of `now`.
    fn drop_least(&mut self, now: f64) {
        let mut worth: Vec<(f64, u64)> = self
            .accounts
            .iter()
            .map(|(prefix, a)| (a.rent_at(now), *prefix))
            .collect();
        // Ties (many accounts are worth exactly 0) broken by prefix, not by the map's
        // per-process order: a simulated run must be the same every time.
        worth.sort_unstable_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        for (_, prefix) in &worth[..worth.len() / 2] {
            self.accounts.remove(prefix);
        }
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

    /// A plan for prefix `prefix` (100 tokens) paying `paid_s`, then its dispatch to an
    /// endpoint holding `held` tokens, at `now`.
    fn send(rents: &mut CopyRents, prefix: u64, paid_s: f64, held: usize, now: f64) {
        rents.plan(prefix, 100, paid_s, now);
        rents.dispatched(prefix, held, now);
    }

    #[test]
    fn rent_accrues_on_holders_decays_is_paid_back_and_a_copy_empties_it() {
        let mut rents = CopyRents::default();
        send(&mut rents, 7, 0.2, 100, 0.0);
        send(&mut rents, 7, 0.3, 120, 0.0);
        assert!((rents.rent(7, 0.0) - 0.5).abs() < 1e-12);
        let later = rents.rent(7, REUSE_TAU_S);
        assert!((later - 0.5 / std::f64::consts::E).abs() < 1e-12);
        // A request whose holder was the cheaper pays back, never below zero.
        send(&mut rents, 7, -0.2, 100, 0.0);
        assert!((rents.rent(7, 0.0) - 0.3).abs() < 1e-12);
        send(&mut rents, 7, -1.0, 100, 0.0);
        assert_eq!(rents.rent(7, 0.0), 0.0);
        send(&mut rents, 7, 0.5, 100, 0.0);
        assert!((rents.rent(7, 0.0) - 0.5).abs() < 1e-12);
        // Sent where the prefix is not: the copy is bought.
        send(&mut rents, 7, 0.3, 40, 1.0);
        assert_eq!(rents.rent(7, 1.0), 0.0);
    }

    #[test]
    fn a_plan_pays_nothing_until_dispatched_and_plans_again_do_not_add_up() {
        let mut rents = CopyRents::default();
        // Planned three times while held: still nothing paid.
        for _ in 0..3 {
            rents.plan(8, 100, 0.4, 0.0);
        }
        assert_eq!(rents.rent(8, 0.0), 0.0);
        // Its dispatch pays once, at its latest plan's figure.
        rents.plan(8, 100, 0.1, 0.0);
        rents.dispatched(8, 100, 0.0);
        assert!((rents.rent(8, 0.0) - 0.1).abs() < 1e-12);
        // A prefix never planned has no account to settle.
        rents.dispatched(9, 100, 0.0);
        assert_eq!(rents.rent(9, 0.0), 0.0);
    }

    #[test]
    fn accounts_stay_bounded_and_the_largest_survive() {
        let mut rents = CopyRents::default();
        for prefix in 0..(3 * MAX_ACCOUNTS as u64) {
            send(&mut rents, prefix, 1.0 + prefix as f64, 100, 0.0);
            assert!(rents.len() <= MAX_ACCOUNTS);
        }
        let last = 3 * MAX_ACCOUNTS as u64 - 1;
        assert!(rents.rent(last, 0.0) > 0.0);
        // Ties (all worth nothing) still leave half.
        let mut even = CopyRents::default();
        for prefix in 0..=(MAX_ACCOUNTS as u64) {
            even.plan(prefix, 100, 0.0, 0.0);
        }
        assert_eq!(even.len(), MAX_ACCOUNTS / 2 + 1);
    }

    /// Which of the accounts tied at nothing survive does not depend on the map's order, which
    /// differs between maps (a simulation must come out the same every run).
    #[test]
    fn tied_accounts_are_dropped_alike_in_every_map() {
        let survivors = || {
            let mut rents = CopyRents::default();
            for prefix in 0..=(MAX_ACCOUNTS as u64) {
                rents.plan(prefix * 7919, 100, 0.0, 0.0);
            }
            let mut kept: Vec<u64> = rents.accounts.keys().copied().collect();
            kept.sort_unstable();
            kept
        };
        let first = survivors();
        for _ in 0..4 {
            assert_eq!(survivors(), first);
        }
    }
}
