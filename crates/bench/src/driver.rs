//! The load driver: runs a workload's sessions against an OpenAI-compatible base URL, streaming
//! every answer to time its first token and the gaps between tokens.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{Value, json};
use tokio::sync::Semaphore;

use crate::result::RequestRecord;
use crate::workload::{Api, Content, Session, Workload};

/// How to drive a workload.
#[derive(Clone, Debug)]
pub struct DriverConfig {
    /// Base URL of the OpenAI API, e.g. `http://127.0.0.1:8000/v1`.
    pub base_url: String,
    /// Model name to send.
    pub model: String,
    /// `Some(n)`: closed loop, at most n sessions at once, started as soon as one ends;
    /// `None`: open loop, sessions start at their arrival times.
    pub concurrency: Option<usize>,
    /// Per-request timeout.
    pub timeout: Duration,
    /// Show a progress bar.
    pub progress: bool,
}

/// Runs the workload; returns every request's record (in start order) and the wall time.
pub async fn run(workload: &Workload, config: &DriverConfig) -> (Vec<RequestRecord>, f64) {
    let client = reqwest::Client::builder()
        .timeout(config.timeout)
        .pool_max_idle_per_host(256)
        .build()
        .expect("a plain HTTP client builds");
    let bar = if config.progress {
        let bar = ProgressBar::new(workload.requests() as u64);
        bar.set_style(
            ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} done  {msg}",
            )
            .expect("static template"),
        );
        bar
    } else {
        ProgressBar::hidden()
    };
    let counters = Arc::new(Counters::default());
    let started = Instant::now();
    let gate = config
        .concurrency
        .map(|n| Arc::new(Semaphore::new(n.max(1))));
    let mut tasks = Vec::with_capacity(workload.sessions.len());
    for session in workload.sessions.clone() {
        let client = client.clone();
        let config = config.clone();
        let gate = gate.clone();
        let bar = bar.clone();
        let counters = counters.clone();
        let api = workload.api;
        tasks.push(tokio::spawn(async move {
            let _permit = match &gate {
                Some(g) => Some(g.clone().acquire_owned().await.expect("never closed")),
                None => {
                    tokio::time::sleep_until(
                        tokio::time::Instant::from_std(started)
                            + Duration::from_secs_f64(session.start_s),
                    )
                    .await;
                    None
                }
            };
            run_session(&client, &config, api, &session, started, &bar, &counters).await
        }));
    }
    let mut records = Vec::with_capacity(workload.requests());
    for task in tasks {
        if let Ok(mut r) = task.await {
            records.append(&mut r);
        }
    }
    bar.finish_and_clear();
    records.sort_by(|a, b| a.start_s.total_cmp(&b.start_s));
    (records, started.elapsed().as_secs_f64())
}

#[derive(Default)]
struct Counters {
    sent: AtomicU64,
    done: AtomicU64,
    errors: AtomicU64,
}

async fn run_session(
    client: &reqwest::Client,
    config: &DriverConfig,
    api: Api,
    session: &Session,
    started: Instant,
    bar: &ProgressBar,
    counters: &Counters,
) -> Vec<RequestRecord> {
    let mut messages: Vec<Value> = Vec::new();
    if let Some(system) = &session.system {
        messages.push(json!({"role": "system", "content": system}));
    }
    let mut records = Vec::new();
    for (turn, spec) in session.turns.iter().enumerate() {
        if spec.think_s > 0.0 {
            tokio::time::sleep(Duration::from_secs_f64(spec.think_s)).await;
        }
        let (url, body) = match (api, &spec.content) {
            (Api::Chat, content) => {
                messages.push(json!({"role": "user", "content": content.chat_text()}));
                (
                    format!("{}/chat/completions", config.base_url),
                    json!({"model": config.model, "messages": messages, "max_tokens": spec.max_tokens,
                        "stream": true, "stream_options": {"include_usage": true}}),
                )
            }
            (Api::Completions, content) => {
                let prompt = match content {
                    Content::Text(t) => json!(t),
                    Content::Tokens(t) => json!(t),
                };
                (
                    format!("{}/completions", config.base_url),
                    json!({"model": config.model, "prompt": prompt, "max_tokens": spec.max_tokens,
                        "stream": true, "stream_options": {"include_usage": true}}),
                )
            }
        };
        counters.sent.fetch_add(1, Ordering::Relaxed);
        let (record, answer) = send(client, &url, &body, session.id, turn as u32, started).await;
        counters.done.fetch_add(1, Ordering::Relaxed);
        if record.error.is_some() {
            counters.errors.fetch_add(1, Ordering::Relaxed);
        }
        bar.inc(1);
        let elapsed = started.elapsed().as_secs_f64().max(1e-9);
        bar.set_message(format!(
            "sent {}  {:.1} req/s  errors {}",
            counters.sent.load(Ordering::Relaxed),
            counters.done.load(Ordering::Relaxed) as f64 / elapsed,
            counters.errors.load(Ordering::Relaxed)
        ));
        let failed = record.error.is_some();
        let failed_at = record.start_s + record.e2e_s;
        records.push(record);
        if failed {
            // A conversation whose turn failed cannot go on faithfully; its later turns count
            // as failed too.
            let unsent = turn + 1..session.turns.len();
            bar.inc(unsent.len() as u64);
            records
                .extend(unsent.map(|t| RequestRecord::not_sent(session.id, t as u32, failed_at)));
            break;
        }
        if api == Api::Chat {
            messages.push(json!({"role": "assistant", "content": answer}));
        }
    }
    records
}

/// Sends one streaming request and times it. Returns the record and the answer's text.
async fn send(
    client: &reqwest::Client,
    url: &str,
    body: &Value,
    session: u64,
    turn: u32,
    started: Instant,
) -> (RequestRecord, String) {
    let sent = Instant::now();
    let mut record = RequestRecord {
        session,
        turn,
        start_s: sent.duration_since(started).as_secs_f64(),
        ..RequestRecord::default()
    };
    let response = match client.post(url).json(body).send().await {
        Ok(r) => r,
        Err(e) => {
            record.error = Some(format!("request failed: {}", with_causes(&e)));
            record.e2e_s = sent.elapsed().as_secs_f64();
            return (record, String::new());
        }
    };
    record.endpoint = response
        .headers()
        .get("x-kvroute-endpoint")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let status = response.status();
    if !status.is_success() {
        let text = response.text().await.unwrap_or_default();
        record.error = Some(format!(
            "HTTP {}: {}",
            status.as_u16(),
            text.chars().take(200).collect::<String>()
        ));
        record.e2e_s = sent.elapsed().as_secs_f64();
        return (record, String::new());
    }
    let mut answer = String::new();
    let mut buffer = String::new();
    let mut last_token: Option<Instant> = None;
    let mut chunks = 0u64;
    let mut stream = response.bytes_stream();
    while let Some(piece) = stream.next().await {
        let piece = match piece {
            Ok(p) => p,
            Err(e) => {
                record.error = Some(format!("stream broken: {e}"));
                break;
            }
        };
        buffer.push_str(&String::from_utf8_lossy(&piece));
        while let Some(end) = buffer.find("\n\n") {
            let event: String = buffer.drain(..end + 2).collect();
            let Some(data) = event.trim().strip_prefix("data:").map(str::trim) else {
                continue;
            };
            if data == "[DONE]" {
                continue;
            }
            let Ok(value) = serde_json::from_str::<Value>(data) else {
                continue;
            };
            if let Some(error) = value.get("error") {
                record.error = Some(format!("engine error: {error}"));
                continue;
            }
            if let Some(usage) = value.get("usage").filter(|u| !u.is_null()) {
                record.prompt_tokens = usage["prompt_tokens"].as_u64().unwrap_or(0);
                record.completion_tokens = usage["completion_tokens"].as_u64().unwrap_or(chunks);
                record.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"].as_u64();
            }
            // Empty text is no token: vLLM's chat stream opens with the role and empty content,
            // just before the first token's chunk (as vLLM's own benchmark, it is skipped).
            let text = value["choices"][0]["delta"]["content"]
                .as_str()
                .or_else(|| value["choices"][0]["text"].as_str())
                .filter(|t| !t.is_empty());
            if let Some(text) = text {
                let now = Instant::now();
                match last_token {
                    None => record.ttft_s = Some(now.duration_since(sent).as_secs_f64()),
                    Some(prev) => record.itl_s.push(now.duration_since(prev).as_secs_f64()),
                }
                last_token = Some(now);
                chunks += 1;
                answer.push_str(text);
            }
        }
    }
    if record.completion_tokens == 0 {
        record.completion_tokens = chunks;
    }
    if record.ttft_s.is_none() && record.error.is_none() {
        record.error = Some("no token received".into());
    }
    record.e2e_s = sent.elapsed().as_secs_f64();
    (record, answer)
}

/// `error` and the errors under it, outermost first (an HTTP client's own message omits why a
/// connection failed: "refused" is its source's).
fn with_causes(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
