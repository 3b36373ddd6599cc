//! Helpers the router's integration tests share.

// Each test binary uses some of them.
#![allow(dead_code)]

use std::future::Future;
use std::time::Duration;

use kvroute_sim::server::{SimConfig, SimFleet, start as start_sim};
use serde_json::Value;

pub mod config_builder;
pub mod fleet_view;
pub mod routing_memory;

/// One simulated engine on loopback (ephemeral ports, KV events and replay, 10× speed).
pub async fn engine() -> SimFleet {
    start_sim(SimConfig {
        port: 0,
        events_port: 0,
        replay_port: Some(0),
        time_scale: 10.0,
        ..SimConfig::default()
    })
    .await
    .unwrap()
}

/// A hand-written engine on loopback: `routes`, and a `/health` that passes. Returns its URL.
pub async fn fake_engine(routes: axum::Router) -> String {
    let routes = routes.route("/health", axum::routing::get(|| async { "" }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, routes).await });
    format!("http://{addr}")
}

/// What a P/D producer answers a prefill leg: a completion whose `kv_transfer_params` name its
/// blocks for the decode leg to pull.
pub const PREFILL_ANSWER: &str = r#"{"choices": [{"text": "a"}], "kv_transfer_params": {"do_remote_prefill": true, "remote_engine_id": "p", "remote_block_ids": [1], "remote_host": "127.0.0.1", "remote_port": 5600}}"#;

/// A hand-written P/D producer on loopback: its completions answer [`PREFILL_ANSWER`]. Returns
/// its URL.
pub async fn prefill_engine() -> String {
    let routes = axum::Router::new().route(
        "/v1/completions",
        axum::routing::post(|| async {
            axum::response::Response::builder()
                .header("content-type", "application/json")
                .body(axum::body::Body::from(PREFILL_ANSWER))
                .unwrap()
        }),
    );
    fake_engine(routes).await
}

/// A streamed completion of one token that ends only once `release` says `true`: a response
/// held open for as long as a test needs a request in flight.
pub fn held_sse_answer(
    mut release: tokio::sync::watch::Receiver<bool>,
) -> axum::response::Response {
    let tokens = futures::stream::once(async move {
        let _ = release.wait_for(|go| *go).await;
        Ok::<_, std::io::Error>(bytes::Bytes::from_static(
            b"data: {\"choices\": [{\"text\": \"b\"}]}\n\ndata: [DONE]\n\n",
        ))
    });
    axum::response::Response::builder()
        .header("content-type", "text/event-stream")
        .body(axum::body::Body::from_stream(tokens))
        .unwrap()
}

/// A router started from `config`, once its KV-event subscribers are connected.
pub async fn router_from_config(
    config: kvroute_router::config::RouterConfig,
) -> kvroute_router::server::RunningRouter {
    let router = kvroute_router::server::start(config).await.unwrap();
    kvroute_testkit::eventually("subscribers connected", || {
        (router.subscribers_connected(), ())
    })
    .await;
    router
}

/// Sets engine `i` of `fleet`'s simulated faults (`POST /sim/faults`), checking it took them.
pub async fn fault(client: &reqwest::Client, fleet: &SimFleet, i: usize, faults: Value) {
    let url = format!("{}/sim/faults", fleet.endpoints[i].url);
    let status = client
        .post(url)
        .json(&faults)
        .send()
        .await
        .unwrap()
        .status();
    assert!(status.is_success(), "faults {faults} refused: {status}");
}

/// Waits until the router's index holds exactly the blocks each engine's prefix cache holds
/// (`engines` in the order the router was given them): every KV event of the responses so far
/// has been applied.
pub async fn settle(router: &kvroute_router::server::RunningRouter, engines: &[&SimFleet]) {
    kvroute_testkit::eventually("the index matches every engine's cache", || {
        let pairs: Vec<(u64, Option<u64>)> = engines
            .iter()
            .enumerate()
            .map(|(i, fleet)| {
                let held = router
                    .router
                    .index_stats(kvroute_core::index::EndpointId(i as u32))
                    .map_or(0, |s| s.blocks_gpu);
                (held, engine_cached_blocks(fleet))
            })
            .collect();
        (
            pairs.iter().all(|(held, cached)| Some(*held) == *cached),
            pairs,
        )
    })
    .await;
}

/// The simulated engine's distinct cached blocks, from its `/metrics`.
pub fn engine_cached_blocks(fleet: &SimFleet) -> Option<u64> {
    let addr = fleet.endpoints[0]
        .url
        .trim_start_matches("http://")
        .parse()
        .ok()?;
    kvroute_testkit::http_get(addr, "/metrics")
        .lines()
        .find(|l| l.starts_with("kvroute_sim_cached_blocks{"))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// [`kvroute_testkit::eventually`] for a check that must await (an HTTP request): polls it every
/// 20 ms until it holds; past the testkit's patience, panics naming `what` and the last state.
pub async fn eventually_async<T: std::fmt::Debug, F: Future<Output = (bool, T)>>(
    what: &str,
    mut check: impl FnMut() -> F,
) -> T {
    let deadline = tokio::time::Instant::now() + kvroute_testkit::patience();
    loop {
        let (ok, state) = check().await;
        if ok {
            return state;
        }
        if tokio::time::Instant::now() > deadline {
            panic!("timed out waiting for {what}; last state: {state:#?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `POST /kvroute/v1/explain` of `body` on `router`'s admin listener.
pub async fn explain(
    client: &reqwest::Client,
    router: &kvroute_router::server::RunningRouter,
    body: &Value,
) -> Value {
    client
        .post(format!("http://{}/kvroute/v1/explain", router.admin_addr))
        .json(body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// Sends `body` to the completions API of the router at `addr`, in a task of its own (a request
/// a test keeps in flight while it acts): the answer's status and whole body once it ends.
pub fn spawn_completion(
    client: reqwest::Client,
    addr: std::net::SocketAddr,
    body: Value,
) -> tokio::task::JoinHandle<(u16, String)> {
    tokio::spawn(async move {
        let response = client
            .post(format!("http://{addr}/v1/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        (response.status().as_u16(), response.text().await.unwrap())
    })
}

/// `POST path` of `body` on `router`'s API listener.
pub async fn post_api(
    client: &reqwest::Client,
    router: &kvroute_router::server::RunningRouter,
    path: &str,
    body: &Value,
) -> reqwest::Response {
    client
        .post(format!("http://{}{path}", router.addr))
        .json(body)
        .send()
        .await
        .unwrap()
}

/// Which endpoint served `response`: its `x-kvroute-endpoint` header.
pub fn served_by(response: &reqwest::Response) -> String {
    response.headers()["x-kvroute-endpoint"]
        .to_str()
        .unwrap()
        .to_owned()
}

/// `router`'s own `/metrics` text.
pub async fn router_metrics(
    client: &reqwest::Client,
    router: &kvroute_router::server::RunningRouter,
) -> String {
    client
        .get(format!("http://{}/metrics", router.admin_addr))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}
