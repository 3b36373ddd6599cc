//! Load scraping of an engine whose `/metrics` answers late, as a CPU-bound vLLM's API server
//! does while its engine computes: the router waits `scrape.timeout_ms` for it, and a scrape
//! that times out is counted and leaves the load unknown, never read as an idle engine.

use serde_json::{Value, json};

mod common;

use common::config_builder::ConfigBuilder;
use common::{eventually_async, explain, fault, router_from_config, router_metrics};
use kvroute_router::server::RunningRouter;

const MODEL: &str = "sim-llama-3.1-8b";

/// `/kvroute/v1/explain`'s view of the only endpoint's load.
async fn scraped_load(client: &reqwest::Client, router: &RunningRouter) -> Value {
    let body = json!({"model": MODEL, "prompt": "how busy is it?", "max_tokens": 1});
    explain(client, router, &body).await["endpoints"][0]["load"].clone()
}

/// The router's `kvroute_scrape_failures_total` for `kind`, summed over endpoints.
async fn scrape_failures(client: &reqwest::Client, router: &RunningRouter, kind: &str) -> f64 {
    let text = router_metrics(client, router).await;
    kvroute_testkit::sum_labelled(
        &text,
        "kvroute_scrape_failures_total{",
        &format!("kind=\"{kind}\""),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_metrics_answer_is_waited_for_within_the_scrape_timeout_and_counted_beyond_it() {
    let engine = common::engine().await;
    let client = reqwest::Client::new();
    common::fault(&client, &engine, 0, json!({"metrics_delay_ms": 600})).await;
    let config = |timeout_ms: u64| {
        ConfigBuilder::new(MODEL)
            .scrape(100)
            .with(|c| c.scrape.timeout_ms = timeout_ms)
            .engines(&[&engine])
            .build()
    };

    // Within the timeout: the late answer is read.
    let patient = router_from_config(config(2_000)).await;
    eventually_async("the slow engine's load scraped", || async {
        let load = scraped_load(&client, &patient).await;
        (load["kv_usage"].is_number(), load)
    })
    .await;
    assert_eq!(scrape_failures(&client, &patient, "timeout").await, 0.0);
    // Used, and shown: how long the answer took.
    let text = router_metrics(&client, &patient).await;
    let took = kvroute_testkit::sum_labelled(&text, "kvroute_scrape_seconds{", "");
    assert!((0.6..2.0).contains(&took), "scrape seconds {took}");

    // Beyond it: every scrape times out, is counted, and the load stays unknown.
    let hasty = router_from_config(config(200)).await;
    eventually_async("the timed-out scrapes counted", || async {
        let failures = scrape_failures(&client, &hasty, "timeout").await;
        (failures >= 2.0, failures)
    })
    .await;
    let unknown = scraped_load(&client, &hasty).await;
    assert!(unknown["kv_usage"].is_null(), "never scraped: {unknown}");

    // Once the engine answers in time again, so does the scrape.
    fault(&client, &engine, 0, json!({"metrics_delay_ms": 0})).await;
    eventually_async(
        "the engine's load scraped once it answers in time",
        || async {
            let load = scraped_load(&client, &hasty).await;
            (load["kv_usage"].is_number(), load)
        },
    )
    .await;
}

/// A sample counts from when its scrape was sent, and the load sample's maximum age is derived
/// so that an answer within `scrape.timeout_ms` is young enough to use: an engine whose every
/// answer is slow but in time (1 s of a 3 s timeout, against 4 × 100 ms + 1 s of missed scrapes) keeps a known
/// load from one answer to the next. It was once discarded as stale on arrival, so a busy CPU
/// engine, the one whose load matters, looked unknown.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_whose_every_answer_is_slow_but_in_time_keeps_a_known_load() {
    let engine = common::engine().await;
    let client = reqwest::Client::new();
    fault(&client, &engine, 0, json!({"metrics_delay_ms": 1_000})).await;
    let config = ConfigBuilder::new(MODEL)
        .scrape(100)
        .with(|c| c.scrape.timeout_ms = 3_000)
        .engines(&[&engine])
        .build();
    let router = router_from_config(config).await;
    eventually_async("the slow engine's load scraped", || async {
        let load = scraped_load(&client, &router).await;
        (load["kv_usage"].is_number(), load)
    })
    .await;
    // Across more than two slow answers, the load never lapses to unknown between them.
    let watched_until = tokio::time::Instant::now() + std::time::Duration::from_secs(4);
    while tokio::time::Instant::now() < watched_until {
        let load = scraped_load(&client, &router).await;
        assert!(load["kv_usage"].is_number(), "the load lapsed: {load}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(scrape_failures(&client, &router, "timeout").await, 0.0);
}
