//! The **prepare** phase: parse the body once, tokenize, cut into block keys ([`Prepared`]),
//! and plan, on the bounded blocking pool for a large body ([`crate::offload`]).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvroute_core::fleet::{Plan, RequestFeatures};
use kvroute_core::keys::{RouterKey, request_extra_keys, router_keys};
use kvroute_core::schedule::Role;
use kvroute_vllm::openai::{
    ApiError, GenerationRequest, chat_from_json, completion_from_json, parse_chat,
    parse_completion, parse_request_json,
};
use serde_json::Value;
use tokio::time::Instant;

use super::{Refused, RequestContext};
use crate::config::ModelConfig;
use crate::endpoint::Endpoint;
use crate::service::Router;
use crate::tokenize::{Remote, tokenize};

/// Which OpenAI API a request used.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Api {
    /// `/v1/completions`.
    Completions,
    /// `/v1/chat/completions`.
    Chat,
}

/// A request made ready for scheduling.
pub struct Prepared {
    /// The model's configuration.
    pub(crate) model: ModelConfig,
    /// The model (or adapter) name the request used.
    pub(crate) model_name: String,
    /// Router keys of the prompt's full blocks.
    pub(crate) keys: Arc<Vec<RouterKey>>,
    /// Prompt length used for scoring (tokens, or an estimate from the body size).
    pub(crate) prompt_tokens: usize,
    /// The session the request names, if any.
    pub(crate) session: Option<String>,
    /// The body as JSON, read once, when the request may be rewritten into P/D legs
    /// (`pd.mode` on) and it reads exactly (see [`kvroute_vllm::openai::RequestJson`]).
    pub(crate) body_json: Option<Value>,
    /// A stream whose body names no `stream_options`: the router may ask for its usage
    /// (`forwarding.stream_usage`).
    pub(crate) may_ask_usage: bool,
}

impl Prepared {
    /// A request that needs no cache (embeddings, `GET` paths): the first model, no tokens.
    pub(crate) fn uncached(router: &Router) -> Self {
        let model = router.config().models[0].clone();
        Self {
            model_name: model.name.clone(),
            model,
            keys: Arc::default(),
            prompt_tokens: 0,
            session: None,
            body_json: None,
            may_ask_usage: false,
        }
    }

    /// The features core plans with.
    pub fn features(&self) -> RequestFeatures<'_> {
        RequestFeatures {
            model: &self.model_name,
            keys: &self.keys,
            prompt_tokens: self.prompt_tokens,
            block_size: self.model.block_size,
            session: self.session.as_deref(),
            role: Role::Both,
        }
    }
}

/// The engine to ask for a `model` request's tokens (its `/tokenize`, for `tokenizer: remote`):
/// one that serves the model and is available (healthy, not ejected), the first of the fleet's
/// passthrough rotation (from a random endpoint on) that does, so that no one engine answers
/// every call, and an engine of another model never does.
fn tokenizing_endpoint(router: &Router, model: &str) -> Option<Arc<Endpoint>> {
    let now = router.now();
    let id = {
        let mut fleet = router.fleet();
        // The passthrough's rotation: every available endpoint, from a random one on.
        let rotation = fleet.passthrough_rotation(now);
        rotation
            .into_iter()
            .find(|&id| fleet.endpoint(id).is_some_and(|e| e.spec.serves(model)))?
    };
    Some(router.endpoint(id))
}

/// Tokenizes and keys a parsed request (`body_len` bytes; `session` from its headers), or
/// `None` when no configured model serves it.
pub async fn prepare_request(
    router: &Router,
    request: &GenerationRequest,
    body_len: usize,
    session: Option<String>,
) -> Option<Prepared> {
    let (model, lora) = router.requested_model(request.model.as_deref())?;
    // The name the request is served under: its own, or the one model it implies.
    let model_name = request.model.clone().unwrap_or_else(|| model.name.clone());
    let started = Instant::now();
    let kind = router.tokenizer(&model.name);
    // An engine to tokenize with is drawn only for a remote tokenizer (it takes the fleet lock).
    let remote = matches!(kind, crate::tokenize::ModelTokenizer::Remote)
        .then(|| tokenizing_endpoint(router, &model.name))
        .flatten()
        .map(|e| Remote {
            client: router.client(),
            base: format!("http://{}", e.authority),
            timeout: Duration::from_secs(2),
        });
    let tokens = tokenize(
        router.token_cache(),
        &kind,
        &model_name,
        &request.input,
        remote,
    )
    .await;
    router
        .metrics()
        .tokenization_seconds
        .observe(started.elapsed().as_secs_f64());
    let (keys, prompt_tokens) = match &tokens {
        Some(t) => {
            // Keyed (and so planned and recorded under the fleet's lock) up to
            // `limits.max_routed_blocks`: a prompt longer than that is routed by its head.
            let max_tokens = router
                .config()
                .limits
                .max_routed_blocks
                .saturating_mul(model.block_size);
            let routed = &t[..t.len().min(max_tokens)];
            let blocks = routed.len() / model.block_size;
            let extra = request_extra_keys(blocks, lora.as_deref(), request.cache_salt.as_deref());
            let keys = router_keys(routed, model.block_size, Some(&extra)).unwrap_or_default();
            (keys, t.len())
        }
        // No tokens: a rough size for load and cost scoring only.
        None => (Vec::new(), body_len / 4),
    };
    Some(Prepared {
        model,
        model_name,
        session,
        keys: Arc::new(keys),
        prompt_tokens,
        body_json: None,
        may_ask_usage: request.stream && !request.stream_options_given,
    })
}

/// Reads a generation request of either API from its body already parsed.
fn from_json(api: Api, body: &Value) -> Result<GenerationRequest, ApiError> {
    match api {
        Api::Completions => completion_from_json(body),
        Api::Chat => chat_from_json(body),
    }
}

/// Parses a generation request of either API.
pub fn parse(api: Api, body: &[u8]) -> Result<GenerationRequest, ApiError> {
    match api {
        Api::Completions => parse_completion(body),
        Api::Chat => parse_chat(body),
    }
}

/// Parses, tokenizes and plans once; a large body on the blocking pool.
pub(super) async fn prepare_and_plan(
    router: &Arc<Router>,
    api: Api,
    body: &Bytes,
    context: &RequestContext,
) -> Result<(Prepared, Plan), Refused> {
    let session = context.session.clone();
    if !router.offload().wanted(body.len()) {
        return prepare_here(router, api, body, session).await;
    }
    let (shared, body) = (router.clone(), body.clone());
    let runtime = tokio::runtime::Handle::current();
    let work = move || runtime.block_on(prepare_here(&shared, api, &body, session));
    router
        .offload()
        .run(work)
        .await
        .map_err(|_| offload_shed(router))?
}

/// Parses, tokenizes and plans on this thread.
async fn prepare_here(
    router: &Router,
    api: Api,
    body: &[u8],
    session: Option<String>,
) -> Result<(Prepared, Plan), Refused> {
    // Parsed once: under P/D the JSON is kept for the legs' bodies.
    let (parsed, body_json) = if router.config().pd.orchestrates() {
        let json = parse_request_json(body)?;
        let parsed = from_json(api, &json.value)?;
        (parsed, json.exact.then_some(json.value))
    } else {
        (parse(api, body)?, None)
    };
    let Some(mut prepared) = prepare_request(router, &parsed, body.len(), session).await else {
        return Err(unserved_model(router, parsed.model.as_deref()).into());
    };
    prepared.body_json = body_json;
    let plan = router.plan(&prepared.features());
    Ok((prepared, plan))
}

/// The blocking pool's queue is full: counted as shed, answered 503.
fn offload_shed(router: &Router) -> Refused {
    router
        .metrics()
        .shed
        .get_or_create(&crate::metrics::ReasonLabel {
            reason: "offload_queue",
        })
        .inc();
    ApiError::unavailable("the router is preparing as many large requests as it may; retry shortly")
        .into()
}

/// Why no configured model serves a request naming `model` (`None`: it names none, and the
/// router serves several, so which one is unknown).
pub(crate) fn unserved_model(router: &Router, model: Option<&str>) -> ApiError {
    match model {
        Some(name) => ApiError::not_found(format!("The model `{name}` does not exist.")),
        None => ApiError::bad_request(
            format!(
                "model is required: this router serves {} models",
                router.config().models.len()
            ),
            Some("model"),
        ),
    }
}
