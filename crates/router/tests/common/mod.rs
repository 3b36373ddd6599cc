//! Helpers the router's integration tests share.

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
