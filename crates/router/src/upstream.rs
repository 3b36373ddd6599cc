//! Connections to engines for proxied requests.
//!
//! A small pool of HTTP/1.1 connections per endpoint, each owned by the router so that when a
//! client goes away mid-stream the engine's connection is closed at once (and the engine
//! cancels the request). A connection whose response was read to the end goes back to the
//! pool; any other is dropped. An engine may close a pooled connection just as a request takes
//! it (uvicorn closes idle keep-alive connections after 5 s): a request the closed connection
//! never wrote is sent again, once, on a new connection, so a healthy engine is neither failed
//! nor charged for it.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use tokio::task::JoinHandle;

/// Idle connections kept per endpoint.
const IDLE_PER_ENDPOINT: usize = 64;

/// TCP keepalive of engine connections: the first probe after 30 s of silence, then every 10 s
/// (the system's count of unanswered probes, 9 on Linux, ends it).
const KEEPALIVE: socket2::TcpKeepalive = socket2::TcpKeepalive::new()
    .with_time(Duration::from_secs(30))
    .with_interval(Duration::from_secs(10));

/// Why a request did not get a response.
#[derive(Debug)]
pub enum UpstreamError {
    /// No connection could be made (refused, unreachable, timed out): nothing reached the
    /// engine, so the request may be retried elsewhere.
    Connect(String),
    /// The connection failed after the request was (or may have been) sent.
    Request(String),
}

impl std::fmt::Display for UpstreamError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            UpstreamError::Connect(e) => write!(f, "cannot connect: {e}"),
            UpstreamError::Request(e) => write!(f, "{e}"),
        }
    }
}

/// A connection to an engine, ready to take a request.
pub struct Connection {
    sender: SendRequest<Full<Bytes>>,
    task: JoinHandle<()>,
    /// Taken from the pool: the engine may have closed it since it was last used.
    reused: bool,
}

/// How a try to send a request failed.
enum Unsent {
    /// The connection closed before writing it: it comes back, and never reached the engine.
    Back(Box<http::Request<Full<Bytes>>>, String),
    /// The connection failed after writing it, or while reading the answer.
    Written(String),
}

impl Unsent {
    fn into_error(self) -> UpstreamError {
        match self {
            Unsent::Back(_, e) => {
                UpstreamError::Connect(format!("the connection closed before the request: {e}"))
            }
            Unsent::Written(e) => UpstreamError::Request(e),
        }
    }
}

/// The pool.
#[derive(Default)]
pub struct Upstream {
    idle: Mutex<HashMap<String, Vec<Connection>>>,
    connect_timeout: Duration,
    opened: AtomicU64,
}

/// A connection in use; closed on drop unless released after a complete response.
pub struct Lease {
    pool: Arc<Upstream>,
    authority: String,
    connection: Option<Connection>,
}

impl Lease {
    /// The response was read to the end: the connection may serve another request.
    pub fn release(mut self) {
        if let Some(conn) = self.connection.take() {
            if conn.sender.is_ready() && !conn.task.is_finished() {
                let mut idle = self.pool.idle.lock();
                let list = idle.entry(self.authority.clone()).or_default();
                if list.len() < IDLE_PER_ENDPOINT {
                    list.push(conn);
                    return;
                }
            }
            conn.task.abort();
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(conn) = self.connection.take() {
            // Not released: the response was abandoned. Closing the socket tells the engine.
            conn.task.abort();
        }
    }
}

impl Upstream {
    /// A pool whose new connections time out after `connect_timeout`.
    pub fn new(connect_timeout: Duration) -> Self {
        Self {
            idle: Mutex::default(),
            connect_timeout,
            opened: AtomicU64::new(0),
        }
    }

    /// Connections opened so far (reuse keeps this low).
    pub fn connections_opened(&self) -> u64 {
        self.opened.load(Ordering::Relaxed)
    }

    /// Closes the idle connections to `authority` (an endpoint that left the fleet): a pod
    /// that comes back at the same address gets new ones.
    pub fn forget(&self, authority: &str) {
        if let Some(idle) = self.idle.lock().remove(authority) {
            for conn in idle {
                conn.task.abort();
            }
        }
    }

    async fn connect(&self, authority: &str) -> Result<Connection, UpstreamError> {
        let stream = tokio::time::timeout(
            self.connect_timeout,
            tokio::net::TcpStream::connect(authority),
        )
        .await
        .map_err(|_| {
            UpstreamError::Connect(format!("no connection within {:?}", self.connect_timeout))
        })?
        .map_err(|e| UpstreamError::Connect(e.to_string()))?;
        let _ = stream.set_nodelay(true);
        // A pod that vanished without closing (its node failed) leaves an idle pooled
        // connection open for good: probes find it dead, and the pool drops it.
        let _ = socket2::SockRef::from(&stream).set_tcp_keepalive(&KEEPALIVE);
        self.opened.fetch_add(1, Ordering::Relaxed);
        let (sender, conn) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| UpstreamError::Connect(e.to_string()))?;
        let task = tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(Connection {
            sender,
            task,
            reused: false,
        })
    }

    /// A ready connection to `authority` (host:port): a pooled one that is still open, or a
    /// new one. Nothing has been sent on it yet, so a failure here may be retried elsewhere.
    pub async fn connection(&self, authority: &str) -> Result<Connection, UpstreamError> {
        loop {
            let candidate = self.idle.lock().get_mut(authority).and_then(Vec::pop);
            match candidate {
                Some(mut conn) if !conn.task.is_finished() => {
                    // Resolves at once for an open idle connection, errors for a closed one.
                    if std::future::poll_fn(|cx| conn.sender.poll_ready(cx))
                        .await
                        .is_ok()
                    {
                        conn.reused = true;
                        return Ok(conn);
                    }
                    conn.task.abort();
                }
                Some(conn) => conn.task.abort(),
                None => return self.connect(authority).await,
            }
        }
    }

    /// Sends a request on `conn` (from [`Upstream::connection`] for `authority`). If `conn`
    /// came from the pool and closed before writing the request, the request is sent once more
    /// on a new connection; a request no connection wrote is a [`UpstreamError::Connect`]
    /// (nothing reached the engine).
    pub async fn send(
        self: &Arc<Self>,
        conn: Connection,
        authority: &str,
        request: http::Request<Full<Bytes>>,
    ) -> Result<(http::Response<Incoming>, Lease), UpstreamError> {
        let reused = conn.reused;
        let unsent = match self.send_on(conn, authority, request).await {
            Err(Unsent::Back(request, _)) if reused => *request,
            other => return other.map_err(Unsent::into_error),
        };
        let conn = self.connect(authority).await?;
        self.send_on(conn, authority, unsent)
            .await
            .map_err(Unsent::into_error)
    }

    /// One try of [`Upstream::send`] on `conn`.
    async fn send_on(
        self: &Arc<Self>,
        mut conn: Connection,
        authority: &str,
        request: http::Request<Full<Bytes>>,
    ) -> Result<(http::Response<Incoming>, Lease), Unsent> {
        match conn.sender.try_send_request(request).await {
            Ok(response) => Ok((
                response,
                Lease {
                    pool: self.clone(),
                    authority: authority.to_owned(),
                    connection: Some(conn),
                },
            )),
            Err(mut e) => {
                conn.task.abort();
                Err(match e.take_message() {
                    Some(request) => Unsent::Back(Box::new(request), e.into_error().to_string()),
                    None => Unsent::Written(e.into_error().to_string()),
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;

    /// An engine on loopback that closes its first connection at once (as an idle keep-alive
    /// connection is closed) and answers `200 ok` on every later one.
    async fn closes_its_first_connection() -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let authority = listener.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            let (first, _) = listener.accept().await.unwrap();
            drop(first);
            loop {
                let (mut socket, _) = listener.accept().await.unwrap();
                tokio::spawn(async move {
                    let mut head = [0u8; 4096];
                    let _ = socket.read(&mut head).await;
                    let answer = "HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                    let _ = socket.write_all(answer.as_bytes()).await;
                });
            }
        });
        authority
    }

    /// An engine on loopback that answers `200 ok` to every request, keeping its connections.
    async fn keeps_its_connections() -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let authority = listener.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            loop {
                let (mut socket, _) = listener.accept().await.unwrap();
                tokio::spawn(async move {
                    let mut head = [0u8; 4096];
                    while matches!(socket.read(&mut head).await, Ok(n) if n > 0) {
                        let answer = "HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                        if socket.write_all(answer.as_bytes()).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        authority
    }

    /// Sends one request on a pooled (or new) connection and reads its answer to the end,
    /// which puts the connection back in the pool.
    async fn exchange(pool: &Arc<Upstream>, authority: &str) {
        let conn = pool.connection(authority).await.unwrap();
        let (response, lease) = pool
            .send(conn, authority, request(authority))
            .await
            .unwrap();
        http_body_util::BodyExt::collect(response.into_body())
            .await
            .unwrap();
        lease.release();
    }

    #[tokio::test]
    async fn an_endpoint_that_left_leaves_no_idle_connection_behind() {
        let authority = keeps_its_connections().await;
        let pool = Arc::new(Upstream::new(Duration::from_secs(2)));
        exchange(&pool, &authority).await;
        exchange(&pool, &authority).await;
        assert_eq!(pool.connections_opened(), 1, "the second reused the first");
        pool.forget(&authority);
        exchange(&pool, &authority).await;
        assert_eq!(
            pool.connections_opened(),
            2,
            "a new connection after it left"
        );
    }

    fn request(authority: &str) -> http::Request<Full<Bytes>> {
        http::Request::post(format!("http://{authority}/v1/completions"))
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap()
    }

    /// A connection to `authority` whose engine has closed it, and the pool knows it.
    async fn closed_connection(pool: &Upstream, authority: &str) -> Connection {
        let mut conn = pool.connection(authority).await.unwrap();
        tokio::time::timeout(Duration::from_secs(10), &mut conn.task)
            .await
            .expect("the connection task ends once the engine closed it")
            .expect("the connection task ends without panicking");
        conn
    }

    #[tokio::test]
    async fn a_request_a_closed_pooled_connection_never_wrote_is_sent_on_a_new_one() {
        let authority = closes_its_first_connection().await;
        let pool = Arc::new(Upstream::new(Duration::from_secs(2)));
        let mut conn = closed_connection(&pool, &authority).await;
        conn.reused = true;
        let (response, lease) = pool
            .send(conn, &authority, request(&authority))
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(pool.connections_opened(), 2);
        drop(lease);
    }

    #[tokio::test]
    async fn a_request_a_new_connection_never_wrote_did_not_reach_the_engine() {
        let authority = closes_its_first_connection().await;
        let pool = Arc::new(Upstream::new(Duration::from_secs(2)));
        let conn = closed_connection(&pool, &authority).await;
        let failed = pool.send(conn, &authority, request(&authority)).await;
        assert!(
            matches!(failed, Err(UpstreamError::Connect(_))),
            "sent once, and may be retried elsewhere: {:?}",
            failed.err()
        );
        assert_eq!(pool.connections_opened(), 1);
    }
}
