//! `kvroute bench`: a workload against any OpenAI-compatible endpoint, and `bench compare`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Subcommand, ValueEnum};
use kvroute_bench::driver::{DriverConfig, run as drive};
use kvroute_bench::result::RunResult;
use kvroute_bench::trace::{TraceOptions, load_trace};
use kvroute_bench::workload::{MultiTurn, SharedPrefix, from_prompts, multi_turn, shared_prefix};

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

#[derive(Clone, Copy, ValueEnum)]
enum WorkloadKind {
    /// N users, T turns each, a shared system prompt; every turn resends the history.
    MultiTurn,
    /// G groups with a long shared context and many short questions.
    SharedPrefix,
    /// A Mooncake-format trace (--trace FILE).
    Trace,
}

#[derive(Args)]
struct RunArgs {
    /// Base URL of the OpenAI API (a router, a load balancer, or one engine).
    #[arg(long, default_value = "http://127.0.0.1:8000/v1")]
    url: String,
    /// Model to request.
    #[arg(long, default_value = "sim-llama-3.1-8b")]
    model: String,
    /// The workload.
    #[arg(long, value_enum, default_value = "multi-turn")]
    workload: WorkloadKind,
    /// Name of this run in tables and charts.
    #[arg(long, default_value = "run")]
    name: String,
    /// Where to write `<name>.json` and `<name>.html`.
    #[arg(long, default_value = "kvroute-bench")]
    out: PathBuf,
    /// Closed loop with this many sessions at once (default: open loop at --rate).
    #[arg(long)]
    concurrency: Option<usize>,
    /// Sessions started per second (open loop).
    #[arg(long, default_value_t = 2.0)]
    rate: f64,
    /// Random seed.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// multi-turn: users; shared-prefix: groups.
    #[arg(long, default_value_t = 16)]
    users: usize,
    /// multi-turn: turns per user; shared-prefix: questions per group.
    #[arg(long, default_value_t = 5)]
    turns: usize,
    /// Tokens of the shared system prompt (multi-turn) or context (shared-prefix).
    #[arg(long, default_value_t = 1500)]
    shared_tokens: usize,
    /// Tokens of each user message or question.
    #[arg(long, default_value_t = 150)]
    user_tokens: usize,
    /// Tokens generated per request (trace: the trace's own, capped by this).
    #[arg(long, default_value_t = 32)]
    output_tokens: u32,
    /// Seconds between an answer and the next turn (multi-turn).
    #[arg(long, default_value_t = 1.5)]
    think_s: f64,
    /// The trace file (Mooncake JSONL) for --workload trace.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Trace replay speed (2.0: twice as fast as recorded).
    #[arg(long, default_value_t = 1.0)]
    speed: f64,
    /// At most this many trace requests.
    #[arg(long)]
    limit: Option<usize>,
    /// Per-request timeout, seconds.
    #[arg(long, default_value_t = 300.0)]
    timeout_s: f64,
    /// Also print the ceiling: the hit rate of one cache of this many blocks (the fleet's
    /// total) serving the same requests in order.
    #[arg(long)]
    ceiling_blocks: Option<usize>,
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
    anyhow::ensure!(
        a.rate > 0.0 && a.rate.is_finite(),
        "--rate must be positive"
    );
    let workload = match a.workload {
        WorkloadKind::MultiTurn => multi_turn(&MultiTurn {
            users: a.users,
            turns: a.turns,
            system_tokens: a.shared_tokens,
            user_tokens: a.user_tokens,
            output_tokens: a.output_tokens,
            think_s: a.think_s,
            rate_per_s: a.rate,
            seed: a.seed,
        }),
        WorkloadKind::SharedPrefix => shared_prefix(&SharedPrefix {
            groups: a.users,
            context_tokens: a.shared_tokens,
            questions: a.turns,
            question_tokens: a.user_tokens,
            output_tokens: a.output_tokens,
            rate_per_s: a.rate,
            seed: a.seed,
        }),
        WorkloadKind::Trace => {
            let path = a
                .trace
                .as_ref()
                .context("--workload trace needs --trace FILE")?;
            let file =
                std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
            let requests = load_trace(
                std::io::BufReader::new(file),
                &TraceOptions {
                    speed: a.speed,
                    limit: a.limit,
                    seed: a.seed,
                    ..TraceOptions::default()
                },
            )?;
            from_prompts(
                serde_json::json!({"workload": "trace", "file": path, "speed": a.speed, "limit": a.limit}),
                requests
                    .into_iter()
                    .map(|r| (r.at_s, r.prompt, r.output_tokens.min(a.output_tokens)))
                    .collect(),
            )
        }
    };
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
            concurrency: a.concurrency,
            timeout: Duration::from_secs_f64(a.timeout_s),
            progress: std::io::IsTerminal::is_terminal(&std::io::stderr()),
        },
    )
    .await;
    let result = RunResult {
        name: a.name.clone(),
        config: serde_json::json!({"url": a.url, "model": a.model, "workload": workload.description, "concurrency": a.concurrency}),
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
        let ceiling = kvroute_bench::ceiling::pooled_hit_rate(
            &workload,
            &kvroute_sim::engine::EngineConfig {
                num_gpu_blocks: blocks,
                ..kvroute_sim::engine::EngineConfig::default()
            },
        );
        println!(
            "Ceiling: one pooled cache of {blocks} blocks serving the same requests in order reaches a {:.1}% hit rate.",
            ceiling * 100.0
        );
    }
    Ok(if result.summary.errors == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}
