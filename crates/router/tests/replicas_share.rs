//! Replicas sharing their dispatches (`replicas.share_dispatches`): a request routed by one
//! replica shows in its peer's plan at once (predicted blocks on the chosen engine, a recent
//! placement there), before the engine's KV events say anything; a replica that does not share
//! sees nothing until the events arrive; and (`replicas.share_load`) a peer's request counts in
//! the engine's queued prefill until its first token, then as decoding there until its end. Routers and simulated engines over real
//! HTTP and ZMQ on loopback.

// Measures real processes and sockets: wall-clock time, not the router's (tokio) clock.
#![allow(clippy::disallowed_methods)]

mod common;
mod replicas_common;

use std::time::{Duration, Instant};

use kvroute_core::index::EndpointId;
use kvroute_router::server::RunningRouter;
use kvroute_router::testing::Membership;
use kvroute_sim::server::SimFleet;
use kvroute_sim::server::faults::Faults;
use kvroute_testkit::free_ports;
use replicas_common::{complete, config, explain, fleet, replica, replicas, until_ready};
use serde_json::Value;

/// `endpoint`'s entry in an explanation.
fn entry<'a>(explain: &'a Value, endpoint: &str) -> &'a Value {
    explain["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["endpoint"] == endpoint)
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peers_dispatch_shows_in_the_plan_before_the_engines_events() {
    // Engines whose KV events arrive 5 s late: long after a dispatch was shared.
    let faults = Faults {
        event_delay: Duration::from_secs(5),
        ..Faults::default()
    };
    let fleet = fleet(3, 10_000, faults).await;
    let client = reqwest::Client::new();
    let (admin_a, admin_b) = (free_ports(1), free_ports(1));
    let peers =
        |peer: u16, share: bool| replicas(&[format!("http://127.0.0.1:{peer}")], 5.0, share);
    let a = replica(config(&fleet, admin_a, peers(admin_b, true))).await;
    let b = replica(config(&fleet, admin_b, peers(admin_a, true))).await;
    // A replica of the same fleet that does not share.
    let c = replica(config(&fleet, 0, peers(admin_a, false))).await;
    for r in [&a, &b, &c] {
        until_ready(&client, r).await;
    }

    let prompt = "a long shared document. ".repeat(60);
    let chosen = complete(&client, &a, &prompt).await;
    let sent = Instant::now();

    // B learns where A sent it, and that it ended (fire-and-forget messages, the end possibly
    // in a later batch than the dispatch: wait for both, well within the events' delay; while
    // B still counts A's request in flight there, an idle endpoint may rightly cost less).
    let blocks = explain(&client, &b, &prompt).await["blocks"]
        .as_u64()
        .unwrap();
    loop {
        let plan = explain(&client, &b, &prompt).await;
        let e = entry(&plan, &chosen);
        if e["matched_blocks"]["predicted"] == blocks && e["load"]["inflight"] == 0 {
            assert_eq!(plan["chosen"], chosen.as_str(), "{plan}");
            assert!(
                e["load"]["recent_placements"].as_f64().unwrap() > 0.5,
                "{plan}"
            );
            // Nothing from the engine yet: the prediction came from A.
            assert_eq!(e["matched_blocks"]["index"], Value::Null, "{plan}");
            break;
        }
        assert!(
            sent.elapsed() < Duration::from_secs(4),
            "B never heard: {plan}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // C does not share: it knows nothing of the request until the events arrive.
    let plan = explain(&client, &c, &prompt).await;
    assert!(sent.elapsed() < Duration::from_secs(4));
    assert_eq!(
        entry(&plan, &chosen)["matched_blocks"]["predicted"],
        0,
        "{plan}"
    );
}

/// While A's request waits for its first token, B counts it as queued prefill at the engine
/// (before any scrape could show it); once A says the first token came, as decoding there; and
/// not at all once A says it ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peers_request_counts_as_queued_prefill_then_decoding_until_its_end() {
    // One engine, very slow: a long prompt's prefill takes seconds.
    let faults = Faults {
        slow_factor: 400.0,
        ..Faults::default()
    };
    let fleet = fleet(1, 10_000, faults).await;
    let client = reqwest::Client::new();
    let (admin_a, admin_b) = (free_ports(1), free_ports(1));
    let peers = |peer: u16| replicas(&[format!("http://127.0.0.1:{peer}")], 5.0, true);
    let a = replica(config(&fleet, admin_a, peers(admin_b))).await;
    let b = replica(config(&fleet, admin_b, peers(admin_a))).await;
    for r in [&a, &b] {
        until_ready(&client, r).await;
    }
    let prompt = "a long document nobody sent before. ".repeat(80);
    let queued = |plan: &Value| {
        let load = &entry(plan, "e0")["load"];
        (
            load["inflight_prefills"].as_u64().unwrap(),
            load["inflight_prefill_tokens"].as_u64().unwrap(),
        )
    };
    let in_flight_there = |plan: &Value| entry(plan, "e0")["load"]["inflight"].as_u64().unwrap();
    let in_flight = tokio::spawn({
        let (client, prompt) = (client.clone(), prompt.clone());
        let a_addr = a.addr;
        async move {
            let response = client
                .post(format!("http://{a_addr}/v1/completions"))
                // Streamed (a whole answer comes at its end), four tokens: three decode steps
                // after the first, a window to see it decoding on this slow engine.
                .json(&serde_json::json!({"model": replicas_common::MODEL, "prompt": prompt, "max_tokens": 4, "stream": true}))
                .send()
                .await
                .unwrap();
            assert_eq!(response.status(), 200);
            response.bytes().await.unwrap();
        }
    });
    let started = Instant::now();
    loop {
        assert!(
            started.elapsed() < kvroute_testkit::patience(),
            "B never counted A's request in the engine's queue"
        );
        let (prefills, tokens) = queued(&explain(&client, &b, "another prompt").await);
        if prefills == 1 {
            assert!(tokens > 500, "the prompt's uncached tokens: {tokens}");
            break;
        }
        assert!(
            !in_flight.is_finished(),
            "A's request ended before B counted it"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Past its first token, still decoding: no longer queued prefill, still in flight there.
    loop {
        let plan = explain(&client, &b, "another prompt").await;
        if queued(&plan) == (0, 0) {
            assert_eq!(in_flight_there(&plan), 1, "A's decoding request: {plan}");
            assert!(
                !in_flight.is_finished(),
                "A's request ended before its first token showed"
            );
            break;
        }
        assert!(
            started.elapsed() < kvroute_testkit::patience(),
            "B never saw A's first token"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    in_flight.await.unwrap();
    let done = Instant::now();
    while in_flight_there(&explain(&client, &b, "another prompt").await) != 0 {
        assert!(
            done.elapsed() < Duration::from_secs(4),
            "B still counts A's finished request"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let stats = &replicas_common::admin_json(&client, &b, "/kvroute/v1/replica").await;
    assert_eq!(stats["peer_load"]["done"], 1, "{stats}");
    assert_eq!(
        (
            &stats["peer_load"]["ended"],
            &stats["peer_load"]["unknown_done"]
        ),
        (&1.into(), &0.into()),
        "{stats}"
    );
}

/// One engine and a replica sharing dispatches with a peer that is never there: a replica that
/// only receives peer messages (the tests post them).
async fn lone_replica() -> (SimFleet, RunningRouter) {
    let fleet = fleet(1, 100, Faults::default()).await;
    let replicas = replicas(&["http://127.0.0.1:1".to_owned()], 1.0, true);
    let r = replica(config(&fleet, 0, replicas)).await;
    (fleet, r)
}

/// A peer's dispatch of a 64-token prompt to `fleet`'s engine, as `PeerDispatch` serializes it.
fn dispatch_body(fleet: &SimFleet, model: &str, block_size: usize) -> Value {
    serde_json::json!({
        "endpoint": fleet.endpoints[0].url,
        "model": model,
        "block_size": block_size,
        "prompt_tokens": 64,
        "session": null,
        "keys": [1, 2, 3, 4],
        "placement": true,
    })
}

/// A peer's dispatch for a model this replica does not serve, or keyed with another block size,
/// is refused (400, counted), not recorded against the wrong blocks; a fitting one is taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peers_dispatch_that_does_not_fit_this_replica_is_refused() {
    let (fleet, r) = lone_replica().await;
    let client = reqwest::Client::new();
    let send = |model: &str, block_size: usize| {
        let body = dispatch_body(&fleet, model, block_size);
        let request = client
            .post(format!("http://{}/kvroute/v1/peer/dispatch", r.admin_addr))
            .json(&body);
        async move { request.send().await.unwrap().status().as_u16() }
    };
    assert_eq!(
        send("another-model", 16).await,
        400,
        "a model not served here"
    );
    assert_eq!(
        send(replicas_common::MODEL, 32).await,
        400,
        "another block size"
    );
    assert_eq!(
        send(replicas_common::MODEL, 16).await,
        204,
        "a fitting dispatch"
    );
    // A prompt longer than any body this replica accepts, with as many uncached tokens (a
    // count that overflowed the engine's load): refused, twice, and the load unmoved.
    let load = || {
        r.router
            .load(kvroute_core::index::EndpointId(0))
            .inflight_prefill_tokens
    };
    let before = load();
    for request in [8u64, 9] {
        let mut body = dispatch_body(&fleet, replicas_common::MODEL, 16);
        body["prompt_tokens"] = u64::MAX.into();
        body["request"] = request.into();
        body["uncached_tokens"] = u64::MAX.into();
        let status = client
            .post(format!("http://{}/kvroute/v1/peer/dispatch", r.admin_addr))
            .json(&body)
            .send()
            .await
            .unwrap()
            .status()
            .as_u16();
        assert_eq!(status, 400, "a prompt no body could carry");
    }
    assert_eq!(load(), before);
    let metrics = r.router.metrics().render();
    assert!(
        metrics.contains("kvroute_rejected_total{status=\"400\"} 4"),
        "{metrics}"
    );
}

/// A pod removed and re-added under the same URL takes a new slot while its old one waits to be
/// reused: a peer's dispatch to that URL counts in the load of the pod present now, not in the
/// departed one's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peers_dispatch_counts_on_a_re_added_pod_not_its_departed_slot() {
    let (fleet, r) = lone_replica().await;
    let departed = EndpointId(0);
    let pod = r.router.endpoint(departed).config.clone();
    assert!(r.router.remove_endpoint(departed));
    let back = r.router.add_endpoint(pod).unwrap();
    assert_ne!(back, departed, "the old slot is not reusable yet");

    let mut body = dispatch_body(&fleet, replicas_common::MODEL, 16);
    body["request"] = 7.into();
    body["uncached_tokens"] = 40.into();
    let status = reqwest::Client::new()
        .post(format!("http://{}/kvroute/v1/peer/dispatch", r.admin_addr))
        .json(&body)
        .send()
        .await
        .unwrap()
        .status();
    assert_eq!(status, 204);
    assert_eq!(
        r.router.load(back).inflight_prefill_tokens,
        40,
        "the peer's prefill counts on the pod present now"
    );
}

/// A batch of peer messages (what a peer's outbox sends once several queued up) is applied in
/// order: a request's dispatch, first token and end leave nothing counted; an entry this
/// replica cannot read or refuses is skipped (counted by kind), the rest applied; a body that
/// is not a batch, or larger than any sender makes, is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_peer_messages_is_applied_in_order() {
    let (fleet, r) = lone_replica().await;
    let client = reqwest::Client::new();
    let dispatch = |model: &str| {
        let mut body = dispatch_body(&fleet, model, 16);
        body["request"] = 7.into();
        body["uncached_tokens"] = 40.into();
        body["shares_end"] = true.into();
        body
    };
    let post = |body: serde_json::Value| {
        let request = client
            .post(format!("http://{}/kvroute/v1/peer/batch", r.admin_addr))
            .json(&body);
        async move { request.send().await.unwrap().status().as_u16() }
    };
    let batch = serde_json::json!({"messages": [
        {"path": "dispatch", "body": dispatch(replicas_common::MODEL)},
        {"path": "a-newer-kind", "body": {}},
        {"path": "dispatch", "body": dispatch("another-model")},
        {"path": "prefill_done", "body": {"request": 7}},
    ]});
    assert_eq!(post(batch).await, 204);
    let stats = &replicas_common::admin_json(&client, &r, "/kvroute/v1/replica").await;
    let load = &stats["peer_load"];
    assert_eq!(
        (&load["started"], &load["done"], &load["open"]),
        (&1.into(), &1.into(), &1.into()),
        "dispatched, then decoding: {stats}"
    );
    let batch = serde_json::json!({"messages": [{"path": "ended", "body": {"request": 7}}]});
    assert_eq!(post(batch).await, 204);
    let stats = &replicas_common::admin_json(&client, &r, "/kvroute/v1/replica").await;
    assert_eq!(
        (&stats["peer_load"]["ended"], &stats["peer_load"]["open"]),
        (&1.into(), &0.into()),
        "{stats}"
    );
    let metrics = r.router.metrics().render();
    for kind in ["unreadable", "refused"] {
        let line = format!("kvroute_replica_peer_messages_skipped_total{{kind=\"{kind}\"}} 1");
        assert!(metrics.contains(&line), "{line} in {metrics}");
    }
    assert_eq!(post(serde_json::json!([1, 2])).await, 400);
    // More entries than any sender puts in one batch, or more bytes: refused whole, nothing
    // applied.
    let ended = serde_json::json!({"path": "ended", "body": {"request": 8}});
    let too_many = serde_json::json!({"messages": vec![ended; 257]});
    assert_eq!(post(too_many).await, 413);
    let long = "x".repeat(2 << 20);
    let too_large =
        serde_json::json!({"messages": [{"path": "dispatch", "body": {"padding": long}}]});
    assert_eq!(post(too_large).await, 413);
    let stats = &replicas_common::admin_json(&client, &r, "/kvroute/v1/replica").await;
    assert_eq!(
        (
            &stats["peer_load"]["ended"],
            &stats["peer_load"]["unknown_done"]
        ),
        (&1.into(), &0.into()),
        "{stats}"
    );
}
