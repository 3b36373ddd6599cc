//! `kvroute bench`: a workload against any OpenAI-compatible endpoint, and `bench compare`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Subcommand};
use kvroute_bench::driver::{DriverConfig, run as drive};
use kvroute_bench::result::RunResult;

use super::workload::WorkloadArgs;

/// `kvroute bench` arguments (or `kvroute bench compare`).
#[derive(Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BenchArgs {
    #[command(subcommand)]
    compare: Option<BenchCommand>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Render several runs' JSON files side by side (table and HTML).
    Compare {
        /// JSON files written by `kvroute bench` or `kvroute demo`.
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// Where to write the combined report.
        #[arg(long, default_value = "kvroute-compare")]
        out: PathBuf,
    },
}

#[derive(Args)]
struct RunArgs {
    /// Base URL of the OpenAI API (a router, a load balancer, or one engine).
    #[arg(long, default_value = "http://127.0.0.1:8000/v1")]
    url: String,
    /// Model to request.
    #[arg(long, default_value = "sim-llama-3.1-8b")]
    model: String,
    /// Name of this run in tables and charts.
    #[arg(long, default_value = "run")]
    name: String,
    /// Where to write `<name>.json` and `<name>.html`.
    #[arg(long, default_value = "kvroute-bench")]
    out: PathBuf,
    #[command(flatten)]
    workload: WorkloadArgs,
    /// Per-request timeout, seconds.
    #[arg(long, default_value_t = 300.0, value_parser = super::numbers::positive_seconds)]
    timeout_s: f64,
    /// Also print the ceiling: the hit rate of one cache of this many blocks (the fleet's
    /// total) serving the same requests in order.
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(2..))]
    ceiling_blocks: Option<usize>,
    /// The longest request (prompt and output, tokens) the ceiling's engine serves: the
    /// fleet's engines' `--max-model-len`, so that the ceiling counts the requests they serve.
    #[arg(
        long,
        default_value_t = kvroute_sim::engine::EngineConfig::default().max_model_len,
        value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..)
    )]
    ceiling_max_model_len: usize,
}

/// Runs a benchmark, or compares saved runs.
pub async fn run(args: BenchArgs) -> anyhow::Result<ExitCode> {
    if let Some(BenchCommand::Compare { files, out }) = args.compare {
        let mut runs: Vec<RunResult> = Vec::new();
        for f in &files {
            runs.extend(
                kvroute_bench::report::load(f)
                    .with_context(|| format!("reading {}", f.display()))?,
            );
        }
        println!("{}", kvroute_bench::report::table(&runs));
        std::fs::create_dir_all(&out)?;
        let (_, html) = kvroute_bench::report::write_files(&runs, &out, "compare")?;
        println!("Report: {}", html.display());
        return Ok(ExitCode::SUCCESS);
    }
    let a = args.run;
    let workload = a.workload.build()?;
    eprintln!(
        "kvroute bench: {} requests against {}",
        workload.requests(),
        a.url
    );
    let (records, duration) = drive(
        &workload,
        &DriverConfig {
            base_url: a.url.trim_end_matches('/').to_owned(),
            model: a.model.clone(),
            concurrency: a.workload.concurrency,
            timeout: Duration::from_secs_f64(a.timeout_s),
            progress: std::io::IsTerminal::is_terminal(&std::io::stderr()),
        },
    )
    .await;
    let result = RunResult {
        name: a.name.clone(),
        config: serde_json::json!({"url": a.url, "model": a.model, "workload": workload.description, "concurrency": a.workload.concurrency}),
        summary: kvroute_bench::stats::summarize(&records, duration),
        records,
    };
    println!(
        "{}",
        kvroute_bench::report::table(std::slice::from_ref(&result))
    );
    std::fs::create_dir_all(&a.out)?;
    let (json, html) =
        kvroute_bench::report::write_files(std::slice::from_ref(&result), &a.out, &a.name)?;
    println!("Results: {}  Report: {}", json.display(), html.display());
    if let Some(blocks) = a.ceiling_blocks {
        let max_model_len = a.ceiling_max_model_len;
        let ceiling = kvroute_bench::ceiling::pooled_ceiling(
            &workload,
            &kvroute_sim::engine::EngineConfig {
                num_gpu_blocks: blocks,
                max_model_len,
                ..kvroute_sim::engine::EngineConfig::default()
            },
        );
        println!(
            "Ceiling: one pooled cache of {blocks} blocks serving the same requests in order reaches a {:.1}% hit rate.",
            ceiling.hit_rate * 100.0
        );
        if ceiling.refused > 0 {
            println!(
                "  It leaves out {} requests longer than --ceiling-max-model-len {max_model_len} or than the pooled cache: give the engines' --max-model-len if they serve longer ones.",
                ceiling.refused
            );
        }
    }
    if result.summary.errors > 0 {
        // Why they failed, not only how many: the first error of each kind (connection refused,
        // a status and its body), once.
        let mut seen: Vec<&str> = Vec::new();
        for error in result.records.iter().filter_map(|r| r.error.as_deref()) {
            if seen.len() < 3 && !seen.contains(&error) {
                seen.push(error);
            }
        }
        eprintln!(
            "kvroute bench: {} of {} requests failed; first errors: {}",
            result.summary.errors,
            result.records.len(),
            seen.join(" | ")
        );
        return Ok(ExitCode::from(1));
    }
    Ok(ExitCode::SUCCESS)
}
