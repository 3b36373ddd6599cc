//! Benchmarks of the KV block index: event ingestion (blocks applied per second) and
//! longest-prefix lookup latency, plus the router-key computation a lookup needs first.
//!
//! Fixtures are built outside the timed closures; see `fixtures/mod.rs`. Run with
//! `cargo bench -p kvroute-core --bench index -- --warm-up-time 1 --measurement-time 3`.

// A benchmark reads the clock (and /proc for memory): kvroute-core's purity rules
// (crates/core/clippy.toml) are for the library, not for its measurements.
#![allow(clippy::disallowed_methods)]

mod fixtures;

use std::collections::VecDeque;
use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BatchSize, BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvroute_core::event::KvEvent;
use kvroute_core::index::{EndpointId, KvIndex};
use kvroute_core::keys::router_keys;

use fixtures::{BLOCK_SIZE, Chain, UNBOUNDED, event_sizes, prefix_index, removal, tokens};

/// Endpoints in the ingestion fixture.
const INGEST_ENDPOINTS: usize = 16;
/// Shared system prompts, each held by every endpoint.
const SYSTEM_PROMPTS: usize = 8;
/// Conversations per endpoint, each continuing one system prompt.
const CONVERSATIONS: usize = 24;
/// Blocks per system prompt and per conversation tail.
const CHAIN_BLOCKS: usize = 128;

/// Conversations kept live by the churn benchmark, per endpoint.
const WINDOW: usize = 64;
/// Unshared entries besides the request's in the lookup fixtures.
const LOOKUP_BACKGROUND: usize = 1_000_000;

/// One endpoint's batch of one event, in arrival order across the fleet.
type Batches = Vec<(EndpointId, Vec<KvEvent>)>;

/// What a fleet of 16 endpoints publishes while filling up: each endpoint stores every system
/// prompt once (shared with all others) and its own conversations after them, in events of 8 to
/// 32 blocks, interleaved round-robin across endpoints. Returns (system-prompt batches,
/// conversation batches).
fn fleet_events() -> (Batches, Batches) {
    let systems: Vec<Chain> = (0..SYSTEM_PROMPTS)
        .map(|s| Chain::new(1_000 + s as u64, CHAIN_BLOCKS))
        .collect();
    let mut sizes = event_sizes();
    let mut per_endpoint_sys = Vec::new();
    let mut per_endpoint_conv = Vec::new();
    for e in 0..INGEST_ENDPOINTS {
        let sys: Vec<KvEvent> = systems
            .iter()
            .flat_map(|s| s.stores(0, s.len(), None, &mut sizes))
            .collect();
        let conv: Vec<KvEvent> = (0..CONVERSATIONS)
            .flat_map(|c| {
                let system = &systems[(e + c) % SYSTEM_PROMPTS];
                let tail = Chain::after(system, (e * 1_000 + c) as u64, CHAIN_BLOCKS);
                tail.stores(0, tail.len(), Some(system.last_hash()), &mut sizes)
            })
            .collect();
        per_endpoint_sys.push(sys);
        per_endpoint_conv.push(conv);
    }
    (interleave(per_endpoint_sys), interleave(per_endpoint_conv))
}

/// One event per endpoint in turn, each as its own batch.
fn interleave(per_endpoint: Vec<Vec<KvEvent>>) -> Batches {
    let mut queues: Vec<_> = per_endpoint.into_iter().map(Vec::into_iter).collect();
    let mut out = Vec::new();
    loop {
        let before = out.len();
        for (e, queue) in queues.iter_mut().enumerate() {
            if let Some(event) = queue.next() {
                out.push((EndpointId(e as u32), vec![event]));
            }
        }
        if out.len() == before {
            return out;
        }
    }
}

fn blocks_in(batches: &Batches) -> u64 {
    batches
        .iter()
        .flat_map(|(_, events)| events)
        .map(|e| e.block_count() as u64)
        .sum()
}

fn apply_all(index: &mut KvIndex, batches: &Batches) {
    for (endpoint, events) in batches {
        index.apply(*endpoint, events);
    }
}

fn ingest(c: &mut Criterion) {
    let (sys, conv) = fleet_events();
    let all: Batches = sys.iter().chain(&conv).cloned().collect();
    let total = blocks_in(&all);
    let removals: Batches = conv
        .iter()
        .map(|(e, events)| (*e, events.iter().map(removal).collect()))
        .collect();
    {
        let mut check = fixtures::index(UNBOUNDED);
        apply_all(&mut check, &all);
        assert_eq!(check.entry_count() as u64, total, "no event was dropped");
        eprintln!(
            "ingest fixture: {} batches, {total} (block, endpoint) entries, {} distinct blocks",
            all.len(),
            check.block_count()
        );
    }

    let mut group = c.benchmark_group("ingest");
    group.throughput(Throughput::Elements(total));
    // Fresh inserts into an empty index: both tables grow as they fill.
    group.bench_function("store_fresh", |b| {
        b.iter_batched(
            || fixtures::index(UNBOUNDED),
            |mut index| {
                apply_all(&mut index, &all);
                index
            },
            BatchSize::PerIteration,
        );
    });
    // The same events again: every store is an idempotent re-store.
    let mut full = fixtures::index(UNBOUNDED);
    apply_all(&mut full, &all);
    group.bench_function("restore_idempotent", |b| {
        b.iter(|| apply_all(&mut full, &all));
    });
    drop(full);
    // Steady state: system prompts stay; every conversation is stored, then removed, so the
    // tables keep their size and every store is new.
    let churn = blocks_in(&conv) * 2;
    group.throughput(Throughput::Elements(churn));
    let mut base = fixtures::index(UNBOUNDED);
    apply_all(&mut base, &sys);
    group.bench_function("store_then_remove", |b| {
        b.iter(|| {
            apply_all(&mut base, &conv);
            apply_all(&mut base, &removals);
        });
    });
    drop(base);

    // Churn in a production-sized index (1M entries: tables far beyond the caches): each
    // iteration stores one new 128-block conversation per endpoint and removes the one stored
    // WINDOW iterations earlier. Events are built outside the timed part.
    let mut big = fixtures::index(UNBOUNDED);
    fixtures::add_private(&mut big, INGEST_ENDPOINTS, 1_000_000);
    let mut seed = 1u64 << 56;
    let mut sizes = event_sizes();
    let mut generation = move || {
        let mut stores = Vec::new();
        for _ in 0..INGEST_ENDPOINTS {
            seed += 1;
            let chain = Chain::new(seed, CHAIN_BLOCKS);
            stores.push(chain.stores(0, CHAIN_BLOCKS, None, &mut sizes));
        }
        let removes = stores
            .iter()
            .map(|events| events.iter().map(removal).collect())
            .collect();
        (interleave(stores), interleave(removes))
    };
    let mut live = VecDeque::new();
    for _ in 0..WINDOW {
        let (stores, removes) = generation();
        apply_all(&mut big, &stores);
        live.push_back(removes);
    }
    eprintln!(
        "churn fixture: {} entries, {} distinct blocks",
        big.entry_count(),
        big.block_count()
    );
    // Time the stores and the removals of the same churn separately.
    group.throughput(Throughput::Elements(
        (INGEST_ENDPOINTS * CHAIN_BLOCKS) as u64,
    ));
    for timed_part in ["store", "remove"] {
        group.bench_function(format!("{timed_part}_at_1M_entries"), |b| {
            b.iter_custom(|iters| {
                let mut timed = Duration::ZERO;
                for _ in 0..iters {
                    let (stores, removes) = generation();
                    let oldest = live.pop_front().expect("window is full");
                    let start = Instant::now();
                    apply_all(&mut big, &stores);
                    if timed_part == "store" {
                        timed += start.elapsed();
                    }
                    let start = Instant::now();
                    apply_all(&mut big, &oldest);
                    if timed_part == "remove" {
                        timed += start.elapsed();
                    }
                    live.push_back(removes);
                }
                timed
            });
        });
    }
    group.finish();
}

/// Endpoint `i` of E holds the first (i + 1)/E of the request (the last holds all of it), on
/// top of 1M unshared entries spread over the endpoints. Warm caches: the same request repeats.
fn lookup(c: &mut Criterion) {
    let mut group = c.benchmark_group("lookup");
    for blocks in [512usize, 8_192] {
        for endpoints in [16usize, 64, 256] {
            let (index, keys) = prefix_index(endpoints, blocks, LOOKUP_BACKGROUND);
            group.throughput(Throughput::Elements(blocks as u64));
            group.bench_with_input(
                BenchmarkId::new(format!("{blocks}_blocks"), format!("{endpoints}_endpoints")),
                &keys,
                |b, keys| b.iter(|| index.lookup(black_box(keys))),
            );
        }
    }
    group.finish();
}

fn keys(c: &mut Criterion) {
    let mut group = c.benchmark_group("router_keys");
    for blocks in [512usize, 8_192] {
        let prompt = tokens(11, blocks);
        group.throughput(Throughput::Elements(blocks as u64));
        group.bench_with_input(BenchmarkId::from_parameter(blocks), &prompt, |b, prompt| {
            b.iter(|| router_keys(black_box(prompt), BLOCK_SIZE, None))
        });
    }
    group.finish();
}

criterion_group!(benches, ingest, lookup, keys);
criterion_main!(benches);
