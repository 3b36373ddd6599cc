//! `kvroute simulate`: a discrete-event simulation of a kvroute fleet in virtual time.
//!
//! It runs the code the live system runs, unchanged: kvroute-sim's engine model for every
//! engine and kvroute-core's scheduler for the routing decision (through the
//! [`RoutingPolicy`] seam). The client side follows `kvroute bench`'s driver: the same
//! workloads, the same session semantics, the same prompts token for token. The output is the
//! run-result JSON `kvroute bench` writes, so `bench compare` and the HTML report read it.
//!
//! - [`config`]: the fleet and the timing around the engines;
//! - [`policy`]: the routing seam; [`core_policy`]: the policies on kvroute-core's fleet state;
//! - [`run`](mod@run): one run in virtual time; [`simulate`] and [`simulate_with`]: runs as
//!   `kvroute bench` results ([`simulate_logged`] with every decision, as `explain` shows
//!   one: [`decisions`]);
//! - [`tune`](mod@tune): searching a profile's parameters, with a held-out part;
//! - [`matrix`]: every policy on a grid of workload shapes, cache sizes and loads.

mod client;
pub mod config;
pub mod core_policy;
pub mod decisions;
mod engines;
mod error;
pub mod matrix;
mod pd;
pub mod pd_policy;
pub mod policy;
mod queue;
pub mod run;
pub mod tune;

use std::path::Path;

use kvroute_bench::result::RunResult;
use kvroute_bench::workload::Workload;

pub use config::FleetConfig;
pub use error::SimulateError;
pub use policy::{Routing, RoutingPolicy, SimRequest, Usage};

/// Simulates `workload` once per named policy (`round-robin`, `random`, `least-load`,
/// `approximate`, `precise`), each on a fresh fleet, and returns one result per policy in the
/// form `kvroute bench` writes. `concurrency` as [`run::run`].
pub fn simulate(
    fleet: &FleetConfig,
    workload: &Workload,
    concurrency: Option<usize>,
    policies: &[String],
) -> Result<Vec<RunResult>, SimulateError> {
    simulate_logged(fleet, workload, concurrency, policies, None)
}

/// [`simulate`], writing each policy's decisions to `decisions-<policy>.jsonl` in
/// `decisions_dir` ([`decisions::DecisionLog`]) when given.
pub fn simulate_logged(
    fleet: &FleetConfig,
    workload: &Workload,
    concurrency: Option<usize>,
    policies: &[String],
    decisions_dir: Option<&Path>,
) -> Result<Vec<RunResult>, SimulateError> {
    policies
        .iter()
        .map(|name| {
            let mut policy = core_policy::CorePolicy::named(name, fleet)?;
            if let Some(dir) = decisions_dir {
                let path = dir.join(format!("decisions-{name}.jsonl"));
                policy.log_decisions(decisions::DecisionLog::create(&path)?);
            }
            let result = simulate_with(name, fleet, workload, concurrency, &mut policy)?;
            policy.finish_decisions()?;
            Ok(result)
        })
        .collect()
}

/// Simulates `workload` through any `policy` (a custom profile, another router) on a fresh
/// fleet, as a result named `name` in the form `kvroute bench` writes.
pub fn simulate_with(
    name: &str,
    fleet: &FleetConfig,
    workload: &Workload,
    concurrency: Option<usize>,
    policy: &mut dyn RoutingPolicy,
) -> Result<RunResult, SimulateError> {
    let outcome = run::run(fleet, workload, concurrency, policy)?;
    let mut summary = kvroute_bench::stats::summarize(&outcome.records, outcome.duration_s);
    kvroute_bench::stats::count_idle_endpoints(&mut summary, fleet.serving_endpoints());
    summary.engine_hit_rate = outcome.engine_hit_rate;
    summary.ttft_prediction_error =
        kvroute_bench::stats::prediction_error(policy.ttft_prediction_errors());
    Ok(RunResult {
        name: name.to_owned(),
        config: serde_json::json!({
            "policy": name,
            "simulated": true,
            "workload": workload.description,
            "engines": fleet.engines,
            "concurrency": concurrency,
            "fleet": fleet,
        }),
        summary,
        records: outcome.records,
    })
}
