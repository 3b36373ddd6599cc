//! `POST /kvroute/v1/peer/batch`: several peer messages in one request, applied in the order
//! sent under one hold of the fleet's lock. A peer's outbox sends what queued up while its last
//! request was in flight as one batch, so that messages keep their order and a peer a network
//! round trip away still takes thousands a second.
//!
//! The body is `{"messages": [{"path": "dispatch" | "prefill_done" | "ended", "body": ...}]}`,
//! each body what the single-message route takes; at most [`MAX_BATCH_MESSAGES`] entries within
//! [`BATCH_BODY_LIMIT`] bytes (what a sender ever sends), else the whole batch is refused. Every
//! entry is read and checked before the fleet's lock is taken. An entry this replica cannot
//! read (a newer peer's kind, a malformed body) or refuses (a dispatch that does not fit it) is
//! skipped, warned about and counted in `kvroute_replica_peer_messages_skipped_total`; the rest
//! are applied.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use kvroute_vllm::openai::ApiError;
use serde::Deserialize;
use tracing::warn;

use super::share::{PeerDispatch, PeerRecord, PeerRequestMessage, read_peer_message};
use crate::metrics::KindLabel;
use crate::replica_state::{BATCH_BODY_LIMIT, MAX_BATCH_MESSAGES};
use crate::reply::error_response;
use crate::service::Router;

/// A batch of peer messages.
#[derive(Debug, Deserialize)]
struct PeerBatch {
    messages: Vec<BatchEntry>,
}

/// One message of a batch: the route it would have been posted to alone, and its body.
#[derive(Debug, Deserialize)]
struct BatchEntry {
    path: String,
    body: serde_json::Value,
}

/// An entry read and checked, ready to apply under the fleet's lock.
enum Ready {
    Dispatch(PeerRecord),
    PrefillDone(u64),
    Ended(u64),
}

/// Why an entry was skipped (the `kind` of `kvroute_replica_peer_messages_skipped_total`).
const UNREADABLE: &str = "unreadable";
const REFUSED: &str = "refused";

impl BatchEntry {
    /// The entry read as its kind and checked against this replica, or why it is skipped.
    fn ready(self, router: &Router) -> Result<Ready, &'static str> {
        let request = |body| {
            serde_json::from_value::<PeerRequestMessage>(body)
                .map(|m| m.request)
                .map_err(|_| UNREADABLE)
        };
        match self.path.as_str() {
            "dispatch" => {
                let message =
                    serde_json::from_value::<PeerDispatch>(self.body).map_err(|_| UNREADABLE)?;
                PeerRecord::resolve(router, message)
                    .map(Ready::Dispatch)
                    .map_err(|_| REFUSED)
            }
            "prefill_done" => request(self.body).map(Ready::PrefillDone),
            "ended" => request(self.body).map(Ready::Ended),
            _ => Err(UNREADABLE),
        }
    }
}

/// `POST /kvroute/v1/peer/batch`.
pub async fn receive_batch(State(router): State<Arc<Router>>, request: Request) -> Response {
    let batch: PeerBatch = match read_peer_message(
        &router,
        request,
        BATCH_BODY_LIMIT,
        "a batch of peer messages",
    )
    .await
    {
        Ok(b) => b,
        Err(answer) => return answer,
    };
    if batch.messages.len() > MAX_BATCH_MESSAGES {
        let message = format!(
            "a batch of {} peer messages: at most {MAX_BATCH_MESSAGES} are taken at once",
            batch.messages.len()
        );
        return error_response(&router, &ApiError::new(413, message));
    }
    let mut ready = Vec::with_capacity(batch.messages.len());
    for entry in batch.messages {
        match entry.ready(&router) {
            Ok(entry) => ready.push(entry),
            Err(kind) => skipped(&router, kind),
        }
    }
    let mut fleet = router.fleet();
    let now = router.now();
    for entry in ready {
        match entry {
            Ready::Dispatch(record) => record.apply(&router, &mut fleet, now),
            Ready::PrefillDone(request) => {
                fleet.peer_prefill_done(request, now);
            }
            Ready::Ended(request) => {
                fleet.peer_request_ended(request, now);
            }
        }
    }
    StatusCode::NO_CONTENT.into_response()
}

/// Counts and warns about one skipped entry.
fn skipped(router: &Router, kind: &'static str) {
    router
        .metrics()
        .replica_peer_messages_skipped
        .get_or_create(&KindLabel { kind })
        .inc();
    warn!(
        kind,
        "skipped a peer message this replica cannot read or refuses (a newer or differently configured peer)"
    );
}
