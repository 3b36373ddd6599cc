//! The workload flags `kvroute bench` and `kvroute simulate` share, and the workload they build.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, ValueEnum};
use kvroute_bench::trace::{TraceOptions, load_trace};
use kvroute_bench::workload::{
    MultiTurn, SharedPrefix, TenantSkew, Tenants, Workload, from_prompts, multi_turn,
    shared_prefix, tenants,
};

#[derive(Clone, Copy, PartialEq, ValueEnum)]
enum WorkloadKind {
    /// N users, T turns each, a shared system prompt; every turn resends the history.
    MultiTurn,
    /// G groups with a long shared context and many short questions.
    SharedPrefix,
    /// --users tenants, each with a long context (--shared-tokens); --conversations
    /// conversations of --turns questions, each under a tenant picked by --tenant-skew.
    Tenants,
    /// A Mooncake-format trace (--trace FILE).
    Trace,
}

/// Which workload to run, and how to drive it.
#[derive(Args)]
pub struct WorkloadArgs {
    /// The workload.
    #[arg(long, value_enum, default_value = "multi-turn")]
    workload: WorkloadKind,
    /// Closed loop with this many sessions at once (default: open loop at --rate).
    #[arg(long, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub concurrency: Option<usize>,
    /// Sessions (conversations, questions) started per second (open loop).
    #[arg(long, default_value_t = 2.0)]
    rate: f64,
    /// Random seed.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// multi-turn: users; shared-prefix: groups; tenants: tenants.
    #[arg(long, default_value_t = 16)]
    users: usize,
    /// multi-turn: turns per user; shared-prefix: questions per group; tenants: questions per
    /// conversation.
    #[arg(long, default_value_t = 5)]
    turns: usize,
    /// tenants: conversations, all tenants together.
    #[arg(long, default_value_t = 400)]
    conversations: usize,
    /// tenants: how popular tenants are: `uniform`, `zipf` or `zipf:S` (exponent S).
    #[arg(long, default_value = "uniform")]
    tenant_skew: TenantSkew,
    /// tenants: coefficient of variation of context and question lengths (log-normal around
    /// --shared-tokens and --user-tokens; 0: fixed lengths).
    #[arg(long, default_value_t = 0.0)]
    length_cv: f64,
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
    #[arg(long, default_value_t = 1.5, value_parser = super::numbers::seconds)]
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
}

impl WorkloadArgs {
    /// The random seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The trace file, if one was given.
    pub fn trace(&self) -> Option<&std::path::Path> {
        self.trace.as_deref()
    }

    /// Builds the workload the flags describe.
    pub fn build(&self) -> anyhow::Result<Workload> {
        anyhow::ensure!(
            self.rate > 0.0 && self.rate.is_finite(),
            "--rate must be positive"
        );
        // A trace given beside another workload would be dropped without a word.
        anyhow::ensure!(
            self.trace.is_none() || self.workload == WorkloadKind::Trace,
            "--trace FILE is replayed only with --workload trace"
        );
        Ok(match self.workload {
            WorkloadKind::MultiTurn => multi_turn(&MultiTurn {
                users: self.users,
                turns: self.turns,
                system_tokens: self.shared_tokens,
                user_tokens: self.user_tokens,
                output_tokens: self.output_tokens,
                think_s: self.think_s,
                rate_per_s: self.rate,
                seed: self.seed,
            }),
            WorkloadKind::SharedPrefix => shared_prefix(&SharedPrefix {
                groups: self.users,
                context_tokens: self.shared_tokens,
                questions: self.turns,
                question_tokens: self.user_tokens,
                output_tokens: self.output_tokens,
                rate_per_s: self.rate,
                seed: self.seed,
            }),
            WorkloadKind::Tenants => {
                anyhow::ensure!(
                    self.length_cv.is_finite() && self.length_cv >= 0.0,
                    "--length-cv must be a non-negative number"
                );
                tenants(&Tenants {
                    tenants: self.users,
                    context_tokens: self.shared_tokens,
                    conversations: self.conversations,
                    turns: self.turns,
                    question_tokens: self.user_tokens,
                    length_cv: self.length_cv,
                    output_tokens: self.output_tokens,
                    think_s: self.think_s,
                    rate_per_s: self.rate,
                    skew: self.tenant_skew,
                    seed: self.seed,
                })
            }
            WorkloadKind::Trace => {
                let path = self
                    .trace
                    .as_ref()
                    .context("--workload trace needs --trace FILE")?;
                trace_workload(path, self.speed, self.limit, self.seed, self.output_tokens)?
            }
        })
    }
}

/// A Mooncake-format trace as a workload: replayed at `speed`, at most `limit` requests, each
/// generating at most `output_cap` tokens.
pub fn trace_workload(
    path: &std::path::Path,
    speed: f64,
    limit: Option<usize>,
    seed: u64,
    output_cap: u32,
) -> anyhow::Result<Workload> {
    let file = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let requests = load_trace(
        std::io::BufReader::new(file),
        &TraceOptions {
            speed,
            limit,
            seed,
            ..TraceOptions::default()
        },
    )
    .with_context(|| format!("reading trace {}", path.display()))?;
    Ok(from_prompts(
        serde_json::json!({"workload": "trace", "file": path, "speed": speed, "limit": limit}),
        requests
            .into_iter()
            .map(|r| (r.at_s, r.prompt, r.output_tokens.min(output_cap)))
            .collect(),
    ))
}
