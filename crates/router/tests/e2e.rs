//! The router in front of simulated vLLM engines, over real HTTP and ZMQ on loopback.

// Measures real processes and sockets: wall-clock time, not the router's (tokio) clock.
#![allow(clippy::disallowed_methods)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kvroute_core::schedule::{ProfileName, Saturation};
use kvroute_router::config::{RouterConfig, TokenizerConfig, TokenizerKind};
use kvroute_router::server::{RunningRouter, start as start_router};
use kvroute_sim::engine::EngineConfig;
use kvroute_sim::server::{SimConfig, SimFleet, start as start_sim};
use kvroute_testkit::{eventually, free_ports};
use serde_json::{Value, json};

mod common;

use common::config_builder::{ConfigBuilder, endpoint};
use common::fleet_view::held_requests;
use common::{eventually_async, fault, router_from_config, settle};

const MODEL: &str = "sim-llama-3.1-8b";

async fn engine(gpu_blocks: usize) -> SimFleet {
    engine_with(gpu_blocks, 256).await
}

async fn engine_with(gpu_blocks: usize, max_num_seqs: usize) -> SimFleet {
    engine_of(EngineConfig {
        num_gpu_blocks: gpu_blocks,
        max_model_len: 16_384,
        max_num_seqs,
        ..EngineConfig::default()
    })
    .await
}

/// A simulated engine of `engine`, publishing its KV events with replay, ten times faster
/// than real time.
async fn engine_of(engine: EngineConfig) -> SimFleet {
    start_sim(SimConfig {
        port: 0,
        events_port: 0,
        replay_port: Some(0),
        engine,
        time_scale: 10.0,
        ..SimConfig::default()
    })
    .await
    .unwrap()
}

/// A router over `engines` (named `e0`, `e1`, ...), with quick health checks and scrapes.
async fn router_for(engines: &[&SimFleet]) -> RunningRouter {
    router_tuned(engines, |_| {}).await
}

/// [`router_for`], with `tune` applied to its configuration.
async fn router_tuned(
    engines: &[&SimFleet],
    tune: impl FnOnce(&mut RouterConfig),
) -> RunningRouter {
    let config = ConfigBuilder::new(MODEL)
        .health(100, 500)
        .scrape(100)
        .engines(engines)
        .with(tune)
        .build();
    // The subscribers connect before traffic starts.
    router_from_config(config).await
}

/// Saturation at `queue` waiting requests (KV usage at its default).
fn saturated_at_queue(queue: f64) -> Saturation {
    Saturation {
        queue,
        ..Saturation::default()
    }
}

struct Answer {
    status: u16,
    endpoint: String,
    body: Value,
}

async fn chat(
    client: &reqwest::Client,
    router: &RunningRouter,
    messages: &[Value],
    max_tokens: u32,
) -> Answer {
    let resp = client
        .post(format!("http://{}/v1/chat/completions", router.addr))
        .json(&json!({"model": MODEL, "messages": messages, "max_tokens": max_tokens}))
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let endpoint = resp
        .headers()
        .get("x-kvroute-endpoint")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    Answer {
        status,
        endpoint,
        body: resp.json().await.unwrap_or(Value::Null),
    }
}

fn words(n: usize, seed: usize) -> String {
    (0..n)
        .map(|i| format!("w{}x{}", (i * 7919 + seed * 104_729) % 100_000, seed))
        .collect::<Vec<_>>()
        .join(" ")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conversations_stick_to_the_endpoint_holding_their_history() {
    let (a, b, c) = (engine(4096).await, engine(4096).await, engine(4096).await);
    let router = router_for(&[&a, &b, &c]).await;
    let client = reqwest::Client::new();
    let system = json!({"role": "system", "content": words(300, 0)});
    let mut conversations: Vec<(Vec<Value>, String)> = Vec::new();
    for user in 0..6 {
        let messages = vec![
            system.clone(),
            json!({"role": "user", "content": words(200, user + 1)}),
        ];
        let answer = chat(&client, &router, &messages, 20).await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        let mut history = messages;
        history.push(json!({"role": "assistant", "content": answer.body["choices"][0]["message"]["content"]}));
        conversations.push((history, answer.endpoint));
        settle(&router, &[&a, &b, &c]).await;
    }
    let mut cached_total = 0u64;
    for turn in 0..3 {
        for (i, (history, home)) in conversations.iter_mut().enumerate() {
            history.push(json!({"role": "user", "content": words(50, 100 + turn * 10 + i)}));
            let answer = chat(&client, &router, history, 20).await;
            assert_eq!(answer.status, 200);
            assert_eq!(
                &answer.endpoint, home,
                "turn {turn} of conversation {i} must go home"
            );
            let cached = answer.body["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap();
            let prompt = answer.body["usage"]["prompt_tokens"].as_u64().unwrap();
            assert!(
                cached * 10 >= prompt * 8,
                "most of the history is cached: {cached}/{prompt}"
            );
            cached_total += cached;
            history.push(json!({"role": "assistant", "content": answer.body["choices"][0]["message"]["content"]}));
            settle(&router, &[&a, &b, &c]).await;
        }
    }
    assert!(cached_total > 0);
    // On a quiet fleet the router's predictions equal what the engines report.
    let metrics = common::router_metrics(&client, &router).await;
    let count = |outcome: &str| -> u64 {
        metrics
            .lines()
            .filter(|l| {
                l.starts_with("kvroute_prediction_outcomes_total")
                    && l.contains(&format!("outcome=\"{outcome}\""))
            })
            .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
            .sum()
    };
    assert_eq!(count("over") + count("under"), 0, "{metrics}");
    assert_eq!(count("exact"), 24);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_are_openai_shaped() {
    let a = engine(512).await;
    let router = router_tuned(&[&a], |c| c.limits.max_body_bytes = 2000).await;
    let client = reqwest::Client::new();
    let url = format!("http://{}/v1/completions", router.addr);
    let cases = [
        (client.post(&url).body("{nope"), 400),
        (
            client
                .post(&url)
                .json(&json!({"model": "gpt-9", "prompt": "x"})),
            404,
        ),
        (
            client
                .post(&url)
                .json(&json!({"model": MODEL, "prompt": "x".repeat(5000)})),
            413,
        ),
        (client.post(&url).json(&json!({"model": MODEL})), 400),
    ];
    for (request, status) in cases {
        let resp = request.send().await.unwrap();
        assert_eq!(resp.status().as_u16(), status);
        let body: Value = resp.json().await.unwrap();
        assert_eq!(body["error"]["code"], status, "{body}");
        assert!(body["error"]["message"].as_str().unwrap().len() > 5);
    }
}

/// vLLM serves a request that names no model with its own: a router serving one model routes
/// it as that model's (its prefix cache found again on the next turn); one serving several
/// cannot tell which, and says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_naming_no_model_is_served_by_the_only_model() {
    let a = engine(512).await;
    let router = router_for(&[&a]).await;
    let client = reqwest::Client::new();
    let url = format!("http://{}/v1/completions", router.addr);
    let prompt = words(300, 41);
    for turn in 0..2 {
        let resp = client
            .post(&url)
            .json(&json!({"prompt": prompt, "max_tokens": 2}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 200, "turn {turn}");
        let body: Value = resp.json().await.unwrap();
        assert_eq!(body["model"], MODEL);
        let cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        assert_eq!(cached > 0, turn == 1, "turn {turn}: {body}");
    }
    let two_models = router_tuned(&[&a], |c| {
        c.models.push(c.models[0].clone());
        c.models[1].name = "another-model".into();
    })
    .await;
    let resp = client
        .post(format!("http://{}/v1/completions", two_models.addr))
        .json(&json!({"prompt": prompt, "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 400);
    let body: Value = resp.json().await.unwrap();
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("model is required"),
        "{body}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_shows_the_breakdown_without_forwarding() {
    let (a, b) = (engine(1024).await, engine(1024).await);
    let router = router_for(&[&a, &b]).await;
    let client = reqwest::Client::new();
    let prompt = words(400, 9);
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 2});
    let first = client
        .post(format!("http://{}/v1/completions", router.addr))
        .json(&body)
        .send()
        .await
        .unwrap();
    let home = common::served_by(&first);
    settle(&router, &[&a, &b]).await;
    let explained: Value = common::explain(&client, &router, &body).await;
    assert_eq!(explained["chosen"], home.as_str());
    assert_eq!(explained["reason"], "cache");
    let endpoints = explained["endpoints"].as_array().unwrap();
    assert_eq!(endpoints.len(), 2);
    let mine = endpoints
        .iter()
        .find(|e| e["endpoint"] == home.as_str())
        .unwrap();
    assert!(
        mine["matched_blocks"]["index"]["gpu"].as_u64().unwrap() > 10,
        "{mine}"
    );
    // The cost, term by term in seconds: the home engine prefills less than the other.
    let other = endpoints
        .iter()
        .find(|e| e["endpoint"] != home.as_str())
        .unwrap();
    let prefill = |e: &Value| e["cost"]["prefill_s"].as_f64().unwrap();
    assert!(prefill(mine) < prefill(other), "{mine} vs {other}");
    for term in ["queue_s", "tier_load_s", "decode_interference_s", "total_s"] {
        assert!(mine["cost"][term].is_number(), "{term} in {mine}");
    }
    // Explaining forwards nothing: the engines saw exactly one request.
    let metrics = client
        .get(format!("{}/metrics", a.endpoints[0].url))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
        + &client
            .get(format!("{}/metrics", b.endpoints[0].url))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
    let total: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("vllm:time_to_first_token_seconds_count"))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum();
    assert_eq!(total, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_engine_is_ejected_and_its_blocks_dropped() {
    let a = engine(1024).await;
    let b = engine(1024).await;
    let router = router_for(&[&a, &b]).await;
    let client = reqwest::Client::new();
    for i in 0..6 {
        let answer = chat(
            &client,
            &router,
            &[json!({"role": "user", "content": words(300, i)})],
            4,
        )
        .await;
        assert_eq!(answer.status, 200);
    }
    settle(&router, &[&a, &b]).await;
    let held = |r: &RunningRouter, i: u32| {
        r.router
            .index_stats(kvroute_core::index::EndpointId(i))
            .map_or(0, |s| s.blocks_gpu)
    };
    assert!(held(&router, 0) + held(&router, 1) > 0);
    drop(b); // kill engine e1
    eventually("e1 ejected", || {
        (
            !router.router.healthy(kvroute_core::index::EndpointId(1)),
            (),
        )
    })
    .await;
    assert_eq!(held(&router, 1), 0, "the dead engine's blocks are dropped");
    for i in 0..4 {
        let answer = chat(
            &client,
            &router,
            &[json!({"role": "user", "content": words(100, 50 + i)})],
            2,
        )
        .await;
        assert_eq!(answer.status, 200);
        assert_eq!(answer.endpoint, "e0");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_connection_is_retried_once_on_the_next_endpoint() {
    let live = engine(512).await;
    // Outside the ephemeral range: no server on port 0 can take it during the test.
    let dead_port = free_ports(1);
    let config = ConfigBuilder::new(MODEL)
        .with(|c| {
            c.health.interval_ms = 60_000;
            c.scheduler.policy = ProfileName::RoundRobin;
        })
        .url("dead", &format!("http://127.0.0.1:{dead_port}"))
        .url("live", &live.endpoints[0].url)
        .build();
    let router = start_router(config).await.unwrap();
    let client = reqwest::Client::new();
    for _ in 0..2 {
        let answer = chat(
            &client,
            &router,
            &[json!({"role": "user", "content": "hello"})],
            2,
        )
        .await;
        assert_eq!(answer.status, 200, "{}", answer.body);
        assert_eq!(answer.endpoint, "live");
    }
    let metrics = common::router_metrics(&client, &router).await;
    assert!(
        metrics.contains("kvroute_retries_total{endpoint=\"dead\",reason=\"connect\"} 1"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_healthy_endpoint_is_a_503_with_retry_after_and_a_slow_engine_a_504() {
    let slow = engine(512).await;
    let client = reqwest::Client::new();
    fault(&client, &slow, 0, json!({"slow_factor": 1000.0})).await;
    let router = router_tuned(&[&slow], |c| c.limits.response_timeout_s = 0.5).await;
    let started = Instant::now();
    let answer = chat(
        &client,
        &router,
        &[json!({"role": "user", "content": words(50, 1)})],
        2,
    )
    .await;
    assert_eq!(answer.status, 504, "{}", answer.body);
    assert!(started.elapsed() < Duration::from_secs(5));
    fault(&client, &slow, 0, json!({"healthy": false})).await;
    eventually("e0 ejected", || {
        (
            !router.router.healthy(kvroute_core::index::EndpointId(0)),
            (),
        )
    })
    .await;
    let resp = client
        .post(format!("http://{}/v1/completions", router.addr))
        .json(&json!({"model": MODEL, "prompt": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 503);
    assert_eq!(resp.headers()["retry-after"], "1");
    assert_eq!(
        client
            .get(format!("http://{}/health", router.addr))
            .send()
            .await
            .unwrap()
            .status()
            .as_u16(),
        503
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_pass_through_and_a_client_disconnect_frees_everything() {
    let a = engine(1024).await;
    let router = router_for(&[&a]).await;
    let client = reqwest::Client::new();
    let started = Instant::now();
    // A raw connection, so that going away really closes the socket.
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut socket = tokio::net::TcpStream::connect(router.addr).await.unwrap();
    let payload =
        json!({"model": MODEL, "prompt": words(100, 3), "max_tokens": 2000, "stream": true})
            .to_string();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: kvroute\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        payload.len()
    );
    socket.write_all(head.as_bytes()).await.unwrap();
    socket.write_all(payload.as_bytes()).await.unwrap();
    let mut received = Vec::new();
    while !String::from_utf8_lossy(&received).contains("data: ") {
        let mut buf = [0u8; 4096];
        let n = socket.read(&mut buf).await.unwrap();
        assert!(n > 0, "connection closed early");
        received.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&received).to_lowercase();
    assert!(text.contains("content-type: text/event-stream"), "{text}");
    assert!(text.contains("x-kvroute-endpoint: e0"), "{text}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "the first token arrives long before the 2,000th"
    );
    assert_eq!(
        router
            .router
            .load(kvroute_core::index::EndpointId(0))
            .inflight,
        1
    );
    drop(socket); // the client goes away mid-stream
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let engine_metrics = client
            .get(format!("{}/metrics", a.endpoints[0].url))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let running = engine_metrics
            .lines()
            .find(|l| l.starts_with("vllm:num_requests_running"))
            .unwrap()
            .ends_with(" 0");
        let inflight = router
            .router
            .load(kvroute_core::index::EndpointId(0))
            .inflight;
        if running && inflight == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "upstream not cancelled: running={running} inflight={inflight}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        router
            .router
            .load(kvroute_core::index::EndpointId(0))
            .inflight_prefills,
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooded_hot_prefix_spills_to_other_endpoints() {
    // Engines that run 8 sequences at a time: a flood queues, as a busy GPU's would.
    let (a, b, c) = (
        engine_with(4096, 8).await,
        engine_with(4096, 8).await,
        engine_with(4096, 8).await,
    );
    let router = router_for(&[&a, &b, &c]).await;
    let client = reqwest::Client::new();
    let hot = words(1500, 77);
    // Warm one endpoint with the hot prefix.
    let warm = chat(
        &client,
        &router,
        &[json!({"role": "user", "content": format!("{hot} warm")})],
        2,
    )
    .await;
    settle(&router, &[&a, &b, &c]).await;
    // The premise: three healthy endpoints to spill to.
    let health = || -> Vec<bool> {
        (0..3)
            .map(|i| router.router.healthy(kvroute_core::index::EndpointId(i)))
            .collect()
    };
    kvroute_testkit::eventually("every endpoint is healthy", || {
        let now = health();
        (now.iter().all(|&h| h), now)
    })
    .await;
    // Then a flood: 48 concurrent requests sharing it, each with 200 output tokens.
    let mut tasks = Vec::new();
    for i in 0..48 {
        let client = client.clone();
        let url = format!("http://{}/v1/chat/completions", router.addr);
        let content = format!("{hot} question {i}");
        tasks.push(tokio::spawn(async move {
            let resp = client.post(url).json(&json!({"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 200})).send().await.unwrap();
            common::served_by(&resp)
        }));
    }
    let mut counts = std::collections::HashMap::new();
    for t in tasks {
        *counts.entry(t.await.unwrap()).or_insert(0) += 1;
    }
    let home = counts.get(&warm.endpoint).copied().unwrap_or(0);
    // What a spill is priced at: a copy's prefill at the observed rates (one slow sample under
    // a loaded machine makes every copy look dear).
    let rates: Vec<Option<f64>> = router
        .router
        .fleet()
        .endpoints()
        .iter()
        .map(|e| e.observed_prefill_rate())
        .collect();
    assert!(
        counts.len() >= 2,
        "the flood must spill: {counts:?} (healthy after it: {:?}; observed prefill rates, \
         tokens/s: {rates:?})",
        health()
    );
    assert!(home < 48, "not everything on the warm endpoint: {counts:?}");
}

/// The router learns an engine's CPU tier capacity from its events (it prices what a queue
/// pushes out of that tier with it), and `/metrics` shows it: unknown (0) until the tier first
/// evicts a block, then the tier's size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engines_cpu_tier_capacity_is_learned_from_its_events_and_shown() {
    const CPU_BLOCKS: usize = 40;
    let a = engine_of(EngineConfig {
        num_gpu_blocks: 512,
        num_cpu_blocks: CPU_BLOCKS,
        max_model_len: 16_384,
        ..EngineConfig::default()
    })
    .await;
    let router = router_for(&[&a]).await;
    let client = reqwest::Client::new();
    let capacity = || {
        kvroute_testkit::sample(
            &kvroute_testkit::http_get(router.admin_addr, "/metrics"),
            "kvroute_index_cpu_capacity_blocks{endpoint=\"e0\"}",
        )
    };
    let cpu_held = || {
        router
            .router
            .index_stats(kvroute_core::index::EndpointId(0))
            .map_or(0, |s| s.blocks_cpu)
    };
    // Prompts written through to the CPU tier until it has had to evict.
    let mut prompts = 0;
    while cpu_held() < CPU_BLOCKS as u64 || prompts < 6 {
        assert!(prompts < 40, "the CPU tier never filled: {}", cpu_held());
        let answer = chat(
            &client,
            &router,
            &[json!({"role": "user", "content": words(60, 500 + prompts)})],
            2,
        )
        .await;
        assert_eq!(answer.status, 200);
        settle(&router, &[&a]).await;
        if prompts == 0 {
            assert_eq!(capacity(), Some(0.0), "unknown before the first eviction");
        }
        prompts += 1;
    }
    eventually("the CPU tier's size in /metrics", || {
        let shown = capacity();
        (shown == Some(CPU_BLOCKS as f64), (shown, cpu_held()))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_engine_is_relearned() {
    let a = engine(1024).await;
    let router = router_for(&[&a]).await;
    let client = reqwest::Client::new();
    let content = words(400, 5);
    chat(
        &client,
        &router,
        &[json!({"role": "user", "content": content.clone()})],
        2,
    )
    .await;
    settle(&router, &[&a]).await;
    let held = || {
        router
            .router
            .index_stats(kvroute_core::index::EndpointId(0))
            .map_or(0, |s| s.blocks_gpu)
    };
    let before = held();
    assert!(before > 10);
    client
        .post(format!("{}/sim/restart", a.endpoints[0].url))
        .send()
        .await
        .unwrap();
    // Forgotten at once (the engine's counters went backwards), before any new event or
    // request: nothing is predicted on an engine that restarted empty.
    eventually("restart noticed without traffic", || (held() == 0, ())).await;
    let answer = chat(
        &client,
        &router,
        &[json!({"role": "user", "content": words(100, 6)})],
        2,
    )
    .await;
    assert_eq!(
        answer.body["usage"]["prompt_tokens_details"]["cached_tokens"],
        0
    );
    settle(&router, &[&a]).await;
    let after = held();
    assert!(
        after > 0 && after < before,
        "old blocks purged, new ones learned: {before} -> {after}"
    );
    let again = chat(
        &client,
        &router,
        &[json!({"role": "user", "content": content})],
        2,
    )
    .await;
    assert_eq!(
        again.body["usage"]["prompt_tokens_details"]["cached_tokens"], 0,
        "the old prefix is really gone"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_connections_are_reused_for_streamed_and_unstreamed_answers() {
    let a = engine(512).await;
    let router = router_for(&[&a]).await;
    let client = reqwest::Client::new();
    for i in 0..10 {
        let stream = i % 2 == 0;
        let resp = client
            .post(format!("http://{}/v1/completions", router.addr))
            .json(
                &json!({"model": MODEL, "prompt": words(20, i), "max_tokens": 3, "stream": stream}),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        resp.bytes().await.unwrap();
    }
    let opened = router.router.upstream().connections_opened();
    assert!(
        opened <= 2,
        "10 sequential requests opened {opened} engine connections"
    );
}

/// Waits until the router's `kvroute_prediction_outcomes_total`, summed, is `expected`: the
/// requests whose engine reported `cached_tokens` to it.
async fn predictions_checked(client: &reqwest::Client, router: &RunningRouter, expected: u64) {
    eventually_async("the answers' usage read", || async {
        let checked: u64 = common::router_metrics(client, router)
            .await
            .lines()
            .filter(|l| l.starts_with("kvroute_prediction_outcomes_total"))
            .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
            .sum();
        (checked == expected, checked)
    })
    .await;
}

/// A streamed completion of `prompt` (with `stream_options` when `usage`), read to its end.
async fn streamed(
    client: &reqwest::Client,
    router: &RunningRouter,
    prompt: String,
    usage: bool,
) -> String {
    let mut body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": true});
    if usage {
        body["stream_options"] = json!({"include_usage": true});
    }
    let resp = common::post_api(client, router, "/v1/completions", &body).await;
    assert_eq!(resp.status(), 200);
    resp.text().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_stream_reports_its_usage_to_the_router_and_only_an_asking_client_sees_it() {
    let a = engine(512).await;
    let client = reqwest::Client::new();
    let router = router_for(&[&a]).await;
    // A client that does not ask for usage gets none (the router asked on its own account)...
    let text = streamed(&client, &router, words(40, 1), false).await;
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    assert!(!text.contains("\"usage\""), "{text}");
    assert_eq!(
        text.matches("\"text\"").count(),
        4,
        "every token passed on: {text}"
    );
    // ... one that asks gets it ...
    let text = streamed(&client, &router, words(40, 2), true).await;
    assert!(text.contains("\"usage\""), "{text}");
    // ... and the router checked its prediction against both streams' usage, and counted
    // what each generated.
    predictions_checked(&client, &router, 2).await;
    let metrics = common::router_metrics(&client, &router).await;
    assert!(
        metrics.contains("kvroute_generated_tokens_total{endpoint=\"e0\"} 8"),
        "{metrics}"
    );
    // Turned off, the request goes as the client sent it: the stream reports nothing.
    let off = router_tuned(&[&a], |c| c.forwarding.stream_usage = false).await;
    let text = streamed(&client, &off, words(40, 3), false).await;
    assert!(!text.contains("\"usage\""), "{text}");
    let text = streamed(&client, &off, words(40, 4), true).await;
    assert!(text.contains("\"usage\""), "{text}");
    predictions_checked(&client, &off, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_event_stream_is_not_trusted_and_says_so() {
    let a = engine(512).await;
    // Events configured on a port where nothing publishes: requests go there, no event comes.
    let dead = free_ports(1);
    let mut quiet = endpoint(Some("quiet".into()), &a.endpoints[0].url);
    quiet.events = Some(format!("tcp://127.0.0.1:{dead}"));
    let config = ConfigBuilder::new(MODEL)
        .with(|c| c.cache.silent_after_s = 0.3)
        .endpoint(quiet)
        .build();
    let router = start_router(config).await.unwrap();
    let client = reqwest::Client::new();
    let body = json!({"model": MODEL, "prompt": words(100, 1), "max_tokens": 1});
    client
        .post(format!("http://{}/v1/completions", router.addr))
        .json(&body)
        .send()
        .await
        .unwrap();
    // Silent past `silent_after_s`: the explanation says so once that much time has passed.
    let explained = eventually_async("the silent stream is distrusted", || async {
        let explained: Value = common::explain(&client, &router, &body).await;
        (
            explained["endpoints"][0]["index_distrust"] == "silent",
            explained,
        )
    })
    .await;
    let endpoint = &explained["endpoints"][0];
    assert_eq!(endpoint["index_trusted"], false, "{endpoint}");
    assert_eq!(endpoint["index_distrust"], "silent");
    let metrics = common::router_metrics(&client, &router).await;
    assert!(
        metrics.contains("kvroute_endpoint_index_trusted{endpoint=\"quiet\"} 0"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicted_history_no_longer_holds_its_conversation() {
    // Small caches: 64 blocks of 16 tokens per engine.
    let (a, b) = (engine(64).await, engine(64).await);
    let router = router_for(&[&a, &b]).await;
    let client = reqwest::Client::new();
    let history = vec![json!({"role": "user", "content": words(300, 11)})];
    let first = chat(&client, &router, &history, 2).await;
    settle(&router, &[&a, &b]).await;
    let home = if first.endpoint == "e0" { &a } else { &b };
    // Other traffic on the home engine (straight to it) evicts the conversation's blocks.
    for i in 0..4 {
        let prompt: Vec<u32> = (0..900).map(|t| 50_000 + t + 1000 * i).collect();
        client
            .post(format!("{}/v1/completions", home.endpoints[0].url))
            .json(&json!({"model": MODEL, "prompt": prompt, "max_tokens": 1}))
            .send()
            .await
            .unwrap();
    }
    let mut next = history.clone();
    next.push(
        json!({"role": "assistant", "content": first.body["choices"][0]["message"]["content"]}),
    );
    next.push(json!({"role": "user", "content": "and then?"}));
    // Once the engine's evictions arrived and the prediction's grace passed, the evicted
    // history counts for nothing at its old home.
    let explained = eventually_async("the evicted history counts for nothing", || async {
        let explained: Value =
            common::explain(&client, &router, &json!({"model": MODEL, "messages": next})).await;
        let at_home = explained["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["endpoint"] == first.endpoint.as_str())
            .unwrap()
            .clone();
        (at_home["predicted_cached_tokens"] == 0, explained)
    })
    .await;
    assert_ne!(explained["reason"], "cache", "{explained}");
}

/// Remote tokenization asks an engine that serves the request's model: one of another model,
/// healthy and first in the list, is never asked (its `/tokenize` does not know the model).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_tokenization_asks_an_engine_of_the_requests_model() {
    let asked = Arc::new(AtomicUsize::new(0));
    let counter = asked.clone();
    let tokenize = move || {
        counter.fetch_add(1, Ordering::SeqCst);
        async {
            (
                axum::http::StatusCode::NOT_FOUND,
                "The model does not exist.",
            )
        }
    };
    let routes = axum::Router::new().route("/tokenize", axum::routing::post(tokenize));
    let other = common::fake_engine(routes).await;
    let b = engine(1024).await;
    let config = ConfigBuilder::new(MODEL)
        .tokenizer(TokenizerConfig::Kind(TokenizerKind::Remote))
        .model("another-model")
        .url("other", &other)
        .unnamed_engine(&b)
        .with(|c| c.endpoints[0].models = vec!["another-model".into()])
        .build();
    let router = start_router(config).await.unwrap();
    let client = reqwest::Client::new();
    let body = json!({"model": MODEL, "prompt": words(200, 5), "max_tokens": 2});
    let explained = common::explain(&client, &router, &body).await;
    let answer: Value = common::post_api(&client, &router, "/v1/completions", &body)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(
        explained["prompt_tokens"], answer["usage"]["prompt_tokens"],
        "tokenized by the model's engine: {explained}"
    );
    assert_eq!(
        asked.load(Ordering::SeqCst),
        0,
        "the other model's engine was asked"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_tokenization_with_the_engines_tokenize_predicts_exactly() {
    let (a, b) = (engine(1024).await, engine(1024).await);
    let config = ConfigBuilder::new(MODEL)
        .tokenizer(TokenizerConfig::Kind(TokenizerKind::Remote))
        .unnamed_engine(&a)
        .unnamed_engine(&b)
        .build();
    let router = start_router(config).await.unwrap();
    eventually("subscribers connected", || {
        (router.subscribers_connected(), ())
    })
    .await;
    let client = reqwest::Client::new();
    let mut history = vec![json!({"role": "user", "content": words(300, 21)})];
    let first = chat(&client, &router, &history, 8).await;
    assert_eq!(first.status, 200);
    settle(&router, &[&a, &b]).await;
    history.push(
        json!({"role": "assistant", "content": first.body["choices"][0]["message"]["content"]}),
    );
    history.push(json!({"role": "user", "content": "more please"}));
    let explained: Value = common::explain(
        &client,
        &router,
        &json!({"model": MODEL, "messages": history}),
    )
    .await;
    let second = chat(&client, &router, &history, 2).await;
    assert_eq!(second.endpoint, first.endpoint, "turn 2 goes home");
    let home = explained["endpoints"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["endpoint"] == first.endpoint.as_str())
        .unwrap();
    assert_eq!(
        explained["prompt_tokens"], second.body["usage"]["prompt_tokens"],
        "the engine's own tokens"
    );
    assert_eq!(
        home["predicted_cached_tokens"],
        second.body["usage"]["prompt_tokens_details"]["cached_tokens"]
    );
    assert!(home["predicted_cached_tokens"].as_u64().unwrap() > 300);
}

async fn complete(
    client: &reqwest::Client,
    router: &RunningRouter,
    prompt: String,
) -> (u16, Option<String>) {
    let resp = client
        .post(format!("http://{}/v1/completions", router.addr))
        .json(&json!({"model": MODEL, "prompt": prompt, "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    let retry_after = resp
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_owned());
    (resp.status().as_u16(), retry_after)
}

/// Flow control: while the only engine is saturated, a request waits in the router (not in the
/// engine's queue) and is served once the engine has room; past the queue's bound it is
/// answered 429, past its wait limit 503, both with `Retry-After`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_saturated_fleet_holds_requests_then_serves_or_sheds_them() {
    let a = engine(4096).await;
    let client = reqwest::Client::new();
    // Prefill 20 times slower: a long prompt keeps the engine busy for a while.
    fault(&client, &a, 0, json!({"slow_factor": 200.0})).await;
    let flow = |c: &mut RouterConfig| {
        c.scheduler.saturation = Some(saturated_at_queue(1.0));
        c.flow.max_requests = 1;
        c.flow.max_wait_s = 30.0;
    };
    let router = std::sync::Arc::new(router_tuned(&[&a], flow).await);
    let e0 = kvroute_core::index::EndpointId(0);
    let long = {
        let (client, router) = (client.clone(), router.clone());
        tokio::spawn(async move { complete(&client, &router, words(600, 1)).await })
    };
    eventually("the long prompt is prefilling", || {
        (router.router.load(e0).inflight_prefills == 1, ())
    })
    .await;
    let held = {
        let (client, router) = (client.clone(), router.clone());
        tokio::spawn(async move { complete(&client, &router, words(10, 2)).await })
    };
    eventually("the second request is held in the router", || {
        (held_requests(&router.router) == 1, ())
    })
    .await;
    assert_eq!(
        router.router.load(e0).inflight,
        1,
        "held, not sent to the engine"
    );
    let (status, retry) = complete(&client, &router, words(10, 3)).await;
    assert_eq!(
        (status, retry.as_deref()),
        (429, Some("1")),
        "the queue is full"
    );
    assert_eq!(long.await.unwrap().0, 200);
    assert_eq!(
        held.await.unwrap().0,
        200,
        "served once the engine had room"
    );
    assert_eq!(held_requests(&router.router), 0);

    // A router that may hold a request only briefly sheds it with 503.
    let brief = |c: &mut RouterConfig| {
        c.scheduler.saturation = Some(saturated_at_queue(1.0));
        c.flow.max_wait_s = 0.2;
    };
    let router = std::sync::Arc::new(router_tuned(&[&a], brief).await);
    let long = {
        let (client, router) = (client.clone(), router.clone());
        tokio::spawn(async move { complete(&client, &router, words(600, 4)).await })
    };
    eventually("the long prompt is prefilling", || {
        (router.router.load(e0).inflight_prefills == 1, ())
    })
    .await;
    let (status, retry) = complete(&client, &router, words(10, 5)).await;
    assert_eq!(
        (status, retry.as_deref()),
        (503, Some("1")),
        "shed after waiting"
    );
    let metrics = router.router.metrics().render();
    assert!(
        metrics.contains("kvroute_shed_total{reason=\"timeout\"} 1"),
        "{metrics}"
    );
    assert_eq!(long.await.unwrap().0, 200);
}

/// Two engines behind a round-robin router configured with `extra`: e0 answers every
/// generation request `status` at once while passing its health checks, e1 is well.
async fn failing_beside_healthy(
    status: u16,
    tune: impl FnOnce(&mut RouterConfig),
) -> (RunningRouter, [SimFleet; 2]) {
    let (bad, good) = (engine(512).await, engine(512).await);
    fault(
        &reqwest::Client::new(),
        &bad,
        0,
        json!({"error_fraction": 1.0, "error_status": status}),
    )
    .await;
    let router = router_tuned(&[&bad, &good], |c| {
        c.scheduler.policy = ProfileName::RoundRobin;
        tune(c);
    })
    .await;
    (router, [bad, good])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_answering_5xx_is_retried_elsewhere_then_ejected() {
    let (router, _engines) = failing_beside_healthy(503, |c| {
        c.outlier.consecutive_failures = 3;
        c.outlier.base_ejection_s = 60.0;
    })
    .await;
    let client = reqwest::Client::new();
    for i in 0..12 {
        let messages = [json!({"role": "user", "content": words(20, 900 + i)})];
        let answer = chat(&client, &router, &messages, 2).await;
        assert_eq!(answer.status, 200, "request {i}: {}", answer.body);
        assert_eq!(answer.endpoint, "e1");
    }
    assert!(router.router.healthy(kvroute_core::index::EndpointId(0)));
    let metrics = common::router_metrics(&client, &router).await;
    let series = |s: &str| kvroute_testkit::sample(&metrics, s);
    assert_eq!(
        series("kvroute_retries_total{endpoint=\"e0\",reason=\"5xx\"}"),
        Some(3.0),
        "{metrics}"
    );
    assert_eq!(
        series("kvroute_outlier_ejections_total{endpoint=\"e0\"}"),
        Some(1.0),
        "{metrics}"
    );
    // The explanation says why e0 is skipped.
    let explained: Value =
        common::explain(&client, &router, &json!({"model": MODEL, "prompt": "x"})).await;
    let e0 = &explained["endpoints"][0];
    assert_eq!(e0["rejected"], "ejected", "{explained}");
    assert!(e0["ejected_for_s"].as_f64().unwrap() > 50.0, "{explained}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_stop_when_the_budget_is_spent() {
    let (router, _engines) = failing_beside_healthy(500, |c| {
        c.outlier.enabled = false;
        c.retry.budget_ratio = 0.0;
        c.retry.min_retries_per_s = 0.0;
    })
    .await;
    let client = reqwest::Client::new();
    let mut statuses = Vec::new();
    for i in 0..4 {
        let messages = [json!({"role": "user", "content": words(20, 950 + i)})];
        statuses.push(chat(&client, &router, &messages, 2).await.status);
    }
    // Round robin sends two to e0: an empty budget refuses their retries.
    statuses.sort_unstable();
    assert_eq!(statuses, vec![200, 200, 500, 500]);
    let metrics = common::router_metrics(&client, &router).await;
    assert_eq!(
        kvroute_testkit::sample(
            &metrics,
            "kvroute_retry_budget_exhausted_total{endpoint=\"e0\",reason=\"5xx\"}"
        ),
        Some(2.0),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_circuit_breaker_sends_past_a_full_endpoint() {
    let (a, b) = (engine(1024).await, engine(1024).await);
    let router = router_tuned(&[&a, &b], |c| c.outlier.max_inflight = 1).await;
    let client = reqwest::Client::new();
    // A long stream holds one endpoint's only slot; the same prompt again, which the cache
    // would send there, goes to the other.
    let prompt = words(100, 7);
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 2000, "stream": true});
    let held = client
        .post(format!("http://{}/v1/completions", router.addr))
        .json(&body)
        .send()
        .await
        .unwrap();
    let home = common::served_by(&held);
    let second = client
        .post(format!("http://{}/v1/completions", router.addr))
        .json(&json!({"model": MODEL, "prompt": prompt, "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(second.status().as_u16(), 200);
    assert_ne!(
        second.headers()["x-kvroute-endpoint"].to_str().unwrap(),
        home
    );
    drop(held);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_circuit_holds_requests_until_a_slot_frees() {
    let a = engine(1024).await;
    let router = router_tuned(&[&a], |c| c.outlier.max_inflight = 1).await;
    let (socket, _) = open_stream(&router, 2000).await;
    let (client, addr) = (reqwest::Client::new(), router.addr);
    let waiting = tokio::spawn(async move {
        client
            .post(format!("http://{addr}/v1/completions"))
            .json(&json!({"model": MODEL, "prompt": "x y z", "max_tokens": 2}))
            .send()
            .await
            .unwrap()
            .status()
            .as_u16()
    });
    eventually("the second request held", || {
        (held_requests(&router.router) == 1, ())
    })
    .await;
    drop(socket);
    assert_eq!(waiting.await.unwrap(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_requests_are_counted_as_client_closed() {
    let a = engine(1024).await;
    let router = router_for(&[&a]).await;
    let client = reqwest::Client::new();
    let inflight = || {
        router
            .router
            .load(kvroute_core::index::EndpointId(0))
            .inflight
    };
    // Mid-stream: the client goes away after the first event.
    let (socket, _) = open_stream(&router, 2000).await;
    drop(socket);
    eventually("the stream ended", || (inflight() == 0, inflight())).await;
    // Before the response headers: an unstreamed answer comes only at its end.
    let body = json!({"model": MODEL, "prompt": words(100, 4), "max_tokens": 2000});
    let socket = raw_completion(&router, &body).await;
    eventually("dispatched", || (inflight() == 1, inflight())).await;
    drop(socket);
    eventually("the request ended", || (inflight() == 0, inflight())).await;
    // And one that completes.
    let answer = chat(
        &client,
        &router,
        &[json!({"role": "user", "content": "hi"})],
        2,
    )
    .await;
    assert_eq!(answer.status, 200);
    let metrics = common::router_metrics(&client, &router).await;
    let count = |status: &str, outcome: &str| {
        metrics
            .lines()
            .filter(|l| l.starts_with("kvroute_requests_total{"))
            .filter(|l| l.contains(&format!("status=\"{status}\",outcome=\"{outcome}\"")))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    assert_eq!(count("2xx", "client_closed"), 1.0, "{metrics}");
    assert_eq!(count("0xx", "client_closed"), 1.0, "{metrics}");
    assert_eq!(count("2xx", "completed"), 1.0, "{metrics}");
}

/// Sends a completion on a raw connection (so that its end is the socket's).
async fn raw_completion(router: &RunningRouter, body: &Value) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let mut socket = tokio::net::TcpStream::connect(router.addr).await.unwrap();
    let payload = body.to_string();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: kvroute\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        payload.len()
    );
    socket.write_all(head.as_bytes()).await.unwrap();
    socket.write_all(payload.as_bytes()).await.unwrap();
    socket
}

/// Sends a streamed completion on a raw connection and reads up to its first event.
async fn open_stream(router: &RunningRouter, max_tokens: u32) -> (tokio::net::TcpStream, Vec<u8>) {
    use tokio::io::AsyncReadExt;
    let body = json!({"model": MODEL, "prompt": words(50, 11), "max_tokens": max_tokens, "stream": true, "ignore_eos": true});
    let mut socket = raw_completion(router, &body).await;
    let mut received = Vec::new();
    while !String::from_utf8_lossy(&received).contains("data: ") {
        let mut buf = [0u8; 4096];
        let n = socket.read(&mut buf).await.unwrap();
        assert!(n > 0, "connection closed early");
        received.extend_from_slice(&buf[..n]);
    }
    (socket, received)
}

/// Reads a connection to its end.
async fn read_to_end(mut socket: tokio::net::TcpStream, mut received: Vec<u8>) -> String {
    use tokio::io::AsyncReadExt;
    tokio::time::timeout(Duration::from_secs(30), socket.read_to_end(&mut received))
        .await
        .expect("the connection ends")
        .unwrap();
    String::from_utf8_lossy(&received).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_refuses_new_connections_and_lets_streams_finish() {
    let a = engine(1024).await;
    let mut router = router_for(&[&a]).await;
    let client = reqwest::Client::new();
    let (socket, received) = open_stream(&router, 200).await;
    router.drain();
    let health = client
        .get(format!("http://{}/health", router.admin_addr))
        .send()
        .await
        .unwrap();
    assert_eq!(
        health.status().as_u16(),
        503,
        "readiness fails while draining"
    );
    let addr = router.addr;
    eventually("new connections refused", || {
        (std::net::TcpStream::connect(addr).is_err(), ())
    })
    .await;
    let text = read_to_end(socket, received).await;
    assert!(text.contains("data: [DONE]"), "{text}");
    assert!(!text.contains("\"error\""), "{text}");
    tokio::time::timeout(Duration::from_secs(10), router.drained())
        .await
        .expect("drained once the stream ended");
    let metrics = common::router_metrics(&client, &router).await;
    assert!(metrics.contains("outcome=\"completed\"} 1"), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_that_times_out_ends_open_streams_with_an_error_event() {
    let a = engine(1024).await;
    let mut router = router_for(&[&a]).await;
    let (socket, received) = open_stream(&router, 8000).await;
    let reader = tokio::spawn(read_to_end(socket, received));
    let finished = router.shutdown(Duration::from_millis(300)).await;
    assert!(!finished, "the stream outlives the drain timeout");
    let text = reader.await.unwrap();
    // The last event (the body is chunked on the wire) is the error.
    let last = &text[text.rfind("data: ").unwrap()..];
    assert!(last.starts_with("data: {\"error\""), "{last}");
    assert!(!text.contains("data: [DONE]"), "{text}");
    assert_eq!(
        router
            .router
            .load(kvroute_core::index::EndpointId(0))
            .inflight,
        0
    );
}
