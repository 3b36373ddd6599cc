//! P/D's own metrics: decisions by reason, fallbacks by reason, each (prefill, decode) pair's
//! transfers as measured and its bandwidth as learned, and both legs' latencies. A
//! [`metric_group`] hooked into [`crate::metrics::RouterMetrics`] with one line.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};

use super::{ReasonLabel, metric_group};

/// Seconds from 1 ms to ~65 s, doubling.
fn seconds_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

/// A histogram family of [`seconds_histogram`]s.
type Seconds<L> = Family<L, Histogram, fn() -> Histogram>;

/// The labels of a P/D decision.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    /// `aggregated` or `disaggregated`.
    pub decision: &'static str,
    /// Why (`cost`, `always`, `no_prefill_endpoint`, ...).
    pub reason: &'static str,
}

/// The labels of a (prefill, decode) pair of endpoints.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PairLabels {
    /// The prefill endpoint's name.
    pub prefill: String,
    /// The decode endpoint's name.
    pub decode: String,
}

/// The `leg` label: `prefill` or `decode`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LegLabel {
    /// The leg.
    pub leg: &'static str,
}

metric_group! {
    /// The P/D metrics.
    pub struct PdMetrics(config) {
        /// P/D decisions, by `decision` (`aggregated`, `disaggregated`) and `reason`.
        decisions: Family<DecisionLabels, Counter> = Family::default(),
            "pd_decisions", "Prefill/decode decisions, by decision and reason";
        /// Requests that fell back from P/D, by `reason`.
        fallbacks: Family<ReasonLabel, Counter> = Family::default(),
            "pd_fallbacks", "Requests served aggregated or failed after choosing P/D, by reason";
        /// KV bytes moved per (`prefill`, `decode`) pair, as the router priced them.
        transfer_bytes: Family<PairLabels, Counter> = Family::default(),
            "pd_transfer_bytes", "KV bytes moved between a prefill and a decode endpoint";
        /// Transfer seconds per pair, as measured from the decode leg's first token (what the
        /// pair's bandwidth is learned from).
        transfer_seconds: Seconds<PairLabels> = Family::new_with_constructor(seconds_histogram),
            "pd_transfer_seconds",
            "KV transfer time between a prefill and a decode endpoint, as measured";
        /// Failed transfers per pair (the decode leg failed after its prefill).
        transfer_failures: Family<PairLabels, Counter> = Family::default(),
            "pd_transfer_failures", "Failed KV transfers between a prefill and a decode endpoint";
        /// Each pair's learned bandwidth, bytes per second (0 while quarantined).
        link_bandwidth: Family<PairLabels, Gauge<f64, AtomicU64>> = Family::default(),
            "pd_link_bandwidth_bytes_per_second",
            "A prefill-decode pair's learned KV bandwidth (0 while quarantined)";
        /// Each leg's latency, by `leg`: `prefill` (to its answer), `decode` (to its first
        /// byte).
        leg_seconds: Seconds<LegLabel> = Family::new_with_constructor(seconds_histogram),
            "pd_leg_seconds",
            "Each P/D leg's latency: prefill to its answer, decode to its first byte";
        /// Requests whose own `kv_transfer_params` were removed (only the router names a
        /// producer).
        client_params_removed: Counter = Counter::default(),
            "pd_client_params_removed",
            "Requests whose client-supplied kv_transfer_params the router removed";
    }
}

impl PdMetrics {
    /// Counts a decision.
    pub fn decision(&self, decision: &'static str, reason: &'static str) {
        self.decisions
            .get_or_create(&DecisionLabels { decision, reason })
            .inc();
    }

    /// Counts a fallback.
    pub fn fallback(&self, reason: &'static str) {
        self.fallbacks.get_or_create(&ReasonLabel { reason }).inc();
    }

    /// Observes a leg's latency.
    pub fn leg(&self, leg: &'static str, seconds: f64) {
        self.leg_seconds
            .get_or_create(&LegLabel { leg })
            .observe(seconds);
    }
}

/// The labels of a (prefill, decode) pair.
pub fn pair(prefill: &str, decode: &str) -> PairLabels {
    PairLabels {
        prefill: prefill.to_owned(),
        decode: decode.to_owned(),
    }
}
