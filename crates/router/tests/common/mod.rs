//! Helpers the router's integration tests share.

// Each test binary uses some of them.
#![allow(dead_code)]

use kvroute_sim::server::{SimConfig, SimFleet, start as start_sim};

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
