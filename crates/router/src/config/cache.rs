//! The KV index's sections: its bounds, the routing history and trust in an endpoint's events
//! (`cache:`), and what a KV-event connection may make the router buffer (`kv_events:`).

use kvroute_core::fleet::FleetConfig;
use serde::{Deserialize, Serialize};

/// What one engine's KV-event connection (PUB or replay) may make the router buffer.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvEventsConfig {
    /// Largest KV-event message accepted, all its frames together; a publisher declaring a
    /// larger frame or message loses its connection (a protocol error, counted, reconnected
    /// with backoff) before anything is buffered for it. As libzmq's `ZMQ_MAXMSGSIZE`.
    pub max_message_bytes: usize,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        Self {
            max_message_bytes: kvroute_vllm::zmtp::DEFAULT_MAX_MESSAGE_BYTES,
        }
    }
}

impl KvEventsConfig {
    /// The subscribers' configuration: default timing, these bounds.
    pub fn subscriber_config(&self) -> kvroute_vllm::subscriber::SubscriberConfig {
        kvroute_vllm::subscriber::SubscriberConfig {
            limits: kvroute_vllm::zmtp::Limits {
                max_message_bytes: self.max_message_bytes,
                ..kvroute_vllm::zmtp::Limits::default()
            },
            ..Default::default()
        }
    }
}

/// The KV block index, the routing history and when to stop trusting an endpoint's events.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CacheConfig {
    /// Most (block, endpoint) entries in the index.
    pub index_capacity: usize,
    /// Shards of the index, split by endpoint: up to this many endpoints' events are applied
    /// at once, and a lookup walks each shard holding the prompt.
    pub index_shards: usize,
    /// Seconds the router remembers where it sent a prefix (approximate mode).
    pub history_ttl_s: f64,
    /// Most (block, endpoint) entries in that history.
    pub history_capacity: usize,
    /// Seconds a just-sent prefix counts as cached before its events arrive.
    pub predicted_ttl_s: f64,
    /// Seconds without any event, while requests keep going there, after which an endpoint's
    /// index is not trusted.
    pub silent_after_s: f64,
    /// Seconds an endpoint's index stays untrusted after events were lost for good; and after
    /// its last judgement when its predictions erred, before it is read again on probation.
    pub distrust_after_gap_s: f64,
    /// Mean absolute prediction error (share of the prompt) above which an endpoint's index is
    /// not trusted.
    pub max_prediction_error: f64,
}

impl Default for CacheConfig {
    fn default() -> Self {
        // Core's defaults, so the two cannot drift apart.
        let fleet = FleetConfig::default();
        Self {
            index_capacity: fleet.index_capacity,
            // One writer unless configured: a second shard doubles ingest only where a core is
            // free, and every lookup pays for it (docs/benchmarks.md, fleet scale).
            index_shards: fleet.index_shards,
            history_ttl_s: fleet.history_ttl_s,
            history_capacity: fleet.history_capacity,
            predicted_ttl_s: fleet.predicted_ttl_s,
            silent_after_s: fleet.trust.silent_after_s,
            distrust_after_gap_s: fleet.trust.distrust_after_gap_s,
            max_prediction_error: fleet.trust.max_prediction_error,
        }
    }
}
