//! Request bodies at the edge: read within a deadline, and each byte charged to the listener's
//! budget of buffered request bytes as it arrives; response bodies that tell the connection when
//! they end.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use http_body_util::{BodyExt, Limited};
use kvroute_vllm::openai::ApiError;
use tokio::time::Sleep;

use super::conn::InFlight;
use crate::RouterError;
use crate::budget::BudgetHold;
use crate::service::Router;

/// A client's request body: fails with [`RouterError::ClientTimeout`] when it is not complete
/// by its deadline, and with [`RouterError::Overloaded`] when the buffered-bytes budget is
/// spent.
pub struct EdgeBody<B> {
    inner: B,
    deadline: Pin<Box<Sleep>>,
    timeout: Duration,
    hold: Arc<BudgetHold>,
    failed: bool,
    read_to_end: ReadToEnd,
}

/// Whether a request's body was read to its end: shared by the body and the edge, which asks
/// once the handler has answered.
#[derive(Clone, Debug)]
pub struct ReadToEnd(Arc<AtomicBool>);

impl ReadToEnd {
    /// For a body that is (`true`: it has none) or is not yet read to its end.
    pub fn new(already: bool) -> Self {
        Self(Arc::new(AtomicBool::new(already)))
    }

    /// Whether the body was read to its end.
    pub fn get(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }

    fn set(&self) {
        self.0.store(true, Ordering::Release);
    }
}

impl<B> EdgeBody<B> {
    /// `inner`, due complete within `timeout` from now; `read_to_end` is set once it has been
    /// read to its end.
    pub fn new(inner: B, timeout: Duration, hold: Arc<BudgetHold>, read_to_end: ReadToEnd) -> Self {
        Self {
            inner,
            deadline: Box::pin(tokio::time::sleep(timeout)),
            timeout,
            hold,
            failed: false,
            read_to_end,
        }
    }
}

impl<B> HttpBody for EdgeBody<B>
where
    B: HttpBody<Data = Bytes> + Unpin,
    B::Error: Into<axum::BoxError>,
{
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if self.failed {
            return Poll::Ready(None);
        }
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        let error = match polled {
            Poll::Ready(Some(Ok(frame))) => match frame.data_ref() {
                Some(data) if !self.hold.charge(data.len()) => RouterError::Overloaded(
                    "the router holds as many request bytes as it may; retry shortly".into(),
                ),
                _ => {
                    // A reader may stop at the last frame without polling the end (it asks
                    // `is_end_stream`); the body is read to its end all the same.
                    if self.inner.is_end_stream() {
                        self.read_to_end.set();
                    }
                    return Poll::Ready(Some(Ok(frame)));
                }
            },
            Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e.into()))),
            Poll::Ready(None) => {
                self.read_to_end.set();
                return Poll::Ready(None);
            }
            Poll::Pending => match self.deadline.as_mut().poll(cx) {
                Poll::Ready(()) => RouterError::ClientTimeout(format!(
                    "the request body did not arrive within {:?}",
                    self.timeout
                )),
                Poll::Pending => return Poll::Pending,
            },
        };
        self.failed = true;
        Poll::Ready(Some(Err(Box::new(error))))
    }

    fn is_end_stream(&self) -> bool {
        self.failed || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A response body that keeps its request in progress on its connection until it is dropped
/// (sent to the end, or abandoned).
pub struct Finishing {
    inner: Body,
    _request: InFlight,
}

impl Finishing {
    /// Wraps a response body.
    pub fn new(inner: Body, request: InFlight) -> Self {
        Self {
            inner,
            _request: request,
        }
    }
}

impl HttpBody for Finishing {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Reads a body up to the configured limit. A body the edge cut off answers 408 (too slow) or
/// 503 (the router's buffered-bytes budget is spent).
pub(crate) async fn read_body(router: &Router, body: Body) -> Result<Bytes, ApiError> {
    read_body_within(body, router.config().limits.max_body_bytes).await
}

/// Reads a body of at most `limit` bytes (413 past it), for messages far smaller than a request.
pub(crate) async fn read_body_within(body: Body, limit: usize) -> Result<Bytes, ApiError> {
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) => Err(body_error(limit, e.as_ref())),
    }
}

/// The answer to a body that could not be read: the error's chain names the cause.
fn body_error(limit: usize, e: &(dyn std::error::Error + 'static)) -> ApiError {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(current) = cause {
        if current
            .downcast_ref::<http_body_util::LengthLimitError>()
            .is_some()
        {
            return ApiError::too_large(format!("request body larger than {limit} bytes"));
        }
        if let Some(e @ (RouterError::ClientTimeout(_) | RouterError::Overloaded(_))) =
            current.downcast_ref::<RouterError>()
        {
            return e.api_error();
        }
        cause = current.source();
    }
    ApiError::bad_request(format!("cannot read the request body: {e}"), None)
}

#[cfg(test)]
mod tests {
    use http_body_util::{BodyExt, Full};
    use prometheus_client::metrics::gauge::Gauge;

    use super::*;
    use crate::budget::ByteBudget;

    fn edge_body(bytes: &'static [u8], budget: usize) -> (EdgeBody<Full<Bytes>>, ReadToEnd) {
        let hold = Arc::new(ByteBudget::new(budget, Gauge::default()).hold());
        let read_to_end = ReadToEnd::new(false);
        let body = EdgeBody::new(
            Full::new(Bytes::from_static(bytes)),
            Duration::from_secs(5),
            hold,
            read_to_end.clone(),
        );
        (body, read_to_end)
    }

    #[tokio::test]
    async fn a_body_whose_last_frame_was_taken_counts_as_read_to_its_end() {
        let (mut body, read_to_end) = edge_body(b"{\"prompt\": \"hi\"}", 1024);
        let frame = body.frame().await.expect("a frame").expect("data");
        assert_eq!(frame.into_data().unwrap().len(), 16);
        assert!(body.is_end_stream());
        assert!(
            read_to_end.get(),
            "a reader that stops at is_end_stream has read the whole body: the connection may be reused"
        );
    }

    #[tokio::test]
    async fn a_body_refused_part_way_is_not_read_to_its_end() {
        let (mut body, read_to_end) = edge_body(b"0123456789", 4);
        assert!(
            body.frame().await.expect("an answer").is_err(),
            "over budget"
        );
        assert!(
            !read_to_end.get(),
            "its bytes were never taken off the connection"
        );
    }
}
