//! Whether one huge prompt delays small requests: the latency of small requests through an
//! in-process router while another client sends multi-megabyte prompts, with large bodies
//! prepared on the blocking pool (the default, `limits.offload_above_bytes: 65536`) and, in the
//! same run, on the async workers (`offload_above_bytes` set past the largest body), and on the
//! async workers with every block of the prompt keyed and planned (`max_routed_blocks`
//! unbounded: the router before issue 17), against the same small requests with no large
//! prompt.
//!
//! The router runs on its own tokio runtime with two workers, built-in tokenizer, in front of a
//! stub engine on a third runtime that reads each body and answers at once (so that only the
//! router's work differs between cases; the clients run on a runtime of their own). One client
//! sends small completions (about 400 bytes, `max_tokens: 1`) one at a time, 5 ms apart, for
//! `KVROUTE_BENCH_SECONDS` (default 6) per case; in the loaded cases a second client sends
//! prompts of `KVROUTE_BENCH_LARGE_MB` megabytes (default 28, the size that delayed small
//! requests by 250–563 ms in issue 17's probe) one at a time, 500 ms apart, each distinct (a
//! new prefix, so the token cache never answers). It prints, per case,
//! the small requests' p50/p99/max and the p99 minus the unloaded p99, the large prompts
//! served, and the process's resident memory before the case and after it (the large client
//! stopped and its requests answered). `KVROUTE_BENCH_TOKENIZER=none` routes without tokens
//! (no block keys: parsing only, no planning or recording work under the fleet lock). Run:
//!
//! ```text
//! cargo bench -p kvroute-router --bench large_prompt
//! ```

// Measures real processes and sockets: wall-clock time, not the router's (tokio) clock.
#![allow(clippy::disallowed_methods)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::routing::{get, post};
use kvroute_router::config::RouterConfig;
use kvroute_router::server::{RunningRouter, start};
use kvroute_testkit::settings::{setting, setting_at_least};
use serde_json::json;

const MODEL: &str = "sim-llama-3.1-8b";
/// Between two large prompts: the machine is not saturated by moving their bytes alone.
const LARGE_PAUSE: Duration = Duration::from_millis(500);

/// A router on its own runtime (two workers), in front of `engine`.
fn router(
    runtime: &tokio::runtime::Runtime,
    engine: &str,
    offload_above: usize,
    routed_blocks: usize,
) -> RunningRouter {
    let tokenizer: String = setting("KVROUTE_BENCH_TOKENIZER", "builtin".to_owned());
    let yaml = format!(
        "listen: 127.0.0.1:0\nadmin: {{listen: 127.0.0.1:0}}\nmodels: [{{name: {MODEL}, tokenizer: {tokenizer}}}]\nlimits: {{offload_above_bytes: {offload_above}, max_routed_blocks: {routed_blocks}, max_body_bytes: 33554432}}\nendpoints: [{{name: e0, url: '{engine}'}}]\n"
    );
    let config = RouterConfig::from_yaml(&yaml).expect("valid configuration");
    runtime.block_on(start(config)).expect("the router starts")
}

struct Case {
    name: &'static str,
    small_ms: Vec<f64>,
    large_served: usize,
    rss_before: u64,
    rss_after: u64,
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

async fn run_case(
    name: &'static str,
    addr: std::net::SocketAddr,
    large_mb: Option<usize>,
    seconds: f64,
) -> Case {
    let rss_before = kvroute_testkit::proc_memory(None, "VmRSS") >> 20;
    let client = reqwest::Client::new();
    let url = format!("http://{addr}/v1/completions");
    let stop = Arc::new(AtomicBool::new(false));
    let served = Arc::new(AtomicUsize::new(0));
    let large = large_mb.map(|mb| {
        let (client, url, stop, served) =
            (client.clone(), url.clone(), stop.clone(), served.clone());
        // Distinct words (no run of repeated blocks), built once; each request gets a new prefix.
        let mut words = String::with_capacity(mb << 20);
        let mut w = 0u64;
        while words.len() < mb << 20 {
            words.push_str(&format!("w{w} "));
            w += 1;
        }
        tokio::spawn(async move {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let body = format!(
                    r#"{{"model": "{MODEL}", "prompt": "large{i} {words}", "max_tokens": 1}}"#
                );
                let _ = client
                    .post(&url)
                    .header("content-type", "application/json")
                    .body(body)
                    .send()
                    .await;
                served.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(LARGE_PAUSE).await;
            }
        })
    });
    let started = Instant::now();
    let mut small_ms = Vec::new();
    let mut n = 0u64;
    while started.elapsed().as_secs_f64() < seconds {
        n += 1;
        let prompt: String = (0..60).map(|w| format!("s{n}w{w} ")).collect();
        let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 1});
        let sent = Instant::now();
        let resp = client.post(&url).json(&body).send().await.expect("sent");
        assert!(
            resp.status().is_success(),
            "small request failed: {}",
            resp.status()
        );
        let _ = resp.bytes().await;
        small_ms.push(sent.elapsed().as_secs_f64() * 1000.0);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    stop.store(true, Ordering::Relaxed);
    if let Some(large) = large {
        let _ = large.await;
    }
    small_ms.sort_by(f64::total_cmp);
    Case {
        name,
        small_ms,
        large_served: served.load(Ordering::Relaxed),
        rss_before,
        rss_after: kvroute_testkit::proc_memory(None, "VmRSS") >> 20,
    }
}

/// An engine that reads each request body and answers at once. Returns its URL.
async fn stub_engine() -> String {
    let complete = |_body: axum::body::Bytes| async {
        axum::Json(json!({"choices": [{"text": "ok"}], "usage": {"prompt_tokens": 1}}))
    };
    let routes = axum::Router::new()
        .route("/health", get(|| async { "" }))
        .route("/metrics", get(|| async { "" }))
        .route("/v1/completions", post(complete))
        .layer(axum::extract::DefaultBodyLimit::disable());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a loopback port");
    let addr = listener.local_addr().expect("bound");
    tokio::spawn(async move { axum::serve(listener, routes).await });
    format!("http://{addr}")
}

fn main() {
    let seconds = setting_at_least("KVROUTE_BENCH_SECONDS", 6.0, 0.1);
    let large_mb: usize = setting("KVROUTE_BENCH_LARGE_MB", 28);
    let driver = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    let routers = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a runtime");
    let engine_runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("a runtime");
    let engine = engine_runtime.block_on(stub_engine());
    let pooled = router(&routers, &engine, 64 << 10, 16_384);
    let inline = router(&routers, &engine, usize::MAX, 16_384);
    let before = router(&routers, &engine, usize::MAX, usize::MAX);
    let cases = driver.block_on(async {
        vec![
            run_case("no large prompt", pooled.addr, None, seconds).await,
            run_case(
                "large prompts, blocking pool",
                pooled.addr,
                Some(large_mb),
                seconds,
            )
            .await,
            run_case(
                "large prompts, async workers",
                inline.addr,
                Some(large_mb),
                seconds,
            )
            .await,
            run_case(
                "async workers, every block",
                before.addr,
                Some(large_mb),
                seconds,
            )
            .await,
        ]
    });
    let base_p99 = percentile(&cases[0].small_ms, 0.99);
    println!(
        "{:<32} {:>7} {:>8} {:>8} {:>8} {:>12} {:>7} {:>14}",
        "case", "small", "p50 ms", "p99 ms", "max ms", "p99-base ms", "large", "RSS MiB"
    );
    for c in &cases {
        let p99 = percentile(&c.small_ms, 0.99);
        println!(
            "{:<32} {:>7} {:>8.2} {:>8.2} {:>8.2} {:>12.2} {:>7} {:>6} -> {:<6}",
            c.name,
            c.small_ms.len(),
            percentile(&c.small_ms, 0.5),
            p99,
            c.small_ms.last().copied().unwrap_or(f64::NAN),
            p99 - base_p99,
            c.large_served,
            c.rss_before,
            c.rss_after
        );
    }
    drop((pooled, inline, before));
}
