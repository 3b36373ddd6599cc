//! Ingestion from a real Python publisher built the way vLLM builds its own: pyzmq PUB plus a
//! ROUTER replay socket, msgspec structs declared with vLLM's struct options and field order
//! (0.23 positional events with the old replay framing, 0.33 map events with the topic in
//! replay replies), and real `sha256_cbor` block hashes. The script (`tests/python/
//! vllm_publisher.py`) simulates an engine's block pool, drops one batch on the live stream,
//! and reports which prefix of each conversation it still caches; the index must agree.
//!
//! The interpreter comes from `KVROUTE_PYTHON` (a Python with pyzmq and msgspec, which
//! `scripts/test.sh` sets up). Without it the tests are skipped with a notice, except under CI,
//! where that is an error.

use std::sync::Arc;
use std::time::Duration;

use kvroute_core::index::{EndpointId, IndexConfig, KvIndex, SharedIndex};
use kvroute_core::keys::router_keys;
use kvroute_testkit::script::JsonLinesChild;
use kvroute_testkit::{eventually, patience};
use kvroute_vllm::subscriber::{
    EndpointSource, EventSink, FeedStats, SubscriberHandle, Timing, spawn_connected,
};
use kvroute_vllm::zmtp::connection::Heartbeat;
use serde_json::Value;
use tokio::process::Command;

const E: EndpointId = EndpointId(3);
const NAME: &str = "python-engine";

/// The publisher script as a child process, talking JSON lines on stdout.
struct Script(JsonLinesChild);

impl Script {
    fn spawn(python: &str, layout: &str, topic: &str, extra_args: &[&str]) -> Self {
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/python/vllm_publisher.py"
        );
        let mut command = Command::new(python);
        command
            .arg(script)
            .args(["--layout", layout, "--topic", topic])
            .args(extra_args);
        Self(JsonLinesChild::spawn(command, "the publisher script"))
    }

    /// The next JSON line; panics if the script exits or stays silent.
    async fn next_json(&mut self) -> Value {
        self.0.next_json(patience()).await
    }

    async fn send(&mut self, line: &str) {
        self.0.send(line).await;
    }

    /// Asks the script to stop and checks that it ended cleanly.
    async fn quit(mut self) {
        self.send("quit").await;
        let status = self.0.finish(patience()).await;
        assert!(status.success(), "the publisher script failed: {status}");
    }
}

/// What the script says it published.
#[derive(Debug)]
struct Report {
    conversations: Vec<(Vec<u32>, u32)>,
    batches: u64,
    lost: Vec<u64>,
    cached_total: u64,
    blocks_stored: u64,
    blocks_removed: u64,
    /// Blocks on the connector's CPU tier at the end (0 without one).
    cpu_total: u64,
    /// Blocks requests found on the CPU tier and loaded.
    cpu_loaded: u64,
}

async fn read_report(script: &mut Script) -> Report {
    let mut conversations = Vec::new();
    loop {
        let line = script.next_json().await;
        if line["done"] == Value::Bool(true) {
            let num = |key: &str| {
                line[key]
                    .as_u64()
                    .unwrap_or_else(|| panic!("no {key} in {line}"))
            };
            let lost = line["lost"]
                .as_array()
                .expect("lost")
                .iter()
                .map(|v| v.as_u64().expect("lost seq"))
                .collect();
            return Report {
                conversations,
                batches: num("batches"),
                lost,
                cached_total: num("cached_total"),
                blocks_stored: num("blocks_stored"),
                blocks_removed: num("blocks_removed"),
                cpu_total: num("cpu_total"),
                cpu_loaded: num("cpu_loaded"),
            };
        }
        let tokens: Vec<u32> = serde_json::from_value(line["tokens"].clone())
            .unwrap_or_else(|e| panic!("bad tokens ({e}) in {line}"));
        let cached = line["cached_blocks"].as_u64().expect("cached_blocks") as u32;
        conversations.push((tokens, cached));
    }
}

fn stats(handle: &SubscriberHandle) -> FeedStats {
    handle
        .stats()
        .into_iter()
        .find(|(name, _)| name == NAME)
        .map(|(_, s)| s)
        .unwrap_or_default()
}

/// (engine's cached prefix, index's prefix) for every conversation.
fn prefixes(index: &SharedIndex, report: &Report) -> (bool, Vec<(u32, u32)>) {
    let pairs: Vec<(u32, u32)> = report
        .conversations
        .iter()
        .map(|(tokens, cached)| {
            let keys = router_keys(tokens, 16, None).unwrap();
            (*cached, index.lookup(&keys).blocks(E))
        })
        .collect();
    (pairs.iter().all(|(a, b)| a == b), pairs)
}

/// Runs the scenario and checks the index against the engine; the script's report, or `None`
/// when no Python is available.
async fn ingest_from_python(layout: &str, topic: &str, extra_args: &[&str]) -> Option<Report> {
    let python = kvroute_testkit::python("pyzmq and msgspec")?;
    let mut script = Script::spawn(&python, layout, topic, extra_args);
    let addresses = script.next_json().await;
    let publisher = addresses["pub"].as_str().expect("pub address").to_owned();
    let replay = addresses["replay"]
        .as_str()
        .expect("replay address")
        .to_owned();

    let index = Arc::new(SharedIndex::new(
        KvIndex::new(IndexConfig::default()).unwrap(),
    ));
    let handle = spawn_connected(
        EndpointSource {
            endpoint: E,
            name: NAME.into(),
            publisher,
            replay: Some(replay),
            topic: topic.into(),
        },
        index.clone() as Arc<dyn EventSink>,
        Timing::default(),
    );
    eventually("the subscription", || {
        (stats(&handle).connected, stats(&handle))
    })
    .await;
    script.send("go").await;
    let report = read_report(&mut script).await;

    // The scenario itself must be worth checking: a batch lost on PUB, evictions, and
    // conversations cached fully, partly and (through the shared system prompt) overlapping.
    assert_eq!(report.conversations.len(), 4, "{report:?}");
    assert!(!report.lost.is_empty(), "{report:?}");
    assert!(report.lost.iter().all(|&s| s + 1 < report.batches));
    assert!(report.blocks_removed > 0, "{report:?}");
    let full_blocks = |t: &Vec<u32>| (t.len() / 16) as u32;
    assert!(
        report
            .conversations
            .iter()
            .any(|(t, c)| *c > 0 && *c < full_blocks(t)),
        "some conversation must be partly evicted: {report:?}"
    );
    assert!(
        report
            .conversations
            .iter()
            .any(|(t, c)| *c == full_blocks(t)),
        "some conversation must be fully cached: {report:?}"
    );

    let last = report.batches - 1;
    eventually("the last batch applied", || {
        let s = stats(&handle);
        (s.last_seq == Some(last) && s.batches >= report.batches, s)
    })
    .await;
    eventually("index prefixes equal the engine's", || {
        prefixes(&index, &report)
    })
    .await;
    // Live copies of replayed batches may still be on their way: let them land before judging.
    tokio::time::sleep(Duration::from_millis(300)).await;

    let s = stats(&handle);
    assert_eq!(
        s.restarts, 0,
        "the subscriber took the publisher for restarted (it never did) and purged the endpoint; \
         a live batch that replay had already delivered arriving late does this: {s:#?}"
    );
    assert_eq!(s.decode_errors, 0, "{s:#?}");
    assert_eq!(
        (s.framing_errors, s.topic_mismatches, s.unknown_events),
        (0, 0, 0),
        "{s:#?}"
    );
    assert!(s.gaps >= 1, "the lost batch must show as a gap: {s:#?}");
    assert_eq!((s.unfilled_gaps, s.lost_batches), (0, 0), "{s:#?}");
    assert!(
        s.replayed_batches >= report.lost.len() as u64,
        "the lost batch must come from replay: {s:#?}"
    );
    assert_eq!(s.batches, report.batches, "{s:#?}");
    assert_eq!(
        (s.blocks_stored, s.blocks_removed, s.clears),
        (report.blocks_stored, report.blocks_removed, 1),
        "{s:#?}"
    );
    let (same, pairs) = prefixes(&index, &report);
    assert!(same, "(engine, index) prefix per conversation: {pairs:?}");

    let index_stats = index
        .endpoint_stats(E)
        .expect("endpoint known to the index");
    assert_eq!(index_stats.orphan_blocks, 0, "{index_stats:#?}");
    assert_eq!(index_stats.unknown_hashes, 0, "{index_stats:#?}");
    assert_eq!(
        (
            index_stats.malformed_blocks,
            index_stats.block_size_mismatches
        ),
        (0, 0),
        "{index_stats:#?}"
    );
    assert_eq!(
        index_stats.blocks_gpu, report.cached_total,
        "{index_stats:#?}"
    );
    assert_eq!(
        (index_stats.blocks_cpu, index_stats.offload_orphans),
        (report.cpu_total, 0),
        "{index_stats:#?}"
    );

    handle.stop();
    script.quit().await;
    Some(report)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_vllm_0_23_array_events_and_legacy_replay() {
    ingest_from_python("array", "kv@127.0.0.1:8000@vllm-0.23", &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_vllm_0_33_map_events_and_topic_replay() {
    ingest_from_python("map", "kv@127.0.0.1:8001@vllm-0.33", &[]).await;
}

/// With vLLM's OffloadingConnector (a CPU tier, stored on write, LRU), in both wire layouts:
/// raw-digest placeholders (0.20–0.23) and int ones (0.24+). The index must predict every
/// conversation's prefix across both tiers, including blocks the GPU evicted that requests
/// then loaded back from the CPU.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_offloading_connector_cpu_tier_in_both_layouts() {
    for (layout, topic) in [
        ("array", "kv@127.0.0.1:8003@vllm-0.23"),
        ("map", "kv@127.0.0.1:8004@vllm-0.33"),
    ] {
        let Some(report) = ingest_from_python(layout, topic, &["--cpu-blocks", "48"]).await else {
            return;
        };
        assert!(report.cpu_total > 0, "{report:?}");
        assert!(
            report.cpu_loaded > 0,
            "the scenario must load blocks back from the CPU: {report:?}"
        );
    }
}

/// Live copies that land after replay already delivered their batches (the PUB path is slower
/// than the replay socket's, as happens under load) must be dropped as duplicates, not taken
/// for an engine restart that purges the endpoint (a bug this test found and now guards).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_late_live_copies_of_replayed_batches_are_duplicates() {
    ingest_from_python(
        "map",
        "kv@127.0.0.1:8002@vllm-0.33",
        &["--live-lag", "2", "--step-interval", "0.05"],
    )
    .await;
}

/// libzmq answers ZMTP 3.1 PINGs even with heartbeats off on its side, so an idle engine keeps
/// its connection under a heartbeat timeout far shorter than its silence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_an_idle_libzmq_publisher_answers_heartbeats() {
    let Some(python) = kvroute_testkit::python("pyzmq and msgspec") else {
        return;
    };
    let topic = "kv@python@idle";
    let mut script = Script::spawn(&python, "map", topic, &[]);
    let addresses = script.next_json().await;
    let index = Arc::new(SharedIndex::new(
        KvIndex::new(IndexConfig::default()).unwrap(),
    ));
    let heartbeat = Heartbeat {
        interval: Duration::from_millis(100),
        timeout: Duration::from_millis(300),
    };
    let handle = spawn_connected(
        EndpointSource {
            endpoint: E,
            name: NAME.into(),
            publisher: addresses["pub"].as_str().expect("pub address").to_owned(),
            replay: None,
            topic: topic.into(),
        },
        index as Arc<dyn EventSink>,
        Timing {
            heartbeat,
            ..Timing::default()
        },
    );
    eventually("the subscription", || {
        (stats(&handle).connected, stats(&handle))
    })
    .await;
    // The property is about time passing: ten heartbeat timeouts of silence from the engine.
    tokio::time::sleep(heartbeat.timeout * 10).await;
    let s = stats(&handle);
    assert_eq!(
        (s.connected, s.connects, s.disconnects),
        (true, 1, 0),
        "{s:#?}"
    );
}
