//! Rate-limited warnings for a stream's bad input: a publisher sending garbage must not flood
//! the log (one line per bad batch was 50,000 lines in half a second). The first few per
//! interval are logged; the rest are counted and summed up in the next line logged.

use std::time::{Duration, Instant};

/// Warnings logged per interval before the rest are only counted.
pub const PER_INTERVAL: u32 = 5;

/// The interval.
pub const INTERVAL: Duration = Duration::from_secs(10);

/// Whether to log one occurrence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Log it; `suppressed` earlier ones were not logged and should be mentioned.
    Log {
        /// Occurrences counted but not logged since the last line.
        suppressed: u64,
    },
    /// Only count it.
    Quiet,
}

/// One stream's limiter.
#[derive(Debug)]
pub struct LogLimiter {
    window_start: Option<Instant>,
    logged: u32,
    suppressed: u64,
}

impl Default for LogLimiter {
    fn default() -> Self {
        Self::new()
    }
}

impl LogLimiter {
    /// Nothing logged yet.
    pub fn new() -> Self {
        Self {
            window_start: None,
            logged: 0,
            suppressed: 0,
        }
    }

    /// Decides for one occurrence at `now`.
    pub fn check(&mut self, now: Instant) -> Verdict {
        let expired = self
            .window_start
            .is_none_or(|start| now.saturating_duration_since(start) >= INTERVAL);
        if expired {
            self.window_start = Some(now);
            self.logged = 0;
        }
        if self.logged < PER_INTERVAL {
            self.logged += 1;
            Verdict::Log {
                suppressed: std::mem::take(&mut self.suppressed),
            }
        } else {
            self.suppressed += 1;
            Verdict::Quiet
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flood_logs_a_few_lines_per_interval_and_sums_up_the_rest() {
        let mut limiter = LogLimiter::new();
        let t0 = Instant::now();
        let verdicts: Vec<Verdict> = (0..50_000).map(|_| limiter.check(t0)).collect();
        let logged = verdicts.iter().filter(|v| **v != Verdict::Quiet).count();
        assert_eq!(logged, PER_INTERVAL as usize);
        assert_eq!(
            limiter.check(t0 + INTERVAL),
            Verdict::Log {
                suppressed: 50_000 - u64::from(PER_INTERVAL)
            }
        );
        assert_eq!(limiter.check(t0 + INTERVAL), Verdict::Log { suppressed: 0 });
    }
}
