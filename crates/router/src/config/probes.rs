//! How the router watches engines: active health checks (`health:`) and load scraping
//! (`scrape:`).

use serde::{Deserialize, Serialize};

/// Active health checks (`GET /health`).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HealthConfig {
    /// Between checks, milliseconds.
    pub interval_ms: u64,
    /// Per check, milliseconds.
    pub timeout_ms: u64,
    /// Consecutive failures that eject an endpoint.
    pub unhealthy_after: u32,
    /// Consecutive successes that bring it back.
    pub healthy_after: u32,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            interval_ms: 1_000,
            timeout_ms: 1_000,
            unhealthy_after: 2,
            healthy_after: 2,
        }
    }
}

/// Load scraping (`GET /metrics`).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScrapeConfig {
    /// Between scrapes, milliseconds.
    pub interval_ms: u64,
    /// Longest wait for an engine's `/metrics` answer, headers and body together, milliseconds. A busy
    /// engine's API server answers late (a CPU-bound vLLM took over a second on a loaded
    /// machine), and a busy engine is the one whose load matters: a timeout shorter than that
    /// leaves the router with the idle picture it had before.
    pub timeout_ms: u64,
}

impl Default for ScrapeConfig {
    fn default() -> Self {
        Self {
            interval_ms: 500,
            timeout_ms: 2_000,
        }
    }
}
