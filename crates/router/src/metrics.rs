//! The router's own Prometheus metrics.
//!
//! Series about one endpoint carry an `endpoint` label. With many endpoints that multiplies
//! the series, so `metrics.per_endpoint: false` ([`MetricsConfig`]) drops the label: counters
//! and histograms then count over every endpoint ([`EndpointFamily`]), and each per-endpoint
//! gauge becomes one series per remaining label set, summed over the endpoints (the age of
//! KV events: the oldest) when `/metrics` is rendered ([`EndpointGauges`]). Either way the
//! exposition's size does not depend on the number of endpoints then.

use std::collections::{HashMap, HashSet};
use std::ops::Deref;
use std::sync::atomic::{AtomicI64, AtomicU64};

use parking_lot::{MappedRwLockReadGuard, RwLock, RwLockReadGuard};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::{Family, MetricConstructor};
use prometheus_client::metrics::gauge::{Atomic, Gauge};
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};

type Labels = Vec<(&'static str, String)>;

/// The `status` label: the HTTP status a refusal was answered with.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StatusLabel {
    /// The HTTP status code.
    pub status: u16,
}

/// The `kind` label: which kind of problem or timeout.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    /// The kind, e.g. `header`, `body`, `port_out_of_range`.
    pub kind: &'static str,
}

/// The `reason` label: why a request was shed or a stream cut.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    /// The reason, e.g. `queue_full`, `stalled`.
    pub reason: &'static str,
}

/// The `listener` label: which client listener (`api`, `admin`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ListenerLabel {
    /// The listener's name.
    pub listener: &'static str,
}

/// The label naming an endpoint.
const ENDPOINT: &str = "endpoint";

/// The router's own `/metrics` (the `metrics` section of the configuration).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MetricsConfig {
    /// Export series per endpoint (an `endpoint` label). `false`: only aggregates over the
    /// endpoints, so the exposition stays the same size however many endpoints there are.
    pub per_endpoint: bool,
}

impl Default for MetricsConfig {
    fn default() -> Self {
        Self { per_endpoint: true }
    }
}

/// `labels` without the `endpoint` label.
fn without_endpoint(labels: &Labels) -> Labels {
    labels
        .iter()
        .filter(|(name, _)| *name != ENDPOINT)
        .cloned()
        .collect()
}

/// The label sets created for each endpoint, so that a departed endpoint's series can be
/// removed (a family cannot list its own).
#[derive(Default)]
struct ByEndpoint(RwLock<HashMap<String, HashSet<Labels>>>);

impl ByEndpoint {
    /// Notes a new series' `labels` under the endpoint they name.
    fn note(&self, labels: &Labels) {
        if let Some((_, name)) = labels.iter().find(|(label, _)| *label == ENDPOINT) {
            self.0
                .write()
                .entry(name.clone())
                .or_default()
                .insert(labels.clone());
        }
    }

    /// The label sets noted under `endpoint`, forgotten.
    fn take(&self, endpoint: &str) -> HashSet<Labels> {
        self.0.write().remove(endpoint).unwrap_or_default()
    }
}

/// Counters or histograms by endpoint (and other labels); with per-endpoint series off, the
/// `endpoint` label is dropped on the way in, so each series counts over every endpoint.
pub struct EndpointFamily<M, C = fn() -> M> {
    family: Family<Labels, M, C>,
    per_endpoint: bool,
    series: ByEndpoint,
}

impl<M, C: MetricConstructor<M>> EndpointFamily<M, C> {
    fn new(family: Family<Labels, M, C>, per_endpoint: bool) -> Self {
        Self {
            family,
            per_endpoint,
            series: ByEndpoint::default(),
        }
    }

    /// The series of `labels` (which name the endpoint), created if new.
    pub fn get_or_create(&self, labels: &Labels) -> impl Deref<Target = M> + '_ {
        if self.per_endpoint {
            if self.family.get(labels).is_none() {
                self.series.note(labels);
            }
            self.family.get_or_create(labels)
        } else {
            self.family.get_or_create(&without_endpoint(labels))
        }
    }

    /// Removes `endpoint`'s series (it left the fleet).
    fn forget(&self, endpoint: &str) {
        for labels in self.series.take(endpoint) {
            self.family.remove(&labels);
        }
    }
}

/// How a per-endpoint gauge is aggregated over the endpoints.
#[derive(Clone, Copy, Debug)]
enum Aggregate {
    Sum,
    Max,
}

/// Gauges by endpoint (and other labels), set when `/metrics` is rendered. With per-endpoint
/// series off, the values set since the last rendering are kept aside and exported
/// aggregated over the endpoints (the set of endpoints is whatever was set, so an endpoint
/// that left no longer counts).
pub struct EndpointGauges<N = i64, A = AtomicI64> {
    family: Family<Labels, Gauge<N, A>>,
    per_endpoint: bool,
    aggregate: Aggregate,
    /// Per-endpoint values awaiting aggregation (per-endpoint series off).
    pending: RwLock<HashMap<Labels, Gauge<N, A>>>,
    series: ByEndpoint,
}

impl<N, A> EndpointGauges<N, A>
where
    N: Copy + Default + PartialOrd + std::ops::Add<Output = N>,
    A: Atomic<N> + Default,
{
    fn new(per_endpoint: bool, aggregate: Aggregate) -> Self {
        Self {
            family: Family::default(),
            per_endpoint,
            aggregate,
            pending: RwLock::default(),
            series: ByEndpoint::default(),
        }
    }

    /// The gauge of `labels` (which name the endpoint), created if new.
    pub fn get_or_create(&self, labels: &Labels) -> MappedRwLockReadGuard<'_, Gauge<N, A>> {
        if self.per_endpoint {
            if self.family.get(labels).is_none() {
                self.series.note(labels);
            }
            return self.family.get_or_create(labels);
        }
        if let Ok(gauge) = RwLockReadGuard::try_map(self.pending.read(), |m| m.get(labels)) {
            return gauge;
        }
        self.pending.write().entry(labels.clone()).or_default();
        RwLockReadGuard::map(self.pending.read(), |m| &m[labels])
    }

    /// Removes `endpoint`'s series (it left the fleet; aggregates forget it at the next
    /// rendering by themselves).
    fn forget(&self, endpoint: &str) {
        for labels in self.series.take(endpoint) {
            self.family.remove(&labels);
        }
    }

    /// Per-endpoint series off: exports the values set since the last call, aggregated over
    /// the endpoints.
    fn export(&self) {
        if self.per_endpoint {
            return;
        }
        let pending = std::mem::take(&mut *self.pending.write());
        if pending.is_empty() {
            // Nothing set since the last rendering (a concurrent scrape took it): the last
            // aggregates stand.
            return;
        }
        let mut totals: HashMap<Labels, N> = HashMap::new();
        for (labels, gauge) in pending {
            let value = gauge.get();
            let key = without_endpoint(&labels);
            match totals.get_mut(&key) {
                Some(total) => {
                    *total = match self.aggregate {
                        Aggregate::Sum => *total + value,
                        Aggregate::Max if value > *total => value,
                        Aggregate::Max => *total,
                    }
                }
                None => {
                    totals.insert(key, value);
                }
            }
        }
        self.family.clear();
        for (labels, total) in totals {
            self.family.get_or_create(&labels).set(total);
        }
    }
}

fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 18))
}

fn fast_histogram() -> Histogram {
    Histogram::new(exponential_buckets(1e-6, 2.0, 20))
}

/// Every metric the router exports.
pub struct RouterMetrics {
    registry: Registry,
    /// Requests routed, by endpoint, decision reason, status class and outcome (`completed`,
    /// `client_closed`, `engine_error`, `timeout`).
    pub requests: EndpointFamily<Counter>,
    /// End-to-end request time through the router, by endpoint.
    pub request_seconds: EndpointFamily<Histogram>,
    /// Time to the engine's first body byte, by endpoint.
    pub first_byte_seconds: EndpointFamily<Histogram>,
    /// Time spent choosing an endpoint.
    pub scheduling_seconds: Histogram,
    /// Time spent tokenizing.
    pub tokenization_seconds: Histogram,
    /// Cached prompt tokens the router predicted, by endpoint.
    pub predicted_cached_tokens: EndpointFamily<Counter>,
    /// Cached prompt tokens engines reported, by endpoint.
    pub reported_cached_tokens: EndpointFamily<Counter>,
    /// Predictions by outcome (exact, over, under), by endpoint.
    pub prediction_outcomes: EndpointFamily<Counter>,
    /// Requests retried on another endpoint, by the endpoint that failed and reason
    /// (`connect`, `5xx`).
    pub retries: EndpointFamily<Counter>,
    /// Retries refused because the retry budget was spent, by reason.
    pub retry_budget_exhausted: EndpointFamily<Counter>,
    /// Endpoints ejected by passive outlier detection, by endpoint.
    pub outlier_ejections: EndpointFamily<Counter>,
    /// Requests refused by the router itself, by status.
    pub rejected: Family<StatusLabel, Counter>,
    /// KV-event batches dropped because their endpoint had left when they arrived.
    pub late_event_batches: Counter,
    /// What discovery ignored, by kind (non_string_label, port_out_of_range,
    /// replay_without_events).
    pub discovery_problems: Family<KindLabel, Counter>,
    /// 1 while an endpoint passes health checks.
    pub endpoint_healthy: EndpointGauges,
    /// 1 while an endpoint's KV index is trusted for scoring.
    pub endpoint_index_trusted: EndpointGauges,
    /// Requests in flight, by endpoint.
    pub endpoint_inflight: EndpointGauges,
    /// Blocks the index holds, by endpoint and tier.
    pub index_blocks: EndpointGauges,
    /// KV-event stream counters mirrored from the subscribers (counts since start), by endpoint
    /// and kind (batches, gaps, replays, unfilled_gaps, restarts, decode_errors, orphans), and
    /// whether the subscriber is connected now (kind `connected`, 1 or 0).
    pub events: EndpointGauges,
    /// Seconds since an endpoint's last KV event (absent before the first).
    pub events_age_seconds: EndpointGauges<f64, AtomicU64>,
    /// Requests held by flow control now.
    pub flow_queue_requests: Gauge,
    /// Body bytes held by flow control now.
    pub flow_queue_bytes: Gauge,
    /// Time requests spent held by flow control.
    pub flow_wait_seconds: Histogram,
    /// Requests shed by flow control, by reason (queue_full, queue_bytes, timeout).
    pub shed: Family<ReasonLabel, Counter>,
    /// Client connections open now, by listener (`api`, `admin`).
    pub connections_open: Family<ListenerLabel, Gauge>,
    /// Client connections closed at once because `limits.max_connections` were open.
    pub connections_refused: Family<ListenerLabel, Counter>,
    /// Failed accepts (out of file descriptors, most likely), by listener.
    pub accept_errors: Family<ListenerLabel, Counter>,
    /// Client connections or requests cut off by a timeout, by kind (`header`, `body`, `idle`).
    pub client_timeouts: Family<KindLabel, Counter>,
    /// Request-body bytes held now by the API listener and the picker (bounded by
    /// `limits.max_buffered_bytes`).
    pub buffered_bytes: Gauge,
    /// Request-body bytes held now by the admin listener (bounded by
    /// `admin.max_buffered_bytes`).
    pub admin_buffered_bytes: Gauge,
    /// Response streams cut before their end, by reason (`shutdown`, `stalled`,
    /// `engine_error`).
    pub streams_cut: Family<ReasonLabel, Counter>,
    /// Large requests being prepared on the blocking pool, or waiting for it.
    pub offload_requests: Gauge,
    /// ext_proc streams the picker serves now (bounded by `limits.max_picker_streams`).
    pub picker_streams: Gauge,
    /// Bytes of prompt tokens in the tokenization cache (bounded by
    /// `limits.token_cache_bytes`).
    pub token_cache_bytes: Gauge,
    /// The cache tiers below the GPU (see [`crate::tiers_metrics`]).
    pub tiers: crate::tiers_metrics::TierMetrics,
}

impl Default for RouterMetrics {
    fn default() -> Self {
        Self::new(&MetricsConfig::default())
    }
}

impl RouterMetrics {
    /// Every metric, per endpoint or aggregated as `config` says.
    pub fn new(config: &MetricsConfig) -> Self {
        let per = config.per_endpoint;
        let mut registry = Registry::with_prefix("kvroute");
        let latency = || {
            EndpointFamily::new(
                Family::<Labels, Histogram>::new_with_constructor(
                    latency_histogram as fn() -> Histogram,
                ),
                per,
            )
        };
        let counters = || EndpointFamily::new(Family::default(), per);
        let sums = || EndpointGauges::new(per, Aggregate::Sum);
        let m = Self {
            requests: counters(),
            request_seconds: latency(),
            first_byte_seconds: latency(),
            scheduling_seconds: fast_histogram(),
            tokenization_seconds: fast_histogram(),
            predicted_cached_tokens: counters(),
            reported_cached_tokens: counters(),
            prediction_outcomes: counters(),
            retries: counters(),
            retry_budget_exhausted: counters(),
            outlier_ejections: counters(),
            rejected: Family::default(),
            late_event_batches: Counter::default(),
            discovery_problems: Family::default(),
            endpoint_healthy: sums(),
            endpoint_index_trusted: sums(),
            endpoint_inflight: sums(),
            index_blocks: sums(),
            events: sums(),
            events_age_seconds: EndpointGauges::new(per, Aggregate::Max),
            flow_queue_requests: Gauge::default(),
            flow_queue_bytes: Gauge::default(),
            flow_wait_seconds: latency_histogram(),
            shed: Family::default(),
            connections_open: Family::default(),
            connections_refused: Family::default(),
            client_timeouts: Family::default(),
            accept_errors: Family::default(),
            buffered_bytes: Gauge::default(),
            admin_buffered_bytes: Gauge::default(),
            picker_streams: Gauge::default(),
            offload_requests: Gauge::default(),
            streams_cut: Family::default(),
            token_cache_bytes: Gauge::default(),
            tiers: crate::tiers_metrics::TierMetrics::register(&mut registry, per),
            registry: Registry::default(),
        };
        registry.register("requests", "Requests routed", m.requests.family.clone());
        registry.register(
            "request_duration_seconds",
            "Request time through the router",
            m.request_seconds.family.clone(),
        );
        registry.register(
            "first_byte_seconds",
            "Time to the engine's first response byte",
            m.first_byte_seconds.family.clone(),
        );
        registry.register(
            "scheduling_seconds",
            "Time spent choosing an endpoint",
            m.scheduling_seconds.clone(),
        );
        registry.register(
            "tokenization_seconds",
            "Time spent tokenizing a request",
            m.tokenization_seconds.clone(),
        );
        registry.register(
            "predicted_cached_tokens",
            "Cached prompt tokens predicted by the router",
            m.predicted_cached_tokens.family.clone(),
        );
        registry.register(
            "reported_cached_tokens",
            "Cached prompt tokens reported by engines",
            m.reported_cached_tokens.family.clone(),
        );
        registry.register(
            "prediction_outcomes",
            "Predicted vs reported cached tokens",
            m.prediction_outcomes.family.clone(),
        );
        registry.register(
            "retries",
            "Requests retried on another endpoint",
            m.retries.family.clone(),
        );
        registry.register(
            "retry_budget_exhausted",
            "Retries refused because the retry budget was spent",
            m.retry_budget_exhausted.family.clone(),
        );
        registry.register(
            "outlier_ejections",
            "Endpoints ejected because their requests failed",
            m.outlier_ejections.family.clone(),
        );
        registry.register(
            "rejected",
            "Requests answered by the router with an error",
            m.rejected.clone(),
        );
        registry.register(
            "discovery_problems",
            "What discovery ignored (and warned about), by kind",
            m.discovery_problems.clone(),
        );
        registry.register(
            "late_event_batches",
            "KV-event batches dropped because their endpoint had left",
            m.late_event_batches.clone(),
        );
        registry.register(
            "endpoint_healthy",
            "1 while the endpoint passes health checks",
            m.endpoint_healthy.family.clone(),
        );
        registry.register(
            "endpoint_index_trusted",
            "1 while the endpoint's KV index is trusted",
            m.endpoint_index_trusted.family.clone(),
        );
        registry.register(
            "endpoint_inflight",
            "Requests in flight",
            m.endpoint_inflight.family.clone(),
        );
        registry.register(
            "index_blocks",
            "Blocks held in the KV index",
            m.index_blocks.family.clone(),
        );
        registry.register(
            "kv_events",
            "KV-event stream counters since start",
            m.events.family.clone(),
        );
        registry.register(
            "kv_events_age_seconds",
            "Seconds since the endpoint's last KV event",
            m.events_age_seconds.family.clone(),
        );
        registry.register(
            "flow_queue_requests",
            "Requests held by flow control while every endpoint is saturated",
            m.flow_queue_requests.clone(),
        );
        registry.register(
            "flow_queue_bytes",
            "Request-body bytes held by flow control",
            m.flow_queue_bytes.clone(),
        );
        registry.register(
            "flow_wait_seconds",
            "Time requests spent held by flow control",
            m.flow_wait_seconds.clone(),
        );
        registry.register(
            "shed",
            "Requests shed by flow control, by reason",
            m.shed.clone(),
        );
        registry.register(
            "connections_open",
            "Client connections open, by listener",
            m.connections_open.clone(),
        );
        registry.register(
            "connections_refused",
            "Client connections closed at once at the connection limit, by listener",
            m.connections_refused.clone(),
        );
        registry.register(
            "accept_errors",
            "Failed accepts of client connections, by listener",
            m.accept_errors.clone(),
        );
        registry.register(
            "client_timeouts",
            "Client connections or requests cut off by a timeout, by kind",
            m.client_timeouts.clone(),
        );
        registry.register(
            "buffered_bytes",
            "Request-body bytes held by the router",
            m.buffered_bytes.clone(),
        );
        registry.register(
            "admin_buffered_bytes",
            "Request-body bytes held by the admin listener",
            m.admin_buffered_bytes.clone(),
        );
        registry.register(
            "streams_cut",
            "Response streams cut before their end, by reason",
            m.streams_cut.clone(),
        );
        registry.register(
            "offload_requests",
            "Large requests prepared on the blocking pool or waiting for it",
            m.offload_requests.clone(),
        );
        registry.register(
            "picker_streams",
            "ext_proc streams the endpoint picker serves",
            m.picker_streams.clone(),
        );
        registry.register(
            "token_cache_bytes",
            "Bytes of prompt tokens in the tokenization cache",
            m.token_cache_bytes.clone(),
        );
        Self { registry, ..m }
    }

    /// Removes every series of `endpoint` (it left the fleet), so that a departed pod's series
    /// do not linger in the exposition. A request still in flight there may count again.
    pub fn forget_endpoint(&self, endpoint: &str) {
        for family in [
            &self.requests,
            &self.predicted_cached_tokens,
            &self.reported_cached_tokens,
            &self.prediction_outcomes,
            &self.retries,
            &self.retry_budget_exhausted,
            &self.outlier_ejections,
        ] {
            family.forget(endpoint);
        }
        for family in [&self.request_seconds, &self.first_byte_seconds] {
            family.forget(endpoint);
        }
        for gauges in [
            &self.endpoint_healthy,
            &self.endpoint_index_trusted,
            &self.endpoint_inflight,
            &self.index_blocks,
            &self.events,
        ] {
            gauges.forget(endpoint);
        }
        self.events_age_seconds.forget(endpoint);
    }

    /// The text exposition (per-endpoint gauges are set just before: with per-endpoint series
    /// off, what was set since the last rendering is aggregated now).
    pub fn render(&self) -> String {
        for gauges in [
            &self.endpoint_healthy,
            &self.endpoint_index_trusted,
            &self.endpoint_inflight,
            &self.index_blocks,
            &self.events,
        ] {
            gauges.export();
        }
        self.events_age_seconds.export();
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        out
    }
}

/// Labels for one client listener (`api` or `admin`).
pub fn listener(name: &'static str) -> ListenerLabel {
    ListenerLabel { listener: name }
}

/// Labels for one endpoint.
pub fn endpoint(name: &str) -> Labels {
    vec![("endpoint", name.to_owned())]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set_for(m: &RouterMetrics, name: &str, healthy: i64, age: f64) {
        m.endpoint_healthy
            .get_or_create(&endpoint(name))
            .set(healthy);
        m.events_age_seconds.get_or_create(&endpoint(name)).set(age);
        m.requests
            .get_or_create(&vec![
                ("endpoint", name.to_owned()),
                ("status", "2xx".into()),
            ])
            .inc();
    }

    #[test]
    fn without_per_endpoint_series_gauges_aggregate_and_counters_count_over_endpoints() {
        let m = RouterMetrics::new(&MetricsConfig {
            per_endpoint: false,
        });
        for (i, healthy) in [1, 1, 0].into_iter().enumerate() {
            set_for(&m, &format!("engine-{i}"), healthy, i as f64);
        }
        let text = m.render();
        assert!(!text.contains("endpoint=\""), "{text}");
        assert!(text.contains("kvroute_endpoint_healthy 2\n"), "{text}");
        assert!(
            text.contains("kvroute_kv_events_age_seconds 2.0\n"),
            "{text}"
        );
        assert!(
            text.contains("kvroute_requests_total{status=\"2xx\"} 3\n"),
            "{text}"
        );
        // A rendering with nothing set since (a concurrent scrape took it) keeps the totals.
        assert!(m.render().contains("kvroute_endpoint_healthy 2\n"));
        // The next refresh counts only the endpoints it sets (one left).
        set_for(&m, "engine-0", 1, 0.5);
        let text = m.render();
        assert!(text.contains("kvroute_endpoint_healthy 1\n"), "{text}");
        assert!(
            text.contains("kvroute_kv_events_age_seconds 0.5\n"),
            "{text}"
        );
    }

    #[test]
    fn with_per_endpoint_series_each_endpoint_has_its_own() {
        let m = RouterMetrics::default();
        set_for(&m, "engine-0", 1, 1.0);
        set_for(&m, "engine-1", 0, 2.0);
        let text = m.render();
        assert!(text.contains("kvroute_endpoint_healthy{endpoint=\"engine-0\"} 1\n"));
        assert!(text.contains("kvroute_endpoint_healthy{endpoint=\"engine-1\"} 0\n"));
    }
}
