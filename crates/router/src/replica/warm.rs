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

/// Subscribes every present endpoint that has events and no subscriber yet.
fn subscribe_all(router: &Arc<Router>, resume: &std::collections::HashMap<EndpointId, u64>) {
    for e in router.endpoints() {
        let present = router.fleet().endpoint(e.id).is_some_and(|s| s.present());
        if present {
            crate::events::spawn_subscriber(router, &e, resume.get(&e.id).copied());
        }
    }
}

async fn warm_up(router: Arc<Router>) {
    let started = Instant::now();
    let timeout = Duration::from_secs_f64(router.config().replicas.warm_timeout_s);
    let mut resume = std::collections::HashMap::new();
    let mut from = None;
    // Peers found in Kubernetes are known after the first list of the router's pods.
    if tokio::time::timeout(timeout, router.replica().peers_known())
        .await
        .is_err()
    {
        warn!(
            "no list of the router's pods within replicas.warm_timeout_s: warming up without peers"
        );
    }
    for peer in router.replica().peers().iter() {
        let left = timeout.saturating_sub(started.elapsed());
        match snapshot::fetch(&router, peer, left).await {
            Ok(snapshot) => {
                resume = snapshot::apply(&router, peer, &snapshot);
                let blocks: usize = snapshot.endpoints.iter().map(|e| e.blocks.len()).sum();
                info!(%peer, endpoints = snapshot.endpoints.len(), blocks, "applied a peer's index snapshot");
                from = Some(peer.clone());
                break;
            }
            Err(why) => {
                warn!(%peer, %why, "no index snapshot from this peer");
            }
        }
    }
    if from.is_none() {
        info!("no peer snapshot: rebuilding the index from the engines' replay buffers");
    }
    subscribe_all(&router, &resume);
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
        subscribe_all(&router, &resume);
    }
    subscribe_all(&router, &resume);
}

/// Present endpoints with events whose subscriber has not caught up (id and name).
fn not_caught_up(router: &Router) -> Vec<(EndpointId, String)> {
    router
        .endpoints()
        .into_iter()
        .filter(|e| e.config.events.is_some())
        .filter(|e| router.fleet().endpoint(e.id).is_some_and(|s| s.present()))
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
