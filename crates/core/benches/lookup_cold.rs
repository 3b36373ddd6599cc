//! Lookup latency with cold caches: before each timed lookup, 96 MiB (three times the last-level
//! cache of the benchmark machine) is written, so the index's tables come from memory as they
//! would for a request whose blocks no recent request touched. Criterion cannot exclude such a
//! flush from its timing, so this target times single lookups itself and prints medians.
//!
//! The index also holds 1M unshared entries, so the request's blocks are scattered over a
//! production-sized block table (and over many pages). Every configuration runs on a
//! [`SharedIndex`](kvroute_core::index::SharedIndex) of one shard and of two (the price of
//! sharding: a request's blocks held on both shards are walked in both).
//!
//! Two shapes of request:
//! - `stairs`: endpoint `i` of `n` holds the first `(i + 1) / n` of the request, so the holders
//!   change every `blocks / n` blocks. The worst case for runs of blocks with the same holders
//!   (`n` of them: a lookup reads one per run).
//! - `chat`: every endpoint holds a system prompt (an eighth of the request) and a conversation
//!   of its own after it; the request is endpoint 0's, stored in prefill-sized events and a
//!   decode's single blocks. Two runs: the prompt and the conversation.
//!
//! Run with `cargo bench -p kvroute-core --bench lookup_cold`; `KVROUTE_BENCH_QUICK=1` runs only
//! 512 blocks × 64 endpoints.

// A benchmark reads the clock (and /proc for memory): kvroute-core's purity rules
// (crates/core/clippy.toml) are for the library, not for its measurements.
#![allow(clippy::disallowed_methods)]

mod fixtures;

use std::hint::black_box;
use std::time::{Duration, Instant};

use fixtures::{sharded_chat_index, sharded_prefix_index};
use kvroute_core::index::SharedIndex;
use kvroute_core::keys::RouterKey;

/// Timed lookups per configuration.
const ROUNDS: usize = 200;
/// Unshared entries besides the request's, so that the block table is production-sized.
const BACKGROUND: usize = 1_000_000;
/// Bytes written between lookups to evict the caches.
const FLUSH_BYTES: usize = 96 << 20;

/// Builds an index of a request's shape: (endpoints, blocks, background entries, shards) →
/// the index and the request's keys.
type Build = fn(usize, usize, usize, usize) -> (SharedIndex, Vec<RouterKey>);

fn percentile(sorted: &[Duration], p: usize) -> Duration {
    sorted[(sorted.len() - 1) * p / 100]
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn main() {
    let mut flush = vec![0u8; FLUSH_BYTES];
    println!("lookup with warm and cold caches ({ROUNDS} lookups each; microseconds)");
    println!(
        "{:>6} {:>7} {:>9} {:>6} {:>11} {:>11} {:>11} {:>11} {:>9}",
        "shape",
        "blocks",
        "endpoints",
        "shards",
        "warm p50",
        "cold p50",
        "cold p90",
        "cold p99",
        "cold/blk"
    );
    let quick = std::env::var_os("KVROUTE_BENCH_QUICK").is_some();
    let sizes: &[(usize, usize)] = if quick {
        &[(512, 64)]
    } else {
        &[
            (512, 16),
            (512, 64),
            (512, 256),
            (8_192, 16),
            (8_192, 64),
            (8_192, 256),
        ]
    };
    let shapes: [(&str, Build); 2] = [
        ("stairs", sharded_prefix_index),
        ("chat", sharded_chat_index),
    ];
    for (shape, build) in shapes {
        for &(blocks, endpoints) in sizes {
            for shards in [1usize, 2] {
                let (index, keys) = build(endpoints, blocks, BACKGROUND, shards);
                let mut warm = Vec::with_capacity(ROUNDS);
                for _ in 0..ROUNDS {
                    let start = Instant::now();
                    black_box(index.lookup(black_box(&keys)));
                    warm.push(start.elapsed());
                }
                let mut cold = Vec::with_capacity(ROUNDS);
                for round in 0..ROUNDS {
                    for line in flush.chunks_mut(64) {
                        line[0] = line[0].wrapping_add(round as u8);
                    }
                    black_box(&mut flush);
                    let start = Instant::now();
                    black_box(index.lookup(black_box(&keys)));
                    cold.push(start.elapsed());
                }
                warm.sort_unstable();
                cold.sort_unstable();
                let cold_p50 = percentile(&cold, 50);
                println!(
                    "{:>6} {:>7} {:>9} {:>6} {:>11.1} {:>11.1} {:>11.1} {:>11.1} {:>7.1}ns",
                    shape,
                    blocks,
                    endpoints,
                    shards,
                    micros(percentile(&warm, 50)),
                    micros(cold_p50),
                    micros(percentile(&cold, 90)),
                    micros(percentile(&cold, 99)),
                    micros(cold_p50) * 1e3 / blocks as f64,
                );
            }
        }
    }
}
