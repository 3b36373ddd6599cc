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
//! - [`run`](mod@run): one run in virtual time; [`simulate`]: several policies, as results.

mod client;
pub mod config;
pub mod core_policy;
mod engines;
mod error;
pub mod policy;
mod queue;
pub mod run;

use kvroute_bench::result::RunResult;
use kvroute_bench::workload::Workload;

pub use config::FleetConfig;
pub use error::SimulateError;
pub use policy::{Routing, RoutingPolicy, SimRequest};

/// Simulates `workload` once per named policy (`round-robin`, `random`, `least-load`,
/// `approximate`, `precise`), each on a fresh fleet, and returns one result per policy in the
/// form `kvroute bench` writes. `concurrency` as [`run::run`].
pub fn simulate(
    fleet: &FleetConfig,
    workload: &Workload,
    concurrency: Option<usize>,
    policies: &[String],
) -> Result<Vec<RunResult>, SimulateError> {
    policies
        .iter()
        .map(|name| {
            let mut policy = core_policy::CorePolicy::named(name, fleet)?;
            let outcome = run::run(fleet, workload, concurrency, &mut policy)?;
            let mut summary = kvroute_bench::stats::summarize(&outcome.records, outcome.duration_s);
            summary.engine_hit_rate = outcome.engine_hit_rate;
            Ok(RunResult {
                name: name.clone(),
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
        })
        .collect()
}
