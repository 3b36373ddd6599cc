//! A replica's KV index as a snapshot a peer can apply: `GET /kvroute/v1/snapshot` on the admin
//! listener answers it, and a starting replica fetches and applies it.
//!
//! A starting replica asks for one endpoint at a time (`?endpoint=URL`), so that neither side
//! holds more than one endpoint's blocks at once: a whole fleet's index (1,000 endpoints ×
//! 100k blocks is 100M entries, several GB as JSON) does not fit one answer. Without the query
//! the answer is every endpoint, as peers of earlier versions give it whatever is asked; the
//! starting replica applies every endpoint an answer holds, so such a peer warms it in one
//! answer, as before.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use kvroute_core::index::{EndpointRestore, HeldEntry, KeyLayout};
use kvroute_vllm::openai::ApiError;
use serde::{Deserialize, Serialize};

use crate::endpoint::Endpoint;
use crate::reply::error_response;
use crate::service::Router;

/// Largest snapshot answer read from a peer: one endpoint's blocks (100k blocks are about
/// 6.5 MB), or a small fleet's from a peer that answers with every endpoint.
const MAX_SNAPSHOT_BYTES: usize = 1 << 30;

/// The query of `GET /kvroute/v1/snapshot`.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct SnapshotQuery {
    /// Only this endpoint (by URL); every endpoint when absent.
    pub endpoint: Option<String>,
}

/// Every endpoint's index, as a starting peer restores it.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Snapshot {
    /// One entry per endpoint with KV events.
    pub endpoints: Vec<EndpointSnapshot>,
}

/// One endpoint's index and where in its event stream it stands.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct EndpointSnapshot {
    /// The endpoint's URL (replicas name endpoints alike by URL; ids may differ).
    pub url: String,
    /// What the blocks' router keys were made with (key chain version, block size, offloaded
    /// chunk size): a replica keying the endpoint otherwise refuses them.
    #[serde(flatten)]
    pub layout: KeyLayout,
    /// The last engine batch the blocks reflect; the peer resumes after it.
    pub seq: Option<u64>,
    /// Whether the serving replica trusted this endpoint's index.
    pub trusted: bool,
    /// Whether the serving replica's picture of this endpoint's offloaded tiers was uncertain
    /// (recent orphans).
    #[serde(default)]
    pub tier_uncertain: bool,
    /// The full-attention KV-cache group the serving replica tracks for this endpoint (a hybrid
    /// model's), once learned; absent from peers of earlier versions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tracked_group: Option<i64>,
    /// Every block the serving replica's index holds for this endpoint.
    pub blocks: Vec<HeldEntry>,
}

/// One endpoint's snapshot, built under its ingest lock (so that its index and sequence agree:
/// no batch is applied meanwhile); `None` when it has no events, has left the fleet, or this
/// replica keeps no journal.
fn endpoint_snapshot(router: &Router, e: &Endpoint) -> Option<EndpointSnapshot> {
    e.config.events.as_ref()?;
    let _ingest = e.ingest.lock();
    let now = router.now();
    let fleet = router.fleet();
    if !fleet.endpoint(e.id).is_some_and(|s| s.present()) {
        return None;
    }
    let index = fleet.index_of(e.id).cloned()?;
    let trusted = fleet.trust(e.id, now).is_ok();
    let layout = fleet.key_layout(e.id)?;
    let seq = router.replica().journal()?.seq(e.id);
    let (blocks, tier_uncertain, tracked_group) = index.read_endpoint(e.id, |ix| {
        (
            ix.endpoint_blocks(e.id).collect(),
            ix.tier_uncertain(e.id),
            ix.tracked_group(e.id),
        )
    });
    drop(fleet);
    Some(EndpointSnapshot {
        url: e.config.url.clone(),
        layout,
        seq,
        trusted,
        tier_uncertain,
        tracked_group,
        blocks,
    })
}

/// `GET /kvroute/v1/snapshot[?endpoint=URL]`: this replica's index for a starting peer, every
/// endpoint or the one named (none when it has no such endpoint with events); 404 when it keeps
/// none, 503 while it is warming up itself, 409 to itself.
///
/// The answer is a [`Snapshot`] written one endpoint at a time as the peer reads it: each
/// endpoint's blocks are collected and serialised only when the previous one has been sent,
/// so that a whole fleet's index (the answer without the query) never sits in memory at once.
pub async fn snapshot(
    State(router): State<Arc<Router>>,
    Query(query): Query<SnapshotQuery>,
    headers: http::HeaderMap,
) -> Response {
    if super::share::own_message(&router, &headers) {
        return super::share::own_message_refused(&router);
    }
    if router.replica().warming() {
        return error_response(
            &router,
            &ApiError::unavailable("this replica is warming up itself"),
        );
    }
    if !router.replica().keeps_journal() {
        return error_response(
            &router,
            &ApiError::not_found("this replica keeps no snapshot: replicas.peers is empty"),
        );
    }
    let only = query.endpoint;
    let endpoints: Vec<_> = router
        .endpoints()
        .iter()
        .filter(|e| only.as_ref().is_none_or(|url| *url == e.config.url))
        .cloned()
        .collect();
    let parts = endpoints
        .into_iter()
        .filter_map(move |e| endpoint_snapshot(&router, &e))
        .enumerate()
        .map(|(i, entry)| {
            let mut part = if i == 0 { b"".to_vec() } else { b",".to_vec() };
            serde_json::to_writer(&mut part, &entry)?;
            Ok::<_, serde_json::Error>(Bytes::from(part))
        });
    let body = std::iter::once(Ok(Bytes::from_static(b"{\"endpoints\":[")))
        .chain(parts)
        .chain(std::iter::once(Ok(Bytes::from_static(b"]}"))));
    (
        [(header::CONTENT_TYPE, "application/json")],
        axum::body::Body::from_stream(futures::stream::iter(body)),
    )
        .into_response()
}

/// Why a peer's snapshot was not had.
#[derive(Debug)]
pub(crate) enum FetchError {
    /// The peer as a whole did not answer (unreachable, refusing, too slow, itself): not worth
    /// asking for other endpoints.
    Peer(String),
    /// This answer could not be used (too large, not a snapshot): another peer may do better.
    Answer(String),
}

impl std::fmt::Display for FetchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Peer(why) | Self::Answer(why) => f.write_str(why),
        }
    }
}

/// Fetches a peer's snapshot of the endpoint whose URL is `endpoint` within `timeout` (a peer
/// of an earlier version answers with every endpoint).
pub(crate) async fn fetch(
    router: &Router,
    peer: &str,
    endpoint: &str,
    timeout: Duration,
) -> Result<Snapshot, FetchError> {
    let query = serde_urlencoded::to_string(SnapshotQuery {
        endpoint: Some(endpoint.to_owned()),
    })
    .map_err(|e| FetchError::Answer(e.to_string()))?;
    let mut request = http::Request::get(format!(
        "{}/kvroute/v1/snapshot?{query}",
        peer.trim_end_matches('/')
    ));
    if let Some(token) = &router.config().admin.token {
        request = request.header(header::AUTHORIZATION, format!("Bearer {token}"));
    }
    let request = request
        .header(crate::replica_state::REPLICA_HEADER, router.replica().id())
        .body(Full::new(Bytes::new()))
        .map_err(|e| FetchError::Peer(e.to_string()))?;
    let work = async {
        let response = router
            .client()
            .request(request)
            .await
            .map_err(|e| FetchError::Peer(e.to_string()))?;
        let status = response.status();
        let replica = router.replica();
        if replica
            .peer_list()
            .came_back(replica.id(), peer, status, response.headers())
        {
            return Err(FetchError::Peer(
                "it is this replica itself: no longer a peer".to_owned(),
            ));
        }
        let body = Limited::new(response.into_body(), MAX_SNAPSHOT_BYTES)
            .collect()
            .await
            .map_err(|e| {
                FetchError::Answer(format!(
                    "reading the snapshot (at most {MAX_SNAPSHOT_BYTES} bytes): {e}"
                ))
            })?
            .to_bytes();
        if !status.is_success() {
            return Err(FetchError::Peer(format!(
                "answered {status}: {}",
                String::from_utf8_lossy(&body[..body.len().min(200)])
            )));
        }
        serde_json::from_slice(&body)
            .map_err(|e| FetchError::Answer(format!("not a snapshot: {e}")))
    };
    tokio::time::timeout(timeout, work)
        .await
        .map_err(|_| FetchError::Peer(format!("no snapshot within {timeout:?}")))?
}

/// Applies a snapshot to the fleet (and the journal): each endpoint named by URL gets the
/// blocks, restored by core in one step ([`Fleet::restore_endpoint`]), on the present endpoint
/// with that URL (a removed one may still hold a slot under the same URL: a pod removed and
/// re-added). An endpoint whose keys the peer made with another layout (block size) is refused,
/// logged and counted (`kvroute_replica_snapshot_refused_total`), and rebuilt from its engine's
/// replay buffer like an endpoint the peer did not send. Returns each present endpoint of this
/// replica the entries named, with the sequence its subscriber resumes after when it was
/// restored at one.
///
/// [`Fleet::restore_endpoint`]: kvroute_core::fleet::Fleet::restore_endpoint
pub(crate) fn apply<'a>(
    router: &Router,
    peer: &str,
    entries: impl IntoIterator<Item = &'a EndpointSnapshot>,
) -> Vec<(Arc<Endpoint>, Option<u64>)> {
    let mut named = Vec::new();
    let endpoints = router.endpoints();
    for entry in entries {
        let restored = endpoints
            .iter()
            .filter(|e| e.config.url == entry.url && e.config.events.is_some())
            .find_map(|e| Some((e.clone(), restore(router, peer, e, entry)?)));
        named.extend(restored);
    }
    named
}

/// Restores `entry` onto `e`: `None` when `e` is not the present endpoint in its slot (nothing
/// restored), else the sequence its subscriber resumes after, when it was restored at one.
fn restore(
    router: &Router,
    peer: &str,
    e: &Endpoint,
    entry: &EndpointSnapshot,
) -> Option<Option<u64>> {
    let restore = EndpointRestore {
        layout: entry.layout,
        blocks: entry.blocks.iter().copied(),
        trusted: entry.trusted,
        tier_uncertain: entry.tier_uncertain,
        tracked_group: entry.tracked_group,
    };
    // Under its ingest lock, which removal takes too: it stays present until restored.
    let _ingest = e.ingest.lock();
    let now = router.now();
    let mut fleet = router.fleet();
    if !router.is_current(&fleet, e) {
        return None;
    }
    match fleet.restore_endpoint(e.id, restore, now) {
        Ok(Some(_)) => {}
        Ok(None) => return Some(None),
        Err(why) => {
            drop(fleet);
            let field = match why {
                kvroute_core::CoreError::KeyLayoutMismatch { field, .. } => field,
                _ => "other",
            };
            router
                .metrics()
                .replica_snapshot_refused
                .get_or_create(&crate::metrics::KindLabel { kind: field })
                .inc();
            tracing::warn!(%peer, endpoint = %e.name, error = %why, "refused a peer's snapshot of this endpoint: its keys were made otherwise (replicas configured differently); rebuilding it from the engine's replay buffer");
            return Some(None);
        }
    }
    if let (Some(mut journal), Some(seq)) = (router.replica().journal(), entry.seq) {
        journal.apply(e.id, seq);
    }
    Some(entry.seq)
}
