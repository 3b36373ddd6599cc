//! Memory per (block, endpoint) entry of the KV block index, and the pause the capacity bound
//! costs when it runs.
//!
//! Each measurement runs in a child process of this binary so that it starts from a clean heap:
//! the child builds an index from streamed events and reports `heap_bytes()` (table capacities,
//! as the index computes them) and the growth of its resident set size (`/proc/self/statm`),
//! which also counts allocator overhead and freed-but-kept memory. The parent prints tables.
//!
//! Run with `cargo bench -p kvroute-core --bench memory`.

// A benchmark reads the clock (and /proc for memory): kvroute-core's purity rules
// (crates/core/clippy.toml) are for the library, not for its measurements.
#![allow(clippy::disallowed_methods)]

mod fixtures;

use std::process::Command;
use std::time::Instant;

use kvroute_core::index::{EndpointId, KvIndex};

use fixtures::{Chain, UNBOUNDED, chain_lengths, fill, private_seeds, rss_bytes};

/// Selects the child's job; unset in the parent.
const CHILD_VAR: &str = "KVROUTE_MEMORY_BENCH_CHILD";
/// Entry counts measured; hashbrown tables double when 7/8 full, so these two sit early
/// (1.0M, tables about half full) and late (1.8M, tables about 7/8 full) in a growth cycle
/// for the unshared scenarios.
const SIZES: [usize; 2] = [1_000_000, 1_800_000];

/// One fleet shape.
#[derive(Clone, Copy)]
struct Scenario {
    name: &'static str,
    endpoints: usize,
    /// Fraction of each endpoint's blocks that belong to chains every endpoint holds.
    shared: f64,
    /// Whether every block is also offloaded to CPU memory (a second tier).
    offload: bool,
}

const SCENARIOS: [Scenario; 4] = [
    Scenario {
        name: "16 ep, 50% shared",
        endpoints: 16,
        shared: 0.5,
        offload: false,
    },
    Scenario {
        name: "16 ep, none shared",
        endpoints: 16,
        shared: 0.0,
        offload: false,
    },
    Scenario {
        name: "256 ep, 50% shared",
        endpoints: 256,
        shared: 0.5,
        offload: false,
    },
    Scenario {
        name: "16 ep, none shared, +CPU tier",
        endpoints: 16,
        shared: 0.0,
        offload: true,
    },
];

/// Builds the scenario's index with about `entries` entries, streaming each chain's events.
fn build(scenario: &Scenario, entries: usize, capacity: usize) -> KvIndex {
    let per_endpoint = entries / scenario.endpoints;
    let shared = (per_endpoint as f64 * scenario.shared) as usize;
    let mut index = fixtures::index(capacity);
    for e in 0..scenario.endpoints {
        let shared_seeds = (0u64..).map(|c| (1 << 60) + c);
        let chains = chain_lengths(shared)
            .zip(shared_seeds)
            .chain(chain_lengths(per_endpoint - shared).zip(private_seeds(e)));
        fill(&mut index, EndpointId(e as u32), chains, scenario.offload);
    }
    index
}

/// Child: build one scenario and print `entries blocks heap_bytes rss_delta build_seconds`.
fn measure_memory(scenario: &Scenario, entries: usize) {
    let before = rss_bytes();
    let start = Instant::now();
    let index = build(scenario, entries, UNBOUNDED);
    let seconds = start.elapsed().as_secs_f64();
    let rss = rss_bytes().saturating_sub(before);
    println!(
        "{} {} {} {rss} {seconds}",
        index.entry_count(),
        index.block_count(),
        index.heap_bytes()
    );
}

/// Batches of 16 blocks timed just under the capacity, for comparison with the one over it.
const NORMAL_BATCHES: usize = 100;

/// Child: fill an index to its capacity, then time the one batch that takes it over.
/// Prints `entries_after pause_seconds mean_normal_batch_seconds`.
fn measure_eviction(capacity: usize) {
    let mut index = build(&SCENARIOS[1], capacity - NORMAL_BATCHES * 16, capacity);
    let batch = |seed: u64| {
        let chain = Chain::new(seed, 16);
        chain.stores(0, 16, None, &mut std::iter::repeat(16))
    };
    let normal: Vec<_> = (0..NORMAL_BATCHES as u64)
        .map(|i| batch(u64::MAX - i))
        .collect();
    let start = Instant::now();
    for events in &normal {
        index.apply(EndpointId(0), events);
    }
    let normal = start.elapsed().as_secs_f64() / NORMAL_BATCHES as f64;
    assert_eq!(index.entry_count(), capacity);
    let over = batch(u64::MAX / 2);
    let start = Instant::now();
    index.apply(EndpointId(0), &over);
    let pause = start.elapsed().as_secs_f64();
    println!("{} {pause} {normal}", index.entry_count());
}

fn child(job: &str) -> Vec<f64> {
    let out = Command::new(std::env::current_exe().expect("own path"))
        .env(CHILD_VAR, job)
        .output()
        .expect("run child");
    assert!(
        out.status.success(),
        "child {job} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .map(|v| v.parse().expect("number"))
        .collect()
}

fn main() {
    if let Ok(job) = std::env::var(CHILD_VAR) {
        let (kind, arg) = job.split_once(':').expect("job:arg");
        match kind {
            "evict" => measure_eviction(arg.parse().expect("capacity")),
            _ => {
                let scenario = &SCENARIOS[kind.parse::<usize>().expect("scenario")];
                measure_memory(scenario, arg.parse().expect("entries"));
            }
        }
        return;
    }

    println!("bytes per (block, endpoint) entry");
    println!(
        "{:<30} {:>10} {:>10} {:>11} {:>10} {:>12}",
        "scenario", "entries", "blocks", "heap/entry", "RSS/entry", "build Mblk/s"
    );
    for (i, scenario) in SCENARIOS.iter().enumerate() {
        for entries in SIZES {
            let v = child(&format!("{i}:{entries}"));
            let (entries, blocks, heap, rss, seconds) = (v[0], v[1], v[2], v[3], v[4]);
            let stored = if scenario.offload { 2.0 } else { 1.0 } * entries;
            println!(
                "{:<30} {:>10} {:>10} {:>11.1} {:>10.1} {:>12.2}",
                scenario.name,
                entries,
                blocks,
                heap / entries,
                rss / entries,
                stored / seconds / 1e6
            );
        }
    }

    println!();
    println!(
        "capacity bound: the batch that takes a full index over its capacity (16 ep, none shared)"
    );
    println!(
        "{:>10} {:>14} {:>12} {:>18}",
        "capacity", "entries after", "pause ms", "normal batch us"
    );
    for capacity in [1_000_000usize, 4_000_000] {
        let v = child(&format!("evict:{capacity}"));
        println!(
            "{:>10} {:>14} {:>12.1} {:>18.1}",
            capacity,
            v[0],
            v[1] * 1e3,
            v[2] * 1e6
        );
    }
}
