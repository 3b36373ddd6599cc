//! The OpenAI front door, `kvroute serve`'s driver of the request pipeline
//! ([`crate::pipeline`]): admit, prepare and select, then forward down the leg's ranking with
//! the body streamed through unbuffered, connecting, responding and retrying (a refused
//! connection or a 5xx before any body byte, as core allows) through the pipeline's phases, and
//! telling the fleet how each attempt went (outlier detection).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, header};
use axum::response::Response;
use bytes::Bytes;
use http_body_util::Full;
use kvroute_core::fleet::{AttemptFailure, UpstreamOutcome};
use kvroute_core::index::EndpointId;
use kvroute_vllm::openai::ApiError;
use tokio::time::Instant;
use tracing::warn;

use crate::accounting::{AccountedBody, Outcome};
use crate::edge::read_body;
use crate::forwarding;
use crate::forwarding::ClientAddr;
use crate::pipeline::Prepared;
use crate::pipeline::{self, Leg, RequestContext};
use crate::reply::error_response;
use crate::service::Router;

pub use crate::pipeline::{Api, Refused, Routed, route};

/// The header naming the endpoint that served a request.
pub const ENDPOINT_HEADER: &str = "x-kvroute-endpoint";

/// `POST /v1/completions`.
pub async fn completions(State(router): State<Arc<Router>>, request: Request) -> Response {
    generate(router, request, Api::Completions).await
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(State(router): State<Arc<Router>>, request: Request) -> Response {
    generate(router, request, Api::Chat).await
}

async fn generate(router: Arc<Router>, request: Request, api: Api) -> Response {
    let started = Instant::now();
    let (parts, body) = request.into_parts();
    let body = match read_body(&router, body).await {
        Ok(b) => b,
        Err(e) => return error_response(&router, &e),
    };
    let context = pipeline::admit(&router, &parts.headers, started);
    let Routed { prepared, plan } = match pipeline::route_in(&router, api, &context, &body).await {
        Ok(r) => r,
        Err(refused) => return error_response(&router, &refused.error),
    };
    let path = path_and_query(&parts.uri);
    forward(ForwardArgs {
        router: &router,
        context,
        prepared: &prepared,
        leg: Leg::planned(plan),
        method: parts.method,
        path,
        headers: parts.headers,
        body,
        client: client_addr(&parts.extensions),
    })
    .await
}

struct ForwardArgs<'a> {
    router: &'a Arc<Router>,
    context: RequestContext,
    prepared: &'a Prepared,
    leg: Leg,
    method: http::Method,
    path: String,
    headers: HeaderMap,
    body: Bytes,
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
        .header("x-request-id", a.context.request_id.as_str())
        .body(Full::new(a.body.clone()))
        .expect("a request built from a valid request is valid")
}

async fn forward(a: ForwardArgs<'_>) -> Response {
    let router = a.router;
    let timeout = Duration::from_secs_f64(router.config().limits.response_timeout_s);
    let attempts = a.leg.attempts(router);
    // Down the plan's ranking: the next endpoint is tried when no connection could be made or
    // the engine answered 5xx before any body byte, while the retry budget allows. Nothing is
    // recorded against an endpoint before a connection to it exists.
    for (attempt, &id) in a.leg.ranking.iter().take(attempts).enumerate() {
        let endpoint = router.endpoint(id).clone();
        let authority = endpoint.authority.to_string();
        let conn = match router.upstream().connection(&authority).await {
            Ok(conn) => conn,
            Err(e) => {
                router.upstream_result(id, UpstreamOutcome::Failure);
                if pipeline::retry(router, &a.leg, id, AttemptFailure::Connect, attempt) {
                    warn!(endpoint = %endpoint.name, error = %e, "cannot connect; retrying on the next best endpoint");
                    continue;
                }
                return error_response(
                    router,
                    &ApiError::engine_failed(format!("the engine {} failed: {e}", endpoint.name)),
                );
            }
        };
        let dispatch = pipeline::connect(router, &a.leg.predicted_cached, a.prepared, id);
        let mut accounting = pipeline::respond(router, &a.context, &a.leg, attempt, dispatch);
        let request = upstream_request(&format!("http://{}", endpoint.authority), &a);
        let sent = tokio::time::timeout(timeout, router.upstream().send(conn, &authority, request));
        let (response, lease) = match sent.await {
            Err(_) => {
                router.upstream_result(id, UpstreamOutcome::Failure);
                accounting.fail(504, Outcome::Timeout);
                if pipeline::retry(router, &a.leg, id, AttemptFailure::Timeout, attempt) {
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
                if pipeline::retry(router, &a.leg, id, AttemptFailure::Transport, attempt) {
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
            if pipeline::retry(router, &a.leg, id, AttemptFailure::ServerError, attempt) {
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
        context: pipeline::admit(&router, &parts.headers, started),
        prepared: &prepared,
        leg: Leg::unplanned(ranking),
        method: parts.method,
        path,
        client: client_addr(&parts.extensions),
        headers: parts.headers,
        body,
    })
    .await
}
