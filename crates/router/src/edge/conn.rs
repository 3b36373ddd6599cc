//! One client connection's clock: when it started sending a request head, whether a request is
//! in progress, when a byte last moved, and since when the client has taken none of the bytes
//! the router is sending, so that slow heads, idle connections and clients that stopped reading
//! are closed.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::Instant;

use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{Notify, OwnedSemaphorePermit};

/// Why a connection is due to be closed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expiry {
    /// A request head started and did not complete in time.
    Header,
    /// No request in progress and no byte received for too long.
    Idle,
    /// The client took none of the bytes sent to it for too long: its socket's buffers stayed
    /// full, as when it stopped reading a stream but keeps the connection open.
    Write,
}

impl Expiry {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Expiry::Header => "header",
            Expiry::Idle => "idle",
            Expiry::Write => "write",
        }
    }
}

#[derive(Debug)]
struct State {
    active: usize,
    /// The connection carries HTTP/2: its reads between requests are frames (window updates,
    /// pings, settings), not the head of a next request.
    multiplexed: bool,
    /// It was idle too long and was told it closes: it has `header_timeout` to let go.
    closing: bool,
    head_started: Option<Instant>,
    last_io: Instant,
    /// Since when a write has waited for the socket to take bytes (`None` once one was taken).
    write_blocked_since: Option<Instant>,
}

/// A connection's activity, shared by its I/O, its requests and its watchdog.
#[derive(Debug)]
pub struct Activity {
    state: Mutex<State>,
    /// Wakes the watchdog when the deadline moves earlier (a head started, a request ended).
    changed: Notify,
    header_timeout: Duration,
    idle_timeout: Duration,
    write_timeout: Duration,
}

impl Activity {
    /// A fresh connection.
    pub fn new(header_timeout: Duration, idle_timeout: Duration, write_timeout: Duration) -> Self {
        Self {
            state: Mutex::new(State {
                active: 0,
                multiplexed: false,
                closing: false,
                head_started: None,
                last_io: Instant::now(),
                write_blocked_since: None,
            }),
            changed: Notify::new(),
            header_timeout,
            idle_timeout,
            write_timeout,
        }
    }

    /// Resolves when the deadline may have moved.
    pub async fn changed(&self) {
        self.changed.notified().await;
    }

    fn on_read(&self) {
        let mut s = self.state.lock();
        if s.active == 0 && s.multiplexed {
            // Frames between HTTP/2 requests (pings, window updates) neither start a request
            // nor keep an idle connection open: its idle clock runs from its last request.
            return;
        }
        s.last_io = Instant::now();
        if s.active == 0 && s.head_started.is_none() {
            s.head_started = Some(s.last_io);
            self.changed.notify_one();
        }
    }

    /// A write's outcome: the socket took bytes, or it is full and the write waits.
    fn on_write(&self, result: &Poll<io::Result<usize>>) {
        match result {
            Poll::Pending => {
                let mut s = self.state.lock();
                if s.write_blocked_since.is_none() {
                    s.write_blocked_since = Some(Instant::now());
                    self.changed.notify_one();
                }
            }
            Poll::Ready(Ok(n)) if *n > 0 => self.state.lock().write_blocked_since = None,
            Poll::Ready(_) => {}
        }
    }

    /// The idle connection was told it closes: the client has `header_timeout` from now to
    /// let go.
    pub fn closing(&self) {
        let mut s = self.state.lock();
        s.closing = true;
        s.last_io = Instant::now();
    }

    /// A request's head was read: it is in progress until [`Activity::request_finished`].
    /// `multiplexed`: it came over HTTP/2.
    fn request_started(&self, multiplexed: bool) {
        let mut s = self.state.lock();
        s.active += 1;
        s.multiplexed |= multiplexed;
        s.head_started = None;
    }

    /// A request's response was sent (or abandoned).
    fn request_finished(&self) {
        let mut s = self.state.lock();
        s.active = s.active.saturating_sub(1);
        s.last_io = Instant::now();
        self.changed.notify_one();
    }

    /// When the connection is due to close if nothing changes, and why: while the client takes
    /// none of what is sent to it, the write clock, whatever else goes on (a response's own
    /// timeouts run only while the server reads it, which it stops doing once the socket is
    /// full); else `None` while a request is in progress (requests have their own timeouts).
    pub fn deadline(&self) -> Option<(Instant, Expiry)> {
        let s = self.state.lock();
        if let Some(since) = s.write_blocked_since {
            Some((since + self.write_timeout, Expiry::Write))
        } else if s.active > 0 {
            None
        } else if let Some(started) = s.head_started {
            Some((started + self.header_timeout, Expiry::Header))
        } else if s.closing {
            Some((s.last_io + self.header_timeout, Expiry::Idle))
        } else {
            Some((s.last_io + self.idle_timeout, Expiry::Idle))
        }
    }
}

/// A request in progress on its connection, from its head until this is dropped (with its
/// response body once sent, or with the handler if the client left first).
pub struct InFlight {
    activity: Arc<Activity>,
    /// Its place among the listener's requests in progress, given back with it.
    _permit: Option<OwnedSemaphorePermit>,
}

impl InFlight {
    /// Marks a request started (`multiplexed`: over HTTP/2).
    pub fn start(activity: Arc<Activity>, multiplexed: bool) -> Self {
        activity.request_started(multiplexed);
        Self {
            activity,
            _permit: None,
        }
    }

    /// The request holds `permit` until it ends.
    pub fn holding(mut self, permit: OwnedSemaphorePermit) -> Self {
        self._permit = Some(permit);
        self
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.activity.request_finished();
    }
}

/// A socket that reports reads, and writes taken or waiting, to its connection's [`Activity`].
pub struct TrackedIo<T> {
    io: T,
    activity: Arc<Activity>,
    /// Its last write waited (the activity was told): only a change is reported, so a socket
    /// that takes its writes takes no lock for them.
    write_blocked: bool,
}

impl<T> TrackedIo<T> {
    /// Wraps `io`.
    pub fn new(io: T, activity: Arc<Activity>) -> Self {
        Self {
            io,
            activity,
            write_blocked: false,
        }
    }

    /// Reports a write's `result` to the activity when it changes whether writes wait.
    fn note_write(&mut self, result: &Poll<io::Result<usize>>) {
        let blocked = match result {
            Poll::Pending => true,
            Poll::Ready(Ok(n)) if *n > 0 => false,
            Poll::Ready(_) => return,
        };
        if blocked != self.write_blocked {
            self.write_blocked = blocked;
            self.activity.on_write(result);
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for TrackedIo<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let result = Pin::new(&mut self.io).poll_read(cx, buf);
        if matches!(result, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.activity.on_read();
        }
        result
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for TrackedIo<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let result = Pin::new(&mut self.io).poll_write(cx, buf);
        self.note_write(&result);
        result
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let result = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.note_write(&result);
        result
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connection's clocks with a 1 s header timeout, 60 s idle timeout and 30 s write
    /// timeout.
    fn activity() -> Activity {
        Activity::new(
            Duration::from_secs(1),
            Duration::from_secs(60),
            Duration::from_secs(30),
        )
    }

    #[test]
    fn a_started_head_runs_the_header_clock_and_a_request_stops_every_clock() {
        let a = activity();
        assert_eq!(a.deadline().map(|d| d.1), Some(Expiry::Idle));
        a.on_read();
        assert_eq!(a.deadline().map(|d| d.1), Some(Expiry::Header));
        let a = Arc::new(a);
        let request = InFlight::start(a.clone(), false);
        assert_eq!(a.deadline(), None);
        a.on_read();
        drop(request);
        assert_eq!(a.deadline().map(|d| d.1), Some(Expiry::Idle));
    }

    /// Between HTTP/2 requests a client sends frames (window updates, pings): they are no
    /// request head, so the idle clock runs, and an idle connection is told it closes before it
    /// is dropped.
    #[test]
    fn frames_between_http2_requests_run_the_idle_clock_and_closing_gives_a_grace() {
        let a = Arc::new(activity());
        drop(InFlight::start(a.clone(), true));
        let idle_from = a.deadline().unwrap().0;
        a.on_read();
        let (at, why) = a.deadline().unwrap();
        assert_eq!(why, Expiry::Idle);
        assert_eq!(at, idle_from, "a frame does not keep it open");
        assert!(
            at >= Instant::now() + Duration::from_secs(59),
            "the idle timeout, not the header's"
        );
        a.closing();
        let (at, why) = a.deadline().unwrap();
        assert_eq!(why, Expiry::Idle);
        assert!(
            at <= Instant::now() + Duration::from_secs(1),
            "the close's grace"
        );
    }

    #[test]
    fn a_full_socket_runs_the_write_clock_even_while_a_request_is_in_progress() {
        let a = Arc::new(activity());
        let request = InFlight::start(a.clone(), false);
        a.on_write(&Poll::Ready(Ok(100)));
        assert_eq!(a.deadline(), None);
        a.on_write(&Poll::Pending);
        let (at, why) = a.deadline().unwrap();
        assert_eq!(why, Expiry::Write);
        // A later wait keeps the first one's start: the clock runs from the first byte refused.
        a.on_write(&Poll::Pending);
        assert_eq!(a.deadline(), Some((at, Expiry::Write)));
        // A write the socket takes stops it.
        a.on_write(&Poll::Ready(Ok(1)));
        assert_eq!(a.deadline(), None);
        drop(request);
        assert_eq!(a.deadline().map(|d| d.1), Some(Expiry::Idle));
    }
}
