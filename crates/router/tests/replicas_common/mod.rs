//! What the replica tests share: a simulated fleet, a replica's configuration over it, and
//! calls to a running replica.
#![allow(dead_code)]
// each test file uses its own part
// Measures real processes and sockets: wall-clock time, not the router's (tokio) clock.
#![allow(clippy::disallowed_methods)]

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::http::StatusCode;
use std::time::{Duration, Instant};

use kvroute_router::config::{ReplicasConfig, RouterConfig};
use kvroute_router::server::{RunningRouter, start};
use kvroute_sim::server::faults::Faults;
use kvroute_sim::server::{SimConfig, SimFleet, start as start_sim};
use kvroute_testkit::patience;
use serde_json::{Value, json};

pub const MODEL: &str = "sim-llama-3.1-8b";

/// `engines` simulated engines at 10× speed, keeping `replay_buffer_steps` batches for
/// replay, with `faults`.
pub async fn fleet(engines: usize, replay_buffer_steps: usize, faults: Faults) -> SimFleet {
    start_sim(SimConfig {
        engines,
        port: 0,
        events_port: 0,
        replay_port: Some(0),
        time_scale: 10.0,
        replay_buffer_steps,
        faults,
        ..SimConfig::default()
    })
    .await
    .unwrap()
}

/// A replica's configuration over `fleet` (endpoints `e0`, `e1`, ...), ephemeral API port,
/// admin on `admin` (0: ephemeral), with `replicas`.
pub fn config(fleet: &SimFleet, admin: u16, replicas: ReplicasConfig) -> RouterConfig {
    crate::common::config_builder::ConfigBuilder::new(MODEL)
        .admin_port(admin)
        .replicas(replicas)
        .engine_endpoints(&fleet.endpoints)
        .build()
}

/// The `replicas` section naming `peers` (URLs), waiting at most `warm_timeout_s` to warm up,
/// sharing dispatches or not.
pub fn replicas(peers: &[String], warm_timeout_s: f64, share_dispatches: bool) -> ReplicasConfig {
    ReplicasConfig {
        peers: peers.to_vec(),
        warm_timeout_s,
        share_dispatches,
        ..ReplicasConfig::default()
    }
}

/// Starts a replica.
pub async fn replica(config: RouterConfig) -> RunningRouter {
    start(config).await.unwrap()
}

/// The status of `GET path` (0 when nothing answers).
pub async fn status(client: &reqwest::Client, addr: SocketAddr, path: &str) -> u16 {
    match client.get(format!("http://{addr}{path}")).send().await {
        Ok(r) => r.status().as_u16(),
        Err(_) => 0,
    }
}

/// Polls the readiness check (`/health` on the API listener) until 200; how long it took.
pub async fn until_ready(client: &reqwest::Client, router: &RunningRouter) -> Duration {
    let started = Instant::now();
    while status(client, router.addr, "/health").await != 200 {
        assert!(started.elapsed() < patience(), "never ready");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    started.elapsed()
}

/// `GET path` on the admin listener, as JSON.
pub async fn admin_json(client: &reqwest::Client, router: &RunningRouter, path: &str) -> Value {
    client
        .get(format!("http://{}{path}", router.admin_addr))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// The explain API's answer for `prompt`.
pub async fn explain(client: &reqwest::Client, router: &RunningRouter, prompt: &str) -> Value {
    crate::common::explain(client, router, &json!({"model": MODEL, "prompt": prompt})).await
}

/// Sends `prompt` through `router`; the endpoint that served it.
pub async fn complete(client: &reqwest::Client, router: &RunningRouter, prompt: &str) -> String {
    let response = client
        .post(format!("http://{}/v1/completions", router.addr))
        .json(&json!({"model": MODEL, "prompt": prompt, "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    crate::common::served_by(&response)
}

/// A peer's admin listener that answers every `GET /kvroute/v1/snapshot`, whatever its query,
/// with `snapshot` (as a peer of an earlier version answers with every endpoint): its URL, and
/// the query of each snapshot it was asked for.
pub async fn snapshot_peer(snapshot: Value) -> (String, Arc<Mutex<Vec<String>>>) {
    answering_peer(StatusCode::OK, snapshot).await
}

/// A peer's admin listener that answers every `GET /kvroute/v1/snapshot` with `status` and
/// `snapshot`: its URL, and the query of each snapshot it was asked for.
pub async fn answering_peer(
    status: StatusCode,
    snapshot: Value,
) -> (String, Arc<Mutex<Vec<String>>>) {
    let (_, open) = tokio::sync::watch::channel(true);
    peer_answering_when(open, status, snapshot).await
}

/// A peer's admin listener like [`snapshot_peer`]'s that holds every answer until the sender
/// returned sends `true` (or is dropped): a snapshot still on its way while the test changes
/// the starting replica. Its URL, the query of each snapshot it was asked for (recorded at
/// once), and the release.
pub async fn held_snapshot_peer(
    snapshot: Value,
) -> (
    String,
    Arc<Mutex<Vec<String>>>,
    tokio::sync::watch::Sender<bool>,
) {
    let (release, open) = tokio::sync::watch::channel(false);
    let (url, asked) = peer_answering_when(open, StatusCode::OK, snapshot).await;
    (url, asked, release)
}

/// A peer's admin listener answering every `GET /kvroute/v1/snapshot` with `status` and
/// `snapshot` once `open` is true: its URL, and the query of each snapshot it was asked for.
async fn peer_answering_when(
    open: tokio::sync::watch::Receiver<bool>,
    status: StatusCode,
    snapshot: Value,
) -> (String, Arc<Mutex<Vec<String>>>) {
    let snapshot = Arc::new(snapshot);
    let asked = Arc::new(Mutex::new(Vec::new()));
    let queries = asked.clone();
    let app = axum::Router::new().route(
        "/kvroute/v1/snapshot",
        axum::routing::get(
            move |axum::extract::RawQuery(query): axum::extract::RawQuery| {
                let snapshot = snapshot.clone();
                let mut open = open.clone();
                queries.lock().unwrap().push(query.unwrap_or_default());
                async move {
                    // Released, or its sender dropped: answer either way.
                    let _ = open.wait_for(|open| *open).await;
                    (status, axum::Json((*snapshot).clone()))
                }
            },
        ),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (format!("http://{addr}"), asked)
}
