//! The router's configuration: one YAML file, every field with a default, validated at start
//! with a message naming the field at fault.

use std::net::SocketAddr;

use kvroute_core::fleet::{
    FleetConfig, FlowConfig, HealthPolicy, OutlierPolicy, RetryPolicy, TrustPolicy,
};
use serde::{Deserialize, Serialize};

mod cache;
mod discovery;
mod edge;
mod endpoint;
mod model;
mod pd;
mod probes;
mod replicas;
mod scheduler;
mod validate;

pub use cache::{CacheConfig, KvEventsConfig};
pub use discovery::KubeDiscovery;
pub use edge::{AdminConfig, Limits, ShutdownConfig};
pub(crate) use endpoint::EndpointClash;
pub use endpoint::{EndpointConfig, OffloadConfig, SHARED_MOUNT_LABEL};
pub use model::{
    ContentFormatConfig, HfTokenizerConfig, ModelConfig, TokenizerConfig, TokenizerKind,
};
pub use probes::{HealthConfig, ScrapeConfig};
pub use replicas::{PeerDiscovery, ReplicasConfig};
pub use scheduler::SchedulerConfig;
// Sections of the configuration declared next to the code they configure.
pub use crate::forwarding::{ForwardingConfig, Network};
pub use crate::metrics::MetricsConfig;
pub use pd::{PdConfig, PdMode};

use crate::RouterError;

/// The whole configuration (`kvroute serve -c kvroute.yaml`).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouterConfig {
    /// Address the OpenAI API (and `/health`) listens on.
    #[serde(default = "default_listen")]
    pub listen: SocketAddr,
    /// The admin listener: `/metrics`, `/kvroute/v1/explain` and `/health`.
    #[serde(default)]
    pub admin: AdminConfig,
    /// Served models.
    pub models: Vec<ModelConfig>,
    /// Engine endpoints known at start (may be empty with `discovery`).
    #[serde(default)]
    pub endpoints: Vec<EndpointConfig>,
    /// Endpoints discovered from Kubernetes while running (feature `kube`).
    #[serde(default)]
    pub discovery: Option<KubeDiscovery>,
    /// How endpoints are chosen.
    #[serde(default)]
    pub scheduler: SchedulerConfig,
    /// Request limits and timeouts.
    #[serde(default)]
    pub limits: Limits,
    /// Health checks.
    #[serde(default)]
    pub health: HealthConfig,
    /// Load scraping.
    #[serde(default)]
    pub scrape: ScrapeConfig,
    /// The router's own `/metrics`.
    #[serde(default)]
    pub metrics: crate::metrics::MetricsConfig,
    /// The KV block index and the router's own routing memory.
    #[serde(default)]
    pub cache: CacheConfig,
    /// Flow control: holding requests in the router while every endpoint is saturated.
    #[serde(default)]
    pub flow: FlowConfig,
    /// Passive outlier detection (failed requests eject an endpoint for a while) and the
    /// per-endpoint circuit breaker.
    #[serde(default)]
    pub outlier: OutlierPolicy,
    /// Retrying a request on the next endpoint, within a budget.
    #[serde(default)]
    pub retry: RetryPolicy,
    /// Graceful shutdown.
    #[serde(default)]
    pub shutdown: ShutdownConfig,
    /// Forwarded headers: which proxies in front of the router are trusted.
    #[serde(default)]
    pub forwarding: crate::forwarding::ForwardingConfig,
    /// Other router replicas serving the same fleet: where a starting replica copies its KV
    /// index from before it reports ready.
    #[serde(default)]
    pub replicas: ReplicasConfig,
    /// The KV-event subscribers' bounds.
    #[serde(default)]
    pub kv_events: KvEventsConfig,
    /// Router-orchestrated prefill/decode disaggregation (off by default).
    #[serde(default)]
    pub pd: PdConfig,
}

fn default_listen() -> SocketAddr {
    "127.0.0.1:8000".parse().expect("valid literal")
}

impl RouterConfig {
    /// How long a removed endpoint's id waits before a newcomer takes it: a request planned on
    /// an endpoint is dispatched once connected (`limits.connect_timeout_ms`), a P/D decode leg
    /// once its prefill answered (`pd.prefill_deadline_s`, when P/D is on), and half a second
    /// covers the work between the plan and the connection.
    pub fn slot_reuse_after_s(&self) -> f64 {
        let pd = match self.pd.mode {
            crate::config::pd::PdMode::Off => 0.0,
            _ => self.pd.prefill_deadline_s,
        };
        self.limits.connect_timeout_ms as f64 / 1000.0 + pd + 0.5
    }

    /// The core fleet's bounds and thresholds, from the sections that set them.
    pub fn fleet_config(&self) -> FleetConfig {
        let c = &self.cache;
        FleetConfig {
            index_capacity: c.index_capacity,
            index_shards: c.index_shards,
            history_ttl_s: c.history_ttl_s,
            history_capacity: c.history_capacity,
            predicted_ttl_s: c.predicted_ttl_s,
            default_prefill_tokens_per_s: self.scheduler.prefill_tokens_per_s,
            prefill_chunk_tokens: self.scheduler.prefill_chunk_tokens,
            load_sample_max_age_s: FleetConfig::load_sample_max_age_for(
                self.scrape.interval_ms as f64 / 1000.0,
                self.scrape.timeout_ms as f64 / 1000.0,
            ),
            trust: TrustPolicy {
                silent_after_s: c.silent_after_s,
                distrust_after_gap_s: c.distrust_after_gap_s,
                max_prediction_error: c.max_prediction_error,
                ..TrustPolicy::default()
            },
            health: HealthPolicy {
                unhealthy_after: self.health.unhealthy_after,
                healthy_after: self.health.healthy_after,
            },
            flow: self.flow.clone(),
            outlier: self.outlier.clone(),
            retry: self.retry.clone(),
            slot_reuse_after_s: self.slot_reuse_after_s(),
            ..FleetConfig::default()
        }
    }
}

/// Seconds no timeout setting may reach (about 31 years): a duration made from more could
/// overflow (and from 2⁶⁴ seconds on, panic), and no timeout means that much.
pub(crate) const MAX_SECONDS: f64 = 1e9;

fn invalid(field: &str, why: impl std::fmt::Display) -> RouterError {
    RouterError::Config(format!("{field}: {why}"))
}

impl RouterConfig {
    /// Parses and validates YAML.
    pub fn from_yaml(text: &str) -> Result<Self, RouterError> {
        let config: RouterConfig =
            serde_yaml_ng::from_str(text).map_err(|e| RouterError::Config(e.to_string()))?;
        config.validate()?;
        Ok(config)
    }
}

#[cfg(test)]
mod tests;
