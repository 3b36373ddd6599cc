//! The HTML page: headline comparisons with the first run, the summary table, the charts, the
//! errors seen and each run's configuration, with an inline style sheet and no scripts.

use super::charts;
use super::metrics::{Metric, Unit, best, format_value, metrics};
use super::svg::color;
use super::{esc, run_label, shorten};
use crate::result::RunResult;

/// The inline style sheet.
const STYLE: &str = r#"
:root { color-scheme: light; --fg: #1f2328; --muted: #57606a; --line: #d8dee4; --soft: #f6f8fa; }
* { box-sizing: border-box; }
body { margin: 0; background: #fff; color: var(--fg);
  font: 14px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; }
main { max-width: 1180px; margin: 0 auto; padding: 28px 24px 48px; }
h1 { font-size: 22px; margin: 0 0 2px; font-weight: 650; }
h2 { font-size: 16px; margin: 32px 0 10px; font-weight: 650; }
h3 { font-size: 14px; margin: 16px 0 6px; }
.sub, .note { color: var(--muted); margin: 0; }
.sub { margin-bottom: 18px; }
.note { font-size: 12.5px; margin-top: 8px; }
ul.highlights { margin: 0; padding-left: 20px; }
ul.highlights li { margin: 6px 0; line-height: 1.8; }
.swatch { display: inline-block; width: 10px; height: 10px; border-radius: 2px;
  margin-right: 6px; vertical-align: baseline; }
.table-wrap { overflow-x: auto; }
table { border-collapse: collapse; font-variant-numeric: tabular-nums; }
table.summary { min-width: 420px; }
th, td { padding: 5px 14px; text-align: right; border-bottom: 1px solid var(--line);
  white-space: nowrap; }
th { font-weight: 600; border-bottom: 2px solid var(--line); vertical-align: bottom; }
th:first-child, td:first-child { text-align: left; padding-left: 0; color: var(--muted); }
tbody tr:hover { background: var(--soft); }
tr.group-start td { border-top: 1px solid var(--line); }
td.best { font-weight: 650; }
.delta { display: inline-block; min-width: 52px; margin-left: 6px; font-size: 12px;
  color: var(--muted); text-align: right; }
.change { font-size: 12.5px; color: var(--muted); }
.kv { white-space: nowrap; }
.sep { color: var(--muted); margin: 0 4px; }
.better { color: #1a7f37; }
.worse { color: #cf222e; }
.charts { display: grid; grid-template-columns: repeat(auto-fit, minmax(480px, 1fr));
  gap: 18px; margin-top: 8px; }
figure { margin: 0; padding: 14px 14px 8px; border: 1px solid var(--line); border-radius: 8px; }
figcaption { font-size: 12.5px; color: var(--muted); margin-bottom: 6px; }
figcaption strong { color: var(--fg); font-size: 14px; margin-right: 4px; }
svg { display: block; width: 100%; height: auto; }
svg text { font-size: 11px; fill: #57606a; }
svg text.axis-title { font-size: 11.5px; fill: #1f2328; }
svg text.legend-label { font-size: 12px; fill: #1f2328; }
svg text.value { font-size: 11px; fill: #1f2328; font-weight: 600; }
svg text.note { font-size: 13px; }
svg text.ref-label { font-size: 10px; }
details { margin-top: 10px; }
summary { cursor: pointer; color: var(--muted); }
pre { background: var(--soft); padding: 10px 12px; border-radius: 6px; overflow-x: auto;
  font: 12px/1.45 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
td.msg { text-align: left; white-space: normal; color: var(--fg); }
footer { margin-top: 36px; color: var(--muted); font-size: 12px; }
@media print { figure { break-inside: avoid; } }
"#;

/// Figures compared in the headline list, by their labels in [`metrics`].
const HEADLINE: [&str; 5] = [
    "TTFT p50 (ms)",
    "TTFT p99 (ms)",
    "prefix-cache hit rate",
    "output tok/s",
    "E2E p99 (ms)",
];

/// Most distinct error messages listed per run.
const MAX_ERRORS: usize = 5;

/// The page for `runs` (see [`super::html`]).
pub(crate) fn render(runs: &[RunResult], title: &str) -> String {
    let mut out = String::with_capacity(64 * 1024);
    w!(
        out,
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n\
         <meta name=\"generator\" content=\"kvroute bench\">\n<title>{}</title>\n<style>{STYLE}</style>\n\
         </head>\n<body>\n<main>\n",
        esc(title)
    );
    w!(out, "<header>\n<h1>{}</h1>\n", esc(title));
    let requests: u64 = runs.iter().map(|r| r.summary.requests).sum();
    w!(
        out,
        "<p class=\"sub\">{} {}, {} requests in all.{}</p>\n</header>\n",
        runs.len(),
        if runs.len() == 1 { "run" } else { "runs" },
        requests,
        if runs.len() > 1 {
            " The first run is the baseline the others are compared with."
        } else {
            ""
        }
    );
    if runs.is_empty() {
        out.push_str("<p class=\"note\">No runs to report.</p>\n");
    }
    let rows = metrics(runs);
    headlines(&mut out, runs, &rows);
    summary_table(&mut out, runs, &rows);

    out.push_str("<h2>Charts</h2>\n<section class=\"charts\">\n");
    out.push_str(&charts::ttft_cdf(runs));
    out.push_str(&charts::hit_rate(runs));
    out.push_str(&charts::endpoint_load(runs));
    out.push_str(&charts::ttft_over_time(runs));
    out.push_str("</section>\n");

    errors(&mut out, runs);
    configs(&mut out, runs);
    out.push_str(
        "<footer>Generated by kvroute bench. This page is self-contained: no scripts, and \
         nothing is loaded from the network.</footer>\n</main>\n</body>\n</html>\n",
    );
    out
}

/// Longest run name shown in headings and the table, in characters.
const NAME_MAX_CHARS: usize = 40;

/// A run's name (shortened, the full name on hover) with its colour swatch, escaped.
fn run_tag(runs: &[RunResult], i: usize) -> String {
    let name = run_label(runs, i);
    format!(
        r#"<span class="swatch" style="background:{}"></span><span title="{}">{}</span>"#,
        color(i),
        esc(&name),
        esc(&shorten(&name, NAME_MAX_CHARS))
    )
}

/// The change from the baseline as a `<span>` of `class` (`delta` in the table, `change` in
/// prose, in parentheses), or nothing.
fn delta_span(metric: &Metric, base: Option<f64>, v: Option<f64>, class: &str) -> String {
    let (Some(base), Some(v)) = (base, v) else {
        return String::new();
    };
    let Some((text, good)) = metric.delta(base, v) else {
        return String::new();
    };
    let verdict = match good {
        Some(true) => " better",
        Some(false) => " worse",
        None => "",
    };
    let text = if class == "change" {
        format!("({text})")
    } else {
        text
    };
    format!(r#"<span class="{class}{verdict}">{}</span>"#, esc(&text))
}

/// A value with its unit, for prose.
fn with_unit(unit: Unit, v: f64) -> String {
    let s = format_value(unit, v);
    match unit {
        Unit::Millis => format!("{s} ms"),
        Unit::Seconds => format!("{s} s"),
        _ => s,
    }
}

/// The headline list: each later run against the first on the figures that matter most.
fn headlines(out: &mut String, runs: &[RunResult], rows: &[Metric]) {
    if runs.len() < 2 {
        return;
    }
    out.push_str("<h2>At a glance</h2>\n<ul class=\"highlights\">\n");
    for i in 1..runs.len() {
        let mut parts = Vec::new();
        for label in HEADLINE {
            let Some(m) = rows.iter().find(|m| m.label == label) else {
                continue;
            };
            let (Some(base), Some(v)) = ((m.value)(&runs[0]), (m.value)(&runs[i])) else {
                continue;
            };
            let name = label.trim_end_matches(" (ms)");
            parts.push(format!(
                "<span class=\"kv\">{} <b>{}</b> vs {} {}</span>",
                esc(name),
                esc(&with_unit(m.unit, v)),
                esc(&with_unit(m.unit, base)),
                delta_span(m, Some(base), Some(v), "change")
            ));
        }
        if parts.is_empty() {
            parts.push("no figures to compare".to_string());
        }
        w!(
            out,
            "<li><b>{}</b> against {}: {}</li>\n",
            run_tag(runs, i),
            run_tag(runs, 0),
            parts.join(" <span class=\"sep\">&middot;</span> ")
        );
    }
    out.push_str("</ul>\n");
}

/// The summary table: a row per figure, a column per run, the best value in bold and changes
/// from the first run beside the others.
fn summary_table(out: &mut String, runs: &[RunResult], rows: &[Metric]) {
    if runs.is_empty() {
        return;
    }
    out.push_str(
        "<h2>Summary</h2>\n<div class=\"table-wrap\"><table class=\"summary\">\n<thead><tr><th>figure</th>",
    );
    for i in 0..runs.len() {
        w!(out, "<th>{}</th>", run_tag(runs, i));
    }
    out.push_str("</tr></thead>\n<tbody>\n");
    for m in rows {
        let group_start = matches!(
            m.label,
            "req/s" | "prefix-cache hit rate" | "TTFT p50 (ms)" | "E2E p50 (ms)" | "ITL p50 (ms)"
        ) || m.label.starts_with("load");
        let flags = best(m, runs);
        w!(
            out,
            "<tr{}><td>{}</td>",
            if group_start {
                " class=\"group-start\""
            } else {
                ""
            },
            esc(m.label)
        );
        let base = (m.value)(&runs[0]);
        for (i, run) in runs.iter().enumerate() {
            let v = (m.value)(run);
            let delta = if i == 0 {
                String::new()
            } else {
                delta_span(m, base, v, "delta")
            };
            w!(
                out,
                "<td{}>{}{}</td>",
                if flags[i] { " class=\"best\"" } else { "" },
                esc(&m.show(run)),
                delta
            );
        }
        out.push_str("</tr>\n");
    }
    out.push_str("</tbody>\n</table></div>\n");
    let mut note = String::from(
        "Times in milliseconds. Bold: the best value of the row; hit rates: cached over prompt tokens.",
    );
    if runs.len() > 1 {
        note.push_str(&format!(
            " Changes are relative to {} (percentage points for rates).",
            esc(&run_label(runs, 0))
        ));
    }
    w!(out, "<p class=\"note\">{note}</p>\n");
}

/// The most frequent error messages of each run that had errors.
fn errors(out: &mut String, runs: &[RunResult]) {
    let mut any = false;
    for (i, run) in runs.iter().enumerate() {
        let mut counts: Vec<(&str, u64)> = Vec::new();
        for e in run.records.iter().filter_map(|r| r.error.as_deref()) {
            match counts.iter_mut().find(|(m, _)| *m == e) {
                Some((_, c)) => *c += 1,
                None => counts.push((e, 1)),
            }
        }
        if counts.is_empty() && run.summary.errors == 0 {
            continue;
        }
        if !any {
            out.push_str("<h2>Errors</h2>\n");
            any = true;
        }
        counts.sort_by_key(|c| std::cmp::Reverse(c.1));
        w!(
            out,
            "<h3>{}: {} of {} requests failed</h3>\n",
            run_tag(runs, i),
            run.summary.errors,
            run.summary.requests
        );
        if counts.is_empty() {
            continue;
        }
        out.push_str("<table class=\"errors\"><tbody>\n");
        for (msg, c) in counts.iter().take(MAX_ERRORS) {
            w!(
                out,
                "<tr><td>{c}</td><td class=\"msg\">{}</td></tr>\n",
                esc(&shorten(msg, 200))
            );
        }
        if counts.len() > MAX_ERRORS {
            let rest: u64 = counts[MAX_ERRORS..].iter().map(|c| c.1).sum();
            w!(
                out,
                "<tr><td>{rest}</td><td class=\"msg\">({} other messages)</td></tr>\n",
                counts.len() - MAX_ERRORS
            );
        }
        out.push_str("</tbody></table>\n");
    }
}

/// Each run's configuration, folded.
fn configs(out: &mut String, runs: &[RunResult]) {
    if runs.is_empty() {
        return;
    }
    out.push_str("<details>\n<summary>Run configurations</summary>\n");
    for (i, run) in runs.iter().enumerate() {
        let text = if run.config.is_null() {
            "(none recorded)".to_string()
        } else {
            serde_json::to_string_pretty(&run.config).unwrap_or_else(|e| e.to_string())
        };
        w!(
            out,
            "<h3>{}</h3>\n<pre>{}</pre>\n",
            run_tag(runs, i),
            esc(&text)
        );
    }
    out.push_str("</details>\n");
}
