//! Fault injection for reliability tests: lost and late events, slow or unhealthy engines,
//! engines that fail some requests while passing their health checks, degraded or failing KV
//! transfers between prefill and decode engines.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Faults in force on one engine.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct Faults {
    /// Fraction of event batches lost in transit (still in the replay buffer).
    pub drop_event_fraction: f64,
    /// Extra delay before each event batch is published.
    #[serde(rename = "event_delay_ms", with = "millis")]
    pub event_delay: Duration,
    /// Step time multiplier (2.0: twice as slow).
    pub slow_factor: f64,
    /// When false, `/health` answers 503 and requests are refused.
    pub healthy: bool,
    /// Fraction of generation requests answered `error_status` at once (before any body
    /// byte), while `/health` still passes.
    pub error_fraction: f64,
    /// The status of those answers (a 5xx).
    pub error_status: u16,
    /// P/D: this consumer's KV pulls run this many times slower than the link model says
    /// (a degraded link: RDMA silently fallen back to TCP, a congested switch).
    pub link_slowdown: f64,
    /// P/D: fraction of this consumer's KV pulls that fail after the transfer time (the
    /// `kv_load_failure_policy` then applies).
    pub kv_transfer_failure_fraction: f64,
    /// Extra delay before `/metrics` answers: a busy engine's API server, starved of CPU by
    /// its own forward passes, answers a scrape late.
    #[serde(rename = "metrics_delay_ms", with = "millis")]
    pub metrics_delay: Duration,
}

impl Default for Faults {
    fn default() -> Self {
        Self {
            drop_event_fraction: 0.0,
            event_delay: Duration::ZERO,
            slow_factor: 1.0,
            healthy: true,
            error_fraction: 0.0,
            error_status: 503,
            link_slowdown: 1.0,
            kv_transfer_failure_fraction: 0.0,
            metrics_delay: Duration::ZERO,
        }
    }
}

mod millis {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_millis() as u64)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        Ok(Duration::from_millis(u64::deserialize(d)?))
    }
}
