//! The simulated server over real HTTP and ZMQ on loopback, as kvroute and clients see it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use kvroute_core::index::{EndpointId, IndexConfig, KvIndex, SharedIndex};
use kvroute_core::keys::{VllmHasher, router_keys};
use kvroute_sim::engine::EngineConfig;
use kvroute_sim::server::{SimConfig, SimFleet, start};
use kvroute_vllm::subscriber::{
    EndpointSource, EventSink, SubscriberHandle, Timing, spawn_connected,
};
use serde_json::{Value, json};

const E: EndpointId = EndpointId(0);

fn config(gpu_blocks: usize) -> SimConfig {
    SimConfig {
        port: 0,
        events_port: 0,
        replay_port: Some(0),
        engine: EngineConfig {
            num_gpu_blocks: gpu_blocks,
            max_model_len: 8192,
            ..EngineConfig::default()
        },
        time_scale: 4.0,
        ..SimConfig::default()
    }
}

async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    kvroute_testkit::eventually(what, || (check(), ())).await;
}

fn subscribe(fleet: &SimFleet, index: &Arc<SharedIndex>) -> SubscriberHandle {
    let ep = &fleet.endpoints[0];
    spawn_connected(
        EndpointSource {
            endpoint: E,
            name: ep.url.clone(),
            publisher: ep.events.clone(),
            replay: ep.replay.clone(),
            topic: String::new(),
        },
        index.clone() as Arc<dyn EventSink>,
        Timing::default(),
    )
}

async fn complete(
    client: &reqwest::Client,
    url: &str,
    body: Value,
) -> (reqwest::StatusCode, Value) {
    let resp = client
        .post(format!("{url}/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = resp.status();
    (status, resp.json().await.unwrap_or(Value::Null))
}

/// Streams a completion; returns (time to first chunk, usage).
async fn stream_ttft(client: &reqwest::Client, url: &str, prompt: &[u32]) -> (Duration, Value) {
    let started = Instant::now();
    let resp = client
        .post(format!("{url}/v1/completions"))
        .json(
            &json!({"model": "sim-llama-3.1-8b", "prompt": prompt, "max_tokens": 4, "stream": true,
            "stream_options": {"include_usage": true}}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let mut body = resp.bytes_stream();
    let mut ttft = None;
    let mut text = String::new();
    while let Some(chunk) = body.next().await {
        ttft.get_or_insert(started.elapsed());
        text.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
    }
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    let events: Vec<Value> = text
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert_eq!(events.len(), 5, "4 token chunks and a usage chunk: {text}");
    assert_eq!(events[3]["choices"][0]["finish_reason"], "length");
    (ttft.unwrap(), events[4]["usage"].clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_prefix_is_reported_cached_and_answers_sooner() {
    // Real time: the 4,000-token prefill takes ~130 ms, far above the hashing work a debug
    // build does per request.
    let mut cfg = config(2048);
    cfg.time_scale = 1.0;
    let fleet = start(cfg).await.unwrap();
    let url = &fleet.endpoints[0].url;
    let client = reqwest::Client::new();
    let prompt: Vec<u32> = (1000..5000).collect(); // 4,000 tokens = 250 blocks
    let (cold, usage) = stream_ttft(&client, url, &prompt).await;
    assert_eq!(usage["prompt_tokens_details"]["cached_tokens"], 0);
    let mut turn2 = prompt.clone();
    turn2.extend(9000..9100);
    let (warm, usage) = stream_ttft(&client, url, &turn2).await;
    assert_eq!(
        usage["prompt_tokens_details"]["cached_tokens"], 4000,
        "all 250 shared blocks"
    );
    assert_eq!(usage["prompt_tokens"], 4100);
    assert!(
        warm * 2 < cold,
        "cached prefill must be much faster: {warm:?} vs {cold:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_name_exactly_the_evicted_blocks_and_the_index_predicts_cached_tokens() {
    let fleet = start(config(40)).await.unwrap();
    let url = fleet.endpoints[0].url.clone();
    let index = Arc::new(SharedIndex::new(
        KvIndex::new(IndexConfig::default()).unwrap(),
    ));
    let sub = subscribe(&fleet, &index);
    eventually("subscription", || sub.stats()[0].1.connected).await;
    let client = reqwest::Client::new();
    let hasher = VllmHasher::new(kvroute_core::keys::VLLM_DEFAULT_SEED);
    let a: Vec<u32> = (0..400).collect(); // 25 blocks
    let b: Vec<u32> = (5000..5400).collect(); // 25 blocks: 40-block pool must evict a's tail
    let a_hashes: Vec<u64> = hasher
        .block_digests(&a, 16, None)
        .unwrap()
        .iter()
        .map(|d| d.event_u64())
        .collect();
    for prompt in [&a, &b, &a, &b, &a] {
        // Quiet fleet: wait until the index has every event, then predict.
        let stored = sub.stats()[0].1.batches;
        let usable = &prompt[..prompt.len() - 1];
        let keys = router_keys(usable, 16, None).unwrap();
        let predicted = index.lookup(&keys).blocks(E) as u64 * 16;
        let (status, body) = complete(
            &client,
            &url,
            json!({"model": "sim-llama-3.1-8b", "prompt": prompt, "max_tokens": 2}),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(
            body["usage"]["prompt_tokens_details"]["cached_tokens"],
            predicted
        );
        eventually("events of the request", || {
            sub.stats()[0].1.batches > stored
        })
        .await;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let stats = index.endpoint_stats(E).unwrap();
    assert!(
        stats.blocks_removed > 0,
        "the small pool must evict: {stats:?}"
    );
    assert_eq!(
        stats.unknown_hashes, 0,
        "every removal named a stored block"
    );
    assert_eq!(stats.orphan_blocks, 0);
    // The blocks of a still held are exactly those never removed since their last store.
    let held_a = a_hashes
        .iter()
        .filter(|h| {
            index.read(|ix| {
                ix.resolve(E, kvroute_core::event::EngineHash(**h))
                    .is_some()
            })
        })
        .count();
    let metrics = client
        .get(format!("{url}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("vllm:cache_config_info{block_size=\"16\""),
        "{metrics}"
    );
    assert!(held_a > 0 && held_a <= 25);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_resets_the_event_sequence_and_the_index_follows() {
    let fleet = start(config(512)).await.unwrap();
    let url = fleet.endpoints[0].url.clone();
    let index = Arc::new(SharedIndex::new(
        KvIndex::new(IndexConfig::default()).unwrap(),
    ));
    let sub = subscribe(&fleet, &index);
    eventually("subscription", || sub.stats()[0].1.connected).await;
    let client = reqwest::Client::new();
    for i in 0..3u32 {
        let prompt: Vec<u32> = (0..100).map(|t| t + 1000 * i).collect();
        complete(
            &client,
            &url,
            json!({"model": "sim-llama-3.1-8b", "prompt": prompt, "max_tokens": 1}),
        )
        .await;
    }
    eventually("3 batches", || sub.stats()[0].1.last_seq == Some(2)).await;
    assert!(index.endpoint_stats(E).unwrap().blocks_gpu > 0);
    assert_eq!(
        client
            .post(format!("{url}/sim/restart"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    let prompt: Vec<u32> = (50_000..50_064).collect();
    let (_, body) = complete(
        &client,
        &url,
        json!({"model": "sim-llama-3.1-8b", "prompt": prompt, "max_tokens": 1}),
    )
    .await;
    assert_eq!(body["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    eventually("restart noticed", || {
        sub.stats()[0].1.restarts == 1 && sub.stats()[0].1.last_seq == Some(0)
    })
    .await;
    assert_eq!(
        index.endpoint_stats(E).unwrap().blocks_gpu,
        4,
        "only the new engine's blocks"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_event_batches_are_replayed() {
    let mut cfg = config(4096);
    cfg.faults.drop_event_fraction = 0.5;
    let fleet = start(cfg).await.unwrap();
    let url = fleet.endpoints[0].url.clone();
    let index = Arc::new(SharedIndex::new(
        KvIndex::new(IndexConfig::default()).unwrap(),
    ));
    let sub = subscribe(&fleet, &index);
    eventually("subscription", || sub.stats()[0].1.connected).await;
    let client = reqwest::Client::new();
    for i in 0..20u32 {
        let prompt: Vec<u32> = (0..64).map(|t| t + 1000 * i).collect();
        complete(
            &client,
            &url,
            json!({"model": "sim-llama-3.1-8b", "prompt": prompt, "max_tokens": 1}),
        )
        .await;
    }
    // One last batch that is not lost, so the subscriber sees the end of the stream.
    client
        .post(format!("{url}/sim/faults"))
        .json(&json!({"drop_event_fraction": 0.0}))
        .send()
        .await
        .unwrap();
    complete(&client, &url, json!({"model": "sim-llama-3.1-8b", "prompt": (90_000..90_064).collect::<Vec<u32>>(), "max_tokens": 1})).await;
    eventually("all batches", || sub.stats()[0].1.last_seq == Some(20)).await;
    let s = sub.stats()[0].1.clone();
    assert!(s.gaps > 0, "{s:?}");
    assert_eq!(s.unfilled_gaps, 0);
    assert_eq!(index.endpoint_stats(E).unwrap().blocks_gpu, 21 * 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_surface_and_errors() {
    let fleet = start(config(256)).await.unwrap();
    let url = fleet.endpoints[0].url.clone();
    let client = reqwest::Client::new();
    let (status, body) = complete(
        &client,
        &url,
        json!({"model": "sim-llama-3.1-8b", "prompt": "Hello there, simulator", "max_tokens": 7}),
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(body["object"], "text_completion");
    assert_eq!(body["usage"]["completion_tokens"], 7);
    assert!(body["choices"][0]["text"].as_str().unwrap().len() > 7);

    let chat = client
        .post(format!("{url}/v1/chat/completions"))
        .json(&json!({"model": "sim-llama-3.1-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}))
        .send()
        .await
        .unwrap();
    let chat: Value = chat.json().await.unwrap();
    assert_eq!(chat["choices"][0]["message"]["role"], "assistant");
    assert_eq!(chat["usage"]["completion_tokens"], 3);
    // Streamed, as vLLM's chat stream: the role with empty content, then one chunk per token.
    let text = client
        .post(format!("{url}/v1/chat/completions"))
        .json(&json!({"model": "sim-llama-3.1-8b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": true}))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let deltas: Vec<Value> = text
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str::<Value>(d).unwrap()["choices"][0]["delta"].clone())
        .collect();
    assert_eq!(deltas.len(), 4, "{text}");
    assert_eq!(deltas[0], json!({"role": "assistant", "content": ""}));
    assert!(
        deltas[1..]
            .iter()
            .all(|d| d.get("role").is_none() && !d["content"].as_str().unwrap().is_empty()),
        "{text}"
    );

    let tok: Value = client
        .post(format!("{url}/tokenize"))
        .json(&json!({"prompt": "a b c"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let tokens = tok["tokens"].clone();
    let detok: Value = client
        .post(format!("{url}/detokenize"))
        .json(&json!({"tokens": tokens}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(detok["prompt"], "a b c");

    let models: Value = client
        .get(format!("{url}/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], "sim-llama-3.1-8b");

    // As vLLM: a request naming no model is served by the engine's own.
    let (status, body) = complete(&client, &url, json!({"prompt": "x", "max_tokens": 1})).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["model"], "sim-llama-3.1-8b");
    for (body, status) in [
        (json!({"model": "", "prompt": "x"}), 400),
        (json!({"model": "other", "prompt": "x"}), 404),
        (
            json!({"model": "sim-llama-3.1-8b", "prompt": (0..9000).collect::<Vec<u32>>()}),
            400,
        ),
    ] {
        let (got, err) = complete(&client, &url, body).await;
        assert_eq!(got.as_u16(), status, "{err}");
        assert_eq!(err["error"]["code"], status);
    }
    let resp = client
        .post(format!("{url}/v1/completions"))
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);

    client
        .post(format!("{url}/sim/faults"))
        .json(&json!({"healthy": false}))
        .send()
        .await
        .unwrap();
    assert_eq!(
        client
            .get(format!("{url}/health"))
            .send()
            .await
            .unwrap()
            .status(),
        503
    );
    let bad = client
        .post(format!("{url}/sim/faults"))
        .json(&json!({"no_such": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_engines_have_their_own_caches() {
    let mut cfg = config(256);
    cfg.engines = 3;
    let fleet = start(cfg).await.unwrap();
    assert_eq!(fleet.endpoints.len(), 3);
    let client = reqwest::Client::new();
    let prompt: Vec<u32> = (0..200).collect();
    let body = json!({"model": "sim-llama-3.1-8b", "prompt": prompt, "max_tokens": 1});
    complete(&client, &fleet.endpoints[0].url, body.clone()).await;
    let (_, on_same) = complete(&client, &fleet.endpoints[0].url, body.clone()).await;
    let (_, on_other) = complete(&client, &fleet.endpoints[1].url, body).await;
    assert_eq!(
        on_same["usage"]["prompt_tokens_details"]["cached_tokens"],
        192
    );
    assert_eq!(
        on_other["usage"]["prompt_tokens_details"]["cached_tokens"],
        0
    );
}
