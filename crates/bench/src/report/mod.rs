//! Reports of benchmark runs, for comparing them side by side: a terminal table ([`table`]), a
//! self-contained HTML page with hand-drawn SVG charts ([`html`]), files holding both
//! ([`write_files`]) and the reading back of saved runs ([`load`]); and a grouped bar chart of
//! any table of figures ([`bar_chart_svg`], e.g. a sweep's TTFT by link and policy).
//!
//! The HTML page needs no network: no scripts, fonts or style sheets are fetched, so it can be
//! mailed, attached to a ticket or opened from an air-gapped machine.

use std::path::{Path, PathBuf};

use crate::result::RunResult;

pub use bars::{BarSeries, BarTable, BarTableError, bar_chart_svg};

/// `write!` into a `String`, which cannot fail.
macro_rules! w {
    ($dst:expr, $($arg:tt)*) => {{
        use std::fmt::Write as _;
        let _ = write!($dst, $($arg)*);
    }};
}

mod bars;
mod charts;
mod metrics;
mod page;
mod svg;
mod terminal;
#[cfg(test)]
mod tests;

/// A plain-text table comparing `runs` side by side, one column per run: requests, errors,
/// throughput, prefix-cache hit rate, TTFT, end-to-end and inter-token latency percentiles (in
/// milliseconds) and load imbalance; when a run read its engines' tier counters, the prompt
/// tokens found on the GPU and loaded from each offload tier. Figures a run lacks (no successful
/// request, no engine counters) show as `-`.
pub fn table(runs: &[RunResult]) -> String {
    terminal::render(runs)
}

/// One self-contained HTML page comparing `runs`: a summary table and four inline SVG charts
/// (TTFT distribution, prefix-cache hit rate, requests per endpoint, TTFT over the run). Every
/// string from the runs is escaped. The first run is the baseline that the others are compared
/// with.
pub fn html(runs: &[RunResult], title: &str) -> String {
    page::render(runs, title)
}

/// Writes `runs` to `dir/stem.json` (pretty JSON, a list of [`RunResult`]) and
/// `dir/stem.html` (the [`html`] report), creating `dir` if needed, and returns both paths.
pub fn write_files(
    runs: &[RunResult],
    dir: impl AsRef<Path>,
    stem: &str,
) -> Result<(PathBuf, PathBuf), std::io::Error> {
    let dir = dir.as_ref();
    std::fs::create_dir_all(dir)?;
    let json_path = dir.join(format!("{stem}.json"));
    let html_path = dir.join(format!("{stem}.html"));
    let mut json = serde_json::to_string_pretty(runs)?;
    json.push('\n');
    std::fs::write(&json_path, json)?;
    std::fs::write(&html_path, html(runs, &default_title(runs, stem)))?;
    Ok((json_path, html_path))
}

/// Reads runs saved as JSON: either one [`RunResult`] (what `kvroute bench --json` writes) or a
/// list of them (what [`write_files`] writes). Reports of several files concatenate the lists.
pub fn load(path: impl AsRef<Path>) -> Result<Vec<RunResult>, ReportError> {
    let path = path.as_ref();
    let text = std::fs::read_to_string(path).map_err(|source| ReportError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let parsed = if text.trim_start().starts_with('[') {
        serde_json::from_str::<Vec<RunResult>>(&text)
    } else {
        serde_json::from_str::<RunResult>(&text).map(|run| vec![run])
    };
    parsed.map_err(|source| ReportError::Parse {
        path: path.to_path_buf(),
        source,
    })
}

/// Why saved runs could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// The file could not be read.
    #[error("cannot read {}: {source}", .path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The file is not JSON of one run result or a list of them.
    #[error("{} is not a run result or a list of run results: {source}", .path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: serde_json::Error,
    },
}

/// The page title [`write_files`] uses: the runs' names, or the file stem without runs.
fn default_title(runs: &[RunResult], stem: &str) -> String {
    if runs.is_empty() {
        return format!("kvroute bench: {stem}");
    }
    let names: Vec<&str> = runs.iter().map(|r| r.name.as_str()).collect();
    format!("kvroute bench: {}", names.join(" vs "))
}

/// `s` escaped for HTML text and attribute values.
pub(crate) fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c if c.is_control() && c != '\n' && c != '\t' => out.push('\u{fffd}'),
            c => out.push(c),
        }
    }
    out
}

/// `name` cut to at most `max` characters (with an ellipsis), for labels with little room.
pub(crate) fn shorten(name: &str, max: usize) -> String {
    let max = max.max(2);
    if name.chars().count() <= max {
        name.to_string()
    } else {
        let mut s: String = name.chars().take(max - 1).collect();
        s.push('…');
        s
    }
}

/// How a run is named in tables and legends: its name, or `run N` (1-based) when it has none.
pub(crate) fn run_label(runs: &[RunResult], i: usize) -> String {
    let name = runs[i].name.trim();
    if name.is_empty() {
        format!("run {}", i + 1)
    } else {
        name.to_string()
    }
}
