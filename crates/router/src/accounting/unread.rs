//! A response its client stopped taking, over HTTP/2: among streams that move, one whose client
//! stopped reading uses up its flow-control window, the server stops asking its body for more,
//! and its socket keeps taking the other streams' bytes, so the connection's write clock
//! (`limits.write_timeout_ms`, at the HTTP edge) never runs for it. Watched here per response:
//! when the server has not asked for the next chunk for `limits.write_timeout_ms` since the last
//! was handed over, the request is given up as if its client had gone: its engine connection is
//! closed (the engine cancels), its accounting ended (`client_closed`), and the give-up counted
//! in `kvroute_client_timeouts_total{kind="unread"}`. A client that reads on gets the bytes
//! already sent, then an error event (SSE) or a reset stream: never an end that looks complete.
//! The watchdog looks once per timeout while
//! nothing waits to be taken, so a stall is caught between one and two timeouts after its last
//! chunk. Over HTTP/1.1 the connection's clock closes the connection after one (`kind="write"`).

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::debug;

use super::{Accounting, Outcome};
use crate::upstream::Lease;

/// What a response body holds until its end, shared with its watchdog.
#[derive(Default)]
pub(super) struct Held {
    /// The request's accounting, until the body ends (or is given up).
    pub(super) accounting: Option<Accounting>,
    /// The engine connection, until the body ends (or is given up).
    pub(super) lease: Option<Lease>,
    /// When the last chunk was handed to the server, if it has not asked for the next since.
    pub(super) handed_out_at: Option<Instant>,
    /// The watchdog gave the request up.
    pub(super) given_up: bool,
}

impl Held {
    /// Takes the accounting and the engine connection (both `None` once taken).
    pub(super) fn take(&mut self) -> (Option<Accounting>, Option<Lease>) {
        (self.accounting.take(), self.lease.take())
    }
}

/// [`Held`], shared.
pub(super) type SharedHeld = Arc<Mutex<Held>>;

/// Watches `held` until the body ends; gives the request up once a chunk handed over has waited
/// `timeout` for the server to ask for the next.
pub(super) fn watch(held: SharedHeld, timeout: Duration) -> JoinHandle<()> {
    tokio::spawn(async move {
        // Decided and given up under one lock: a body asked for more meanwhile is not given up.
        let (accounting, lease) = loop {
            let due = {
                let mut h = held.lock();
                if h.accounting.is_none() && h.lease.is_none() {
                    return; // ended
                }
                match h.handed_out_at.map(|at| at + timeout) {
                    Some(due) if due <= Instant::now() => {
                        h.given_up = true;
                        break h.take();
                    }
                    due => due,
                }
            };
            match due {
                Some(due) => tokio::time::sleep_until(due).await,
                // The server asks for more, or the engine has not answered yet: look again a
                // timeout later.
                None => tokio::time::sleep(timeout).await,
            }
        };
        // Closing the engine connection cancels the request there.
        drop(lease);
        if let Some(mut acc) = accounting {
            acc.outcome = Some(Outcome::ClientClosed);
            acc.router
                .metrics()
                .client_timeouts
                .get_or_create(&crate::metrics::KindLabel { kind: "unread" })
                .inc();
            debug!(endpoint = %acc.endpoint.name, request_id = %acc.request_id,
                "the client took none of its response for limits.write_timeout_ms; giving the request up");
        }
    })
}
