//! Connections to engines for proxied requests.
//!
//! A small pool of HTTP/1.1 connections per endpoint, each owned by the router so that when a
//! client goes away mid-stream the engine's connection is closed at once (and the engine
//! cancels the request). A connection whose response was read to the end goes back to the
//! pool; any other is dropped.

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
        self.opened.fetch_add(1, Ordering::Relaxed);
        let (sender, conn) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| UpstreamError::Connect(e.to_string()))?;
        let task = tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(Connection { sender, task })
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
                        return Ok(conn);
                    }
                    conn.task.abort();
                }
                Some(conn) => conn.task.abort(),
                None => return self.connect(authority).await,
            }
        }
    }

    /// Sends a request on `conn` (from [`Upstream::connection`] for `authority`).
    pub async fn send(
        self: &Arc<Self>,
        mut conn: Connection,
        authority: &str,
        request: http::Request<Full<Bytes>>,
    ) -> Result<(http::Response<Incoming>, Lease), UpstreamError> {
        match conn.sender.send_request(request).await {
            Ok(response) => Ok((
                response,
                Lease {
                    pool: self.clone(),
                    authority: authority.to_owned(),
                    connection: Some(conn),
                },
            )),
            Err(e) => {
                conn.task.abort();
                Err(UpstreamError::Request(e.to_string()))
            }
        }
    }
}
