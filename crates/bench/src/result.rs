//! What a benchmark run produces: one record per request and the run's summary. This is the
//! JSON schema of `kvroute bench --json` and the input of reports and `bench compare`.

use serde::{Deserialize, Serialize};

/// One request as the client saw it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RequestRecord {
    /// Session (conversation, tenant question, trace row) the request belongs to.
    pub session: u64,
    /// Turn within the session (0 for single-turn workloads).
    pub turn: u32,
    /// When it was sent, seconds from the start of the run.
    pub start_s: f64,
    /// Time to the first generated token, seconds (`None` on error).
    pub ttft_s: Option<f64>,
    /// Gaps between consecutive tokens, seconds.
    pub itl_s: Vec<f64>,
    /// Time to the last byte, seconds.
    pub e2e_s: f64,
    /// Prompt tokens (from `usage`).
    pub prompt_tokens: u64,
    /// Generated tokens (from `usage`, or counted chunks).
    pub completion_tokens: u64,
    /// Prompt tokens served from the engine's prefix cache (`usage.prompt_tokens_details`).
    pub cached_tokens: Option<u64>,
    /// The endpoint that served it (`x-kvroute-endpoint`), when a router says.
    pub endpoint: Option<String>,
    /// What went wrong, if anything.
    pub error: Option<String>,
}

impl RequestRecord {
    /// Why a turn has a record but was never sent.
    pub const NOT_SENT: &'static str = "not sent: an earlier turn of its conversation failed";

    /// The record of turn `turn` of `session`, never sent because an earlier turn of its
    /// conversation failed at `at_s`: counted as an error, so that a policy that fails turns
    /// is not measured over fewer, easier requests than one that serves them all.
    pub fn not_sent(session: u64, turn: u32, at_s: f64) -> RequestRecord {
        RequestRecord {
            session,
            turn,
            start_s: at_s,
            error: Some(Self::NOT_SENT.to_owned()),
            ..RequestRecord::default()
        }
    }
}

/// Latency percentiles of one measure, seconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Percentiles {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Mean.
    pub mean: f64,
    /// Samples.
    pub count: u64,
}

/// One endpoint's share of the run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EndpointShare {
    /// Endpoint name.
    pub endpoint: String,
    /// Requests it served.
    pub requests: u64,
    /// Prompt tokens it was sent.
    pub prompt_tokens: u64,
    /// Of those, tokens it served from cache.
    pub cached_tokens: u64,
}

/// The figures of one run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Requests sent.
    pub requests: u64,
    /// Requests that failed.
    pub errors: u64,
    /// Wall time of the run, seconds.
    pub duration_s: f64,
    /// Completed requests per second.
    pub requests_per_s: f64,
    /// Generated tokens per second.
    pub output_tokens_per_s: f64,
    /// Time to first token.
    pub ttft: Percentiles,
    /// End-to-end time.
    pub e2e: Percentiles,
    /// Inter-token latency.
    pub itl: Percentiles,
    /// Cached / prompt tokens over the requests that reported usage.
    pub hit_rate: f64,
    /// Same, from the engines' `vllm:prefix_cache_*` counters, when they were reachable.
    pub engine_hit_rate: Option<f64>,
    /// Requests and tokens per endpoint.
    pub endpoints: Vec<EndpointShare>,
    /// Load balance: the busiest endpoint's requests over the mean (1.0 is perfect).
    pub load_imbalance: f64,
    /// Where the engines found the prompt tokens, tier by tier, from their own counters, when a
    /// run read them (`kvroute demo --offload`); absent from older result files.
    #[serde(default)]
    pub tier_tokens: Option<TierTokens>,
    /// How far each planned leg's time to first token was from the router's prediction for
    /// it (a request's, or a disaggregated request's prefill leg's; a decode leg's wait is
    /// not the plan's), when the run knows the predictions (`kvroute simulate` under a policy
    /// that plans with the cost model); absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft_prediction_error: Option<PredictionError>,
}

/// Measured less predicted time to first token over a run's predicted requests, seconds
/// (negative: served sooner than predicted). Percentiles are nearest-rank over the exact
/// values.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PredictionError {
    /// Requests with a prediction.
    pub count: u64,
    /// Mean error (the bias).
    pub mean_s: f64,
    /// Mean absolute error.
    pub mean_abs_s: f64,
    /// 10th percentile (the predictions furthest above what happened).
    pub p10_s: f64,
    /// Median.
    pub p50_s: f64,
    /// 90th percentile (the waits furthest beyond their prediction).
    pub p90_s: f64,
}

/// Prompt tokens the engines served from each KV-cache tier during one run: the difference of
/// their counters over the run (`vllm:prefix_cache_hits` for the GPU, the offload connector's
/// loaded-token counters for the other tiers), summed over the fleet.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TierTokens {
    /// Found in the GPU prefix cache.
    pub gpu: u64,
    /// Loaded from the engines' CPU tier.
    pub cpu: u64,
    /// Loaded from the engines' own storage (local SSD).
    pub ssd: u64,
    /// Loaded from the fleet's shared filesystem.
    pub shared_fs: u64,
}

/// A complete run: what was run, its summary, every request.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RunResult {
    /// A name for tables and charts (e.g. the routing policy).
    pub name: String,
    /// The workload and settings, for the record.
    pub config: serde_json::Value,
    /// The figures.
    pub summary: Summary,
    /// Every request, in start order.
    pub records: Vec<RequestRecord>,
}
