//! Replicas start warm: a replica started beside a running one copies its KV index (a snapshot
//! from the peer's admin listener, then each engine's events resumed after it) before its
//! readiness check answers 200; one that cannot warm up says so and reports ready anyway, its
//! endpoints untrusted. Simulated engines and routers over real HTTP and ZMQ on loopback.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvroute_router::config::RouterConfig;
use kvroute_router::server::{RunningRouter, start};
use kvroute_sim::server::{SimConfig, SimFleet, start as start_sim};
use kvroute_testkit::{free_ports, patience};
use serde_json::{Value, json};

const MODEL: &str = "sim-llama-3.1-8b";

/// Two engines that keep only 4 batches for replay: far fewer than the traffic below makes,
/// so a replica that started late cannot rebuild the index from the engines alone.
async fn fleet() -> SimFleet {
    start_sim(SimConfig {
        engines: 2,
        port: 0,
        events_port: 0,
        replay_port: Some(0),
        time_scale: 10.0,
        replay_buffer_steps: 4,
        ..SimConfig::default()
    })
    .await
    .unwrap()
}

fn yaml(fleet: &SimFleet, peer: &str, warm_timeout_s: f64) -> String {
    let mut yaml = format!(
        "listen: 127.0.0.1:0\nadmin: {{listen: 127.0.0.1:0}}\nmodels: [{{name: {MODEL}}}]\nreplicas: {{peers: ['{peer}'], warm_timeout_s: {warm_timeout_s}}}\nendpoints:\n"
    );
    for (i, e) in fleet.endpoints.iter().enumerate() {
        yaml.push_str(&format!(
            "  - {{name: e{i}, url: '{}', events: '{}', replay: '{}'}}\n",
            e.url,
            e.events,
            e.replay.as_deref().unwrap()
        ));
    }
    yaml
}

/// A loopback address nobody listens on.
fn dead_address() -> String {
    format!("127.0.0.1:{}", free_ports(1))
}

async fn status(client: &reqwest::Client, addr: SocketAddr, path: &str) -> u16 {
    match client.get(format!("http://{addr}{path}")).send().await {
        Ok(r) => r.status().as_u16(),
        Err(_) => 0,
    }
}

async fn get_json(client: &reqwest::Client, addr: SocketAddr, path: &str) -> Value {
    client
        .get(format!("http://{addr}{path}"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// Polls the readiness check (`/health` on the API listener) until 200; how long it took.
async fn until_ready(client: &reqwest::Client, router: &RunningRouter) -> Duration {
    let started = Instant::now();
    while status(client, router.addr, "/health").await != 200 {
        assert!(started.elapsed() < patience(), "never ready");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    started.elapsed()
}

fn prompt(i: usize) -> String {
    format!("conversation {i}: ").repeat(40)
}

/// Per endpoint name, the index's leading blocks of `prompt`, as the explain API says.
async fn matched(
    client: &reqwest::Client,
    router: &RunningRouter,
    prompt: &str,
) -> Vec<(String, u64)> {
    let explain: Value = client
        .post(format!("http://{}/kvroute/v1/explain", router.admin_addr))
        .json(&json!({"model": MODEL, "prompt": prompt}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let mut out: Vec<(String, u64)> = explain["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let total = e["matched_blocks"]["index"]["total"].as_u64().unwrap_or(0);
            (e["endpoint"].as_str().unwrap().to_owned(), total)
        })
        .collect();
    out.sort();
    out
}

async fn blocks_of(client: &reqwest::Client, router: &RunningRouter, prompt: &str) -> u64 {
    let explain: Value = client
        .post(format!("http://{}/kvroute/v1/explain", router.admin_addr))
        .json(&json!({"model": MODEL, "prompt": prompt}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    explain["blocks"].as_u64().unwrap()
}

/// Sends `prompt` through `router`; the endpoint that served it.
async fn complete(client: &reqwest::Client, router: &RunningRouter, prompt: &str) -> String {
    let response = client
        .post(format!("http://{}/v1/completions", router.addr))
        .json(&json!({"model": MODEL, "prompt": prompt, "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    response.headers()["x-kvroute-endpoint"]
        .to_str()
        .unwrap()
        .to_owned()
}

/// Waits until `router`'s index holds every block of each prompt on the endpoint that served it
/// (the engines cache every full prompt block).
async fn until_indexed(
    client: &reqwest::Client,
    router: &RunningRouter,
    served: &[(String, String)],
) {
    let started = Instant::now();
    'poll: loop {
        assert!(started.elapsed() < patience(), "the index never caught up");
        for (prompt, endpoint) in served {
            let want = blocks_of(client, router, prompt).await;
            let have = matched(client, router, prompt).await;
            if !have.iter().any(|(e, n)| e == endpoint && *n == want) {
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue 'poll;
            }
        }
        return;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_replica_copies_a_running_ones_index_before_it_reports_ready() {
    let fleet = fleet().await;
    let client = reqwest::Client::new();
    // A names a peer that is not there: it warms up from the engines (nothing published yet).
    let dead = format!("http://{}", dead_address());
    let a = start(RouterConfig::from_yaml(&yaml(&fleet, &dead, 10.0)).unwrap())
        .await
        .unwrap();
    until_ready(&client, &a).await;
    let warm = get_json(&client, a.admin_addr, "/kvroute/v1/replica").await;
    assert_eq!(warm["state"], "warm", "{warm}");
    assert_eq!(warm["peer"], Value::Null, "{warm}");

    // Traffic through A: each prompt's blocks cached on the engine that served it.
    let mut served = Vec::new();
    for i in 0..12 {
        let p = prompt(i);
        let endpoint = complete(&client, &a, &p).await;
        served.push((p, endpoint));
    }
    until_indexed(&client, &a, &served).await;
    let a_index: Vec<_> = {
        let mut all = Vec::new();
        for (p, _) in &served {
            all.push(matched(&client, &a, p).await);
        }
        all
    };

    // B starts beside A, naming A's admin listener as its peer.
    let peer = format!("http://{}", a.admin_addr);
    let b = start(RouterConfig::from_yaml(&yaml(&fleet, &peer, 10.0)).unwrap())
        .await
        .unwrap();
    until_ready(&client, &b).await;
    // The moment it reports ready, B's index is A's: every prompt matches alike, all of its
    // blocks on the engine that holds them.
    for ((p, _), want) in served.iter().zip(&a_index) {
        assert_eq!(&matched(&client, &b, p).await, want, "{p}");
    }
    let warm = get_json(&client, b.admin_addr, "/kvroute/v1/replica").await;
    assert_eq!(warm["state"], "warm", "{warm}");
    assert_eq!(warm["peer"], peer.as_str(), "{warm}");
    // Its subscribers resumed where the snapshot stood: nothing lost, so every endpoint is
    // trusted (rebuilding from the engines' 4-batch replay buffers would have lost events).
    let explain: Value = client
        .post(format!("http://{}/kvroute/v1/explain", b.admin_addr))
        .json(&json!({"model": MODEL, "prompt": served[0].0}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    for e in explain["endpoints"].as_array().unwrap() {
        assert_eq!(e["index_trusted"], true, "{explain}");
    }

    // Live events keep flowing to B after the snapshot: traffic through A shows up in B.
    let p = prompt(100);
    let endpoint = complete(&client, &a, &p).await;
    until_indexed(&client, &b, &[(p, endpoint)]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_cannot_warm_up_says_so_and_reports_ready_anyway() {
    let fleet = fleet().await;
    let client = reqwest::Client::new();
    // No peer answers, and one endpoint's event publisher is not there: it never catches up.
    let mut yaml = yaml(&fleet, &format!("http://{}", dead_address()), 1.0);
    yaml = yaml.replacen(
        &fleet.endpoints[1].events,
        &format!("tcp://{}", dead_address()),
        1,
    );
    let router = start(RouterConfig::from_yaml(&yaml).unwrap())
        .await
        .unwrap();
    assert_eq!(
        status(&client, router.addr, "/health").await,
        503,
        "warming"
    );
    // Liveness (the admin listener's /health) is not held back.
    assert_eq!(status(&client, router.admin_addr, "/health").await, 200);
    let waited = until_ready(&client, &router).await;
    assert!(waited >= Duration::from_millis(800), "{waited:?}");

    let warm = get_json(&client, router.admin_addr, "/kvroute/v1/replica").await;
    assert_eq!(warm["state"], "timed_out", "{warm}");
    assert_eq!(warm["untrusted"], json!(["e1"]), "{warm}");
    let metrics = client
        .get(format!("http://{}/metrics", router.admin_addr))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("kvroute_endpoint_index_trusted{endpoint=\"e1\"} 0"),
        "{metrics}"
    );
    assert!(
        metrics.contains("kvroute_endpoint_index_trusted{endpoint=\"e0\"} 1"),
        "{metrics}"
    );
    // It serves: requests are routed (e1 by load only).
    complete(&client, &router, &prompt(1)).await;
}
