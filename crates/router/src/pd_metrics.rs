//! P/D's own metrics: decisions by reason, fallbacks by reason, each (prefill, decode) pair's
//! transfers as measured and its bandwidth as learned, and both legs' latencies. Registered
//! under the router's prefix by [`PdMetrics::register`].

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

type Labels = Vec<(&'static str, String)>;

/// Seconds from 1 ms to ~65 s, doubling.
fn seconds_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

/// The P/D metrics.
#[derive(Clone)]
pub struct PdMetrics {
    /// P/D decisions, by `decision` (`aggregated`, `disaggregated`) and `reason`.
    pub decisions: Family<Labels, Counter>,
    /// Requests that fell back from P/D, by `reason`.
    pub fallbacks: Family<Labels, Counter>,
    /// KV bytes moved per (`prefill`, `decode`) pair, as the router priced them.
    pub transfer_bytes: Family<Labels, Counter>,
    /// Transfer seconds per pair, as measured from the decode leg's first token (what the
    /// pair's bandwidth is learned from).
    pub transfer_seconds: Family<Labels, Histogram, fn() -> Histogram>,
    /// Failed transfers per pair (the decode leg failed after its prefill).
    pub transfer_failures: Family<Labels, Counter>,
    /// Each pair's learned bandwidth, bytes per second (0 while quarantined).
    pub link_bandwidth: Family<Labels, Gauge<f64, AtomicU64>>,
    /// Each leg's latency, by `leg`: `prefill` (to its answer), `decode` (to its first byte).
    pub leg_seconds: Family<Labels, Histogram, fn() -> Histogram>,
    /// Requests whose own `kv_transfer_params` were removed (only the router names a producer).
    pub client_params_removed: Counter,
}

impl PdMetrics {
    /// The metrics, registered in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let m = Self {
            decisions: Family::default(),
            fallbacks: Family::default(),
            transfer_bytes: Family::default(),
            transfer_seconds: Family::new_with_constructor(seconds_histogram),
            transfer_failures: Family::default(),
            link_bandwidth: Family::default(),
            leg_seconds: Family::new_with_constructor(seconds_histogram),
            client_params_removed: Counter::default(),
        };
        registry.register(
            "pd_decisions",
            "Prefill/decode decisions, by decision and reason",
            m.decisions.clone(),
        );
        registry.register(
            "pd_fallbacks",
            "Requests served aggregated or failed after choosing P/D, by reason",
            m.fallbacks.clone(),
        );
        registry.register(
            "pd_transfer_bytes",
            "KV bytes moved between a prefill and a decode endpoint",
            m.transfer_bytes.clone(),
        );
        registry.register(
            "pd_transfer_seconds",
            "KV transfer time between a prefill and a decode endpoint, as measured",
            m.transfer_seconds.clone(),
        );
        registry.register(
            "pd_transfer_failures",
            "Failed KV transfers between a prefill and a decode endpoint",
            m.transfer_failures.clone(),
        );
        registry.register(
            "pd_link_bandwidth_bytes_per_second",
            "A prefill-decode pair's learned KV bandwidth (0 while quarantined)",
            m.link_bandwidth.clone(),
        );
        registry.register(
            "pd_leg_seconds",
            "Each P/D leg's latency: prefill to its answer, decode to its first byte",
            m.leg_seconds.clone(),
        );
        registry.register(
            "pd_client_params_removed",
            "Requests whose client-supplied kv_transfer_params the router removed",
            m.client_params_removed.clone(),
        );
        m
    }

    /// Counts a decision.
    pub fn decision(&self, decision: &'static str, reason: &'static str) {
        self.decisions
            .get_or_create(&vec![
                ("decision", decision.to_owned()),
                ("reason", reason.to_owned()),
            ])
            .inc();
    }

    /// Counts a fallback.
    pub fn fallback(&self, reason: &'static str) {
        self.fallbacks
            .get_or_create(&vec![("reason", reason.to_owned())])
            .inc();
    }
}

/// The labels of a (prefill, decode) pair.
pub fn pair(prefill: &str, decode: &str) -> Labels {
    vec![
        ("prefill", prefill.to_owned()),
        ("decode", decode.to_owned()),
    ]
}
