//! Following a proxied response to its end: in-flight load up at dispatch, prefill done at the
//! first body byte, everything released at the end or when the client goes away; and the
//! engine's reported `cached_tokens` compared with the router's prediction.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use tracing::info;

use crate::fleet::Endpoint;
use crate::metrics::endpoint as labels;
use crate::service::Router;
use crate::upstream::Lease;

/// How long a prediction outlives its request's first byte: the time the engine's
/// `BlockStored` needs to reach the router.
const PREDICTION_GRACE_S: f64 = 0.25;

/// Bytes of the response tail kept to find the usage object.
const TAIL: usize = 4096;

/// One request's share of an endpoint's load, released exactly once.
pub struct Accounting {
    /// The router.
    pub router: Arc<Router>,
    /// Where the request went.
    pub endpoint: Arc<Endpoint>,
    /// Uncached prompt tokens counted into the endpoint's prefill queue.
    pub uncached_tokens: u64,
    /// Cached tokens the router predicted.
    pub predicted_cached: usize,
    /// Prompt length.
    pub prompt_tokens: usize,
    /// Decision reason, for metrics and the log line.
    pub reason: &'static str,
    /// Request id, for the log line.
    pub request_id: String,
    /// When the router received the request.
    pub started: Instant,
    /// Upstream status.
    pub status: u16,
    /// The request's block keys, to retire its prediction once the engine's events can speak.
    pub keys: std::sync::Arc<Vec<kvroute_core::keys::RouterKey>>,
    prefill_done: bool,
    tail: Vec<u8>,
}

impl Accounting {
    /// Takes the load: call when the request is dispatched.
    #[allow(clippy::too_many_arguments)]
    pub fn dispatch(
        router: Arc<Router>,
        endpoint: Arc<Endpoint>,
        uncached_tokens: u64,
        predicted_cached: usize,
        prompt_tokens: usize,
        reason: &'static str,
        request_id: String,
        started: Instant,
    ) -> Self {
        endpoint.inflight.fetch_add(1, Ordering::Relaxed);
        endpoint.inflight_prefills.fetch_add(1, Ordering::Relaxed);
        endpoint
            .inflight_prefill_tokens
            .fetch_add(uncached_tokens, Ordering::Relaxed);
        Self {
            router,
            endpoint,
            uncached_tokens,
            predicted_cached,
            prompt_tokens,
            reason,
            request_id,
            started,
            status: 0,
            keys: std::sync::Arc::default(),
            prefill_done: false,
            tail: Vec::new(),
        }
    }

    fn first_byte(&mut self) {
        if self.prefill_done {
            return;
        }
        self.prefill_done = true;
        self.endpoint
            .inflight_prefills
            .fetch_sub(1, Ordering::Relaxed);
        self.endpoint
            .inflight_prefill_tokens
            .fetch_sub(self.uncached_tokens, Ordering::Relaxed);
        let seconds = self.started.elapsed().as_secs_f64();
        self.router
            .metrics
            .first_byte_seconds
            .get_or_create(&labels(&self.endpoint.name))
            .observe(seconds);
        if self.status == 200 {
            self.endpoint.note_prefill(self.uncached_tokens, seconds);
        }
        // The prefill is done, so the engine has published (or is about to publish) these
        // blocks: from now on its events, not the prediction, say what it holds.
        if !self.keys.is_empty() {
            let expiry = self.router.now() + PREDICTION_GRACE_S;
            self.router
                .predicted
                .lock()
                .shorten(self.endpoint.id, &self.keys, expiry);
        }
    }

    fn observe(&mut self, data: &[u8]) {
        self.first_byte();
        self.tail.extend_from_slice(data);
        if self.tail.len() > 2 * TAIL {
            self.tail.drain(..self.tail.len() - TAIL);
        }
    }

    /// The last `"cached_tokens": N` in the response, if any.
    fn reported_cached(&self) -> Option<usize> {
        let text = String::from_utf8_lossy(&self.tail);
        let at = text.rfind("\"cached_tokens\"")?;
        let rest = text[at + "\"cached_tokens\"".len()..]
            .trim_start()
            .strip_prefix(':')?
            .trim_start();
        let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
        digits.parse().ok()
    }
}

impl Drop for Accounting {
    fn drop(&mut self) {
        // Released on completion and on client disconnect alike.
        if !self.prefill_done {
            self.endpoint
                .inflight_prefills
                .fetch_sub(1, Ordering::Relaxed);
            self.endpoint
                .inflight_prefill_tokens
                .fetch_sub(self.uncached_tokens, Ordering::Relaxed);
        }
        self.endpoint.inflight.fetch_sub(1, Ordering::Relaxed);
        let m = &self.router.metrics;
        let name = &self.endpoint.name;
        let elapsed = self.started.elapsed().as_secs_f64();
        m.request_seconds
            .get_or_create(&labels(name))
            .observe(elapsed);
        let class = format!("{}xx", self.status / 100);
        m.requests
            .get_or_create(&vec![
                ("endpoint", name.clone()),
                ("reason", self.reason.to_owned()),
                ("status", class),
            ])
            .inc();
        let reported = self.reported_cached();
        if let Some(reported) = reported {
            m.predicted_cached_tokens
                .get_or_create(&labels(name))
                .inc_by(self.predicted_cached as u64);
            m.reported_cached_tokens
                .get_or_create(&labels(name))
                .inc_by(reported as u64);
            let outcome = match self.predicted_cached.cmp(&reported) {
                std::cmp::Ordering::Equal => "exact",
                std::cmp::Ordering::Greater => "over",
                std::cmp::Ordering::Less => "under",
            };
            m.prediction_outcomes
                .get_or_create(&vec![
                    ("endpoint", name.clone()),
                    ("outcome", outcome.to_owned()),
                ])
                .inc();
            self.endpoint
                .note_prediction(self.predicted_cached, reported, self.prompt_tokens);
        }
        info!(
            request_id = %self.request_id,
            endpoint = %name,
            reason = self.reason,
            status = self.status,
            prompt_tokens = self.prompt_tokens,
            predicted_cached = self.predicted_cached,
            reported_cached = ?reported,
            seconds = elapsed,
            completed = self.prefill_done,
            "routed"
        );
    }
}

/// A response body passed through chunk by chunk while its accounting watches. It holds the
/// engine connection: read to the end, the connection is reused; dropped early (the client went
/// away), the connection is closed and the engine cancels the request.
pub struct AccountedBody<B> {
    inner: B,
    accounting: Option<Accounting>,
    lease: Option<Lease>,
}

impl<B> AccountedBody<B> {
    /// Wraps `inner`.
    pub fn new(inner: B, accounting: Accounting, lease: Lease) -> Self {
        Self {
            inner,
            accounting: Some(accounting),
            lease: Some(lease),
        }
    }
}

impl<B> Body for AccountedBody<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let poll = Pin::new(&mut self.inner).poll_frame(cx);
        match &poll {
            Poll::Ready(Some(Ok(frame))) => {
                if let (Some(data), Some(acc)) = (frame.data_ref(), self.accounting.as_mut()) {
                    acc.observe(data);
                }
                // A body of known length ends with its last byte: the server will not poll
                // again for the `None` that would release the connection, so release it now.
                if self.inner.is_end_stream() {
                    self.accounting.take();
                    if let Some(lease) = self.lease.take() {
                        lease.release();
                    }
                }
            }
            // End of body: release now rather than when the connection lets go.
            Poll::Ready(None) => {
                self.accounting.take();
                if let Some(lease) = self.lease.take() {
                    lease.release();
                }
            }
            Poll::Ready(Some(Err(_))) => {
                self.accounting.take();
                self.lease.take();
            }
            Poll::Pending => {}
        }
        poll
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
