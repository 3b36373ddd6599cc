//! The router's own Prometheus metrics.

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

type Labels = Vec<(&'static str, String)>;

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
    pub requests: Family<Labels, Counter>,
    /// End-to-end request time through the router, by endpoint.
    pub request_seconds: Family<Labels, Histogram>,
    /// Time to the engine's first body byte, by endpoint.
    pub first_byte_seconds: Family<Labels, Histogram>,
    /// Time spent choosing an endpoint.
    pub scheduling_seconds: Histogram,
    /// Time spent tokenizing.
    pub tokenization_seconds: Histogram,
    /// Cached prompt tokens the router predicted, by endpoint.
    pub predicted_cached_tokens: Family<Labels, Counter>,
    /// Cached prompt tokens engines reported, by endpoint.
    pub reported_cached_tokens: Family<Labels, Counter>,
    /// Predictions by outcome (exact, over, under), by endpoint.
    pub prediction_outcomes: Family<Labels, Counter>,
    /// Requests retried on another endpoint, by the endpoint that failed and reason
    /// (`connect`, `5xx`).
    pub retries: Family<Labels, Counter>,
    /// Retries refused because the retry budget was spent, by reason.
    pub retry_budget_exhausted: Family<Labels, Counter>,
    /// Endpoints ejected by passive outlier detection, by endpoint.
    pub outlier_ejections: Family<Labels, Counter>,
    /// Requests refused by the router itself, by status.
    pub rejected: Family<Labels, Counter>,
    /// 1 while an endpoint passes health checks.
    pub endpoint_healthy: Family<Labels, Gauge>,
    /// 1 while an endpoint's KV index is trusted for scoring.
    pub endpoint_index_trusted: Family<Labels, Gauge>,
    /// Requests in flight, by endpoint.
    pub endpoint_inflight: Family<Labels, Gauge>,
    /// Blocks the index holds, by endpoint and tier.
    pub index_blocks: Family<Labels, Gauge>,
    /// KV-event stream counters mirrored from the subscribers (counts since start), by endpoint
    /// and kind (batches, gaps, replays, unfilled_gaps, restarts, decode_errors, orphans).
    pub events: Family<Labels, Gauge>,
    /// Seconds since an endpoint's last KV event (absent before the first).
    pub events_age_seconds: Family<Labels, Gauge<f64, std::sync::atomic::AtomicU64>>,
    /// Requests held by flow control now.
    pub flow_queue_requests: Gauge,
    /// Body bytes held by flow control now.
    pub flow_queue_bytes: Gauge,
    /// Time requests spent held by flow control.
    pub flow_wait_seconds: Histogram,
    /// Requests shed by flow control, by reason (queue_full, queue_bytes, timeout).
    pub shed: Family<Labels, Counter>,
    /// Client connections open now, by listener (`api`, `admin`).
    pub connections_open: Family<Labels, Gauge>,
    /// Client connections closed at once because `limits.max_connections` were open.
    pub connections_refused: Family<Labels, Counter>,
    /// Client connections or requests cut off by a timeout, by kind (`header`, `body`, `idle`).
    pub client_timeouts: Family<Labels, Counter>,
    /// Request-body bytes held now (bounded by `limits.max_buffered_bytes`).
    pub buffered_bytes: Gauge,
    /// Bytes of prompt tokens in the tokenization cache (bounded by
    /// `limits.token_cache_bytes`).
    pub token_cache_bytes: Gauge,
}

impl Default for RouterMetrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("kvroute");
        let requests = Family::<Labels, Counter>::default();
        let request_seconds = Family::<Labels, Histogram>::new_with_constructor(
            latency_histogram as fn() -> Histogram,
        );
        let first_byte_seconds = Family::<Labels, Histogram>::new_with_constructor(
            latency_histogram as fn() -> Histogram,
        );
        let scheduling_seconds = fast_histogram();
        let tokenization_seconds = fast_histogram();
        let m = Self {
            requests,
            request_seconds,
            first_byte_seconds,
            scheduling_seconds,
            tokenization_seconds,
            predicted_cached_tokens: Family::default(),
            reported_cached_tokens: Family::default(),
            prediction_outcomes: Family::default(),
            retries: Family::default(),
            retry_budget_exhausted: Family::default(),
            outlier_ejections: Family::default(),
            rejected: Family::default(),
            endpoint_healthy: Family::default(),
            endpoint_index_trusted: Family::default(),
            endpoint_inflight: Family::default(),
            index_blocks: Family::default(),
            events: Family::default(),
            events_age_seconds: Family::default(),
            flow_queue_requests: Gauge::default(),
            flow_queue_bytes: Gauge::default(),
            flow_wait_seconds: latency_histogram(),
            shed: Family::default(),
            connections_open: Family::default(),
            connections_refused: Family::default(),
            client_timeouts: Family::default(),
            buffered_bytes: Gauge::default(),
            token_cache_bytes: Gauge::default(),
            registry: Registry::default(),
        };
        registry.register("requests", "Requests routed", m.requests.clone());
        registry.register(
            "request_duration_seconds",
            "Request time through the router",
            m.request_seconds.clone(),
        );
        registry.register(
            "first_byte_seconds",
            "Time to the engine's first response byte",
            m.first_byte_seconds.clone(),
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
            m.predicted_cached_tokens.clone(),
        );
        registry.register(
            "reported_cached_tokens",
            "Cached prompt tokens reported by engines",
            m.reported_cached_tokens.clone(),
        );
        registry.register(
            "prediction_outcomes",
            "Predicted vs reported cached tokens",
            m.prediction_outcomes.clone(),
        );
        registry.register(
            "retries",
            "Requests retried on another endpoint",
            m.retries.clone(),
        );
        registry.register(
            "retry_budget_exhausted",
            "Retries refused because the retry budget was spent",
            m.retry_budget_exhausted.clone(),
        );
        registry.register(
            "outlier_ejections",
            "Endpoints ejected because their requests failed",
            m.outlier_ejections.clone(),
        );
        registry.register(
            "rejected",
            "Requests answered by the router with an error",
            m.rejected.clone(),
        );
        registry.register(
            "endpoint_healthy",
            "1 while the endpoint passes health checks",
            m.endpoint_healthy.clone(),
        );
        registry.register(
            "endpoint_index_trusted",
            "1 while the endpoint's KV index is trusted",
            m.endpoint_index_trusted.clone(),
        );
        registry.register(
            "endpoint_inflight",
            "Requests in flight",
            m.endpoint_inflight.clone(),
        );
        registry.register(
            "index_blocks",
            "Blocks held in the KV index",
            m.index_blocks.clone(),
        );
        registry.register(
            "kv_events",
            "KV-event stream counters since start",
            m.events.clone(),
        );
        registry.register(
            "kv_events_age_seconds",
            "Seconds since the endpoint's last KV event",
            m.events_age_seconds.clone(),
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
            "token_cache_bytes",
            "Bytes of prompt tokens in the tokenization cache",
            m.token_cache_bytes.clone(),
        );
        Self { registry, ..m }
    }
}

impl RouterMetrics {
    /// The text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        out
    }
}

/// Labels for one client listener (`api` or `admin`).
pub fn listener(name: &'static str) -> Labels {
    vec![("listener", name.to_owned())]
}

/// Labels for one endpoint.
pub fn endpoint(name: &str) -> Labels {
    vec![("endpoint", name.to_owned())]
}
