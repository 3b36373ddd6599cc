//! The memory budget of docs/operations.md (`crates/router/src/memory.rs`) against the resident
//! memory the router's routing memory really takes: the routing history, the predicted overlay
//! and the table of shared prefixes filled to their capacities with distinct blocks in this
//! process, measured as the growth of `VmRSS`. Filled by one-block requests (the worst case:
//! a record and a run per block) the formula and the measurement agree within 25%
//! (`memory_long_requests.rs`, its own process: long requests take less).

mod common;

use common::routing_memory::routing_memory_over_formula;

#[test]
fn the_documented_routing_memory_is_the_worst_case_one_block_requests_take() {
    let ratio = routing_memory_over_formula(1);
    assert!(
        (0.75..=1.25).contains(&ratio),
        "one-block requests: the router took {ratio:.2} of the formula"
    );
}
