//! The small scheduler matrix, as a regression test: twelve tenants whose contexts fit the
//! pooled cache but not one engine, at a light and a heavy load, medians of three seeds (as the
//! targets are). Precise must stay within 90% of the pooled-cache ceiling's hit rate and at most
//! 1.05× the best other policy's TTFT percentiles; at the light load, nine in ten questions must
//! find their tenant's context, so its TTFT p90 is a cache hit's, at most half of round-robin's
//! (a miss's). A rule that copies contexts to other engines once caches fill (the
//! `replicate_shared_above` rule this test was written against) makes the copies evict each
//! other and fails that.

use kvroute_simulate::FleetConfig;
use kvroute_simulate::matrix::report::{HIT_TARGET_SHARE, TTFT_TARGET_RATIO};
use kvroute_simulate::matrix::{Kind, MatrixSpec, report, run_matrix};

#[test]
fn precise_holds_the_ceiling_and_the_best_ttft_on_the_small_matrix() {
    let results = run_matrix(
        &MatrixSpec::small(),
        &FleetConfig::default(),
        &mut |_, _| {},
    )
    .expect("the matrix runs");
    let table = report::table(&results);
    assert_eq!(results.len(), 2, "{table}");
    for r in &results {
        for p in &r.policies {
            assert_eq!(
                p.errors, 0.0,
                "{}: every engine holds every request\n{table}",
                p.policy
            );
        }
        let precise = r.figures("precise").expect("precise ran");
        assert!(
            r.fits(),
            "the small matrix's cells fit the pooled cache\n{table}"
        );
        assert!(
            precise.hit_rate >= HIT_TARGET_SHARE * r.ceiling,
            "hit rate {:.3} below {HIT_TARGET_SHARE} of the ceiling {:.3}\n{table}",
            precise.hit_rate,
            r.ceiling
        );
        if r.cell.load_ratio < 0.5 {
            let round_robin = r.figures("round-robin").expect("round-robin ran");
            assert!(
                precise.ttft_p90 <= 0.5 * round_robin.ttft_p90,
                "at light load TTFT p90 {:.1} ms is not a hit's (round-robin {:.1} ms)\n{table}",
                precise.ttft_p90 * 1e3,
                round_robin.ttft_p90 * 1e3
            );
        }
        let ratios = r.precise_over_best_other().expect("other policies ran");
        for (name, ratio) in ["p50", "p90", "p99"].iter().zip(ratios) {
            assert!(
                ratio <= TTFT_TARGET_RATIO,
                "TTFT {name} {ratio:.2}× the best other policy's\n{table}"
            );
        }
    }
}

#[test]
fn a_conversations_longest_turn_fits_every_engine_of_the_smallest_cell() {
    // Chats at the floor: the third turn's prompt (the context, two questions and answers and
    // its question) and reply must fit an engine, or every policy fails the same requests and
    // the ceiling counts hits none of them can have.
    let spec = MatrixSpec {
        kinds: vec![Kind::TenantChats],
        tenants: vec![4],
        context_tokens: vec![2000],
        cache_ratios: vec![0.25],
        load_ratios: vec![0.3],
        seeds: vec![2],
        policies: vec!["round-robin".to_owned()],
        requests: 120,
        question_tokens: 100,
        output_tokens: 32,
    };
    let results = run_matrix(&spec, &FleetConfig::default(), &mut |_, _| {}).expect("runs");
    let table = report::table(&results);
    for r in &results {
        for p in &r.policies {
            assert_eq!(p.errors, 0.0, "{}\n{table}", p.policy);
        }
    }
}
