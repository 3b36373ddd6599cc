//! Live KV-event ingestion end to end: vLLM-shaped Python publishers (pyzmq PUB with vLLM's
//! high-water mark, a ROUTER replay socket, msgspec payloads; `benches/python/
//! flood_publisher.py`) → kvroute's subscriber (its own ZMTP client, the sequencer, the
//! decoder) → the KV index, over loopback TCP, as `kvroute serve` follows its engines (without
//! the router's fleet bookkeeping around each batch).
//!
//! Each publisher is a busy engine: every batch stores a 32-block chain with its 512 token ids
//! and removes an older one (64 block events). For each count of publishers and each rate,
//! the publishers send for a while; the benchmark reports the block events the index received
//! per second of wall time (from `go` until every batch sent is applied or reported lost) and
//! per second of this process's CPU time (on a shared machine the publishers take cores too),
//! the time left to drain after the publishers stopped, and what the stream's sequencing saw:
//! gaps, batches filled by replay, batches lost for good. A lost batch is one the subscriber
//! reported (`FeedStats::lost_batches`); a batch neither applied nor reported is counted as
//! missing, which must stay 0. Chains stored after a lost removal still index; a lost store
//! leaves nothing to chain onto (orphan blocks, counted, never guessed).
//!
//! Before each count's live runs, the same publishers' payloads are decoded and applied in
//! process on one thread, their batches taken in turn: the ratio of the live figure per
//! CPU-second to it is what the network, ZMTP, the sequencer and the runtime cost.
//!
//! Run with `KVROUTE_PYTHON=$PWD/.venv/bin/python cargo bench -p kvroute-vllm --bench live_ingest`
//! (`scripts/test.sh` makes that Python). Settings: `KVROUTE_BENCH_PUBLISHERS` (default
//! `1,2,8`), `KVROUTE_BENCH_RATES` (batches per second per publisher, `0` for as fast as
//! Python sends; default `0`), `KVROUTE_BENCH_SECONDS` (default 3), `KVROUTE_BENCH_SHARDS`
//! (index shards, default 1), `KVROUTE_BENCH_WINDOW` (chains each engine's cache holds, default
//! 1,024) and `KVROUTE_BENCH_CHAIN_BLOCKS` (blocks per chain, default 32: 32,768 blocks a cache,
//! an 8B model's on one H100; a batch carries twice as many block events).

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_core::index::{EndpointId, IndexConfig, SharedIndex};
use kvroute_testkit::script::JsonLinesChild;
use kvroute_testkit::settings::{setting, setting_at_least, setting_list};
use kvroute_vllm::codec::decode_batch;
use kvroute_vllm::subscriber::{
    EndpointSource, FeedStats, SubscriberHandle, Timing, spawn_connected,
};
use serde_json::Value;
use tokio::process::Command;

const SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/benches/python/flood_publisher.py"
);
const BLOCK_SIZE: usize = 16;
/// How long the subscribers may take to connect, and to drain once the publishers stop.
const PATIENCE: Duration = Duration::from_secs(60);

fn main() {
    // The subscriber's own logs (gaps, replays, lost batches) when `RUST_LOG` asks for them.
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let Ok(python) = std::env::var("KVROUTE_PYTHON") else {
        eprintln!(
            "live_ingest skipped: set KVROUTE_PYTHON to a Python with pyzmq and msgspec \
             (scripts/test.sh makes one in .venv)"
        );
        return;
    };
    let publishers = setting_list(
        "KVROUTE_BENCH_PUBLISHERS",
        "1,2,8",
        "publisher counts",
        |p| p.parse::<usize>().ok().filter(|&n| n > 0),
    );
    let rates = setting_list(
        "KVROUTE_BENCH_RATES",
        "0",
        "batches per second (0: unpaced)",
        |r| r.parse::<f64>().ok().filter(|r| r.is_finite() && *r >= 0.0),
    );
    let seconds = setting_at_least("KVROUTE_BENCH_SECONDS", 3.0, 0.1);
    let shards = setting("KVROUTE_BENCH_SHARDS", 1usize);
    let window = setting("KVROUTE_BENCH_WINDOW", 1_024usize);
    let chain_blocks = setting("KVROUTE_BENCH_CHAIN_BLOCKS", 32usize);
    let shape = Shape {
        shards,
        window,
        chain_blocks,
    };

    println!(
        "index: {shards} shard(s); each engine's cache {} blocks; {} block events a batch",
        shape.cache_blocks(),
        2 * chain_blocks
    );
    println!();
    println!(
        "| publishers | rate, batches/s each | sent, M block events/s | applied, M/s wall | \
         applied, M per CPU-s | in process, M/s | ÷ in process | drain, ms | gaps | replayed | \
         lost | missing | orphan blocks |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mut in_process = std::collections::HashMap::new();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    for &rate in &rates {
        for &count in &publishers {
            let in_process = *in_process
                .entry(count)
                .or_insert_with(|| in_process_rate(&python, &shape, count));
            let run = runtime.block_on(live_run(&python, count, rate, seconds, &shape));
            let rate_text = if rate > 0.0 {
                format!("{rate:.0}")
            } else {
                "unpaced".into()
            };
            println!(
                "| {count} | {rate_text} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.0} | {} | {} | {} | {} | {} |",
                run.sent_block_events as f64 / run.publishing.as_secs_f64() / 1e6,
                run.applied_block_events as f64 / run.wall.as_secs_f64() / 1e6,
                run.applied_block_events as f64 / run.cpu_seconds / 1e6,
                in_process / 1e6,
                run.applied_block_events as f64 / run.cpu_seconds / in_process,
                run.drain.as_secs_f64() * 1e3,
                run.totals.gaps,
                run.totals.replayed_batches,
                run.totals.lost_batches,
                run.missing,
                run.orphan_blocks,
            );
        }
    }
}

/// The payloads publisher `seed` sends first, in order (`4 * window` of them: its cache
/// filled, then turned over three times).
fn dumped_payloads(python: &str, seed: usize, shape: &Shape) -> Vec<Vec<u8>> {
    let dump = std::env::temp_dir().join(format!(
        "kvroute-live-ingest-{}-{seed}.bin",
        std::process::id()
    ));
    let status = std::process::Command::new(python)
        .arg(SCRIPT)
        .args(["--seed", &seed.to_string()])
        .args(shape.publisher_args())
        .arg("--dump")
        .arg(&dump)
        .args(["--dump-batches", &(4 * shape.window).to_string()])
        .status()
        .unwrap_or_else(|e| panic!("cannot run {python} {SCRIPT}: {e}"));
    assert!(
        status.success(),
        "the publisher script failed to dump its payloads"
    );
    let bytes = std::fs::read(&dump).expect("read the dumped payloads");
    let _ = std::fs::remove_file(&dump);
    let mut payloads = Vec::new();
    let mut rest = bytes.as_slice();
    while let Some((len, tail)) = rest.split_first_chunk::<4>() {
        let len = u32::from_be_bytes(*len) as usize;
        payloads.push(tail[..len].to_vec());
        rest = &tail[len..];
    }
    payloads
}

/// Block events per second that one thread decodes and applies from `engines` publishers' own
/// payloads, their batches taken in turn (a fresh index per pass, passes repeated for about
/// two seconds): the live run's work without the network, ZMTP and the sequencer.
fn in_process_rate(python: &str, shape: &Shape, engines: usize) -> f64 {
    let streams: Vec<Vec<Vec<u8>>> = (1..=engines)
        .map(|seed| dumped_payloads(python, seed, shape))
        .collect();
    let mut events = 0u64;
    let mut spent = Duration::ZERO;
    while spent < Duration::from_secs(2) {
        let index = new_index(shape.shards);
        let started = Instant::now();
        for step in 0..4 * shape.window {
            for (seed, stream) in (1..).zip(&streams) {
                let decoded = decode_batch(&stream[step]).expect("the publisher's payloads decode");
                events += block_events(&decoded.batch.events);
                index.apply(EndpointId(seed), &decoded.batch.events);
            }
        }
        spent += started.elapsed();
        // A figure for events the index dropped (orphans) would measure nothing.
        for seed in (1..).take(engines) {
            let held = index
                .endpoint_stats(EndpointId(seed))
                .expect("the endpoint is indexed");
            assert_eq!(
                (held.blocks_gpu, held.orphan_blocks),
                (shape.cache_blocks() as u64, 0),
                "the index holds every chain of the engine's cache"
            );
        }
    }
    events as f64 / spent.as_secs_f64()
}

/// What each engine publishes and the index it feeds.
struct Shape {
    /// Index shards.
    shards: usize,
    /// Chains an engine's cache holds.
    window: usize,
    /// Blocks per chain.
    chain_blocks: usize,
}

impl Shape {
    /// Blocks an engine's cache holds once full.
    fn cache_blocks(&self) -> usize {
        self.window * self.chain_blocks
    }

    /// The publisher script's arguments for this shape.
    fn publisher_args(&self) -> [String; 4] {
        [
            "--window".into(),
            self.window.to_string(),
            "--chain-blocks".into(),
            self.chain_blocks.to_string(),
        ]
    }
}

fn block_events(events: &[kvroute_core::event::KvEvent]) -> u64 {
    use kvroute_core::event::KvEvent;
    events
        .iter()
        .map(|e| match e {
            KvEvent::BlockStored(s) => s.block_hashes.len() as u64,
            KvEvent::BlockRemoved(r) => r.block_hashes.len() as u64,
            _ => 0,
        })
        .sum()
}

fn new_index(shards: usize) -> SharedIndex {
    SharedIndex::sharded(
        IndexConfig {
            block_size: BLOCK_SIZE,
            ..IndexConfig::default()
        },
        shards,
    )
    .expect("index configuration")
}

/// What one live run measured.
struct LiveRun {
    /// Block events the publishers sent.
    sent_block_events: u64,
    /// How long they sent for, by their own clocks (the longest).
    publishing: Duration,
    /// Block events applied to the index (live and replayed).
    applied_block_events: u64,
    /// From `go` until every batch sent was applied or reported lost.
    wall: Duration,
    /// This process's CPU time over `wall`.
    cpu_seconds: f64,
    /// From the last publisher's end until then.
    drain: Duration,
    /// Every stream's counters, added up.
    totals: FeedStats,
    /// Batches neither applied nor reported lost.
    missing: u64,
    /// Stored blocks the index could not chain (their parent unknown: a lost batch's).
    orphan_blocks: u64,
}

/// One publisher script, talking JSON lines.
struct Publisher(JsonLinesChild);

impl Publisher {
    fn spawn(python: &str, seed: usize, rate: f64, seconds: f64, shape: &Shape) -> Self {
        let mut command = Command::new(python);
        command
            .arg(SCRIPT)
            .args(["--seed", &seed.to_string()])
            .args(["--rate", &rate.to_string()])
            .args(["--seconds", &seconds.to_string()])
            .args(shape.publisher_args());
        Self(JsonLinesChild::spawn(command, "the publisher script"))
    }

    async fn next_json(&mut self) -> Value {
        self.0.next_json(PATIENCE).await
    }

    async fn send(&mut self, line: &str) {
        self.0.send(line).await;
    }
}

fn field(value: &Value, name: &str) -> u64 {
    value[name]
        .as_u64()
        .unwrap_or_else(|| panic!("no {name} in {value}"))
}

async fn live_run(python: &str, count: usize, rate: f64, seconds: f64, shape: &Shape) -> LiveRun {
    let index = Arc::new(new_index(shape.shards));
    let mut publishers = Vec::new();
    let mut subscribers: Vec<SubscriberHandle> = Vec::new();
    for seed in 1..=count {
        let mut publisher = Publisher::spawn(python, seed, rate, seconds, shape);
        let addresses = publisher.next_json().await;
        subscribers.push(spawn_connected(
            EndpointSource {
                endpoint: EndpointId(seed as u32),
                name: format!("publisher-{seed}"),
                publisher: addresses["pub"].as_str().expect("pub address").into(),
                replay: addresses["replay"].as_str().map(Into::into),
                topic: String::new(),
            },
            index.clone(),
            Timing::default(),
        ));
        publishers.push(publisher);
    }
    let stats = |subscribers: &[SubscriberHandle]| -> Vec<FeedStats> {
        subscribers
            .iter()
            .flat_map(|s| s.stats().into_iter().map(|(_, feed)| feed))
            .collect()
    };
    wait_until(|| {
        let now = stats(&subscribers);
        now.len() == count && now.iter().all(|f| f.connected)
    })
    .await
    .expect("the subscribers connect");

    let cpu_before = kvroute_testkit::proc_cpu_seconds("/proc/self/stat");
    let started = Instant::now();
    for publisher in &mut publishers {
        publisher.send("go").await;
    }
    let mut sent_batches = Vec::new();
    let mut sent_block_events = 0;
    let mut publishing = Duration::ZERO;
    for publisher in &mut publishers {
        let report = publisher.next_json().await;
        sent_batches.push(field(&report, "sent"));
        sent_block_events += field(&report, "block_events");
        publishing = publishing.max(Duration::from_secs_f64(
            report["seconds"].as_f64().expect("seconds"),
        ));
    }
    let published = Instant::now();
    let accounted = |feeds: &[FeedStats]| {
        feeds
            .iter()
            .zip(&sent_batches)
            .all(|(feed, &sent)| feed.batches + feed.lost_batches >= sent)
    };
    // Not finding every batch accounted for is a result too (`missing`), not a failure.
    let _ = wait_until(|| accounted(&stats(&subscribers))).await;
    let wall = started.elapsed();
    let cpu_seconds = kvroute_testkit::proc_cpu_seconds("/proc/self/stat") - cpu_before;
    let feeds = stats(&subscribers);
    for publisher in &mut publishers {
        publisher.send("quit").await;
        publisher.next_json().await;
    }
    let mut totals = FeedStats::default();
    for feed in &feeds {
        totals.batches += feed.batches;
        totals.blocks_stored += feed.blocks_stored;
        totals.blocks_removed += feed.blocks_removed;
        totals.gaps += feed.gaps;
        totals.replayed_batches += feed.replayed_batches;
        totals.lost_batches += feed.lost_batches;
    }
    let mut missing = 0;
    for (feed, &sent) in feeds.iter().zip(&sent_batches) {
        let unaccounted = sent.saturating_sub(feed.batches + feed.lost_batches);
        if unaccounted > 0 {
            eprintln!("a stream did not drain: {sent} batches sent, its counters {feed:?}");
        }
        missing += unaccounted;
    }
    let orphan_blocks = (1..=count)
        .filter_map(|seed| index.endpoint_stats(EndpointId(seed as u32)))
        .map(|held| held.orphan_blocks)
        .sum();
    LiveRun {
        orphan_blocks,
        sent_block_events,
        publishing,
        applied_block_events: totals.blocks_stored + totals.blocks_removed,
        wall,
        cpu_seconds,
        drain: wall.saturating_sub(published - started),
        totals,
        missing,
    }
}

/// Polls `done` every 5 ms for up to [`PATIENCE`]; `Err` when it never held.
async fn wait_until(mut done: impl FnMut() -> bool) -> Result<(), ()> {
    let deadline = Instant::now() + PATIENCE;
    while !done() {
        if Instant::now() > deadline {
            return Err(());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(())
}
