//! Many endpoints behind one router: `/metrics` bounded in cardinality when per-endpoint series
//! are off, and health checks and scrapes spread over their interval instead of all firing at
//! once. Real HTTP (and ZMQ for the simulated engines) on loopback.

// Measures real processes and sockets: wall-clock time, not the router's (tokio) clock.
#![allow(clippy::disallowed_methods)]

mod common;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::routing::get;
use common::config_builder::{ConfigBuilder, endpoint};
use common::router_from_config;
use kvroute_core::schedule::ProfileName;
use kvroute_router::server::RunningRouter;
use kvroute_sim::server::{SimConfig, SimFleet, start as start_sim};
use kvroute_testkit::{eventually, http_get};
use parking_lot::Mutex;
use serde_json::json;

const MODEL: &str = "sim-llama-3.1-8b";

/// A router in front of the first `n` engines of `fleet`, round-robin (every request has the
/// same decision reason, however many endpoints), with series per endpoint or not.
async fn router_for(fleet: &SimFleet, n: usize, per_endpoint: bool) -> RunningRouter {
    let mut config = ConfigBuilder::new(MODEL).scrape(200).with(|c| {
        c.scheduler.policy = ProfileName::RoundRobin;
        c.metrics.per_endpoint = per_endpoint;
    });
    for (i, ep) in fleet.endpoints.iter().take(n).enumerate() {
        let mut engine = endpoint(Some(format!("engine-{i}")), &ep.url);
        engine.events = Some(ep.events.clone());
        config = config.endpoint(engine);
    }
    router_from_config(config.build()).await
}

/// Sends `n` completions with unrelated prompts (no prefix shared, so every prediction is exact
/// on any fleet).
async fn traffic(router: &RunningRouter, n: usize) {
    let client = reqwest::Client::new();
    for i in 0..n {
        let response = client
            .post(format!("http://{}/v1/completions", router.addr))
            .json(&json!({"model": MODEL, "prompt": format!("{i} unrelated prompt number {i} ").repeat(8), "max_tokens": 2}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        response.bytes().await.unwrap();
    }
}

/// The series of an exposition (name and labels, without values or comments).
fn series(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| l.rsplit_once(' ').map_or(l, |(key, _)| key).to_owned())
        .collect()
}

/// Endpoint names that label some series.
fn endpoint_labels(text: &str) -> BTreeSet<String> {
    text.split("endpoint=\"")
        .skip(1)
        .filter_map(|rest| rest.split_once('"').map(|(name, _)| name.to_owned()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_per_endpoint_series_metrics_do_not_grow_with_the_endpoints() {
    let fleet = start_sim(SimConfig {
        engines: 24,
        port: 0,
        events_port: 0,
        replay_port: None,
        time_scale: 10.0,
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let small = router_for(&fleet, 3, false).await;
    let large = router_for(&fleet, 24, false).await;
    let labelled = router_for(&fleet, 24, true).await;
    for router in [&small, &large, &labelled] {
        traffic(router, 24).await;
    }
    // Every series family with values once events and scrapes have arrived everywhere.
    let wanted = [
        "kvroute_requests_total{",
        "kvroute_first_byte_seconds_bucket{",
        "kvroute_prediction_outcomes_total{",
        "kvroute_endpoint_healthy",
        "kvroute_endpoint_inflight",
        "kvroute_index_blocks{",
        "kvroute_kv_events{",
        "kvroute_kv_events_age_seconds",
        "kvroute_scrape_seconds",
    ];
    let mut texts = Vec::new();
    for router in [&small, &large, &labelled] {
        eventually("every metric family has a series", || {
            let text = http_get(router.admin_addr, "/metrics");
            let missing: Vec<&str> = wanted
                .iter()
                .copied()
                .filter(|w| !text.contains(w))
                .collect();
            (missing.is_empty(), missing)
        })
        .await;
        texts.push(http_get(router.admin_addr, "/metrics"));
    }
    let [small, large, labelled] = &texts[..] else {
        unreachable!()
    };
    // On: a series per endpoint, for all 24 of them.
    assert_eq!(endpoint_labels(labelled).len(), 24, "{labelled}");
    // Off: no endpoint label at all, the very same series for 3 and 24 endpoints, so the same
    // size but for the digits of the values.
    for text in [small, large] {
        assert!(endpoint_labels(text).is_empty(), "{text}");
    }
    assert_eq!(series(small), series(large));
    assert!(
        large.len() <= small.len() + small.len() / 20,
        "{} bytes with 24 endpoints, {} with 3",
        large.len(),
        small.len()
    );
    assert!(labelled.len() > 3 * large.len());
    // The aggregates add up over the endpoints.
    let healthy = |text: &str| kvroute_testkit::sample(text, "kvroute_endpoint_healthy");
    assert_eq!(healthy(small), Some(3.0));
    assert_eq!(healthy(large), Some(24.0));
    let completed =
        "kvroute_requests_total{reason=\"round_robin\",status=\"2xx\",outcome=\"completed\"}";
    assert_eq!(
        kvroute_testkit::sample(large, completed),
        Some(24.0),
        "{large}"
    );
}

/// When each fake engine was probed: (engine, path, time).
type Probes = Arc<Mutex<Vec<(usize, &'static str, Instant)>>>;

/// An engine that only answers health checks and scrapes, recording when each came.
async fn probe_recorder(engine: usize, probes: Probes) -> SocketAddr {
    let record = |path: &'static str, probes: Probes| {
        move || {
            probes.lock().push((engine, path, Instant::now()));
            async { "" }
        }
    };
    let app = axum::Router::new()
        .route("/health", get(record("/health", probes.clone())))
        .route("/metrics", get(record("/metrics", probes)));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_checks_and_scrapes_of_64_endpoints_spread_over_the_interval() {
    const ENGINES: usize = 64;
    const PERIOD: Duration = Duration::from_millis(800);
    let probes: Probes = Arc::default();
    let period_ms = PERIOD.as_millis() as u64;
    let mut config = ConfigBuilder::new(MODEL)
        .health(period_ms, period_ms)
        .scrape(period_ms);
    for i in 0..ENGINES {
        let addr = probe_recorder(i, probes.clone()).await;
        config = config.url(&format!("engine-{i}"), &format!("http://{addr}"));
    }
    let _router = router_from_config(config.build()).await;
    // Each endpoint's first probe of each kind is at once; the second is at its own phase.
    let second_probes = |path: &str| {
        let probes = probes.lock();
        (0..ENGINES)
            .filter_map(|e| {
                probes
                    .iter()
                    .filter(|(engine, p, _)| *engine == e && *p == path)
                    .nth(1)
                    .map(|(_, _, at)| *at)
            })
            .collect::<Vec<Instant>>()
    };
    for path in ["/health", "/metrics"] {
        eventually("every endpoint probed twice", || {
            let n = second_probes(path).len();
            (n == ENGINES, n)
        })
        .await;
        let mut times = second_probes(path);
        times.sort();
        let first = times[0];
        let offsets: Vec<f64> = times
            .iter()
            .map(|t| t.duration_since(first).as_secs_f64() / PERIOD.as_secs_f64())
            .collect();
        // All at once, they would span a few milliseconds; spread, they span nearly the whole
        // interval. Delays (a loaded machine) only stretch the span or bunch a part of it.
        let span = offsets[ENGINES - 1];
        assert!(
            span >= 0.5,
            "{path}: probes span {span} of the interval: {offsets:?}"
        );
        let most_in_an_eighth = (0..ENGINES)
            .map(|i| {
                offsets[i..]
                    .iter()
                    .take_while(|&&o| o - offsets[i] < 0.125)
                    .count()
            })
            .max()
            .unwrap();
        assert!(
            most_in_an_eighth <= ENGINES / 2,
            "{path}: {most_in_an_eighth} of {ENGINES} probes within an eighth of the interval: {offsets:?}"
        );
    }
}
