use proptest::prelude::*;

use super::*;

/// A successful record with the given TTFT, E2E and token counts.
fn ok(ttft_s: f64, e2e_s: f64) -> RequestRecord {
    RequestRecord {
        ttft_s: Some(ttft_s),
        e2e_s,
        prompt_tokens: 100,
        completion_tokens: 10,
        ..RequestRecord::default()
    }
}

fn failed() -> RequestRecord {
    RequestRecord {
        ttft_s: None,
        e2e_s: 1000.0,
        itl_s: vec![1000.0],
        prompt_tokens: 100,
        completion_tokens: 7,
        error: Some("connection reset".to_owned()),
        ..RequestRecord::default()
    }
}

fn on(endpoint: &str, mut record: RequestRecord) -> RequestRecord {
    record.endpoint = Some(endpoint.to_owned());
    record
}

/// `actual` is `expected` within the histograms' 3-significant-digit precision.
fn close(actual: f64, expected: f64) -> bool {
    (actual - expected).abs() <= expected.abs() * 1e-3 + 1e-6
}

#[test]
fn empty_input_gives_zeros() {
    let summary = summarize(&[], 0.0);
    assert_eq!(summary.requests, 0);
    assert_eq!(summary.errors, 0);
    assert_eq!(summary.requests_per_s, 0.0);
    assert_eq!(summary.output_tokens_per_s, 0.0);
    assert_eq!(summary.ttft, Percentiles::default());
    assert_eq!(summary.e2e, Percentiles::default());
    assert_eq!(summary.itl, Percentiles::default());
    assert_eq!(summary.hit_rate, 0.0);
    assert_eq!(summary.engine_hit_rate, None);
    assert!(summary.endpoints.is_empty());
    assert_eq!(summary.load_imbalance, 1.0);

    let summary = summarize(&[], 10.0);
    assert_eq!(summary.duration_s, 10.0);
    assert_eq!(summary.requests_per_s, 0.0);
}

#[test]
fn ttft_percentiles_of_1_to_100_ms() {
    let records: Vec<_> = (1..=100)
        .map(|ms| ok(f64::from(ms) / 1000.0, 1.0))
        .collect();
    let summary = summarize(&records, 10.0);
    let ttft = &summary.ttft;
    assert_eq!(ttft.count, 100);
    assert!(close(ttft.p50, 0.050), "p50 {}", ttft.p50);
    assert!(close(ttft.p90, 0.090), "p90 {}", ttft.p90);
    assert!(close(ttft.p99, 0.099), "p99 {}", ttft.p99);
    assert!((ttft.mean - 0.0505).abs() < 1e-12, "mean {}", ttft.mean);
    assert_eq!(summary.e2e.count, 100);
    assert!(close(summary.e2e.p50, 1.0));
    assert_eq!(summary.requests_per_s, 10.0);
    assert_eq!(summary.output_tokens_per_s, 100.0);
}

#[test]
fn errors_are_counted_but_excluded_from_latency_and_throughput() {
    let mut records = vec![ok(0.010, 0.5), ok(0.020, 0.5), failed(), failed()];
    records[0].itl_s = vec![0.001, 0.002];
    let summary = summarize(&records, 2.0);
    assert_eq!(summary.requests, 4);
    assert_eq!(summary.errors, 2);
    assert_eq!(summary.requests_per_s, 1.0);
    assert_eq!(summary.output_tokens_per_s, 10.0);
    assert_eq!(summary.ttft.count, 2);
    assert_eq!(summary.e2e.count, 2);
    assert!(close(summary.e2e.p99, 0.5));
    assert_eq!(summary.itl.count, 2);
    assert!(close(summary.itl.p99, 0.002));
    assert!((summary.itl.mean - 0.0015).abs() < 1e-12);
}

#[test]
fn missing_and_non_finite_values_are_skipped() {
    let mut no_ttft = ok(0.0, 0.25);
    no_ttft.ttft_s = None;
    let mut nan = ok(f64::NAN, 0.25);
    nan.itl_s = vec![f64::INFINITY, 0.003];
    let summary = summarize(&[no_ttft, nan, ok(0.004, 0.25)], 1.0);
    assert_eq!(summary.ttft.count, 1);
    assert!(close(summary.ttft.p50, 0.004));
    assert_eq!(summary.e2e.count, 3);
    assert_eq!(summary.itl.count, 1);
}

#[test]
fn hit_rate_over_reporting_records() {
    let mut a = ok(0.01, 0.1);
    a.prompt_tokens = 1000;
    a.cached_tokens = Some(500);
    let mut b = ok(0.01, 0.1);
    b.prompt_tokens = 3000;
    b.cached_tokens = Some(2500);
    let mut c = ok(0.01, 0.1);
    c.prompt_tokens = 10_000;
    c.cached_tokens = None; // Not reported: left out of both sums.
    let summary = summarize(&[a, b, c], 1.0);
    assert!(
        (summary.hit_rate - 0.75).abs() < 1e-12,
        "{}",
        summary.hit_rate
    );

    // Nobody reported: 0.
    assert_eq!(summarize(&[ok(0.01, 0.1)], 1.0).hit_rate, 0.0);
}

#[test]
fn endpoint_shares_are_sorted_and_summed() {
    let mut r1 = on("b", ok(0.01, 0.1));
    r1.cached_tokens = Some(40);
    let r2 = on("a", ok(0.01, 0.1));
    let mut r3 = on("b", failed());
    r3.cached_tokens = None;
    let r4 = ok(0.01, 0.1); // No endpoint: grouped under "-".
    let summary = summarize(&[r1, r2, r3, r4], 1.0);
    let names: Vec<&str> = summary
        .endpoints
        .iter()
        .map(|e| e.endpoint.as_str())
        .collect();
    assert_eq!(names, ["-", "a", "b"]);
    let b = &summary.endpoints[2];
    assert_eq!(b.requests, 2);
    assert_eq!(b.prompt_tokens, 200);
    assert_eq!(b.cached_tokens, 40);
    assert_eq!(summary.endpoints[0].requests, 1);
    // Over the named endpoints a (1) and b (2): 2 / 1.5.
    assert!((summary.load_imbalance - 2.0 / 1.5).abs() < 1e-12);
}

#[test]
fn load_imbalance_of_10_10_20() {
    let mut records = Vec::new();
    for (name, n) in [("e0", 10), ("e1", 10), ("e2", 20)] {
        records.extend((0..n).map(|_| on(name, ok(0.01, 0.1))));
    }
    let summary = summarize(&records, 1.0);
    assert!((summary.load_imbalance - 20.0 / (40.0 / 3.0)).abs() < 1e-12);
    assert!((summary.load_imbalance - 1.5).abs() < 1e-12);
}

#[test]
fn a_fleet_whose_requests_all_went_to_one_of_four_endpoints_is_imbalanced_4_to_1() {
    // The records alone name only the endpoint that was used: 1.0, as if it were balanced.
    let records: Vec<_> = (0..8).map(|_| on("e2", ok(0.01, 0.1))).collect();
    let mut summary = summarize(&records, 1.0);
    assert_eq!(summary.load_imbalance, 1.0);
    count_idle_endpoints(&mut summary, ["e0", "e1", "e2", "e3"]);
    assert!((summary.load_imbalance - 4.0).abs() < 1e-12);
    let names: Vec<(&str, u64)> = summary
        .endpoints
        .iter()
        .map(|e| (e.endpoint.as_str(), e.requests))
        .collect();
    assert_eq!(names, [("e0", 0), ("e1", 0), ("e2", 8), ("e3", 0)]);
    // The used endpoint keeps its counts; adding the fleet again changes nothing.
    assert_eq!(
        summary.endpoints[2].prompt_tokens,
        records.len() as u64 * 100
    );
    count_idle_endpoints(&mut summary, ["e0", "e1", "e2", "e3"]);
    assert_eq!(summary.endpoints.len(), 4);
}

#[test]
fn load_imbalance_with_one_endpoint_or_none() {
    let one: Vec<_> = (0..5).map(|_| on("only", ok(0.01, 0.1))).collect();
    assert_eq!(summarize(&one, 1.0).load_imbalance, 1.0);
    let none: Vec<_> = (0..5).map(|_| ok(0.01, 0.1)).collect();
    let summary = summarize(&none, 1.0);
    assert_eq!(summary.load_imbalance, 1.0);
    assert_eq!(summary.endpoints.len(), 1);
    assert_eq!(summary.endpoints[0].endpoint, UNKNOWN_ENDPOINT);
    assert_eq!(summary.endpoints[0].requests, 5);
}

#[test]
fn bad_duration_gives_zero_rates() {
    for duration in [0.0, -1.0, f64::NAN] {
        let summary = summarize(&[ok(0.01, 0.1)], duration);
        assert_eq!(summary.requests_per_s, 0.0);
        assert_eq!(summary.output_tokens_per_s, 0.0);
    }
}

proptest! {
    #[test]
    fn percentiles_are_ordered_and_within_range(
        ttfts in proptest::collection::vec(0.0f64..120.0, 1..200),
    ) {
        let records: Vec<_> = ttfts.iter().map(|&t| ok(t, t)).collect();
        let summary = summarize(&records, 1.0);
        let min = ttfts.iter().copied().fold(f64::INFINITY, f64::min);
        let max = ttfts.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        for p in [&summary.ttft, &summary.e2e] {
            prop_assert_eq!(p.count, ttfts.len() as u64);
            prop_assert!(p.p50 <= p.p90 && p.p90 <= p.p99, "{:?}", p);
            // One microsecond of rounding plus 0.1% of HDR precision either way.
            let low = min * (1.0 - 1e-3) - 1e-6;
            let high = max * (1.0 + 1e-3) + 1e-6;
            for v in [p.p50, p.p90, p.p99, p.mean] {
                prop_assert!(low <= v && v <= high, "{} not in [{}, {}]", v, min, max);
            }
        }
    }
}

#[test]
fn prediction_errors_are_summarized_with_their_sign() {
    // Ten requests: eight a millisecond late, one 50 ms early, one 200 ms late; a broken value
    // left out.
    let mut errors = vec![0.001; 8];
    errors.extend([-0.05, 0.2, f64::NAN]);
    let summary = prediction_error(&errors).unwrap();
    assert_eq!(summary.count, 10);
    assert!(close(summary.mean_s, (0.008 - 0.05 + 0.2) / 10.0));
    assert!(close(summary.mean_abs_s, (0.008 + 0.05 + 0.2) / 10.0));
    assert!(close(summary.p10_s, -0.05), "{summary:?}");
    assert!(close(summary.p50_s, 0.001));
    assert!(close(summary.p90_s, 0.001), "the 9th of 10: {summary:?}");
    assert_eq!(prediction_error(&[]), None);
    assert_eq!(prediction_error(&[f64::INFINITY]), None);
}
