//! `kvroute tune`: searches a policy's parameters for a workload on a simulated fleet, reports
//! the gain over the starting profile on a held-out part, and prints the winner as YAML for
//! `kvroute serve`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use kvroute_bench::targets::{self, TargetFleet};
use kvroute_core::schedule::{Profile, ProfileName};
use kvroute_sim::engine::EngineConfig;
use kvroute_simulate::FleetConfig;
use kvroute_simulate::tune::{
    Case, Objective, PARAMS, Split, TuneConfig, TuneOutcome, tune_cases, yaml_snippet,
};

use super::fleet_args::FleetArgs;
use super::numbers::parse_duration;
use super::workload::{WorkloadArgs, trace_workload};

#[derive(Clone, Copy, ValueEnum)]
enum ObjectiveKind {
    /// Time to first token, 90th percentile.
    TtftP90,
    /// Time to first token, 99th percentile.
    TtftP99,
    /// Requests meeting --slo (maximised).
    Goodput,
}

#[derive(Clone, Copy, ValueEnum)]
enum SplitKind {
    /// Hold out whole sessions (every conversation is either tuned on or held out).
    Session,
    /// Hold out the sessions that start last.
    Time,
}

/// Arguments of `kvroute tune`.
#[derive(Args)]
pub struct TuneArgs {
    #[command(flatten)]
    fleet: FleetArgs,
    #[command(flatten)]
    workload: WorkloadArgs,
    /// The policy whose parameters are searched (`precise`, `approximate` or `least-load`).
    #[arg(long, default_value = "precise")]
    policy: ProfileName,
    /// What to minimise.
    #[arg(long, value_enum, default_value = "ttft-p90")]
    objective: ObjectiveKind,
    /// The TTFT SLO for `--objective goodput`.
    #[arg(long, default_value = "200ms", value_parser = parse_duration)]
    slo: Duration,
    /// Largest load imbalance (busiest endpoint's requests over the mean) a profile may have.
    #[arg(long, default_value_t = 1.25)]
    max_imbalance: f64,
    /// Simulations of the tuning part, the starting profile included.
    #[arg(long, default_value_t = 40)]
    trials: usize,
    /// Share of the sessions held out to measure the gain on.
    #[arg(long, default_value_t = 0.3)]
    holdout: f64,
    /// How the held-out sessions are chosen.
    #[arg(long, value_enum, default_value = "session")]
    split: SplitKind,
    /// Tune on every workload of the scheduler's targets together (docs/benchmarks.md), each
    /// on its own fleet, instead of the workload flags; with `--trace`, the Mooncake slice too.
    #[arg(long)]
    suite: bool,
    /// Where to write the held-out comparison (`tune.json`, `tune.html`) and `tuned.yaml`.
    #[arg(long, default_value = "kvroute-tune")]
    out: PathBuf,
}

/// The scheduler's targets ([`targets`]) as cases, each on its own fleet of `base`'s engine
/// model; the Mooncake slice only when `trace` names the trace file.
fn suite(
    base: &FleetConfig,
    trace: Option<&std::path::Path>,
    seed: u64,
) -> anyhow::Result<Vec<Case>> {
    let case = |name: &str, target: TargetFleet, workload| Case {
        name: name.to_owned(),
        fleet: FleetConfig {
            engines: target.engines,
            engine: EngineConfig {
                num_gpu_blocks: target.gpu_blocks,
                max_model_len: target.max_model_len.max(base.engine.max_model_len),
                ..base.engine.clone()
            },
            ..base.clone()
        },
        workload,
        concurrency: None,
    };
    let mut cases: Vec<Case> = targets::synthetic(seed)
        .into_iter()
        .map(|t| case(t.name, t.fleet, t.workload))
        .collect();
    if let Some(path) = trace {
        let m = targets::MOONCAKE;
        let workload = trace_workload(path, m.speed, Some(m.limit), seed, m.output_cap)?;
        cases.push(case(m.name, m.fleet, workload));
    }
    Ok(cases)
}

/// Runs the search and prints the winner.
pub fn run(args: TuneArgs) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        (0.0..1.0).contains(&args.holdout) && args.holdout > 0.0,
        "--holdout must be between 0 and 1"
    );
    let fleet = args.fleet.fleet(args.workload.seed())?;
    let cases = if args.suite {
        suite(&fleet, args.workload.trace(), args.workload.seed())?
    } else {
        vec![Case {
            name: "workload".into(),
            fleet,
            workload: args.workload.build()?,
            concurrency: args.workload.concurrency,
        }]
    };
    let objective = match args.objective {
        ObjectiveKind::TtftP90 => Objective::TtftP90,
        ObjectiveKind::TtftP99 => Objective::TtftP99,
        ObjectiveKind::Goodput => Objective::Goodput {
            slo_s: args.slo.as_secs_f64(),
        },
    };
    let config = TuneConfig {
        objective,
        max_imbalance: args.max_imbalance,
        trials: args.trials,
        holdout: args.holdout,
        split: match args.split {
            SplitKind::Session => Split::Session,
            SplitKind::Time => Split::Time,
        },
        seed: args.workload.seed(),
    };
    // The cost model's policies; least-load weighs queueing against decode interference
    // with it too. Round-robin, random and prefix-hash have nothing to tune.
    if !matches!(
        args.policy,
        ProfileName::Precise | ProfileName::Approximate | ProfileName::LeastLoad
    ) {
        anyhow::bail!(
            "--policy {}: only precise, approximate and least-load have parameters to tune",
            args.policy.as_str()
        );
    }
    let start = Profile::named(args.policy);
    for c in &cases {
        eprintln!(
            "kvroute tune: {}: {} requests on {} engines x {} blocks",
            c.name,
            c.workload.requests(),
            c.fleet.engines,
            c.fleet.engine.num_gpu_blocks,
        );
    }
    eprintln!(
        "{} trials, {:.0}% of each workload held out",
        config.trials,
        config.holdout * 100.0
    );
    let bar = if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        ProgressBar::new(0)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} runs")
            .context("progress template")?,
    );
    let outcome = tune_cases(&cases, &start, &config, &mut |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    })?;
    bar.finish_and_clear();
    report(&args, &config, &start, &outcome)
}

fn report(
    args: &TuneArgs,
    config: &TuneConfig,
    start: &Profile,
    outcome: &TuneOutcome,
) -> anyhow::Result<ExitCode> {
    let objective = config.objective;
    let several = outcome.cases.len() > 1;
    let describe = |v: f64| {
        if several {
            format!("{v:.3} of the defaults' objective")
        } else {
            objective.describe(v)
        }
    };
    let feasible = outcome.trials.iter().filter(|t| t.feasible).count();
    let defaults = &outcome.trials[0];
    let best = outcome
        .trials
        .iter()
        .filter(|t| t.feasible)
        .map(|t| t.value)
        .fold(f64::INFINITY, f64::min);
    println!(
        "{} trials, {feasible} within imbalance {:.2} (or the defaults'). Tuning part: defaults {} (largest imbalance {:.2}), best {}.",
        outcome.trials.len(),
        config.max_imbalance,
        describe(defaults.value),
        defaults.imbalance,
        describe(best),
    );
    for p in &PARAMS {
        println!(
            "  {:<30} {:>8.3} -> {:>8.3}",
            p.name,
            p.get(start),
            p.get(&outcome.best)
        );
    }
    let mut runs = Vec::new();
    for case in &outcome.cases {
        let (b, t) = (
            objective.value(&case.baseline),
            objective.value(&case.tuned),
        );
        println!(
            "Held out, {} ({} requests): defaults {}, tuned {} ({:+.1}{}); load imbalance {:.2} -> {:.2}.",
            case.name,
            case.tuned.summary.requests,
            objective.describe(b),
            objective.describe(t),
            objective.change(b, t),
            objective.change_unit(),
            case.baseline.summary.load_imbalance,
            case.tuned.summary.load_imbalance
        );
        let named = |run: &kvroute_bench::result::RunResult, label: &str| {
            let mut run = run.clone();
            if several {
                run.name = format!("{} {label}", case.name);
            }
            run
        };
        runs.push(named(&case.baseline, "defaults"));
        runs.push(named(&case.tuned, "tuned"));
    }
    println!("{}", kvroute_bench::report::table(&runs));
    let yaml = yaml_snippet(args.policy.as_str(), &outcome.best);
    println!("For kvroute serve:\n{yaml}");
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    std::fs::write(args.out.join("tuned.yaml"), &yaml).context("writing tuned.yaml")?;
    let (json, html) = kvroute_bench::report::write_files(&runs, &args.out, "tune")
        .context("writing the report")?;
    println!("Results: {}  Report: {}", json.display(), html.display());
    Ok(ExitCode::SUCCESS)
}
