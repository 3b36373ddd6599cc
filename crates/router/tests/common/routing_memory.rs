//! The routing memory a filled history takes, against the budget's formula
//! (`tests/memory.rs`, `tests/memory_long_requests.rs`: one measurement per process, since
//! `VmRSS` is the process's).

use std::sync::Arc;

use super::config_builder::ConfigBuilder;
use kvroute_core::fleet::{EndpointSpec, Fleet, RequestFeatures};
use kvroute_core::index::EndpointId;
use kvroute_core::keys::RouterKey;
use kvroute_core::schedule::{Profile, Role};

/// Fills the routing history and the overlay to an eighth of their default capacities (and an
/// eighth beyond, so both evict) with distinct requests of `blocks` blocks each; the growth of
/// `VmRSS` over the formula's figure.
pub fn routing_memory_over_formula(blocks: u64) -> f64 {
    // The defaults' proportions (history 4 Mi, predicted overlay 1 Mi), at an eighth.
    let config = ConfigBuilder::new("m")
        .url("e0", "http://127.0.0.1:1")
        .with(|c| {
            c.cache.index_capacity = 1024;
            c.cache.history_capacity = 524288;
        })
        .build();
    let mut fleet_config = config.fleet_config();
    fleet_config.predicted_capacity = fleet_config.history_capacity / 4;
    fleet_config.history_ttl_s = 1e9;
    fleet_config.predicted_ttl_s = 1e9;
    let records = fleet_config.history_capacity as u64;
    let predicted = fleet_config.predicted_capacity as u64;
    let spec = |i: usize| EndpointSpec {
        name: format!("e{i}"),
        models: vec!["m".into()],
        role: Role::Both,
        has_events: false,
        block_size: 16,
        offload: Default::default(),
    };
    let before = kvroute_testkit::proc_memory(None, "VmRSS");
    let mut fleet = Fleet::new(fleet_config, Profile::default(), vec![spec(0), spec(1)]).unwrap();
    // Distinct blocks, a prompt at a time, until every table is full (and a little more, so
    // that the oldest entries are dropped as in a long-running router).
    let mut next = 1u64;
    for prompt in 0..(records + records / 8) / blocks {
        let keys: Vec<RouterKey> = (0..blocks)
            .map(|_| {
                next += 1;
                RouterKey(next)
            })
            .collect();
        let keys = Arc::new(keys);
        let features = RequestFeatures {
            model: "m",
            keys: &keys,
            prompt_tokens: (blocks * 16) as usize,
            block_size: 16,
            session: None,
            role: Role::Both,
        };
        let now = prompt as f64 * 1e-3;
        let dispatch = fleet.dispatched(&[], &features, EndpointId((prompt % 2) as u32), now);
        fleet.finished(dispatch, None, now);
    }
    let measured = kvroute_testkit::proc_memory(None, "VmRSS").saturating_sub(before);
    let formula = kvroute_router::testing::routing_memory_bytes(records, predicted);
    let ratio = measured as f64 / formula as f64;
    eprintln!(
        "routing memory, {blocks}-block requests: {measured} B measured, {formula} B by the formula ({:.0} B per history record besides the overlay), ratio {ratio:.2}",
        (measured as f64 - predicted as f64 * kvroute_router::testing::HISTORY_RECORD_BYTES as f64)
            / records as f64
    );
    drop(fleet);
    ratio
}
