//! When a quiet stream is checked for a lost tail ([`super::sequencer::Sequencer::on_quiet`]):
//! first after [`super::Timing::tail_check_after`] without a live batch, then at doubling
//! intervals while it stays quiet, at most [`MAX_SPACING`] apart. An idle engine then costs its
//! replay socket one connection a minute, not one a second, and a burst's lost tail is still
//! fetched about a second after the burst.

use std::time::{Duration, Instant};

/// The longest wait between two checks of a stream that stays quiet.
pub(crate) const MAX_SPACING: Duration = Duration::from_secs(60);

/// The shortest: a zero setting must not ask again at every tick.
pub(crate) const MIN_SPACING: Duration = Duration::from_millis(10);

/// One stream's tail-check schedule.
#[derive(Debug)]
pub(crate) struct TailChecks {
    /// Silence after a live batch before the first check.
    after: Duration,
    /// The wait before the next check, doubled by each check.
    spacing: Duration,
    /// When the next check is due (`None`: never, for a setting too large to add to a clock).
    next_at: Option<Instant>,
}

impl TailChecks {
    /// A schedule whose first check is `after` (at least [`MIN_SPACING`]) from `now`.
    pub(crate) fn new(after: Duration, now: Instant) -> Self {
        let after = after.max(MIN_SPACING);
        Self {
            after,
            spacing: after,
            next_at: now.checked_add(after),
        }
    }

    /// A live batch arrived: the stream is not quiet, its next check is `after` from `now`.
    pub(crate) fn heard(&mut self, now: Instant) {
        self.spacing = self.after;
        self.next_at = now.checked_add(self.after);
    }

    /// Whether a check is due at `now`.
    pub(crate) fn due(&self, now: Instant) -> bool {
        self.next_at.is_some_and(|at| now >= at)
    }

    /// A check was asked at `now`: the next waits twice as long as the last wait, at most
    /// [`MAX_SPACING`] (or `after`, when that is longer).
    pub(crate) fn checked(&mut self, now: Instant) {
        self.spacing = self
            .spacing
            .saturating_mul(2)
            .min(MAX_SPACING.max(self.after));
        self.next_at = now.checked_add(self.spacing);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn a_quiet_stream_is_checked_ever_less_often_until_it_speaks() {
        let t0 = Instant::now();
        let mut checks = TailChecks::new(S, t0);
        assert!(!checks.due(t0 + S / 2));
        let mut at = t0 + S;
        let mut waits = Vec::new();
        for _ in 0..8 {
            assert!(checks.due(at));
            checks.checked(at);
            let next = (1..=120)
                .map(|s| at + S * s)
                .find(|&t| checks.due(t))
                .expect("a next check");
            waits.push((next - at).as_secs());
            at = next;
        }
        assert_eq!(waits, vec![2, 4, 8, 16, 32, 60, 60, 60]);
        // A live batch: the next check is a second after it, whatever came before.
        checks.heard(at);
        assert!(!checks.due(at + S / 2));
        assert!(checks.due(at + S));
    }

    #[test]
    fn a_zero_setting_still_spaces_its_checks_out() {
        let t0 = Instant::now();
        let mut checks = TailChecks::new(Duration::ZERO, t0);
        checks.checked(t0);
        assert!(!checks.due(t0 + MIN_SPACING), "twice the shortest spacing");
        assert!(checks.due(t0 + 2 * MIN_SPACING));
        checks.checked(t0);
        assert!(!checks.due(t0 + 2 * MIN_SPACING), "and doubling");
    }

    #[test]
    fn a_setting_too_large_for_the_clock_means_never() {
        let t0 = Instant::now();
        let mut checks = TailChecks::new(Duration::MAX, t0);
        assert!(!checks.due(t0 + S * 1_000_000));
        checks.heard(t0);
        checks.checked(t0);
        assert!(!checks.due(t0 + S * 1_000_000));
    }
}
