//! A count that decays exponentially with time: what the fleet keeps of recent events (an
//! endpoint's placements, the retry budget's requests and retries) without a window of them.

/// A count decaying exponentially with time constant `tau` (seconds), as of `at`.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Decaying {
    value: f64,
    at: f64,
}

impl Decaying {
    /// The count decayed to `now`.
    pub(super) fn at(&self, now: f64, tau: f64) -> f64 {
        self.value * (-(now - self.at).max(0.0) / tau.max(1e-3)).exp()
    }

    /// Counts one event at `now`.
    pub(super) fn add(&mut self, now: f64, tau: f64) {
        self.value = self.at(now, tau) + 1.0;
        self.at = now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_count_decays_by_e_per_time_constant() {
        let mut c = Decaying::default();
        c.add(10.0, 60.0);
        c.add(10.0, 60.0);
        assert_eq!(c.at(10.0, 60.0), 2.0);
        assert!((c.at(70.0, 60.0) - 2.0 / std::f64::consts::E).abs() < 1e-12);
        // Time never runs backwards for it.
        assert_eq!(c.at(5.0, 60.0), 2.0);
    }
}
