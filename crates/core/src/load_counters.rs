//! Tier load rates read from the engines' own load counters, under any load.
//!
//! A request teaches its endpoint's tier rates from its time to first token only when it ran
//! alone there (batched decodes would count as load time), and a loaded fleet has no such
//! requests: on the simulator a shared filesystem's rate stayed at its configured value for a
//! whole run while the filesystem read three times faster, so its hits were priced slower than
//! recomputing and got no credit (docs/benchmarks.md, "The scheduler's predictions against what
//! happened"). The engines themselves count what they load and how long each load took: vLLM's
//! offloading connector publishes `vllm:kv_offload_total_time_total` by `transfer_type`
//! (`CPU_to_GPU`; llm-d's filesystem backend `SHARED_STORAGE_to_GPU`), and the tokens loaded
//! per tier come from `vllm:prompt_tokens_cached_by_source_total` (the simulator exports both).
//!
//! **The estimate.** Over a window of scrapes ([`LoadWindow`], at least [`WINDOW_S`]) a tier
//! loaded `tokens` in loads that took `seconds` in all, each timed from its start to its end,
//! within `window` seconds of wall time. The
//! device (a PCIe link, a filesystem) was busy for at most `min(window, seconds)`: exactly
//! `seconds` when no two loads overlapped, exactly `window` when it never idled. So its rate
//! is at least `tokens / min(window, seconds)`, and equal to it at both ends; in between (loads
//! that overlap on a device that also idles) it is under-stated, never over-stated.
//!
//! **A shared filesystem** is one device for every endpoint that mounts it, and the cost model
//! charges a shared load the tokens queued ahead on it at its rate (the fleet's shared
//! backlog), so its rate is the aggregate one: each endpoint's loads are added into one window
//! per mount ([`MountWindows`]), and the rate that window shows is every mounting endpoint's. One endpoint's own
//! loads alone would show its share of the filesystem, which the backlog already charges.

/// Samples with fewer tier tokens than this say little about a tier's rate: a request's, or a
/// window of an engine's load counters.
pub const MIN_SAMPLE_TOKENS: usize = 64;

/// One scrape of an engine's per-tier load counters (CPU, own storage, shared; cumulative,
/// `None` where the engine does not report the tier).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TierLoadCounters {
    /// Prompt tokens loaded from each tier.
    pub tokens: [Option<f64>; 3],
    /// Seconds the loads from each tier took, summed over the loads.
    pub seconds: [Option<f64>; 3],
}

/// What one tier loaded between two scrapes.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LoadDelta {
    /// Tokens loaded.
    pub tokens: f64,
    /// Seconds the loads took, summed.
    pub seconds: f64,
}

/// Wall seconds a window spans before its rate is read: many scrapes, so that an engine whose
/// token counter and load timer tick at different moments (vLLM counts a hit when it schedules
/// the load and times it when it ends) is read over many loads, not one split in two.
pub const WINDOW_S: f64 = 5.0;

/// The load rate, tokens per second, that `delta` loaded within `window_s` seconds of wall
/// time shows (see the [module docs](self)); `None` when it loaded too little to say.
pub fn window_rate(delta: LoadDelta, window_s: f64) -> Option<f64> {
    let busy_s = delta.seconds.min(window_s);
    let usable = delta.tokens.is_finite()
        && delta.tokens >= MIN_SAMPLE_TOKENS as f64
        && busy_s.is_finite()
        && busy_s > 0.0;
    usable.then(|| delta.tokens / busy_s)
}

/// One device's loads over the current window: what scrapes said was loaded, and since when.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LoadWindow {
    /// The earliest start of the scrape intervals added (`None`: nothing added yet).
    start: Option<f64>,
    loaded: LoadDelta,
}

impl LoadWindow {
    /// Adds what a scrape at `now` says was loaded since `since` (that endpoint's previous
    /// scrape). The window starts at the earliest `since` it was given, so a scrape interval
    /// that began before the window (a late first scrape, failed scrapes between two) widens
    /// it rather than crowding its loads into a shorter span: the rate can only be
    /// under-stated. Once the window spans [`WINDOW_S`] and loaded enough to say, returns the
    /// rate and starts the next window at `now`; until then it keeps adding.
    pub fn add(&mut self, delta: LoadDelta, since: f64, now: f64) -> Option<f64> {
        if !(delta.tokens.is_finite() && delta.seconds.is_finite() && since.is_finite()) {
            return None;
        }
        let start = self.start.map_or(since, |s| s.min(since));
        self.start = Some(start);
        self.loaded.tokens += delta.tokens;
        self.loaded.seconds += delta.seconds;
        let span = now - start;
        // A clock that is not a number never completes a window.
        if span.is_nan() || span < WINDOW_S {
            return None;
        }
        let rate = window_rate(self.loaded, span)?;
        *self = LoadWindow {
            start: Some(now),
            loaded: LoadDelta::default(),
        };
        Some(rate)
    }
}

/// Each shared filesystem's loads over its current window, from every endpoint that mounts it.
#[derive(Clone, Debug, Default)]
pub struct MountWindows {
    windows: Vec<(String, LoadWindow)>,
}

impl MountWindows {
    /// Adds what an endpoint's scrape at `now` says it loaded from `mount` since `since` (its
    /// previous scrape): [`LoadWindow::add`] on that mount's window.
    pub fn add(&mut self, mount: &str, delta: LoadDelta, since: f64, now: f64) -> Option<f64> {
        let index = match self.windows.iter().position(|(m, _)| m == mount) {
            Some(i) => i,
            None => {
                self.windows.push((mount.to_owned(), LoadWindow::default()));
                self.windows.len() - 1
            }
        };
        self.windows[index].1.add(delta, since, now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn delta(tokens: f64, seconds: f64) -> LoadDelta {
        LoadDelta { tokens, seconds }
    }

    #[test]
    fn the_rate_is_exact_when_loads_never_overlap_and_when_the_device_never_idles() {
        // 10,000 tokens in loads that took 0.2 s in all, one after another, within a second.
        assert_eq!(window_rate(delta(10_000.0, 0.2), 1.0), Some(50_000.0));
        // Loads always in flight, overlapping: their times sum past the window; the device
        // read 10,000 tokens in the window's one second.
        assert_eq!(window_rate(delta(10_000.0, 3.0), 1.0), Some(10_000.0));
        assert_eq!(
            window_rate(delta(10.0, 0.1), 1.0),
            None,
            "too little to say"
        );
        assert_eq!(
            window_rate(delta(1_000.0, 0.0), 1.0),
            None,
            "no load time reported"
        );
        assert_eq!(window_rate(delta(f64::NAN, 0.1), 1.0), None);
    }

    #[test]
    fn a_mounts_window_adds_every_endpoints_loads_before_it_reads_a_rate() {
        let mut mounts = MountWindows::default();
        // Two endpoints, each loading 20,000 tokens a second for 5 s with loads that overlap
        // (2 s of load time per endpoint-second), each scraped every 1.25 s: the filesystem
        // read 40,000 tokens per second of the window.
        for step in 1..=4 {
            let now = f64::from(step) * 1.25;
            let since = now - 1.25;
            assert_eq!(
                mounts.add("fs", delta(25_000.0, 2.5), since, now - 0.1),
                None
            );
            let rate = mounts.add("fs", delta(25_000.0, 2.5), since, now);
            assert_eq!(rate.is_some(), step == 4, "read once the window spans 5 s");
            if let Some(rate) = rate {
                assert!((rate - 40_000.0).abs() < 1e-9, "{rate}");
            }
        }
        // Another mount has its own window; the next window starts at the read.
        assert_eq!(mounts.add("other", delta(1e6, 1.0), 4.0, 5.0), None);
        assert_eq!(
            mounts.add("fs", delta(100.0, 0.01), 5.0, 10.0),
            Some(10_000.0)
        );
    }

    #[test]
    fn a_scrape_interval_that_began_before_the_window_widens_it() {
        let mut window = LoadWindow::default();
        // A minute without a scrape (they failed), then one: its loads are spread over the
        // minute, not crowded into the window's 5 s. The device read at most 600,000 tokens in
        // 60 s of which its loads took 50: at least 12,000 a second.
        assert_eq!(
            window.add(delta(600_000.0, 50.0), 0.0, 60.0),
            Some(12_000.0)
        );
        // Too little to say keeps the window open, adding, until it can.
        assert_eq!(window.add(delta(10.0, 0.001), 60.0, 70.0), None);
        assert_eq!(window.add(delta(90.0, 0.001), 70.0, 71.0), Some(50_000.0));
        assert_eq!(
            window.add(delta(f64::NAN, 1.0), 71.0, 80.0),
            None,
            "not a number"
        );
    }
}
