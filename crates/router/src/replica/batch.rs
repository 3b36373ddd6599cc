//! `POST /kvroute/v1/peer/batch`: several peer messages in one request, applied in the order
//! sent under one hold of the fleet's lock. A peer's outbox sends what queued up while its last
//! request was in flight as one batch, so that messages keep their order and a peer a network
//! round trip away still takes thousands a second.
//!
//! The body is `{"messages": [{"path": "dispatch" | "prefill_done" | "ended", "body": ...}]}`,
//! each body what the single-message route takes. An entry this replica cannot read (a newer
//! peer's kind, a malformed body) or refuses (a dispatch that does not fit it) is skipped and
//! warned about; the rest are applied.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use tracing::warn;

use super::share::{PeerDispatch, PeerRequestMessage, read_peer_message, record_dispatch};
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

/// `POST /kvroute/v1/peer/batch`.
pub async fn receive_batch(State(router): State<Arc<Router>>, request: Request) -> Response {
    let limit = router.config().limits.max_body_bytes;
    let batch: PeerBatch =
        match read_peer_message(&router, request, limit, "a batch of peer messages").await {
            Ok(b) => b,
            Err(answer) => return answer,
        };
    let now = router.now();
    let mut skipped = 0usize;
    let mut fleet = router.fleet();
    for entry in batch.messages {
        let applied = match entry.path.as_str() {
            "dispatch" => serde_json::from_value::<PeerDispatch>(entry.body)
                .ok()
                .is_some_and(|m| record_dispatch(&router, &mut fleet, m, now).is_ok()),
            "prefill_done" => serde_json::from_value::<PeerRequestMessage>(entry.body)
                .map(|m| fleet.peer_prefill_done(m.request, now))
                .is_ok(),
            "ended" => serde_json::from_value::<PeerRequestMessage>(entry.body)
                .map(|m| fleet.peer_request_ended(m.request, now))
                .is_ok(),
            _ => false,
        };
        skipped += usize::from(!applied);
    }
    drop(fleet);
    if skipped > 0 {
        warn!(
            skipped,
            "skipped peer messages this replica cannot read or refuses (a newer or differently configured peer)"
        );
    }
    StatusCode::NO_CONTENT.into_response()
}
