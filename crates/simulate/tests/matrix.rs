//! The small scheduler matrix, as a regression test: twelve tenants whose contexts fit the
//! pooled cache but not one engine, at a light and a heavy load. Precise must stay within 90%
//! of the pooled-cache ceiling's hit rate and at most 1.05× the best other policy's TTFT
//! percentiles. A rule that copies every tenant's context everywhere once caches fill (the
//! `replicate_shared_above` rule this test was written against) makes the copies evict each
//! other and fails both.

use kvroute_simulate::FleetConfig;
use kvroute_simulate::matrix::{MatrixSpec, report, run_matrix};

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
        let precise = r.figures("precise").expect("precise ran");
        assert!(
            r.fits(),
            "the small matrix's cells fit the pooled cache\n{table}"
        );
        assert!(
            precise.hit_rate >= 0.9 * r.ceiling,
            "hit rate {:.3} below 90% of the ceiling {:.3}\n{table}",
            precise.hit_rate,
            r.ceiling
        );
        let ratios = r.precise_over_best_other().expect("other policies ran");
        for (name, ratio) in ["p50", "p90", "p99"].iter().zip(ratios) {
            assert!(
                ratio <= 1.05,
                "TTFT {name} {ratio:.2}× the best other policy's\n{table}"
            );
        }
    }
}
