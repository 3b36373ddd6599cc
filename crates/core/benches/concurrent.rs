//! The index under production-like concurrency on a large fleet: writers apply the fleet's
//! events (stores and removals, with the capacity bound evicting) as fast as they can, while
//! another thread looks up requests, each timed on its own. Runs on an index of one shard with
//! one writer (the index before sharding), then on one of two shards with two writers, one per
//! shard. Reports the ingest rate and the lookups' latency percentiles, and the same figures
//! for ingest alone and lookups alone. The ingest rate is given per second of wall time (all
//! writers together) and per second of the writers' CPU time (other processes on a shared
//! machine lower the first, not the second); the lookup latencies are wall-clock.
//!
//! Run with `cargo bench -p kvroute-core --bench concurrent` (about four minutes; 2 cores).
//! `KVROUTE_BENCH_ENTRIES` sets the index size (default 10M entries) and
//! `KVROUTE_BENCH_ENDPOINTS` the fleet (default 64); 1,000 endpoints × 100k blocks is
//! `KVROUTE_BENCH_ENDPOINTS=1000 KVROUTE_BENCH_ENTRIES=100000000`. `KVROUTE_BENCH_CONFIGS`
//! lists the (shards, writers) pairs to run, default `1x1,2x2`. A last phase paces the writers
//! at `KVROUTE_BENCH_PACED` block events per second (default 500,000: ingest that does not
//! saturate the writers). `KVROUTE_BENCH_PHASES` runs only the phases whose names contain one
//! of its comma-separated parts. The index line and each phase show how much of the process's
//! memory the kernel backs with transparent huge pages (`huge MiB`): 0 unless the run asked for
//! them (`GLIBC_TUNABLES=glibc.malloc.hugetlb=1`, see docs/operations.md) and got them.
//!
//! The other phases put the index behind kvroute-core's `Fleet`, as the router runs it, the
//! precise profile planning 512-block requests. "before" is the router until 2026-12-02: a
//! decision walks the index under the fleet's mutex (`Fleet::plan`) and event batches are
//! applied under it too (`Fleet::apply_events`). "now" is the router since: the walk runs before
//! the mutex is taken (its target read without the mutex: `Fleet::lookup_targets`, then
//! `Fleet::plan_with`), and a batch is noted under the mutex and applied after it is released,
//! under the index shard's own lock (`Fleet::events_arrived`). Both with saturating and paced
//! ingest, then two planners at once (as the router's workers plan), without ingest and with
//! paced ingest; the last two phases read the walk's target under the mutex instead (the mutex
//! taken twice per decision, as the router did until the lock-free targets).

// A benchmark reads the clock (and /proc for memory): kvroute-core's purity rules
// (crates/core/clippy.toml) are for the library, not for its measurements.
#![allow(clippy::disallowed_methods)]

mod fixtures;

use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvroute_core::event::KvEvent;
use kvroute_core::fleet::{EndpointSpec, Fleet, FleetConfig, LookupTargets, RequestFeatures};
use kvroute_core::index::{EndpointId, OffloadSpec, SharedIndex};
use kvroute_core::keys::RouterKey;
use kvroute_core::schedule::{Profile, ProfileName, Role};
use kvroute_testkit::settings::{setting, setting_at_least, setting_list};
use parking_lot::Mutex;

use fixtures::{
    BLOCK_SIZE, Chain, anon_huge_bytes, chain_lengths, fill, private_seeds, removal, rss_bytes,
};

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
const PHASE: Duration = Duration::from_secs(6);
/// The model every endpoint serves.
const MODEL: &str = "m";

/// What a phase's reader does.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Reader {
    /// Nothing (no reader thread).
    Idle,
    /// Index lookups.
    Lookup,
    /// Whole decisions under the fleet's mutex.
    Plan,
    /// Decisions whose index walk runs before the fleet's mutex is taken, its target read
    /// without the mutex (`Fleet::lookup_targets`, then `Fleet::plan_with`), as the router plans.
    PlanWalkFirst,
    /// The same with the walk's target read under the mutex (`Fleet::lookup_target`): the
    /// mutex taken twice per decision, as the router planned before.
    PlanTargetInLock,
}

/// How a phase's writers apply a batch.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Writes {
    /// Not at all (no writer threads).
    Idle,
    /// Straight to the index.
    Index,
    /// Under the fleet's mutex.
    UnderFleet,
    /// Noted under the fleet's mutex, applied after releasing it.
    BesideFleet,
}

/// The index behind its fleet, and the requests the reader looks up.
struct Bench {
    fleet: Arc<Mutex<Fleet>>,
    index: Arc<SharedIndex>,
    keys: Vec<Arc<Vec<RouterKey>>>,
    /// The fleet's clock starts here.
    epoch: Instant,
}

/// One conversation's stores and the removals that undo them.
type Churn = Vec<(Vec<KvEvent>, Vec<KvEvent>)>;

fn main() {
    let entries = setting("KVROUTE_BENCH_ENTRIES", 10_000_000usize);
    let endpoints = setting("KVROUTE_BENCH_ENDPOINTS", 64usize);
    let paced = setting_at_least("KVROUTE_BENCH_PACED", 500_000.0, 1.0);
    let churn: Churn = (0..CHURN_CHAINS)
        .map(|c| {
            let chain = Chain::new(5_000_000 + c as u64, CHURN_BLOCKS);
            let stores = chain.stores(0, CHURN_BLOCKS, None, &mut std::iter::repeat(16));
            let removals = stores.iter().map(removal).collect();
            (stores, removals)
        })
        .collect();
    let churn = Arc::new(churn);
    println!(
        "{:<28} {:>6} {:>7} {:>12} {:>14} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "phase",
        "shards",
        "writers",
        "Mev/wall-s",
        "Mev/writer-cpu-s",
        "lookups",
        "p50 us",
        "p99 us",
        "max us",
        "huge MiB"
    );
    let configurations = configurations();
    let wanted = wanted_phases(paced);
    for (shards, writers) in configurations {
        let bench = build(entries, endpoints, shards);
        for phase in phases(paced)
            .into_iter()
            .filter(|p| wanted.contains(&p.name))
        {
            let feed = Feed {
                endpoints,
                churn: churn.clone(),
                writers: if phase.writes == Writes::Idle {
                    0
                } else {
                    writers
                },
                writes: phase.writes,
                pace: phase.pace,
            };
            run_phase(&phase, &bench, &feed);
        }
    }
}

/// The names of the phases to run: every phase, or those whose names contain one of the
/// comma-separated parts of `KVROUTE_BENCH_PHASES` (`ingest alone` to profile ingest only). A
/// part that names no phase stops the benchmark, listing the phases.
fn wanted_phases(paced: f64) -> Vec<&'static str> {
    let names: Vec<&'static str> = phases(paced).iter().map(|p| p.name).collect();
    let expected = format!("parts of phase names, comma-separated: {names:?}");
    let parts = setting_list("KVROUTE_BENCH_PHASES", "", &expected, |part| {
        names
            .iter()
            .any(|name| name.contains(part))
            .then(|| part.to_owned())
    });
    names
        .into_iter()
        .filter(|name| parts.is_empty() || parts.iter().any(|part| name.contains(part.as_str())))
        .collect()
}

/// One timed phase: what its writers and readers do.
struct Phase {
    name: &'static str,
    writes: Writes,
    reader: Reader,
    /// Reader threads (each a client of the fleet, as the router's workers are).
    readers: usize,
    /// Block events per second of all writers together (`None`: as fast as they can).
    pace: Option<f64>,
}

/// Every phase, in the order run; `paced` is the paced phases' rate.
fn phases(paced: f64) -> Vec<Phase> {
    let phase = |name, writes, reader, readers, pace| Phase {
        name,
        writes,
        reader,
        readers,
        pace,
    };
    use Reader::{Idle, Lookup, Plan, PlanTargetInLock, PlanWalkFirst};
    use Writes::{BesideFleet, Index, UnderFleet};
    vec![
        phase("ingest alone", Index, Idle, 0, None),
        phase("lookups alone", Writes::Idle, Lookup, 1, None),
        phase("ingest + lookups", Index, Lookup, 1, None),
        phase("paced + lookups", Index, Lookup, 1, Some(paced)),
        phase("plans alone", Writes::Idle, Plan, 1, None),
        phase("before: plans + events", UnderFleet, Plan, 1, None),
        phase("now: plans + events", BesideFleet, PlanWalkFirst, 1, None),
        phase("before: plans + paced", UnderFleet, Plan, 1, Some(paced)),
        phase(
            "now: plans + paced",
            BesideFleet,
            PlanWalkFirst,
            1,
            Some(paced),
        ),
        phase("2 planners, walk in lock", Writes::Idle, Plan, 2, None),
        phase(
            "2 planners, walk first",
            Writes::Idle,
            PlanWalkFirst,
            2,
            None,
        ),
        phase(
            "before: 2 planners + paced",
            UnderFleet,
            Plan,
            2,
            Some(paced),
        ),
        phase(
            "now: 2 planners + paced",
            BesideFleet,
            PlanWalkFirst,
            2,
            Some(paced),
        ),
        phase(
            "2 planners, target in lock",
            Writes::Idle,
            PlanTargetInLock,
            2,
            None,
        ),
        phase(
            "2 planners + paced, target in lock",
            BesideFleet,
            PlanTargetInLock,
            2,
            Some(paced),
        ),
    ]
}

/// (shards, writers) to run: `KVROUTE_BENCH_CONFIGS` as `1x1,2x2` (the default), or any list.
fn configurations() -> Vec<(usize, usize)> {
    setting_list(
        "KVROUTE_BENCH_CONFIGS",
        "1x1,2x2",
        "SHARDSxWRITERS, comma-separated, each at least 1 (e.g. 1x1,2x2)",
        |part| {
            let (shards, writers) = part.split_once('x')?;
            let shards: usize = shards.trim().parse().ok()?;
            let writers: usize = writers.trim().parse().ok()?;
            (shards >= 1 && writers >= 1).then_some((shards, writers))
        },
    )
}

/// A fleet whose index of `shards` shards is filled for the phases, and the requests the
/// reader looks up.
fn build(entries: usize, endpoints: usize, shards: usize) -> Bench {
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
    let config = FleetConfig {
        index_capacity: capacity,
        index_shards: shards,
        ..FleetConfig::default()
    };
    let specs = (0..endpoints)
        .map(|e| EndpointSpec {
            name: format!("e{e}"),
            models: vec![MODEL.to_owned()],
            role: Role::Both,
            has_events: true,
            block_size: BLOCK_SIZE,
            offload: OffloadSpec::default(),
        })
        .collect();
    let mut fleet =
        Fleet::new(config, Profile::named(ProfileName::Precise), specs).expect("a valid fleet");
    for e in 0..endpoints {
        let spare = if e >= endpoints / 2 { spare } else { 0 };
        let chains = chain_lengths(entries / endpoints + spare).zip(private_seeds(e));
        fill(&mut fleet, EndpointId(e as u32), chains, false);
    }
    // Requests: each stored whole on one endpoint and half on another (lower half).
    let requests: Vec<Chain> = (0..REQUESTS)
        .map(|r| Chain::new(9_000_000 + r as u64, REQUEST_BLOCKS))
        .collect();
    for (r, chain) in requests.iter().enumerate() {
        let whole = chain.stores(0, REQUEST_BLOCKS, None, &mut std::iter::repeat(32));
        fleet.apply_events(EndpointId((r % (endpoints / 2)) as u32), &whole, 0.0);
        let half = chain.stores(0, REQUEST_BLOCKS / 2, None, &mut std::iter::repeat(32));
        fleet.apply_events(EndpointId(((r + 1) % (endpoints / 2)) as u32), &half, 0.0);
    }
    let index = fleet.index_of(EndpointId(0)).cloned().expect("an index");
    let (entry_count, block_count) = index.read(|r| (r.entry_count(), r.block_count()));
    println!(
        "index: {} shard(s), {} endpoints, {} entries, {} blocks (per shard, summed), built in {:.1} s, RSS +{:.0} MiB ({:.1} B/entry), {} MiB on huge pages",
        shards,
        endpoints,
        entry_count,
        block_count,
        start.elapsed().as_secs_f64(),
        rss_bytes().saturating_sub(rss_before) as f64 / (1 << 20) as f64,
        rss_bytes().saturating_sub(rss_before) as f64 / entry_count as f64,
        anon_huge_bytes() >> 20,
    );
    Bench {
        fleet: Arc::new(Mutex::new(fleet)),
        index,
        keys: requests.into_iter().map(|c| Arc::new(c.keys)).collect(),
        epoch: Instant::now(),
    }
}

/// Runs one phase for `PHASE`: the feed's writers, and the phase's readers; prints its row.
fn run_phase(phase: &Phase, bench: &Bench, feed: &Feed) {
    let shards = bench.index.shard_count();
    let writers = feed.writers;
    let ingest = writers > 0;
    let stop = Arc::new(AtomicBool::new(false));
    let wall = Instant::now();
    let writer_threads: Vec<_> = (0..writers)
        .map(|w| {
            let (target, stop, feed) = (Target::of(bench), stop.clone(), feed.clone());
            std::thread::spawn(move || ingest_until(&target, &feed, w, &stop))
        })
        .collect();
    let readers: Vec<_> = (0..phase.readers)
        .map(|r| {
            let (target, stop, keys) = (Target::of(bench), stop.clone(), bench.keys.clone());
            let reader = phase.reader;
            std::thread::spawn(move || reads_until(&target, reader, r, &keys, &stop))
        })
        .collect();
    std::thread::sleep(PHASE);
    stop.store(true, Ordering::Relaxed);
    let done: Vec<(u64, f64)> = writer_threads
        .into_iter()
        .map(|w| w.join().expect("writer"))
        .collect();
    let seconds = wall.elapsed().as_secs_f64();
    let events: u64 = done.iter().map(|(events, _)| events).sum();
    let cpu: f64 = done.iter().map(|(_, cpu)| cpu).sum();
    let mut times: Vec<Duration> = readers
        .into_iter()
        .flat_map(|r| r.join().expect("reader"))
        .collect();
    times.sort_unstable();
    let at = |p: usize| {
        times
            .get((times.len().max(1) - 1) * p / 100)
            .map_or(0.0, |d| d.as_secs_f64() * 1e6)
    };
    let rate = |per: f64| {
        if ingest {
            format!("{:.2}", events as f64 / per / 1e6)
        } else {
            "-".into()
        }
    };
    println!(
        "{:<28} {:>6} {:>7} {:>12} {:>14} {:>9} {:>9.1} {:>9.1} {:>9.1} {:>9}",
        phase.name,
        shards,
        writers,
        rate(seconds),
        rate(cpu),
        times.len(),
        at(50),
        at(99),
        times.last().map_or(0.0, |d| d.as_secs_f64() * 1e6),
        anon_huge_bytes() >> 20,
    );
}

/// CPU seconds this thread has run (10 ms resolution): on a shared machine the wall clock also
/// counts the time other processes had the core.
fn thread_cpu_seconds() -> f64 {
    kvroute_testkit::proc_cpu_seconds("/proc/thread-self/stat")
}

/// What the writers of a phase apply.
#[derive(Clone)]
struct Feed {
    endpoints: usize,
    churn: Arc<Churn>,
    /// Writers; writer `w` takes the endpoints `e` with `e mod writers = w` (with one writer
    /// per shard: its shard's).
    writers: usize,
    /// How they apply each batch.
    writes: Writes,
    /// Block events per second of all writers together (`None`: as fast as they can).
    pace: Option<f64>,
}

/// Applies churn batches until told to stop: writer `writer` takes its endpoints'
/// conversations, stores each and removes it `WINDOW` (all writers together) conversations
/// later. Returns (block events applied, CPU seconds).
fn ingest_until(target: &Target, feed: &Feed, writer: usize, stop: &AtomicBool) -> (u64, f64) {
    let endpoint = |c: usize| EndpointId((c % feed.endpoints) as u32);
    let mine: Vec<usize> = (0..CHURN_CHAINS)
        .filter(|&c| endpoint(c).0 as usize % feed.writers == writer)
        .collect();
    let window = WINDOW * mine.len() / CHURN_CHAINS;
    let wall = Instant::now();
    let start = thread_cpu_seconds();
    let mut events = 0u64;
    let mut step = 0usize;
    while !stop.load(Ordering::Relaxed) {
        let c = mine[step % mine.len()];
        for batch in &feed.churn[c].0 {
            target.apply(feed.writes, endpoint(c), std::slice::from_ref(batch));
        }
        events += CHURN_BLOCKS as u64;
        if step >= window {
            let old = mine[(step - window) % mine.len()];
            target.apply(feed.writes, endpoint(old), &feed.churn[old].1);
            events += CHURN_BLOCKS as u64;
        }
        step += 1;
        if let Some(pace) = feed.pace {
            let due = Duration::from_secs_f64(events as f64 * feed.writers as f64 / pace);
            if let Some(early) = due.checked_sub(wall.elapsed()) {
                std::thread::sleep(early);
            }
        }
    }
    (events, thread_cpu_seconds() - start)
}

/// What a phase's threads work on: the fleet, its index, and the fleet's clock.
struct Target {
    fleet: Arc<Mutex<Fleet>>,
    targets: Arc<LookupTargets>,
    index: Arc<SharedIndex>,
    epoch: Instant,
}

impl Target {
    fn of(bench: &Bench) -> Self {
        Self {
            fleet: bench.fleet.clone(),
            targets: bench.fleet.lock().lookup_targets(),
            index: bench.index.clone(),
            epoch: bench.epoch,
        }
    }

    /// Seconds on the fleet's clock.
    fn now(&self) -> f64 {
        self.epoch.elapsed().as_secs_f64()
    }

    /// Applies one endpoint's batch the way `writes` says.
    fn apply(&self, writes: Writes, endpoint: EndpointId, events: &[KvEvent]) {
        match writes {
            Writes::Idle => {}
            Writes::Index => self.index.apply(endpoint, events),
            Writes::UnderFleet => self.fleet.lock().apply_events(endpoint, events, self.now()),
            Writes::BesideFleet => {
                let index = self.fleet.lock().events_arrived(endpoint, self.now());
                if let Some(index) = index {
                    index.apply(endpoint, events);
                }
            }
        }
    }
}

/// Looks up or plans requests (as `reader` says) in a fixed pseudo-random order until told to
/// stop; returns each one's time, waiting for locks included.
fn reads_until(
    target: &Target,
    reader: Reader,
    seed: usize,
    keys: &[Arc<Vec<RouterKey>>],
    stop: &AtomicBool,
) -> Vec<Duration> {
    let mut times = Vec::new();
    let mut r = seed * 101;
    while !stop.load(Ordering::Relaxed) {
        r = (r * 7 + 13) % keys.len();
        let start = Instant::now();
        match reader {
            Reader::Idle => {}
            Reader::Lookup => {
                black_box(target.index.lookup(&keys[r]));
            }
            Reader::Plan | Reader::PlanWalkFirst | Reader::PlanTargetInLock => {
                let request = RequestFeatures {
                    model: MODEL,
                    keys: &keys[r],
                    prompt_tokens: keys[r].len() * BLOCK_SIZE,
                    block_size: BLOCK_SIZE,
                    session: None,
                    role: Role::Both,
                };
                let lookup = match reader {
                    Reader::PlanWalkFirst => Some(target.targets.target(BLOCK_SIZE).run(&keys[r])),
                    Reader::PlanTargetInLock => {
                        let walk = target.fleet.lock().lookup_target(BLOCK_SIZE);
                        Some(walk.run(&keys[r]))
                    }
                    _ => None,
                };
                let now = target.now();
                let plan = target
                    .fleet
                    .lock()
                    .plan_with(&request, lookup, r as u64, now);
                black_box(plan);
            }
        }
        times.push(start.elapsed());
    }
    times
}
