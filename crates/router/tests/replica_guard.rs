//! What a replica takes from its peers, and from whom: a peer's index snapshot whose keys were
//! made with another block size is refused (and the endpoint rebuilt from its engine's replay
//! buffer), sharing dispatches or load without an admin token is flagged at start, and a
//! message naming the replica's own id never makes it forget a real peer.

mod common;
mod replicas_common;

use common::eventually_async;
use kvroute_router::config::ReplicasConfig;
use kvroute_router::server::RunningRouter;
use kvroute_testkit::{free_ports, sample};
use replicas_common::{
    admin_json, complete, config, explain, fleet, replica, replicas, snapshot_peer, until_ready,
};
use serde_json::Value;

/// A loopback address nobody listens on.
fn dead_peer() -> String {
    format!("http://127.0.0.1:{}", free_ports(1))
}

/// The router's own metric `series` (0 when absent).
fn metric(router: &RunningRouter, series: &str) -> f64 {
    sample(&router.router.metrics().render(), series).unwrap_or(0.0)
}

/// Blocks of `prompt` the index of `router` holds on its only endpoint.
async fn indexed(client: &reqwest::Client, router: &RunningRouter, prompt: &str) -> (u64, u64) {
    let plan = explain(client, router, prompt).await;
    let blocks = plan["blocks"].as_u64().unwrap();
    let held = plan["endpoints"][0]["matched_blocks"]["index"]["total"]
        .as_u64()
        .unwrap_or(0);
    (held, blocks)
}

/// A real replica's snapshot of a prompt one engine cached is moved, by URL, onto another
/// engine that never saw it: a starting replica restores it when its keys were made with the
/// same block size (the blocks show in its plan), and refuses it, counted and logged, when they
/// were made with another (the blocks never show, and the endpoint is rebuilt from its engine).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_keyed_with_another_block_size_is_refused() {
    let client = reqwest::Client::new();
    let (seen, unseen) = (
        fleet(1, 10_000, Default::default()).await,
        fleet(1, 10_000, Default::default()).await,
    );
    let source = replica(config(&seen, 0, replicas(&[dead_peer()], 0.5, false))).await;
    until_ready(&client, &source).await;
    let prompt = "a document only the first engine has seen. ".repeat(30);
    complete(&client, &source, &prompt).await;
    eventually_async("the source replica indexed the prompt", || async {
        let (held, blocks) = indexed(&client, &source, &prompt).await;
        (held == blocks && blocks > 0, (held, blocks))
    })
    .await;
    let mut snapshot = admin_json(&client, &source, "/kvroute/v1/snapshot").await;
    let entry = &mut snapshot["endpoints"][0];
    assert_eq!(entry["block_size"], 16, "{entry}");
    entry["url"] = Value::from(unseen.endpoints[0].url.clone());
    // Resume the other engine's events from the start of its replay buffer.
    entry["seq"] = Value::Null;

    let alike = snapshot_peer(snapshot.clone()).await.0;
    let restored = replica(config(
        &unseen,
        0,
        replicas(std::slice::from_ref(&alike), 10.0, false),
    ))
    .await;
    until_ready(&client, &restored).await;
    let status = admin_json(&client, &restored, "/kvroute/v1/replica").await;
    assert_eq!(status["peer"], alike.as_str(), "{status}");
    let (held, blocks) = indexed(&client, &restored, &prompt).await;
    assert_eq!(held, blocks, "the snapshot's blocks are restored");

    snapshot["endpoints"][0]["block_size"] = Value::from(32);
    let larger = snapshot_peer(snapshot).await.0;
    let refusing = replica(config(&unseen, 0, replicas(&[larger], 10.0, false))).await;
    until_ready(&client, &refusing).await;
    assert_eq!(
        metric(
            &refusing,
            "kvroute_replica_snapshot_refused_total{kind=\"block_size\"}"
        ),
        1.0
    );
    let (held, _) = indexed(&client, &refusing, &prompt).await;
    assert_eq!(held, 0, "keys made with another block size were restored");
    // The endpoint itself is rebuilt from its engine: trusted once its events caught up.
    let status = admin_json(&client, &refusing, "/kvroute/v1/replica").await;
    assert_eq!(status["state"], "warm", "{status}");
}

/// Peers post dispatches and shared load to the admin listener: without `admin.token` anyone
/// who reaches it may too, which is flagged in a gauge (and warned) while replicas share.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sharing_with_peers_without_an_admin_token_is_flagged() {
    let engines = fleet(1, 1_000, Default::default()).await;
    let gauge = "kvroute_replica_peer_messages_unauthenticated";
    let sharing = replicas(&[dead_peer()], 0.2, true);

    let open = replica(config(&engines, 0, sharing.clone())).await;
    assert_eq!(metric(&open, gauge), 1.0);

    let mut with_token = config(&engines, 0, sharing.clone());
    with_token.admin.token = Some("secret".into());
    assert_eq!(metric(&replica(with_token).await, gauge), 0.0);

    let quiet = replicas(&[dead_peer()], 0.2, false);
    assert_eq!(
        metric(&replica(config(&engines, 0, quiet)).await, gauge),
        0.0
    );
    let alone = config(&engines, 0, ReplicasConfig::default());
    assert_eq!(metric(&replica(alone).await, gauge), 0.0);
}

/// A peer message that carries a replica's own id (`x-kvroute-replica`, which every peer
/// receives) is dropped (409, counted), but its `Host` header, which the sender writes, never
/// makes the replica forget a real peer: only the replica's own request coming back to it
/// (the sender sees its id in the 409) takes an address out of its peers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_naming_a_replicas_id_cannot_make_it_forget_a_real_peer() {
    let engines = fleet(1, 1_000, Default::default()).await;
    let real_peer = dead_peer();
    let running = replica(config(
        &engines,
        0,
        replicas(std::slice::from_ref(&real_peer), 0.2, true),
    ))
    .await;
    let id = running.router.replica().id().to_owned();
    let client = reqwest::Client::new();
    let answer = client
        .post(format!(
            "http://{}/kvroute/v1/peer/prefill_done",
            running.admin_addr
        ))
        .header("x-kvroute-replica", &id)
        .header("host", real_peer.trim_start_matches("http://"))
        .body(r#"{"request": 1}"#)
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 409);
    assert_eq!(metric(&running, "kvroute_replica_self_messages_total"), 1.0);
    assert_eq!(running.router.replica().peers().to_vec(), [real_peer]);
}

/// A replica whose static peer list names its own admin listener asks itself for a snapshot
/// while warming up: the answer (409 with its own id) takes that address out of its peers, and
/// it warms up from the engines instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_asking_itself_for_a_snapshot_leaves_itself_out_of_its_peers() {
    let engines = fleet(1, 1_000, Default::default()).await;
    let admin_port = free_ports(1);
    let itself = format!("http://127.0.0.1:{admin_port}");
    let running = replica(config(
        &engines,
        admin_port,
        replicas(std::slice::from_ref(&itself), 5.0, true),
    ))
    .await;
    let client = reqwest::Client::new();
    until_ready(&client, &running).await;
    assert!(running.router.replica().peers().is_empty());
    assert!(metric(&running, "kvroute_replica_self_messages_total") >= 1.0);
    let status = admin_json(&client, &running, "/kvroute/v1/replica").await;
    assert_eq!(status["peer"], Value::Null, "{status}");
}
