//! The OpenAI front door: parse once, tokenize, ask core for a plan (holding the request while
//! every endpoint is saturated), forward with the body streamed through unbuffered, retry on
//! the next endpoint of the plan after a refused connection or a 5xx before any body byte
//! (within the retry budget), tell the fleet how each attempt went (outlier detection), and
//! answer errors in OpenAI's shape.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, header};
use axum::response::Response;
use bytes::Bytes;
use http_body_util::Full;
use kvroute_core::fleet::{Admission, AttemptFailure, Dispatch, Plan, Shed, UpstreamOutcome};
use kvroute_core::index::EndpointId;
use kvroute_vllm::openai::{ApiError, GenerationRequest, parse_chat, parse_completion};
use tracing::warn;

use crate::accounting::{AccountedBody, Accounting, Outcome};
use crate::edge::read_body;
use crate::flow;
use crate::forwarding;
use crate::forwarding::ClientAddr;
use crate::reply::error_response;
use crate::service::{Prepared, Router};

/// The header naming the endpoint that served a request.
pub const ENDPOINT_HEADER: &str = "x-kvroute-endpoint";

/// Which OpenAI API a request used.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Api {
    /// `/v1/completions`.
    Completions,
    /// `/v1/chat/completions`.
    Chat,
}

/// Records that `prepared` was connected to `id` with its plan's `predicted_cached` (the
/// connect phase): the fleet's dispatch, shared with peer replicas.
pub(crate) fn connected(
    router: &Router,
    predicted_cached: &[usize],
    prepared: &Prepared,
    id: EndpointId,
) -> Dispatch {
    let dispatch = router.dispatched(predicted_cached, prepared, id);
    crate::replica::share::dispatched(router, prepared, &dispatch);
    dispatch
}

/// Parses a generation request of either API.
pub fn parse(api: Api, body: &[u8]) -> Result<GenerationRequest, ApiError> {
    match api {
        Api::Completions => parse_completion(body),
        Api::Chat => parse_chat(body),
    }
}

/// `POST /v1/completions`.
pub async fn completions(State(router): State<Arc<Router>>, request: Request) -> Response {
    generate(router, request, Api::Completions).await
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(State(router): State<Arc<Router>>, request: Request) -> Response {
    generate(router, request, Api::Chat).await
}

pub(crate) fn request_id(headers: &HeaderMap) -> String {
    headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .unwrap_or_else(|| format!("{:016x}", rand::random::<u64>()))
}

pub(crate) fn session(router: &Router, headers: &HeaderMap) -> Option<String> {
    headers
        .get(router.config().scheduler.session_header.as_str())
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

pub(crate) fn priority(router: &Router, headers: &HeaderMap) -> i64 {
    headers
        .get(router.config().scheduler.priority_header.as_str())
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// A request core has planned, ready to be sent to the first endpoint of its ranking.
pub struct Routed {
    /// The request, tokenized and keyed.
    pub prepared: Prepared,
    /// Core's plan for it (the ranking is never empty).
    pub plan: Plan,
}

/// Why a request was not routed.
pub struct Refused {
    /// The answer for the client.
    pub error: ApiError,
    /// Set when flow control shed the request.
    pub shed: Option<Shed>,
}

impl From<ApiError> for Refused {
    fn from(error: ApiError) -> Self {
        Self { error, shed: None }
    }
}

/// Parses, tokenizes and plans a generation request, holding it while every endpoint is
/// saturated: the one decision path of `kvroute serve` and `kvroute epp`. A large body is
/// prepared on the bounded blocking pool ([`crate::offload`]).
pub async fn route(
    router: &Arc<Router>,
    api: Api,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<Routed, Refused> {
    let session = session(router, headers);
    let (prepared, plan) = if router.offload().wanted(body.len()) {
        let (shared, body) = (router.clone(), body.clone());
        let runtime = tokio::runtime::Handle::current();
        let work = move || runtime.block_on(prepare_and_plan(&shared, api, &body, session));
        router
            .offload()
            .run(work)
            .await
            .map_err(|_| offload_shed(router))??
    } else {
        prepare_and_plan(router, api, body, session).await?
    };
    let admission = {
        let now = router.now();
        router
            .fleet()
            .admit(&plan, priority(router, headers), body.len(), now)
    };
    let plan = match admission {
        Admission::Route => plan,
        Admission::Held(ticket) => flow::wait_for_capacity(router, &prepared, ticket)
            .await
            .map_err(|why| match why {
                flow::NotReleased::Shed(why) => shed_refusal(router, why),
                flow::NotReleased::NoEndpoint => no_endpoint(),
            })?,
        Admission::Shed(why) => return Err(shed_refusal(router, why)),
        Admission::NoEndpoint => return Err(no_endpoint()),
    };
    Ok(Routed { prepared, plan })
}

/// Flow control shed the request: counted, and answered 503 or 429.
fn shed_refusal(router: &Router, why: Shed) -> Refused {
    Refused {
        error: flow::shed(router, why),
        shed: Some(why),
    }
}

/// No endpoint can take the request.
fn no_endpoint() -> Refused {
    ApiError::unavailable("no healthy endpoint serves this model; retry shortly").into()
}

/// Parses, tokenizes and plans once.
async fn prepare_and_plan(
    router: &Router,
    api: Api,
    body: &[u8],
    session: Option<String>,
) -> Result<(Prepared, Plan), Refused> {
    let parsed = parse(api, body)?;
    let Some(prepared) = router.prepare(&parsed, body.len(), session).await else {
        return Err(
            ApiError::not_found(format!("The model `{}` does not exist.", parsed.model)).into(),
        );
    };
    let plan = router.plan(&prepared);
    Ok((prepared, plan))
}

/// The blocking pool's queue is full: counted as shed, answered 503.
fn offload_shed(router: &Router) -> Refused {
    router
        .metrics()
        .shed
        .get_or_create(&vec![("reason", "offload_queue".to_owned())])
        .inc();
    ApiError::unavailable("the router is preparing as many large requests as it may; retry shortly")
        .into()
}

async fn generate(router: Arc<Router>, request: Request, api: Api) -> Response {
    let started = Instant::now();
    let (parts, body) = request.into_parts();
    let body = match read_body(&router, body).await {
        Ok(b) => b,
        Err(e) => return error_response(&router, &e),
    };
    let Routed { prepared, plan } = match route(&router, api, &parts.headers, &body).await {
        Ok(r) => r,
        Err(refused) => return error_response(&router, &refused.error),
    };
    let rid = request_id(&parts.headers);
    let path = path_and_query(&parts.uri);
    forward(ForwardArgs {
        router: &router,
        prepared: &prepared,
        ranking: &plan.decision.ranking,
        predicted_cached: &plan.predicted_cached,
        reason: plan.decision.reason.as_str(),
        method: parts.method,
        path,
        headers: parts.headers,
        body,
        request_id: rid,
        started,
        client: client_addr(&parts.extensions),
    })
    .await
}

struct ForwardArgs<'a> {
    router: &'a Arc<Router>,
    prepared: &'a Prepared,
    ranking: &'a [EndpointId],
    predicted_cached: &'a [usize],
    reason: &'static str,
    method: http::Method,
    path: String,
    headers: HeaderMap,
    body: Bytes,
    request_id: String,
    started: Instant,
    /// The client's address, as the edge accepted it.
    client: Option<SocketAddr>,
}

/// The client's address the edge put in a request's extensions.
fn client_addr(extensions: &http::Extensions) -> Option<SocketAddr> {
    extensions.get::<ClientAddr>().map(|c| c.0)
}

/// The path and query to send upstream, as the client sent them.
fn path_and_query(uri: &http::Uri) -> String {
    uri.path_and_query()
        .map_or(uri.path(), |p| p.as_str())
        .to_owned()
}

/// The request to send to the engine at `base` (`http://host:port`): origin-form target with
/// a `Host` header, as strict HTTP/1.1 servers (h11, uvicorn) require.
fn upstream_request(base: &str, a: &ForwardArgs<'_>) -> http::Request<Full<Bytes>> {
    let authority = base.strip_prefix("http://").unwrap_or(base);
    let mut builder = http::Request::builder()
        .method(a.method.clone())
        .uri(a.path.as_str())
        .header(header::HOST, authority);
    for (name, value) in forwarding::end_to_end(&a.headers, &forwarding::FORWARDING_HEADERS) {
        builder = builder.header(name, value);
    }
    for (name, value) in
        forwarding::forwarded_for(&a.router.config().forwarding, &a.headers, a.client)
    {
        builder = builder.header(name, value);
    }
    builder
        .header("x-request-id", a.request_id.as_str())
        .body(Full::new(a.body.clone()))
        .expect("a request built from a valid request is valid")
}

async fn forward(a: ForwardArgs<'_>) -> Response {
    let router = a.router;
    let timeout = Duration::from_secs_f64(router.config().limits.response_timeout_s);
    let attempts = router.config().retry.attempts(a.ranking.len());
    // Down the plan's ranking: the next endpoint is tried when no connection could be made or
    // the engine answered 5xx before any body byte, while the retry budget allows. Nothing is
    // recorded against an endpoint before a connection to it exists.
    for (attempt, &id) in a.ranking.iter().take(attempts).enumerate() {
        let endpoint = router.endpoint(id).clone();
        let authority = endpoint.authority.to_string();
        let conn = match router.upstream().connection(&authority).await {
            Ok(conn) => conn,
            Err(e) => {
                router.upstream_result(id, UpstreamOutcome::Failure);
                if router.retry(id, AttemptFailure::Connect, attempt, attempts) {
                    warn!(endpoint = %endpoint.name, error = %e, "cannot connect; retrying on the next best endpoint");
                    continue;
                }
                return error_response(
                    router,
                    &ApiError::engine_failed(format!("the engine {} failed: {e}", endpoint.name)),
                );
            }
        };
        let dispatch = connected(router, a.predicted_cached, a.prepared, id);
        let mut accounting = Accounting::new(
            router.clone(),
            dispatch,
            if attempt == 0 { a.reason } else { "retry" },
            a.request_id.clone(),
            a.started,
        );
        let request = upstream_request(&format!("http://{}", endpoint.authority), &a);
        let sent = tokio::time::timeout(timeout, router.upstream().send(conn, &authority, request));
        let (response, lease) = match sent.await {
            Err(_) => {
                router.upstream_result(id, UpstreamOutcome::Failure);
                accounting.fail(504, Outcome::Timeout);
                if router.retry(id, AttemptFailure::Timeout, attempt, attempts) {
                    continue;
                }
                let message = format!(
                    "the engine {} did not answer within {timeout:?}",
                    endpoint.name
                );
                return error_response(router, &ApiError::engine_timeout(message));
            }
            Ok(Err(e)) => {
                router.upstream_result(id, UpstreamOutcome::Failure);
                accounting.fail(502, Outcome::EngineError);
                if router.retry(id, AttemptFailure::Transport, attempt, attempts) {
                    continue;
                }
                let message = format!("the engine {} failed: {e}", endpoint.name);
                return error_response(router, &ApiError::engine_failed(message));
            }
            Ok(Ok(answer)) => answer,
        };
        let (parts, body) = response.into_parts();
        accounting.status = parts.status.as_u16();
        if parts.status.is_server_error() {
            router.upstream_result(id, UpstreamOutcome::Failure);
            if router.retry(id, AttemptFailure::ServerError, attempt, attempts) {
                warn!(endpoint = %endpoint.name, status = %parts.status, "the engine failed before answering; retrying on the next best endpoint");
                continue; // the response, its accounting and its connection are dropped
            }
        } else {
            router.upstream_result(id, UpstreamOutcome::Success);
        }
        let mut out = Response::builder().status(parts.status);
        for (name, value) in forwarding::end_to_end(&parts.headers, &[]) {
            out = out.header(name, value);
        }
        out = out.header(ENDPOINT_HEADER, endpoint.name.as_str());
        let sse = parts
            .headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        return out
            .body(Body::new(AccountedBody::new(body, accounting, lease, sse)))
            .unwrap_or_else(|_| {
                error_response(
                    router,
                    &ApiError::engine_failed("the engine sent an invalid response"),
                )
            });
    }
    error_response(
        router,
        &ApiError::unavailable("no endpoint accepted the connection; retry shortly"),
    )
}

/// Every healthy endpoint, starting at a random one: where a request that needs no cache
/// (embeddings, `GET` paths) goes.
pub fn healthy_rotation(router: &Router) -> Vec<EndpointId> {
    let now = router.now();
    router.fleet().passthrough_rotation(now)
}

/// A forwarded OpenAI path other than completions and chat (see
/// `server::FORWARDED_PATHS`): passed to a random healthy endpoint unchanged.
pub async fn passthrough(State(router): State<Arc<Router>>, request: Request) -> Response {
    let started = Instant::now();
    let (parts, body) = request.into_parts();
    let body = match read_body(&router, body).await {
        Ok(b) => b,
        Err(e) => return error_response(&router, &e),
    };
    let ranking = healthy_rotation(&router);
    if ranking.is_empty() {
        return error_response(
            &router,
            &ApiError::unavailable("no healthy endpoint; retry shortly"),
        );
    }
    let prepared = Prepared::uncached(&router);
    let path = path_and_query(&parts.uri);
    forward(ForwardArgs {
        router: &router,
        prepared: &prepared,
        ranking: &ranking,
        predicted_cached: &[],
        reason: "passthrough",
        method: parts.method,
        path,
        request_id: request_id(&parts.headers),
        client: client_addr(&parts.extensions),
        headers: parts.headers,
        body,
        started,
    })
    .await
}
