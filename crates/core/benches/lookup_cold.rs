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
//! - `inside`: `chat` with the request ending a block before endpoint 0's conversation does;
//!   `leaving`: `chat` with the request leaving the conversation halfway. A lookup finds where
//!   a request leaves a run by a search, not a walk.
//! - `restored`: `chat` copied into an empty index as a starting replica copies a peer's
//!   (`endpoint_blocks`, then `restore`), so the same two runs; `no-order`: the same copy
//!   without the entries' run order (a peer of a build without `follows`), so no run.
//!
//! Cold is measured twice. *All cold*: the lookup runs right after the flush, so its code, the
//! index's own fields and the lock are cold too, as they would be in a router idle for long
//! enough to lose them. *Data cold*: a one-block lookup of an absent key runs between the flush
//! and the timed lookup, as another request would in a router serving traffic, and the request's
//! keys are copied into a new list, as hashing its tokens just before the lookup makes one, so
//! the code, the index's fixed parts, the allocator and the request are warm and only the
//! index's blocks come from memory. A `1`-block
//! lookup of an absent key is each shape's floor (`floor` rows, after the shape's first size):
//! what any lookup costs.
//!
//! Run with `cargo bench -p kvroute-core --bench lookup_cold`; `KVROUTE_BENCH_QUICK=1` runs only
//! 512 blocks × 64 endpoints, `KVROUTE_BENCH_SHAPES=chat,inside` only those shapes, and
//! `KVROUTE_BENCH_ROUNDS=N` times `N` lookups per row (200 by default).

// A benchmark reads the clock (and /proc for memory): kvroute-core's purity rules
// (crates/core/clippy.toml) are for the library, not for its measurements.
#![allow(clippy::disallowed_methods)]

mod fixtures;

use std::hint::black_box;
use std::time::{Duration, Instant};

use fixtures::{
    inside_chat_index, leaving_chat_index, restored_chat_index, sharded_chat_index,
    sharded_prefix_index, unordered_chat_index,
};
use kvroute_core::index::SharedIndex;
use kvroute_core::keys::RouterKey;
use kvroute_testkit::settings::{refuse, setting, setting_list};

/// Timed lookups per configuration, unless `KVROUTE_BENCH_ROUNDS` says otherwise (the p99 of
/// 200 is the third-slowest lookup; more rounds steady it, each costing a flush of ~10 ms).
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

/// `rounds` timings of looking up `keys` in `index`, each right after writing `flush` (which
/// evicts the caches) and, with `warm_up`, after looking that up untimed and copying `keys`
/// into a new list, the one looked up (a router hashes a request's keys from its tokens into a
/// new list just before the lookup: they are in the caches, and so is the allocator).
fn timed_after_flush(
    rounds: usize,
    flush: &mut [u8],
    index: &SharedIndex,
    keys: &[RouterKey],
    warm_up: Option<&[RouterKey]>,
) -> Vec<Duration> {
    (0..rounds)
        .map(|round| {
            for line in flush.chunks_mut(64) {
                line[0] = line[0].wrapping_add(round as u8);
            }
            black_box(&mut *flush);
            let request = warm_up.map(|other| {
                black_box(index.lookup(black_box(other)));
                black_box(keys.to_vec())
            });
            let start = Instant::now();
            black_box(index.lookup(black_box(request.as_deref().unwrap_or(keys))));
            start.elapsed()
        })
        .collect()
}

/// Times lookups of `keys` warm, all cold and data cold, and prints their row.
fn report(
    rounds: usize,
    shape: &str,
    endpoints: usize,
    shards: usize,
    index: &SharedIndex,
    keys: &[RouterKey],
    flush: &mut [u8],
) {
    let mut warm: Vec<Duration> = (0..rounds)
        .map(|_| {
            let start = Instant::now();
            black_box(index.lookup(black_box(keys)));
            start.elapsed()
        })
        .collect();
    let absent = [RouterKey::from_hash(0x5eed_0fab_5e17)];
    let mut cold = timed_after_flush(rounds, flush, index, keys, None);
    let mut data_cold = timed_after_flush(rounds, flush, index, keys, Some(&absent));
    warm.sort_unstable();
    cold.sort_unstable();
    data_cold.sort_unstable();
    let cold_p50 = percentile(&cold, 50);
    println!(
        "{:>8} {:>7} {:>9} {:>6} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>7.1}ns {:>9.1} {:>9.1}",
        shape,
        keys.len(),
        endpoints,
        shards,
        micros(percentile(&warm, 50)),
        micros(cold_p50),
        micros(percentile(&cold, 90)),
        micros(percentile(&cold, 99)),
        micros(cold_p50) * 1e3 / keys.len() as f64,
        micros(percentile(&data_cold, 50)),
        micros(percentile(&data_cold, 99)),
    );
}

fn main() {
    let rounds: usize = setting("KVROUTE_BENCH_ROUNDS", ROUNDS);
    if rounds < 100 {
        refuse(
            "KVROUTE_BENCH_ROUNDS",
            &rounds.to_string(),
            "at least 100 lookups",
        );
    }
    let mut flush = vec![0u8; FLUSH_BYTES];
    println!("lookup with warm and cold caches ({rounds} lookups each; microseconds)");
    println!(
        "{:>8} {:>7} {:>9} {:>6} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "shape",
        "blocks",
        "endpoints",
        "shards",
        "warm p50",
        "cold p50",
        "cold p90",
        "cold p99",
        "cold/blk",
        "data p50",
        "data p99"
    );
    println!("{:43} {:-^39} {:-^19}", "", " all cold ", " data cold ");
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
    let shapes: [(&str, Build); 6] = [
        ("stairs", sharded_prefix_index),
        ("chat", sharded_chat_index),
        ("inside", inside_chat_index),
        ("leaving", leaving_chat_index),
        ("restored", restored_chat_index),
        ("no-order", unordered_chat_index),
    ];
    let names: Vec<&str> = shapes.iter().map(|(name, _)| *name).collect();
    let only = setting_list(
        "KVROUTE_BENCH_SHAPES",
        "",
        &format!("shape names, comma-separated: {names:?}"),
        |part| names.contains(&part).then(|| part.to_owned()),
    );
    for (shape, build) in shapes {
        if !only.is_empty() && !only.iter().any(|name| name == shape) {
            continue;
        }
        for &(blocks, endpoints) in sizes {
            for shards in [1usize, 2] {
                let (index, keys) = build(endpoints, blocks, BACKGROUND, shards);
                report(rounds, shape, endpoints, shards, &index, &keys, &mut flush);
                if blocks == sizes[0].0 && endpoints == sizes[0].1 {
                    // Two absent keys: the timed one is never the one that warmed up.
                    let floor = [RouterKey::from_hash(0x0f10_0a5e)];
                    report(
                        rounds, "floor", endpoints, shards, &index, &floor, &mut flush,
                    );
                }
            }
        }
    }
}
