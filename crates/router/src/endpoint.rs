//! What the router needs of each endpoint to talk to it: its name, address, configuration, the
//! last health-check error and its KV-event subscriber. Everything a decision reads about it
//! lives in `kvroute-core`'s [`Fleet`](kvroute_core::fleet::Fleet); the event sink here feeds
//! that fleet. Its health checks and scrapes run on a [`ProbeSchedule`], staggered so that with
//! many endpoints the probes of one interval do not all fire at once.

use std::time::Duration;

use kvroute_core::index::EndpointId;
use kvroute_vllm::subscriber::{FeedStats, SubscriberHandle};
use parking_lot::Mutex;
use tokio::task::JoinHandle;
use tokio::time::{Instant, Interval, MissedTickBehavior};

use crate::config::{EndpointClash, EndpointConfig};

/// One endpoint, as the router talks to it.
pub struct Endpoint {
    /// Id in the fleet.
    pub id: EndpointId,
    /// Name for logs, metrics and the response header.
    pub name: String,
    /// Its configuration.
    pub config: EndpointConfig,
    /// `host:port` of its HTTP API.
    pub authority: http::uri::Authority,
    /// The last failed health check, for the explain API.
    pub(crate) last_health_error: Mutex<Option<String>>,
    /// The KV-event subscriber, when events are configured.
    pub(crate) subscriber: Mutex<Option<SubscriberHandle>>,
    /// Its health-check and scrape tasks.
    pub(crate) tasks: Mutex<Vec<JoinHandle<()>>>,
    /// Held while one of its KV-event batches is checked and applied, and by what must not
    /// interleave with that: its removal (a batch found current is applied before its id can
    /// be reused) and a snapshot of it (its blocks and sequence number agree). Batches are
    /// applied outside the fleet's lock, so this is what orders them. Taken before the fleet's
    /// lock, never while holding it.
    pub(crate) ingest: Mutex<()>,
}

impl Endpoint {
    /// A new endpoint from its (validated) configuration.
    pub fn new(id: EndpointId, config: EndpointConfig) -> Self {
        let uri: http::Uri = config.url.parse().expect("validated");
        let authority = uri.authority().expect("validated").clone();
        let name = config.name_or_authority(&authority).to_owned();
        Self {
            id,
            name,
            config,
            authority,
            last_health_error: Mutex::new(None),
            subscriber: Mutex::new(None),
            tasks: Mutex::new(Vec::new()),
            ingest: Mutex::new(()),
        }
    }

    /// How it collides with `other`: the same engine, KV-event address or name
    /// ([`EndpointConfig::clash_with`]); `None` when the two can serve side by side.
    pub(crate) fn clash_with(&self, other: &Endpoint) -> Option<EndpointClash> {
        self.config
            .clash_with(&self.authority, &other.config, &other.authority)
    }

    /// Stops its subscriber and background tasks (removed, or the router is shutting down).
    pub fn stop(&self) {
        self.subscriber.lock().take();
        for task in self.tasks.lock().drain(..) {
            task.abort();
        }
    }

    /// Whether its KV-event subscriber is connected (true when it has no events configured):
    /// what a test or a readiness check waits for before sending traffic.
    pub fn events_connected(&self) -> bool {
        self.config.events.is_none()
            || self
                .subscriber
                .lock()
                .as_ref()
                .is_some_and(|s| s.stats().iter().all(|(_, f)| f.connected))
    }

    /// Its KV-event subscriber's counters per feed, while it has one (events configured, not
    /// stopped).
    pub fn subscriber_stats(&self) -> Option<Vec<(String, FeedStats)>> {
        self.subscriber.lock().as_ref().map(|s| s.stats())
    }
}

/// A periodic probe of an endpoint (each kind gets its own phase, so that an endpoint's health
/// check and scrape do not coincide either).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Probe {
    /// `GET /health`.
    Health,
    /// `GET /metrics`.
    Scrape,
}

/// The fraction of the golden ratio that spreads consecutive ids over an interval: any number
/// of them lands nearly evenly (at most three distinct gaps between neighbours).
const GOLDEN: f64 = 0.618_033_988_749_894_9;

/// Where in each `period` endpoint `id`'s `probe` fires, as an offset in (0, `period`]: the
/// ids' golden-ratio sequence, so that probes of any number of endpoints spread nearly evenly
/// over the interval (deterministic: no two routers' schedules drift into a burst).
pub fn probe_offset(id: EndpointId, probe: Probe, period: Duration) -> Duration {
    let salt = match probe {
        Probe::Health => 0.0,
        Probe::Scrape => 0.5,
    };
    let phase = (f64::from(id.0) * GOLDEN + salt).fract();
    period.mul_f64(1.0 - phase)
}

/// When an endpoint's probe loop fires: once at once (a new endpoint is checked and scraped
/// without delay), then every `period` at the endpoint's own offset ([`probe_offset`]). Ticks
/// missed while the process stalled are skipped, not fired in a burst, and the endpoint keeps
/// its phase (so a stall does not bunch the endpoints for good).
pub struct ProbeSchedule {
    first: bool,
    interval: Interval,
}

impl ProbeSchedule {
    /// The schedule of endpoint `id`'s `probe` every `period`, starting now.
    pub fn new(id: EndpointId, probe: Probe, period: Duration) -> Self {
        let period = period.max(Duration::from_millis(1));
        let mut interval =
            tokio::time::interval_at(Instant::now() + probe_offset(id, probe, period), period);
        interval.set_missed_tick_behavior(MissedTickBehavior::Skip);
        Self {
            first: true,
            interval,
        }
    }

    /// Waits for the next probe time.
    pub async fn tick(&mut self) {
        if std::mem::take(&mut self.first) {
            return;
        }
        self.interval.tick().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RouterConfig;

    /// Offsets of `n` endpoints, as fractions of the period, counted into `bins` equal bins.
    fn binned(n: u32, probe: Probe, bins: usize) -> Vec<usize> {
        let period = Duration::from_secs(1);
        let mut counts = vec![0; bins];
        for id in 0..n {
            let offset = probe_offset(EndpointId(id), probe, period);
            assert!(offset > Duration::ZERO && offset <= period, "{offset:?}");
            let bin = ((offset.as_secs_f64() * bins as f64) as usize).min(bins - 1);
            counts[bin] += 1;
        }
        counts
    }

    #[test]
    fn probes_of_many_endpoints_spread_evenly_over_the_interval() {
        for probe in [Probe::Health, Probe::Scrape] {
            for n in [16_u32, 64, 256, 1_000] {
                // 16 bins: an even spread puts n/16 in each; allow half to twice that.
                let counts = binned(n, probe, 16);
                let even = n as f64 / 16.0;
                for (bin, &c) in counts.iter().enumerate() {
                    assert!(
                        (c as f64) >= (even / 2.0).floor() && (c as f64) <= even * 2.0,
                        "{n} endpoints, {probe:?}: bin {bin} holds {c} ({counts:?})"
                    );
                }
            }
        }
    }

    #[test]
    fn an_endpoints_health_check_and_scrape_have_different_phases() {
        let period = Duration::from_secs(1);
        for id in 0..64 {
            let h = probe_offset(EndpointId(id), Probe::Health, period).as_secs_f64();
            let s = probe_offset(EndpointId(id), Probe::Scrape, period).as_secs_f64();
            assert!((h - s).abs() > 0.4, "endpoint {id}: {h} and {s}");
        }
    }

    #[tokio::test]
    async fn the_first_probe_is_at_once_then_at_the_offset_every_period() {
        let period = Duration::from_millis(200);
        let id = EndpointId(3);
        let offset = probe_offset(id, Probe::Scrape, period);
        let start = Instant::now();
        let mut schedule = ProbeSchedule::new(id, Probe::Scrape, period);
        schedule.tick().await;
        // Timers never fire early: only lower bounds are asserted after the first tick.
        assert!(start.elapsed() < offset, "the first probe waited");
        for k in 0..3 {
            schedule.tick().await;
            assert!(start.elapsed() >= offset + period * k);
        }
    }

    #[test]
    fn names_are_checked_as_the_router_gives_them() {
        // An unnamed endpoint is known by its URL's host and port as written, case and all.
        let unnamed = "{url: 'http://Host-A:8000'}";
        let config =
            |other: &str| format!("models: [{{name: m}}]\nendpoints: [{unnamed}, {other}]");
        let refusal = |yaml: &str| RouterConfig::from_yaml(yaml).unwrap_err().to_string();
        let running = RouterConfig::from_yaml(&config("{url: 'http://b:1'}")).unwrap();
        let given = Endpoint::new(
            kvroute_core::index::EndpointId(0),
            running.endpoints[0].clone(),
        );
        assert_eq!(given.name, "Host-A:8000");
        // Another endpoint named so would share its metrics and its answers.
        let clash = config("{url: 'http://b:1', name: 'Host-A:8000'}");
        let err = refusal(&clash);
        assert!(
            err.contains("endpoints[1]: \"Host-A:8000\" is another endpoint's name"),
            "{err}"
        );
        // Names are compared as written: one that differs in case is another name.
        let distinct = config("{url: 'http://b:1', name: 'host-a:8000'}");
        RouterConfig::from_yaml(&distinct).unwrap();
        // Host names are not: the same host in other case is the same engine.
        let same_engine = config("{url: 'http://host-a:8000'}");
        let err = refusal(&same_engine);
        assert!(
            err.contains("is another endpoint's host and port (host-a:8000)"),
            "{err}"
        );
    }
}
