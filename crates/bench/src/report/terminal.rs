//! The terminal table: one row per figure, one right-aligned column per run.

use super::metrics::metrics;
use super::{run_label, shorten};
use crate::result::RunResult;

/// Spaces between columns.
const GAP: usize = 3;
/// Longest run name in a column heading, in characters.
const NAME_MAX_CHARS: usize = 28;

/// The table for `runs` (see [`super::table`]).
pub(crate) fn render(runs: &[RunResult]) -> String {
    if runs.is_empty() {
        return "(no runs)\n".to_string();
    }
    let rows = metrics(runs);
    let names: Vec<String> = (0..runs.len())
        .map(|i| printable(&shorten(&run_label(runs, i), NAME_MAX_CHARS)))
        .collect();
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|m| runs.iter().map(|r| m.show(r)).collect())
        .collect();
    let label_w = rows
        .iter()
        .map(|m| m.label.chars().count())
        .max()
        .unwrap_or(0);
    let widths: Vec<usize> = (0..runs.len())
        .map(|c| {
            cells
                .iter()
                .map(|row| row[c].chars().count())
                .chain([names[c].chars().count()])
                .max()
                .unwrap_or(0)
        })
        .collect();

    let mut out = String::new();
    let mut line = " ".repeat(label_w);
    for (name, &w) in names.iter().zip(&widths) {
        push_right(&mut line, name, w);
    }
    out.push_str(line.trim_end());
    out.push('\n');
    let total = label_w + widths.iter().map(|w| w + GAP).sum::<usize>();
    out.push_str(&"-".repeat(total));
    out.push('\n');
    for (m, row) in rows.iter().zip(&cells) {
        let mut line = m.label.to_string();
        line.push_str(&" ".repeat(label_w - m.label.chars().count()));
        for (cell, &w) in row.iter().zip(&widths) {
            push_right(&mut line, cell, w);
        }
        out.push_str(&line);
        out.push('\n');
    }
    out
}

/// Appends the gap and `s` right-aligned in `width` characters.
fn push_right(line: &mut String, s: &str, width: usize) {
    let pad = GAP + width.saturating_sub(s.chars().count());
    line.push_str(&" ".repeat(pad));
    line.push_str(s);
}

/// `s` without control characters, which would break the layout.
fn printable(s: &str) -> String {
    s.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}
