//! Choosing an endpoint: filters, then weighted scorers, then a picker.
//!
//! The scheduler is a pure function of the request's features, each candidate endpoint's
//! state (health, load, what it has cached) and a random number: it has no side effects (the
//! router reserves load and records history after it picks). It returns every candidate
//! ranked best first with the breakdown that `/kvroute/v1/explain` shows, so a retry can take
//! the next one and an operator can see why.

mod picker;
mod profile;
mod scorers;

use serde::{Deserialize, Serialize};

use crate::index::{EndpointId, PrefixMatch};
pub use picker::Picker;
pub use profile::{Filters, Profile, ProfileName, ScorerWeights, TierWeights};

/// What an endpoint is for (prefill/decode disaggregation).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Serves whole requests.
    #[default]
    Both,
    /// Prefill only.
    Prefill,
    /// Decode only.
    Decode,
}

/// Load signals of one endpoint. Scraped values are `None` until first scraped.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct EndpointLoad {
    /// `vllm:num_requests_waiting` at the last scrape.
    pub waiting: Option<f64>,
    /// `vllm:num_requests_running` at the last scrape.
    pub running: Option<f64>,
    /// `vllm:kv_cache_usage_perc` (0–1) at the last scrape.
    pub kv_usage: Option<f64>,
    /// Requests the router has in flight to it (fresher than any scrape).
    pub inflight: u32,
    /// Of those, requests still waiting for their first token.
    pub inflight_prefills: u32,
    /// Uncached prompt tokens of in-flight requests still waiting for their first token.
    pub inflight_prefill_tokens: u64,
    /// Requests the router recently placed there for reasons other than its cache (a
    /// time-decayed count): what the balance scorer evens out.
    pub recent_requests: f64,
}

impl EndpointLoad {
    /// Requests queued ahead of a new one: the larger of the scraped waiting queue and the
    /// router's own requests not yet past prefill (fresher, but blind to other routers).
    pub fn queue(&self) -> f64 {
        self.waiting
            .unwrap_or(0.0)
            .max(f64::from(self.inflight_prefills))
    }
}

/// What the router knows an endpoint has cached of this request, in blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct CacheView {
    /// From the engine's KV events, by tier; `None` when the endpoint's index is not trusted
    /// (no events configured, stale, unfilled gap) and so must not be used.
    pub precise: Option<PrefixMatch>,
    /// From the router's own routing history (approximate mode).
    pub approximate: u32,
    /// From the short-lived overlay of requests just sent there, before their events arrive.
    pub predicted: u32,
}

/// One endpoint as the scheduler sees it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Candidate {
    /// The endpoint.
    pub endpoint: EndpointId,
    /// Passing health checks.
    pub healthy: bool,
    /// Serves the requested model or adapter.
    pub serves_model: bool,
    /// Its role.
    pub role: Role,
    /// Its load.
    pub load: EndpointLoad,
    /// What it has cached of this request.
    pub cache: CacheView,
    /// Prompt tokens per second it prefills (observed, or configured).
    pub prefill_tokens_per_s: f64,
}

/// The request's features that scheduling uses.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RequestInfo {
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// The endpoint this request's session used last, if any.
    pub session_endpoint: Option<EndpointId>,
    /// The role wanted.
    pub role: Role,
}

/// Why a candidate was filtered out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Rejection {
    /// Failing health checks.
    Unhealthy,
    /// Does not serve the model.
    WrongModel,
    /// Wrong role.
    WrongRole,
    /// Waiting queue above the limit.
    QueueFull,
    /// KV cache usage above the limit.
    KvCacheFull,
}

/// One scorer's verdict on one candidate.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ScoreTerm {
    /// Scorer name.
    pub scorer: &'static str,
    /// Raw score in [0, 1].
    pub score: f64,
    /// Its weight in the profile.
    pub weight: f64,
}

/// The breakdown of one candidate.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Assessment {
    /// The endpoint.
    pub endpoint: EndpointId,
    /// Why it was filtered out; `None` if it competed.
    pub rejected: Option<Rejection>,
    /// Prompt tokens it holds, counted by the best source in use (precise, predicted, history).
    pub cached_tokens: usize,
    /// Of those, tokens on the GPU (precise index or prediction).
    pub gpu_tokens: usize,
    /// Predicted time to first token, seconds (queue + uncached prefill).
    pub predicted_ttft_s: f64,
    /// Each scorer's score.
    pub scores: Vec<ScoreTerm>,
    /// Weighted sum.
    pub total: f64,
}

/// The scheduler's answer.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Decision {
    /// Candidates that competed, best first (the first is the choice; the rest are fallbacks).
    pub ranking: Vec<EndpointId>,
    /// Every candidate's breakdown, in input order.
    pub assessments: Vec<Assessment>,
    /// Why the first was chosen, in a few words (for logs and metrics labels).
    pub reason: &'static str,
}

impl Decision {
    /// The chosen endpoint, if any candidate passed the filters.
    pub fn chosen(&self) -> Option<EndpointId> {
        self.ranking.first().copied()
    }

    /// The breakdown of `endpoint`.
    pub fn assessment(&self, endpoint: EndpointId) -> Option<&Assessment> {
        self.assessments.iter().find(|a| a.endpoint == endpoint)
    }
}

/// Ranks `candidates` for `request` under `profile`. `random` is a uniformly random `u64`
/// (tie-breaking and softmax sampling); `round_robin` a counter the caller increments.
pub fn schedule(
    profile: &Profile,
    request: &RequestInfo,
    candidates: &[Candidate],
    random: u64,
    round_robin: u64,
) -> Decision {
    let mut assessments: Vec<Assessment> = candidates
        .iter()
        .map(|c| scorers::assess(profile, request, c))
        .collect();
    scorers::apply_relative(candidates, &mut assessments);
    let competing: Vec<usize> = (0..assessments.len())
        .filter(|&i| assessments[i].rejected.is_none())
        .collect();
    let (ranking, reason) = profile
        .picker
        .rank(&assessments, &competing, random, round_robin);
    let reason = if ranking.is_empty() {
        "no_candidate"
    } else {
        reason.unwrap_or_else(|| {
            scorers::reason(
                &assessments[ranking[0]],
                ranking.get(1).map(|&i| &assessments[i]),
            )
        })
    };
    Decision {
        ranking: ranking.iter().map(|&i| assessments[i].endpoint).collect(),
        assessments,
        reason,
    }
}

#[cfg(test)]
mod tests;
