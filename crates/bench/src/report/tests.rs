//! Unit tests of the report module: table figures, HTML escaping, chart geometry, edge cases and
//! the JSON round trip.

use super::charts::{endpoint_counts, endpoint_labels, rolling_median, ttft_cdf_points};
use super::svg::Scale;
use super::*;
use crate::result::{EndpointShare, Percentiles, RequestRecord, Summary, TierTokens};

/// A run with known figures and `n` records cycling over four endpoints.
fn run(name: &str, ttft_base: f64, hit: f64, n: usize) -> RunResult {
    let records = (0..n)
        .map(|i| RequestRecord {
            session: i as u64,
            turn: 0,
            start_s: i as f64 * 0.1,
            ttft_s: Some(ttft_base * (1.0 + (i % 10) as f64 / 10.0)),
            itl_s: vec![0.01, 0.012],
            e2e_s: ttft_base + 0.5,
            prompt_tokens: 1000,
            completion_tokens: 50,
            cached_tokens: Some((1000.0 * hit) as u64),
            endpoint: Some(format!("e{}", i % 4)),
            error: None,
        })
        .collect();
    RunResult {
        name: name.to_string(),
        config: serde_json::json!({ "policy": name }),
        summary: Summary {
            requests: n as u64,
            errors: 2,
            duration_s: 60.0,
            requests_per_s: 3.3333,
            output_tokens_per_s: 1234.56,
            ttft: Percentiles {
                p50: 0.1234,
                p90: 0.4567,
                p99: 1.5,
                mean: 0.2,
                count: n as u64,
            },
            e2e: Percentiles {
                p50: 2.0,
                p90: 3.0,
                p99: 4.25,
                mean: 2.5,
                count: n as u64,
            },
            itl: Percentiles {
                p50: 0.0125,
                p90: 0.02,
                p99: 0.0456,
                mean: 0.013,
                count: n as u64,
            },
            hit_rate: hit,
            engine_hit_rate: Some(0.5),
            endpoints: (0..4)
                .map(|e| EndpointShare {
                    endpoint: format!("e{e}"),
                    requests: (n / 4) as u64,
                    prompt_tokens: 0,
                    cached_tokens: 0,
                })
                .collect(),
            load_imbalance: 1.25,
            tier_tokens: None,
            ttft_prediction_error: None,
        },
        records,
    }
}

#[test]
fn table_shows_names_and_figures() {
    let t = table(&[
        run("round-robin", 0.3, 0.1, 40),
        run("precise", 0.05, 0.8, 40),
    ]);
    let lines: Vec<&str> = t.lines().collect();
    assert!(
        lines[0].contains("round-robin") && lines[0].contains("precise"),
        "{t}"
    );
    let row = |label: &str| {
        lines
            .iter()
            .find(|l| l.starts_with(label))
            .unwrap_or_else(|| panic!("no row {label} in\n{t}"))
            .split_whitespace()
            .rev()
            .take(2)
            .collect::<Vec<_>>()
    };
    assert_eq!(row("requests"), ["40", "40"]);
    assert_eq!(row("errors"), ["2", "2"]);
    assert_eq!(row("req/s"), ["3.33", "3.33"]);
    assert_eq!(row("output tok/s"), ["1234.6", "1234.6"]);
    assert_eq!(row("prefix-cache hit rate"), ["80.0%", "10.0%"]);
    assert_eq!(row("engine hit rate"), ["50.0%", "50.0%"]);
    assert_eq!(row("TTFT p50 (ms)"), ["123.4", "123.4"]);
    assert_eq!(row("TTFT p90 (ms)"), ["456.7", "456.7"]);
    assert_eq!(row("TTFT p99 (ms)"), ["1500", "1500"]);
    assert_eq!(row("TTFT mean (ms)"), ["200.0", "200.0"]);
    assert_eq!(row("E2E p50 (ms)"), ["2000", "2000"]);
    assert_eq!(row("E2E p99 (ms)"), ["4250", "4250"]);
    assert_eq!(row("ITL p50 (ms)"), ["12.5", "12.5"]);
    assert_eq!(row("ITL p99 (ms)"), ["45.6", "45.6"]);
    assert_eq!(row("load imbalance"), ["1.25", "1.25"]);
    // Columns line up: every line as long as the separator.
    let width = lines[1].chars().count();
    assert!(lines[2..].iter().all(|l| l.chars().count() == width), "{t}");
}

#[test]
fn table_marks_missing_figures() {
    let mut r = run("no-success", 0.1, 0.0, 0);
    r.summary.ttft = Percentiles::default();
    r.summary.engine_hit_rate = None;
    let t = table(&[r]);
    assert!(!t.contains("engine hit rate"), "{t}");
    let ttft = t.lines().find(|l| l.starts_with("TTFT p50")).unwrap();
    assert!(ttft.trim_end().ends_with('-'), "{t}");
    assert_eq!(table(&[]), "(no runs)\n");
}

/// The runs of `kvroute demo --offload` carry, per run, the prompt tokens the engines found on
/// the GPU and loaded from each tier; the table shows them next to each other, `-` for a run
/// that did not read them, and no tier rows at all when no run did.
#[test]
fn table_shows_tokens_by_tier_when_runs_have_them() {
    let mut gpu_only = run("gpu-only", 0.3, 0.2, 8);
    gpu_only.summary.tier_tokens = Some(TierTokens {
        gpu: 4000,
        ..TierTokens::default()
    });
    let mut tiered = run("tier-aware", 0.1, 0.6, 8);
    tiered.summary.tier_tokens = Some(TierTokens {
        gpu: 5000,
        cpu: 2400,
        ssd: 160,
        shared_fs: 32,
    });
    let live = run("live", 0.1, 0.6, 8);
    let t = table(&[gpu_only, tiered, live.clone()]);
    let row = |label: &str| {
        t.lines()
            .find(|l| l.starts_with(label))
            .unwrap_or_else(|| panic!("no row {label} in\n{t}"))
            .split_whitespace()
            .rev()
            .take(3)
            .collect::<Vec<_>>()
    };
    assert_eq!(row("tokens found on GPU"), ["-", "5000", "4000"]);
    assert_eq!(row("tokens loaded from CPU"), ["-", "2400", "0"]);
    assert_eq!(row("tokens loaded from SSD"), ["-", "160", "0"]);
    assert_eq!(row("tokens loaded from shared FS"), ["-", "32", "0"]);
    let without = table(&[live]);
    assert!(!without.contains("tokens loaded"), "{without}");
}

/// A result file written before the tier figures existed still loads, without them; one with
/// them reads them back.
#[test]
fn result_files_load_with_and_without_tier_tokens() {
    let mut old = serde_json::to_value(run("old", 0.1, 0.5, 2)).unwrap();
    old["summary"]
        .as_object_mut()
        .unwrap()
        .remove("tier_tokens")
        .expect("the field is written");
    let back: RunResult = serde_json::from_value(old).expect("an old file loads");
    assert_eq!(back.summary.tier_tokens, None);
    let mut new = run("new", 0.1, 0.5, 2);
    new.summary.tier_tokens = Some(TierTokens {
        gpu: 1,
        cpu: 2,
        ssd: 3,
        shared_fs: 4,
    });
    let text = serde_json::to_string(&new).unwrap();
    let back: RunResult = serde_json::from_str(&text).unwrap();
    assert_eq!(back.summary.tier_tokens, new.summary.tier_tokens);
}

#[test]
fn html_escapes_names() {
    let evil = "<script>alert('x')</script> & \"co\"";
    let mut a = run(evil, 0.2, 0.3, 20);
    a.records[0].endpoint = Some("<b>e9</b>".into());
    a.summary.endpoints[0].endpoint = "<img src=x>".into();
    a.records[1].error = Some("<oops>".into());
    let page = html(&[a, run("ok", 0.1, 0.6, 20)], "<title> & co");
    assert!(!page.contains("<script"), "unescaped script tag");
    assert!(!page.contains("<img"), "unescaped endpoint name");
    assert!(!page.contains("<oops>"), "unescaped error");
    assert!(!page.contains("<title> & co"), "unescaped title");
    assert!(page.contains("&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt; &amp; &quot;co&quot;"));
    assert!(page.contains("&lt;img src=x&gt;"));
}

#[test]
fn html_has_the_four_figures() {
    let page = html(&[run("a", 0.2, 0.3, 50), run("b", 0.05, 0.7, 50)], "t");
    for id in ["ttft-cdf", "hit-rate", "endpoint-load", "ttft-over-time"] {
        let start = page.find(&format!("<figure id=\"{id}\"")).expect(id);
        let end = start + page[start..].find("</figure>").unwrap();
        let fig = &page[start..end];
        assert!(fig.contains("<figcaption>") && fig.contains("<svg"), "{id}");
        assert!(fig.contains("class=\"legend\""), "{id}");
        assert!(
            fig.contains("#4e79a7") && fig.contains("#f28e2b"),
            "{id}: run colours"
        );
    }
    assert!(!page.contains("<script") && !page.contains("<link") && !page.contains("src="));
}

#[test]
fn cdf_is_monotonic() {
    let mut r = run("x", 0.1, 0.5, 0);
    // Unsorted, with ties, a zero and an error without TTFT.
    for (i, t) in [0.5, 0.1, 0.3, 0.3, 0.0, 2.0, 0.7, 0.3].iter().enumerate() {
        r.records.push(RequestRecord {
            start_s: i as f64,
            ttft_s: Some(*t),
            ..Default::default()
        });
    }
    r.records.push(RequestRecord {
        ttft_s: None,
        error: Some("boom".into()),
        ..Default::default()
    });
    for max in [2, 3, 5, 1000] {
        let pts = ttft_cdf_points(&r, max);
        assert!(!pts.is_empty());
        assert!(pts.len() <= max.max(2), "{pts:?}");
        assert!(
            pts.windows(2).all(|w| w[0].0 <= w[1].0 && w[0].1 < w[1].1),
            "{pts:?}"
        );
        assert_eq!(pts.last().unwrap(), &(2.0, 100.0));
        assert!(pts[0].1 > 0.0);
    }
    let all = ttft_cdf_points(&r, 1000);
    assert_eq!(all[0], (0.0, 12.5));
    assert_eq!(all[2], (0.3, 62.5)); // three 0.3s: the step lands on the last of them
    let big = run("big", 0.1, 0.5, 10_000);
    let pts = ttft_cdf_points(&big, 600);
    assert!(pts.len() <= 600);
    assert!(pts.windows(2).all(|w| w[0].0 <= w[1].0 && w[0].1 <= w[1].1));
}

#[test]
fn empty_inputs_do_not_panic() {
    let page = html(&[], "nothing");
    assert!(page.contains("No runs to report"));
    assert!(page.contains("id=\"ttft-cdf\""));
    let empty = RunResult {
        name: String::new(),
        ..Default::default()
    };
    let mut failing = run("failing", 0.1, 0.0, 10);
    for r in &mut failing.records {
        r.ttft_s = None;
        r.cached_tokens = None;
        r.endpoint = None;
        r.error = Some("connection refused".into());
    }
    failing.summary = Summary {
        requests: 10,
        errors: 10,
        ..Default::default()
    };
    let mut one_endpoint = run("single", 0.1, 0.4, 10);
    one_endpoint.summary.endpoints.truncate(1);
    one_endpoint.summary.endpoints[0].endpoint = String::new();
    let mut summary_only = run("summary-only", 0.1, 0.4, 10);
    summary_only.records.clear();
    summary_only.summary.endpoints.clear();
    let runs = [empty, failing, one_endpoint, summary_only];
    let page = html(&runs, "edge cases");
    assert!(page.contains("run 1"), "an unnamed run gets a label");
    assert!(page.contains("failing (no data)"));
    assert!(page.contains("(unnamed)"));
    assert!(page.contains("connection refused"));
    assert!(
        !page.contains("NaN") && !page.contains("inf"),
        "non-finite numbers leaked"
    );
    let t = table(&runs);
    assert!(t.contains("failing") && t.contains("summary-only"));
    let _ = table(&[RunResult::default()]);
    let _ = html(&[RunResult::default()], "");
}

#[test]
fn endpoints_fall_back_to_records() {
    let mut r = run("x", 0.1, 0.1, 8);
    r.summary.endpoints.clear();
    r.records[0].endpoint = None;
    r.records[1].endpoint = Some(String::new());
    let counts = endpoint_counts(&r);
    assert_eq!(counts.iter().map(|c| c.1).sum::<u64>(), 8);
    assert!(counts.contains(&("(unknown)".to_string(), 1)));
    assert!(counts.contains(&("(unnamed)".to_string(), 1)));
    r.records.iter_mut().for_each(|rec| rec.endpoint = None);
    assert!(endpoint_counts(&r).is_empty());
}

#[test]
fn rolling_median_is_bounded() {
    let pts: Vec<(f64, f64)> = (0..1000).map(|i| (i as f64, (i % 7) as f64)).collect();
    let m = rolling_median(&pts, 21, 100);
    assert!(m.len() <= 101 && m.len() > 50);
    assert_eq!(m.last().unwrap().0, 999.0);
    assert!(m.iter().all(|p| (0.0..=6.0).contains(&p.1)));
    assert!(rolling_median(&[], 5, 10).is_empty());
    assert_eq!(rolling_median(&[(1.0, 2.0)], 5, 10), [(1.0, 2.0)]);
}

#[test]
fn scales_have_readable_ticks() {
    let s = Scale::linear(0.0, 7.3);
    assert_eq!(s.ticks(), [0.0, 2.0, 4.0, 6.0, 8.0]);
    let s = Scale::linear(0.0, 0.37);
    assert_eq!(
        s.ticks().iter().map(|t| s.label(*t)).collect::<Vec<_>>(),
        ["0", "0.1", "0.2", "0.3", "0.4"]
    );
    let s = Scale::log(0.023, 3.1);
    assert!(s.log);
    let labels: Vec<String> = s.ticks().iter().map(|t| s.label(*t)).collect();
    assert_eq!(labels, ["0.02", "0.05", "0.1", "0.2", "0.5", "1", "2", "5"]);
    assert!((s.frac(0.023) - 0.0).abs() < 0.1 && s.frac(100.0) == 1.0 && s.frac(0.0) == 0.0);
    let wide = Scale::log(1e-4, 50.0);
    assert!(wide.ticks().len() <= 9);
    let flat = Scale::linear(2.0, 2.0);
    assert!(flat.hi > flat.lo);
    assert!(Scale::auto(f64::INFINITY, f64::NEG_INFINITY, 20.0).hi > 0.0);
}

#[test]
fn files_round_trip() {
    let dir = std::env::temp_dir().join(format!("kvroute-report-unit-{}", std::process::id()));
    let runs = vec![run("a", 0.1, 0.2, 5), run("b", 0.2, 0.3, 5)];
    let (json, page) = write_files(&runs, &dir, "cmp").unwrap();
    assert_eq!(json, dir.join("cmp.json"));
    assert!(
        std::fs::read_to_string(&page)
            .unwrap()
            .contains("kvroute bench: a vs b")
    );
    // serde_json parses floats to within an ulp (exactly with its `float_roundtrip` feature).
    let back = load(&json).unwrap();
    assert_eq!(back.len(), 2);
    for (b, r) in back.iter().zip(&runs) {
        assert_eq!(
            (&b.name, &b.config, &b.summary),
            (&r.name, &r.config, &r.summary)
        );
        assert_eq!(b.records.len(), r.records.len());
        for (x, y) in b.records.iter().zip(&r.records) {
            assert!((x.ttft_s.unwrap() - y.ttft_s.unwrap()).abs() < 1e-12);
            assert_eq!(x.endpoint, y.endpoint);
        }
    }
    let single = dir.join("single.json");
    std::fs::write(&single, serde_json::to_string(&runs[1]).unwrap()).unwrap();
    assert_eq!(load(&single).unwrap()[0].name, "b");
    std::fs::write(&single, "{\"name\": 3}").unwrap();
    let err = load(&single).unwrap_err();
    assert!(matches!(err, ReportError::Parse { .. }), "{err}");
    assert!(err.to_string().contains("single.json"));
    assert!(matches!(
        load(dir.join("missing.json")),
        Err(ReportError::Read { .. })
    ));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn endpoint_labels_drop_shared_parts_only_when_needed() {
    let short = ["e0", "e1"];
    assert_eq!(endpoint_labels(&short, 10).0, ["e0", "e1"]);
    let long = ["vllm-0.svc:8000", "vllm-1.svc:8000", "vllm-12.svc:8000"];
    let (labels, prefix, suffix) = endpoint_labels(&long, 6);
    assert_eq!(labels, ["0", "1", "12"]);
    assert_eq!((prefix.as_str(), suffix.as_str()), ("vllm-", ".svc:8000"));
    let numbered = ["worker-10", "worker-11", "worker-12"];
    assert_eq!(endpoint_labels(&numbered, 4).0, ["10", "11", "12"]);
    let nested = ["node-a", "node-a-2"];
    assert_eq!(endpoint_labels(&nested, 3).0, ["a", "a-2"]);
    // A label would vanish: keep the names.
    let vanishing = ["pod-", "pod-b-"];
    assert_eq!(endpoint_labels(&vanishing, 3).0, ["pod-", "pod-b-"]);
    let page = html(
        &[RunResult {
            name: "x".into(),
            records: (0..4)
                .map(|i| RequestRecord {
                    endpoint: Some(format!("http://10.0.0.{i}:8000/v1")),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }],
        "t",
    );
    assert!(
        page.contains("common prefix “http://10.0.0.” and suffix “:8000/v1”"),
        "{page}"
    );
}
