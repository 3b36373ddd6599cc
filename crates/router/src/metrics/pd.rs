//! P/D's own metrics: decisions by reason, fallbacks by reason, each (prefill, decode) pair's
//! transfers as measured and its bandwidth as learned, and both legs' latencies. A
//! [`metric_group`] hooked into [`crate::metrics::RouterMetrics`] with one line; the pair
//! series of an endpoint that leaves the fleet leave with it ([`PairFamily`]).

use std::collections::HashSet;
use std::ops::Deref;
use std::sync::atomic::AtomicU64;

use kvroute_core::fleet::TransfersDropped;
use parking_lot::Mutex;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::{Family, MetricConstructor};
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Metric, Registry};

use super::group::{Exported, Hooks};
use super::{ReasonLabel, metric_group};

/// Seconds from 1 ms to ~65 s, doubling.
fn seconds_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

/// A histogram family of [`seconds_histogram`]s.
type Seconds<L> = Family<L, Histogram, fn() -> Histogram>;

/// A family by (prefill, decode) pair that remembers its pairs, so that the series of an
/// endpoint that left the fleet, on either side, are removed (a family cannot list its own).
pub struct PairFamily<M, C = fn() -> M> {
    family: Family<PairLabels, M, C>,
    pairs: Mutex<HashSet<PairLabels>>,
}

impl<M: Default> Default for PairFamily<M> {
    fn default() -> Self {
        Self::with_constructor(M::default)
    }
}

impl<M, C: MetricConstructor<M>> PairFamily<M, C> {
    /// A family whose metrics `constructor` makes.
    pub fn with_constructor(constructor: C) -> Self {
        Self {
            family: Family::new_with_constructor(constructor),
            pairs: Mutex::default(),
        }
    }

    /// The series of `labels`, created if new.
    pub fn get_or_create(&self, labels: &PairLabels) -> impl Deref<Target = M> + '_ {
        if self.family.get(labels).is_none() {
            self.pairs.lock().insert(labels.clone());
        }
        self.family.get_or_create(labels)
    }
}

impl<M, C: MetricConstructor<M>> Hooks for PairFamily<M, C> {
    fn forget_endpoint(&self, endpoint: &str) {
        self.pairs.lock().retain(|pair| {
            let gone = pair.prefill == endpoint || pair.decode == endpoint;
            if gone {
                self.family.remove(pair);
            }
            !gone
        });
    }
}

impl<M, C> Exported for PairFamily<M, C>
where
    C: MetricConstructor<M>,
    Family<PairLabels, M, C>: Metric + Clone,
{
    fn register(&self, registry: &mut Registry, name: &'static str, help: &'static str) {
        registry.register(name, help, self.family.clone());
    }
}

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
        transfer_bytes: PairFamily<Counter> = PairFamily::default(),
            "pd_transfer_bytes", "KV bytes moved between a prefill and a decode endpoint";
        /// Transfer seconds per pair, as measured from the decode leg's first token (what the
        /// pair's bandwidth is learned from).
        transfer_seconds: PairFamily<Histogram> = PairFamily::with_constructor(seconds_histogram),
            "pd_transfer_seconds",
            "KV transfer time between a prefill and a decode endpoint, as measured";
        /// Failed transfers per pair (the decode leg failed after its prefill).
        transfer_failures: PairFamily<Counter> = PairFamily::default(),
            "pd_transfer_failures", "Failed KV transfers between a prefill and a decode endpoint";
        /// Each pair's learned bandwidth, bytes per second (0 while quarantined).
        link_bandwidth: PairFamily<Gauge<f64, AtomicU64>> = PairFamily::default(),
            "pd_link_bandwidth_bytes_per_second",
            "A prefill-decode pair's learned KV bandwidth (0 while quarantined)";
        /// Each leg's latency, by `leg`: `prefill` (to its answer), `decode` (to its first
        /// byte).
        leg_seconds: Seconds<LegLabel> = Family::new_with_constructor(seconds_histogram),
            "pd_leg_seconds",
            "Each P/D leg's latency: prefill to its answer, decode to its first byte";
        /// Transfers core stopped tracking without their end reported, by `reason`:
        /// `expired` (not over long after the link predicted it) or `evicted` (the oldest, at
        /// core's cap). Their bytes no longer count as a NIC's backlog.
        transfers_dropped: Family<ReasonLabel, Counter> = Family::default(),
            "pd_transfers_dropped",
            "KV transfers dropped from the NIC backlog without their end reported, by reason";
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

    /// Counts the transfers core dropped.
    pub fn transfers_dropped(&self, dropped: TransfersDropped) {
        for (reason, count) in [("expired", dropped.expired), ("evicted", dropped.evicted)] {
            if count > 0 {
                self.transfers_dropped
                    .get_or_create(&ReasonLabel { reason })
                    .inc_by(count);
            }
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::MetricsConfig;

    fn rendered(metrics: &PdMetrics) -> String {
        let mut registry = Registry::default();
        crate::metrics::MetricGroup::register(metrics, &mut registry);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        text
    }

    #[test]
    fn dropped_transfers_are_counted_by_reason() {
        let metrics = PdMetrics::new(&MetricsConfig::default());
        metrics.transfers_dropped(TransfersDropped {
            expired: 3,
            evicted: 0,
        });
        metrics.transfers_dropped(TransfersDropped {
            expired: 1,
            evicted: 2,
        });
        let text = rendered(&metrics);
        assert!(
            text.contains("pd_transfers_dropped_total{reason=\"expired\"} 4"),
            "{text}"
        );
        assert!(
            text.contains("pd_transfers_dropped_total{reason=\"evicted\"} 2"),
            "{text}"
        );
    }

    #[test]
    fn an_endpoint_that_leaves_takes_its_pair_series_on_either_side() {
        let metrics = PdMetrics::new(&MetricsConfig::default());
        for (p, d) in [("p0", "d0"), ("p0", "d1"), ("p1", "d0")] {
            let labels = pair(p, d);
            metrics.transfer_bytes.get_or_create(&labels).inc_by(10);
            metrics.transfer_seconds.get_or_create(&labels).observe(0.1);
            metrics.transfer_failures.get_or_create(&labels).inc();
            metrics.link_bandwidth.get_or_create(&labels).set(1e9);
        }
        Hooks::forget_endpoint(&metrics, "d0");
        let text = rendered(&metrics);
        assert!(!text.contains("decode=\"d0\""), "{text}");
        assert!(text.contains("prefill=\"p0\",decode=\"d1\""), "{text}");
        Hooks::forget_endpoint(&metrics, "p0");
        let text = rendered(&metrics);
        assert!(!text.contains("prefill=\"p"), "{text}");
        // A pair seen again after its endpoint came back is exported again.
        metrics
            .transfer_bytes
            .get_or_create(&pair("p0", "d0"))
            .inc();
        assert!(rendered(&metrics).contains("prefill=\"p0\",decode=\"d0\""));
    }
}
