//! The OpenAI front door, `kvroute serve`'s driver of the request pipeline
//! ([`crate::pipeline`]): admit, prepare and select, then forward down the leg's ranking
//! ([`crate::forward`]), or, under `pd.mode`, as two legs when core says they pay
//! ([`crate::pd`]).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::response::Response;
use bytes::Bytes;
use kvroute_core::index::EndpointId;
use kvroute_vllm::openai::{ApiError, request_stream_usage};
use tokio::time::Instant;

use crate::edge::read_body;
use crate::forward::{ForwardArgs, forward};
use crate::forwarding::ClientAddr;
use crate::pipeline::{self, Leg, Prepared};
use crate::reply::error_response;
use crate::service::Router;

pub use crate::pipeline::{Api, Refused, Routed, route};

pub use crate::forward::ENDPOINT_HEADER;

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
    // Under P/D the leg is decided by `crate::pd`, from the plan.
    let (leg, pd_plan) = if router.config().pd.orchestrates() {
        (Leg::unplanned(Vec::new()), Some(plan))
    } else {
        (Leg::planned(plan), None)
    };
    // A stream that names no `stream_options` is asked for its usage, which the client is not
    // shown (under P/D, on the decode leg and on any aggregated attempt: `crate::pd`).
    let asked = (prepared.may_ask_usage && router.config().forwarding.stream_usage)
        .then(|| request_stream_usage(&body))
        .flatten();
    let strip_usage = asked.is_some();
    let body = asked.map_or(body, Bytes::from);
    let args = ForwardArgs {
        router: &router,
        context,
        prepared: &prepared,
        leg,
        method: parts.method,
        path,
        headers: parts.headers,
        body,
        client: client_addr(&parts.extensions),
        decode: None,
        multiplexed: parts.version == http::Version::HTTP_2,
        strip_usage,
    };
    if let Some(plan) = pd_plan {
        // Two legs when core says they pay.
        return crate::pd::generate(args, plan).await;
    }
    forward(args).await
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
        multiplexed: parts.version == http::Version::HTTP_2,
        headers: parts.headers,
        body,
        decode: None,
        strip_usage: false,
    })
    .await
}
