//! P/D fleets in virtual time: both legs and the pull run on kvroute-sim's engine and link
//! models; `pd-always` disaggregates everything, `pd-cost` prices each request with
//! kvroute-core's decision.

use kvroute_bench::result::RunResult;
use kvroute_bench::workload::{Workload, from_prompts};
use kvroute_sim::link::LinkSpec;
use kvroute_simulate::{FleetConfig, simulate};
use kvroute_vllm::nixl::KvRole;

const PROMPT: usize = 8192;

/// Engines with `roles`, Llama-3.1-8B's KV over `link`, 8,000 GPU blocks each.
fn fleet(roles: &[KvRole], link: &str) -> FleetConfig {
    FleetConfig::disaggregated(roles, LinkSpec::parse(link).unwrap(), 8000)
}

/// `n` distinct 8k-token prompts, one every `gap_s`, 32 tokens out each.
fn long_prompts(n: usize, gap_s: f64) -> Workload {
    let prompts = (0..n)
        .map(|i| {
            let tokens = (0..PROMPT as u32).map(|t| i as u32 * 100_000 + t).collect();
            (i as f64 * gap_s, tokens, 32)
        })
        .collect();
    from_prompts(serde_json::json!({"name": "long prompts"}), prompts)
}

fn run(fleet: &FleetConfig, workload: &Workload, policy: &str) -> RunResult {
    simulate(fleet, workload, None, &[policy.to_owned()])
        .unwrap()
        .remove(0)
}

#[test]
fn pd_always_runs_both_legs_and_answers_on_the_decode_engine() {
    use KvRole::{Consumer, Producer};
    let fleet = fleet(&[Producer, Producer, Consumer, Consumer], "roce-100");
    let workload = long_prompts(8, 0.5);
    let result = run(&fleet, &workload, "pd-always");
    assert_eq!(result.summary.errors, 0, "{:?}", result.records);
    for r in &result.records {
        assert_eq!(r.completion_tokens, 32);
        let endpoint = r.endpoint.as_deref().unwrap();
        assert!(
            endpoint == "engine-2" || endpoint == "engine-3",
            "{endpoint}"
        );
        // The pulled blocks count as cached on the decode engine, as vLLM reports them.
        assert_eq!(r.cached_tokens, Some(((PROMPT - 1) / 16 * 16) as u64));
        // At least the 8k prefill (262 ms) and the 1.07 GB pull (89 ms).
        assert!(r.ttft_s.unwrap() > 0.35, "{r:?}");
    }
    // The same answers as an aggregated run (the decode engine computes them).
    let aggregated = run(&fleet, &workload, "precise");
    assert_eq!(aggregated.summary.errors, 0);
}

#[test]
fn over_tcp_always_pd_raises_ttft_for_long_prompts_and_the_cost_decision_does_not() {
    let fleet = fleet(&[KvRole::Both; 4], "tcp");
    let workload = long_prompts(12, 1.0);
    let aggregated = run(&fleet, &workload, "precise");
    let always = run(&fleet, &workload, "pd-always");
    let decided = run(&fleet, &workload, "pd-cost");
    let p50 = |r: &RunResult| r.summary.ttft.p50;
    // 1.07 GB at 0.55 GB/s is ~2 s on top of a 262 ms prefill.
    assert!(
        p50(&always) > p50(&aggregated) + 1.5,
        "{} vs {}",
        p50(&always),
        p50(&aggregated)
    );
    assert!(
        p50(&decided) <= p50(&aggregated) * 1.05,
        "{} vs {}",
        p50(&decided),
        p50(&aggregated)
    );
}

#[test]
fn over_infiniband_the_cost_decision_is_no_worse_than_aggregated() {
    let fleet = fleet(&[KvRole::Both; 4], "ib-400");
    let workload = long_prompts(12, 0.2);
    let aggregated = run(&fleet, &workload, "precise");
    let decided = run(&fleet, &workload, "pd-cost");
    assert_eq!(decided.summary.errors, 0);
    let p90 = |r: &RunResult| r.summary.ttft.p90;
    assert!(
        p90(&decided) <= p90(&aggregated) * 1.05,
        "{} vs {}",
        p90(&decided),
        p90(&aggregated)
    );
}

#[test]
fn a_producer_whose_blocks_are_all_held_waits_for_pulls_instead_of_stalling() {
    use KvRole::{Consumer, Producer};
    // 1300 blocks: two held 8k prompts (512 blocks each) leave no room for a third prefill
    // until a slow (tcp) pull releases one.
    let mut fleet = fleet(&[Producer, Consumer, Consumer], "tcp");
    fleet.engine.num_gpu_blocks = 1300;
    let workload = long_prompts(6, 0.05);
    let result = run(&fleet, &workload, "pd-always");
    assert_eq!(result.summary.errors, 0, "{:?}", result.records);
    assert_eq!(result.records.len(), 6);
}
