//! The router's HTTP edge over real loopback sockets: which paths reach an engine, slow and
//! oversized clients, connection limits, the buffered-bytes budget, the admin listener, and
//! requests that vLLM accepts in every shape.

// Measures real processes and sockets: wall-clock time, not the router's (tokio) clock.
#![allow(clippy::disallowed_methods)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::config_builder::ConfigBuilder;
use common::engine;
use futures::StreamExt;
use kvroute_router::config::Network;
use kvroute_router::config::RouterConfig;
use kvroute_router::server::{RunningRouter, start as start_router};
use kvroute_sim::server::SimFleet;
use kvroute_testkit::{eventually, http_get, patience, sample};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const MODEL: &str = "sim-llama-3.1-8b";

/// A router in front of one engine URL (no KV events: these tests are about HTTP).
async fn router_with(url: &str, tune: impl FnOnce(&mut RouterConfig)) -> RunningRouter {
    let config = ConfigBuilder::new(MODEL).url("e0", url).with(tune).build();
    start_router(config).await.unwrap()
}

/// A simulated engine and a router in front of it.
async fn engine_and_router(tune: impl FnOnce(&mut RouterConfig)) -> (SimFleet, RunningRouter) {
    let engine = engine().await;
    let router = router_with(&engine.endpoints[0].url, tune).await;
    (engine, router)
}

/// Sends raw bytes on a new connection.
async fn send_raw(addr: std::net::SocketAddr, bytes: &[u8]) -> TcpStream {
    let mut socket = TcpStream::connect(addr).await.unwrap();
    socket.write_all(bytes).await.unwrap();
    socket
}

/// Everything the router writes until it closes the connection (or a complete response has
/// arrived when `until` is found in it); panics past the test patience.
async fn read_until_closed(socket: &mut TcpStream) -> String {
    let mut out = Vec::new();
    let read = tokio::time::timeout(patience(), socket.read_to_end(&mut out)).await;
    assert!(
        read.is_ok(),
        "the router kept the connection open; it sent {:?}",
        String::from_utf8_lossy(&out)
    );
    String::from_utf8_lossy(&out).into_owned()
}

/// Reads until the response head and `needle` have arrived.
async fn read_response(socket: &mut TcpStream, needle: &str) -> String {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = Instant::now() + patience();
    while !String::from_utf8_lossy(&out).contains(needle) {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, socket.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
            Err(_) => panic!(
                "no {needle:?} in time; got {:?}",
                String::from_utf8_lossy(&out)
            ),
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Reads one response with a `Content-Length` body (and nothing after it): its head and body.
async fn read_one_response(socket: &mut TcpStream) -> (String, String) {
    let answer = read_response(socket, "\r\n\r\n").await;
    let (head, body) = answer.split_once("\r\n\r\n").unwrap();
    let length: usize = head
        .lines()
        .find_map(|line| {
            let (name, value) = line.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse().unwrap())
        })
        .unwrap_or_else(|| panic!("no content-length: {head}"));
    let mut body = body.as_bytes().to_vec();
    let mut rest = vec![0u8; length.saturating_sub(body.len())];
    tokio::time::timeout(patience(), socket.read_exact(&mut rest))
        .await
        .expect("the body in time")
        .unwrap();
    body.extend_from_slice(&rest);
    (head.to_owned(), String::from_utf8(body).unwrap())
}

async fn completion(client: &reqwest::Client, router: &RunningRouter, body: Value) -> (u16, Value) {
    let resp = client
        .post(format!("http://{}/v1/completions", router.addr))
        .json(&body)
        .send()
        .await
        .unwrap();
    (
        resp.status().as_u16(),
        resp.json().await.unwrap_or(Value::Null),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_allowlisted_openai_paths_reach_an_engine() {
    let (_engine, router) = engine_and_router(|_| {}).await;
    for (method, path) in [
        ("POST", "/v1/load_lora_adapter"),
        ("POST", "/v1/../sim/restart"),
        ("POST", "/v1/%2e%2e/sim/restart"),
        ("GET", "/v1/../metrics"),
        ("POST", "/kvroute/v1/explain"),
        ("GET", "/metrics"),
    ] {
        let request = format!(
            "{method} {path} HTTP/1.1\r\nhost: kvroute\r\ncontent-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{{}}"
        );
        let mut socket = send_raw(router.addr, request.as_bytes()).await;
        let answer = read_until_closed(&mut socket).await;
        let (head, body) = answer.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 404"), "{method} {path}: {head}");
        assert!(
            !head.to_ascii_lowercase().contains("x-kvroute-endpoint"),
            "{method} {path} reached an engine: {head}"
        );
        let error: Value = serde_json::from_str(body).unwrap();
        assert_eq!(error["error"]["type"], "NotFoundError", "{body}");
    }
    // Allowlisted paths are forwarded (the simulator has no embeddings: its 404 comes back
    // through the router, with the endpoint that answered).
    let resp = reqwest::Client::new()
        .post(format!("http://{}/v1/./embeddings", router.addr))
        .json(&json!({"model": MODEL, "input": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers()["x-kvroute-endpoint"], "e0");
    let resp = reqwest::Client::new()
        .get(format!("http://{}/v1/embeddings", router.addr))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 405);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declared_oversized_body_gets_413_before_any_body_byte() {
    let (_engine, router) = engine_and_router(|c| c.limits.max_body_bytes = 1000).await;
    let mut socket = send_raw(
        router.addr,
        b"POST /v1/completions HTTP/1.1\r\nhost: kvroute\r\ncontent-type: application/json\r\ncontent-length: 100000000\r\n\r\n",
    )
    .await;
    let answer = read_until_closed(&mut socket).await;
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("RequestTooLargeError"), "{answer}");
    let (head, _) = answer.split_once("\r\n\r\n").unwrap();
    assert!(
        head.to_ascii_lowercase().contains("connection: close"),
        "the body is never read, so the connection cannot be reused: {head}"
    );
}

/// A body refused part way (past the limit, with no length declared) leaves its rest unread on
/// the connection: the answer says `Connection: close` and the router closes it, so a client
/// that keeps connections alive does not send its next request there. A body read to its end
/// keeps the connection open, whatever the answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_before_the_body_is_read_closes_the_connection_and_says_so() {
    let (_engine, router) = engine_and_router(|c| c.limits.max_body_bytes = 1000).await;
    let chunk = "x".repeat(4000);
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: kvroute\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n{:x}\r\n{chunk}\r\n",
        chunk.len()
    );
    let mut socket = send_raw(router.addr, request.as_bytes()).await;
    let answer = read_until_closed(&mut socket).await;
    let (head, _) = answer.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 413"), "{head}");
    assert!(
        head.to_ascii_lowercase().contains("connection: close"),
        "{head}"
    );
    // A body read to its end and refused (not JSON) leaves the connection open: a second
    // request on it is answered.
    let bad = "POST /v1/completions HTTP/1.1\r\nhost: kvroute\r\ncontent-type: application/json\r\ncontent-length: 3\r\n\r\n{{{";
    let mut socket = send_raw(router.addr, bad.as_bytes()).await;
    let (first, _) = read_one_response(&mut socket).await;
    assert!(first.starts_with("HTTP/1.1 400"), "{first}");
    assert!(
        !first.to_ascii_lowercase().contains("connection: close"),
        "{first}"
    );
    socket.write_all(bad.as_bytes()).await.unwrap();
    let (second, _) = read_one_response(&mut socket).await;
    assert!(second.starts_with("HTTP/1.1 400"), "{second}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_are_cut_off_while_others_are_served() {
    let (_engine, router) = engine_and_router(|c| {
        c.limits.header_timeout_ms = 400;
        c.limits.body_timeout_ms = 400;
    })
    .await;
    let client = reqwest::Client::new();
    let started = Instant::now();
    // Partial headers, never finished.
    let mut slow_head = send_raw(
        router.addr,
        b"POST /v1/completions HTTP/1.1\r\nhost: kvroute\r\nx-slow: 1\r\n",
    )
    .await;
    // A chunked body that never ends.
    let mut slow_body = send_raw(
        router.addr,
        b"POST /v1/completions HTTP/1.1\r\nhost: kvroute\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n5\r\n{\"mod\r\n",
    )
    .await;
    let served = async {
        let mut n = 0;
        while started.elapsed() < Duration::from_millis(600) || n < 3 {
            let (status, body) = completion(
                &client,
                &router,
                json!({"model": MODEL, "prompt": "hello", "max_tokens": 2}),
            )
            .await;
            assert_eq!(status, 200, "{body}");
            n += 1;
        }
        n
    };
    let (served, head_answer, body_answer) = tokio::join!(
        served,
        read_until_closed(&mut slow_head),
        read_response(&mut slow_body, "}")
    );
    assert!(served >= 3);
    assert_eq!(
        head_answer, "",
        "a partial head gets no answer, only a close"
    );
    assert!(body_answer.starts_with("HTTP/1.1 408"), "{body_answer}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "cut off late: {:?}",
        started.elapsed()
    );
    let text = http_get(router.admin_addr, "/metrics");
    assert_eq!(
        sample(&text, "kvroute_client_timeouts_total{kind=\"header\"}"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, "kvroute_rejected_total{status=\"408\"}"),
        Some(1.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_limit_are_refused_and_idle_ones_closed() {
    let (_engine, router) = engine_and_router(|c| {
        c.limits.max_connections = 2;
        c.limits.idle_timeout_ms = 1000;
    })
    .await;
    let started = Instant::now();
    let mut first = TcpStream::connect(router.addr).await.unwrap();
    let mut second = TcpStream::connect(router.addr).await.unwrap();
    let client = reqwest::Client::new();
    eventually("both connections are open", || {
        let text = http_get(router.admin_addr, "/metrics");
        let open = sample(&text, "kvroute_connections_open{listener=\"api\"}");
        (open == Some(2.0), open)
    })
    .await;
    let mut third = TcpStream::connect(router.addr).await.unwrap();
    assert_eq!(read_until_closed(&mut third).await, "", "refused at once");
    // Idle connections are closed after the idle timeout, freeing their slots.
    assert_eq!(read_until_closed(&mut first).await, "");
    assert_eq!(read_until_closed(&mut second).await, "");
    assert!(started.elapsed() < Duration::from_secs(5));
    let text = http_get(router.admin_addr, "/metrics");
    assert_eq!(
        sample(&text, "kvroute_connections_refused_total{listener=\"api\"}"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, "kvroute_client_timeouts_total{kind=\"idle\"}"),
        Some(2.0),
        "{text}"
    );
    let (status, _) = completion(
        &client,
        &router,
        json!({"model": MODEL, "prompt": "hello", "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, 200);
}

/// Counts a stream's end when dropped (the engine stops sending it).
struct Ended(Arc<AtomicUsize>);

impl Drop for Ended {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// A client speaking HTTP/2 with prior knowledge (h2c), as a gateway does.
fn h2c_client() -> reqwest::Client {
    reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap()
}

/// A streamed completion that, on [`endless_stream_engine`], never ends by itself.
fn endless_request() -> Value {
    json!({"model": MODEL, "prompt": "hello", "max_tokens": 1_000_000, "stream": true})
}

/// An engine whose completions stream an 8 KiB event every millisecond, without end, counting in
/// `ended` the streams it stopped sending because their reader went away. Returns its URL.
async fn endless_stream_engine(ended: Arc<AtomicUsize>) -> String {
    let completion = move || {
        let ended = Ended(ended.clone());
        async move {
            let event = bytes::Bytes::from(format!(
                "data: {{\"choices\": [{{\"text\": \"{}\"}}]}}\n\n",
                "x".repeat(8000)
            ));
            let events = futures::stream::unfold((ended, event), |(ended, event)| async move {
                tokio::time::sleep(Duration::from_millis(1)).await;
                Some((Ok::<_, std::io::Error>(event.clone()), (ended, event)))
            });
            axum::response::Response::builder()
                .header("content-type", "text/event-stream")
                .body(axum::body::Body::from_stream(events))
                .unwrap()
        }
    };
    let routes = axum::Router::new().route("/v1/completions", axum::routing::post(completion));
    common::fake_engine(routes).await
}

/// Waits until the one endless stream's engine request ended, its endpoint's load is released,
/// and the router counted one client timeout of `kind` (`write`: the connection closed;
/// `unread`: the stream given up).
async fn engine_freed(router: &RunningRouter, ended: &AtomicUsize, kind: &str) {
    let series = format!("kvroute_client_timeouts_total{{kind=\"{kind}\"}}");
    eventually(
        "the router gives the stalled client up and frees its engine",
        || {
            let text = http_get(router.admin_addr, "/metrics");
            let inflight = sample(&text, "kvroute_endpoint_inflight{endpoint=\"e0\"}");
            let counted = sample(&text, &series);
            let ended = ended.load(Ordering::SeqCst);
            (
                ended == 1 && inflight == Some(0.0) && counted == Some(1.0),
                (ended, inflight, counted),
            )
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_a_stream_is_cut_off_and_its_engine_freed() {
    let ended = Arc::new(AtomicUsize::new(0));
    let engine = endless_stream_engine(ended.clone()).await;
    let router = router_with(&engine, |c| c.limits.write_timeout_ms = 500).await;
    // A client with a small receive buffer reads the response head, then stops reading and
    // keeps its connection open.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut client = socket.connect(router.addr).await.unwrap();
    let body = json!({"model": MODEL, "prompt": "hello", "max_tokens": 1_000_000, "stream": true})
        .to_string();
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: kvroute\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    client.write_all(request.as_bytes()).await.unwrap();
    let head = read_response(&mut client, "\r\n\r\n").await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    // The engine's stream ends, the request's load is released, and the cut is counted.
    engine_freed(&router, &ended, "write").await;
    // The connection was closed: what the client had not read, then the end.
    read_until_closed(&mut client).await;
}

/// An HTTP/2 connection carries many requests, each of which may hold an engine connection:
/// past `limits.max_connections` requests in progress at once, the next is answered 503 at
/// once rather than opening engine connections past what the descriptor limit was sized for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_streams_past_the_connection_limit_are_refused() {
    let ended = Arc::new(AtomicUsize::new(0));
    let engine = endless_stream_engine(ended.clone()).await;
    let router = router_with(&engine, |c| c.limits.max_connections = 2).await;
    let client = h2c_client();
    let url = format!("http://{}/v1/completions", router.addr);
    let body = endless_request();
    let mut open = Vec::new();
    for _ in 0..2 {
        let response = client.post(&url).json(&body).send().await.unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(response.version(), reqwest::Version::HTTP_2);
        open.push(response);
    }
    let third = client.post(&url).json(&body).send().await.unwrap();
    assert_eq!(third.status(), 503);
    // One ends: its place is free again.
    drop(open.pop());
    eventually("a place is free again", || {
        let text = http_get(router.admin_addr, "/metrics");
        let inflight = sample(&text, "kvroute_endpoint_inflight{endpoint=\"e0\"}");
        (inflight == Some(1.0), inflight)
    })
    .await;
    let again = client.post(&url).json(&body).send().await.unwrap();
    assert_eq!(again.status(), 200);
    drop((open, again));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_stream_its_client_stops_reading_is_given_up_and_its_engine_freed() {
    let ended = Arc::new(AtomicUsize::new(0));
    let engine = endless_stream_engine(ended.clone()).await;
    let router = router_with(&engine, |c| c.limits.write_timeout_ms = 500).await;
    let client = h2c_client();
    let body = endless_request();
    let response = client
        .post(format!("http://{}/v1/completions", router.addr))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.version(), reqwest::Version::HTTP_2);
    // The client keeps the stream open and reads none of it: its flow-control window fills,
    // while the connection's socket stays free (no write waits on it).
    engine_freed(&router, &ended, "unread").await;
    // A client that reads on gets what was sent, then an error event as the last: never a
    // stream that seems to have ended as it should.
    let mut response = response;
    let mut tail = Vec::new();
    while let Some(chunk) = response.chunk().await.unwrap() {
        tail = chunk.to_vec();
    }
    let last = String::from_utf8_lossy(&tail);
    assert!(
        kvroute_vllm::openai::is_stream_error_event(&tail) && last.contains("given up"),
        "the stream's last chunk: {last}"
    );
}

/// The router's buffered request bytes now, on the API listener (`kvroute_buffered_bytes`) or
/// the admin listener (`kvroute_admin_buffered_bytes`).
fn buffered(router: &RunningRouter, gauge: &str) -> Option<f64> {
    sample(&http_get(router.admin_addr, "/metrics"), gauge)
}

/// A request that declares 2000 body bytes and sends 1900 of them, then stalls.
const HOLDER: &[u8] = b"POST /v1/completions HTTP/1.1\r\nhost: kvroute\r\ncontent-type: application/json\r\ncontent-length: 2000\r\n\r\n";

async fn send_holder(addr: std::net::SocketAddr) -> TcpStream {
    let mut bytes = HOLDER.to_vec();
    bytes.extend_from_slice(&[b' '; 1900]);
    send_raw(addr, &bytes).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_bodies_share_one_byte_budget() {
    let (_engine, router) = engine_and_router(|c| {
        c.limits.max_body_bytes = 2000;
        c.limits.max_buffered_bytes = 3000;
        c.limits.body_timeout_ms = 500;
    })
    .await;
    // Holds the 1900 bytes it sent while it stalls.
    let mut holder = send_holder(router.addr).await;
    eventually("the first body is held", || {
        let held = buffered(&router, "kvroute_buffered_bytes");
        (held == Some(1900.0), held)
    })
    .await;
    let body = json!({"model": MODEL, "prompt": "x".repeat(1500), "max_tokens": 1});
    let client = reqwest::Client::new();
    let (status, answer) = completion(&client, &router, body.clone()).await;
    assert_eq!(status, 503, "{answer}");
    // The holder is cut off; its bytes come back and the same request goes through.
    assert!(
        read_response(&mut holder, "}")
            .await
            .starts_with("HTTP/1.1 408")
    );
    eventually("the budget is free", || {
        let held = buffered(&router, "kvroute_buffered_bytes");
        (held == Some(0.0), held)
    })
    .await;
    let (status, answer) = completion(&client, &router, body).await;
    assert_eq!(status, 200, "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declared_lengths_cost_nothing_until_their_bytes_arrive() {
    let (_engine, router) = engine_and_router(|c| {
        c.limits.max_body_bytes = 2000;
        c.limits.max_buffered_bytes = 3000;
        c.limits.body_timeout_ms = 60000;
    })
    .await;
    // Over HTTP/1.1: 20 connections that declare 2000 bytes each (13 times the budget) and send
    // one.
    let mut promises = Vec::new();
    for _ in 0..20 {
        let mut bytes = HOLDER.to_vec();
        bytes.push(b' ');
        promises.push(send_raw(router.addr, &bytes).await);
    }
    // Over h2c: one connection, 20 streams that declare as much and send one byte.
    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let mut streams = Vec::new();
    for _ in 0..20 {
        let one_byte = futures::stream::once(async { Ok::<_, std::io::Error>(vec![b' ']) })
            .chain(futures::stream::pending());
        let request = h2
            .post(format!("http://{}/v1/completions", router.addr))
            .header("content-type", "application/json")
            .header("content-length", "2000")
            .body(reqwest::Body::wrap_stream(one_byte));
        streams.push(tokio::spawn(request.send()));
    }
    eventually("every promise holds the one byte it sent", || {
        let held = buffered(&router, "kvroute_buffered_bytes");
        (held == Some(40.0), held)
    })
    .await;
    let client = reqwest::Client::new();
    let body = json!({"model": MODEL, "prompt": "x".repeat(1500), "max_tokens": 1});
    for _ in 0..3 {
        let (status, answer) = completion(&client, &router, body.clone()).await;
        assert_eq!(status, 200, "{answer}");
    }
    assert_eq!(buffered(&router, "kvroute_buffered_bytes"), Some(40.0));
    drop(promises);
    for s in streams {
        s.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_listener_has_its_own_byte_budget() {
    let (_engine, router) = engine_and_router(|c| {
        c.limits.max_body_bytes = 2000;
        c.limits.max_buffered_bytes = 2000;
        c.limits.body_timeout_ms = 60000;
    })
    .await;
    let _holder = send_holder(router.addr).await;
    eventually("the API budget is nearly spent", || {
        let held = buffered(&router, "kvroute_buffered_bytes");
        (held >= Some(1900.0), held)
    })
    .await;
    let resp = reqwest::Client::new()
        .post(format!("http://{}/kvroute/v1/explain", router.admin_addr))
        .json(&json!({"model": MODEL, "prompt": "x".repeat(1500)}))
        .send()
        .await
        .unwrap();
    assert_eq!(
        resp.status().as_u16(),
        200,
        "{}",
        resp.text().await.unwrap()
    );
    assert_eq!(buffered(&router, "kvroute_admin_buffered_bytes"), Some(0.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_and_explain_live_on_the_admin_listener_behind_its_token() {
    let (_engine, router) = engine_and_router(|c| c.admin.token = Some("s3cret".into())).await;
    let client = reqwest::Client::new();
    let admin = |path: &str| format!("http://{}{path}", router.admin_addr);
    let resp = client.get(admin("/metrics")).send().await.unwrap();
    assert_eq!(resp.status().as_u16(), 401);
    assert_eq!(resp.headers()["www-authenticate"], "Bearer");
    let resp = client
        .get(admin("/metrics"))
        .bearer_auth("wrong")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 401);
    let resp = client
        .get(admin("/metrics"))
        .bearer_auth("s3cret")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let text = resp.text().await.unwrap();
    assert!(text.contains("kvroute_token_cache_bytes"), "{text}");
    let resp = client
        .post(admin("/kvroute/v1/explain"))
        .bearer_auth("s3cret")
        .json(&json!({"model": MODEL, "prompt": "hello"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let explained: Value = resp.json().await.unwrap();
    assert_eq!(explained["chosen"], "e0");
    let resp = client.get(admin("/health")).send().await.unwrap();
    assert_eq!(resp.status().as_u16(), 200, "health needs no token");
    for path in ["/metrics", "/kvroute/v1/explain"] {
        let resp = client
            .post(format!("http://{}{path}", router.addr))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 404, "{path} on the API listener");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_vllm_accepts_are_routed_in_every_shape() {
    let (_engine, router) = engine_and_router(|_| {}).await;
    let client = reqwest::Client::new();
    let completions = [
        r#"{"model":"M","prompt":["first prompt","second prompt"],"max_tokens":2}"#,
        r#"{"model":"M","prompt":[[1,2,3],[4,5]],"max_tokens":2}"#,
        r#"{"model":"M","prompt":"lone \ud800 surrogate","max_tokens":2}"#,
    ];
    for body in completions {
        let resp = client
            .post(format!("http://{}/v1/completions", router.addr))
            .header("content-type", "application/json")
            .body(body.replace('M', MODEL))
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        assert_eq!(status, 200, "{body}: {}", resp.text().await.unwrap());
    }
    let chat = json!({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        {"type": "text", "text": "what is in this image?"}
    ]}]});
    let resp = client
        .post(format!("http://{}/v1/chat/completions", router.addr))
        .json(&chat)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    assert_eq!(status, 200, "{}", resp.text().await.unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_token_cache_stays_within_its_byte_budget() {
    let (_engine, router) = engine_and_router(|c| c.limits.token_cache_bytes = 1_000_000).await;
    let client = reqwest::Client::new();
    for i in 0..12 {
        // About 160 KB of tokens each: 2 MB offered to a 1 MB cache.
        let prompt = format!("p{i} {}", "word ".repeat(20_000));
        let resp = client
            .post(format!("http://{}/kvroute/v1/explain", router.admin_addr))
            .json(&json!({"model": MODEL, "prompt": prompt}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 200);
        let text = http_get(router.admin_addr, "/metrics");
        let held = sample(&text, "kvroute_token_cache_bytes").unwrap();
        assert!(held > 0.0 && held <= 1_000_000.0, "{held} bytes after {i}");
    }
}

/// An engine that answers each completion with the request headers it received, as
/// `[[name, value], ...]`. Returns its URL.
async fn header_echo_engine() -> String {
    let echo = |headers: axum::http::HeaderMap| async move {
        let pairs: Vec<(String, String)> = headers
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_str().unwrap_or_default().to_owned()))
            .collect();
        axum::Json(json!(pairs))
    };
    let routes = axum::Router::new().route("/v1/completions", axum::routing::post(echo));
    common::fake_engine(routes).await
}

/// The values of header `name` the echo engine received.
fn echoed(answer: &str, name: &str) -> Vec<String> {
    let (_, body) = answer.split_once("\r\n\r\n").unwrap();
    let pairs: Vec<(String, String)> = serde_json::from_str(body.trim())
        .or_else(|_| {
            // A chunked body: the JSON is the one line that starts with `[`.
            let line = body
                .lines()
                .find(|l| l.starts_with('['))
                .unwrap_or_default();
            serde_json::from_str(line)
        })
        .unwrap_or_else(|e| panic!("{e}: {answer}"));
    pairs
        .into_iter()
        .filter(|(n, _)| n == name)
        .map(|(_, v)| v)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_are_forwarded_as_rfc_9110_says() {
    let engine = header_echo_engine().await;
    let body = format!(r#"{{"model": "{MODEL}", "prompt": "hello", "max_tokens": 1}}"#);
    let request = |extra: &str| {
        format!(
            "POST /v1/completions HTTP/1.1\r\nhost: kvroute\r\ncontent-type: application/json\r\ncontent-length: {}\r\n{extra}\r\n{body}",
            body.len()
        )
    };
    let hostile = "x-request-id: abc\r\nconnection: close, x-secret\r\nx-secret: 1\r\nhttp2-settings: AAMAAABkAAQAAP__\r\nx-forwarded-for: 203.0.113.9\r\nforwarded: for=203.0.113.9\r\n";
    for (trusts_loopback, xff) in [(false, "127.0.0.1"), (true, "203.0.113.9, 127.0.0.1")] {
        let router = router_with(&engine, |c| {
            if trusts_loopback {
                c.forwarding.trusted_proxies =
                    vec![Network::try_from("127.0.0.0/8".to_owned()).unwrap()];
            }
        })
        .await;
        let mut socket = send_raw(router.addr, request(hostile).as_bytes()).await;
        let answer = read_until_closed(&mut socket).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert_eq!(echoed(&answer, "x-request-id"), ["abc"], "sent once");
        assert!(
            echoed(&answer, "x-secret").is_empty(),
            "named by Connection"
        );
        assert!(echoed(&answer, "http2-settings").is_empty());
        assert_eq!(
            echoed(&answer, "x-forwarded-for"),
            [xff],
            "trusts loopback: {trusts_loopback}"
        );
        let forwarded = echoed(&answer, "forwarded");
        assert_eq!(forwarded.len(), 1);
        assert!(forwarded[0].ends_with("for=127.0.0.1"), "{forwarded:?}");
        assert_eq!(
            forwarded[0].contains("203.0.113.9"),
            trusts_loopback,
            "{forwarded:?}"
        );
    }
    // Two Host headers: refused before any engine sees the request.
    let router = router_with(&engine, |_| {}).await;
    let mut socket = send_raw(
        router.addr,
        request("host: elsewhere\r\nconnection: close\r\n").as_bytes(),
    )
    .await;
    let answer = read_until_closed(&mut socket).await;
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
}
