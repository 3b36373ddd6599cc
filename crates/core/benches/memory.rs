//! Memory per (block, endpoint) entry of the KV block index, the pause the capacity bound
//! costs when it runs, and the pauses of its tables' growth.
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
/// Entry counts measured: two points in the tables' growth (the parts of a table grow and split
/// at different times, so its fill varies less with the count than one table's did).
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

/// Batches of 16 blocks timed per measurement: 320k blocks, over which the clock hand visits
/// 2.6M slots, twice round the 1M-entry index (with 2,000 batches it was still in its first
/// pass, clearing marks that the build set, and the figures were its best case); at 4M entries
/// it does not finish a pass.
const TIMED_BATCHES: usize = 20_000;

/// Child: fill an index to its capacity (the bound already evicting), then time single
/// 16-block batches, each of which also moves the clock hand. With `bounded` false the same
/// batches go into an index whose capacity is never reached, for comparison.
/// Prints `entries_after p50_seconds p99_seconds max_seconds`.
fn measure_eviction(capacity: usize, bounded: bool) {
    let limit = if bounded { capacity } else { UNBOUNDED };
    let mut index = build(&SCENARIOS[1], capacity, limit);
    let batches: Vec<_> = (0..TIMED_BATCHES as u64)
        .map(|i| Chain::new(u64::MAX - i, 16).stores(0, 16, None, &mut std::iter::repeat(16)))
        .collect();
    let mut times: Vec<f64> = batches
        .iter()
        .enumerate()
        .map(|(i, events)| {
            let start = Instant::now();
            index.apply(EndpointId((i % SCENARIOS[1].endpoints) as u32), events);
            start.elapsed().as_secs_f64()
        })
        .collect();
    if bounded {
        assert!(index.entry_count() <= capacity);
    }
    times.sort_by(f64::total_cmp);
    let at = |p: usize| times[(times.len() - 1) * p / 100];
    println!(
        "{} {} {} {}",
        index.entry_count(),
        at(50),
        at(99),
        times[times.len() - 1]
    );
}

/// Child: time every 16-block batch while an index grows from empty to `entries` entries (16
/// endpoints, none shared, batches taking turns between them), so that every table's growth
/// (each endpoint's table parts, the block table's) is among them.
/// Prints `p50_seconds p99_seconds p99.9_seconds max_seconds`.
fn measure_growth(entries: usize) {
    let mut index = fixtures::index(UNBOUNDED);
    let batches = (entries / 16) as u64;
    let mut times: Vec<f64> = (0..batches)
        .map(|i| {
            let events =
                Chain::new(u64::MAX - i, 16).stores(0, 16, None, &mut std::iter::repeat(16));
            let start = Instant::now();
            index.apply(EndpointId((i % 16) as u32), &events);
            start.elapsed().as_secs_f64()
        })
        .collect();
    assert_eq!(index.entry_count(), batches as usize * 16);
    times.sort_by(f64::total_cmp);
    let at = |per_mille: usize| times[(times.len() - 1) * per_mille / 1000];
    println!(
        "{} {} {} {}",
        at(500),
        at(990),
        at(999),
        times[times.len() - 1]
    );
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
            "grow" => measure_growth(arg.parse().expect("entries")),
            "evict" => {
                let (capacity, bounded) = arg.split_once(':').expect("capacity:bounded");
                measure_eviction(
                    capacity.parse().expect("capacity"),
                    bounded.parse().expect("bool"),
                );
            }
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
        "capacity bound: 16-block batches into a full index (16 ep, none shared), each also \
         moving the clock hand, vs the same batches with no bound"
    );
    println!(
        "{:>10} {:>9} {:>14} {:>9} {:>9} {:>9}",
        "capacity", "bound", "entries after", "p50 us", "p99 us", "max us"
    );
    for capacity in [1_000_000usize, 4_000_000] {
        for bounded in [true, false] {
            let v = child(&format!("evict:{capacity}:{bounded}"));
            println!(
                "{:>10} {:>9} {:>14} {:>9.1} {:>9.1} {:>9.1}",
                capacity,
                if bounded { "on" } else { "off" },
                v[0],
                v[1] * 1e6,
                v[2] * 1e6,
                v[3] * 1e6
            );
        }
    }

    println!();
    println!(
        "growth: 16-block batches while the index grows from empty (16 ep, none shared, \
         every table's growth among them)"
    );
    println!(
        "{:>10} {:>9} {:>9} {:>10} {:>9}",
        "entries", "p50 us", "p99 us", "p99.9 us", "max us"
    );
    for entries in [1_000_000usize, 4_000_000] {
        let v = child(&format!("grow:{entries}"));
        println!(
            "{:>10} {:>9.1} {:>9.1} {:>10.1} {:>9.1}",
            entries,
            v[0] * 1e6,
            v[1] * 1e6,
            v[2] * 1e6,
            v[3] * 1e6
        );
    }
}
