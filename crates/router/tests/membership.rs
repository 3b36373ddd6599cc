//! Endpoints joining and leaving a running router (what Kubernetes discovery drives), in front
//! of simulated engines over real HTTP and ZMQ.

mod common;

use common::config_builder::{ConfigBuilder, endpoint};
use common::engine;
use kvroute_router::config::EndpointConfig;
use kvroute_router::server::start;
use kvroute_router::testing::Membership;
use kvroute_sim::server::SimFleet;
use kvroute_testkit::eventually;
use serde_json::json;

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
