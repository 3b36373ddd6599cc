//! Cache tiers below the GPU end to end, as separate processes on loopback: `kvroute sim`
//! engines with a CPU tier or a shared filesystem, `kvroute serve` in front. A prompt whose
//! prefix survives only in one engine's CPU memory, or only on the shared filesystem, is routed
//! to an engine that can load it, predicted as the engine then reports it, and its first token
//! comes sooner (by the engine's own clock) than a recompute of the same length's; a tier configured slower than recomputing gets no
//! credit, and `explain` says so.

mod serve_support;
mod sim_support;

use std::time::{Duration, Instant};

use kvroute_testkit::{eventually_blocking, http_get, http_post, sum_labelled};
use serde_json::{Value, json};
use serve_support::{Serve, Served};
use sim_support::SimProcess;

const MODEL: &str = "sim-llama-3.1-8b";
const BLOCK_SIZE: usize = 16;
/// GPU blocks per engine: the prefix (256 blocks) and one filler (440) do not fit together.
const GPU_BLOCKS: &str = "512";
/// Prompt tokens of the prefix the tests look for (256 blocks).
const PREFIX_TOKENS: usize = 4096;
/// Seconds per prefilled token: 10k tokens/s, so recomputing the prefix takes ~0.4 s while
/// loading it from the CPU takes ~20 ms and from the shared filesystem ~55 ms.
const PREFILL_PER_TOKEN_S: &str = "100e-6";

/// `kvroute sim` engines on consecutive ports, waited for.
struct Sims {
    sim: SimProcess,
    engines: u16,
}

impl Sims {
    /// `engines` engines with the test's GPU and prefill rate, plus `args`.
    fn start(engines: u16, args: &[&str]) -> Self {
        let count = engines.to_string();
        let common = [
            "--engines",
            &count,
            "--num-gpu-blocks",
            GPU_BLOCKS,
            "--prefill-per-token-s",
            PREFILL_PER_TOKEN_S,
        ];
        Self {
            sim: SimProcess::start(engines, &[&common, args].concat()),
            engines,
        }
    }

    /// The `endpoints:` items for these engines, named `{prefix}{i}`, with `offload` (YAML
    /// flow mapping, or empty).
    fn endpoints(&self, prefix: &str, offload: &str) -> String {
        (0..self.engines)
            .map(|i| {
                format!(
                    "  - {{name: {prefix}{i}, url: 'http://127.0.0.1:{}', events: 'tcp://127.0.0.1:{}', replay: 'tcp://127.0.0.1:{}'{offload}}}\n",
                    self.sim.http + i,
                    self.sim.events + i,
                    self.sim.replay + i
                )
            })
            .collect()
    }

    /// Engine `i`'s HTTP port.
    fn port(&self, i: u16) -> u16 {
        self.sim.http + i
    }
}

/// A running `kvroute serve` (started again on fresh ports if it loses a port race).
struct Router {
    served: Served,
}

impl Router {
    /// `kvroute serve` over `endpoints` with `extra` configuration, waited for.
    fn start(endpoints: &str, extra: &str) -> Self {
        Self {
            served: Serve::new(endpoints, extra).start(),
        }
    }

    /// The router's decision for `tokens`, without forwarding it.
    fn explain(&self, tokens: &[u32]) -> Value {
        let body = json!({"model": MODEL, "token_ids": tokens}).to_string();
        let (status, text) = http_post(addr(self.served.admin), "/kvroute/v1/explain", &body);
        assert_eq!(status, 200, "{text}");
        serde_json::from_str(&text).unwrap()
    }

    /// A one-token completion of `tokens` through the router: the answer and its time.
    fn complete(&self, tokens: &[u32]) -> (Value, Duration) {
        complete(self.served.listen, tokens)
    }

    /// The router's `/metrics`.
    fn metrics(&self) -> String {
        http_get(addr(self.served.admin), "/metrics")
    }
}

impl Drop for Router {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.served.dir);
    }
}

fn addr(port: u16) -> std::net::SocketAddr {
    ([127, 0, 0, 1], port).into()
}

/// A one-token completion of `tokens` on `port` (the router or an engine itself): the answer
/// and how long it took (with one output token, the time to first token).
fn complete(port: u16, tokens: &[u32]) -> (Value, Duration) {
    let body = json!({"model": MODEL, "prompt": tokens, "max_tokens": 1}).to_string();
    let started = Instant::now();
    let (status, text) = http_post(addr(port), "/v1/completions", &body);
    let took = started.elapsed();
    assert_eq!(status, 200, "{text}");
    (serde_json::from_str(&text).unwrap(), took)
}

/// `request`'s answer and its time to first token as the engine on one of `ports` measured it
/// (the growth of their `vllm:time_to_first_token_seconds` sums; they serve nothing else
/// meanwhile). The
/// engine's own clock leaves out connecting to it: a loopback connect whose SYN is dropped
/// waits a whole second to retry, longer than the difference these tests assert.
fn engine_ttft(ports: &[u16], request: impl FnOnce() -> (Value, Duration)) -> (Value, Duration) {
    let ttft_total = || -> f64 {
        ports
            .iter()
            .map(|&port| {
                let text = http_get(addr(port), "/metrics");
                sum_labelled(&text, "vllm:time_to_first_token_seconds_sum", "")
            })
            .sum()
    };
    let before = ttft_total();
    let (answer, _) = request();
    let mut after = before;
    eventually_blocking("the engine's time to first token recorded", || {
        after = ttft_total();
        (after > before, after)
    });
    (answer, Duration::from_secs_f64(after - before))
}

/// `len` token ids, distinct per `salt`.
fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|t| 1_000 + (t.wrapping_mul(7919) ^ salt.wrapping_mul(104_729)) % 30_000)
        .collect()
}

/// The prefix with a short new question after it.
fn with_question(prefix: &[u32], salt: u32) -> Vec<u32> {
    let mut tokens = prefix.to_vec();
    tokens.extend(prompt(40, salt));
    tokens
}

/// Sends `prefix` to engine `i` of `sims` directly (the router sees only its events), then
/// enough other prompts there that its GPU drops the prefix: what is left of it is below the
/// GPU.
fn push_below_the_gpu(sims: &Sims, i: u16, prefix: &[u32]) {
    complete(sims.port(i), prefix);
    for salt in 0..3 {
        complete(sims.port(i), &prompt(7_000, 900 + salt));
    }
}

/// `explain`'s entry for endpoint `name`.
fn entry<'a>(explain: &'a Value, name: &str) -> &'a Value {
    explain["endpoints"]
        .as_array()
        .and_then(|list| list.iter().find(|e| e["endpoint"] == name))
        .unwrap_or_else(|| panic!("{name} not in {explain:#}"))
}

/// The engine's reported `cached_tokens`.
fn reported_cached(answer: &Value) -> u64 {
    answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no cached_tokens in {answer}"))
}

/// Waits until the router's `explain` for `tokens` shows `name` holding every reportable block
/// of the prefix on `tier` and none on the GPU; returns that explanation.
fn wait_for_tier(router: &Router, tokens: &[u32], name: &str, tier: &str) -> Value {
    let blocks = (PREFIX_TOKENS / BLOCK_SIZE) as u64;
    let mut last = Value::Null;
    eventually_blocking(&format!("the prefix only on {name}'s {tier} tier"), || {
        last = router.explain(tokens);
        let index = &entry(&last, name)["matched_blocks"]["index"];
        (index[tier] == blocks && index["gpu"] == 0, index.clone())
    });
    last
}

#[test]
fn a_prefix_only_in_cpu_memory_is_routed_there_predicted_and_loaded_faster_than_recomputed() {
    prefix_only_in_cpu_memory("vllm");
}

#[test]
fn the_same_with_self_describing_offload_events() {
    prefix_only_in_cpu_memory("vllm-self-describing");
}

#[test]
fn the_same_with_lmcaches_stored_only_events() {
    prefix_only_in_cpu_memory("lmcache");
}

/// A prefix only in engine 0's CPU memory, its tier events published as connector `shape`
/// publishes them (`kvroute sim --offload-events`).
fn prefix_only_in_cpu_memory(shape: &str) {
    let sims = Sims::start(2, &["--num-cpu-blocks", "4096", "--offload-events", shape]);
    let router = Router::start(&sims.endpoints("e", ""), "");
    // A router whose CPU tier is configured slower than recomputing (500 tokens/s).
    let slow = Router::start(
        &sims.endpoints("e", ""),
        "scheduler: {tiers: {cpu_tokens_per_s: 500}}",
    );
    let prefix = prompt(PREFIX_TOKENS, 1);
    push_below_the_gpu(&sims, 0, &prefix);
    let question = with_question(&prefix, 2);
    let explain = wait_for_tier(&router, &question, "e0", "cpu");
    assert_eq!(explain["chosen"], "e0", "{explain:#}");
    let e0 = entry(&explain, "e0");
    let cpu = &e0["tiers"]["cpu"];
    assert_eq!(cpu["tokens"], PREFIX_TOKENS, "{cpu:#}");
    assert_eq!(cpu["credited"], true, "{cpu:#}");
    assert!(cpu["load_s"].as_f64().unwrap() < cpu["recompute_s"].as_f64().unwrap());
    assert_eq!(e0["tier_uncertain"], false);
    let predicted = e0["predicted_cached_tokens"].as_u64().unwrap();
    assert_eq!(predicted, PREFIX_TOKENS as u64);

    // The slow router sees the same blocks and gives them no credit: e1 recomputes.
    let explain_slow = wait_for_tier(&slow, &question, "e0", "cpu");
    let slow_cpu = &entry(&explain_slow, "e0")["tiers"]["cpu"];
    assert_eq!(slow_cpu["credited"], false, "{slow_cpu:#}");
    assert!(
        slow_cpu["no_credit_reason"]
            .as_str()
            .is_some_and(|r| r.contains("slower than recomputing")),
        "{slow_cpu:#}"
    );
    assert_eq!(explain_slow["chosen"], "e1", "{explain_slow:#}");

    // Through the router: to e0, which loads what was predicted, faster than a recompute of
    // a prompt as long on the other engine.
    let (answer, loaded) = engine_ttft(&[sims.port(0)], || router.complete(&question));
    assert_eq!(reported_cached(&answer), predicted, "{answer}");
    let other = with_question(&prompt(PREFIX_TOKENS, 3), 4);
    let (fresh, recomputed) = engine_ttft(&[sims.port(1)], || complete(sims.port(1), &other));
    assert_eq!(reported_cached(&fresh), 0);
    assert!(
        loaded * 2 < recomputed,
        "loaded from the CPU in {loaded:?}, recomputed in {recomputed:?}"
    );
    // The router's tier metrics: predicted and found on the CPU tier, at e0.
    let mut text = String::new();
    eventually_blocking("the CPU tier's tokens in the router's metrics", || {
        text = router.metrics();
        let predicted = sum_labelled(
            &text,
            "kvroute_tier_predicted_cached_tokens",
            "tier=\"cpu\"",
        );
        let found = sum_labelled(&text, "kvroute_tier_found_cached_tokens", "tier=\"cpu\"");
        (
            predicted == PREFIX_TOKENS as f64 && found == predicted,
            (predicted, found),
        )
    });
    // The engine's own per-tier counter says the same, once scraped.
    eventually_blocking("the engine's CPU loads scraped", || {
        let loaded = sum_labelled(
            &router.metrics(),
            "kvroute_tier_engine_loaded_tokens",
            "tier=\"cpu\"",
        );
        (loaded >= PREFIX_TOKENS as f64, loaded)
    });
    // And how long its loads took (vLLM's `vllm:kv_offload_total_time_total`): the CPU rate
    // the cost model uses at e0 then moves from the configured 150,000 tokens/s to the
    // engine's own, 16-token blocks at 80 µs each (200,000), with no request having run alone
    // there (e1 keeps the configured rate). One window is one sample, weighed as much as the
    // configured rate: halfway, in seconds per token.
    let e0_cpu = "endpoint=\"e0\",tier=\"cpu\"";
    let one_sample = 1.0 / (0.5 / 200_000.0 + 0.5 / 150_000.0);
    eventually_blocking("e0's CPU rate learned from its load counters", || {
        let rate = sum_labelled(
            &router.metrics(),
            "kvroute_tier_load_tokens_per_second",
            e0_cpu,
        );
        ((rate - one_sample).abs() < 1.0, rate)
    });
    let e1_cpu = "endpoint=\"e1\",tier=\"cpu\"";
    let configured = sum_labelled(&text, "kvroute_tier_load_tokens_per_second", e1_cpu);
    assert_eq!(configured, 150_000.0, "{text}");
}

#[test]
fn a_prefix_only_on_the_shared_filesystem_is_routed_to_an_engine_that_mounts_it() {
    // Two engines mount one shared filesystem; a third, its own process, mounts nothing.
    let shared = Sims::start(2, &["--shared-fs-blocks", "8192"]);
    let alone = Sims::start(1, &[]);
    let endpoints =
        shared.endpoints("fs", ", offload: {shared_mount: lustre}") + &alone.endpoints("local", "");
    let router = Router::start(&endpoints, "");
    let prefix = prompt(PREFIX_TOKENS, 5);
    // fs0 computes it (writing it to the filesystem) and then drops it from its GPU.
    push_below_the_gpu(&shared, 0, &prefix);
    let question = with_question(&prefix, 6);
    let explain = wait_for_tier(&router, &question, "fs0", "shared");
    for name in ["fs0", "fs1"] {
        let e = entry(&explain, name);
        assert_eq!(e["tiers"]["shared"]["tokens"], PREFIX_TOKENS, "{e:#}");
        assert_eq!(e["tiers"]["shared"]["credited"], true, "{e:#}");
        assert_eq!(e["predicted_cached_tokens"], PREFIX_TOKENS, "{e:#}");
    }
    assert_eq!(entry(&explain, "local0")["predicted_cached_tokens"], 0);
    let chosen = explain["chosen"].as_str().unwrap().to_owned();
    assert!(chosen.starts_with("fs"), "{explain:#}");
    let (answer, loaded) = engine_ttft(&[shared.port(0), shared.port(1)], || {
        router.complete(&question)
    });
    assert_eq!(reported_cached(&answer), PREFIX_TOKENS as u64, "{answer}");
    let other = with_question(&prompt(PREFIX_TOKENS, 7), 8);
    let (fresh, recomputed) = engine_ttft(&[alone.port(0)], || complete(alone.port(0), &other));
    assert_eq!(reported_cached(&fresh), 0);
    assert!(
        loaded * 2 < recomputed,
        "loaded from the shared filesystem in {loaded:?}, recomputed in {recomputed:?}"
    );
    let text = router.metrics();
    assert!(
        sum_labelled(&text, "kvroute_tier_found_cached_tokens", "tier=\"shared\"")
            >= PREFIX_TOKENS as f64,
        "{text}"
    );
}
