//! The index under production-like concurrency on a large fleet: one thread applies the
//! fleet's events (stores and removals, with the capacity bound evicting) as fast as it can,
//! while another looks up requests, each timed on its own. Reports the ingest rate and the
//! lookups' latency percentiles, and the same figures for ingest alone and lookups alone. The
//! ingest rate is per second of the writer thread's CPU time, so that other processes on a
//! shared machine do not lower it; the lookup latencies are wall-clock and do include them.
//!
//! Run with `cargo bench -p kvroute-core --bench concurrent` (about a minute; 2 cores).
//! `KVROUTE_BENCH_ENTRIES` sets the index size (default 10M entries) and
//! `KVROUTE_BENCH_ENDPOINTS` the fleet (default 64); 1,000 endpoints × 100k blocks is
//! `KVROUTE_BENCH_ENDPOINTS=1000 KVROUTE_BENCH_ENTRIES=100000000`.

// A benchmark reads the clock (and /proc for memory): kvroute-core's purity rules
// (crates/core/clippy.toml) are for the library, not for its measurements.
#![allow(clippy::disallowed_methods)]

mod fixtures;

use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvroute_core::event::KvEvent;
use kvroute_core::index::{EndpointId, SharedIndex};

use fixtures::{Chain, chain_lengths, fill, private_seeds, removal, rss_bytes};

/// Blocks per churned conversation.
const CHURN_BLOCKS: usize = 64;
/// Conversations the writer cycles through; each is stored, then removed `WINDOW` later.
const CHURN_CHAINS: usize = 4_096;
/// Conversations live at once per cycle position.
const WINDOW: usize = 1_024;
/// Requests the reader draws from: stored prefixes of 512 blocks (8k tokens).
const REQUESTS: usize = 256;
/// Blocks per request.
const REQUEST_BLOCKS: usize = 512;
/// Extra private blocks on each endpoint of the upper half (the bound's victims), beyond what
/// the requests add to the lower half.
const MIN_SPARE: usize = 2_048;
/// How long each phase runs.
const PHASE: Duration = Duration::from_secs(8);

/// A size from the environment, or its default.
fn setting(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let entries = setting("KVROUTE_BENCH_ENTRIES", 10_000_000);
    let endpoints = setting("KVROUTE_BENCH_ENDPOINTS", 64);
    let rss_before = rss_bytes();
    let start = Instant::now();
    // The bound's high-water mark sits half-way through the churn window's growth, so that it
    // evicts during the timed phases. It evicts from the largest endpoint: the upper half of
    // the endpoints hold spare blocks, so that it finds its victims there and not
    // among the requests' holders.
    // Spare blocks: more than the requests add to each lower-half endpoint.
    let spare = REQUESTS * REQUEST_BLOCKS * 3 / endpoints + MIN_SPARE;
    let live = entries + endpoints / 2 * spare + REQUESTS * REQUEST_BLOCKS * 3 / 2;
    let capacity = (live + WINDOW * CHURN_BLOCKS / 2) * 10 / 9;
    let mut index = fixtures::index(capacity);
    for e in 0..endpoints {
        let spare = if e >= endpoints / 2 { spare } else { 0 };
        let chains = chain_lengths(entries / endpoints + spare).zip(private_seeds(e));
        fill(&mut index, EndpointId(e as u32), chains, false);
    }
    // Requests: each stored whole on one endpoint and half on another (lower half).
    let requests: Vec<Chain> = (0..REQUESTS)
        .map(|r| Chain::new(9_000_000 + r as u64, REQUEST_BLOCKS))
        .collect();
    for (r, chain) in requests.iter().enumerate() {
        let whole = chain.stores(0, REQUEST_BLOCKS, None, &mut std::iter::repeat(32));
        index.apply(EndpointId((r % (endpoints / 2)) as u32), &whole);
        let half = chain.stores(0, REQUEST_BLOCKS / 2, None, &mut std::iter::repeat(32));
        index.apply(EndpointId(((r + 1) % (endpoints / 2)) as u32), &half);
    }
    println!(
        "index: {} endpoints, {} entries, {} blocks, built in {:.1} s, RSS +{:.0} MiB ({:.1} B/entry)",
        endpoints,
        index.entry_count(),
        index.block_count(),
        start.elapsed().as_secs_f64(),
        rss_bytes().saturating_sub(rss_before) as f64 / (1 << 20) as f64,
        rss_bytes().saturating_sub(rss_before) as f64 / index.entry_count() as f64,
    );
    let churn: Vec<(Vec<KvEvent>, Vec<KvEvent>)> = (0..CHURN_CHAINS)
        .map(|c| {
            let chain = Chain::new(5_000_000 + c as u64, CHURN_BLOCKS);
            let stores = chain.stores(0, CHURN_BLOCKS, None, &mut std::iter::repeat(16));
            let removals = stores.iter().map(removal).collect();
            (stores, removals)
        })
        .collect();
    let keys: Vec<Vec<_>> = requests.iter().map(|c| c.keys.clone()).collect();
    let index = Arc::new(SharedIndex::new(index));

    println!(
        "{:<22} {:>14} {:>10} {:>10} {:>10} {:>10}",
        "phase", "ingest Mev/cpu-s", "lookups", "p50 us", "p99 us", "max us"
    );
    for (name, ingest, lookup) in [
        ("ingest alone", true, false),
        ("lookups alone", false, true),
        ("ingest + lookups", true, true),
    ] {
        let stop = Arc::new(AtomicBool::new(false));
        let writer = ingest.then(|| {
            let (index, stop, churn) = (index.clone(), stop.clone(), churn.clone());
            std::thread::spawn(move || ingest_until(&index, endpoints, &churn, &stop))
        });
        let reader = lookup.then(|| {
            let (index, stop, keys) = (index.clone(), stop.clone(), keys.clone());
            std::thread::spawn(move || lookups_until(&index, &keys, &stop))
        });
        std::thread::sleep(PHASE);
        stop.store(true, Ordering::Relaxed);
        let rate = writer.map(|w| {
            let (events, seconds) = w.join().expect("writer");
            events as f64 / seconds / 1e6
        });
        let mut times = reader
            .map(|r| r.join().expect("reader"))
            .unwrap_or_default();
        times.sort_unstable();
        let at = |p: usize| {
            times
                .get((times.len().max(1) - 1) * p / 100)
                .map_or(0.0, |d| d.as_secs_f64() * 1e6)
        };
        println!(
            "{:<22} {:>14} {:>10} {:>10.1} {:>10.1} {:>10.1}",
            name,
            rate.map_or("-".into(), |r| format!("{r:.2}")),
            times.len(),
            at(50),
            at(99),
            times.last().map_or(0.0, |d| d.as_secs_f64() * 1e6),
        );
    }
}

/// CPU seconds this thread has run, from `/proc/thread-self/stat` (10 ms resolution): on a
/// shared machine the wall clock also counts the time other processes had the core.
fn thread_cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").expect("read thread stat");
    // Fields after the command name (which is in parentheses): utime and stime are 14 and 15.
    let after = &stat[stat.rfind(')').expect("comm") + 2..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 =
        fields[11].parse::<f64>().expect("utime") + fields[12].parse::<f64>().expect("stime");
    ticks / 100.0
}

/// Applies churn batches (each conversation stored on an endpoint, removed `WINDOW` later)
/// until told to stop; returns (block events applied, CPU seconds).
fn ingest_until(
    index: &SharedIndex,
    endpoints: usize,
    churn: &[(Vec<KvEvent>, Vec<KvEvent>)],
    stop: &AtomicBool,
) -> (u64, f64) {
    let start = thread_cpu_seconds();
    let mut events = 0u64;
    let mut step = 0usize;
    while !stop.load(Ordering::Relaxed) {
        let endpoint = |c: usize| EndpointId((c % endpoints) as u32);
        let c = step % CHURN_CHAINS;
        for batch in &churn[c].0 {
            index.apply(endpoint(c), std::slice::from_ref(batch));
        }
        if step >= WINDOW {
            let old = (step - WINDOW) % CHURN_CHAINS;
            index.apply(endpoint(old), &churn[old].1);
        }
        events += 2 * CHURN_BLOCKS as u64;
        step += 1;
    }
    (events, thread_cpu_seconds() - start)
}

/// Looks up requests in a fixed pseudo-random order until told to stop; returns each lookup's
/// time.
fn lookups_until(
    index: &SharedIndex,
    keys: &[Vec<kvroute_core::keys::RouterKey>],
    stop: &AtomicBool,
) -> Vec<Duration> {
    let mut times = Vec::new();
    let mut r = 0usize;
    while !stop.load(Ordering::Relaxed) {
        r = (r * 7 + 13) % keys.len();
        let start = Instant::now();
        black_box(index.lookup(&keys[r]));
        times.push(start.elapsed());
    }
    times
}
