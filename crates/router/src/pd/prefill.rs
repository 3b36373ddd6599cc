//! The prefill leg: connected, dispatched and accounted like any leg, its (small,
//! non-streaming) answer read whole, bounded in bytes and within `pd.prefill_deadline_s`, and
//! its `kv_transfer_params` taken for the decode leg.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use kvroute_core::fleet::{Plan, UpstreamOutcome};
use kvroute_core::index::EndpointId;
use kvroute_core::schedule::PredictedTtfts;
use kvroute_vllm::nixl::{prefill_answer_params, prefill_leg_body};
use kvroute_vllm::openai::usage_cached_tokens;
use serde_json::{Map, Value};
use tokio::time::Instant;

use crate::accounting::{Accounting, Outcome};
use crate::forward::{ForwardArgs, upstream_request};
use crate::pipeline::{self, Leg};
use crate::upstream::UpstreamError;

/// Largest prefill answer read: one token and the transfer params.
const MAX_ANSWER_BYTES: usize = 1 << 20;

/// What the prefill leg returned.
pub(super) struct PrefillAnswer {
    /// Its `kv_transfer_params`, for the decode leg, unchanged.
    pub(super) params: Map<String, Value>,
    /// Its `usage.prompt_tokens_details.cached_tokens`, if it said.
    pub(super) cached_tokens: Option<u64>,
}

/// Why a prefill leg gave nothing to decode from (a fallback's reason, not an error the
/// client sees: the request is served aggregated).
#[derive(Debug)]
pub(super) enum PrefillFailure {
    /// No connection to the prefill endpoint.
    Connect(String),
    /// The answer did not come within the deadline.
    Deadline(Duration),
    /// The connection failed, or the engine answered 5xx.
    Engine(String),
    /// The engine refused the leg (a 4xx: the request, or the endpoint's role, not its
    /// health).
    Refused(String),
    /// A 200 without usable `kv_transfer_params`.
    Answer(String),
}

impl std::fmt::Display for PrefillFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PrefillFailure::Connect(e) => write!(f, "cannot connect to the prefill endpoint: {e}"),
            PrefillFailure::Deadline(d) => write!(f, "no prefill answer within {d:?}"),
            PrefillFailure::Engine(e) => write!(f, "the prefill endpoint failed: {e}"),
            PrefillFailure::Refused(e) => write!(f, "the prefill endpoint refused the leg: {e}"),
            PrefillFailure::Answer(e) => write!(f, "the prefill answer is unusable: {e}"),
        }
    }
}

impl PrefillFailure {
    /// The `reason` label of `kvroute_pd_fallbacks_total`.
    pub(super) fn label(&self) -> &'static str {
        match self {
            PrefillFailure::Connect(_) => "prefill_connect",
            PrefillFailure::Deadline(_) => "prefill_deadline",
            PrefillFailure::Engine(_) => "prefill_failed",
            PrefillFailure::Refused(_) => "prefill_refused",
            PrefillFailure::Answer(_) => "prefill_no_params",
        }
    }
}

/// Runs the prefill leg of `a` (the client's request, `client` its body) on `prefill`.
pub(super) async fn run(
    a: &ForwardArgs<'_>,
    prefill: EndpointId,
    client: &Value,
    plan: &Plan,
) -> Result<PrefillAnswer, PrefillFailure> {
    let router = a.router;
    let deadline = Duration::from_secs_f64(router.config().pd.prefill_deadline_s);
    let started = Instant::now();
    let leg = Leg {
        ranking: vec![prefill],
        predicted_cached: plan.predicted_cached.clone(),
        predicted_ttft_s: PredictedTtfts::of(&plan.decision),
        reason: "pd_prefill",
    };
    let body = Bytes::from(serde_json::to_vec(&prefill_leg_body(client)).unwrap_or_default());
    let endpoint = router.endpoint(prefill);
    let authority = endpoint.authority.to_string();
    // The leg's accounting lives outside the deadline's future, so that a missed deadline is
    // accounted as one (not as a client that went away when the future is dropped).
    let mut accounting: Option<Accounting> = None;
    let exchange = async {
        let conn = router
            .upstream()
            .connection(&authority)
            .await
            .map_err(|e| PrefillFailure::Connect(e.to_string()))?;
        let dispatch = pipeline::connect(router, &leg, a.prepared, prefill);
        super::prefill_sent(router, plan, prefill);
        let accounting =
            accounting.insert(pipeline::respond(router, &a.context, &leg, 0, dispatch));
        accounting.skip_output_count();
        // Its answer is its one token.
        accounting.first_byte_is_first_token();
        let request = upstream_request(&format!("http://{authority}"), a, body);
        let (response, lease) = match router.upstream().send(conn, &authority, request).await {
            Ok(answer) => answer,
            Err(e) => {
                accounting.fail(502, Outcome::EngineError);
                // Nothing reached the engine: as a refused connection.
                return Err(match e {
                    UpstreamError::Connect(_) => PrefillFailure::Connect(e.to_string()),
                    UpstreamError::Request(_) => PrefillFailure::Engine(e.to_string()),
                });
            }
        };
        let (parts, body) = response.into_parts();
        accounting.status = parts.status.as_u16();
        let bytes = match Limited::new(body, MAX_ANSWER_BYTES).collect().await {
            Ok(collected) => collected.to_bytes(),
            // The request's shape (`echo`, `prompt_logprobs` of a long prompt), not the
            // endpoint's health: an unusable answer, not an outlier's strike.
            Err(e) if e.is::<LengthLimitError>() && parts.status.is_success() => {
                accounting.fail(502, Outcome::EngineError);
                return Err(PrefillFailure::Answer(format!(
                    "an answer over {MAX_ANSWER_BYTES} bytes"
                )));
            }
            Err(e) => {
                accounting.fail(502, Outcome::EngineError);
                return Err(PrefillFailure::Engine(e.to_string()));
            }
        };
        lease.release();
        accounting.observe(&bytes);
        accounting.completed();
        if !parts.status.is_success() {
            // At most the first 512 bytes of the engine's answer: it is logged per request.
            let shown = &bytes[..bytes.len().min(512)];
            let why = format!("HTTP {}: {}", parts.status, String::from_utf8_lossy(shown));
            return Err(if parts.status.is_client_error() {
                PrefillFailure::Refused(why)
            } else {
                PrefillFailure::Engine(why)
            });
        }
        Ok(bytes)
    };
    let outcome = match tokio::time::timeout(deadline, exchange).await {
        Err(_) => {
            if let Some(accounting) = accounting.as_mut() {
                accounting.fail(504, Outcome::Deadline);
            }
            Err(PrefillFailure::Deadline(deadline))
        }
        Ok(Err(why)) => Err(why),
        Ok(Ok(bytes)) => parse_answer(&bytes),
    };
    // Accounted now, before the fallback's leg.
    drop(accounting);
    router
        .metrics()
        .pd
        .leg("prefill", started.elapsed().as_secs_f64());
    // A deadline missed or an engine failure counts against the endpoint; a refusal or an
    // unusable 200 (no connector) is the request's or the configuration's problem, not an
    // outlier's.
    let result = match &outcome {
        Err(PrefillFailure::Answer(_) | PrefillFailure::Refused(_)) | Ok(_) => {
            UpstreamOutcome::Success
        }
        Err(_) => UpstreamOutcome::Failure,
    };
    router.upstream_result(prefill, result);
    outcome
}

/// The params and cached tokens of a prefill answer.
fn parse_answer(bytes: &[u8]) -> Result<PrefillAnswer, PrefillFailure> {
    let answer: Value =
        serde_json::from_slice(bytes).map_err(|e| PrefillFailure::Answer(e.to_string()))?;
    let params = prefill_answer_params(&answer)
        .map_err(|e| PrefillFailure::Answer(e.to_string()))?
        .clone();
    let cached_tokens = usage_cached_tokens(&answer);
    Ok(PrefillAnswer {
        params,
        cached_tokens,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_without_params_or_not_json_is_unusable() {
        assert!(matches!(
            parse_answer(b"{\"choices\": []}"),
            Err(PrefillFailure::Answer(_))
        ));
        assert!(matches!(
            parse_answer(b"<html>"),
            Err(PrefillFailure::Answer(_))
        ));
        let ok = parse_answer(
            br#"{"kv_transfer_params": {"do_remote_prefill": true, "remote_engine_id": "p"},
                "usage": {"prompt_tokens_details": {"cached_tokens": 32}}}"#,
        )
        .unwrap();
        assert_eq!(ok.params["remote_engine_id"], "p");
        assert_eq!(ok.cached_tokens, Some(32));
    }
}
