//! Properties of a simulated run: it is deterministic, its records are whole, and routing on
//! the cache beats ignoring it.

use kvroute_bench::result::RunResult;
use kvroute_bench::workload::{MultiTurn, Workload, from_prompts, multi_turn};
use kvroute_sim::engine::EngineConfig;
use kvroute_simulate::{FleetConfig, simulate};

fn fleet(engines: usize, blocks: usize) -> FleetConfig {
    FleetConfig {
        engines,
        engine: EngineConfig {
            num_gpu_blocks: blocks,
            ..EngineConfig::default()
        },
        ..FleetConfig::default()
    }
}

fn chat(seed: u64) -> Workload {
    multi_turn(&MultiTurn {
        users: 12,
        turns: 4,
        system_tokens: 300,
        user_tokens: 120,
        output_tokens: 24,
        think_s: 0.5,
        rate_per_s: 4.0,
        seed,
    })
}

fn policies(names: &[&str]) -> Vec<String> {
    names.iter().map(|s| (*s).to_owned()).collect()
}

#[test]
fn the_same_seed_gives_the_same_result() {
    let names = policies(&["random", "precise"]);
    let a = simulate(&fleet(3, 300), &chat(7), None, &names).unwrap();
    let b = simulate(&fleet(3, 300), &chat(7), None, &names).unwrap();
    assert_eq!(a, b);
    let c = simulate(&fleet(3, 300), &chat(8), None, &names).unwrap();
    assert_ne!(a[0].records, c[0].records, "another seed, another workload");
}

#[test]
fn every_request_is_recorded_with_its_timings() {
    let workload = chat(3);
    let runs = simulate(&fleet(2, 400), &workload, None, &policies(&["least-load"])).unwrap();
    let run = &runs[0];
    assert_eq!(run.records.len(), workload.requests());
    assert_eq!(run.summary.errors, 0);
    for r in &run.records {
        let ttft = r.ttft_s.unwrap();
        assert!(ttft > 0.0 && ttft < r.e2e_s, "{r:?}");
        assert_eq!(r.completion_tokens, 24);
        assert_eq!(r.itl_s.len(), 23);
        assert!(
            r.endpoint
                .as_deref()
                .is_some_and(|e| e.starts_with("engine-"))
        );
    }
    // A conversation's turns follow each other: each starts after the previous answer.
    for pair in run.records.windows(2) {
        if pair[0].session == pair[1].session {
            assert!(pair[1].start_s >= pair[0].start_s + pair[0].e2e_s);
        }
    }
    let json = serde_json::to_string(run).unwrap();
    let back: RunResult = serde_json::from_str(&json).unwrap();
    assert_eq!(back.records.len(), run.records.len(), "bench's JSON shape");
}

#[test]
fn precise_routing_beats_round_robin_on_multi_turn_hit_rate() {
    let runs = simulate(
        &fleet(4, 400),
        &chat(11),
        None,
        &policies(&["round-robin", "precise"]),
    )
    .unwrap();
    let (rr, precise) = (&runs[0].summary, &runs[1].summary);
    assert!(
        precise.hit_rate > rr.hit_rate + 0.15,
        "precise {:.3} vs round-robin {:.3}",
        precise.hit_rate,
        rr.hit_rate
    );
    assert!(precise.ttft.p50 < rr.ttft.p50);
}

#[test]
fn refused_requests_are_errors_and_unknown_policies_are_refused() {
    let workload = from_prompts(
        serde_json::json!({"workload": "test"}),
        vec![(0.0, vec![300; 100], 4), (0.1, vec![301; 5000], 4)],
    );
    let mut small = fleet(1, 64);
    small.engine.max_model_len = 1000;
    let run = &simulate(&small, &workload, Some(1), &policies(&["precise"])).unwrap()[0];
    assert!(run.records[0].error.is_none());
    assert!(run.records[1].error.as_deref().unwrap().contains("413"));
    assert!(simulate(&small, &workload, None, &policies(&["nope"])).is_err());
}

#[test]
fn a_closed_loop_runs_at_most_that_many_sessions_at_once() {
    let workload = chat(5);
    let run = &simulate(&fleet(2, 400), &workload, Some(2), &policies(&["precise"])).unwrap()[0];
    assert_eq!(run.summary.errors, 0);
    let mut spans: Vec<(f64, f64)> = Vec::new();
    for session in 0..workload.sessions.len() as u64 {
        let turns: Vec<_> = run
            .records
            .iter()
            .filter(|r| r.session == session)
            .collect();
        let last = turns.last().unwrap();
        spans.push((turns[0].start_s, last.start_s + last.e2e_s));
    }
    for (start, _) in &spans {
        let open = spans
            .iter()
            .filter(|(s, e)| s <= start && start < e)
            .count();
        assert!(open <= 2, "{open} sessions at once at {start}");
    }
}
