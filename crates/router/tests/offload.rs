//! Large requests are prepared on the bounded blocking pool: while it is busy, a large request
//! past its queue is shed with 503 and counted, and small requests go on being served beside
//! it. The engine is a loopback stub whose `/tokenize` (the `remote` tokenizer) answers only
//! when the test lets it, so that the pool is busy for as long as the test needs.

mod common;

use std::sync::Arc;

use axum::routing::{get, post};
use common::config_builder::ConfigBuilder;
use kvroute_router::config::{TokenizerConfig, TokenizerKind};
use kvroute_router::server::start as start_router;
use kvroute_testkit::{http_get, patience, sample};
use serde_json::{Value, json};
use tokio::sync::{Notify, mpsc};

const MODEL: &str = "m";

/// A stub engine: `/tokenize` reports each call on `called` and answers once `release` is
/// notified; completions answer at once. Returns its URL.
async fn stub_engine(called: mpsc::Sender<()>, release: Arc<Notify>) -> String {
    let tokenize = move || {
        let (called, release) = (called.clone(), release.clone());
        async move {
            // Waiting for the release before the test hears of this call, so none is missed.
            let released = release.notified();
            tokio::pin!(released);
            released.as_mut().enable();
            let _ = called.send(()).await;
            released.await;
            axum::Json(json!({"tokens": [1, 2, 3]}))
        }
    };
    let complete = || async { axum::Json(json!({"choices": [{"text": "ok"}]})) };
    let routes = axum::Router::new()
        .route("/metrics", get(|| async { "" }))
        .route("/tokenize", post(tokenize))
        .route("/v1/completions", post(complete));
    common::fake_engine(routes).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_requests_past_the_pools_queue_are_shed_and_small_ones_go_on() {
    let (called_tx, mut called) = mpsc::channel(4);
    let release = Arc::new(Notify::new());
    let url = stub_engine(called_tx, release.clone()).await;
    let config = ConfigBuilder::new(MODEL)
        .tokenizer(TokenizerConfig::Kind(TokenizerKind::Remote))
        .with(|c| {
            c.limits.offload_above_bytes = 10_000;
            c.limits.offload_threads = 1;
            c.limits.offload_queue = 0;
        })
        .url("e0", &url)
        .build();
    let router = start_router(config).await.unwrap();
    let client = reqwest::Client::new();
    let send = |prompt: String| {
        let client = client.clone();
        let url = format!("http://{}/v1/completions", router.addr);
        async move {
            let resp = client
                .post(url)
                .json(&json!({"model": MODEL, "prompt": prompt, "max_tokens": 1}))
                .send()
                .await
                .unwrap();
            let status = resp.status().as_u16();
            (status, resp.json::<Value>().await.unwrap_or(Value::Null))
        }
    };
    let large = || "word ".repeat(4_000);
    // The first large request takes the pool's one thread, waiting on `/tokenize`.
    let first = tokio::spawn(send(large()));
    tokio::time::timeout(patience(), called.recv())
        .await
        .expect("the first large request reached /tokenize");
    // A second one finds the queue (of none) full.
    let (status, answer) = send(large()).await;
    assert_eq!(status, 503, "{answer}");
    let text = http_get(router.admin_addr, "/metrics");
    assert_eq!(
        sample(&text, "kvroute_shed_total{reason=\"offload_queue\"}"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(sample(&text, "kvroute_offload_requests"), Some(1.0));
    // A small request is prepared on the async workers, beside the busy pool.
    let small = tokio::spawn(send("hello".into()));
    tokio::time::timeout(patience(), called.recv())
        .await
        .expect("the small request reached /tokenize");
    release.notify_waiters();
    for task in [first, small] {
        let (status, answer) = task.await.unwrap();
        assert_eq!(status, 200, "{answer}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_past_the_routed_blocks_is_routed_by_its_head() {
    let config = ConfigBuilder::new("m")
        .with(|c| c.limits.max_routed_blocks = 8)
        .url("e0", "http://127.0.0.1:9")
        .build();
    let router = start_router(config).await.unwrap();
    let explained: Value = common::explain(
        &reqwest::Client::new(),
        &router,
        &json!({"model": MODEL, "prompt": "word ".repeat(2_000)}),
    )
    .await;
    assert_eq!(explained["blocks"], 8, "{explained}");
    assert!(
        explained["prompt_tokens"].as_u64().unwrap() > 1_000,
        "the cost still counts every token: {explained}"
    );
}
