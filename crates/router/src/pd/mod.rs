//! Router-orchestrated prefill/decode disaggregation (`pd.mode: orchestrate`), as vLLM's
//! reference proxy runs it but scheduled by core: the plan's best decode-capable endpoint is the
//! decode pick, then core prices aggregated against P/D with each prefill-capable endpoint
//! ([`kvroute_core::fleet::Fleet::plan_disagg`]) and the router carries the choice out.
//!
//! A disaggregated request is two legs through the pipeline, each selected, connected and
//! accounted on its own, with the client's `X-Request-Id` on both:
//!
//! 1. the **prefill leg** ([`prefill`]) on the prefill endpoint: non-streaming, `max_tokens: 1`,
//!    `stream_options` and `min_tokens` removed, `kv_transfer_params` asking for a remote
//!    decode; its answer's `kv_transfer_params` are read within `pd.prefill_deadline_s`;
//! 2. the **decode leg** on the decode endpoint: the client's own body with those params,
//!    unchanged (and, for 0.33+, the prefill's `cached_tokens` so that the client sees what an
//!    aggregated run reports), streamed to the client through the proxy's forwarding. Its
//!    transfer is tracked ([`crate::transfer`]): its bytes queue on both NICs until it ends, and the
//!    time to the decode leg's first token, less its predicted wait in the decode queue,
//!    teaches the pair's bandwidth.
//!
//! Failures never hang a client: a prefill leg that fails or misses its deadline falls back to
//! one aggregated attempt on the decode pick; a decode leg that fails after its prefill is
//! retried once on the next decode-capable endpoint: as a decode leg only when no connection
//! was made, the producer's lease holds and that endpoint is not the producer itself (NIXL
//! refuses a pull from its own engine), else aggregated (a consumer that took the leg may
//! have pulled, and the producer released the blocks); past the retry budget the client gets
//! the engine's error. No prefill endpoint available means aggregated. Each fallback is counted
//! by reason ([`crate::pd_metrics`]).

mod explain;
mod prefill;

use std::borrow::Cow;

use axum::response::Response;
use bytes::Bytes;
use kvroute_core::fleet::Plan;
use kvroute_core::index::EndpointId;
use kvroute_core::schedule::PredictedTtfts;
use kvroute_core::schedule::disagg::{DisaggChoice, PdOption};
use kvroute_vllm::nixl::{decode_leg_body, lease_expiry_unix_s};
use kvroute_vllm::openai::{ApiError, ask_stream_usage, request_stream_usage};
use serde_json::Value;

pub use explain::explain;

use crate::forward::{ForwardArgs, forward};
use crate::pipeline::Leg;
use crate::service::Router;
use crate::transfer::{DecodeLeg, lease_holds};

/// What core decided for one request.
enum Route {
    /// One leg down `ranking` (the decode pick first).
    Aggregated { ranking: Vec<EndpointId> },
    /// A prefill leg on `option.prefill`, then the decode leg down `decoders` (the decode pick
    /// first).
    Disaggregated {
        option: PdOption,
        decoders: Vec<EndpointId>,
    },
}

/// Asks core for the request's P/D choice; counted by reason.
fn decide(router: &Router, plan: &Plan, prompt_tokens: usize, block_size: usize) -> Route {
    let route = choose(router, plan, prompt_tokens, block_size);
    if let Route::Aggregated { ranking } = &route
        && let Some(first) = ranking.first()
    {
        // Served whole: its prefill counts on the endpoint that computes it.
        prefill_sent(router, plan, *first);
    }
    route
}

/// The choice [`decide`] records: aggregated or disaggregated, counted by reason.
fn choose(router: &Router, plan: &Plan, prompt_tokens: usize, block_size: usize) -> Route {
    let now = router.now();
    let (decoders, explain) = {
        let fleet = router.fleet();
        let decoders: Vec<EndpointId> = plan
            .decision
            .ranking
            .iter()
            .copied()
            .filter(|e| fleet.endpoint(*e).is_some_and(|s| s.spec.role.decodes()))
            .collect();
        let explain = decoders
            .first()
            .and_then(|d| fleet.plan_disagg(plan, *d, prompt_tokens, block_size, now));
        (decoders, explain)
    };
    let metrics = &router.metrics().pd;
    if decoders.is_empty() {
        // Only prefill endpoints can take it: served whole where the plan says.
        metrics.decision("aggregated", "no_decode_endpoint");
        return Route::Aggregated {
            ranking: plan.decision.ranking.clone(),
        };
    }
    let aggregated = |reason| {
        metrics.decision("aggregated", reason);
        Route::Aggregated {
            ranking: decoders.clone(),
        }
    };
    let Some(explain) = explain else {
        return aggregated("off");
    };
    let always = router.config().pd.mode == crate::config::PdMode::Always;
    match explain.choice {
        _ if explain.disaggregated.is_empty() => {
            metrics.fallback("no_prefill_endpoint");
            aggregated("no_prefill_endpoint")
        }
        DisaggChoice::Aggregated if explain.disaggregated.iter().all(|o| !o.eligible) => {
            metrics.fallback("quarantined");
            aggregated("quarantined")
        }
        // The options are cheapest first, eligible ones before the others.
        DisaggChoice::Aggregated if always => {
            let option = explain.disaggregated.into_iter().next();
            metrics.decision("disaggregated", "always");
            match option {
                Some(option) => Route::Disaggregated { option, decoders },
                None => aggregated("no_prefill_endpoint"),
            }
        }
        DisaggChoice::Aggregated => aggregated("cost"),
        DisaggChoice::Disaggregated { prefill } => {
            let Some(option) = explain
                .disaggregated
                .into_iter()
                .find(|o| o.prefill == prefill)
            else {
                return aggregated("cost");
            };
            metrics.decision("disaggregated", if always { "always" } else { "cost" });
            Route::Disaggregated { option, decoders }
        }
    }
}

/// Serves a planned generation request under `pd.mode` `orchestrate` or `always`.
pub(crate) async fn generate(mut a: ForwardArgs<'_>, plan: Plan) -> Response {
    let router = a.router;
    let client = match remove_client_params(&mut a) {
        Ok(client) => client,
        Err(e) => return crate::reply::error_response(router, &e),
    };
    let block_size = a.prepared.model.block_size;
    let route = decide(router, &plan, a.prepared.prompt_tokens, block_size);
    let (option, decoders) = match route {
        Route::Aggregated { ranking } => {
            a.leg = Leg {
                ranking,
                ..Leg::planned(plan)
            };
            return forward(a).await;
        }
        Route::Disaggregated { option, decoders } => (option, decoders),
    };
    let decode = option.decode;
    let client: &Value = &client;
    let answer = match prefill::run(&a, option.prefill, client, &plan).await {
        Ok(answer) => answer,
        Err(why) => {
            router.metrics().pd.fallback(why.label());
            tracing::warn!(request_id = %a.context.request_id, prefill = %router.endpoint(option.prefill).name, error = %why, "the prefill leg failed; serving the request aggregated on the decode endpoint");
            // The decode endpoint computes the prompt now.
            prefill_sent(router, &plan, decode);
            a.leg = fallback_leg(&plan, decode);
            return forward(a).await;
        }
    };
    let mut body = decode_leg_body(client, &answer.params, answer.cached_tokens);
    if a.strip_usage {
        // Asked for on the router's account, as on the aggregated body (`proxy::generate`).
        ask_stream_usage(&mut body);
    }
    let aggregated_body = std::mem::replace(
        &mut a.body,
        Bytes::from(serde_json::to_vec(&body).unwrap_or_default()),
    );
    // A second decode-capable endpoint to retry on, if the producer still holds the blocks as
    // its answer comes (core's `Fleet::decode_leg_failed` then decides between a pull and the
    // aggregated body); a hold already over leaves the decode pick alone, with no retry.
    let lease_until = lease_expiry_unix_s(&answer.params);
    let ranking = if lease_holds(lease_until) {
        decoders.iter().copied().take(2).collect()
    } else {
        vec![decode]
    };
    a.leg = Leg {
        ranking,
        predicted_cached: decoders_predicted(&plan, &decoders, a.prepared.prompt_tokens),
        predicted_ttft_s: PredictedTtfts::default(),
        reason: crate::pipeline::PD_DECODE,
    };
    a.decode = Some(DecodeLeg {
        prefill: option.prefill,
        prompt_tokens: a.prepared.prompt_tokens,
        block_size,
        decode_cached: plan
            .decision
            .assessments
            .iter()
            .map(|x| (x.endpoint, x.cached_tokens))
            .collect(),
        // Its wait in the decode queue, the engine step that computes its first token (core's
        // step of a queued request, `scheduler.queue_wait_s`), and the leg's fixed cost.
        predicted_wait_s: option.decode_queue_s
            + router.fleet().profile().queue_wait_s
            + option.leg_overhead_s,
        stream: client.get("stream").and_then(Value::as_bool) == Some(true),
        lease_until,
        aggregated_body,
        plan,
    });
    forward(a).await
}

/// `kvroute epp`'s header mode, for llm-d's P/D sidecar: the endpoints to name as the
/// destination (decode-capable, best first) and, when core chooses P/D, the prefill endpoint
/// whose `host:port` goes in `x-prefiller-host-port`: always an endpoint of the fleet, never
/// anything a request says. The sidecar runs the prefill unseen, so it is recorded as a peer's
/// dispatch there (the blocks it will hold, no in-flight load).
#[cfg(feature = "epp")]
pub(crate) fn header_mode(
    router: &Router,
    prepared: &crate::pipeline::Prepared,
    plan: Plan,
) -> (Leg, Option<EndpointId>) {
    if !router.config().pd.orchestrates() {
        return (Leg::planned(plan), None);
    }
    let block_size = prepared.model.block_size;
    match decide(router, &plan, prepared.prompt_tokens, block_size) {
        Route::Aggregated { ranking } => (
            Leg {
                ranking,
                ..Leg::planned(plan)
            },
            None,
        ),
        Route::Disaggregated { option, decoders } => {
            prefill_sent(router, &plan, option.prefill);
            let now = router.now();
            router
                .fleet()
                .peer_dispatched(&prepared.features(), option.prefill, false, now);
            let leg = Leg {
                predicted_cached: decoders_predicted(&plan, &decoders, prepared.prompt_tokens),
                predicted_ttft_s: PredictedTtfts::default(),
                ranking: decoders,
                reason: crate::pipeline::PD_DECODE,
            };
            (leg, Some(option.prefill))
        }
    }
}

/// `plan`'s cached-token predictions for a decode leg: the decode endpoints compute (almost)
/// nothing, they pull what they lack, so each is expected to report the whole prompt.
fn decoders_predicted(plan: &Plan, decoders: &[EndpointId], prompt_tokens: usize) -> Vec<usize> {
    let mut predicted_cached = plan.predicted_cached.clone();
    for e in decoders {
        if let Some(slot) = predicted_cached.get_mut(e.0 as usize) {
            *slot = prompt_tokens;
        }
    }
    predicted_cached
}

/// A client's generation body under P/D, checked for `kv_transfer_params`.
pub(crate) enum ClientBody<'b> {
    /// It names none: the body goes on as it is.
    Clean(&'b Value),
    /// It named some: the body without them, to send instead (counted and logged).
    Stripped(Value),
}

/// Removes `kv_transfer_params` a client put in its body
/// ([`kvroute_vllm::nixl::without_client_params`]): with P/D on, only the router names a
/// producer, so a request can never make an engine pull from (connect to) an address outside
/// the fleet. `kvroute serve` and `kvroute epp` both check here; the caller that sends the
/// stripped body counts it ([`client_params_removed`]), so that a request refused instead is
/// not counted as stripped. Read from the body parsed once in `prepare` (escaped key spellings
/// such as `kv_transfer\u005fparams` are the same key there); a body that did not read exactly
/// (lone surrogate escapes) cannot be checked and rewritten, and is refused (400) rather than
/// passed on unchecked.
pub(crate) fn without_client_params(
    prepared: &crate::pipeline::Prepared,
) -> Result<ClientBody<'_>, ApiError> {
    let Some(body) = prepared.body_json.as_ref() else {
        return Err(ApiError::new(
            400,
            "the request body is not JSON kvroute can read exactly, so its kv_transfer_params cannot be checked (pd.mode is on)",
        ));
    };
    Ok(match kvroute_vllm::nixl::without_client_params(body) {
        Some(stripped) => ClientBody::Stripped(stripped),
        None => ClientBody::Clean(body),
    })
}

/// Counts (`kvroute_pd_client_params_removed_total`) and logs a request whose client
/// `kv_transfer_params` were removed and whose body goes on without them.
pub(crate) fn client_params_removed(router: &Router, request_id: &str) {
    router.metrics().pd.client_params_removed.inc();
    tracing::warn!(
        request_id,
        "removed the kv_transfer_params a client sent: under pd.mode the router alone names a producer"
    );
}

/// [`without_client_params`] for `serve`'s request: the body to forward is replaced when they
/// were removed. Returns the client's body, without the key.
fn remove_client_params<'b>(a: &mut ForwardArgs<'b>) -> Result<Cow<'b, Value>, ApiError> {
    match without_client_params(a.prepared)? {
        ClientBody::Clean(body) => Ok(Cow::Borrowed(body)),
        ClientBody::Stripped(body) => {
            let encoded = serde_json::to_vec(&body)
                .map_err(|e| ApiError::new(500, format!("re-encoding the request body: {e}")))?;
            // The router's own ask for the stream's usage, if it made one, goes on too.
            let encoded = if a.strip_usage {
                request_stream_usage(&encoded).unwrap_or(encoded)
            } else {
                encoded
            };
            client_params_removed(a.router, &a.context.request_id);
            // The aggregated leg sends the body as it is.
            a.body = Bytes::from(encoded);
            Ok(Cow::Owned(body))
        }
    }
}

/// The prefill of `plan`'s request was sent to `endpoint` (the endpoint that computes it,
/// whatever core chose): its work counts there.
pub(super) fn prefill_sent(router: &Router, plan: &Plan, endpoint: EndpointId) {
    let now = router.now();
    router.fleet().prefill_sent(plan, endpoint, now);
}

/// The one aggregated attempt on the decode pick after a failed prefill leg.
fn fallback_leg(plan: &Plan, decode: EndpointId) -> Leg {
    Leg {
        ranking: vec![decode],
        predicted_cached: plan.predicted_cached.clone(),
        // Planned before the prefill leg that failed: no prediction of this attempt's wait.
        predicted_ttft_s: PredictedTtfts::default(),
        reason: "pd_fallback",
    }
}
