//! Properties of a simulated run: it is deterministic, its records are whole, and routing on
//! the cache beats ignoring it.

use kvroute_bench::result::RunResult;
use kvroute_bench::workload::{
    MultiTurn, SharedPrefix, Workload, from_prompts, multi_turn, shared_prefix,
};
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

/// Caches that hold one request with its output, or two prompts without theirs, on a fleet two
/// fifths busy: a request sent beside a running one of another prefix fits by its prompt, but
/// one of the two is preempted when their outputs grow. Counted by prompts alone, precise sent
/// requests to busy holders and lost to round-robin on mean TTFT by 18–27% (p99 11×); counted
/// with the output the engines report, it sends them where they fit.
#[test]
fn precise_counts_the_output_a_request_will_hold_where_a_cache_holds_few() {
    let tight = FleetConfig {
        engines: 12,
        engine: EngineConfig {
            num_gpu_blocks: 98,
            max_model_len: 1_568,
            ..EngineConfig::default()
        },
        ..FleetConfig::default()
    };
    for seed in [1, 2] {
        let questions = shared_prefix(&SharedPrefix {
            groups: 29,
            context_tokens: 379,
            questions: 12,
            question_tokens: 284,
            output_tokens: 170,
            rate_per_s: 5.8,
            seed,
        });
        let runs = simulate(
            &tight,
            &questions,
            None,
            &policies(&["round-robin", "precise"]),
        )
        .unwrap();
        let (rr, precise) = (&runs[0].summary, &runs[1].summary);
        assert_eq!(precise.errors, 0);
        assert!(
            precise.ttft.mean <= rr.ttft.mean,
            "seed {seed}: precise {:.4} s vs round-robin {:.4} s",
            precise.ttft.mean,
            rr.ttft.mean
        );
    }
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
    assert!(run.records[1].error.as_deref().unwrap().contains("400"));
    assert!(simulate(&small, &workload, None, &policies(&["nope"])).is_err());
}

/// A conversation whose turn fails ends there, and its later turns are recorded as failed: a
/// policy is measured over every request of the workload, never over fewer, easier ones.
#[test]
fn turns_after_a_failed_turn_are_recorded_as_failed() {
    let workload = chat(3);
    // Histories outgrow the engines' context by the third turn (300 + 3 × (120 + 24) tokens
    // and the chat template's).
    let mut small = fleet(2, 400);
    small.engine.max_model_len = 600;
    let run = &simulate(&small, &workload, None, &policies(&["precise"])).unwrap()[0];
    assert_eq!(run.records.len(), workload.requests());
    let failed_turn = |session: u64| {
        run.records
            .iter()
            .filter(|r| {
                r.session == session && r.error.as_deref().is_some_and(|e| e.contains("400"))
            })
            .map(|r| r.turn)
            .min()
    };
    let mut conversations_cut = 0;
    for r in &run.records {
        let Some(first_failure) = failed_turn(r.session) else {
            assert!(r.error.is_none(), "{r:?}");
            continue;
        };
        if r.turn > first_failure {
            assert_eq!(
                r.error.as_deref(),
                Some(kvroute_bench::result::RequestRecord::NOT_SENT),
                "{r:?}"
            );
            conversations_cut += usize::from(r.turn == first_failure + 1);
        }
    }
    assert!(conversations_cut > 0, "some conversation was cut short");
    assert_eq!(
        run.summary.errors as usize,
        run.records.iter().filter(|r| r.error.is_some()).count()
    );
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

mod tenants_converge {
    use std::collections::{HashMap, HashSet};

    use kvroute_bench::workload::{TenantSkew, Tenants, tenants};
    use kvroute_core::random::SeededRandom;
    use kvroute_vllm::tokenizer::BuiltinTokenizer;
    use proptest::prelude::*;

    use super::{fleet, policies};
    use kvroute_simulate::simulate;

    /// `engines + extra` tenants whose contexts of about `context` words fit the pooled cache
    /// but not one engine, asking one question at a time (no load). `None` when the contexts
    /// drawn fit one engine; else, for each tenant whose questions after its first did not all
    /// go to one endpoint, where they went. "Fit" counts whole contexts per engine, and room for
    /// the blocks of the last few questions and answers, which an engine keeps cached too
    /// (least recently used first out: with no room for them, a context's tail is evicted
    /// between its questions whatever the routing).
    fn unsettled(
        engines: usize,
        extra: usize,
        context: usize,
        seed: u64,
    ) -> Option<Vec<Vec<String>>> {
        let n = engines + extra;
        let w = tenants(&Tenants {
            tenants: n,
            context_tokens: context,
            conversations: n * 6,
            turns: 1,
            question_tokens: 40,
            length_cv: 0.0,
            output_tokens: 4,
            think_s: 0.0,
            rate_per_s: 2.0,
            skew: TenantSkew::Uniform,
            seed,
        });
        let bs = 16;
        let contexts: Vec<&String> = w
            .sessions
            .iter()
            .filter_map(|s| s.system.as_ref())
            .collect();
        let distinct: HashSet<&String> = contexts.iter().copied().collect();
        let working: usize = distinct
            .iter()
            .map(|c| BuiltinTokenizer.encode(c).len() / bs + 1)
            .sum();
        let longest = distinct
            .iter()
            .map(|c| BuiltinTokenizer.encode(c).len() / bs + 1)
            .max()
            .unwrap();
        // Each engine holds its share of whole contexts, rounded up, and 48 blocks of
        // questions and answers; one engine holds less than all of the contexts.
        let blocks = n.div_ceil(engines) * longest + 48;
        if blocks >= working {
            return None;
        }
        // No load: one question at a time (a closed loop of one).
        let runs = simulate(
            &fleet(engines, blocks),
            &w,
            Some(1),
            &policies(&["precise"]),
        )
        .unwrap();
        let mut homes: HashMap<&String, Vec<String>> = HashMap::new();
        for r in &runs[0].records {
            let context = w.sessions[r.session as usize].system.as_ref().unwrap();
            homes
                .entry(context)
                .or_default()
                .push(r.endpoint.clone().unwrap());
        }
        Some(
            homes
                .into_values()
                .filter(|endpoints| endpoints.iter().skip(1).collect::<HashSet<_>>().len() > 1)
                .collect(),
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 6, ..ProptestConfig::default() })]

        /// After each tenant's first question, every question of a tenant goes to one
        /// endpoint, which holds its context ([`unsettled`]'s load).
        #[test]
        fn each_context_settles_on_one_endpoint(
            engines in 2usize..5,
            extra in 1usize..4,
            context in 300usize..700,
            seed in 0u64..1000,
        ) {
            let unsettled = unsettled(engines, extra, context, seed);
            prop_assume!(unsettled.is_some());
            let unsettled = unsettled.unwrap();
            prop_assert!(unsettled.is_empty(), "a tenant's questions went to {unsettled:?}");
        }
    }

    /// The inputs the property failed on while balancing could place a new context where its
    /// blocks overflowed the cache, and while an endpoint with no reuse measured yet priced what
    /// it evicts at nothing: the one a CI run drew, and the six of a grid of 999 (see
    /// docs/benchmarks.md). Then while balancing put a new context where it filled a cache that
    /// two contexts already half filled, because its placements were fewer by a hundredth (the
    /// same placements at other ages): the one a later CI run drew, and four more of 24,294 that a
    /// sweep like [`the_property_holds_across_its_domain`] drew. Three others of that sweep are
    /// left out, (2, 3, 321, 923), (2, 3, 367, 937) and (3, 3, 300, 160): an engine stores more
    /// blocks of one hot tenant's questions between another tenant's two questions than the 48
    /// the premise allows (13 to 15 questions of about 4 blocks), unless the tenants that turn
    /// hot happen to sit apart. Each must still meet the property's premise (`expect`).
    #[test]
    fn the_inputs_that_failed_settle() {
        let failed = [
            (2, 3, 326, 137),
            (2, 2, 500, 2),
            (2, 3, 350, 4),
            (3, 3, 300, 137),
            (3, 3, 300, 5),
            (3, 3, 350, 7),
            (3, 3, 650, 7),
            (3, 3, 358, 972),
            (3, 2, 332, 697),
            (3, 3, 316, 967),
            (3, 3, 307, 232),
            (3, 3, 336, 186),
        ];
        for (engines, extra, context, seed) in failed {
            let unsettled = unsettled(engines, extra, context, seed).expect("the contexts fit");
            assert!(
                unsettled.is_empty(),
                "{engines} engines, {extra} extra tenants, context {context}, seed {seed}: {unsettled:?}"
            );
        }
    }

    /// The property over 26,000 inputs of its domain (drawn by a seeded generator, so every run
    /// draws the same), of which about 24,300 meet its premise: it fails on at most one in 10,000
    /// (a CI run tries six). A measurement, as run for docs/benchmarks.md: about a minute in a
    /// release build (`cargo test --release -p kvroute-simulate --test properties --
    /// --ignored`).
    #[test]
    #[ignore]
    fn the_property_holds_across_its_domain() {
        let (mut premise, mut failed) = (0usize, Vec::new());
        for k in 0..26_000u64 {
            let mut draw = SeededRandom::new(k);
            let engines = 2 + draw.below(3);
            let extra = 1 + draw.below(3);
            let context = 300 + draw.below(400);
            let seed = draw.below(1000) as u64;
            if let Some(unsettled) = unsettled(engines, extra, context, seed) {
                premise += 1;
                if !unsettled.is_empty() {
                    failed.push(((engines, extra, context, seed), unsettled));
                }
            }
        }
        println!(
            "{premise} inputs meet the premise; {} fail: {failed:?}",
            failed.len()
        );
        assert!(
            failed.len() * 10_000 <= premise,
            "{} of {premise} fail: {failed:?}",
            failed.len()
        );
    }
}
