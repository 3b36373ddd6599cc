//! Helpers the router's integration tests share.

// Each test binary uses some of them.
#![allow(dead_code)]

use kvroute_sim::server::{EngineEndpoint, SimConfig, SimFleet, start as start_sim};
use serde_json::Value;

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

/// A router started from `yaml`, once its KV-event subscribers are connected.
pub async fn router_from_yaml(yaml: &str) -> kvroute_router::server::RunningRouter {
    let config = kvroute_router::config::RouterConfig::from_yaml(yaml).unwrap();
    let router = kvroute_router::server::start(config).await.unwrap();
    kvroute_testkit::eventually("subscribers connected", || {
        (router.subscribers_connected(), ())
    })
    .await;
    router
}

/// The `endpoints:` list items for `endpoints`, named `e0`, `e1`, ... in order.
pub fn endpoint_lines<'a>(endpoints: impl IntoIterator<Item = &'a EngineEndpoint>) -> String {
    endpoints
        .into_iter()
        .enumerate()
        .map(|(i, ep)| {
            format!(
                "  - {{name: e{i}, url: '{}', events: '{}', replay: '{}'}}\n",
                ep.url,
                ep.events,
                ep.replay.as_deref().unwrap_or_default()
            )
        })
        .collect()
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
