//! Endpoints joining and leaving a running router (what Kubernetes discovery drives), in front
//! of simulated engines over real HTTP and ZMQ.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::routing::post;
use common::config_builder::{ConfigBuilder, endpoint, pd_always};
use common::{engine, fake_engine};
use kvroute_core::index::EndpointId;
use kvroute_router::config::EndpointConfig;
use kvroute_router::server::start;
use kvroute_router::testing::Membership;
use kvroute_sim::server::SimFleet;
use kvroute_testkit::eventually;
use serde_json::json;
use tokio::sync::watch;

const MODEL: &str = "sim-llama-3.1-8b";

fn endpoint_config(fleet: &SimFleet, name: &str) -> EndpointConfig {
    let ep = &fleet.endpoints[0];
    let mut config = endpoint(Some(name.to_owned()), &ep.url);
    config.events = Some(ep.events.clone());
    config
}

async fn served_by(client: &reqwest::Client, addr: std::net::SocketAddr, i: usize) -> String {
    let response = client
        .post(format!("http://{addr}/v1/completions"))
        .json(
            &json!({"model": MODEL, "prompt": format!("request {i} ").repeat(20), "max_tokens": 1}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    common::served_by(&response)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoints_join_and_leave_a_running_router() {
    let (a, b) = (engine().await, engine().await);
    let config = ConfigBuilder::new(MODEL)
        .health(100, 500)
        .url("a", &a.endpoints[0].url)
        .build();
    let running = start(config).await.unwrap();
    let router = running.router.clone();
    let client = reqwest::Client::new();

    // b joins: its subscriber connects and requests reach it.
    let id = router.add_endpoint(endpoint_config(&b, "b")).unwrap();
    let added = router.endpoint(id);
    eventually("b's subscriber connected", || {
        let stats = added.subscriber_stats();
        (added.events_connected(), stats)
    })
    .await;
    let mut seen = std::collections::BTreeSet::new();
    for i in 0..12 {
        seen.insert(served_by(&client, running.addr, i).await);
    }
    assert!(seen.contains("b"), "{seen:?}");

    let metrics = || kvroute_testkit::http_get(running.admin_addr, "/metrics");
    assert!(
        metrics().contains("endpoint=\"b\""),
        "b has series while present"
    );
    // While b is present, its engine cannot join again under another name, nor another
    // engine under its name (they would split b's load, or share its series).
    let err = router
        .add_endpoint(endpoint_config(&b, "b2"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("another endpoint's host and port"), "{err}");
    let mut named_a = endpoint_config(&b, "a");
    named_a.url = "http://127.0.0.1:1".into();
    named_a.events = None;
    let err = router.add_endpoint(named_a).unwrap_err().to_string();
    assert!(err.contains("\"a\" is another endpoint's name"), "{err}");
    // Named as a and at b's host and port: the gravest clash is told, with whom.
    let err = router
        .add_endpoint(endpoint_config(&b, "a"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("another endpoint's host and port") && err.contains("(endpoint \"b\")"),
        "{err}"
    );

    // b leaves: nothing goes there any more, its tasks stop, and a bad config is refused.
    assert!(router.remove_endpoint(id));
    let text = metrics();
    assert!(
        !text.contains("endpoint=\"b\""),
        "b's series left with it: {text}"
    );
    assert!(!router.remove_endpoint(id));
    assert!(added.subscriber_stats().is_none());
    for i in 12..20 {
        assert_eq!(served_by(&client, running.addr, i).await, "a");
    }
    let mut bad = endpoint_config(&b, "c");
    bad.url = "ftp://x".into();
    assert!(router.add_endpoint(bad).is_err());

    // It can come back, in a new slot: a request planned on the old one may still be on its
    // way there, and would be charged to the newcomer.
    let back = router.add_endpoint(endpoint_config(&b, "b")).unwrap();
    assert_ne!(back, id);
    assert!(metrics().contains("endpoint=\"b\""), "b has series again");
}

/// An engine whose completions stream their headers at once and their tokens only once `release`
/// says so: a request in flight there for as long as a test needs. Returns its URL, and whether
/// a request reached it.
async fn held_stream_engine(release: watch::Receiver<bool>) -> (String, Arc<AtomicBool>) {
    let reached = Arc::new(AtomicBool::new(false));
    let seen = reached.clone();
    let routes = axum::Router::new().route(
        "/v1/completions",
        post(move || {
            seen.store(true, Ordering::SeqCst);
            let release = release.clone();
            async move { common::held_sse_answer(release) }
        }),
    );
    (fake_engine(routes).await, reached)
}

/// A decode endpoint removed while a request's decode leg is in flight there: the request
/// finishes, and neither its series nor its pair's (prefill, decode) series come back in the
/// exposition when it does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_departed_endpoints_series_stay_gone_when_its_last_request_ends() {
    let (release, held) = watch::channel(false);
    let (decode, reached) = held_stream_engine(held).await;
    let config = ConfigBuilder::new(MODEL)
        .url("p", &common::prefill_engine().await)
        .url("d", &decode)
        .with(pd_always)
        .build();
    let running = start(config).await.unwrap();
    let in_flight = common::spawn_completion(
        reqwest::Client::new(),
        running.addr,
        json!({"model": MODEL, "prompt": "hello", "max_tokens": 2, "stream": true}),
    );
    eventually("the decode leg reached d", || {
        (reached.load(Ordering::SeqCst), ())
    })
    .await;

    assert!(running.router.remove_endpoint(EndpointId(1)));
    let departed = |text: &str| text.contains("endpoint=\"d\"") || text.contains("decode=\"d\"");
    let metrics = || kvroute_testkit::http_get(running.admin_addr, "/metrics");
    let text = metrics();
    assert!(!departed(&text), "d's series left with it: {text}");

    release.send(true).unwrap();
    let (status, body) = in_flight.await.unwrap();
    assert_eq!(
        status, 200,
        "a request in flight at a departed endpoint finishes"
    );
    assert!(body.contains("[DONE]"), "{body}");
    // The response ended once the router let go of it: its accounting is done.
    let text = metrics();
    assert!(
        text.contains("kvroute_requests_total{endpoint=\"p\""),
        "the prefill leg, on a present endpoint, is counted: {text}"
    );
    assert!(!departed(&text), "d's series came back: {text}");
}
