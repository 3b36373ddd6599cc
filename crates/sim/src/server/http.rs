//! The HTTP surface of one simulated engine: vLLM's OpenAI endpoints, tokenization, health,
//! metrics, cache reset, and the simulator's own fault-injection endpoints.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::StreamExt;
use kvroute_vllm::openai::{ApiError, GenerationRequest, Input, parse_chat, parse_completion};
use kvroute_vllm::tokenizer::BuiltinTokenizer;
use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::UnboundedReceiverStream;

use super::actor::{Command, Delivery, EngineShared, Submission};
use super::faults::Faults;
use super::metrics;
use super::pd::PdEngine;
use super::pd::legs::{self, Leg, PullError};
use super::text::{completion_seed, synthetic_completion};
use crate::engine::{EngineConfig, EngineRequest, HeldBlocks, KvTransfer};
use kvroute_vllm::nixl::KvLoadFailurePolicy;

/// Default `max_tokens` for completions (vLLM's) and the cap used for chat when unset.
const DEFAULT_COMPLETION_TOKENS: u32 = 16;
const DEFAULT_CHAT_TOKENS: u32 = 512;

/// How the simulated engine tokenizes.
#[derive(Clone)]
pub enum SimTokenizer {
    /// kvroute's built-in tokenizer.
    Builtin,
    /// A HuggingFace tokenizer and chat template.
    Hf(Arc<kvroute_vllm::tokenizer::HfTokenizer>),
}

impl SimTokenizer {
    fn prompt(&self, input: &Input) -> Result<Vec<u32>, ApiError> {
        let bad = |e: kvroute_vllm::VllmError| ApiError::bad_request(e.to_string(), None);
        Ok(match (self, input) {
            (_, Input::Tokens(t)) => t.clone(),
            (SimTokenizer::Builtin, Input::Text(t)) => BuiltinTokenizer.encode(t),
            (SimTokenizer::Builtin, Input::Chat(chat)) => {
                BuiltinTokenizer.encode(&BuiltinTokenizer.render_chat(chat))
            }
            (SimTokenizer::Hf(hf), Input::Text(t)) => hf.encode(t, true).map_err(bad)?,
            (SimTokenizer::Hf(hf), Input::Chat(chat)) => hf.encode_chat(chat).map_err(bad)?,
        })
    }

    fn decode(&self, tokens: &[u32]) -> String {
        match self {
            SimTokenizer::Builtin => BuiltinTokenizer.decode(tokens),
            SimTokenizer::Hf(hf) => hf.decode(tokens).unwrap_or_default(),
        }
    }

    /// Output tokens valid for this tokenizer.
    fn completion(&self, seed: u64, max_tokens: usize) -> Vec<u32> {
        let builtin = synthetic_completion(seed, max_tokens);
        match self {
            SimTokenizer::Builtin => builtin,
            SimTokenizer::Hf(hf) => {
                let mut ids = hf
                    .encode(&BuiltinTokenizer.decode(&builtin), false)
                    .unwrap_or_default();
                ids.truncate(max_tokens);
                while ids.len() < max_tokens {
                    ids.push(ids.last().copied().unwrap_or(0));
                }
                ids
            }
        }
    }
}

/// Everything a handler needs about its engine.
pub struct EngineHttp {
    /// Served model name.
    pub model: String,
    /// LoRA adapters served besides the base model.
    pub lora_modules: Vec<String>,
    /// Index of the engine in the fleet (the `engine` metric label).
    pub index: usize,
    /// The engine's settings.
    pub config: EngineConfig,
    /// Commands to the engine task.
    pub commands: mpsc::UnboundedSender<Command>,
    /// Metrics and faults.
    pub shared: Arc<EngineShared>,
    /// Request id counter.
    pub next_id: AtomicU64,
    /// The tokenizer.
    pub tokenizer: SimTokenizer,
    /// P/D state (`None`: no KV connector).
    pub pd: Option<Arc<PdEngine>>,
}

type AppState = Arc<EngineHttp>;

/// The router of one engine's HTTP server.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/sim/faults", get(get_faults).post(set_faults))
        .route("/sim/restart", post(restart))
        .with_state(state)
}

fn error_response(e: &ApiError) -> Response {
    e.to_response().map(axum::body::Body::from)
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs()
}

#[derive(Clone, Copy, PartialEq)]
enum Api {
    Completions,
    Chat,
}

async fn completions(State(state): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    generate(state, headers, body, Api::Completions).await
}

async fn chat_completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    generate(state, headers, body, Api::Chat).await
}

/// Validates a request and turns it into prompt tokens, adapter and output length.
fn prepare(
    state: &EngineHttp,
    body: &[u8],
    api: Api,
) -> Result<(GenerationRequest, Vec<u32>, Option<String>, u32), ApiError> {
    let faults = state.shared.faults.lock().clone();
    if !faults.healthy {
        return Err(ApiError::unavailable("the engine is unhealthy"));
    }
    if faults.error_fraction > 0.0 && rand::random_bool(faults.error_fraction.clamp(0.0, 1.0)) {
        return Err(ApiError::new(faults.error_status, "an injected fault"));
    }
    let request = match api {
        Api::Completions => parse_completion(body)?,
        Api::Chat => parse_chat(body)?,
    };
    // A request naming no model is served by the engine's own, as vLLM serves it.
    let named = request.model.clone().unwrap_or_else(|| state.model.clone());
    let lora = if named == state.model {
        None
    } else if state.lora_modules.contains(&named) {
        Some(named.clone())
    } else {
        return Err(ApiError::not_found(format!(
            "The model `{named}` does not exist."
        )));
    };
    let prompt = state.tokenizer.prompt(&request.input)?;
    if prompt.is_empty() {
        return Err(ApiError::bad_request("the prompt is empty", Some("prompt")));
    }
    let max_len = state.config.max_model_len;
    let default = match api {
        Api::Completions => DEFAULT_COMPLETION_TOKENS,
        Api::Chat => DEFAULT_CHAT_TOKENS.min(max_len.saturating_sub(prompt.len()).max(1) as u32),
    };
    let max_tokens = request.max_tokens.unwrap_or(default);
    // vLLM answers a prompt beyond the context with 400 BadRequestError, not 413.
    if prompt.len() + max_tokens as usize > max_len {
        return Err(ApiError::bad_request(
            format!(
                "This model's maximum context length is {max_len} tokens. However, you requested {} tokens ({} in the messages, {max_tokens} in the completion).",
                prompt.len() + max_tokens as usize,
                prompt.len()
            ),
            None,
        ));
    }
    Ok((request, prompt, lora, max_tokens))
}

async fn generate(state: AppState, headers: HeaderMap, body: Bytes, api: Api) -> Response {
    let (request, prompt, lora, max_tokens) = match prepare(&state, &body, api) {
        Ok(ok) => ok,
        Err(e) => return error_response(&e),
    };
    let leg = match legs::classify(state.pd.as_deref(), &body) {
        Ok(leg) => leg,
        Err(e) => return error_response(&e),
    };
    let id = state.next_id.fetch_add(1, Ordering::Relaxed);
    let seed = completion_seed(id, &prompt);
    let output = state.tokenizer.completion(seed, max_tokens as usize);
    let (tx, rx) = mpsc::unbounded_channel();
    let engine_request = EngineRequest {
        id,
        prompt,
        output,
        lora_name: lora.clone(),
        cache_salt: request.cache_salt.clone(),
    };
    let request_id = headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .unwrap_or_else(|| format!("{id}"));
    let mut reply = Reply {
        tokenizer: state.tokenizer.clone(),
        api,
        id: match api {
            Api::Completions => format!("cmpl-{request_id}"),
            Api::Chat => format!("chatcmpl-{request_id}"),
        },
        // Served as the adapter it names, else as the engine's own model.
        model: lora.unwrap_or_else(|| state.model.clone()),
        created: now_secs(),
        producer: None,
        cached_override: None,
    };
    let (transfer, lease_name) = match (leg, &state.pd) {
        (Leg::Prefill, Some(pd)) => {
            reply.producer = Some((pd.clone(), state.shared.clone()));
            (KvTransfer::Produce, Some(reply.id.clone()))
        }
        (Leg::Decode(params), Some(pd)) => {
            if pd.release.reports_remote_cached_tokens() {
                reply.cached_override = params.remote_prefill_cached_tokens.map(|t| t as usize);
            }
            let faults = state.shared.faults.lock().clone();
            match legs::pull(
                pd,
                &state.commands,
                &faults,
                &engine_request,
                &params,
                &reply.id,
            )
            .await
            {
                Ok(transfer) => (transfer, None),
                Err(PullError::Invalid(e)) => {
                    return error_response(&ApiError::bad_request(e, Some("kv_transfer_params")));
                }
                Err(PullError::Failed(e)) => match pd.load_failure_policy {
                    KvLoadFailurePolicy::Recompute => {
                        tracing::warn!(request = %reply.id, error = %e, "KV pull failed: recomputing the prompt (kv_load_failure_policy=recompute)");
                        (KvTransfer::None, None)
                    }
                    KvLoadFailurePolicy::Fail => {
                        return transfer_failed(&e, request.stream);
                    }
                },
            }
        }
        _ => (KvTransfer::None, None),
    };
    let submission = Submission {
        request: engine_request,
        transfer,
        lease_name,
    };
    if state
        .commands
        .send(Command::Submit(submission, tx))
        .is_err()
    {
        return error_response(&ApiError::unavailable("the engine stopped"));
    }
    let guard = AbortOnDrop {
        id,
        commands: state.commands.clone(),
        armed: true,
    };
    let mut response = if request.stream {
        stream_response(reply, rx, request.include_usage, guard)
    } else {
        collect_response(reply, rx, guard).await
    };
    if let Ok(value) = HeaderValue::from_str(&request_id) {
        response.headers_mut().insert("x-request-id", value);
    }
    response
}

/// Aborts the engine request if the HTTP side goes away before it finished.
struct AbortOnDrop {
    id: u64,
    commands: mpsc::UnboundedSender<Command>,
    armed: bool,
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.commands.send(Command::Abort(self.id));
        }
    }
}

/// A decode leg whose pull failed under `kv_load_failure_policy=fail`. A streamed request
/// gets its 200 and the error as an event, as a client of a streaming vLLM sees it; a plain
/// one gets a 500.
fn transfer_failed(reason: &str, stream: bool) -> Response {
    let error = ApiError::new(500, format!("KV transfer failed: {reason}"));
    if !stream {
        return error_response(&error);
    }
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .body(Body::from(format!(
            "data: {}\n\ndata: [DONE]\n\n",
            error.to_json()
        )))
        .expect("static response parts are valid")
}

struct Reply {
    tokenizer: SimTokenizer,
    api: Api,
    id: String,
    model: String,
    created: u64,
    /// A prefill leg: the engine whose `kv_transfer_params` to return.
    producer: Option<(Arc<PdEngine>, Arc<EngineShared>)>,
    /// 0.33's `remote_prefill_cached_tokens`: reported as `cached_tokens`.
    cached_override: Option<usize>,
}

impl Reply {
    /// The `kv_transfer_params` of a prefill leg's held blocks.
    fn producer_params(&self, held: &HeldBlocks, prompt_tokens: usize) -> Option<Value> {
        let (pd, shared) = self.producer.as_ref()?;
        let (lease, generation) = {
            let leases = shared.leases.lock();
            (leases.duration(), leases.generation())
        };
        Some(legs::producer_params(
            pd,
            held,
            &self.id,
            prompt_tokens,
            lease,
            generation,
        ))
    }

    /// Whether a streamed answer carries the params on its final chunk (0.33+).
    fn streams_params(&self) -> bool {
        self.producer
            .as_ref()
            .is_some_and(|(pd, _)| pd.release.streams_params())
    }

    fn cached(&self, engine_cached: usize) -> usize {
        self.cached_override.unwrap_or(engine_cached)
    }

    fn usage(prompt: usize, completion: usize, cached: usize) -> Value {
        json!({
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        })
    }

    fn full(&self, text: &str, usage: Value) -> Value {
        let choice = match self.api {
            Api::Completions => {
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": "length", "stop_reason": null})
            }
            Api::Chat => {
                json!({"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": "length", "stop_reason": null})
            }
        };
        let object = match self.api {
            Api::Completions => "text_completion",
            Api::Chat => "chat.completion",
        };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": [choice], "usage": usage})
    }

    fn chunk(&self, text: &str, finish: bool) -> Value {
        let finish_reason = if finish { json!("length") } else { Value::Null };
        match self.api {
            Api::Completions => {
                json!({"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish_reason}]})
            }
            Api::Chat => self.chat_chunk(json!({"content": text}), finish_reason),
        }
    }

    /// The chunk vLLM's chat stream opens with, when its first token is ready: the role, with
    /// empty content (the token comes in the next chunk). Completions have none.
    fn role_chunk(&self) -> Option<Value> {
        (self.api == Api::Chat)
            .then(|| self.chat_chunk(json!({"role": "assistant", "content": ""}), Value::Null))
    }

    fn chat_chunk(&self, delta: Value, finish_reason: Value) -> Value {
        json!({"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish_reason}]})
    }

    fn usage_chunk(&self, usage: Value) -> Value {
        let object = match self.api {
            Api::Completions => "text_completion",
            Api::Chat => "chat.completion.chunk",
        };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": [], "usage": usage})
    }
}

async fn collect_response(
    reply: Reply,
    mut rx: mpsc::UnboundedReceiver<Delivery>,
    mut guard: AbortOnDrop,
) -> Response {
    let mut tokens = Vec::new();
    let (mut prompt, mut cached) = (0, 0);
    let mut held = None;
    while let Some(delivery) = rx.recv().await {
        match delivery {
            Delivery::Held(h) => held = Some(h),
            Delivery::Token(t) => {
                prompt = t.prompt_tokens;
                cached = t.cached_tokens;
                tokens.push(t.token);
                if t.finished.is_some() {
                    break;
                }
            }
            Delivery::Aborted(reason) => {
                guard.armed = false;
                return error_response(&ApiError::new(
                    if reason.contains("context length") {
                        400
                    } else {
                        503
                    },
                    reason,
                ));
            }
        }
    }
    guard.armed = false;
    let text = reply.tokenizer.decode(&tokens);
    let mut body = reply.full(
        &text,
        Reply::usage(prompt, tokens.len(), reply.cached(cached)),
    );
    if let Some(params) = held.and_then(|h| reply.producer_params(&h, prompt)) {
        body["kv_transfer_params"] = params;
    }
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

fn sse(value: &Value) -> Bytes {
    Bytes::from(format!("data: {value}\n\n"))
}

fn stream_response(
    reply: Reply,
    rx: mpsc::UnboundedReceiver<Delivery>,
    include_usage: bool,
    guard: AbortOnDrop,
) -> Response {
    let mut count = 0usize;
    let mut guard = Some(guard);
    let mut held: Option<HeldBlocks> = None;
    // The stream ends when the engine task drops its sender after the last token.
    let stream = UnboundedReceiverStream::new(rx).flat_map(move |delivery| {
        let mut out: Vec<Bytes> = Vec::new();
        match delivery {
            Delivery::Held(h) => held = Some(h),
            Delivery::Token(t) => {
                let finished = t.finished.is_some();
                if count == 0 {
                    out.extend(reply.role_chunk().as_ref().map(sse));
                }
                let mut chunk = reply.chunk(&reply.tokenizer.decode(&[t.token]), finished);
                if finished
                    && reply.streams_params()
                    && let Some(params) = held
                        .take()
                        .and_then(|h| reply.producer_params(&h, t.prompt_tokens))
                {
                    chunk["kv_transfer_params"] = params;
                }
                out.push(sse(&chunk));
                count += 1;
                if finished {
                    if include_usage {
                        out.push(sse(&reply.usage_chunk(Reply::usage(
                            t.prompt_tokens,
                            count,
                            reply.cached(t.cached_tokens),
                        ))));
                    }
                    out.push(Bytes::from_static(b"data: [DONE]\n\n"));
                    if let Some(mut g) = guard.take() {
                        g.armed = false;
                    }
                }
            }
            Delivery::Aborted(reason) => {
                let error = ApiError::unavailable(reason);
                out.push(Bytes::from(format!("data: {}\n\n", error.to_json())));
                out.push(Bytes::from_static(b"data: [DONE]\n\n"));
                if let Some(mut g) = guard.take() {
                    g.armed = false;
                }
            }
        }
        futures::stream::iter(out.into_iter().map(Ok::<_, Infallible>))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(stream))
        .expect("static response parts are valid")
}

async fn models(State(state): State<AppState>) -> Response {
    let created = now_secs();
    let mut data = vec![
        json!({"id": state.model, "object": "model", "created": created, "owned_by": "vllm",
        "root": state.model, "parent": null, "max_model_len": state.config.max_model_len, "permission": []}),
    ];
    for lora in &state.lora_modules {
        data.push(
            json!({"id": lora, "object": "model", "created": created, "owned_by": "vllm",
            "root": lora, "parent": state.model, "max_model_len": null, "permission": []}),
        );
    }
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

async fn tokenize(State(state): State<AppState>, body: Bytes) -> Response {
    let value: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => {
            return error_response(&ApiError::bad_request(
                format!("request body is not valid JSON: {e}"),
                None,
            ));
        }
    };
    let input = if let Some(prompt) = value.get("prompt").and_then(Value::as_str) {
        Input::Text(prompt.to_owned())
    } else if value.get("messages").is_some() {
        match kvroute_vllm::openai::chat_input(&value) {
            Ok(chat) => Input::Chat(Box::new(chat)),
            Err(e) => return error_response(&e),
        }
    } else {
        return error_response(&ApiError::bad_request(
            "either prompt or messages is required",
            None,
        ));
    };
    match state.tokenizer.prompt(&input) {
        Ok(tokens) => axum::Json(json!({"count": tokens.len(), "max_model_len": state.config.max_model_len, "tokens": tokens})).into_response(),
        Err(e) => error_response(&e),
    }
}

async fn detokenize(State(state): State<AppState>, body: Bytes) -> Response {
    #[derive(serde::Deserialize)]
    struct Detokenize {
        tokens: Vec<u32>,
    }
    match serde_json::from_slice::<Detokenize>(&body) {
        Ok(d) => axum::Json(json!({"prompt": state.tokenizer.decode(&d.tokens)})).into_response(),
        Err(e) => error_response(&ApiError::bad_request(
            format!("tokens must be a list of token ids: {e}"),
            Some("tokens"),
        )),
    }
}

async fn health(State(state): State<AppState>) -> StatusCode {
    if state.shared.faults.lock().healthy {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

async fn metrics_text(State(state): State<AppState>) -> Response {
    let delay = state.shared.faults.lock().metrics_delay;
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    let mut text = metrics::render(
        &state.shared.observed.lock(),
        &state.config,
        &state.model,
        state.index,
    );
    if let Some(pd) = &state.pd {
        let (held, expired) = {
            let leases = state.shared.leases.lock();
            (leases.len(), leases.expired_total())
        };
        let labels = format!(
            "engine=\"{}\",model_name=\"{}\"",
            state.index,
            metrics::escape(&state.model)
        );
        pd.metrics.lock().render(&mut text, &labels, held, expired);
    }
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

async fn reset_prefix_cache(State(state): State<AppState>) -> Response {
    let (tx, rx) = oneshot::channel();
    if state.commands.send(Command::ResetCache(tx)).is_err() {
        return error_response(&ApiError::unavailable("the engine stopped"));
    }
    match rx.await {
        Ok(true) => StatusCode::OK.into_response(),
        _ => error_response(&ApiError::new(
            409,
            "the prefix cache cannot be reset while requests are running",
        )),
    }
}

async fn get_faults(State(state): State<AppState>) -> Response {
    axum::Json(state.shared.faults.lock().clone()).into_response()
}

/// Merges the given fields into the engine's faults (fields not given keep their value).
async fn set_faults(State(state): State<AppState>, body: Bytes) -> Response {
    let mut faults = state.shared.faults.lock();
    let mut current = serde_json::to_value(&*faults).expect("faults serialize");
    let update: Value = match serde_json::from_slice(&body) {
        Ok(Value::Object(map)) => Value::Object(map),
        _ => {
            return error_response(&ApiError::bad_request(
                "body must be a JSON object of fault settings",
                None,
            ));
        }
    };
    if let (Value::Object(cur), Value::Object(upd)) = (&mut current, update) {
        for (k, v) in upd {
            if !cur.contains_key(&k) {
                return error_response(&ApiError::bad_request(
                    format!("unknown fault setting {k:?}"),
                    Some(&k),
                ));
            }
            cur.insert(k, v);
        }
    }
    match serde_json::from_value::<Faults>(current)
        .map_err(|e| e.to_string())
        .and_then(|new| new.validate().map(|()| new).map_err(|e| e.to_string()))
    {
        Ok(new) => {
            *faults = new.clone();
            axum::Json(new).into_response()
        }
        Err(e) => error_response(&ApiError::bad_request(
            format!("invalid fault settings: {e}"),
            None,
        )),
    }
}

async fn restart(State(state): State<AppState>) -> Response {
    if state.commands.send(Command::Restart).is_err() {
        return error_response(&ApiError::unavailable("the engine stopped"));
    }
    StatusCode::OK.into_response()
}
