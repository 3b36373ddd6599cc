//! Request bodies at the edge: read within a deadline, and counted against the router-wide
//! budget of buffered request bytes; response bodies that tell the connection when they end.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use parking_lot::Mutex;
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::Semaphore;
use tokio::time::Sleep;

use super::conn::InFlight;
use crate::RouterError;

/// The bytes one request holds of the router-wide budget; given back when the last holder
/// (its body, or the handler waiting for the engine's response) drops it.
pub struct BudgetHold {
    budget: Arc<Semaphore>,
    gauge: Gauge,
    /// (bytes acquired, bytes of them used by received data)
    held: Mutex<(u32, u32)>,
}

impl BudgetHold {
    /// Holds nothing yet.
    pub fn new(budget: Arc<Semaphore>, gauge: Gauge) -> Self {
        Self {
            budget,
            gauge,
            held: Mutex::new((0, 0)),
        }
    }

    /// Reserves `bytes` ahead (a declared `Content-Length`); false when the budget lacks them.
    pub fn reserve(&self, bytes: usize) -> bool {
        let mut held = self.held.lock();
        self.acquire(&mut held, bytes)
    }

    /// Counts `bytes` of received data, from the reservation first; false when the budget
    /// lacks them.
    fn receive(&self, bytes: usize) -> bool {
        let mut held = self.held.lock();
        let spare = (held.0 - held.1) as usize;
        if bytes > spare && !self.acquire(&mut held, bytes - spare) {
            return false;
        }
        held.1 = held.1.saturating_add(bytes as u32).min(held.0);
        true
    }

    fn acquire(&self, held: &mut (u32, u32), bytes: usize) -> bool {
        let Ok(n) = u32::try_from(bytes) else {
            return false;
        };
        match self.budget.try_acquire_many(n) {
            Ok(permit) => {
                permit.forget();
                held.0 += n;
                self.gauge.inc_by(i64::from(n));
                true
            }
            Err(_) => false,
        }
    }
}

impl Drop for BudgetHold {
    fn drop(&mut self) {
        let (acquired, _) = *self.held.get_mut();
        self.budget.add_permits(acquired as usize);
        self.gauge.dec_by(i64::from(acquired));
    }
}

/// A client's request body: fails with [`RouterError::ClientTimeout`] when it is not complete
/// by its deadline, and with [`RouterError::Overloaded`] when the buffered-bytes budget is
/// spent.
pub struct EdgeBody<B> {
    inner: B,
    deadline: Pin<Box<Sleep>>,
    timeout: Duration,
    hold: Arc<BudgetHold>,
    failed: bool,
}

impl<B> EdgeBody<B> {
    /// `inner`, due complete within `timeout` from now.
    pub fn new(inner: B, timeout: Duration, hold: Arc<BudgetHold>) -> Self {
        Self {
            inner,
            deadline: Box::pin(tokio::time::sleep(timeout)),
            timeout,
            hold,
            failed: false,
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
                Some(data) if !self.hold.receive(data.len()) => RouterError::Overloaded(
                    "the router holds as many request bytes as it may; retry shortly".into(),
                ),
                _ => return Poll::Ready(Some(Ok(frame))),
            },
            Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e.into()))),
            Poll::Ready(None) => return Poll::Ready(None),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_draw_on_one_budget_and_give_it_back() {
        let budget = Arc::new(Semaphore::new(100));
        let gauge = Gauge::default();
        let a = BudgetHold::new(budget.clone(), gauge.clone());
        assert!(a.reserve(60));
        assert!(a.receive(50), "within the reservation");
        assert!(a.receive(20), "10 left reserved, 10 more acquired");
        assert_eq!(gauge.get(), 70);
        let b = BudgetHold::new(budget.clone(), gauge.clone());
        assert!(!b.reserve(31));
        assert!(b.receive(30));
        drop(a);
        drop(b);
        assert_eq!((budget.available_permits(), gauge.get()), (100, 0));
    }
}
