//! The router's HTTP edge, in front of its routes: bounded connections, timeouts on slow
//! clients, canonical paths, and request bodies held within a router-wide byte budget.
//!
//! Per connection: a request head must complete within `limits.header_timeout_ms` of its first
//! byte, a connection with no request in progress closes after `limits.idle_timeout_ms`
//! without a byte, and one whose client takes none of the bytes sent to it for
//! `limits.write_timeout_ms` closes whatever it is doing (a stream its client stopped reading
//! would otherwise hold its engine and its load forever: a response's own timeouts run only
//! while the server reads it; an HTTP/2 stream stalled among moving ones is given up alone, by
//! its body's watchdog). Per request: a declared `Content-Length` above
//! `limits.max_body_bytes` is answered 413 before any body byte is read, the body must arrive
//! within `limits.body_timeout_ms` (408), and each of its bytes is charged, as it arrives, to
//! the listener's byte budget until the handler answers (503 when the budget is spent): a declared
//! length costs nothing until its bytes come. An HTTP/1 answer given before the request's body
//! was read to its end (413, or any early refusal) says `Connection: close` and closes the
//! connection: the rest of the body is never read, so the connection cannot carry another
//! request, and a client told so does not send its next request on it.
//!
//! A listener that drains (the API listener, see [`crate::shutdown`]) stops accepting when the
//! router drains, closes each open connection once its request is answered, and returns when
//! none is left.

mod body;
mod conn;
pub mod path;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::Router as Routes;
use axum::body::Body;
use axum::response::Response;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder;
use kvroute_vllm::openai::ApiError;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tower::ServiceExt;
use tracing::{debug, warn};

use crate::budget::ByteBudget;
use crate::forwarding::ClientAddr;
use crate::metrics::listener as listener_labels;
use crate::reply::error_response;
use crate::service::Router;
use crate::shutdown::Phase;
use body::{EdgeBody, Finishing, ReadToEnd};
pub(crate) use body::{read_body, read_body_within};
use conn::{Activity, Expiry, InFlight, TrackedIo};

/// Largest request head (request line and headers) read from a client; larger ones get 431.
pub const MAX_HEAD_BYTES: usize = 64 << 10;

/// What every connection of one router shares.
struct Edge {
    router: Arc<Router>,
    routes: Routes,
    name: &'static str,
    budget: ByteBudget,
    /// Requests in progress, at most as many as connections: each may hold an engine
    /// connection, which the connection limit counts one per client connection. An HTTP/2
    /// connection carries many requests, so its streams take these too.
    requests: Arc<Semaphore>,
}

/// Serves `routes` on `listener` until the task is dropped or, when `drains`, until the router
/// drains and every open connection has closed. `name` labels the listener in metrics (`api`,
/// `admin`); `budget` is the buffered-bytes budget of its requests; at most `max_connections`
/// are open at once.
pub async fn serve(
    listener: TcpListener,
    routes: Routes,
    router: Arc<Router>,
    name: &'static str,
    budget: ByteBudget,
    max_connections: usize,
    drains: bool,
) {
    let limits = &router.config().limits;
    let connections = Arc::new(Semaphore::new(max_connections));
    let mut accept_errors = AcceptErrors::default();
    let header_timeout = Duration::from_millis(limits.header_timeout_ms);
    let idle_timeout = Duration::from_millis(limits.idle_timeout_ms);
    let write_timeout = Duration::from_millis(limits.write_timeout_ms);
    let edge = Arc::new(Edge {
        router: router.clone(),
        routes,
        name,
        budget,
        requests: Arc::new(Semaphore::new(max_connections)),
    });
    let labels = listener_labels(name);
    let draining = router.shutdown().reached(Phase::Draining);
    tokio::pin!(draining);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut draining, if drains => break,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of file descriptors, most likely: give the open connections a moment.
                router.metrics().accept_errors.get_or_create(&labels).inc();
                accept_errors.warn(name, &e);
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(permit) = connections.clone().try_acquire_owned() else {
            router
                .metrics()
                .connections_refused
                .get_or_create(&labels)
                .inc();
            debug!(%peer, listener = name, "connection limit reached: closing a new connection");
            drop(stream);
            continue;
        };
        // Streamed tokens must not wait for the client's delayed ACK (Nagle).
        let _ = stream.set_nodelay(true);
        let activity = Arc::new(Activity::new(header_timeout, idle_timeout, write_timeout));
        let edge = edge.clone();
        let open = router
            .metrics()
            .connections_open
            .get_or_create(&labels)
            .clone();
        open.inc();
        tokio::spawn(async move {
            serve_connection(edge, stream, peer, activity, drains).await;
            open.dec();
            drop(permit);
        });
    }
    // Draining: new connections are refused (the listener closes) and the open ones close
    // once answered.
    drop(listener);
    let all = u32::try_from(max_connections).unwrap_or(u32::MAX);
    let _ = connections.acquire_many(all).await;
}

/// Failed accepts, warned about at most once per [`ACCEPT_WARNING_PERIOD`] (each is counted in
/// `kvroute_accept_errors_total`).
#[derive(Default)]
struct AcceptErrors {
    last_warning: Option<tokio::time::Instant>,
    since: u64,
}

/// Least time between two warnings of failed accepts on one listener.
const ACCEPT_WARNING_PERIOD: Duration = Duration::from_secs(10);

impl AcceptErrors {
    fn warn(&mut self, listener: &str, error: &std::io::Error) {
        self.since += 1;
        let due = self
            .last_warning
            .is_none_or(|at| at.elapsed() >= ACCEPT_WARNING_PERIOD);
        if due {
            warn!(%error, listener, failed = self.since, "cannot accept connections (out of file descriptors? see limits.max_connections and ulimit -n); warned at most every 10 s");
            self.last_warning = Some(tokio::time::Instant::now());
            self.since = 0;
        }
    }
}

async fn serve_connection(
    edge: Arc<Edge>,
    stream: tokio::net::TcpStream,
    peer: std::net::SocketAddr,
    activity: Arc<Activity>,
    drains: bool,
) {
    let io = TokioIo::new(TrackedIo::new(stream, activity.clone()));
    let service = {
        let activity = activity.clone();
        let edge = edge.clone();
        hyper::service::service_fn(move |mut request: http::Request<Incoming>| {
            request.extensions_mut().insert(ClientAddr(peer));
            let edge = edge.clone();
            let activity = activity.clone();
            async move { Ok::<_, Infallible>(edge.handle(request, activity).await) }
        })
    };
    let mut builder = Builder::new(TokioExecutor::new());
    // A request head larger than the read buffer is answered 431; the bound keeps each
    // connection's buffers small (hyper's default lets one grow to 400 KiB).
    builder
        .http1()
        .header_read_timeout(None)
        .max_buf_size(MAX_HEAD_BYTES);
    let connection = builder.serve_connection(io, service);
    tokio::pin!(connection);
    let draining = edge.router.shutdown().reached(Phase::Draining);
    tokio::pin!(draining);
    let mut drained = !drains;
    let mut closing = false;
    loop {
        let deadline = activity.deadline();
        let expired = async {
            match deadline {
                Some((at, _)) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = connection.as_mut() => return,
            () = activity.changed() => {}
            // Answer the request in progress, if any, then close.
            () = &mut draining, if !drained => {
                drained = true;
                connection.as_mut().graceful_shutdown();
            }
            () = expired => {
                if let Some((at, why)) = activity.deadline()
                    && at <= tokio::time::Instant::now()
                {
                    if !closing {
                        edge.router
                            .metrics()
                            .client_timeouts
                            .get_or_create(&crate::metrics::KindLabel { kind: why.label() })
                            .inc();
                        debug!(listener = edge.name, reason = why.label(), "closing a client connection");
                    }
                    if why == Expiry::Idle && !closing {
                        // Nothing in progress: said to the client first (HTTP/2's GOAWAY), so
                        // that it sends no request the close would lose; dropped if it never
                        // lets go.
                        closing = true;
                        connection.as_mut().graceful_shutdown();
                        activity.closing();
                        continue;
                    }
                    return;
                }
            }
        }
    }
}

/// `response`, saying `Connection: close` when it answers an HTTP/1 request whose body was not
/// read to its end (`read_to_end` false). The server then closes the connection after it (the
/// unread rest of the body cannot be told from a next request); without the header a client
/// that keeps connections alive would send its next request on a connection being closed, and
/// see it fail.
fn closing_unless_read(
    mut response: Response,
    version: http::Version,
    read_to_end: bool,
) -> Response {
    let http1 = matches!(version, http::Version::HTTP_10 | http::Version::HTTP_11);
    if http1 && !read_to_end {
        response.headers_mut().insert(
            http::header::CONNECTION,
            http::HeaderValue::from_static("close"),
        );
    }
    response
}

impl Edge {
    /// One request: admitted (or refused) at the edge, then routed. It counts as in progress
    /// on its connection until its response body is dropped, or this future is.
    async fn handle(&self, request: http::Request<Incoming>, activity: Arc<Activity>) -> Response {
        let in_flight = InFlight::start(activity, request.version() == http::Version::HTTP_2);
        let (in_flight, response) = match self.requests.clone().try_acquire_owned() {
            Ok(permit) => match self.admit(request).await {
                Ok(response) | Err(response) => (in_flight.holding(permit), response),
            },
            // Only HTTP/2 gets here: its streams, many per connection, are past the limit.
            Err(_) => (
                in_flight,
                error_response(
                    &self.router,
                    &ApiError::unavailable(
                        "the router serves as many requests at once as limits.max_connections allows; retry shortly",
                    ),
                ),
            ),
        };
        response.map(|body| Body::new(Finishing::new(body, in_flight)))
    }

    async fn admit(&self, request: http::Request<Incoming>) -> Result<Response, Response> {
        let refuse = |status: u16, message: String| {
            error_response(&self.router, &ApiError::new(status, message))
        };
        let (mut parts, body) = request.into_parts();
        parts.uri = path::normalize(&parts.uri).ok_or_else(|| {
            refuse(
                404,
                "paths with encoded dots, slashes or backslashes are not served".into(),
            )
        })?;
        if parts.headers.get_all(http::header::HOST).iter().count() > 1 {
            return Err(refuse(400, "more than one Host header".into()));
        }
        let limits = &self.router.config().limits;
        let declared = parts
            .headers
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        let version = parts.version;
        if let Some(declared) = declared
            && declared > limits.max_body_bytes as u64
        {
            let refused = refuse(
                413,
                format!("request body larger than {} bytes", limits.max_body_bytes),
            );
            return Err(closing_unless_read(refused, version, false));
        }
        // Charged as the bytes arrive: a declared length reserves nothing.
        let hold = Arc::new(self.budget.hold());
        let read_to_end = ReadToEnd::new(hyper::body::Body::is_end_stream(&body));
        let body = EdgeBody::new(
            body,
            Duration::from_millis(limits.body_timeout_ms),
            hold.clone(),
            read_to_end.clone(),
        );
        let request = http::Request::from_parts(parts, Body::new(body));
        let response = self.routes.clone().oneshot(request).await;
        // The handler answered: the body it read is no longer held.
        drop(hold);
        let response = match response {
            Ok(response) => response,
            Err(never) => match never {},
        };
        Ok(closing_unless_read(response, version, read_to_end.get()))
    }
}
