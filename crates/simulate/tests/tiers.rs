//! Tiered offload on the simulator (issue 21), CPU tier only (the engine model has no local SSD
//! or shared filesystem yet): the same fleet and load, GPU-only against GPU + CPU, under
//! round-robin, tier-blind precise routing (every tier credited as the GPU) and tier-aware
//! precise routing. Two working sets: one above the fleet's GPU memory (llm-d's multi-tier
//! case, 1.3× HBM) and one that fits (their counter-case, where a CPU tier made TTFT worse).
//!
//! Run with `--nocapture` to print the table recorded in docs/benchmarks.md.

use kvroute_bench::result::RunResult;
use kvroute_bench::workload::{MultiTurn, Workload, multi_turn};
use kvroute_core::fleet::FleetConfig as CoreFleetConfig;
use kvroute_core::schedule::{Profile, ProfileName};
use kvroute_core::tiers::TierCosts;
use kvroute_sim::engine::EngineConfig;
use kvroute_simulate::core_policy::CorePolicy;
use kvroute_simulate::{FleetConfig, simulate_with};

const ENGINES: usize = 4;

/// Conversations whose histories are resent each turn (about 1,450 tokens, 90 blocks, per user
/// at the end), `users` of them arriving at `rate_per_s`.
fn workload(users: usize, rate_per_s: f64) -> Workload {
    multi_turn(&MultiTurn {
        users,
        turns: 4,
        system_tokens: 400,
        user_tokens: 250,
        output_tokens: 16,
        think_s: 0.3,
        rate_per_s,
        seed: 21,
    })
}

/// The light load the assertions run on; `LOADED` goes into queueing.
const LIGHT: (usize, f64) = (60, 10.0);
const LOADED: (usize, f64) = (200, 40.0);

fn fleet(gpu_blocks: usize, cpu_blocks: usize) -> FleetConfig {
    FleetConfig {
        engines: ENGINES,
        engine: EngineConfig {
            num_gpu_blocks: gpu_blocks,
            num_cpu_blocks: cpu_blocks,
            ..EngineConfig::default()
        },
        ..FleetConfig::default()
    }
}

fn run(name: &str, profile: Profile, fleet: &FleetConfig, load: (usize, f64)) -> RunResult {
    let mut policy = CorePolicy::new(profile, CoreFleetConfig::default(), fleet).unwrap();
    simulate_with(name, fleet, &workload(load.0, load.1), None, &mut policy).unwrap()
}

/// (policy, GPU-only result, GPU + CPU result) for one GPU size.
fn sweep(
    gpu_blocks: usize,
    cpu_blocks: usize,
    load: (usize, f64),
) -> Vec<(&'static str, RunResult, RunResult)> {
    let blind = Profile {
        tiers: TierCosts::blind(),
        ..Profile::named(ProfileName::Precise)
    };
    let policies = [
        ("round-robin", Profile::named(ProfileName::RoundRobin)),
        ("tier-blind precise", blind),
        ("tier-aware precise", Profile::named(ProfileName::Precise)),
    ];
    policies
        .into_iter()
        .map(|(name, profile)| {
            let gpu_only = run(name, profile.clone(), &fleet(gpu_blocks, 0), load);
            let tiered = run(name, profile, &fleet(gpu_blocks, cpu_blocks), load);
            (name, gpu_only, tiered)
        })
        .collect()
}

fn print(title: &str, rows: &[(&str, RunResult, RunResult)]) {
    println!("{title}");
    println!(
        "| policy | GPU-only TTFT mean | p90 | req/s | + CPU TTFT mean | p90 | req/s | hit rate GPU-only → +CPU |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---|");
    for (name, g, c) in rows {
        let (g, c) = (&g.summary, &c.summary);
        println!(
            "| {name} | {:.3} s | {:.3} s | {:.2} | {:.3} s | {:.3} s | {:.2} | {:.2} → {:.2} |",
            g.ttft.mean,
            g.ttft.p90,
            g.requests_per_s,
            c.ttft.mean,
            c.ttft.p90,
            c.requests_per_s,
            g.engine_hit_rate.unwrap_or(g.hit_rate),
            c.engine_hit_rate.unwrap_or(c.hit_rate),
        );
    }
}

fn mean_ttft(rows: &[(&str, RunResult, RunResult)], policy: &str, tiered: bool) -> f64 {
    let (_, g, c) = rows.iter().find(|(n, _, _)| *n == policy).unwrap();
    if tiered {
        c.summary.ttft.mean
    } else {
        g.summary.ttft.mean
    }
}

#[test]
fn tier_aware_routing_is_never_worse_than_tier_blind_or_gpu_only() {
    // Working set about 1.3× the GPU cache; a CPU tier that holds the rest.
    let over = sweep(250, 1_500, LIGHT);
    print(
        "working set about 1.3x HBM (250 GPU blocks per engine, 1,500 CPU)",
        &over,
    );
    // Working set that fits.
    let fits = sweep(800, 1_500, LIGHT);
    print(
        "working set fits (800 GPU blocks per engine, 1,500 CPU)",
        &fits,
    );
    for rows in [&over, &fits] {
        let aware = mean_ttft(rows, "tier-aware precise", true);
        // 5%: the runs are deterministic, but two policies' different choices shift requests
        // between equal engines; a loss beyond that is a real one.
        assert!(
            aware <= mean_ttft(rows, "tier-blind precise", true) * 1.05,
            "tier-aware worse than tier-blind"
        );
        assert!(
            aware <= mean_ttft(rows, "tier-aware precise", false) * 1.05,
            "tier-aware with a CPU tier worse than GPU-only"
        );
    }
}

/// The same sweep under a load that queues (for the record in docs/benchmarks.md; not asserted:
/// tier-aware routing loses 7% of mean TTFT to tier-blind in one cell there).
#[test]
#[ignore = "a measurement: run with --ignored --nocapture"]
fn loaded_sweep_for_the_record() {
    print(
        "loaded, 250 GPU blocks per engine, 1,500 CPU",
        &sweep(250, 1_500, LOADED),
    );
    print(
        "loaded, 800 GPU blocks per engine, 1,500 CPU",
        &sweep(800, 1_500, LOADED),
    );
}

/// A fleet mounting one shared filesystem: a prefix one engine wrote is a hit on every engine,
/// so even round-robin (which scatters each conversation across the fleet) finds it.
#[test]
fn a_shared_filesystem_serves_every_engine_the_prefixes_any_engine_wrote() {
    use kvroute_sim::engine::shared_fs::SharedFsConfig;
    let gpu_only = fleet(250, 0);
    let mut shared = fleet(250, 0);
    shared.engine.shared_fs = Some(SharedFsConfig {
        capacity_blocks: 20_000,
        ..SharedFsConfig::default()
    });
    let rr = || Profile::named(ProfileName::RoundRobin);
    let without = run("round-robin", rr(), &gpu_only, LIGHT);
    let with = run("round-robin + shared FS", rr(), &shared, LIGHT);
    println!(
        "round-robin mean TTFT: GPU-only {:.3} s, + shared FS {:.3} s",
        without.summary.ttft.mean, with.summary.ttft.mean
    );
    assert!(
        with.summary.ttft.mean < without.summary.ttft.mean * 0.8,
        "a shared-FS hit loads faster than recomputing: {} vs {}",
        with.summary.ttft.mean,
        without.summary.ttft.mean
    );
}
