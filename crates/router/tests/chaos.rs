//! Chaos at a small size, in process over loopback: three simulated engines and a router under
//! a bounded load of four conversational clients while an engine restarts, one engine loses
//! 10% of its event batches in transit, one is three times slower, and the router itself is
//! drained and started again on the same configuration, while a header flood sends request
//! heads over the limit all along, and a fourth endpoint's KV-event address is a hostile
//! publisher declaring frames of 2^62 bytes and 8 GiB. `KVROUTE_CHAOS_SECONDS` sets the length
//! (12 s by default; docs/operations.md has the 30-minute soak recipe).

// Measures real processes and sockets: wall-clock time, not the router's (tokio) clock.
#![allow(clippy::disallowed_methods)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvroute_core::index::EndpointId;
use kvroute_router::server::RunningRouter;
use kvroute_sim::engine::EngineConfig;
use kvroute_sim::server::{SimConfig, SimFleet, start as start_sim};
use kvroute_testkit::hostile::HostilePublisher;
use kvroute_testkit::{eventually, sample};
use serde_json::{Value, json};

mod common;

use common::config_builder::{ConfigBuilder, endpoint};
use common::fleet_view::forgotten_at;
use common::{fault, router_from_config};

const MODEL: &str = "sim-llama-3.1-8b";
const CLIENTS: usize = 4;
/// A client's pause between turns (a person reading and typing), which also lets an answer's
/// KV events land before the next turn is planned.
const THINK: Duration = Duration::from_millis(50);

/// The router's configuration: small bounds, so that its memory budget is small too.
fn config(fleet: &SimFleet) -> ConfigBuilder {
    ConfigBuilder::new(MODEL)
        .health(100, 500)
        .scrape(100)
        .with(|c| {
            c.cache.index_capacity = 65_536;
            c.cache.history_capacity = 65_536;
            c.limits.token_cache_bytes = 16_777_216;
            c.limits.max_buffered_bytes = 16_777_216;
            c.limits.max_body_bytes = 1_048_576;
            c.limits.max_connections = 256;
        })
        .engine_endpoints(&fleet.endpoints)
}

/// A fourth endpoint: a real engine for its HTTP, a hostile publisher for its KV events.
struct HostileEndpoint {
    engine: SimFleet,
    publisher: HostilePublisher,
}

impl HostileEndpoint {
    async fn start() -> Self {
        Self {
            engine: common::engine().await,
            // Holds each connection a second before attacking, so the router's subscriber
            // reports itself connected for a while (the router's start waits for that).
            publisher: HostilePublisher::start(
                kvroute_vllm::zmtp::DEFAULT_MAX_MESSAGE_BYTES,
                Duration::from_secs(1),
            ),
        }
    }

    /// `config` with this endpoint, `e3`, added.
    fn add_to(&self, config: ConfigBuilder) -> ConfigBuilder {
        let mut e3 = endpoint(Some("e3".into()), &self.engine.endpoints[0].url);
        e3.events = Some(self.publisher.address().to_string());
        config.endpoint(e3)
    }

    /// Checks that the publisher attacked and that `router` counted it.
    fn assert_attacks_counted(&self, router: &RunningRouter) {
        assert!(
            self.publisher.connections() >= 2,
            "the hostile publisher was reconnected to"
        );
        let metrics = kvroute_testkit::http_get(router.admin_addr, "/metrics");
        let oversized = sample(
            &metrics,
            "kvroute_kv_events{endpoint=\"e3\",kind=\"oversized_messages\"}",
        );
        assert!(oversized.is_some_and(|n| n >= 1.0), "{metrics}");
    }
}

/// The memory budget of docs/operations.md for that configuration, in bytes, loosely: the
/// index term is charged 120 B per entry, well above the 32–48 B operations.md gives now.
fn memory_budget() -> u64 {
    let mib = 1u64 << 20;
    50 * mib
        + 65_536 * 120
        + (65_536 + (1 << 20)) * 64
        + 100_000 * 100
        + 16 * mib
        + 4 * 16 * mib
        + 2 * 256 * 400 * 1024
}

/// The router's prediction outcomes, summed over endpoints.
#[derive(Debug, Default)]
struct Predictions {
    exact: f64,
    over: f64,
    under: f64,
}

impl Predictions {
    fn read(router: &RunningRouter) -> Self {
        let metrics = kvroute_testkit::http_get(router.admin_addr, "/metrics");
        let sum = |outcome: &str| -> f64 {
            (0..3)
                .filter_map(|i| {
                    let series = format!(
                        "kvroute_prediction_outcomes_total{{endpoint=\"e{i}\",outcome=\"{outcome}\"}}"
                    );
                    sample(&metrics, &series)
                })
                .sum()
        };
        Self {
            exact: sum("exact"),
            over: sum("over"),
            under: sum("under"),
        }
    }

    fn since(&self, before: &Self) -> Self {
        Self {
            exact: self.exact - before.exact,
            over: self.over - before.over,
            under: self.under - before.under,
        }
    }

    fn total(&self) -> f64 {
        self.exact + self.over + self.under
    }
}

/// What one client saw.
#[derive(Debug, Default)]
struct Tally {
    ok: usize,
    failed: Vec<String>,
}

/// A client: conversations of growing turns, one request at a time, until `stop`. It waits
/// while `paused` (the router restarting), and sends again a request that failed to connect
/// or failed while the router was restarting.
async fn client_loop(
    addr: std::net::SocketAddr,
    seed: usize,
    stop: Arc<AtomicBool>,
    paused: Arc<AtomicBool>,
) -> Tally {
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let mut tally = Tally::default();
    let mut conversation = 0;
    while !stop.load(Ordering::Relaxed) {
        conversation += 1;
        let mut messages: Vec<Value> = Vec::new();
        for turn in 0..6 {
            if stop.load(Ordering::Relaxed) {
                break;
            }
            tokio::time::sleep(THINK).await;
            while paused.load(Ordering::Relaxed) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let content: String = (0..40)
                .map(|w| format!("c{seed}v{conversation}t{turn}w{w}"))
                .collect::<Vec<_>>()
                .join(" ");
            messages.push(json!({"role": "user", "content": content}));
            let body = json!({"model": MODEL, "messages": messages, "max_tokens": 8});
            let answer = loop {
                match http
                    .post(format!("http://{addr}/v1/chat/completions"))
                    .json(&body)
                    .send()
                    .await
                {
                    // A refused connection, or one the draining router accepted in the
                    // kernel and closed unanswered (sent just as the restart began): the
                    // router is restarting, so the request is sent again once it is back.
                    Err(e) if e.is_connect() || paused.load(Ordering::Relaxed) => {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                    other => break other,
                }
            };
            match answer {
                Ok(r) if r.status().is_success() => {
                    let value: Value = r.json().await.unwrap_or(Value::Null);
                    let text = value["choices"][0]["message"]["content"]
                        .as_str()
                        .unwrap_or_default()
                        .to_owned();
                    messages.push(json!({"role": "assistant", "content": text}));
                    tally.ok += 1;
                }
                Ok(r) => {
                    let status = r.status();
                    tally
                        .failed
                        .push(format!("{status}: {}", r.text().await.unwrap_or_default()));
                    break;
                }
                Err(e) => {
                    tally.failed.push(e.to_string());
                    break;
                }
            }
        }
    }
    tally
}

/// A header flood beside the load: one connection after another sending a request head far
/// over the router's limit (400 headers, 80 KB), as fast as each is answered, until `stop`.
/// Returns how many were answered 431.
async fn header_flood(addr: std::net::SocketAddr, stop: Arc<AtomicBool>) -> usize {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let headers: String = (0..400)
        .map(|i| format!("x-flood-{i}: {}\r\n", "v".repeat(200)))
        .collect();
    let head = format!("GET /v1/models HTTP/1.1\r\nhost: kvroute\r\n{headers}\r\n");
    let mut refused = 0;
    while !stop.load(Ordering::Relaxed) {
        let Ok(mut socket) = tokio::net::TcpStream::connect(addr).await else {
            // The router is restarting.
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let _ = socket.write_all(head.as_bytes()).await;
        let mut answer = [0u8; 12];
        let read = tokio::time::timeout(Duration::from_secs(5), socket.read_exact(&mut answer));
        if matches!(read.await, Ok(Ok(_))) && answer.starts_with(b"HTTP/1.1 431") {
            refused += 1;
        }
    }
    refused
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleet_survives_restarts_lost_events_a_slow_engine_and_a_router_restart() {
    let seconds: f64 = std::env::var("KVROUTE_CHAOS_SECONDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(12.0);
    let fleet = start_sim(SimConfig {
        port: 0,
        events_port: 0,
        replay_port: Some(0),
        engines: 3,
        engine: EngineConfig {
            num_gpu_blocks: 2048,
            max_model_len: 16_384,
            ..EngineConfig::default()
        },
        time_scale: 10.0,
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let hostile = HostileEndpoint::start().await;
    let http = reqwest::Client::new();
    fault(&http, &fleet, 1, json!({"drop_event_fraction": 0.1})).await;
    fault(&http, &fleet, 2, json!({"slow_factor": 3.0})).await;
    let first = router_from_config(hostile.add_to(config(&fleet)).build()).await;
    let addr = first.addr;
    let same_again = hostile.add_to(config(&fleet)).listen(addr).build();
    let mut router = Some(first);

    let stop = Arc::new(AtomicBool::new(false));
    let paused = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|seed| tokio::spawn(client_loop(addr, seed, stop.clone(), paused.clone())))
        .collect();
    let flood = tokio::spawn(header_flood(addr, stop.clone()));
    let started = Instant::now();
    let at = |fraction: f64| started + Duration::from_secs_f64(seconds * fraction);

    // An engine restarts: the router must notice within 2 s, with no traffic needed.
    tokio::time::sleep_until(at(0.2).into()).await;
    let current = router.as_ref().unwrap();
    let inflight_at_restart = current.router.load(EndpointId(0)).inflight as usize;
    let restarted_at = current.router.now();
    http.post(format!("{}/sim/restart", fleet.endpoints[0].url))
        .send()
        .await
        .unwrap();
    let noticed = Instant::now();
    eventually("the restart noticed", || {
        let forgotten = forgotten_at(&current.router, EndpointId(0));
        (forgotten.is_some_and(|t| t >= restarted_at), forgotten)
    })
    .await;
    assert!(
        noticed.elapsed() < Duration::from_secs(2),
        "index re-synced within 2 s"
    );
    // The restarted engine holds nothing, and the clients' conversations stay on the engines
    // that hold them, so it may get no request before the router restarts: one sent straight
    // to it gives it blocks that the next router must learn from its replay buffer.
    let direct = http
        .post(format!("{}/v1/completions", fleet.endpoints[0].url))
        .json(&json!({"model": MODEL, "prompt": "direct to the restarted engine ".repeat(40), "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert!(direct.status().is_success(), "{}", direct.status());

    // The router restarts on the same configuration: drained, dropped, started again.
    tokio::time::sleep_until(at(0.4).into()).await;
    paused.store(true, Ordering::Relaxed);
    let mut old = router.take().unwrap();
    assert!(
        old.shutdown(Duration::from_secs(10)).await,
        "drained in time"
    );
    drop(old);
    let restarted = router_from_config(same_again).await;
    // Resynchronised from the engines' replay buffers before traffic resumes.
    eventually("the new router's index relearned", || {
        let held: Vec<u64> = (0..3)
            .map(|i| {
                restarted
                    .router
                    .index_stats(EndpointId(i))
                    .map_or(0, |s| s.blocks_gpu)
            })
            .collect();
        (held.iter().all(|&b| b > 0), held)
    })
    .await;
    paused.store(false, Ordering::Relaxed);
    router = Some(restarted);

    // Event loss ends; predictions are measured from a little later to the end.
    tokio::time::sleep_until(at(0.5).into()).await;
    fault(&http, &fleet, 1, json!({"drop_event_fraction": 0.0})).await;
    let router = router.unwrap();
    let during = Predictions::read(&router);
    tokio::time::sleep_until(at(0.55).into()).await;
    let recovered = Predictions::read(&router);
    tokio::time::sleep_until(at(1.0).into()).await;
    stop.store(true, Ordering::Relaxed);
    let mut tally = Tally::default();
    for c in clients {
        let t = c.await.unwrap();
        tally.ok += t.ok;
        tally.failed.extend(t.failed);
    }
    assert!(tally.ok > 40, "load flowed: {tally:?}");
    let flooded = flood.await.unwrap();
    assert!(
        flooded > 10,
        "the header flood was answered 431 {flooded} times"
    );
    assert!(
        tally.failed.len() <= inflight_at_restart,
        "no request lost beyond the {inflight_at_restart} in flight on the restarted engine: {tally:?}"
    );
    hostile.assert_attacks_counted(&router);
    let after = Predictions::read(&router).since(&recovered);
    assert!(after.total() > 20.0, "{after:?}");
    assert!(
        after.exact >= 0.99 * after.total(),
        "after recovery: {after:?}"
    );
    let (rss, budget) = (kvroute_testkit::proc_memory(None, "VmRSS"), memory_budget());
    eprintln!(
        "chaos over {seconds} s: {} requests answered, {} failed ({inflight_at_restart} in flight on the restarted engine); predictions of the restarted router during event loss {during:?}, after recovery {after:?}; VmRSS {} MiB of a {} MiB budget",
        tally.ok,
        tally.failed.len(),
        rss >> 20,
        budget >> 20
    );
    assert!(
        rss < budget,
        "the test process (router, engines, clients) uses {rss} B, the router's budget is {budget} B"
    );
}
