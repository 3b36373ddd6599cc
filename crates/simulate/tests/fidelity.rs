//! Fidelity: `kvroute simulate` and a live run of the same workload agree. The live run is what
//! `kvroute demo` does (simulated engines over HTTP and ZMQ, the router, bench's driver), at a
//! size a test can afford; the simulation runs the same workload on the same fleet settings.
//! Hit rates must agree within 5 percentage points, TTFT p50 and p90 within 15%.
//!
//! What the simulation cannot know is how long the live stack itself takes outside the engines
//! (HTTP, the router's parsing, tokenization and scheduling): that depends on the build and the
//! machine, and is a parameter of the simulated fleet. The test measures it on the live stack,
//! before and after the live runs, with sequential requests to an idle engine whose model time
//! is known, and gives the simulation the mean.

use std::time::Duration;

use kvroute_bench::driver::{DriverConfig, run as drive};
use kvroute_bench::result::{RequestRecord, RunResult, Summary};
use kvroute_bench::workload::{MultiTurn, Workload, multi_turn};
use kvroute_router::config::RouterConfig;
use kvroute_router::server::{RunningRouter, start as start_router};
use kvroute_sim::engine::EngineConfig;
use kvroute_sim::engine::latency::StepWork;
use kvroute_sim::server::{SimConfig, SimFleet, start as start_sim};
use kvroute_simulate::{FleetConfig, simulate};
use kvroute_testkit::eventually;
use serde_json::{Value, json};

const MODEL: &str = "sim-llama-3.1-8b";
const ENGINES: usize = 4;
const SCRAPE_MS: u64 = 200;

/// The demo's shape (a shared system prompt, long user turns, histories resent), smaller.
fn workload() -> Workload {
    multi_turn(&MultiTurn {
        users: 60,
        turns: 4,
        system_tokens: 400,
        user_tokens: 250,
        output_tokens: 16,
        think_s: 0.3,
        rate_per_s: 10.0,
        seed: 42,
    })
}

/// Like the demo's, so that caches are under the same pressure: about the blocks the
/// conversations need, all together.
fn engine_config() -> EngineConfig {
    EngineConfig {
        num_gpu_blocks: 1500,
        ..EngineConfig::default()
    }
}

async fn live_router(engines: &[SimFleet], policy: &str) -> RunningRouter {
    let endpoints: Vec<Value> = engines
        .iter()
        .enumerate()
        .map(|(i, f)| {
            let ep = &f.endpoints[0];
            json!({"name": format!("engine-{i}"), "url": ep.url, "events": ep.events, "replay": ep.replay})
        })
        .collect();
    // JSON is YAML: the configuration `kvroute demo` writes, built as a value.
    let config = json!({
        "listen": "127.0.0.1:0",
        "models": [{"name": MODEL}],
        "scheduler": {"policy": policy},
        "scrape": {"interval_ms": SCRAPE_MS},
        "endpoints": endpoints,
    });
    let router = start_router(RouterConfig::from_yaml(&config.to_string()).unwrap())
        .await
        .unwrap();
    eventually("subscribers connected", || {
        let endpoints = router.router.endpoints();
        (endpoints.iter().all(|e| e.events_connected()), ())
    })
    .await;
    router
}

async fn fleet(engines: usize) -> Vec<SimFleet> {
    let mut fleet = Vec::new();
    for _ in 0..engines {
        fleet.push(
            start_sim(SimConfig {
                port: 0,
                events_port: 0,
                replay_port: Some(0),
                engine: engine_config(),
                ..SimConfig::default()
            })
            .await
            .unwrap(),
        );
    }
    fleet
}

async fn drive_through(
    router: &RunningRouter,
    workload: &Workload,
    concurrency: Option<usize>,
) -> Vec<RequestRecord> {
    drive(
        workload,
        &DriverConfig {
            base_url: format!("http://{}/v1", router.addr),
            model: MODEL.into(),
            concurrency,
            timeout: Duration::from_secs(60),
            progress: false,
        },
    )
    .await
    .0
}

/// Seconds the live stack adds to a request's TTFT outside the engine: the median, over
/// sequential requests with unshared prompts of the workload's size to an idle fleet of the
/// test's size, of the measured TTFT minus the engine model's time for the uncached prefill.
async fn live_overhead() -> f64 {
    let engines = fleet(ENGINES).await;
    let router = live_router(&engines, "precise").await;
    let probes = multi_turn(&MultiTurn {
        users: 11,
        turns: 1,
        system_tokens: 1,
        user_tokens: 900,
        output_tokens: 1,
        think_s: 0.0,
        rate_per_s: 100.0,
        seed: 7,
    });
    let latency = engine_config().latency;
    let mut overheads: Vec<f64> = drive_through(&router, &probes, Some(1))
        .await
        .iter()
        .skip(2) // warm-up: connections are being made
        .map(|r| {
            let uncached = r.prompt_tokens - r.cached_tokens.unwrap_or(0);
            let model = latency.step_seconds(&StepWork {
                prefill_tokens: uncached as usize,
                ..StepWork::default()
            });
            r.ttft_s.expect("a probe failed") - model
        })
        .collect();
    overheads.sort_by(f64::total_cmp);
    overheads[overheads.len() / 2].max(0.0)
}

async fn live(workload: &Workload, policy: &str) -> RunResult {
    let engines = fleet(ENGINES).await;
    let router = live_router(&engines, policy).await;
    let started = std::time::Instant::now();
    let records = drive_through(&router, workload, None).await;
    RunResult {
        name: format!("{policy} (live)"),
        config: json!({"policy": policy}),
        summary: kvroute_bench::stats::summarize(&records, started.elapsed().as_secs_f64()),
        records,
    }
}

fn agree(policy: &str, live: &Summary, sim: &Summary) -> Vec<String> {
    let mut problems = Vec::new();
    if (live.hit_rate - sim.hit_rate).abs() > 0.05 {
        problems.push(format!(
            "{policy}: hit rate live {:.3} vs simulated {:.3}",
            live.hit_rate, sim.hit_rate
        ));
    }
    for (what, l, s) in [
        ("TTFT p50", live.ttft.p50, sim.ttft.p50),
        ("TTFT p90", live.ttft.p90, sim.ttft.p90),
    ] {
        if (s - l).abs() > 0.15 * l {
            problems.push(format!(
                "{policy}: {what} live {:.1} ms vs simulated {:.1} ms",
                l * 1e3,
                s * 1e3
            ));
        }
    }
    problems
}

/// One comparison: live runs of every policy (with the stack's overhead measured around them),
/// then the simulation. Returns the disagreements and both sides' results.
async fn compare(workload: &Workload, policies: &[String]) -> (Vec<String>, Vec<RunResult>) {
    let before = live_overhead().await;
    let mut lives = Vec::new();
    for policy in policies {
        let live = live(workload, policy).await;
        assert_eq!(
            live.summary.errors, 0,
            "{policy}: the live run failed requests"
        );
        lives.push(live);
    }
    let after = live_overhead().await;
    eprintln!(
        "live stack overhead: {:.2} ms before, {:.2} ms after",
        before * 1e3,
        after * 1e3
    );
    let fleet = FleetConfig {
        engines: ENGINES,
        engine: engine_config(),
        request_latency_s: (before + after) / 2.0,
        response_latency_s: 0.0,
        scrape_interval_s: SCRAPE_MS as f64 / 1000.0,
        ..FleetConfig::default()
    };
    let simulated = simulate(&fleet, workload, None, policies).unwrap();
    let mut problems = Vec::new();
    for ((policy, sim), live) in policies.iter().zip(&simulated).zip(&lives) {
        let live = &live.summary;
        eprintln!(
            "{policy}: hit rate live {:.3} sim {:.3}; TTFT p50 live {:.1} sim {:.1} ms; p90 live {:.1} sim {:.1} ms",
            live.hit_rate,
            sim.summary.hit_rate,
            live.ttft.p50 * 1e3,
            sim.summary.ttft.p50 * 1e3,
            live.ttft.p90 * 1e3,
            sim.summary.ttft.p90 * 1e3
        );
        problems.extend(agree(policy, live, &sim.summary));
    }
    (problems, lives.into_iter().chain(simulated).collect())
}

/// Live runs on a shared machine sometimes stall (the process is descheduled for a few hundred
/// milliseconds and a burst of requests waits): such a run is repeated, up to three times. A
/// simulation that disagrees with the live system disagrees every time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simulate_agrees_with_a_live_run() {
    let workload = workload();
    let policies = vec!["round-robin".to_owned(), "precise".to_owned()];
    let mut failures = Vec::new();
    for attempt in 1..=3 {
        let (problems, runs) = compare(&workload, &policies).await;
        if problems.is_empty() {
            return;
        }
        // Both sides, for `kvroute bench compare`.
        let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("fidelity");
        std::fs::create_dir_all(&dir).unwrap();
        let name = format!("attempt-{attempt}");
        let (json, _) = kvroute_bench::report::write_files(&runs, &dir, &name).unwrap();
        eprintln!(
            "attempt {attempt} disagrees: {problems:#?}; both runs: {}",
            json.display()
        );
        failures.push(problems);
    }
    panic!("simulation and live runs disagreed three times: {failures:#?}");
}
