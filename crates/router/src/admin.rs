//! The router's own endpoints: `/health` and `/v1/models` (aggregated) on the API listener;
//! `/metrics` and `/kvroute/v1/explain` on the admin listener, behind its bearer token when one
//! is configured; and the OpenAI-shaped answers to unknown paths and methods.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::StreamExt;
use http_body_util::{BodyExt, Full, Limited};
use kvroute_core::event::Tier;
use kvroute_vllm::openai::{ApiError, GenerationRequest, Input};
use serde_json::{Value, json};
use tracing::debug;

use crate::edge::read_body;
use crate::metrics::{KindLabel, TierLabel};
use crate::pipeline::{Api, parse, prepare_request};
use crate::reply::error_response;
use crate::service::Router;

/// Largest `/v1/models` answer read from an engine.
const MAX_MODELS_BYTES: usize = 4 << 20;

/// Most time `/v1/models` waits for the endpoints' own listings, all together.
pub const MODELS_TIMEOUT: Duration = Duration::from_secs(2);

/// Most endpoints asked for their models at once.
const MODELS_PARALLEL: usize = 32;

/// Any path the router does not serve: OpenAI's 404.
pub async fn not_found(State(router): State<Arc<Router>>, request: Request) -> Response {
    error_response(
        &router,
        &ApiError::not_found(format!(
            "Invalid URL ({} {})",
            request.method(),
            request.uri().path()
        )),
    )
}

/// A served path with another method: OpenAI-shaped 405.
pub async fn method_not_allowed(State(router): State<Arc<Router>>, request: Request) -> Response {
    error_response(
        &router,
        &ApiError::new(
            405,
            format!(
                "Method {} not allowed on {}",
                request.method(),
                request.uri().path()
            ),
        ),
    )
}

/// Admin requests must carry `Authorization: Bearer <admin.token>` when a token is configured.
pub async fn require_token(
    State(router): State<Arc<Router>>,
    request: Request,
    next: Next,
) -> Response {
    let Some(token) = &router.config().admin.token else {
        return next.run(request).await;
    };
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or_default();
    if constant_time_eq(presented.as_bytes(), token.as_bytes()) {
        return next.run(request).await;
    }
    let mut response = error_response(
        &router,
        &ApiError::new(
            401,
            "admin endpoints need Authorization: Bearer <admin.token>",
        ),
    );
    response
        .headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    response
}

/// Compares without an early exit, so that timing does not reveal a matching prefix.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// `GET /health`: 200 while some endpoint is healthy and the router is not draining.
pub async fn health(State(router): State<Arc<Router>>) -> StatusCode {
    if router.live() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

/// `GET /metrics`: the router's metrics, with per-endpoint gauges refreshed.
pub async fn metrics(State(router): State<Arc<Router>>) -> Response {
    refresh_gauges(&router);
    router
        .metrics()
        .tiers
        .refresh(&router.fleet(), &|id| router.endpoint(id).name.clone());
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        router.metrics().render(),
    )
        .into_response()
}

fn refresh_gauges(router: &Router) {
    let m = router.metrics();
    m.token_cache_bytes
        .set(router.token_cache().weight() as i64);
    let now = router.now();
    let fleet = router.fleet();
    m.flow_queue_requests.set(fleet.flow().len() as i64);
    m.flow_queue_bytes.set(fleet.flow().bytes() as i64);
    let endpoints = router.endpoints();
    for (e, state) in endpoints
        .iter()
        .zip(fleet.endpoints())
        .filter(|(_, state)| state.present())
    {
        let l = &e.name;
        m.endpoint_healthy.of(l).set(i64::from(state.healthy()));
        m.endpoint_index_trusted
            .of(l)
            .set(i64::from(fleet.trust(e.id, now).is_ok()));
        m.endpoint_inflight.of(l).set(i64::from(state.inflight()));
        if let Some(stats) = fleet.index_of(e.id).and_then(|i| i.endpoint_stats(e.id)) {
            m.index_cpu_capacity_blocks
                .of(l)
                .set(stats.cpu_blocks_when_full as i64);
            for (tier, value) in [
                (Tier::Gpu, stats.blocks_gpu),
                (Tier::Cpu, stats.blocks_cpu),
                (Tier::Storage, stats.blocks_storage),
            ] {
                let name = format!("{tier:?}").to_lowercase();
                m.index_blocks
                    .get_or_create(l, TierLabel { tier: name })
                    .set(value as i64);
            }
            for (kind, value) in [
                ("orphan_blocks", stats.orphan_blocks),
                ("ignored_group_blocks", stats.ignored_group_blocks),
                ("unnamed_lora_blocks", stats.unnamed_lora_blocks),
            ] {
                m.events
                    .get_or_create(l, KindLabel { kind })
                    .set(value as i64);
            }
        }
        if let Some(sub) = e.subscriber.lock().as_ref() {
            for (_, feed) in sub.stats() {
                for (kind, value) in [
                    ("connected", u64::from(feed.connected)),
                    ("batches", feed.batches),
                    ("gaps", feed.gaps),
                    ("replays", feed.replays),
                    ("replayed_batches", feed.replayed_batches),
                    ("tail_checks", feed.tail_checks),
                    ("unfilled_gaps", feed.unfilled_gaps),
                    ("restarts", feed.restarts),
                    ("decode_errors", feed.decode_errors),
                    ("framing_errors", feed.framing_errors),
                    ("bad_frame_count", feed.bad_frame_count),
                    ("bad_sequence_length", feed.bad_sequence_length),
                    ("topic_mismatches", feed.topic_mismatches),
                    ("protocol_errors", feed.protocol_errors),
                    ("oversized_messages", feed.oversized_messages),
                    ("unknown_events", feed.unknown_events),
                ] {
                    m.events
                        .get_or_create(l, KindLabel { kind })
                        .set(value as i64);
                }
            }
        }
        if let Some(age) = fleet.events_age(e.id, now) {
            m.events_age_seconds.of(l).set(age);
        }
    }
}

/// `GET /v1/models`: the models every healthy endpoint lists (asked in parallel, at most
/// [`MODELS_PARALLEL`] at once, the whole listing within [`MODELS_TIMEOUT`]: an endpoint that
/// has not answered by then is left out), or the configured ones when none answers.
pub async fn models(State(router): State<Arc<Router>>) -> Response {
    let healthy: Vec<_> = router
        .endpoints()
        .iter()
        .filter(|e| router.healthy(e.id))
        .cloned()
        .collect();
    let asked = healthy.len();
    let mut lists: Vec<(usize, Value)> = Vec::new();
    let answers = futures::stream::iter(healthy.into_iter().enumerate())
        .map(|(i, e)| {
            let router = router.clone();
            async move { (i, endpoint_models(&router, e.authority.as_str()).await) }
        })
        .buffer_unordered(MODELS_PARALLEL)
        .take_until(tokio::time::sleep(MODELS_TIMEOUT));
    let mut answers = std::pin::pin!(answers);
    while let Some((i, list)) = answers.next().await {
        lists.extend(list.map(|l| (i, l)));
    }
    if lists.len() < asked {
        debug!(
            answered = lists.len(),
            asked, "some endpoints did not list their models in time"
        );
    }
    // In endpoint order, whichever answered first.
    lists.sort_by_key(|(i, _)| *i);
    let mut data: Vec<Value> = Vec::new();
    for (_, list) in &lists {
        for card in list["data"].as_array().into_iter().flatten() {
            if !data.iter().any(|c| c["id"] == card["id"]) {
                data.push(card.clone());
            }
        }
    }
    if data.is_empty() {
        // No endpoint answered: list what the router is configured to serve.
        for m in &router.config().models {
            data.push(json!({"id": m.name, "object": "model", "owned_by": "kvroute"}));
        }
    }
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

/// One endpoint's `/v1/models` answer, headers and body within [`MODELS_TIMEOUT`].
async fn endpoint_models(router: &Router, authority: &str) -> Option<Value> {
    let request = http::Request::get(format!("http://{authority}/v1/models"))
        .body(Full::new(Bytes::new()))
        .expect("static request");
    let read = async {
        let response = router.client().request(request).await.ok()?;
        let body = Limited::new(response.into_body(), MAX_MODELS_BYTES)
            .collect()
            .await
            .ok()?;
        serde_json::from_slice::<Value>(&body.to_bytes()).ok()
    };
    tokio::time::timeout(MODELS_TIMEOUT, read)
        .await
        .ok()
        .flatten()
}

/// `POST /kvroute/v1/explain`: the decision for a request body, without forwarding it.
pub async fn explain(State(router): State<Arc<Router>>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let body = match read_body(&router, body).await {
        Ok(b) => b,
        Err(e) => return error_response(&router, &e),
    };
    let parsed = match parse_explain(&body) {
        Ok(p) => p,
        Err(e) => return error_response(&router, &e),
    };
    let session = parts
        .headers
        .get(router.config().scheduler.session_header.as_str())
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let Some(prepared) = prepare_request(&router, &parsed, body.len(), session).await else {
        return error_response(
            &router,
            &crate::pipeline::unserved_model(&router, parsed.model.as_deref()),
        );
    };
    let plan = router.plan_every(&prepared.features());
    let name = |id: kvroute_core::index::EndpointId| router.endpoint(id).name.clone();
    let endpoints: Vec<Value> = plan
        .decision
        .assessments
        .iter()
        .zip(&plan.facts)
        .zip(&plan.predicted_cached)
        .zip(&plan.predicted_tiers)
        .map(|(((a, facts), predicted), predicted_tiers)| {
            json!({
                "endpoint": name(facts.endpoint),
                "healthy": facts.healthy,
                "ejected_for_s": facts.ejected_until.map(|until| until - router.now()),
                "index_trusted": facts.index_distrust.is_none(),
                "index_distrust": facts.index_distrust,
                "matched_blocks": {
                    "index": facts.index_match.map(|m| json!({"total": m.blocks, "gpu": m.gpu_blocks, "cpu": m.cpu_blocks, "storage": m.storage_blocks, "shared": m.shared_blocks})),
                    "history": facts.history_blocks,
                    "predicted": facts.predicted_blocks,
                },
                "cached_tokens": a.cached_tokens,
                "predicted_cached_tokens": predicted,
                "tiers": tiers_explained(a, facts.index_match.as_ref(), predicted_tiers),
                "tier_uncertain": a.tier_uncertain,
                "load": facts.load,
                "prefill_tokens_per_s": facts.prefill_tokens_per_s,
                "rejected": a.rejected,
                "saturated": a.saturated,
                "cost": a.cost,
                "predicted_ttft_s": a.predicted_ttft_s,
            })
        })
        .collect();
    axum::Json(json!({
        "model": prepared.model_name,
        "prompt_tokens": prepared.prompt_tokens,
        "block_size": prepared.model.block_size,
        "blocks": prepared.keys.len(),
        "policy": router.config().scheduler.policy,
        "chosen": plan.decision.chosen().map(name),
        "reason": plan.decision.reason,
        "saturated": plan.decision.saturated,
        "ranking": plan.decision.ranking.iter().map(|id| name(*id)).collect::<Vec<_>>(),
        "copy_rent": plan.decision.copy.map(|c| json!({
            "shared_tokens": c.shared_tokens,
            "rent_s": c.rent_s,
            "paid_s": c.paid_s,
            "bought": c.bought.map(|(at, credit_s)| json!({"endpoint": name(at), "credit_s": credit_s})),
        })),
        "endpoints": endpoints,
        "pd": crate::pd::explain(&router, &prepared, &plan),
    }))
    .into_response()
}

/// One candidate's tiers below the GPU, for `explain`: per tier, the matched blocks, the
/// tokens predicted cached there, the tokens other loads queued ahead on its bandwidth (the
/// shared filesystem's), the seconds charged to load them against the seconds to
/// recompute them, and whether the tier is credited (`no_credit_reason` says why not); and a
/// warning when the tier picture is uncertain.
fn tiers_explained(
    a: &kvroute_core::schedule::Assessment,
    index_match: Option<&kvroute_core::index::PrefixMatch>,
    predicted_tiers: &kvroute_core::tiers::TierTokens,
) -> Value {
    use kvroute_core::tiers::LoadTier;
    let mut out = serde_json::Map::new();
    for tier in LoadTier::ALL {
        let charge = &a.cost.tiers.tiers[tier as usize];
        let blocks = index_match.map_or(0, |m| match tier {
            LoadTier::Cpu => m.cpu_blocks,
            LoadTier::Storage => m.storage_blocks,
            LoadTier::Shared => m.shared_blocks,
        });
        let no_credit = if charge.slower_than_recompute {
            Some("loading is slower than recomputing: charged its load time, no credit")
        } else {
            None
        };
        out.insert(
            tier.as_str().to_owned(),
            json!({
                "matched_blocks": blocks,
                "tokens": charge.tokens,
                "predicted_cached_tokens": predicted_tiers[tier as usize],
                "tokens_per_s": charge.tokens_per_s,
                "queued_tokens": charge.queued_tokens,
                "load_s": charge.seconds,
                "recompute_s": charge.recompute_s,
                "credited": charge.tokens > 0 && !charge.slower_than_recompute,
                "weighted": charge.weighted,
                "no_credit_reason": no_credit,
            }),
        );
    }
    if a.tier_uncertain {
        out.insert(
            "warning".to_owned(),
            json!("the endpoint's offloaded-tier events were recently inconsistent (orphans): its blocks below the GPU are an estimate, not a certain prediction"),
        );
    }
    Value::Object(out)
}

/// A normal completions or chat body, or `{"model"?, "token_ids": [...]}`.
fn parse_explain(body: &[u8]) -> Result<GenerationRequest, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("request body is not valid JSON: {e}"), None))?;
    if let Some(ids) = value.get("token_ids") {
        let tokens = ids
            .as_array()
            .and_then(|a| {
                a.iter()
                    .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                    .collect::<Option<Vec<u32>>>()
            })
            .ok_or_else(|| {
                ApiError::bad_request("token_ids must be a list of token ids", Some("token_ids"))
            })?;
        let model = value
            .get("model")
            .and_then(Value::as_str)
            .map(str::to_owned);
        return Ok(GenerationRequest {
            model,
            input: Input::Tokens(tokens),
            max_tokens: None,
            stream: false,
            include_usage: false,
            stream_options_given: false,
            cache_salt: value
                .get("cache_salt")
                .and_then(Value::as_str)
                .map(str::to_owned),
        });
    }
    let api = if value.get("messages").is_some() {
        Api::Chat
    } else {
        Api::Completions
    };
    parse(api, body)
}
