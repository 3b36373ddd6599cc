//! A starting replica's warm-up: a peer's snapshot, then each engine's events resumed after it,
//! then ready; or, when that takes longer than `replicas.warm_timeout_s`, ready anyway with
//! the endpoints not caught up untrusted (logged, and visible in
//! `kvroute_endpoint_index_trusted` and `GET /kvroute/v1/replica`).

use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use kvroute_core::fleet::{PeerLoadStats, WarmVerdict};
use kvroute_core::index::EndpointId;
use serde::Serialize;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::{info, warn};

use super::snapshot;
use crate::endpoint::Endpoint;
use crate::replica_state::WarmStatus;
use crate::service::Router;

/// How often the warm-up checks whether every subscriber caught up.
const POLL: Duration = Duration::from_millis(20);

/// Starts the warm-up when the configuration names peers (none otherwise: subscribers were
/// started with the endpoints' other tasks), and the watch of peers in Kubernetes when
/// configured.
pub(crate) fn spawn(router: &Arc<Router>) -> Vec<JoinHandle<()>> {
    let mut tasks = Vec::new();
    // Configuration refuses `replicas.kubernetes` in a build without the `kube` feature.
    #[cfg(feature = "kube")]
    if let Some(discovery) = &router.config().replicas.kubernetes {
        tasks.push(crate::discovery::peers::spawn(router, discovery.clone()));
    }
    if router.replica().warming() {
        tasks.push(tokio::spawn(warm_up(router.clone())));
    }
    tasks
}

/// Subscribes every present endpoint that has events and no subscriber yet, from the start of
/// its engine's replay buffer (those restored from a peer's snapshot were subscribed then).
fn subscribe_all(router: &Arc<Router>) {
    for e in router.endpoints() {
        crate::events::spawn_subscriber_while_present(router, &e, None);
    }
}

async fn warm_up(router: Arc<Router>) {
    let started = Instant::now();
    let timeout = Duration::from_secs_f64(router.config().replicas.warm_timeout_s);
    // Peers found in Kubernetes are known after the first list of the router's pods.
    if tokio::time::timeout(timeout, router.replica().peers_known())
        .await
        .is_err()
    {
        warn!(
            "no list of the router's pods within replicas.warm_timeout_s: warming up without peers"
        );
    }
    let from = copy_from_peers(&router, started, timeout).await;
    subscribe_all(&router);
    loop {
        let behind = not_caught_up(&router);
        let ids: Vec<EndpointId> = behind.iter().map(|(id, _)| *id).collect();
        let elapsed = started.elapsed();
        let verdict = {
            let now = router.now();
            router
                .fleet()
                .warm_verdict(&ids, elapsed.as_secs_f64(), timeout.as_secs_f64(), now)
        };
        match verdict {
            WarmVerdict::Warm => {
                let seconds = elapsed.as_secs_f64();
                info!(peer = ?from, seconds, "warm: every endpoint's events caught up; ready");
                router.replica().finish(WarmStatus::Warm {
                    peer: from,
                    seconds,
                });
                break;
            }
            WarmVerdict::TimedOut => {
                let names: Vec<String> = behind.into_iter().map(|(_, name)| name).collect();
                warn!(untrusted = ?names, timeout_s = timeout.as_secs_f64(), "warm-up timed out: ready anyway; these endpoints' KV index is not trusted (routed by load) until their events catch up");
                router.replica().finish(WarmStatus::TimedOut {
                    peer: from,
                    untrusted: names,
                });
                break;
            }
            WarmVerdict::Warming => {}
        }
        tokio::time::sleep(POLL).await;
        // Endpoints discovered meanwhile.
        subscribe_all(&router);
    }
    subscribe_all(&router);
}

/// Copies each endpoint's index from the first peer that answers for it, one endpoint per
/// answer, within `timeout` of `started`, and subscribes each restored endpoint to its engine's
/// events at once, resuming after the snapshot's sequence (so that no restored snapshot ages
/// while the others are copied). A peer that fails as a whole is not asked again; one whose
/// answer for an endpoint cannot be used is, for the others. An endpoint no peer answers for is
/// left to be rebuilt from its engine's replay buffer. Returns the first peer that answered.
async fn copy_from_peers(
    router: &Arc<Router>,
    started: Instant,
    timeout: Duration,
) -> Option<String> {
    let peers = router.replica().peers();
    let mut failed = vec![false; peers.len()];
    let mut pending: Vec<Arc<Endpoint>> = with_events(router).collect();
    let mut from = None;
    let (mut endpoints, mut blocks) = (0usize, 0usize);
    'endpoints: while let Some(asked) = pending.first().cloned() {
        pending.remove(0);
        for (at, peer) in peers.iter().enumerate() {
            if failed[at] {
                continue;
            }
            let left = timeout.saturating_sub(started.elapsed());
            if left.is_zero() {
                warn!(
                    "replicas.warm_timeout_s spent copying peers' snapshots: the endpoints left are rebuilt from their engines"
                );
                break 'endpoints;
            }
            let snapshot = match snapshot::fetch(router, peer, &asked.config.url, left).await {
                Ok(snapshot) => snapshot,
                Err(why) => {
                    warn!(%peer, endpoint = %asked.name, %why, "no index snapshot from this peer");
                    failed[at] = matches!(why, snapshot::FetchError::Peer(_));
                    continue;
                }
            };
            from.get_or_insert_with(|| peer.clone());
            // A peer of an earlier version answers with every endpoint it has: those not yet
            // restored are taken from it, and the rest rebuilt from their engines.
            let whole = snapshot.endpoints.iter().any(|e| e.url != asked.config.url);
            let wanted =
                |url: &str| url == asked.config.url || pending.iter().any(|p| p.config.url == url);
            let entries: Vec<_> = snapshot
                .endpoints
                .iter()
                .filter(|e| wanted(&e.url))
                .collect();
            blocks += entries.iter().map(|e| e.blocks.len()).sum::<usize>();
            for (restored, seq) in snapshot::apply(router, peer, entries) {
                endpoints += 1;
                // Removed since it was restored: no subscriber for it.
                crate::events::spawn_subscriber_while_present(router, &restored, seq);
            }
            if whole {
                break 'endpoints;
            }
            // Answered (a peer without it has nothing for it: rebuilt from its engine).
            continue 'endpoints;
        }
    }
    match &from {
        Some(peer) => info!(%peer, endpoints, blocks, "applied peers' index snapshots"),
        None => info!("no peer snapshot: rebuilding the index from the engines' replay buffers"),
    }
    from
}

/// Present endpoints with events: those a peer's snapshot can restore.
fn with_events(router: &Router) -> impl Iterator<Item = Arc<Endpoint>> + '_ {
    router
        .endpoints()
        .into_iter()
        .filter(|e| e.config.events.is_some())
        .filter(|e| router.fleet().endpoint(e.id).is_some_and(|s| s.present()))
}

/// Present endpoints with events whose subscriber has not caught up (id and name).
fn not_caught_up(router: &Router) -> Vec<(EndpointId, String)> {
    with_events(router)
        .filter(|e| {
            !e.subscriber
                .lock()
                .as_ref()
                .is_some_and(|s| s.stats().iter().all(|(_, f)| f.caught_up))
        })
        .map(|e| (e.id, e.name.clone()))
        .collect()
}

/// `GET /health` on the API listener (readiness): 503 while warming up, else as the admin
/// listener's `/health` (liveness) answers.
pub async fn ready(State(router): State<Arc<Router>>) -> StatusCode {
    if !router.replica().warming() && router.live() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

/// What `GET /kvroute/v1/replica` answers.
#[derive(Serialize)]
struct ReplicaReport {
    /// The warm-up's status (`state` and its details).
    #[serde(flatten)]
    warm: WarmStatus,
    /// The peers' admin listeners now.
    peers: Vec<String>,
    /// Peers' prefills counted in this replica's load (`replicas.share_load`).
    peer_load: PeerLoadStats,
}

/// `GET /kvroute/v1/replica`: the warm-up's status, and the peers' prefills counted here.
pub async fn status(State(router): State<Arc<Router>>) -> Response {
    let report = ReplicaReport {
        warm: router.replica().status(),
        peers: router.replica().peers().to_vec(),
        peer_load: router.fleet().peer_load_stats().clone(),
    };
    axum::Json(report).into_response()
}
