//! The simulator against the engine: one request sequence, sent to a real engine with a small
//! cache and to `kvroute sim` configured alike, and what each published and reported.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};

use kvroute_testkit::{Killed, free_ports, wait_http};
use serde_json::{Value, json};

use super::engines::{Install, MODEL};

/// GPU blocks of both caches (`--num-gpu-blocks-override`): the fewest vLLM 0.32 accepts for a
/// 2048-token context of 32-token blocks (64 usable, its null block, and one more its start-up
/// check holds back).
pub const SMALL_CACHE_BLOCKS: usize = 66;

/// The sequence: eight ~11-block documents (more than the cache holds), then two of them
/// again (one evicted, one still cached), then one extended. One output token each, so every
/// cached block holds prompt tokens only and both sides cache the same blocks.
pub fn sequence() -> Vec<Value> {
    let document = |i: usize| {
        format!("Document {i} about the fleet. ")
            + &format!("The router keeps an index of block {i} and the engine stores it. ")
                .repeat(22)
    };
    let mut prompts: Vec<String> = (0..8).map(document).collect();
    prompts.push(document(0));
    prompts.push(document(7));
    prompts.push(
        document(7)
            + "And a question that extends the last document by a few blocks. "
                .repeat(6)
                .as_str(),
    );
    prompts
        .into_iter()
        .map(|prompt| json!({"model": MODEL, "prompt": prompt, "max_tokens": 1}))
        .collect()
}

/// The KV events published on `events` (a `tcp://` address), recorded by a pyzmq + msgspec
/// subscriber (`tests/python/kv_events_recorder.py`) until [`Recorder::finish`], then completed
/// from the publisher's `replay` socket (a subscription misses what is published before it
/// reaches the publisher).
pub struct Recorder {
    child: Child,
}

impl Recorder {
    /// Subscribes, with the engine venv's Python, and waits until it has connected.
    pub fn start(install: &Install, events: &str, replay: &str) -> Recorder {
        let script = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/python/kv_events_recorder.py"
        );
        let mut child = Command::new(&install.python)
            .args([script, events, replay])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut ready = String::new();
        BufReader::new(child.stdout.as_mut().unwrap())
            .read_line(&mut ready)
            .unwrap();
        assert_eq!(ready.trim(), "ready");
        Recorder { child }
    }

    /// Every event published, in order (the recorder drains until 100 ms pass without one, then
    /// replays from the first batch and keeps each batch once).
    pub fn finish(mut self) -> Vec<Value> {
        self.child.stdin.take().unwrap().flush().unwrap();
        let out = self.child.wait_with_output().unwrap();
        assert!(out.status.success());
        serde_json::from_slice(&out.stdout).unwrap()
    }
}

/// `kvroute sim` as the engine is configured: vLLM 0.32.0's wire format, 32-token blocks, the
/// same small cache, the same tokenizer (its chat template found beside it).
pub struct Sim {
    _process: Killed,
    /// HTTP port.
    pub http: u16,
    /// KV-event PUB address.
    pub events: String,
    /// KV-event replay address.
    pub replay: String,
}

impl Sim {
    /// Starts it and waits for `/health`.
    pub fn start(install: &Install) -> Sim {
        let ports = free_ports(3);
        let process = Killed(
            Command::new(env!("CARGO_BIN_EXE_kvroute"))
                .args(["sim", "--vllm-version", "0.32.0", "--block-size", "32"])
                .args(["--num-gpu-blocks", &SMALL_CACHE_BLOCKS.to_string()])
                .args(["--max-model-len", "2048", "--time-scale", "20"])
                .args(["--model", MODEL, "--topic", "kv-events"])
                .args([
                    "--tokenizer",
                    install.model.join("tokenizer.json").to_str().unwrap(),
                ])
                .args(["--port", &ports.to_string()])
                .args(["--events-port", &(ports + 1).to_string()])
                .args(["--replay-port", &(ports + 2).to_string()])
                .stdout(Stdio::null())
                .spawn()
                .unwrap(),
        );
        wait_http(&format!("http://127.0.0.1:{ports}"));
        Sim {
            _process: process,
            http: ports,
            events: format!("tcp://127.0.0.1:{}", ports + 1),
            replay: format!("tcp://127.0.0.1:{}", ports + 2),
        }
    }
}

/// Each event's kind and block count, for a readable first comparison.
pub fn outline(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .map(|e| {
            let blocks = e["block_hashes"].as_array().map_or(0, Vec::len);
            format!("{} {blocks}", e["type"].as_str().unwrap_or("?"))
        })
        .collect()
}

/// The names of the `vllm:` metrics a `/metrics` text exposes.
pub fn metric_names(text: &str) -> std::collections::BTreeSet<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split(' ').next())
        .filter(|name| name.starts_with("vllm:"))
        .map(str::to_owned)
        .collect()
}

/// The events without what is known to differ (docs/benchmarks-log.md, "The simulator against
/// vLLM 0.32"): the sequence numbers (batching differs) and `kv_cache_spec_kind`, which
/// kvroute's event model does not carry.
pub fn comparable(events: &[Value]) -> Vec<Value> {
    events
        .iter()
        .map(|e| {
            let mut e = e.clone();
            let fields = e.as_object_mut().unwrap();
            fields.remove("seq");
            fields.remove("kv_cache_spec_kind");
            e
        })
        .collect()
}
