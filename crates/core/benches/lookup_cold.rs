//! Lookup latency with cold caches: before each timed lookup, three times the machine's
//! last-level cache is written (its size read from `/sys/devices/system/cpu/cpu0/cache`; 96 MiB
//! where that cannot be read, three times the 32 MiB of the machine these benchmarks were first
//! run on), so the index's tables come from memory as they would for a request whose blocks no
//! recent request touched. A fixed size is not enough: on a machine whose last-level cache is
//! larger than the flush (480 MiB on some current servers) the "cold" lookups would read it.
//! Criterion cannot exclude such a flush from its timing, so this target times single lookups
//! itself and prints medians.
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
//! Before the lookups, a `chase` line times a chain of dependent reads at random lines of a
//! buffer the flush evicted, the same way: what a cold read costs on the machine, and how long
//! its tail is when the work is the same in every round (virtual machines add stalls of their
//! own that no index can avoid).
//!
//! Run with `cargo bench -p kvroute-core --bench lookup_cold`; `KVROUTE_BENCH_QUICK=1` runs only
//! 512 blocks × 64 endpoints, `KVROUTE_BENCH_SHAPES=chat,inside` only those shapes, and
//! `KVROUTE_BENCH_ROUNDS=N` times `N` lookups per row (200 by default), and
//! `KVROUTE_BENCH_FLUSH_MIB=M` writes `M` MiB between lookups instead.

// A benchmark reads the clock (and /proc for memory): kvroute-core's purity rules
// (crates/core/clippy.toml) are for the library, not for its measurements.
#![allow(clippy::disallowed_methods)]

mod fixtures;

use std::hint::black_box;
use std::time::{Duration, Instant};

use fixtures::{
    anon_huge_bytes, inside_chat_index, leaving_chat_index, restored_chat_index,
    sharded_chat_index, sharded_prefix_index, unordered_chat_index,
};
use kvroute_core::index::SharedIndex;
use kvroute_core::keys::RouterKey;
use kvroute_testkit::settings::{refuse, setting, setting_list};

/// Timed lookups per configuration, unless `KVROUTE_BENCH_ROUNDS` says otherwise (the p99 of
/// 200 is the third-slowest lookup; more rounds steady it, each costing two flushes: about 10 ms
/// each on a 32 MiB cache, 0.15 s on a 480 MiB one).
const ROUNDS: usize = 200;
/// Unshared entries besides the request's, so that the block table is production-sized.
const BACKGROUND: usize = 1_000_000;
/// Bytes written between lookups to evict the caches where the last-level cache's size cannot
/// be read.
const FALLBACK_FLUSH_BYTES: usize = 96 << 20;
/// Times the last-level cache's size written between lookups.
const FLUSH_TIMES_CACHE: usize = 3;

/// The size of the largest cache of CPU 0 as Linux reports it (`None` elsewhere, or when
/// sysfs cannot be read): sizes are written as `491520K` or `32M`.
fn last_level_cache_bytes() -> Option<usize> {
    let caches = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    caches
        .filter_map(|entry| {
            let size = std::fs::read_to_string(entry.ok()?.path().join("size")).ok()?;
            let size = size.trim();
            let (digits, unit) = size.split_at(size.find(|c: char| !c.is_ascii_digit())?);
            let shift = match unit {
                "K" => 10,
                "M" => 20,
                "G" => 30,
                _ => return None,
            };
            digits.parse::<usize>().ok().map(|n| n << shift)
        })
        .max()
}

/// Bytes written between lookups: `KVROUTE_BENCH_FLUSH_MIB`, else three times the last-level
/// cache, else [`FALLBACK_FLUSH_BYTES`].
fn flush_bytes() -> usize {
    let cache = last_level_cache_bytes();
    let default_mib = cache.map_or(FALLBACK_FLUSH_BYTES, |bytes| bytes * FLUSH_TIMES_CACHE) >> 20;
    let mib: usize = setting("KVROUTE_BENCH_FLUSH_MIB", default_mib);
    if mib == 0 {
        refuse("KVROUTE_BENCH_FLUSH_MIB", "0", "at least 1 MiB");
    }
    println!(
        "last-level cache: {}; {mib} MiB written before each cold lookup",
        cache.map_or("unknown".to_owned(), |bytes| format!("{} MiB", bytes >> 20)),
    );
    mib << 20
}

/// Builds an index of a request's shape: (endpoints, blocks, background entries, shards) →
/// the index and the request's keys.
type Build = fn(usize, usize, usize, usize) -> (SharedIndex, Vec<RouterKey>);

fn percentile(sorted: &[Duration], p: usize) -> Duration {
    sorted[(sorted.len() - 1) * p / 100]
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// `rounds` timings of `timed`, each right after writing `flush` (which evicts the caches) and
/// then running `prepare` untimed, whose result `timed` takes.
fn timed_after_flush<T>(
    rounds: usize,
    flush: &mut [u8],
    mut prepare: impl FnMut() -> T,
    mut timed: impl FnMut(T),
) -> Vec<Duration> {
    (0..rounds)
        .map(|round| {
            for line in flush.chunks_mut(64) {
                line[0] = line[0].wrapping_add(round as u8);
            }
            black_box(&mut *flush);
            let prepared = prepare();
            let start = Instant::now();
            timed(prepared);
            start.elapsed()
        })
        .collect()
}

/// Cache lines of the chase's buffer (64 MiB: as many pages as a production-sized block
/// table spreads a request over, so its reads miss the TLB as the lookups' do).
const CHASE_LINES: usize = (64 << 20) / 64;
/// Dependent reads per timed chase: one per run of the stairs request.
const CHASE_READS: usize = 64;

/// What cold reads cost on this machine, to read the lookups' figures against: a chain of
/// [`CHASE_READS`] dependent reads, each at a random line of a buffer the flush evicted, timed
/// as the lookups are. Its tail is the machine's (the hypervisor, other tenants, page walks),
/// since the work is the same in every round.
fn report_chase(rounds: usize, flush: &mut [u8]) {
    // One `u64` per line, the next line's number: a random cycle through every line.
    let mut order: Vec<usize> = (0..CHASE_LINES).collect();
    let mut random = kvroute_testkit::random::SplitMix64(0xc0ff_ee00_5eed);
    for i in (1..order.len()).rev() {
        order.swap(i, (random.next_u64() % (i as u64 + 1)) as usize);
    }
    let mut next = vec![0u64; CHASE_LINES * 8];
    for pair in order.windows(2) {
        next[pair[0] * 8] = pair[1] as u64;
    }
    next[order[CHASE_LINES - 1] * 8] = order[0] as u64;
    let mut start = order[0];
    let mut chase = timed_after_flush(
        rounds,
        flush,
        || {
            // Each round starts where the last ended: never the lines just read.
            start = (start + CHASE_LINES / 2) % CHASE_LINES;
            start
        },
        |from| {
            let mut at = from;
            for _ in 0..CHASE_READS {
                at = next[at * 8] as usize;
            }
            black_box(at);
        },
    );
    chase.sort_unstable();
    println!(
        "   chase {CHASE_READS:>7} dependent reads of random lines: cold p50 {:.1}, p90 {:.1}, p99 {:.1} \
         ({:.1}ns per read)",
        micros(percentile(&chase, 50)),
        micros(percentile(&chase, 90)),
        micros(percentile(&chase, 99)),
        micros(percentile(&chase, 50)) * 1e3 / CHASE_READS as f64,
    );
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
    let mut cold = timed_after_flush(
        rounds,
        flush,
        || (),
        |()| {
            black_box(index.lookup(black_box(keys)));
        },
    );
    // The code, the index's fixed parts and the allocator warmed by a lookup of another key,
    // and the keys copied into a new list, the one looked up (a router hashes a request's keys
    // from its tokens into a new list just before the lookup: they are in the caches).
    let mut data_cold = timed_after_flush(
        rounds,
        flush,
        || {
            black_box(index.lookup(black_box(&absent)));
            black_box(keys.to_vec())
        },
        |request| {
            black_box(index.lookup(black_box(&request)));
        },
    );
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
    let mut flush = vec![0u8; flush_bytes()];
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
    report_chase(rounds, &mut flush);
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
    // Whether a run that asked for huge pages (docs/operations.md) got them.
    println!(
        "memory on transparent huge pages at the end: {} MiB",
        anon_huge_bytes() >> 20
    );
}
