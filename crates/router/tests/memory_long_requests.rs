//! The memory budget's routing-memory formula (`crates/router/src/memory.rs`) is an upper
//! bound: filled by long requests (64 blocks each), the history shares a record and a run
//! between a request's blocks and takes less than the formula, measured as the growth of
//! `VmRSS` in a process of its own.

mod common;

use common::routing_memory::routing_memory_over_formula;

#[test]
fn long_requests_take_less_routing_memory_than_the_formula() {
    let ratio = routing_memory_over_formula(64);
    assert!(
        ratio <= 1.0,
        "64-block requests: the router took {ratio:.2} of the formula"
    );
}
