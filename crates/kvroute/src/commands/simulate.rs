//! `kvroute simulate`: a workload through one or more routing policies on a simulated fleet, in
//! virtual time, with `kvroute bench`'s results.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context;
use clap::Args;

use super::fleet_args::FleetArgs;
use super::workload::WorkloadArgs;

/// Arguments of `kvroute simulate`.
#[derive(Args)]
pub struct SimulateArgs {
    #[command(flatten)]
    fleet: FleetArgs,
    #[command(flatten)]
    workload: WorkloadArgs,
    /// A routing policy to simulate (repeat, or separate with commas).
    #[arg(
        long = "policy",
        value_delimiter = ',',
        default_value = "round-robin,least-load,prefix-hash,approximate,precise"
    )]
    policies: Vec<String>,
    /// Where to write `simulate.json` and `simulate.html`.
    #[arg(long, default_value = "kvroute-simulate")]
    out: PathBuf,
}

/// Runs the simulation and prints the comparison.
pub fn run(args: SimulateArgs) -> anyhow::Result<ExitCode> {
    let workload = args.workload.build()?;
    let fleet = args.fleet.fleet(args.workload.seed())?;
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
    let pooled = kvroute_sim::engine::EngineConfig {
        num_gpu_blocks: fleet.engine.num_gpu_blocks * fleet.engines,
        ..fleet.engine.clone()
    };
    println!(
        "Pooled-cache ceiling (one cache as large as the fleet's): {:.1}% hit rate.",
        kvroute_bench::ceiling::pooled_hit_rate(&workload, &pooled) * 100.0
    );
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
