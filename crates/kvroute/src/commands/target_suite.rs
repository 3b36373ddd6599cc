//! The scheduler's target workloads (docs/benchmarks.md, "Scheduler targets"), as simulation
//! cases for `kvroute tune --suite`: the same fleets and workloads `scripts/targets.sh` runs
//! live, so defaults tuned on them can be confirmed live.

use std::path::Path;

use kvroute_bench::workload::{MultiTurn, SharedPrefix, multi_turn, shared_prefix};
use kvroute_sim::engine::EngineConfig;
use kvroute_simulate::FleetConfig;
use kvroute_simulate::tune::Case;

use super::workload::trace_workload;

fn fleet(base: &FleetConfig, engines: usize, blocks: usize, max_model_len: usize) -> FleetConfig {
    FleetConfig {
        engines,
        engine: EngineConfig {
            num_gpu_blocks: blocks,
            max_model_len: max_model_len.max(base.engine.max_model_len),
            ..base.engine.clone()
        },
        ..base.clone()
    }
}

fn chat(users: usize, rate: f64, seed: u64) -> MultiTurn {
    MultiTurn {
        users,
        turns: 6,
        system_tokens: 400,
        user_tokens: 250,
        output_tokens: 64,
        think_s: 1.0,
        rate_per_s: rate,
        seed,
    }
}

/// Every target workload on its fleet (`base` gives the engine model and the timing around
/// it); the Mooncake case only when `trace` names the trace file.
pub fn cases(base: &FleetConfig, trace: Option<&Path>, seed: u64) -> anyhow::Result<Vec<Case>> {
    let case = |name: &str, fleet: FleetConfig, workload| Case {
        name: name.to_owned(),
        fleet,
        workload,
        concurrency: None,
    };
    let mut cases = vec![
        case(
            "demo",
            fleet(base, 4, 1200, 0),
            multi_turn(&chat(32, 2.0, seed)),
        ),
        case(
            "heavy-multi-turn",
            fleet(base, 4, 1200, 0),
            multi_turn(&chat(256, 16.0, seed)),
        ),
        case(
            "llm-d-shape-60",
            fleet(base, 8, 3000, 0),
            shared_prefix(&SharedPrefix {
                groups: 24,
                context_tokens: 6000,
                questions: 40,
                question_tokens: 200,
                output_tokens: 64,
                rate_per_s: 60.0,
                seed,
            }),
        ),
        case(
            "shared-prefix-tenants",
            fleet(base, 4, 4096, 0),
            shared_prefix(&SharedPrefix {
                groups: 8,
                context_tokens: 3000,
                questions: 40,
                question_tokens: 150,
                output_tokens: 32,
                rate_per_s: 4.0,
                seed,
            }),
        ),
    ];
    if let Some(path) = trace {
        cases.push(case(
            "mooncake",
            fleet(base, 8, 62_500, 131_072),
            trace_workload(path, 3.0, Some(1500), seed, 256)?,
        ));
    }
    Ok(cases)
}
