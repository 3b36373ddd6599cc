//! A proxied response body on its way to the client, watched to its end: each chunk is shown to
//! the request's [`Accounting`]; the engine connection is handed back for reuse at the end.
//!
//! A stream can be cut three ways ([`Cut`]): the router closes (the end of a drain), the engine
//! sends nothing for too long (`limits.response_timeout_s` before the first body byte,
//! `limits.stream_idle_timeout_s` between chunks after it), or the engine's connection fails
//! mid-body. Each is counted (`kvroute_streams_cut_total{reason}`), the engine connection is
//! closed (the engine cancels), and an SSE client gets an OpenAI-shaped error event as the
//! stream's last event rather than a silently truncated stream. A client that stops taking the
//! stream is given up by its watchdog ([`super::unread`]).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use kvroute_core::fleet::UpstreamOutcome;
use kvroute_vllm::openai::ApiError;
use tokio::time::Sleep;
use tracing::warn;

use super::unread::{Held, SharedHeld};
use super::{Accounting, Outcome};
use crate::shutdown::Phase;
use crate::upstream::Lease;

/// The error a proxied body ends with (the engine's own, or the router's cut).
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Why a stream was cut before its end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cut {
    /// The router closed (a drain ran out of time, or a second signal).
    Shutdown,
    /// The engine sent nothing for too long.
    Stalled,
    /// The engine's connection failed mid-body.
    EngineError,
}

/// A body that wants to know why its stream is cut (before it is dropped): a prefill/decode
/// transfer watch, whose pair a decode leg that stalls or breaks before its first byte strikes.
pub trait CutAware {
    /// The stream was cut for `why`.
    fn cut(&mut self, why: Cut);
}

impl Cut {
    /// The `reason` label of `kvroute_streams_cut_total`.
    pub fn label(self) -> &'static str {
        match self {
            Cut::Shutdown => "shutdown",
            Cut::Stalled => "stalled",
            Cut::EngineError => "engine_error",
        }
    }

    fn outcome(self) -> Outcome {
        match self {
            Cut::Shutdown | Cut::Stalled => Outcome::Timeout,
            Cut::EngineError => Outcome::EngineError,
        }
    }
}

/// The SSE event that ends a stream with `error` (OpenAI's error object, as vLLM sends it
/// mid-stream).
pub fn sse_error_event(error: &ApiError) -> Bytes {
    Bytes::from(format!("data: {}\n\n", error.to_json()))
}

/// A response body passed through chunk by chunk while its accounting watches. It holds the
/// engine connection: read to the end, the connection is reused; dropped early (the client went
/// away) or cut, the connection is closed and the engine cancels the request.
pub struct AccountedBody<B> {
    inner: B,
    /// The accounting and the engine connection, shared with the watchdog.
    held: SharedHeld,
    /// Gives the request up when its client stops taking the body.
    watchdog: Option<tokio::task::JoinHandle<()>>,
    /// Resolves when the router closes; `None` once it did.
    closing: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
    /// When the engine, silent since its last chunk, counts as stalled.
    stall: Pin<Box<Sleep>>,
    idle_timeout: Duration,
    /// The response is a server-sent event stream.
    sse: bool,
    /// Ended (cut, or passed to its end): nothing more is sent.
    done: bool,
}

impl<B> AccountedBody<B> {
    /// Wraps `inner`; `sse`: it is a server-sent event stream (ended with an error event when
    /// cut). The engine must send its first body byte within `limits.response_timeout_s` and
    /// each later one within `limits.stream_idle_timeout_s` of the one before. `multiplexed`:
    /// its client's connection carries other requests (HTTP/2), so a watchdog gives the
    /// request up when its client stops taking the body ([`super::unread`]); over HTTP/1.1 the
    /// connection's own write clock does, at no cost per request.
    pub fn new(inner: B, accounting: Accounting, lease: Lease, sse: bool, multiplexed: bool) -> Self
    where
        B: Body,
    {
        let router = accounting.router.clone();
        let limits = &router.config().limits;
        let first_byte = Duration::from_secs_f64(limits.response_timeout_s);
        let empty = inner.is_end_stream();
        let held = SharedHeld::new(parking_lot::Mutex::new(Held {
            accounting: Some(accounting),
            lease: Some(lease),
            ..Held::default()
        }));
        let unread = Duration::from_millis(limits.write_timeout_ms);
        let mut body = Self {
            inner,
            closing: Some(Box::pin(router.shutdown().reached(Phase::Closing))),
            watchdog: (multiplexed && !empty).then(|| super::unread::watch(held.clone(), unread)),
            held,
            stall: Box::pin(tokio::time::sleep(first_byte)),
            idle_timeout: Duration::from_secs_f64(limits.stream_idle_timeout_s),
            sse,
            done: false,
        };
        // An empty body (`Content-Length: 0`, a 204) is never polled: the server sees its end
        // before sending the head. It ended, and its connection goes back to the pool.
        if empty {
            body.end();
        }
        body
    }

    /// Cuts the stream: the request is accounted for as `why` says, counted, the engine
    /// connection closed, and an SSE client told why. `engine` is the engine's own error.
    fn cut(
        &mut self,
        why: Cut,
        engine: Option<BoxError>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>>
    where
        B: CutAware,
    {
        self.inner.cut(why);
        self.done = true;
        let (acc, lease) = self.held.lock().take();
        drop(lease);
        let Some(mut acc) = acc else {
            return Poll::Ready(None);
        };
        acc.outcome = Some(why.outcome());
        let router = acc.router.clone();
        let name = acc.endpoint.name.clone();
        router
            .metrics()
            .streams_cut
            .get_or_create(&crate::metrics::ReasonLabel {
                reason: why.label(),
            })
            .inc();
        let error = match why {
            Cut::Shutdown => {
                ApiError::unavailable("the router is shutting down; the stream was cut; retry")
            }
            Cut::Stalled => ApiError::engine_timeout(format!(
                "the engine {name} sent nothing for {:?}; the stream was cut",
                self.idle_timeout
            )),
            Cut::EngineError => ApiError::engine_failed(format!(
                "the engine {name} failed mid-response: {}; the stream was cut",
                engine.as_ref().map_or(String::new(), ToString::to_string)
            )),
        };
        if why != Cut::Shutdown {
            warn!(endpoint = %name, request_id = %acc.request_id, reason = why.label(), "a response stream was cut");
            router.upstream_result(acc.endpoint.id, UpstreamOutcome::Failure);
        }
        drop(acc);
        match (self.sse, why, engine) {
            (true, _, _) => Poll::Ready(Some(Ok(Frame::data(sse_error_event(&error))))),
            // Not a stream: the client sees the response end early, as before.
            (false, Cut::Shutdown, _) => Poll::Ready(None),
            (false, _, Some(engine)) => Poll::Ready(Some(Err(engine))),
            (false, _, None) => Poll::Ready(Some(Err(error.to_json().into()))),
        }
    }

    /// The last frame of a stream its watchdog gave up (the client had taken nothing for
    /// `limits.write_timeout_ms`): a client that reads on learns why, and never sees a response
    /// that looks complete. An SSE client gets an error event; any other, an error that resets
    /// the stream.
    fn given_up_end(&self) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let error = ApiError::client_timeout(
            "the client took nothing of this response for longer than limits.write_timeout_ms; \
             the response was given up",
        );
        if self.sse {
            Poll::Ready(Some(Ok(Frame::data(sse_error_event(&error)))))
        } else {
            Poll::Ready(Some(Err(error.to_json().into())))
        }
    }

    /// The body ended: account for it and hand the engine connection back for reuse.
    fn end(&mut self) {
        self.done = true;
        let (acc, lease) = self.held.lock().take();
        if let Some(mut acc) = acc {
            acc.ended = true;
        }
        if let Some(lease) = lease {
            lease.release();
        }
    }
}

impl<B> Drop for AccountedBody<B> {
    /// Dropped before its end (the client went away): accounted for now, the engine connection
    /// closed, the watchdog stopped.
    fn drop(&mut self) {
        if let Some(watchdog) = self.watchdog.take() {
            watchdog.abort();
        }
        let (acc, lease) = self.held.lock().take();
        drop(lease);
        drop(acc);
    }
}

impl<B> Body for AccountedBody<B>
where
    B: Body<Data = Bytes> + CutAware + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if self.done {
            return Poll::Ready(None);
        }
        // Only a watchdog reads or sets these (HTTP/2); over HTTP/1.1 no lock is taken here.
        if self.watchdog.is_some() {
            let mut held = self.held.lock();
            if held.given_up {
                drop(held);
                self.done = true;
                return self.given_up_end();
            }
            // Asked for more: the last chunk was taken.
            held.handed_out_at = None;
        }
        if let Some(closing) = self.closing.as_mut()
            && closing.as_mut().poll(cx).is_ready()
        {
            self.closing = None;
            return self.cut(Cut::Shutdown, None);
        }
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                let now = tokio::time::Instant::now();
                {
                    let mut held = self.held.lock();
                    if let (Some(data), Some(acc)) = (frame.data_ref(), held.accounting.as_mut()) {
                        acc.observe(data);
                    }
                    if self.watchdog.is_some() {
                        held.handed_out_at = Some(now);
                    }
                }
                let next = now + self.idle_timeout;
                self.stall.as_mut().reset(next);
                // A body of known length ends with its last byte: the server will not poll
                // again for the `None` that would release the connection, so release it now.
                if self.inner.is_end_stream() {
                    self.end();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            // End of body: release now rather than when the connection lets go.
            Poll::Ready(None) => {
                self.end();
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(e))) => self.cut(Cut::EngineError, Some(e.into())),
            Poll::Pending => match self.stall.as_mut().poll(cx) {
                Poll::Ready(()) => self.cut(Cut::Stalled, None),
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        if self.sse {
            // An error event may be added.
            SizeHint::default()
        } else {
            self.inner.size_hint()
        }
    }
}
