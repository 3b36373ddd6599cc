//! The router's own Prometheus metrics, each declared once in [`RouterMetrics`]'s table.
//!
//! Series about one endpoint carry an `endpoint` label. With many endpoints that multiplies
//! the series, so `metrics.per_endpoint: false` ([`MetricsConfig`]) drops the label: counters
//! and histograms then count over every endpoint ([`EndpointFamily`]), and each per-endpoint
//! gauge becomes one series per remaining label set, summed over the endpoints (the age of
//! KV events: the oldest) when `/metrics` is rendered ([`EndpointGauges`]). Either way the
//! exposition's size does not depend on the number of endpoints then.
//!
//! Other parts of the router add their own groups of metrics with [`metric_group!`] (see
//! [`group`]) and one line in the table below.

mod by_endpoint;
mod group;
mod labels;
pub mod pd;
mod present;
pub mod tiers;

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};

pub use by_endpoint::{Aggregate, EndpointFamily, EndpointGauges, EndpointLabels};
pub use group::{Exported, Hooks, MetricGroup};
pub(crate) use group::{metric_group, register_entry};
pub use labels::{
    KindLabel, ListenerLabel, NoLabels, OutcomeLabel, ReasonLabel, RequestLabels, StatusLabel,
    TierLabel,
};
pub(crate) use present::PresentNames;

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

fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 18))
}

fn fast_histogram() -> Histogram {
    Histogram::new(exponential_buckets(1e-6, 2.0, 20))
}

/// Measured less predicted time to first token, seconds: symmetric around zero, from 10 ms
/// (a step or a round trip) to 3 s (a queue the model did not see).
fn prediction_error_histogram() -> Histogram {
    Histogram::new([
        -1.0, -0.3, -0.1, -0.03, -0.01, 0.0, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0,
    ])
}

/// A histogram family by endpoint with the latency buckets.
type LatencyByEndpoint = EndpointFamily<Histogram, NoLabels, fn() -> Histogram>;

/// Latency histograms by endpoint.
fn latency_by_endpoint(config: &MetricsConfig) -> LatencyByEndpoint {
    EndpointFamily::with_constructor(latency_histogram, config.per_endpoint)
}

/// Gauges by endpoint, summed over the endpoints with per-endpoint series off.
fn summed<L: EndpointLabels>(config: &MetricsConfig) -> EndpointGauges<L> {
    EndpointGauges::new(config.per_endpoint, Aggregate::Sum)
}

metric_group! {
    /// Every metric the router exports (in the exposition's order).
    pub struct RouterMetrics(config) {
        /// Requests routed, by endpoint, decision reason, status class and outcome
        /// (`completed`, `client_closed`, `engine_error`, `timeout`).
        requests: EndpointFamily<Counter, RequestLabels> = EndpointFamily::new(config.per_endpoint),
            "requests", "Requests routed";
        /// End-to-end request time through the router, by endpoint.
        request_seconds: LatencyByEndpoint = latency_by_endpoint(config),
            "request_duration_seconds", "Request time through the router";
        /// Time to the engine's first body byte, by endpoint.
        first_byte_seconds: LatencyByEndpoint = latency_by_endpoint(config),
            "first_byte_seconds", "Time to the engine's first response byte";
        /// Time to first token less the plan's prediction, by endpoint: how far the cost
        /// model's picture of each endpoint is from what it did.
        ttft_prediction_error_seconds: EndpointFamily<Histogram, NoLabels, fn() -> Histogram> =
            EndpointFamily::with_constructor(prediction_error_histogram, config.per_endpoint),
            "ttft_prediction_error_seconds", "Time to first token measured from dispatch, less the plan's prediction";
        /// Time spent choosing an endpoint.
        scheduling_seconds: Histogram = fast_histogram(),
            "scheduling_seconds", "Time spent choosing an endpoint";
        /// Time spent tokenizing.
        tokenization_seconds: Histogram = fast_histogram(),
            "tokenization_seconds", "Time spent tokenizing a request";
        /// Cached prompt tokens the router predicted, by endpoint.
        predicted_cached_tokens: EndpointFamily<Counter> = EndpointFamily::new(config.per_endpoint),
            "predicted_cached_tokens", "Cached prompt tokens predicted by the router";
        /// Cached prompt tokens engines reported, by endpoint.
        reported_cached_tokens: EndpointFamily<Counter> = EndpointFamily::new(config.per_endpoint),
            "reported_cached_tokens", "Cached prompt tokens reported by engines";
        /// Output tokens engines reported (`usage.completion_tokens`), by endpoint.
        generated_tokens: EndpointFamily<Counter> = EndpointFamily::new(config.per_endpoint),
            "generated_tokens", "Output tokens reported by engines";
        /// Predictions by outcome (exact, over, under), by endpoint.
        prediction_outcomes: EndpointFamily<Counter, OutcomeLabel> =
            EndpointFamily::new(config.per_endpoint),
            "prediction_outcomes", "Predicted vs reported cached tokens";
        /// Requests retried on another endpoint, by the endpoint that failed and reason
        /// (`connect`, `5xx`).
        retries: EndpointFamily<Counter, ReasonLabel> = EndpointFamily::new(config.per_endpoint),
            "retries", "Requests retried on another endpoint";
        /// Retries refused because the retry budget was spent, by reason.
        retry_budget_exhausted: EndpointFamily<Counter, ReasonLabel> =
            EndpointFamily::new(config.per_endpoint),
            "retry_budget_exhausted", "Retries refused because the retry budget was spent";
        /// Endpoints ejected by passive outlier detection, by endpoint.
        outlier_ejections: EndpointFamily<Counter> = EndpointFamily::new(config.per_endpoint),
            "outlier_ejections", "Endpoints ejected because their requests failed";
        /// Failed scrapes of an engine's `/metrics`, by endpoint and kind (`timeout`,
        /// `body_timeout`, `request`, `status`, `body`, `invalid`; `stale`: answered after the
        /// load sample's maximum age, counted from when it was sent): its load is not updated
        /// then.
        scrape_failures: EndpointFamily<Counter, KindLabel> = EndpointFamily::new(config.per_endpoint),
            "scrape_failures", "Failed scrapes of an engine's /metrics, by kind";
        /// Requests refused by the router itself, by status.
        rejected: Family<StatusLabel, Counter> = Family::default(),
            "rejected", "Requests answered by the router with an error";
        /// What discovery ignored, by kind (non_string_label, port_out_of_range,
        /// replay_without_events).
        discovery_problems: Family<KindLabel, Counter> = Family::default(),
            "discovery_problems", "What discovery ignored (and warned about), by kind";
        /// Endpoints of a peer replica's index snapshot refused, by the key-layout field that
        /// differed (`key_scheme`, `block_size`, `offload_block_size`): they are rebuilt from
        /// their engines' replay buffers instead.
        replica_snapshot_refused: Family<KindLabel, Counter> = Family::default(),
            "replica_snapshot_refused", "Endpoints of a peer's index snapshot refused (keys made with another layout), by field";
        /// 1 while peer messages (`/kvroute/v1/peer/*`: dispatches, shared load) are accepted
        /// without a token (`admin.token` unset): any process that reaches the admin listener
        /// can add load or cache predictions to any engine.
        replica_peer_messages_unauthenticated: Gauge = Gauge::default(),
            "replica_peer_messages_unauthenticated", "1 while replicas share dispatches or load without admin.token";
        /// Peer messages (and snapshot requests) this replica received from itself, its own
        /// admin listener being among its peers: dropped, and the address left out of its peers.
        replica_self_messages: Counter = Counter::default(),
            "replica_self_messages", "Peer messages a replica received from itself (dropped; the address is no longer a peer)";
        /// Messages to peers (`/kvroute/v1/peer/*`) not delivered, by kind: `outbox_full` (the
        /// peer's outbox held `4096` messages or 16 MiB waiting), `timeout` (no answer within 1 s), `unreachable`,
        /// `refused` (an error status), `unsupported` (an older peer without that message's route),
        /// `invalid`, `shutdown` (posted while the router shuts down: no task to send it). Each
        /// costs only what sharing would have won.
        replica_peer_messages_dropped: Family<KindLabel, Counter> = Family::default(),
            "replica_peer_messages_dropped", "Messages to peer replicas not delivered, by kind";
        /// Entries of peers' message batches skipped here, by kind: `unreadable` (a kind or
        /// body this build does not read), `refused` (a dispatch that does not fit this
        /// replica's configuration).
        replica_peer_messages_skipped: Family<KindLabel, Counter> = Family::default(),
            "replica_peer_messages_skipped", "Entries of peers' message batches skipped, by kind";
        /// KV-event batches dropped because their endpoint had left when they arrived.
        late_event_batches: Counter = Counter::default(),
            "late_event_batches", "KV-event batches dropped because their endpoint had left";
        /// 1 while an endpoint passes health checks.
        endpoint_healthy: EndpointGauges = summed(config),
            "endpoint_healthy", "1 while the endpoint passes health checks";
        /// 1 while an endpoint's KV index is trusted for scoring.
        endpoint_index_trusted: EndpointGauges = summed(config),
            "endpoint_index_trusted", "1 while the endpoint's KV index is trusted";
        /// Requests in flight, by endpoint.
        endpoint_inflight: EndpointGauges = summed(config),
            "endpoint_inflight", "Requests in flight";
        /// Blocks the index holds, by endpoint and tier.
        index_blocks: EndpointGauges<TierLabel> = summed(config),
            "index_blocks", "Blocks held in the KV index";
        /// An endpoint's CPU tier capacity in blocks as its events showed it: the most blocks
        /// the tier held when the engine evicted one (0 until it first does). The cost of
        /// placing a request reads it to price what the queue ahead pushes out of that tier.
        index_cpu_capacity_blocks: EndpointGauges = summed(config),
            "index_cpu_capacity_blocks",
            "CPU tier capacity in blocks, learned from the engine's first CPU eviction (0 before)";
        /// KV-event stream counters mirrored from the subscribers (counts since start), by
        /// endpoint and kind (batches, gaps, replays, replayed_batches, tail_checks,
        /// unfilled_gaps, restarts, decode_errors, orphans), and whether the subscriber is
        /// connected now (kind `connected`, 1 or 0).
        events: EndpointGauges<KindLabel> = summed(config),
            "kv_events", "KV-event stream counters since start";
        /// Seconds since an endpoint's last KV event (absent before the first).
        events_age_seconds: EndpointGauges<NoLabels, f64, AtomicU64> =
            EndpointGauges::new(config.per_endpoint, Aggregate::Max),
            "kv_events_age_seconds", "Seconds since the endpoint's last KV event";
        /// Seconds the endpoint's last answered `/metrics` scrape took (its load sample is that
        /// much older when it arrives; the slowest endpoint's without per-endpoint series).
        scrape_seconds: EndpointGauges<NoLabels, f64, AtomicU64> =
            EndpointGauges::new(config.per_endpoint, Aggregate::Max),
            "scrape_seconds", "Seconds the endpoint's last answered /metrics scrape took";
        /// Requests held by flow control now.
        flow_queue_requests: Gauge = Gauge::default(),
            "flow_queue_requests", "Requests held by flow control while every endpoint is saturated";
        /// Body bytes held by flow control now.
        flow_queue_bytes: Gauge = Gauge::default(),
            "flow_queue_bytes", "Request-body bytes held by flow control";
        /// Time requests spent held by flow control.
        flow_wait_seconds: Histogram = latency_histogram(),
            "flow_wait_seconds", "Time requests spent held by flow control";
        /// Requests shed by flow control, by reason (queue_full, queue_bytes, timeout).
        shed: Family<ReasonLabel, Counter> = Family::default(),
            "shed", "Requests shed by flow control, by reason";
        /// Client connections open now, by listener (`api`, `admin`).
        connections_open: Family<ListenerLabel, Gauge> = Family::default(),
            "connections_open", "Client connections open, by listener";
        /// Client connections closed at once because `limits.max_connections` were open.
        connections_refused: Family<ListenerLabel, Counter> = Family::default(),
            "connections_refused", "Client connections closed at once at the connection limit, by listener";
        /// Failed accepts (out of file descriptors, most likely), by listener.
        accept_errors: Family<ListenerLabel, Counter> = Family::default(),
            "accept_errors", "Failed accepts of client connections, by listener";
        /// Client connections or requests cut off by a timeout, by kind (`header`, `body`,
        /// `idle`).
        client_timeouts: Family<KindLabel, Counter> = Family::default(),
            "client_timeouts", "Client connections or requests cut off by a timeout, by kind";
        /// Request-body bytes held now by the API listener and the picker (bounded by
        /// `limits.max_buffered_bytes`).
        buffered_bytes: Gauge = Gauge::default(),
            "buffered_bytes", "Request-body bytes held by the router";
        /// Request-body bytes held now by the admin listener (bounded by
        /// `admin.max_buffered_bytes`).
        admin_buffered_bytes: Gauge = Gauge::default(),
            "admin_buffered_bytes", "Request-body bytes held by the admin listener";
        /// Response streams cut before their end, by reason (`shutdown`, `stalled`,
        /// `engine_error`).
        streams_cut: Family<ReasonLabel, Counter> = Family::default(),
            "streams_cut", "Response streams cut before their end, by reason";
        /// Large requests being prepared on the blocking pool, or waiting for it.
        offload_requests: Gauge = Gauge::default(),
            "offload_requests", "Large requests prepared on the blocking pool or waiting for it";
        /// ext_proc streams the picker serves now (bounded by `limits.max_picker_streams`).
        picker_streams: Gauge = Gauge::default(),
            "picker_streams", "ext_proc streams the endpoint picker serves";
        /// Observer streams the picker serves now (bounded by `limits.max_observer_streams`).
        picker_observer_streams: Gauge = Gauge::default(),
            "picker_observer_streams", "Observer ext_proc streams the endpoint picker serves";
        /// Observer streams ended unanswered because `limits.max_observer_streams` were open.
        observer_streams_refused: Counter = Counter::default(),
            "observer_streams_refused", "Observer ext_proc streams ended at the observer stream limit";
        /// Bytes of prompt tokens in the tokenization cache (bounded by
        /// `limits.token_cache_bytes`).
        token_cache_bytes: Gauge = Gauge::default(),
            "token_cache_bytes", "Bytes of prompt tokens in the tokenization cache";
        /// Prefill/decode disaggregation's metrics.
        pd: pd::PdMetrics = pd::PdMetrics::new(config);
        /// The cache tiers below the GPU ([`tiers`]).
        tiers: tiers::TierMetrics = tiers::TierMetrics::new(config);
    }
}

impl Default for RouterMetrics {
    fn default() -> Self {
        Self::new(&MetricsConfig::default())
    }
}

impl RouterMetrics {
    /// Removes every series of `endpoint` (it left the fleet), so that a departed pod's series
    /// do not linger in the exposition. What may write them after (a request still in flight
    /// there) goes through [`PresentNames`], which calls this when the name's last endpoint
    /// leaves.
    pub fn forget_endpoint(&self, endpoint: &str) {
        Hooks::forget_endpoint(self, endpoint);
    }

    /// The text exposition (per-endpoint gauges are set just before: with per-endpoint series
    /// off, what was set since the last rendering is aggregated now). The registry is built
    /// for each rendering from the table (the metrics it holds are shared handles), so every
    /// group registered in the table appears.
    pub fn render(&self) -> String {
        self.before_render();
        let mut registry = Registry::with_prefix("kvroute");
        MetricGroup::register(self, &mut registry);
        let mut out = String::new();
        encode(&mut out, &registry).expect("writing to a String cannot fail");
        out
    }
}

/// Labels for one client listener (`api` or `admin`).
pub fn listener(name: &'static str) -> ListenerLabel {
    ListenerLabel { listener: name }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set_for(m: &RouterMetrics, name: &str, healthy: i64, age: f64) {
        m.endpoint_healthy.of(name).set(healthy);
        m.events_age_seconds.of(name).set(age);
        m.retries
            .get_or_create(name, ReasonLabel { reason: "5xx" })
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
            text.contains("kvroute_retries_total{reason=\"5xx\"} 3\n"),
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

    #[test]
    fn endpoint_labels_come_first_in_their_order_and_leave_with_their_endpoint() {
        let m = RouterMetrics::default();
        let request = RequestLabels {
            reason: "cache",
            status: "2xx".into(),
            outcome: "completed",
        };
        m.requests.get_or_create("engine-0", request.clone()).inc();
        m.requests.get_or_create("engine-1", request).inc();
        m.prediction_outcomes
            .get_or_create("engine-0", OutcomeLabel { outcome: "exact" })
            .inc();
        m.index_blocks
            .get_or_create("engine-0", TierLabel { tier: "gpu".into() })
            .set(7);
        m.first_byte_seconds.of("engine-0").observe(0.01);
        m.ttft_prediction_error_seconds
            .of("engine-0")
            .observe(-0.02);
        let text = m.render();
        for line in [
            "# HELP kvroute_requests Requests routed.\n",
            "kvroute_requests_total{endpoint=\"engine-0\",reason=\"cache\",status=\"2xx\",outcome=\"completed\"} 1\n",
            "kvroute_prediction_outcomes_total{endpoint=\"engine-0\",outcome=\"exact\"} 1\n",
            "kvroute_index_blocks{endpoint=\"engine-0\",tier=\"gpu\"} 7\n",
            "kvroute_first_byte_seconds_count{endpoint=\"engine-0\"} 1\n",
            "kvroute_ttft_prediction_error_seconds_bucket{le=\"-0.03\",endpoint=\"engine-0\"} 0\n",
            "kvroute_ttft_prediction_error_seconds_bucket{le=\"-0.01\",endpoint=\"engine-0\"} 1\n",
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
        m.forget_endpoint("engine-0");
        let text = m.render();
        assert!(!text.contains("engine-0"), "{text}");
        assert!(
            text.contains("kvroute_requests_total{endpoint=\"engine-1\""),
            "{text}"
        );
    }

    metric_group! {
        /// A part's own metrics, as P/D or tiers would declare them.
        struct PartMetrics(config) {
            /// Legs run, by endpoint.
            legs: EndpointFamily<Counter> = EndpointFamily::new(config.per_endpoint),
                "part_legs", "Legs run";
        }
    }

    metric_group! {
        /// A table with a nested group, as `RouterMetrics` would hook one in.
        struct WithPart(config) {
            /// Requests refused.
            refused: Counter = Counter::default(), "refused", "Requests refused";
            /// The part's group.
            part: PartMetrics = PartMetrics::new(config);
        }
    }

    #[test]
    fn a_nested_group_registers_its_metrics_and_forgets_a_departed_endpoint() {
        let m = WithPart::new(&MetricsConfig::default());
        m.refused.inc();
        m.part.legs.of("engine-0").inc();
        let render = || {
            let mut registry = Registry::with_prefix("kvroute");
            MetricGroup::register(&m, &mut registry);
            let mut out = String::new();
            encode(&mut out, &registry).unwrap();
            out
        };
        let text = render();
        assert!(text.contains("kvroute_refused_total 1\n"), "{text}");
        assert!(
            text.contains("kvroute_part_legs_total{endpoint=\"engine-0\"} 1\n"),
            "{text}"
        );
        Hooks::forget_endpoint(&m, "engine-0");
        assert!(!render().contains("engine-0"));
    }
}
