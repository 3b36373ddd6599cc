//! The matrix's results as a text table and as an HTML page with a heat map of precise against
//! the best other policy (TTFT p90 ratio; green where precise is faster) and its hit rate
//! against the pooled-cache ceiling.

use std::fmt::Write as _;

use super::CellResult;

/// One line per cell: its coordinates, the ceiling, and each policy's hit rate and TTFT p90,
/// then precise's TTFT ratios to the best other policy.
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
    let _ = writeln!(out, " {:>18} {:>8}", "precise/best p50,90,99", "ITL p99");
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
        let itl = r
            .figures("precise")
            .map_or("-".to_owned(), |p| format!("{:.1}ms", p.itl_p99 * 1e3));
        let _ = writeln!(out, " {ratios:>18} {itl:>8}");
    }
    out
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
         policies' (median of the seeds; green: precise faster, red: slower), and precise's hit \
         rate over the pooled-cache ceiling's.</p><table><tr><th>shape</th>",
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
                    let _ = write!(
                        out,
                        "<td style=\"background:{}\">p90 {p90:.2}×<br>hit {:.0}% of ceiling</td>",
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
