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
    /// Run the scheduler matrix instead of one workload: `small` (what CI runs) or `full`
    /// (docs/benchmarks.md); the fleet flags set engines, their model and timing, the cache
    /// size and rate come from each cell. Writes `matrix.json` and `matrix.html`.
    #[arg(long, value_enum, conflicts_with_all = ["policies", "trace"])]
    matrix: Option<MatrixSize>,
    /// The matrix's workload seeds (each cell's figures are medians over them), in place of
    /// its own (1, 2, 3 for `full`): held-out seeds check that a change did not fit the usual
    /// ones.
    #[arg(long, value_delimiter = ',', requires = "matrix")]
    matrix_seeds: Vec<u64>,
    /// Where to write `simulate.json` and `simulate.html`.
    #[arg(long, default_value = "kvroute-simulate")]
    out: PathBuf,
    /// Also write every routing decision, one JSON line each (the request, where it went, and
    /// each candidate's cost term by term, as `/kvroute/v1/explain` shows one), to
    /// `decisions-<policy>.jsonl` beside the results.
    #[arg(long, conflicts_with = "matrix")]
    log_decisions: bool,
}

/// Which scheduler matrix to run.
#[derive(Clone, Copy, clap::ValueEnum)]
enum MatrixSize {
    /// A few cells (seconds).
    Small,
    /// Every cell of docs/benchmarks.md (minutes).
    Full,
}

fn run_matrix(args: &SimulateArgs, size: MatrixSize) -> anyhow::Result<ExitCode> {
    use kvroute_simulate::matrix::{MatrixSpec, report, run_matrix};
    let fleet = args.fleet.fleet(args.workload.seed())?;
    let mut spec = match size {
        MatrixSize::Small => MatrixSpec::small(),
        MatrixSize::Full => MatrixSpec::full(),
    };
    if !args.matrix_seeds.is_empty() {
        spec.seeds.clone_from(&args.matrix_seeds);
    }
    let started = Instant::now();
    let results = run_matrix(&spec, &fleet, &mut |done, total| {
        eprint!("\rkvroute simulate --matrix: {done}/{total} runs");
    })?;
    eprintln!();
    println!("{}", report::table(&results));
    let verdicts = report::verdicts(&results);
    println!("{}", report::verdict_line(&verdicts));
    println!(
        "{} cells in {:.1} s of wall time.",
        results.len(),
        started.elapsed().as_secs_f64()
    );
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let command: Vec<String> = std::env::args().collect();
    let json = args.out.join("matrix.json");
    let html = args.out.join("matrix.html");
    std::fs::write(
        &json,
        serde_json::to_vec_pretty(
            &serde_json::json!({"spec": spec, "cells": results, "verdicts": verdicts}),
        )?,
    )
    .with_context(|| format!("writing {}", json.display()))?;
    std::fs::write(&html, report::html(&results, &command.join(" ")))
        .with_context(|| format!("writing {}", html.display()))?;
    println!("Results: {}  Report: {}", json.display(), html.display());
    Ok(ExitCode::SUCCESS)
}

/// Runs the simulation and prints the comparison.
pub fn run(args: SimulateArgs) -> anyhow::Result<ExitCode> {
    if let Some(size) = args.matrix {
        return run_matrix(&args, size);
    }
    let workload = args.workload.build()?;
    let fleet = args.fleet.fleet(args.workload.seed())?;
    eprintln!(
        "kvroute simulate: {} requests on {} engines x {} blocks, policies {}",
        workload.requests(),
        fleet.engines,
        fleet.engine.num_gpu_blocks,
        args.policies.join(", ")
    );
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let started = Instant::now();
    let runs = kvroute_simulate::simulate_logged(
        &fleet,
        &workload,
        args.workload.concurrency,
        &args.policies,
        args.log_decisions.then_some(args.out.as_path()),
    )?;
    let wall = started.elapsed().as_secs_f64();
    println!("{}", kvroute_bench::report::table(&runs));
    let pooled = fleet.engine.pooled(fleet.engines);
    let ceiling = kvroute_bench::ceiling::pooled_ceiling(&workload, &pooled);
    println!(
        "Pooled-cache ceiling (one cache as large as the fleet's): {:.1}% hit rate.",
        ceiling.hit_rate * 100.0
    );
    if ceiling.refused > 0 {
        println!(
            "  It leaves out {} requests too long for the fleet's engines (--max-model-len {}).",
            ceiling.refused, pooled.max_model_len
        );
    }
    println!(
        "Simulated {:.1} s of fleet time per policy in {wall:.2} s of wall time.",
        runs.iter()
            .map(|r| r.summary.duration_s)
            .fold(0.0, f64::max)
    );
    let (json, html) = kvroute_bench::report::write_files(&runs, &args.out, "simulate")
        .context("writing the report")?;
    println!("Results: {}  Report: {}", json.display(), html.display());
    Ok(ExitCode::SUCCESS)
}
