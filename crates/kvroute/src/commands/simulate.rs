//! `kvroute simulate`: a workload through one or more routing policies on a simulated fleet, in
//! virtual time, with `kvroute bench`'s results.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use kvroute_simulate::FleetConfig;

use super::engine_args::EngineArgs;
use super::events::parse_duration;
use super::workload::WorkloadArgs;

/// Arguments of `kvroute simulate`.
#[derive(Args)]
pub struct SimulateArgs {
    /// Engines in the fleet.
    #[arg(long, default_value_t = 4)]
    engines: usize,
    #[command(flatten)]
    engine: EngineArgs,
    #[command(flatten)]
    workload: WorkloadArgs,
    /// A routing policy to simulate (repeat, or separate with commas).
    #[arg(
        long = "policy",
        value_delimiter = ',',
        default_value = "round-robin,least-load,approximate,precise"
    )]
    policies: Vec<String>,
    /// Client to engine latency of a request (HTTP and the router's own work).
    #[arg(long, default_value = "0.5ms", value_parser = parse_duration)]
    request_latency: Duration,
    /// Engine to client latency of a token.
    #[arg(long, default_value = "0.2ms", value_parser = parse_duration)]
    response_latency: Duration,
    /// Delay of KV events from the engine to the router.
    #[arg(long, default_value = "1ms", value_parser = parse_duration)]
    event_delay: Duration,
    /// How often the router scrapes each engine's load (its `scrape.interval_ms`).
    #[arg(long, default_value = "500ms", value_parser = parse_duration)]
    scrape_interval: Duration,
    /// Where to write `simulate.json` and `simulate.html`.
    #[arg(long, default_value = "kvroute-simulate")]
    out: PathBuf,
}

/// Runs the simulation and prints the comparison.
pub fn run(args: SimulateArgs) -> anyhow::Result<ExitCode> {
    let workload = args.workload.build()?;
    let fleet = FleetConfig {
        engines: args.engines,
        engine: args.engine.engine_config()?,
        request_latency_s: args.request_latency.as_secs_f64(),
        response_latency_s: args.response_latency.as_secs_f64(),
        event_delay_s: args.event_delay.as_secs_f64(),
        scrape_interval_s: args.scrape_interval.as_secs_f64(),
        seed: args.workload.seed(),
    };
    eprintln!(
        "kvroute simulate: {} requests on {} engines x {} blocks, policies {}",
        workload.requests(),
        fleet.engines,
        fleet.engine.num_gpu_blocks,
        args.policies.join(", ")
    );
    let started = Instant::now();
    let runs =
        kvroute_simulate::simulate(&fleet, &workload, args.workload.concurrency, &args.policies)?;
    let wall = started.elapsed().as_secs_f64();
    println!("{}", kvroute_bench::report::table(&runs));
    println!(
        "Simulated {:.1} s of fleet time per policy in {wall:.2} s of wall time.",
        runs.iter()
            .map(|r| r.summary.duration_s)
            .fold(0.0, f64::max)
    );
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let (json, html) = kvroute_bench::report::write_files(&runs, &args.out, "simulate")
        .context("writing the report")?;
    println!("Results: {}  Report: {}", json.display(), html.display());
    Ok(ExitCode::SUCCESS)
}
