//! The scheduler's target workloads (docs/benchmarks.md, "Scheduler targets"), each with the
//! fleet it runs on: `kvroute tune --suite` simulates them and `scripts/targets.sh` runs the
//! same shapes live, so that defaults tuned on them can be confirmed live.

use crate::workload::{MultiTurn, SharedPrefix, Workload, multi_turn, shared_prefix};

/// The fleet a target runs on (the engine model around it is the caller's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TargetFleet {
    /// Engines.
    pub engines: usize,
    /// GPU KV-cache blocks per engine.
    pub gpu_blocks: usize,
    /// The longest prompt an engine must accept (0: the engine model's own).
    pub max_model_len: usize,
}

/// One target: its name, its fleet and its workload.
#[derive(Clone, Debug)]
pub struct Target {
    /// The name reports give it.
    pub name: &'static str,
    /// The fleet it runs on.
    pub fleet: TargetFleet,
    /// The requests.
    pub workload: Workload,
}

/// How the Mooncake conversation trace is replayed as a target (the trace file is the user's).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TraceTarget {
    /// The name reports give it.
    pub name: &'static str,
    /// The fleet it runs on.
    pub fleet: TargetFleet,
    /// Replay speed (3: three times faster than recorded).
    pub speed: f64,
    /// The first this many requests.
    pub limit: usize,
    /// Output tokens per request at most.
    pub output_cap: u32,
}

/// The Mooncake conversation trace's slice among the targets.
pub const MOONCAKE: TraceTarget = TraceTarget {
    name: "mooncake",
    fleet: TargetFleet {
        engines: 8,
        gpu_blocks: 62_500,
        max_model_len: 131_072,
    },
    speed: 3.0,
    limit: 1500,
    output_cap: 256,
};

/// The demo's conversations (`kvroute demo`): `users` users, six turns each.
fn chat(users: usize, rate_per_s: f64, seed: u64) -> MultiTurn {
    MultiTurn {
        users,
        turns: 6,
        system_tokens: 400,
        user_tokens: 250,
        output_tokens: 64,
        think_s: 1.0,
        rate_per_s,
        seed,
    }
}

/// Every synthetic target, from `seed` (the Mooncake one needs its trace: [`MOONCAKE`]).
pub fn synthetic(seed: u64) -> Vec<Target> {
    let fleet = |engines, gpu_blocks| TargetFleet {
        engines,
        gpu_blocks,
        max_model_len: 0,
    };
    vec![
        Target {
            name: "demo",
            fleet: fleet(4, 1200),
            workload: multi_turn(&chat(32, 2.0, seed)),
        },
        Target {
            name: "heavy-multi-turn",
            fleet: fleet(4, 1200),
            workload: multi_turn(&chat(256, 16.0, seed)),
        },
        Target {
            name: "llm-d-shape-60",
            fleet: fleet(8, 3000),
            workload: shared_prefix(&SharedPrefix {
                groups: 24,
                context_tokens: 6000,
                questions: 40,
                question_tokens: 200,
                output_tokens: 64,
                rate_per_s: 60.0,
                seed,
            }),
        },
        Target {
            name: "shared-prefix-tenants",
            fleet: fleet(4, 4096),
            workload: shared_prefix(&SharedPrefix {
                groups: 8,
                context_tokens: 3000,
                questions: 40,
                question_tokens: 150,
                output_tokens: 32,
                rate_per_s: 4.0,
                seed,
            }),
        },
    ]
}
