//! Sending one leg down its ranking with the body streamed through unbuffered: connecting,
//! responding and retrying (a refused connection or a 5xx before any body byte, as core allows)
//! through the pipeline's phases, and telling the fleet how each attempt went (outlier
//! detection). A P/D decode leg also has its KV transfer tracked ([`crate::transfer`]).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, header};
use axum::response::Response;
use bytes::Bytes;
use http_body_util::Full;
use kvroute_core::fleet::{AttemptFailure, DecodeRetry, FailedDecodeLeg, UpstreamOutcome};
use kvroute_core::index::EndpointId;
use kvroute_vllm::openai::ApiError;
use tracing::warn;

use crate::accounting::{AccountedBody, Outcome, StripUsage};
use crate::forwarding;
use crate::pipeline::Prepared;
use crate::pipeline::{self, Leg, RequestContext};
use crate::reply::error_response;
use crate::service::Router;
use crate::transfer::{DecodeLeg, TransferBody};
use crate::upstream::UpstreamError;

/// The header naming the endpoint that served a request.
pub const ENDPOINT_HEADER: &str = "x-kvroute-endpoint";

/// One request on its way to an engine: the client's request, its leg, and for a P/D decode
/// leg, what its transfer needs.
pub(crate) struct ForwardArgs<'a> {
    pub(crate) router: &'a Arc<Router>,
    pub(crate) context: RequestContext,
    pub(crate) prepared: &'a Prepared,
    pub(crate) leg: Leg,
    pub(crate) method: http::Method,
    pub(crate) path: String,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
    /// The client's address, as the edge accepted it.
    pub(crate) client: Option<SocketAddr>,
    /// Set on a P/D decode leg: its transfer is tracked, and it is retried only while the
    /// producer's hold lasts.
    pub(crate) decode: Option<DecodeLeg>,
    /// The client's connection carries other requests beside this one (HTTP/2): the
    /// connection's write clock cannot see this response stall, so it gets its own watchdog
    /// ([`AccountedBody::new`]).
    pub(crate) multiplexed: bool,
    /// The router asked for the stream's usage on its own account (`forwarding.stream_usage`):
    /// the usage event is taken out of the stream before the client sees it ([`StripUsage`]).
    pub(crate) strip_usage: bool,
}

/// The request to send to the engine at `base` (`http://host:port`) with `body`: origin-form
/// target with a `Host` header, as strict HTTP/1.1 servers (h11, uvicorn) require.
pub(crate) fn upstream_request(
    base: &str,
    a: &ForwardArgs<'_>,
    body: Bytes,
) -> http::Request<Full<Bytes>> {
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
        .body(Full::new(body))
        .expect("a request built from a valid request is valid")
}

/// Whether the attempt on `id` that failed with `failure` is followed by one on the next
/// endpoint of the ranking (as the retry budget allows). A P/D decode leg goes on as one or the
/// request is served aggregated on the next endpoint, as core decides
/// ([`Fleet::decode_leg_failed`]): aggregated, it is sent the client's body as the router
/// forwards it (a client's `kv_transfer_params` taken out, the stream's usage asked for), with
/// the cached tokens core predicts there.
///
/// [`Fleet::decode_leg_failed`]: kvroute_core::fleet::Fleet::decode_leg_failed
fn retry_after(
    a: &mut ForwardArgs<'_>,
    id: EndpointId,
    failure: AttemptFailure,
    attempt: usize,
) -> bool {
    if !pipeline::retry(a.router, &a.leg, id, failure, attempt) {
        return false;
    }
    let Some(decode) = a.decode.take() else {
        return true;
    };
    let failed = FailedDecodeLeg {
        plan: &decode.plan,
        producer: decode.prefill,
        prompt_tokens: decode.prompt_tokens,
        next: a.leg.ranking.get(attempt + 1).copied(),
        failure,
        lease_holds: decode.may_retry(),
    };
    let now = a.router.now();
    let verdict = a.router.fleet().decode_leg_failed(failed, now);
    match verdict {
        DecodeRetry::PullAgain => a.decode = Some(decode),
        DecodeRetry::Aggregated {
            predicted_cached,
            next_is_producer,
        } => {
            a.router.metrics().pd.fallback("decode_failed");
            warn!(request_id = %a.context.request_id, ?failure, on_producer = next_is_producer, "the decode leg cannot go on as one (its consumer may have pulled, the producer's hold is over, or the next decode endpoint is the producer itself); serving the request aggregated on the next decode endpoint");
            a.body = decode.aggregated_body;
            a.leg.predicted_cached = predicted_cached;
        }
    }
    true
}

/// Sends `a` down its leg's ranking and streams the answer back.
pub(crate) async fn forward(mut a: ForwardArgs<'_>) -> Response {
    let router = a.router;
    let timeout = Duration::from_secs_f64(router.config().limits.response_timeout_s);
    let attempts = a.leg.attempts(router);
    // Down the plan's ranking: the next endpoint is tried when no connection could be made or
    // the engine answered 5xx before any body byte, while the retry budget allows. Nothing is
    // recorded against an endpoint before a connection to it exists. (By index: a failed
    // decode leg changes `a` between attempts.)
    for attempt in 0..attempts {
        let Some(&id) = a.leg.ranking.get(attempt) else {
            break;
        };
        let endpoint = router.endpoint(id).clone();
        let authority = endpoint.authority.to_string();
        let conn = match router.upstream().connection(&authority).await {
            Ok(conn) => conn,
            Err(e) => {
                router.upstream_result(id, UpstreamOutcome::Failure);
                if retry_after(&mut a, id, AttemptFailure::Connect, attempt) {
                    warn!(endpoint = %endpoint.name, error = %e, "cannot connect; retrying on the next best endpoint");
                    continue;
                }
                return error_response(
                    router,
                    &ApiError::engine_failed(format!("the engine {} failed: {e}", endpoint.name)),
                );
            }
        };
        let dispatch = pipeline::connect(router, &a.leg, a.prepared, id);
        let mut accounting = pipeline::respond(router, &a.context, &a.leg, attempt, dispatch);
        let mut transfer = a.decode.as_ref().map(|leg| leg.start(router, id));
        // A decode leg's reported cached tokens count the blocks it pulls: no lesson about the
        // index from them. Nor from its aggregated fallback's, whose engine may hold what a
        // pull or the prefill leg just left there, before the index shows it.
        if transfer.is_some() || a.leg.reason == pipeline::PD_DECODE {
            accounting.skip_cached_check();
        }
        let request = upstream_request(
            &format!("http://{}", endpoint.authority),
            &a,
            a.body.clone(),
        );
        let sent = tokio::time::timeout(timeout, router.upstream().send(conn, &authority, request));
        let (response, lease) = match sent.await {
            Err(_) => {
                router.upstream_result(id, UpstreamOutcome::Failure);
                accounting.fail(504, Outcome::Timeout);
                if let Some(t) = transfer.as_mut() {
                    t.failed();
                }
                if retry_after(&mut a, id, AttemptFailure::Timeout, attempt) {
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
                // A request no connection wrote never reached the engine: as a refused
                // connection, it may go to the next endpoint, and no pull was tried.
                let failure = match e {
                    UpstreamError::Connect(_) => AttemptFailure::Connect,
                    UpstreamError::Request(_) => AttemptFailure::Transport,
                };
                if let Some(t) = transfer.as_mut() {
                    match failure {
                        AttemptFailure::Connect => t.ended(),
                        _ => t.failed(),
                    }
                }
                if retry_after(&mut a, id, failure, attempt) {
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
            if let Some(t) = transfer.as_mut() {
                t.failed();
            }
            if retry_after(&mut a, id, AttemptFailure::ServerError, attempt) {
                warn!(endpoint = %endpoint.name, status = %parts.status, "the engine failed before answering; retrying on the next best endpoint");
                continue; // the response, its accounting and its connection are dropped
            }
        } else {
            router.upstream_result(id, UpstreamOutcome::Success);
            if parts.status.is_client_error()
                && let Some(mut t) = transfer.take()
            {
                // The request's own fault (a `max_tokens` past the model's length): it says
                // nothing of the pull, good or bad, so a client cannot quarantine a pair.
                t.ended();
            }
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
        if sse {
            accounting.first_byte_is_first_token();
        }
        let body = TransferBody::new(body, transfer);
        let body = AccountedBody::new(body, accounting, lease, sse, a.multiplexed);
        let body = if sse && a.strip_usage {
            Body::new(StripUsage::new(body))
        } else {
            Body::new(body)
        };
        return out.body(body).unwrap_or_else(|_| {
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
