//! The router's memory budget, term by term, as docs/operations.md gives it: what each bound of
//! the configuration may cost at most, from measurement (`tests/memory.rs` checks the routing
//! memory's terms against the resident memory they take, within 25%).

use crate::config::RouterConfig;

/// The binary, the runtime and fixed tables.
pub const BASE_BYTES: u64 = 50 << 20;
/// One (block, endpoint) entry of the KV index (benchmarks.md, "Memory per entry").
pub const INDEX_ENTRY_BYTES: u64 = 48;
/// One (block, endpoint) record of the routing history or the predicted overlay at full
/// capacity, in the worst case: every request one block long, so each record is a request's
/// record, a run of the chain tree and a key, at the tables' worst fill. Requests of many blocks
/// share a run and a record (at 64 blocks a request, with the shared prefixes' runs: about a
/// seventh of the formula, `tests/memory_long_requests.rs`).
pub const HISTORY_RECORD_BYTES: u64 = 144;
/// One block of the table of shared prefixes (sized by `cache.history_capacity`).
pub const SHARED_BLOCK_BYTES: u64 = 66;
/// One remembered session.
pub const SESSION_BYTES: u64 = 100;
/// Hyper's read and write buffers of one open client connection, at most: the read buffer is
/// bounded by the largest request head ([`crate::edge::MAX_HEAD_BYTES`]), the write buffer
/// holds a response's head (bodies are written through).
pub const CONNECTION_BYTES: u64 = crate::edge::MAX_HEAD_BYTES as u64 + (16 << 10);

/// What the budget comes to with every default, at most: the total docs/operations.md
/// documents and the Helm chart's memory limit allows for.
pub const DEFAULT_TOTAL_BYTES: u64 = 2560 << 20;

/// The routing history (`history_records` records, each with a shared-prefix block) and the
/// predicted overlay (`predicted_records`), full.
pub fn routing_memory_bytes(history_records: u64, predicted_records: u64) -> u64 {
    history_records * (HISTORY_RECORD_BYTES + SHARED_BLOCK_BYTES)
        + predicted_records * HISTORY_RECORD_BYTES
}

/// Each term of the budget for `config`: (what, bytes at most).
pub fn budget_terms(config: &RouterConfig) -> Vec<(&'static str, u64)> {
    let fleet = config.fleet_config();
    let l = &config.limits;
    vec![
        ("binary, runtime, tables", BASE_BYTES),
        (
            "KV index",
            config.cache.index_capacity as u64 * INDEX_ENTRY_BYTES,
        ),
        (
            "routing history, shared prefixes, predicted overlay",
            routing_memory_bytes(
                fleet.history_capacity as u64,
                fleet.predicted_capacity as u64,
            ),
        ),
        ("sessions", fleet.sessions_capacity as u64 * SESSION_BYTES),
        ("token cache", l.token_cache_bytes as u64),
        // Bodies held, and what a body becomes while prepared: its parsed JSON and tokens
        // (three times the body at most) on the blocking pool for a large one; for a small
        // one, at most the offload threshold on each of the async workers.
        (
            "request bodies and their preparation",
            l.max_buffered_bytes as u64
                + 3 * l.offload_threads as u64 * l.max_body_bytes as u64
                + 3 * 16 * l.offload_above_bytes as u64,
        ),
        (
            "client connections (API and admin)",
            (l.max_connections + crate::descriptors::ADMIN_CONNECTIONS) as u64 * CONNECTION_BYTES,
        ),
    ]
}

/// The whole budget for `config`, in bytes.
pub fn budget_bytes(config: &RouterConfig) -> u64 {
    budget_terms(config).iter().map(|(_, b)| b).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_fit_the_documented_total() {
        let yaml = "models: [{name: m}]\nendpoints: [{url: 'http://127.0.0.1:1'}]\n";
        let config = RouterConfig::from_yaml(yaml).unwrap();
        let total = budget_bytes(&config);
        for (what, bytes) in budget_terms(&config) {
            eprintln!("{what}: {} MiB", bytes >> 20);
        }
        eprintln!("total: {} MiB", total >> 20);
        assert!(
            total <= DEFAULT_TOTAL_BYTES,
            "{} MiB at defaults, {} MiB documented",
            total >> 20,
            DEFAULT_TOTAL_BYTES >> 20
        );
    }
}
