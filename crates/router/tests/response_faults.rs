//! An engine that fails after its response headers, over real loopback HTTP: a stream that
//! stalls or breaks mid-body ends with an OpenAI-shaped SSE error event, counted, one engine
//! stalling its `/v1/models` body does not hang the router's listing, an empty answer is
//! accounted as completed, a prefill answer too large to read is the request's problem, not
//! the prefill endpoint's, a decode leg that stalls before its first byte strikes its pair, and
//! one that fails is served aggregated on the next decoder, its prompt counted there (on the
//! producer itself, never as a pull from itself).

// Measures real processes and sockets: wall-clock time, not the router's (tokio) clock.
#![allow(clippy::disallowed_methods)]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::response::Response;
use axum::routing::{get, post};
use bytes::Bytes;
use common::config_builder::{ConfigBuilder, pd_always};
use futures::StreamExt;
use kvroute_router::config::RouterConfig;
use kvroute_router::server::{RunningRouter, start as start_router};
use kvroute_testkit::{http_get, patience, sample};
use serde_json::{Value, json};

const MODEL: &str = "sim-llama-3.1-8b";

/// What the faulty engine does after the first chunk of a completion.
#[derive(Clone, Copy)]
enum AfterFirstChunk {
    /// Sends nothing more, and keeps the connection open.
    Stall,
    /// Breaks the connection a moment later (once the first chunk is on its way).
    Fail,
}

/// A body that sends `first` (if any), then stalls or fails.
fn faulty_body(first: Option<&'static str>, then: AfterFirstChunk) -> Body {
    let first = futures::stream::iter(first.map(|c| Ok::<_, std::io::Error>(Bytes::from(c))));
    let rest = match then {
        AfterFirstChunk::Stall => futures::stream::pending().boxed(),
        AfterFirstChunk::Fail => futures::stream::once(async {
            tokio::time::sleep(Duration::from_millis(200)).await;
            Err(std::io::Error::other("the engine crashed"))
        })
        .boxed(),
    };
    Body::from_stream(first.chain(rest))
}

/// An engine on loopback whose `/health` passes, whose completions stream one chunk and then
/// do `then`, and whose `/v1/models` sends its headers and stalls. Returns its URL.
async fn faulty_engine(then: AfterFirstChunk) -> String {
    let completion = move || async move {
        Response::builder()
            .header("content-type", "text/event-stream")
            .body(faulty_body(
                Some("data: {\"choices\": [{\"text\": \"a\"}]}\n\n"),
                then,
            ))
            .unwrap()
    };
    let models = || async {
        Response::builder()
            .header("content-type", "application/json")
            .body(faulty_body(None, AfterFirstChunk::Stall))
            .unwrap()
    };
    let routes = axum::Router::new()
        .route("/metrics", get(|| async { "" }))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completion));
    common::fake_engine(routes).await
}

async fn router(urls: &[&str], tune: impl FnOnce(&mut RouterConfig)) -> RunningRouter {
    let mut config = ConfigBuilder::new(MODEL);
    for (i, url) in urls.iter().enumerate() {
        config = config.url(&format!("e{i}"), url);
    }
    start_router(config.with(tune).build()).await.unwrap()
}

/// Streams a completion through the router: the whole text it sent before ending.
async fn stream_completion(router: &RunningRouter) -> String {
    let resp = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", router.addr))
        .json(&json!({"model": MODEL, "prompt": "hello", "max_tokens": 4, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let mut body = resp.bytes_stream();
    let mut text = String::new();
    let read = tokio::time::timeout(patience(), async {
        while let Some(Ok(chunk)) = body.next().await {
            text.push_str(&String::from_utf8_lossy(&chunk));
        }
    })
    .await;
    assert!(read.is_ok(), "the stream was never ended; got {text:?}");
    text
}

/// The stream's last event, parsed.
fn last_event(text: &str) -> Value {
    let last = text.trim_end().rsplit("data: ").next().unwrap();
    serde_json::from_str(last).unwrap_or_else(|e| panic!("{e}: {text:?}"))
}

/// The sum of `metric`'s series carrying `label` on `router`'s `/metrics`, and the page (for
/// the assertion's message).
fn counted(router: &RunningRouter, metric: &str, label: &str) -> (f64, String) {
    let metrics = http_get(router.admin_addr, "/metrics");
    (
        kvroute_testkit::sum_labelled(&metrics, metric, label),
        metrics,
    )
}

fn cut(router: &RunningRouter, reason: &str) -> Option<f64> {
    let series = format!("kvroute_streams_cut_total{{reason=\"{reason}\"}}");
    sample(&http_get(router.admin_addr, "/metrics"), &series)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_the_engine_stalls_is_cut_with_an_error_event() {
    let url = faulty_engine(AfterFirstChunk::Stall).await;
    let router = router(&[&url], |c| c.limits.stream_idle_timeout_s = 0.5).await;
    let started = Instant::now();
    let text = stream_completion(&router).await;
    assert!(text.starts_with("data: {\"choices\""), "{text}");
    let error = last_event(&text);
    assert_eq!(error["error"]["code"], 504, "{text}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "cut late: {:?}",
        started.elapsed()
    );
    assert_eq!(cut(&router, "stalled"), Some(1.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_the_engine_breaks_ends_with_an_error_event() {
    let url = faulty_engine(AfterFirstChunk::Fail).await;
    let router = router(&[&url], |_| {}).await;
    let text = stream_completion(&router).await;
    assert!(text.starts_with("data: {\"choices\""), "{text}");
    let error = last_event(&text);
    assert_eq!(error["error"]["code"], 502, "{text}");
    assert_eq!(cut(&router, "engine_error"), Some(1.0));
    let (failed, metrics) = counted(
        &router,
        "kvroute_requests_total",
        "outcome=\"engine_error\"",
    );
    assert_eq!(failed, 1.0, "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_stalling_its_model_list_does_not_hang_the_listing() {
    let stalled = faulty_engine(AfterFirstChunk::Stall).await;
    let engine = common::engine().await;
    let router = router(&[&stalled, &engine.endpoints[0].url], |_| {}).await;
    let started = Instant::now();
    let listing = tokio::time::timeout(
        patience(),
        reqwest::get(format!("http://{}/v1/models", router.addr)),
    )
    .await
    .expect("/v1/models answered")
    .unwrap();
    let list: Value = listing.json().await.unwrap();
    let ids: Vec<&str> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|c| c["id"].as_str())
        .collect();
    assert_eq!(ids, [MODEL], "{list}");
    // Within the listing's bound (2 s), not one bound per endpoint.
    assert!(
        started.elapsed() < kvroute_router::testing::MODELS_TIMEOUT + Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
}

/// Posts a two-token completion through `router`; its status and body.
async fn complete(client: &reqwest::Client, router: &RunningRouter) -> (u16, bytes::Bytes) {
    let answer = client
        .post(format!("http://{}/v1/completions", router.addr))
        .json(&json!({"model": MODEL, "prompt": "hello", "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    (answer.status().as_u16(), answer.bytes().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_answer_is_accounted_completed() {
    let url = answering_engine(b"").await;
    let router = router(&[&url], |_| {}).await;
    let client = reqwest::Client::new();
    for _ in 0..2 {
        let (status, body) = complete(&client, &router).await;
        assert_eq!(status, 200);
        assert!(body.is_empty());
    }
    let metrics = http_get(router.admin_addr, "/metrics");
    let outcome = |o: &str| {
        kvroute_testkit::sum_labelled(
            &metrics,
            "kvroute_requests_total",
            &format!("outcome=\"{o}\""),
        )
    };
    assert_eq!(outcome("completed"), 2.0, "{metrics}");
    assert_eq!(outcome("client_closed"), 0.0, "{metrics}");
    assert_eq!(
        sample(&metrics, "kvroute_endpoint_inflight{endpoint=\"e0\"}"),
        Some(0.0),
        "{metrics}"
    );
}

/// An engine on loopback whose completions answer 200 with `body`. Returns its URL.
async fn answering_engine(body: &'static [u8]) -> String {
    let routes = axum::Router::new().route(
        "/v1/completions",
        post(move || async move {
            Response::builder()
                .header("content-type", "application/json")
                .body(Body::from(body))
                .unwrap()
        }),
    );
    common::fake_engine(routes).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_answer_too_large_to_read_does_not_eject_the_prefill_endpoint() {
    // A prefill engine whose answers are 2 MiB (as `echo` or `prompt_logprobs` of a long
    // prompt make them), past what the router reads of one; a decode engine that answers.
    let huge: &'static [u8] = format!("{{\"text\": \"{}\"}}", "x".repeat(2 << 20))
        .leak()
        .as_bytes();
    let prefill = answering_engine(huge).await;
    let decode = answering_engine(br#"{"choices": [{"text": "a"}]}"#).await;
    let router = router(&[&prefill, &decode], pd_always).await;
    let client = reqwest::Client::new();
    // More than the outlier detector's consecutive failures (5).
    for _ in 0..7 {
        // Each falls back to an aggregated prefill on the decode pick.
        assert_eq!(complete(&client, &router).await.0, 200);
    }
    assert!(
        router.router.available(kvroute_core::index::EndpointId(0)),
        "the prefill endpoint was ejected for answers its requests made large"
    );
    let (fallbacks, metrics) = counted(
        &router,
        "kvroute_pd_fallbacks_total",
        "reason=\"prefill_no_params\"",
    );
    assert_eq!(fallbacks, 7.0, "{metrics}");
}

/// An engine on loopback whose completions send a stream's headers, then nothing (a decode
/// engine whose pull hangs: real vLLM sends the headers before it pulls). Returns its URL.
async fn headers_then_silence_engine() -> String {
    let routes = axum::Router::new().route(
        "/v1/completions",
        post(|| async {
            Response::builder()
                .header("content-type", "text/event-stream")
                .body(faulty_body(None, AfterFirstChunk::Stall))
                .unwrap()
        }),
    );
    common::fake_engine(routes).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_leg_stalled_before_its_first_byte_strikes_its_pair() {
    let prefill = common::prefill_engine().await;
    let decode = headers_then_silence_engine().await;
    let router = router(&[&prefill, &decode], |c| {
        pd_always(c);
        c.limits.response_timeout_s = 0.3;
    })
    .await;
    for _ in 0..3 {
        let text = stream_completion(&router).await;
        // Cut with an error event once the first byte is overdue.
        assert_eq!(last_event(&text)["error"]["code"], 504, "{text}");
    }
    let (strikes, metrics) = counted(&router, "kvroute_pd_transfer_failures_total", "");
    assert_eq!(strikes, 3.0, "{metrics}");
}

/// Decode engines sharing one script: the first decode request any of them receives fails
/// (503, before any body byte); the next is held, its engine and body noted, until `release`.
#[derive(Default)]
struct FailOnceThenHold {
    failed: std::sync::atomic::AtomicBool,
    held: std::sync::Mutex<Option<(usize, Value)>>,
}

impl FailOnceThenHold {
    /// Engine `at` (its endpoint id in the router) following the script. Returns its URL.
    async fn engine(
        self: &Arc<Self>,
        at: usize,
        release: tokio::sync::watch::Receiver<bool>,
    ) -> String {
        let script = self.clone();
        let completion = move |body: axum::Json<Value>| {
            let script = script.clone();
            let release = release.clone();
            async move {
                if !script
                    .failed
                    .swap(true, std::sync::atomic::Ordering::SeqCst)
                {
                    return Response::builder()
                        .status(503)
                        .body(Body::from("overloaded"))
                        .unwrap();
                }
                *script.held.lock().unwrap() = Some((at, body.0));
                common::held_sse_answer(release)
            }
        };
        common::fake_engine(axum::Router::new().route("/v1/completions", post(completion))).await
    }
}

/// A decode leg that fails after its prefill is served aggregated on the next decode endpoint,
/// which computes the whole prompt: until its first token, that endpoint's queued prefill counts
/// the prompt (what flow control and later requests' costs read), not the nothing left to
/// compute after a pull.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_decode_leg_served_aggregated_counts_its_prompt_on_the_next_decoder() {
    let prefill = common::prefill_engine().await;
    let script = Arc::new(FailOnceThenHold::default());
    let (release, held) = tokio::sync::watch::channel(false);
    let decoders = [
        script.engine(1, held.clone()).await,
        script.engine(2, held).await,
    ];
    let router = router(&[&prefill, &decoders[0], &decoders[1]], pd_always).await;
    let client = reqwest::Client::new();
    let request = json!({"model": MODEL, "prompt": "a long document nobody sent before. ".repeat(40), "max_tokens": 2, "stream": true});
    let prompt_tokens = common::explain(&client, &router, &request).await["prompt_tokens"]
        .as_u64()
        .unwrap();
    let in_flight = common::spawn_completion(client, router.addr, request);
    kvroute_testkit::eventually("the request reached the next decoder", || {
        let held = script.held.lock().unwrap().clone();
        (held.is_some(), held)
    })
    .await;
    let (serving, body) = script.held.lock().unwrap().clone().unwrap();
    assert_eq!(
        body.get("kv_transfer_params"),
        None,
        "served aggregated: {body}"
    );
    let load = router
        .router
        .load(kvroute_core::index::EndpointId(serving as u32));
    assert_eq!(
        load.inflight_prefill_tokens, prompt_tokens,
        "the whole prompt is computed there"
    );
    release.send(true).unwrap();
    let (status, text) = in_flight.await.unwrap();
    assert_eq!(status, 200, "{text}");
}

/// An engine serving whole requests and prefill legs alike (a kv_both fleet's): a prefill leg
/// is answered [`common::PREFILL_ANSWER`], anything else a completion. Returns its URL and the
/// bodies of the completions it received.
async fn producing_engine() -> (String, Arc<std::sync::Mutex<Vec<Value>>>) {
    let received = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = received.clone();
    let completion = move |body: axum::Json<Value>| {
        let prefill = body.0["kv_transfer_params"]["do_remote_decode"] == true;
        seen.lock().unwrap().push(body.0);
        let answer = if prefill {
            common::PREFILL_ANSWER
        } else {
            r#"{"choices": [{"text": "b"}]}"#
        };
        async move {
            Response::builder()
                .header("content-type", "application/json")
                .body(Body::from(answer))
                .unwrap()
        }
    };
    let routes = axum::Router::new().route("/v1/completions", post(completion));
    (common::fake_engine(routes).await, received)
}

/// In a kv_both fleet the prefill endpoint is also a decoder: a decode leg whose decoder cannot
/// be reached goes on to the next decoder, the producer itself, which cannot pull from its own
/// engine (NIXL refuses the handshake). It is served aggregated there, where the prefill leg
/// left the prompt cached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_leg_retried_on_its_own_producer_is_served_aggregated_there() {
    let (producer, received) = producing_engine().await;
    let unreachable = format!("http://127.0.0.1:{}", kvroute_testkit::free_ports(1));
    let router = router(&[&producer, &unreachable], |c| {
        c.pd.mode = kvroute_router::config::PdMode::Always;
        // Round robin from the second endpoint: the unreachable one is the first request's
        // decode pick, and the producer (the only other endpoint) its prefill endpoint.
        c.scheduler.policy = kvroute_core::schedule::ProfileName::RoundRobin;
    })
    .await;
    let (status, body) = complete(&reqwest::Client::new(), &router).await;
    assert_eq!(status, 200, "{body:?}");
    let (retried, metrics) = counted(&router, "kvroute_retries_total", "endpoint=\"e1\"");
    assert_eq!(
        retried, 1.0,
        "the decode leg went to the unreachable decoder first: {metrics}"
    );
    let received = received.lock().unwrap().clone();
    let params: Vec<&Value> = received.iter().map(|b| &b["kv_transfer_params"]).collect();
    assert_eq!(params.len(), 2, "{received:#?}");
    assert_eq!(
        params[0]["do_remote_decode"], true,
        "the prefill leg: {received:#?}"
    );
    assert_eq!(
        params[1],
        &Value::Null,
        "the retry on the producer is served aggregated, not a pull from itself: {received:#?}"
    );
}
