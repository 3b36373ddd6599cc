//! Replicas start warm: a replica started beside a running one copies its KV index (a snapshot
//! from the peer's admin listener, then each engine's events resumed after it) before its
//! readiness check answers 200; one that cannot warm up says so and reports ready anyway, its
//! endpoints untrusted. Simulated engines and routers over real HTTP and ZMQ on loopback.

// Measures real processes and sockets: wall-clock time, not the router's (tokio) clock.
#![allow(clippy::disallowed_methods)]

mod common;
mod replicas_common;

use std::time::{Duration, Instant};

use axum::http::StatusCode;
use kvroute_core::index::EndpointId;
use kvroute_router::server::RunningRouter;
use kvroute_router::testing::Membership;
use kvroute_sim::server::faults::Faults;
use kvroute_testkit::{free_ports, patience};
use replicas_common::{
    admin_json, answering_peer, complete, config, explain, fleet, held_snapshot_peer, replica,
    replicas, snapshot_peer, status, until_ready,
};
use serde_json::{Value, json};

/// A loopback address nobody listens on.
fn dead_address() -> String {
    format!("127.0.0.1:{}", free_ports(1))
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
    let plan = explain(client, router, prompt).await;
    let mut out: Vec<(String, u64)> = plan["endpoints"]
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
            let want = explain(client, router, prompt).await["blocks"]
                .as_u64()
                .unwrap();
            let have = matched(client, router, prompt).await;
            if !have.iter().any(|(e, n)| e == endpoint && *n == want) {
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue 'poll;
            }
        }
        return;
    }
}

/// Two engines that keep only 4 batches for replay: far fewer than the traffic below makes,
/// so a replica that started late cannot rebuild the index from the engines alone.
async fn small_replay_fleet() -> kvroute_sim::server::SimFleet {
    fleet(2, 4, Faults::default()).await
}

/// A replica over `fleet` whose only peer is not there (it warms up from the engines, nothing
/// published yet), and 12 prompts sent through it, each indexed on the engine that served it:
/// the replica, and each prompt with that engine.
async fn replica_with_traffic(
    client: &reqwest::Client,
    fleet: &kvroute_sim::server::SimFleet,
) -> (RunningRouter, Vec<(String, String)>) {
    let dead = replicas(&[format!("http://{}", dead_address())], 10.0, true);
    let a = replica(config(fleet, 0, dead)).await;
    until_ready(client, &a).await;
    let warm = admin_json(client, &a, "/kvroute/v1/replica").await;
    assert_eq!(warm["state"], "warm", "{warm}");
    assert_eq!(warm["peer"], Value::Null, "{warm}");
    let mut served = Vec::new();
    for i in 0..12 {
        let p = prompt(i);
        let endpoint = complete(client, &a, &p).await;
        served.push((p, endpoint));
    }
    until_indexed(client, &a, &served).await;
    (a, served)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_replica_copies_a_running_ones_index_before_it_reports_ready() {
    let fleet = small_replay_fleet().await;
    let client = reqwest::Client::new();
    // A names a peer that is not there: it warms up from the engines (nothing published yet).
    let (a, served) = replica_with_traffic(&client, &fleet).await;
    let mut a_index = Vec::new();
    for (p, _) in &served {
        a_index.push(matched(&client, &a, p).await);
    }

    // A answers a peer for one endpoint at a time (a fleet's whole index does not fit one
    // answer): each endpoint's snapshot holds it alone, all the blocks of the whole snapshot's.
    let peer = format!("http://{}", a.admin_addr);
    let snapshot = |query: Vec<(&'static str, String)>| {
        let query = serde_urlencoded::to_string(&query).unwrap();
        let request = client.get(format!("{peer}/kvroute/v1/snapshot?{query}"));
        async move { request.send().await.unwrap().json::<Value>().await.unwrap() }
    };
    let whole = snapshot(vec![]).await;
    assert_eq!(whole["endpoints"].as_array().unwrap().len(), 2, "{whole}");
    let mut held = 0;
    for (at, engine) in fleet.endpoints.iter().enumerate() {
        let one = snapshot(vec![("endpoint", engine.url.clone())]).await;
        let entries = one["endpoints"].as_array().unwrap();
        assert_eq!(entries.len(), 1, "{one}");
        assert_eq!(entries[0]["url"], engine.url.as_str());
        let blocks = |entry: &Value| entry["blocks"].as_array().unwrap().len();
        let in_whole = whole["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["url"] == engine.url.as_str())
            .map(blocks);
        assert_eq!(Some(blocks(&entries[0])), in_whole, "endpoint {at}");
        held += blocks(&entries[0]);
    }
    assert!(held > 0, "the traffic's blocks are in the snapshots");
    let unknown = snapshot(vec![("endpoint", "http://elsewhere:8000".into())]).await;
    assert_eq!(unknown["endpoints"], json!([]), "{unknown}");

    // B starts beside A, naming A's admin listener as its peer.
    let b = replica(config(
        &fleet,
        0,
        replicas(std::slice::from_ref(&peer), 10.0, true),
    ))
    .await;
    until_ready(&client, &b).await;
    // The moment it reports ready, B's index is A's: every prompt matches alike, all of its
    // blocks on the engine that holds them.
    for ((p, _), want) in served.iter().zip(&a_index) {
        assert_eq!(&matched(&client, &b, p).await, want, "{p}");
    }
    let warm = admin_json(&client, &b, "/kvroute/v1/replica").await;
    assert_eq!(warm["state"], "warm", "{warm}");
    assert_eq!(warm["peer"], peer.as_str(), "{warm}");
    // Its subscribers resumed where the snapshot stood: nothing lost, so every endpoint is
    // trusted (rebuilding from the engines' 4-batch replay buffers would have lost events).
    let plan = explain(&client, &b, &served[0].0).await;
    for e in plan["endpoints"].as_array().unwrap() {
        assert_eq!(e["index_trusted"], true, "{plan}");
    }

    // Live events keep flowing to B after the snapshot: traffic through A shows up in B.
    let p = prompt(100);
    let endpoint = complete(&client, &a, &p).await;
    until_indexed(&client, &b, &[(p, endpoint)]).await;
}

/// Replica `b`'s index matches `a`'s for every prompt served, and `b` says it warmed up from
/// `peer`.
async fn same_index_from(
    client: &reqwest::Client,
    (a, b): (&RunningRouter, &RunningRouter),
    served: &[(String, String)],
    peer: &str,
) {
    for (p, _) in served {
        assert_eq!(
            matched(client, b, p).await,
            matched(client, a, p).await,
            "{p}"
        );
    }
    let warm = admin_json(client, b, "/kvroute/v1/replica").await;
    assert_eq!(warm["peer"], peer, "{warm}");
}

/// A peer of an earlier version ignores `?endpoint=` and answers with every endpoint: the
/// starting replica applies that one answer to all its endpoints and asks nothing more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_answering_with_every_endpoint_warms_a_replica_in_one_answer() {
    let fleet = small_replay_fleet().await;
    let client = reqwest::Client::new();
    let (a, served) = replica_with_traffic(&client, &fleet).await;
    let whole = admin_json(&client, &a, "/kvroute/v1/snapshot").await;
    assert_eq!(whole["endpoints"].as_array().unwrap().len(), 2, "{whole}");

    let (old_peer, asked) = snapshot_peer(whole).await;
    let b = replica(config(
        &fleet,
        0,
        replicas(std::slice::from_ref(&old_peer), 10.0, true),
    ))
    .await;
    until_ready(&client, &b).await;
    // Asked once, for the first endpoint by URL.
    let asked = asked.lock().unwrap().clone();
    let first = serde_urlencoded::to_string([("endpoint", &fleet.endpoints[0].url)]).unwrap();
    assert_eq!(asked, [first]);
    same_index_from(&client, (&a, &b), &served, &old_peer).await;
}

/// A peer that refuses (503: warming up itself) is asked once, not once per endpoint, and every
/// endpoint is copied from the next peer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusing_peer_is_asked_once_and_the_next_one_answers_for_every_endpoint() {
    let fleet = small_replay_fleet().await;
    let client = reqwest::Client::new();
    let (a, served) = replica_with_traffic(&client, &fleet).await;
    let (refusing, asked) = answering_peer(
        StatusCode::SERVICE_UNAVAILABLE,
        json!({"error": {"message": "warming up"}}),
    )
    .await;
    let peer = format!("http://{}", a.admin_addr);
    let b = replica(config(
        &fleet,
        0,
        replicas(&[refusing, peer.clone()], 10.0, true),
    ))
    .await;
    until_ready(&client, &b).await;
    let asked = asked.lock().unwrap().clone();
    assert_eq!(asked.len(), 1, "{asked:?}");
    same_index_from(&client, (&a, &b), &served, &peer).await;
}

/// A pod removed and re-added while the starting replica waits for a peer's snapshot of it (the
/// same URL in a new slot, its old slot held until it may be reused): the snapshot restores the
/// pod present now, whose events resume after it, and the departed one gets no subscriber.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_restores_a_pod_re_added_during_warm_up_not_its_departed_slot() {
    // One engine keeping 4 batches for replay: rebuilt from the engine alone, its index would
    // lack most of the traffic's blocks.
    let fleet = fleet(1, 4, Faults::default()).await;
    let client = reqwest::Client::new();
    let (a, _) = replica_with_traffic(&client, &fleet).await;
    let whole = admin_json(&client, &a, "/kvroute/v1/snapshot").await;
    let (peer, asked, release) = held_snapshot_peer(whole).await;
    let b = replica(config(
        &fleet,
        0,
        replicas(std::slice::from_ref(&peer), 10.0, true),
    ))
    .await;
    kvroute_testkit::eventually("B asked the peer for its snapshot", || {
        let asked = asked.lock().unwrap().clone();
        (!asked.is_empty(), asked)
    })
    .await;

    let departed = EndpointId(0);
    let pod = b.router.endpoint(departed).config.clone();
    assert!(b.router.remove_endpoint(departed));
    let back = b.router.add_endpoint(pod).unwrap();
    assert_ne!(back, departed, "the old slot is not reusable yet");
    release.send(true).unwrap();

    until_ready(&client, &b).await;
    let blocks = |r: &RunningRouter, id| r.router.index_stats(id).map_or(0, |s| s.blocks_gpu);
    assert_eq!(
        blocks(&b, back),
        blocks(&a, departed),
        "the pod present now holds the snapshot's blocks"
    );
    let warm = admin_json(&client, &b, "/kvroute/v1/replica").await;
    assert_eq!(warm["peer"], peer.as_str(), "{warm}");
    assert!(
        b.router.endpoint(departed).subscriber_stats().is_none(),
        "the departed pod got a subscriber nothing stops"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_cannot_warm_up_says_so_and_reports_ready_anyway() {
    let fleet = small_replay_fleet().await;
    let client = reqwest::Client::new();
    // No peer answers, and one endpoint's event publisher is not there: it never catches up.
    let replicas = replicas(&[format!("http://{}", dead_address())], 1.0, true);
    let mut config = config(&fleet, 0, replicas);
    config.endpoints[1].events = Some(format!("tcp://{}", dead_address()));
    let router = replica(config).await;
    assert_eq!(
        status(&client, router.addr, "/health").await,
        503,
        "warming"
    );
    // Liveness (the admin listener's /health) is not held back.
    assert_eq!(status(&client, router.admin_addr, "/health").await, 200);
    let waited = until_ready(&client, &router).await;
    assert!(waited >= Duration::from_millis(800), "{waited:?}");

    let warm = admin_json(&client, &router, "/kvroute/v1/replica").await;
    assert_eq!(warm["state"], "timed_out", "{warm}");
    assert_eq!(warm["untrusted"], json!(["e1"]), "{warm}");
    let metrics = kvroute_testkit::http_get(router.admin_addr, "/metrics");
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
