//! The restart verdict from an engine's `/metrics`: a new process start time, or a prefix-cache
//! query counter that went backwards, means the engine restarted since the last scrape and lost
//! its cache. Unless its KV events already said so (the fleet forgot it since), everything known
//! of it must be forgotten now, not at its next event batch.

use super::Fleet;
use crate::index::EndpointId;

/// What one endpoint's last scrapes said, to compare the next one with.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RestartWatch {
    /// The prefix-cache query counter at the last scrape that had it, and when.
    last_queries: Option<(f64, f64)>,
    /// The process start time at the last scrape that had it, and when.
    last_start: Option<(f64, f64)>,
}

/// The two readings of a `/metrics` sample that reveal a restart.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RestartSignals {
    /// `process_start_time_seconds`.
    pub process_start_time: Option<f64>,
    /// The prefix-cache query counter (monotonic while the engine lives).
    pub prefix_cache_queries: Option<f64>,
}

impl RestartWatch {
    /// Records a scrape of `signals` at `now` and says since when the engine has restarted,
    /// if it has (the time of the previous scrape: it restarted after that).
    pub fn observe(&mut self, signals: RestartSignals, now: f64) -> Option<f64> {
        // Prometheus text allows NaN and ±Inf: such a reading says nothing (and NaN never
        // equals the last one, which would look like a restart at every scrape).
        let signals = RestartSignals {
            process_start_time: signals.process_start_time.filter(|v| v.is_finite()),
            prefix_cache_queries: signals.prefix_cache_queries.filter(|v| v.is_finite()),
        };
        let restarted_since = match (self.last_start, signals.process_start_time) {
            (Some((before, at)), Some(start)) if start != before => Some(at),
            _ => match (self.last_queries, signals.prefix_cache_queries) {
                (Some((before, at)), Some(queries)) if queries < before => Some(at),
                _ => None,
            },
        };
        if let Some(queries) = signals.prefix_cache_queries {
            self.last_queries = Some((queries, now));
        }
        if let Some(start) = signals.process_start_time {
            self.last_start = Some((start, now));
        }
        restarted_since
    }
}

impl Fleet {
    /// Whether `id`'s scrape at `now` reveals a restart the fleet has not yet acted on: the
    /// caller forgets the endpoint (and resubscribes to its events) when it does.
    pub fn restart_unnoticed(
        &self,
        id: EndpointId,
        watch: &mut RestartWatch,
        signals: RestartSignals,
        now: f64,
    ) -> bool {
        let Some(since) = watch.observe(signals, now) else {
            return false;
        };
        !self
            .endpoint(id)
            .and_then(|e| e.forgotten_at())
            .is_some_and(|t| t >= since)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn signals(start: Option<f64>, queries: Option<f64>) -> RestartSignals {
        RestartSignals {
            process_start_time: start,
            prefix_cache_queries: queries,
        }
    }

    #[test]
    fn a_new_start_time_or_a_counter_that_went_back_is_a_restart() {
        let mut w = RestartWatch::default();
        assert_eq!(w.observe(signals(Some(100.0), Some(5.0)), 1.0), None);
        assert_eq!(w.observe(signals(Some(100.0), Some(9.0)), 2.0), None);
        assert_eq!(w.observe(signals(Some(200.0), Some(9.0)), 3.0), Some(2.0));
        assert_eq!(w.observe(signals(None, Some(1.0)), 4.0), Some(3.0));
        assert_eq!(w.observe(signals(None, Some(2.0)), 5.0), None);
    }

    #[test]
    fn a_nan_or_infinite_reading_is_no_restart() {
        let mut w = RestartWatch::default();
        assert_eq!(w.observe(signals(Some(100.0), Some(5.0)), 1.0), None);
        for t in 2..6 {
            let nan = signals(Some(f64::NAN), Some(f64::NAN));
            assert_eq!(w.observe(nan, f64::from(t)), None);
        }
        assert_eq!(w.observe(signals(Some(f64::INFINITY), None), 6.0), None);
        assert_eq!(w.observe(signals(Some(100.0), Some(6.0)), 7.0), None);
    }
}
