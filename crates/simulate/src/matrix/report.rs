//! The matrix's results as a text table and as an HTML page with a heat map of precise against
//! the best other policy (TTFT p90 ratio; green where precise is faster), its hit rate against
//! the pooled-cache ceiling, and its ITL p99 against round-robin's (whether the decodes pay for
//! the TTFT), and how many cells meet the scheduler's targets (docs/benchmarks.md, "Scheduler
//! matrix"); the CI matrix test checks the same targets.

use std::fmt::Write as _;

use serde::Serialize;

use super::CellResult;

/// Precise's TTFT target: each of its TTFT p50, p90 and p99 at most this many times the best
/// other policy's.
pub const TTFT_TARGET_RATIO: f64 = 1.05;

/// Precise's hit-rate target where the working set fits the pooled cache: at least this share
/// of the pooled-cache ceiling's hit rate.
pub const HIT_TARGET_SHARE: f64 = 0.9;

/// How precise fares against the scheduler's targets over a matrix's cells.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Verdicts {
    /// Cells where precise's TTFT p50, p90 and p99 are each at most [`TTFT_TARGET_RATIO`] times
    /// the best other policy's.
    pub ttft_met: usize,
    /// Cells where precise and another policy ran (those the TTFT target is checked on).
    pub ttft_cells: usize,
    /// Cells whose working set fits where precise's hit rate reaches [`HIT_TARGET_SHARE`] of the
    /// pooled-cache ceiling's.
    pub hit_met: usize,
    /// Cells whose working set fits the pooled cache ([`CellResult::fits`]) where precise ran.
    pub hit_cells: usize,
    /// Geometric mean over the TTFT cells of precise's worst ratio (of p50, p90 and p99) to the
    /// best other policy's (`None` without such a cell): below 1, precise is faster.
    pub worst_ratio_geomean: Option<f64>,
}

/// The verdicts over `results`.
pub fn verdicts(results: &[CellResult]) -> Verdicts {
    let worst: Vec<f64> = results
        .iter()
        .filter_map(CellResult::precise_over_best_other)
        .map(|ratios| ratios.into_iter().fold(0.0, f64::max))
        .collect();
    let fitting: Vec<bool> = results
        .iter()
        .filter(|r| r.fits())
        .filter_map(|r| {
            r.figures("precise")
                .map(|p| p.hit_rate >= HIT_TARGET_SHARE * r.ceiling)
        })
        .collect();
    let positive = worst.iter().all(|&w| w > 0.0 && w.is_finite());
    Verdicts {
        ttft_met: worst.iter().filter(|&&w| w <= TTFT_TARGET_RATIO).count(),
        ttft_cells: worst.len(),
        hit_met: fitting.iter().filter(|&&met| met).count(),
        hit_cells: fitting.len(),
        worst_ratio_geomean: (!worst.is_empty() && positive)
            .then(|| (worst.iter().map(|w| w.ln()).sum::<f64>() / worst.len() as f64).exp()),
    }
}

/// The verdicts as one line for the matrix's printout.
pub fn verdict_line(v: &Verdicts) -> String {
    let geomean = v
        .worst_ratio_geomean
        .map_or("-".to_owned(), |g| format!("{g:.3}"));
    format!(
        "precise: TTFT p50, p90 and p99 within {TTFT_TARGET_RATIO}x the best other policy's in \
         {} of {} cells (geometric mean of its worst ratio {geomean}); hit rate at least {:.0}% of \
         the pooled-cache ceiling's in {} of {} cells whose working set fits",
        v.ttft_met,
        v.ttft_cells,
        HIT_TARGET_SHARE * 100.0,
        v.hit_met,
        v.hit_cells
    )
}

/// One line per cell: its coordinates, the ceiling, and each policy's hit rate and TTFT p90,
/// then precise's TTFT ratios to the best other policy, each policy's ITL p99, precise's ITL
/// p99 over round-robin's, and, past the last column, the policies that failed requests there
/// (in the seed where most failed), if any.
pub fn table(results: &[CellResult]) -> String {
    let mut out = String::new();
    let Some(first) = results.first() else {
        return out;
    };
    let _ = write!(
        out,
        "{:<10} {:>3} {:>5} {:>5} {:>4} {:>6} {:>6}",
        "kind", "ten", "ctx", "cache", "load", "req/s", "ceil"
    );
    for p in &first.policies {
        let _ = write!(out, " {:>20}", format!("{} hit/p90", p.policy));
    }
    let _ = write!(out, " {:>RATIOS_WIDTH$}", "precise/best p50,90,99");
    for p in &first.policies {
        let _ = write!(
            out,
            " {:>w$}",
            itl_heading(&p.policy),
            w = itl_width(&p.policy)
        );
    }
    let _ = writeln!(out, " {:>ITL_RATIO_WIDTH$}", "ITL99 precise/RR");
    for r in results {
        let c = &r.cell;
        let _ = write!(
            out,
            "{:<10} {:>3} {:>5} {:>5.2} {:>4.1} {:>6.1} {:>5.1}%",
            c.kind.as_str(),
            c.tenants,
            c.context_tokens,
            c.effective_cache_ratio,
            c.load_ratio,
            c.rate,
            r.ceiling * 100.0
        );
        for p in &r.policies {
            let _ = write!(
                out,
                " {:>20}",
                format!("{:.1}% {:.0}ms", p.hit_rate * 100.0, p.ttft_p90 * 1e3)
            );
        }
        let ratios = r
            .precise_over_best_other()
            .map_or("-".to_owned(), |[a, b, c]| format!("{a:.2},{b:.2},{c:.2}"));
        let _ = write!(out, " {ratios:>RATIOS_WIDTH$}");
        // Each column of the heading's policies: the figures of that policy, wherever it is.
        for heading in &first.policies {
            let itl = r
                .figures(&heading.policy)
                .map_or("-".to_owned(), |p| format!("{:.1}ms", p.itl_p99 * 1e3));
            let _ = write!(out, " {itl:>w$}", w = itl_width(&heading.policy));
        }
        let itl_ratio = r
            .precise_itl_p99_over("round-robin")
            .map_or("-".to_owned(), |x| format!("{x:.2}"));
        let _ = write!(out, " {itl_ratio:>ITL_RATIO_WIDTH$}");
        // A cell where requests failed compares what is left: it says so.
        let failed: Vec<String> = r
            .policies
            .iter()
            .filter(|p| p.errors > 0.0)
            .map(|p| format!("{} {}", p.policy, p.errors))
            .collect();
        if !failed.is_empty() {
            let _ = write!(out, "  failed requests: {}", failed.join(", "));
        }
        let _ = writeln!(out);
    }
    out
}

/// Width of the column of precise's TTFT ratios to the best other policy (its heading's).
const RATIOS_WIDTH: usize = 22;

/// Width of the column of precise's ITL p99 over round-robin's.
const ITL_RATIO_WIDTH: usize = 16;

/// The heading of `policy`'s ITL p99 column.
fn itl_heading(policy: &str) -> String {
    format!("{policy} ITL99")
}

/// The width of `policy`'s ITL p99 column: its heading, or a figure such as `1234.5ms`.
fn itl_width(policy: &str) -> usize {
    itl_heading(policy).chars().count().max(8)
}

/// A colour from green (ratio ≤ 0.5) through white (1) to red (≥ 2), on a log scale.
fn colour(ratio: f64) -> String {
    let x = (ratio.max(1e-6).log2()).clamp(-1.0, 1.0);
    let (r, g, b) = if x < 0.0 {
        let t = -x;
        (255.0 * (1.0 - t * 0.6), 255.0, 255.0 * (1.0 - t * 0.6))
    } else {
        (255.0, 255.0 * (1.0 - x * 0.6), 255.0 * (1.0 - x * 0.6))
    };
    format!("rgb({:.0},{:.0},{:.0})", r, g, b)
}

/// The HTML page: the heat map (rows: kind × tenants × context × cache; columns: load), then
/// the full table.
pub fn html(results: &[CellResult], command: &str) -> String {
    let mut loads: Vec<f64> = results.iter().map(|r| r.cell.load_ratio).collect();
    loads.sort_by(f64::total_cmp);
    loads.dedup();
    let mut rows: Vec<(String, Vec<&CellResult>)> = Vec::new();
    for r in results {
        let c = &r.cell;
        let key = format!(
            "{} · {} tenants · {} tokens · cache {:.2}× working set",
            c.kind.as_str(),
            c.tenants,
            c.context_tokens,
            c.effective_cache_ratio
        );
        match rows.iter_mut().find(|(k, _)| *k == key) {
            Some((_, cells)) => cells.push(r),
            None => rows.push((key, vec![r])),
        }
    }
    let mut out = String::from(
        "<!doctype html><meta charset=utf-8><title>kvroute scheduler matrix</title>\
         <style>body{font-family:sans-serif}td,th{padding:4px 8px;border:1px solid #ccc;\
         font-size:13px}table{border-collapse:collapse}</style>\
         <h1>kvroute scheduler matrix</h1>",
    );
    let _ = write!(
        out,
        "<p><code>{}</code></p><p>Each cell: precise's TTFT p90 over the best of the other \
         policies' (median of the seeds; green: precise faster, red: slower), precise's hit \
         rate over the pooled-cache ceiling's, and precise's ITL p99 over round-robin's (with \
         both in milliseconds: above 1, the running decodes pay for precise's TTFT).</p><table><tr><th>shape</th>",
        escape(command)
    );
    for l in &loads {
        let _ = write!(out, "<th>load {l:.1}× RR saturation</th>");
    }
    out.push_str("</tr>");
    for (key, cells) in &rows {
        let _ = write!(out, "<tr><th>{}</th>", escape(key));
        for l in &loads {
            match cells.iter().find(|r| (r.cell.load_ratio - l).abs() < 1e-9) {
                Some(r) => {
                    let p90 = r.precise_over_best_other().map_or(1.0, |x| x[1]);
                    let hit = r
                        .figures("precise")
                        .map_or(0.0, |p| p.hit_rate / r.ceiling.max(1e-9));
                    let itl = match (
                        r.precise_itl_p99_over("round-robin"),
                        r.figures("precise"),
                        r.figures("round-robin"),
                    ) {
                        (Some(ratio), Some(precise), Some(round_robin)) => format!(
                            "<br>ITL p99 {ratio:.2}× RR ({:.1} vs {:.1} ms)",
                            precise.itl_p99 * 1e3,
                            round_robin.itl_p99 * 1e3
                        ),
                        _ => String::new(),
                    };
                    let _ = write!(
                        out,
                        "<td style=\"background:{}\">p90 {p90:.2}×<br>hit {:.0}% of ceiling{itl}</td>",
                        colour(p90),
                        hit * 100.0
                    );
                }
                None => out.push_str("<td></td>"),
            }
        }
        out.push_str("</tr>");
    }
    let _ = write!(
        out,
        "</table><h2>All figures</h2><pre>{}</pre>",
        escape(&table(results))
    );
    out
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matrix::{Cell, Kind, PolicyFigures};

    /// A cell where precise wins TTFT and pays in ITL: its ITL p99 is 2.74× round-robin's.
    fn cell() -> CellResult {
        let policy = |name: &str, ttft_p90: f64, itl_p99: f64| PolicyFigures {
            policy: name.to_owned(),
            hit_rate: 0.5,
            ttft_p50: ttft_p90 / 2.0,
            ttft_p90,
            ttft_p99: ttft_p90 * 2.0,
            itl_p99,
            imbalance: 1.1,
            errors: 0.0,
        };
        let mut result = CellResult {
            cell: Cell {
                kind: Kind::TenantQuestions,
                tenants: 12,
                context_tokens: 1000,
                cache_ratio: 1.5,
                effective_cache_ratio: 1.5,
                load_ratio: 0.9,
                blocks_per_engine: 300,
                saturation_rate: 40.0,
                rate: 36.0,
            },
            ceiling: 0.9,
            policies: vec![
                policy("round-robin", 0.8, 0.0065),
                policy("least-load", 0.7, 0.0071),
                policy("prefix-hash", 0.3, 0.0082),
                policy("precise", 0.1, 0.0178),
            ],
            precise_itl_p99_over_round_robin: None,
        };
        result.precise_itl_p99_over_round_robin = result.precise_itl_p99_over("round-robin");
        result
    }

    #[test]
    fn the_table_prints_every_policys_itl_p99_next_to_precises() {
        let text = table(&[cell()]);
        let mut lines = text.lines();
        let heading = lines.next().unwrap();
        for name in ["round-robin", "least-load", "prefix-hash", "precise"] {
            assert!(heading.contains(&format!("{name} ITL99")), "{text}");
        }
        assert!(heading.contains("ITL99 precise/RR"), "{text}");
        let row: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
        assert_eq!(
            row[row.len() - 5..],
            ["6.5ms", "7.1ms", "8.2ms", "17.8ms", "2.74"],
            "{text}"
        );
        // Every line as wide as the heading: the columns line up.
        let width = heading.chars().count();
        assert!(text.lines().all(|l| l.chars().count() == width), "{text}");
    }

    #[test]
    fn a_cell_where_requests_failed_says_which_policies_failed_them() {
        let mut result = cell();
        result.policies[2].errors = 3.0;
        let text = table(&[result]);
        let row = text.lines().nth(1).unwrap();
        assert!(row.ends_with("  failed requests: prefix-hash 3"), "{text}");
        assert!(!table(&[cell()]).contains("failed"));
    }

    #[test]
    fn a_cell_without_round_robin_shows_no_itl_ratio() {
        let mut result = cell();
        result.policies.remove(0);
        let text = table(&[result.clone()]);
        let row = text.lines().nth(1).unwrap();
        assert!(row.trim_end().ends_with(" -"), "{text}");
        assert_eq!(result.precise_itl_p99_over("round-robin"), None);
        assert!(!html(&[result], "kvroute simulate").contains("<br>ITL p99"));
    }

    #[test]
    fn the_heat_map_compares_precises_itl_p99_with_round_robins() {
        let page = html(&[cell()], "kvroute simulate --matrix small");
        assert!(page.contains("ITL p99 2.74× RR (17.8 vs 6.5 ms)"), "{page}");
    }

    #[test]
    fn the_verdicts_count_the_cells_that_meet_each_target() {
        // The builder's cell, precise's TTFT a third of prefix-hash's at every percentile, with
        // its hit rate (0.5) at a 0.5 ceiling: both met.
        let mut met = cell();
        met.ceiling = 0.5;
        // Precise's p99 1.1× prefix-hash's; hit rate 0.5 of a 0.9 ceiling.
        let mut slow = cell();
        slow.policies[3].ttft_p99 = 1.1 * slow.policies[2].ttft_p99;
        // A cache smaller than the working set: no hit verdict.
        let mut small = met.clone();
        small.cell.cache_ratio = 0.5;
        small.cell.effective_cache_ratio = 0.8;
        let v = verdicts(&[met.clone(), slow, small]);
        assert_eq!((v.ttft_met, v.ttft_cells), (2, 3), "{v:?}");
        assert_eq!((v.hit_met, v.hit_cells), (1, 2), "{v:?}");
        // Worst ratios: 1/3 (p90, p99 and p50 alike), 1.1, 1/3.
        let expected = (1.1f64 / 9.0).powf(1.0 / 3.0);
        assert!(
            (v.worst_ratio_geomean.unwrap() - expected).abs() < 1e-9,
            "{v:?}"
        );
        let line = verdict_line(&v);
        assert!(line.contains("in 2 of 3 cells"), "{line}");
        assert!(
            line.contains("in 1 of 2 cells whose working set fits"),
            "{line}"
        );
        // Without another policy there is nothing to compare.
        let mut alone = met;
        alone.policies.retain(|p| p.policy == "precise");
        let v = verdicts(&[alone]);
        assert_eq!(
            (v.ttft_met, v.ttft_cells, v.worst_ratio_geomean),
            (0, 0, None)
        );
        assert_eq!((v.hit_met, v.hit_cells), (1, 1));
    }

    #[test]
    fn the_json_keeps_its_fields_and_adds_the_itl_ratio() {
        let json = serde_json::to_value(cell()).unwrap();
        let ratio = json["precise_itl_p99_over_round_robin"].as_f64().unwrap();
        assert!((ratio - 0.0178 / 0.0065).abs() < 1e-9, "{json}");
        assert_eq!(json["policies"][0]["itl_p99"], 0.0065);
        assert_eq!(json["policies"][3]["ttft_p90"], 0.1);
    }
}
