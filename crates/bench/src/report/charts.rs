//! The four charts of the HTML report, drawn as inline SVG: the TTFT distribution (CDF), the
//! prefix-cache hit rate, requests per endpoint and TTFT over the course of each run.

use super::metrics::format_ms;
use super::svg::{CHAR_W, Entry, Frame, Key, Legend, MUTED, Scale, color, figure};
use super::{esc, run_label, shorten};
use crate::result::RunResult;

/// SVG width of every chart.
const W: f64 = 560.0;
/// SVG height of every chart.
const H: f64 = 340.0;
/// Most points of one run's CDF line.
const CDF_POINTS: usize = 600;
/// Most dots of one run in the TTFT-over-time chart.
const SCATTER_POINTS: usize = 2500;
/// Most points of one run's rolling-median line.
const MEDIAN_POINTS: usize = 400;
/// TTFTs spanning more than this ratio get a log axis.
const LOG_RATIO: f64 = 20.0;
/// Grey of the hit-rate chart's "source" legend entries.
const NEUTRAL: &str = "#8c959f";

/// The run's successful TTFTs in seconds (finite, not negative).
fn ttfts(run: &RunResult) -> impl Iterator<Item = f64> + '_ {
    run.records
        .iter()
        .filter_map(|r| r.ttft_s)
        .filter(|t| t.is_finite() && *t >= 0.0)
}

/// The smallest positive and the largest of `values` (infinite when there are none).
fn positive_range(values: impl Iterator<Item = f64>) -> (f64, f64) {
    values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (if v > 0.0 { lo.min(v) } else { lo }, hi.max(v))
    })
}

/// A frame with room above the plot for `legend` (laid out across the plot's width).
fn frame_with_legend(entries: Vec<Entry>, left: f64, right: f64, bottom: f64) -> (Frame, Legend) {
    let legend = Legend::new(entries, left, W - left - right);
    let top = 16.0 + legend.height() + 6.0;
    let frame = Frame {
        w: W,
        h: H + legend.height().max(18.0) - 18.0,
        left,
        right,
        top,
        bottom,
    };
    (frame, legend)
}

/// The run legend, one entry per run with `key`; runs for which `has_data` is false are marked.
fn run_entries(runs: &[RunResult], key: Key, has_data: impl Fn(&RunResult) -> bool) -> Vec<Entry> {
    (0..runs.len())
        .map(|i| {
            let mut label = run_label(runs, i);
            if !has_data(&runs[i]) {
                label.push_str(" (no data)");
            }
            Entry {
                label,
                color: color(i),
                key,
            }
        })
        .collect()
}

/// The empirical CDF of the run's TTFTs: `(seconds, percent of requests at or below)`, both
/// non-decreasing, ending at 100%. Runs with more than `max_points` TTFTs are sampled at evenly
/// spaced ranks (the last one always included).
pub(crate) fn ttft_cdf_points(run: &RunResult, max_points: usize) -> Vec<(f64, f64)> {
    let mut v: Vec<f64> = ttfts(run).collect();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return Vec::new();
    }
    let k = n.min(max_points.max(2));
    let mut out: Vec<(f64, f64)> = Vec::with_capacity(k);
    for j in 1..=k {
        // The rank whose cumulative share is j/k, rounded up.
        let rank = (j * n).div_ceil(k);
        let idx = rank - 1;
        let point = (v[idx], rank as f64 / n as f64 * 100.0);
        match out.last_mut() {
            // Ties: the CDF at a value counts all of them.
            Some(last) if last.0 == point.0 => *last = point,
            _ => out.push(point),
        }
    }
    out
}

/// The TTFT CDF chart, one line per run.
pub(crate) fn ttft_cdf(runs: &[RunResult]) -> String {
    let curves: Vec<Vec<(f64, f64)>> = runs
        .iter()
        .map(|r| ttft_cdf_points(r, CDF_POINTS))
        .collect();
    let entries = run_entries(runs, Key::Line, |r| ttfts(r).next().is_some());
    let (f, legend) = frame_with_legend(entries, 52.0, 34.0, 42.0);
    let (min, max) = positive_range(curves.iter().flatten().map(|p| p.0));
    // A little room right of the slowest request, so its step does not sit on the border.
    let xs = Scale::auto(min, max * 1.02, LOG_RATIO);
    let ys = Scale::fixed(0.0, 100.0, 25.0);

    let mut s = String::new();
    f.open(&mut s, "TTFT distribution per run");
    legend.draw(&mut s, 16.0);
    let x_title = if xs.log {
        "time to first token (s, log scale)"
    } else {
        "time to first token (s)"
    };
    f.y_axis(&mut s, &ys, "requests at or below", "%");
    f.x_axis(&mut s, &xs, x_title);
    for (p, label) in [(50.0, "p50"), (90.0, "p90"), (99.0, "p99")] {
        let y = f.y(ys.frac(p));
        w!(
            s,
            r#"<line class="ref" x1="{:.1}" x2="{:.1}" y1="{y:.1}" y2="{y:.1}" stroke="{MUTED}" stroke-dasharray="3 4" stroke-opacity="0.6"/><text class="ref-label" x="{:.1}" y="{:.1}">{label}</text>"#,
            f.x(0.0),
            f.x(1.0),
            f.x(1.0) + 4.0,
            y + 4.0
        );
    }
    if curves.iter().all(Vec::is_empty) {
        f.note(&mut s, "no successful requests");
    }
    for (i, curve) in curves.iter().enumerate() {
        let Some(&(x0, _)) = curve.first() else {
            continue;
        };
        let mut d = format!("M{:.1} {:.1}", f.x(xs.frac(x0)), f.y(0.0));
        for &(x, y) in curve {
            w!(d, "H{:.1}V{:.1}", f.x(xs.frac(x)), f.y(ys.frac(y)));
        }
        w!(d, "H{:.1}", f.x(1.0));
        let summary = &runs[i].summary.ttft;
        w!(
            s,
            r#"<path class="series" d="{d}" fill="none" stroke="{}" stroke-width="2" stroke-linejoin="round"><title>{}: p50 {} ms, p90 {} ms, p99 {} ms</title></path>"#,
            color(i),
            esc(&run_label(runs, i)),
            format_ms(summary.p50),
            format_ms(summary.p90),
            format_ms(summary.p99)
        );
    }
    s.push_str("</svg>");
    figure(
        "ttft-cdf",
        "Time to first token, distribution.",
        "Share of successful requests whose first token came within a given time; further left and steeper is better. Dashed lines mark the p50, p90 and p99 levels.",
        &s,
    )
}

/// Whether the run's records carry usage (some request reported cached tokens), or it has no
/// records to tell (then its summary is trusted).
fn reports_usage(run: &RunResult) -> bool {
    run.records.is_empty()
        || run.summary.hit_rate > 0.0
        || run.records.iter().any(|r| r.cached_tokens.is_some())
}

/// The prefix-cache hit-rate chart: a bar per run, and a pale bar beside it for the engines'
/// own counters when a run has them.
pub(crate) fn hit_rate(runs: &[RunResult]) -> String {
    let engine = runs.iter().any(|r| r.summary.engine_hit_rate.is_some());
    let mut entries = run_entries(runs, Key::Box, reports_usage);
    if engine {
        entries.push(Entry {
            label: "from request usage".into(),
            color: NEUTRAL,
            key: Key::Box,
        });
        entries.push(Entry {
            label: "from engine counters".into(),
            color: NEUTRAL,
            key: Key::Pale,
        });
    }
    let (f, legend) = frame_with_legend(entries, 52.0, 16.0, 42.0);
    let ys = Scale::fixed(0.0, 100.0, 20.0);

    let mut s = String::new();
    f.open(&mut s, "prefix-cache hit rate per run");
    legend.draw(&mut s, 16.0);
    f.y_axis(&mut s, &ys, "prefix-cache hit rate", "%");
    f.baseline(&mut s);
    if runs.is_empty() {
        f.note(&mut s, "no runs");
    }
    let n = runs.len().max(1) as f64;
    let gw = f.pw() / n;
    let bw = if engine {
        (gw * 0.34).min(48.0)
    } else {
        (gw * 0.5).min(80.0)
    };
    let max_chars = ((gw - 6.0) / CHAR_W).floor().max(3.0) as usize;
    for (i, run) in runs.iter().enumerate() {
        let cx = f.x((i as f64 + 0.5) / n);
        let name = run_label(runs, i);
        let client = (reports_usage(run) && run.summary.hit_rate.is_finite())
            .then_some(run.summary.hit_rate);
        let engine_rate = run.summary.engine_hit_rate.filter(|v| v.is_finite());
        let bars: Vec<(f64, Option<f64>, bool)> = if engine {
            vec![
                (cx - bw / 2.0 - 2.0, client, false),
                (cx + bw / 2.0 + 2.0, engine_rate, true),
            ]
        } else {
            vec![(cx, client, false)]
        };
        for (bx, value, pale) in bars {
            let Some(v) = value else {
                w!(
                    s,
                    r#"<text class="value" x="{bx:.1}" y="{:.1}" text-anchor="middle">n/a</text>"#,
                    f.y(0.0) - 6.0
                );
                continue;
            };
            let top = f.y(ys.frac(v * 100.0));
            let height = (f.y(0.0) - top).max(0.0);
            let style = if pale {
                format!(
                    r#"fill="{c}" fill-opacity="0.3" stroke="{c}""#,
                    c = color(i)
                )
            } else {
                format!(r#"fill="{}""#, color(i))
            };
            let source = if pale {
                "engine counters"
            } else {
                "request usage"
            };
            w!(
                s,
                r#"<rect class="bar" x="{:.1}" y="{top:.1}" width="{bw:.1}" height="{height:.1}" {style}><title>{}: {:.1}% ({source})</title></rect>"#,
                bx - bw / 2.0,
                esc(&name),
                v * 100.0
            );
            w!(
                s,
                r#"<text class="value" x="{bx:.1}" y="{:.1}" text-anchor="middle">{:.1}%</text>"#,
                top - 5.0,
                v * 100.0
            );
        }
        w!(
            s,
            r#"<text class="category" x="{cx:.1}" y="{:.1}" text-anchor="middle"><title>{}</title>{}</text>"#,
            f.y(0.0) + 16.0,
            esc(&name),
            esc(&shorten(&name, max_chars))
        );
    }
    s.push_str("</svg>");
    figure(
        "hit-rate",
        "Prefix-cache hit rate.",
        "Share of prompt tokens served from the engines' prefix cache; higher means less prefill work and usually a faster first token.",
        &s,
    )
}

/// Requests per endpoint of one run: from its summary, or counted from its records when the
/// summary has none (requests without an endpoint count as `(unknown)`).
pub(crate) fn endpoint_counts(run: &RunResult) -> Vec<(String, u64)> {
    let named = |e: &str| {
        if e.trim().is_empty() {
            "(unnamed)".to_string()
        } else {
            e.to_string()
        }
    };
    let mut out: Vec<(String, u64)> = Vec::new();
    let mut add = |name: String, n: u64| match out.iter_mut().find(|(e, _)| *e == name) {
        Some((_, c)) => *c += n,
        None => out.push((name, n)),
    };
    if !run.summary.endpoints.is_empty() {
        for e in &run.summary.endpoints {
            add(named(&e.endpoint), e.requests);
        }
    } else if run.records.iter().any(|r| r.endpoint.is_some()) {
        for r in &run.records {
            let name = r
                .endpoint
                .as_deref()
                .map_or_else(|| "(unknown)".to_string(), named);
            add(name, 1);
        }
    }
    out
}

/// Axis labels for `names`: the names themselves when they fit in `max_chars`, otherwise
/// without the prefix and suffix they all share (as long as every label keeps a character);
/// also returns the prefix and suffix dropped.
pub(crate) fn endpoint_labels(names: &[&str], max_chars: usize) -> (Vec<String>, String, String) {
    let as_is = || {
        (
            names.iter().map(|n| n.to_string()).collect(),
            String::new(),
            String::new(),
        )
    };
    if names.len() < 2 || names.iter().all(|n| n.chars().count() <= max_chars) {
        return as_is();
    }
    let chars: Vec<Vec<char>> = names.iter().map(|n| n.chars().collect()).collect();
    let shortest = chars.iter().map(Vec::len).min().unwrap_or(0);
    let common = |at: &dyn Fn(&[char], usize) -> char| {
        (0..shortest)
            .take_while(|&k| chars.iter().all(|c| at(c, k) == at(&chars[0], k)))
            .count()
    };
    let first = &chars[0];
    // Cut only after a separator, so that `e10`, `e11` do not become `0`, `1`.
    let mut pre = common(&|c, k| c[k]);
    while pre > 0 && first[pre - 1].is_alphanumeric() {
        pre -= 1;
    }
    let mut suf = common(&|c, k| c[c.len() - 1 - k]).min(shortest - pre);
    while suf > 0 && first[first.len() - suf].is_alphanumeric() {
        suf -= 1;
    }
    if pre + suf == 0 || chars.iter().any(|c| c.len() - pre - suf == 0) {
        return as_is();
    }
    let labels = chars
        .iter()
        .map(|c| c[pre..c.len() - suf].iter().collect())
        .collect();
    let prefix = first[..pre].iter().collect();
    let suffix = first[first.len() - suf..].iter().collect();
    (labels, prefix, suffix)
}

/// The endpoint-load chart: for each endpoint, a bar per run with the requests it served.
pub(crate) fn endpoint_load(runs: &[RunResult]) -> String {
    let counts: Vec<Vec<(String, u64)>> = runs.iter().map(endpoint_counts).collect();
    let mut endpoints: Vec<&str> = Vec::new();
    for (e, _) in counts.iter().flatten() {
        if !endpoints.contains(&e.as_str()) {
            endpoints.push(e);
        }
    }
    let entries = run_entries(runs, Key::Box, |r| !endpoint_counts(r).is_empty());
    let (f, legend) = frame_with_legend(entries, 52.0, 16.0, 42.0);
    let max = counts.iter().flatten().map(|c| c.1).max().unwrap_or(0);
    // Whole requests: no fractional ticks.
    let ys = Scale::linear(0.0, (max as f64).max(5.0));

    let mut s = String::new();
    f.open(&mut s, "requests per endpoint, per run");
    legend.draw(&mut s, 16.0);
    f.y_axis(&mut s, &ys, "requests", "");
    f.baseline(&mut s);
    if runs.is_empty() {
        f.note(&mut s, "no runs");
    } else if endpoints.is_empty() {
        f.note(
            &mut s,
            "no endpoint data (the router did not name endpoints)",
        );
    }
    let n = endpoints.len().max(1) as f64;
    let gw = f.pw() / n;
    let runs_n = runs.len().max(1) as f64;
    let bw = (gw * 0.8 / runs_n).min(36.0);
    let label_every = (endpoints.len() as f64 * 7.0 * CHAR_W / f.pw())
        .ceil()
        .max(1.0) as usize;
    let max_chars = ((gw * label_every as f64 - 6.0) / CHAR_W).floor().max(3.0) as usize;
    let (labels, prefix, suffix) = endpoint_labels(&endpoints, max_chars);
    for (j, endpoint) in endpoints.iter().enumerate() {
        let cx = f.x((j as f64 + 0.5) / n);
        for (i, run_counts) in counts.iter().enumerate() {
            let Some(&(_, c)) = run_counts.iter().find(|(e, _)| e == endpoint) else {
                continue;
            };
            let bx = cx + (i as f64 - (runs_n - 1.0) / 2.0) * bw;
            let top = f.y(ys.frac(c as f64));
            w!(
                s,
                r#"<rect class="bar" x="{:.1}" y="{top:.1}" width="{:.1}" height="{:.1}" fill="{}"><title>{}: {} served {c} requests</title></rect>"#,
                bx - bw / 2.0 + 0.5,
                (bw - 1.0).max(0.5),
                (f.y(0.0) - top).max(0.0),
                color(i),
                esc(&run_label(runs, i)),
                esc(endpoint)
            );
        }
        if j % label_every == 0 {
            w!(
                s,
                r#"<text class="category" x="{cx:.1}" y="{:.1}" text-anchor="middle"><title>{}</title>{}</text>"#,
                f.y(0.0) + 16.0,
                esc(endpoint),
                esc(&shorten(&labels[j], max_chars))
            );
        }
    }
    w!(
        s,
        r#"<text class="axis-title" x="{:.1}" y="{:.1}" text-anchor="middle">endpoint</text>"#,
        f.x(0.5),
        f.h - 6.0
    );
    s.push_str("</svg>");
    let imbalance: Vec<String> = runs
        .iter()
        .enumerate()
        .filter(|(_, r)| r.summary.load_imbalance.is_finite() && r.summary.load_imbalance > 0.0)
        .map(|(i, r)| format!("{} {:.2}", run_label(runs, i), r.summary.load_imbalance))
        .collect();
    let mut caption = "Requests each endpoint served. Even bars mean even load; cache-aware routing trades some balance for cache hits.".to_string();
    if !imbalance.is_empty() {
        caption.push_str(&format!(
            " Busiest endpoint over the mean: {}.",
            imbalance.join(", ")
        ));
    }
    match (prefix.is_empty(), suffix.is_empty()) {
        (true, true) => {}
        (false, true) => caption.push_str(&format!(" Labels omit the common prefix “{prefix}”.")),
        (true, false) => caption.push_str(&format!(" Labels omit the common suffix “{suffix}”.")),
        (false, false) => caption.push_str(&format!(
            " Labels omit the common prefix “{prefix}” and suffix “{suffix}”."
        )),
    }
    figure("endpoint-load", "Load per endpoint.", &caption, &s)
}

/// Rolling median of `points` (sorted by x) over `window` neighbours, at up to `max_out`
/// evenly spaced points.
pub(crate) fn rolling_median(
    points: &[(f64, f64)],
    window: usize,
    max_out: usize,
) -> Vec<(f64, f64)> {
    let n = points.len();
    if n == 0 {
        return Vec::new();
    }
    let half = window / 2;
    let stride = n.div_ceil(max_out.max(1)).max(1);
    let mut buf = Vec::with_capacity(window + 1);
    let mut out = Vec::new();
    let mut i: usize = 0;
    loop {
        let lo = i.saturating_sub(half);
        let hi = (i + half + 1).min(n);
        buf.clear();
        buf.extend(points[lo..hi].iter().map(|p| p.1));
        buf.sort_by(f64::total_cmp);
        let m = buf.len();
        let median = if m % 2 == 1 {
            buf[m / 2]
        } else {
            (buf[m / 2 - 1] + buf[m / 2]) / 2.0
        };
        out.push((points[i].0, median));
        if i == n - 1 {
            break;
        }
        i = (i + stride).min(n - 1);
    }
    out
}

/// The TTFT-over-time chart: a dot per request at its send time, and a rolling median per run.
pub(crate) fn ttft_over_time(runs: &[RunResult]) -> String {
    let series: Vec<Vec<(f64, f64)>> = runs
        .iter()
        .map(|r| {
            let mut v: Vec<(f64, f64)> = r
                .records
                .iter()
                .filter(|rec| rec.start_s.is_finite())
                .filter_map(|rec| rec.ttft_s.map(|t| (rec.start_s.max(0.0), t)))
                .filter(|(_, t)| t.is_finite() && *t >= 0.0)
                .collect();
            v.sort_by(|a, b| a.0.total_cmp(&b.0));
            v
        })
        .collect();
    let entries = run_entries(runs, Key::Line, |r| ttfts(r).next().is_some());
    let (f, legend) = frame_with_legend(entries, 52.0, 24.0, 42.0);
    let (min, max) = positive_range(series.iter().flatten().map(|p| p.1));
    let ys = Scale::auto(min, max * 1.02, LOG_RATIO);
    let t_max = series.iter().flatten().map(|p| p.0).fold(0.0f64, f64::max);
    let xs = Scale::linear(0.0, if t_max > 0.0 { t_max } else { 1.0 });
    let longest = series.iter().map(Vec::len).max().unwrap_or(0);
    let window = (longest / 20).clamp(5, 101) | 1;

    let mut s = String::new();
    f.open(&mut s, "TTFT over the course of each run");
    legend.draw(&mut s, 16.0);
    let y_title = if ys.log { "TTFT (s, log)" } else { "TTFT (s)" };
    f.y_axis(&mut s, &ys, y_title, "");
    f.x_axis(&mut s, &xs, "request sent at (s from the start of the run)");
    if series.iter().all(Vec::is_empty) {
        f.note(&mut s, "no successful requests");
    }
    for (i, points) in series.iter().enumerate() {
        if points.is_empty() {
            continue;
        }
        let stride = points.len().div_ceil(SCATTER_POINTS).max(1);
        w!(
            s,
            r#"<g class="dots" fill="{}" fill-opacity="0.3">"#,
            color(i)
        );
        for &(x, y) in points.iter().step_by(stride) {
            w!(
                s,
                r#"<circle cx="{:.1}" cy="{:.1}" r="1.8"/>"#,
                f.x(xs.frac(x)),
                f.y(ys.frac(y))
            );
        }
        s.push_str("</g>");
    }
    for (i, points) in series.iter().enumerate() {
        let median = rolling_median(points, window, MEDIAN_POINTS);
        if median.is_empty() {
            continue;
        }
        let mut d = String::new();
        for (k, &(x, y)) in median.iter().enumerate() {
            let cmd = if k == 0 { 'M' } else { 'L' };
            w!(d, "{cmd}{:.1} {:.1}", f.x(xs.frac(x)), f.y(ys.frac(y)));
        }
        w!(
            s,
            r#"<path d="{d}" fill="none" stroke="white" stroke-width="4.5" stroke-opacity="0.85" stroke-linejoin="round"/><path class="series" d="{d}" fill="none" stroke="{}" stroke-width="2" stroke-linejoin="round"><title>{}: rolling median TTFT</title></path>"#,
            color(i),
            esc(&run_label(runs, i))
        );
    }
    s.push_str("</svg>");
    figure(
        "ttft-over-time",
        "Time to first token over the run.",
        &format!(
            "Each dot is one request, at the time it was sent; lines are the rolling median over {window} requests. Warm-up, cache build-up and saturation show here."
        ),
        &s,
    )
}
