//! Following a proxied response to its end and telling the fleet: prefill done at the first
//! body byte, the request finished at the end or when the client goes away, with the engine's
//! reported `cached_tokens` to compare with the prediction.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use kvroute_core::fleet::Dispatch;
use tracing::info;

use crate::endpoint::Endpoint;
use crate::metrics::endpoint as labels;
use crate::service::Router;
use crate::upstream::Lease;

/// Bytes of the response tail kept to find the usage object.
const TAIL: usize = 4096;

/// One request's share of an endpoint's load, handed back to the fleet exactly once.
pub struct Accounting {
    router: Arc<Router>,
    endpoint: Arc<Endpoint>,
    dispatch: Option<Dispatch>,
    reason: &'static str,
    request_id: String,
    started: Instant,
    /// Upstream status (0 until response headers arrived).
    pub status: u16,
    tail: Vec<u8>,
}

impl Accounting {
    /// Takes over a dispatched request's accounting.
    pub fn new(
        router: Arc<Router>,
        dispatch: Dispatch,
        reason: &'static str,
        request_id: String,
        started: Instant,
    ) -> Self {
        let endpoint = router.endpoint(dispatch.endpoint).clone();
        Self {
            router,
            endpoint,
            dispatch: Some(dispatch),
            reason,
            request_id,
            started,
            status: 0,
            tail: Vec::new(),
        }
    }

    fn first_byte(&mut self) {
        let Some(dispatch) = self.dispatch.as_mut() else {
            return;
        };
        if dispatch.prefill_done() {
            return;
        }
        let now = self.router.now();
        self.router
            .fleet()
            .first_token(dispatch, self.status == 200, now);
        self.router
            .metrics()
            .first_byte_seconds
            .get_or_create(&labels(&self.endpoint.name))
            .observe(self.started.elapsed().as_secs_f64());
        self.router.capacity_changed();
    }

    /// Sees a chunk of the response body: the first one marks the prefill done; the tail is
    /// kept to read the engine's reported `cached_tokens` at the end.
    pub fn observe(&mut self, data: &[u8]) {
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
        let Some(dispatch) = self.dispatch.take() else {
            return;
        };
        // Released on completion and on client disconnect alike.
        let reported = self.reported_cached();
        let completed = dispatch.prefill_done();
        let predicted = dispatch.predicted_cached;
        let prompt_tokens = dispatch.prompt_tokens;
        let now = self.router.now();
        self.router.fleet().finished(dispatch, reported, now);
        self.router.capacity_changed();
        let m = self.router.metrics();
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
        if let Some(reported) = reported {
            m.predicted_cached_tokens
                .get_or_create(&labels(name))
                .inc_by(predicted as u64);
            m.reported_cached_tokens
                .get_or_create(&labels(name))
                .inc_by(reported as u64);
            let outcome = match predicted.cmp(&reported) {
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
        }
        info!(
            request_id = %self.request_id,
            endpoint = %name,
            reason = self.reason,
            status = self.status,
            prompt_tokens,
            predicted_cached = predicted,
            reported_cached = ?reported,
            seconds = elapsed,
            completed,
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
