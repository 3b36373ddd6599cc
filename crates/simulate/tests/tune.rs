//! The tuner's split and search, on small simulated workloads.

use kvroute_bench::workload::{MultiTurn, multi_turn};
use kvroute_core::schedule::Profile;
use kvroute_sim::engine::EngineConfig;
use kvroute_simulate::FleetConfig;
use kvroute_simulate::tune::{Case, Objective, PARAMS, Split, TuneConfig, split, tune, tune_cases};

fn params() -> MultiTurn {
    MultiTurn {
        users: 12,
        turns: 3,
        system_tokens: 200,
        user_tokens: 100,
        output_tokens: 8,
        think_s: 0.5,
        rate_per_s: 4.0,
        seed: 3,
    }
}

fn workload() -> kvroute_bench::workload::Workload {
    multi_turn(&params())
}

#[test]
fn the_split_keeps_every_session_once_and_time_holds_out_the_latest() {
    let w = workload();
    for how in [Split::Session, Split::Time] {
        let (tuning, held) = split(&w, 0.25, how);
        assert_eq!(held.sessions.len(), 3);
        let mut ids: Vec<u64> = tuning
            .sessions
            .iter()
            .chain(&held.sessions)
            .map(|s| s.id)
            .collect();
        ids.sort_unstable();
        assert_eq!(ids, (0..12).collect::<Vec<u64>>());
        assert_eq!(
            held.sessions[0].start_s, 0.0,
            "each part starts at its first arrival"
        );
    }
    let (tuning, held) = split(&w, 0.25, Split::Time);
    let last_tuned = tuning.sessions.iter().map(|s| s.id).max().unwrap();
    assert!(held.sessions.iter().all(|s| s.id > last_tuned));
}

/// Sessions started per second over a workload's span of arrivals.
fn arrival_rate(w: &kvroute_bench::workload::Workload) -> f64 {
    let first = w
        .sessions
        .iter()
        .map(|s| s.start_s)
        .fold(f64::INFINITY, f64::min);
    let last = w.sessions.iter().map(|s| s.start_s).fold(0.0, f64::max);
    (w.sessions.len() - 1) as f64 / (last - first)
}

#[test]
fn every_part_is_replayed_at_the_wholes_offered_rate() {
    let w = multi_turn(&MultiTurn {
        users: 400,
        rate_per_s: 20.0,
        ..params()
    });
    let whole = arrival_rate(&w);
    for how in [Split::Session, Split::Time] {
        let (tuning, held) = split(&w, 0.3, how);
        for part in [&tuning, &held] {
            let rate = arrival_rate(part);
            assert!(
                (rate / whole - 1.0).abs() < 0.15,
                "{how:?}: a part arrives at {rate:.1}/s, the whole at {whole:.1}/s"
            );
        }
    }
}

/// Two engines of 300 blocks: small enough for several simulations per test.
fn small_fleet() -> FleetConfig {
    FleetConfig {
        engines: 2,
        engine: EngineConfig {
            num_gpu_blocks: 300,
            ..EngineConfig::default()
        },
        ..FleetConfig::default()
    }
}

#[test]
fn the_search_starts_from_the_given_profile_and_reports_the_held_out_part() {
    let fleet = small_fleet();
    let config = TuneConfig {
        objective: Objective::TtftP90,
        max_imbalance: 10.0,
        trials: 4,
        holdout: 0.25,
        split: Split::Session,
        seed: 1,
    };
    let start = Profile::default();
    let mut calls = Vec::new();
    let outcome = tune(
        &fleet,
        &workload(),
        None,
        &start,
        &config,
        &mut |done, total| {
            calls.push((done, total));
        },
    )
    .unwrap();
    assert_eq!(outcome.trials.len(), 4);
    let first: Vec<f64> = PARAMS.iter().map(|p| p.get(&start)).collect();
    assert_eq!(
        outcome.trials[0].values, first,
        "trial 0 is the starting profile"
    );
    assert_eq!(calls.last(), Some(&(6, 6)), "progress reaches its total");
    assert_eq!(outcome.cases[0].baseline.summary.requests, 9);
    assert_eq!(outcome.cases[0].tuned.summary.requests, 9);
    let best_trial = outcome
        .trials
        .iter()
        .filter(|t| t.feasible)
        .map(|t| t.value)
        .fold(f64::INFINITY, f64::min);
    assert!(
        outcome.trials[0].feasible,
        "the starting profile is never ruled out"
    );
    assert!(best_trial <= outcome.trials[0].value);
    let argmin = outcome
        .trials
        .iter()
        .filter(|t| t.feasible)
        .min_by(|a, b| a.value.total_cmp(&b.value))
        .unwrap();
    let best_values: Vec<f64> = PARAMS.iter().map(|p| p.get(&outcome.best)).collect();
    assert_eq!(
        best_values, argmin.values,
        "the best profile is the feasible minimum"
    );
    for p in &PARAMS {
        let v = p.get(&outcome.best);
        assert!(
            (p.low..=p.high).contains(&v) || v == p.get(&start),
            "{} = {v}",
            p.name
        );
    }
}

#[test]
fn several_workloads_are_tuned_together_relative_to_the_defaults() {
    let fleet = small_fleet();
    let cases: Vec<Case> = [3u64, 4]
        .iter()
        .map(|&seed| Case {
            name: format!("seed {seed}"),
            fleet: fleet.clone(),
            workload: multi_turn(&MultiTurn { seed, ..params() }),
            concurrency: None,
        })
        .collect();
    let config = TuneConfig {
        objective: Objective::TtftP90,
        max_imbalance: 1.25,
        trials: 3,
        holdout: 0.25,
        split: Split::Time,
        seed: 2,
    };
    let outcome = tune_cases(&cases, &Profile::default(), &config, &mut |_, _| {}).unwrap();
    assert!(
        (outcome.trials[0].value - 1.0).abs() < 1e-12,
        "the defaults score 1"
    );
    assert_eq!(outcome.cases.len(), 2);
    assert_eq!(outcome.cases[1].name, "seed 4");
}
