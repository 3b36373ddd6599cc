//! Hand-written SVG building blocks for the report's charts: scales with readable ticks, a plot
//! frame with axes and grid lines, a legend, and the `<figure>` around a chart.

use super::{esc, shorten};

/// Series colours, one per run (Tableau 10: distinct, and readable for most colour-vision
/// deficiencies); runs beyond ten reuse them.
pub(crate) const PALETTE: [&str; 10] = [
    "#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#b07aa1", "#76b7b2", "#edc948", "#9c755f",
    "#ff9da7", "#bab0ac",
];

/// The colour of run `i`.
pub(crate) fn color(i: usize) -> &'static str {
    PALETTE[i % PALETTE.len()]
}

/// Text and axis grey.
pub(crate) const MUTED: &str = "#57606a";
/// Grid-line grey.
const GRID: &str = "#e4e7eb";
/// Average width of a character of 11 px text, for laying out labels.
pub(crate) const CHAR_W: f64 = 6.2;

/// A mapping of data values onto `[0, 1]`, linear or logarithmic, with its ticks.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Scale {
    /// Smallest value shown.
    pub lo: f64,
    /// Largest value shown.
    pub hi: f64,
    /// Tick spacing of a linear scale; 0 on a log scale.
    pub step: f64,
    /// Logarithmic.
    pub log: bool,
}

impl Scale {
    /// A linear scale covering `[lo, hi]`, widened to whole ticks of a 1-2-5 step.
    pub fn linear(lo: f64, hi: f64) -> Self {
        let (lo, hi) = if lo.is_finite() && hi.is_finite() {
            (lo.min(hi), lo.max(hi))
        } else {
            (0.0, 1.0)
        };
        let hi = if hi - lo < 1e-12 { lo + 1.0 } else { hi };
        let step = nice_step((hi - lo) / 5.0);
        let lo = (lo / step + 1e-9).floor() * step;
        let hi = (hi / step - 1e-9).ceil() * step;
        Scale {
            lo,
            hi: if hi <= lo { lo + step } else { hi },
            step,
            log: false,
        }
    }

    /// A fixed linear scale from `lo` to `hi` with ticks every `step`.
    pub fn fixed(lo: f64, hi: f64, step: f64) -> Self {
        Scale {
            lo,
            hi,
            step,
            log: false,
        }
    }

    /// A logarithmic scale covering `[lo, hi]` (both positive), widened to 1-2-5 values.
    pub fn log(lo: f64, hi: f64) -> Self {
        let lo = one_two_five(lo, false);
        let mut hi = one_two_five(hi, true);
        if hi <= lo * (1.0 + 1e-9) {
            hi = one_two_five(lo * 1.5, true);
        }
        Scale {
            lo,
            hi,
            step: 0.0,
            log: true,
        }
    }

    /// A scale for values in `[min, max]`: logarithmic when they are all positive and span more
    /// than `ratio` times, otherwise linear from zero.
    pub fn auto(min: f64, max: f64, ratio: f64) -> Self {
        if min.is_finite() && max.is_finite() && min > 0.0 && max / min > ratio {
            Scale::log(min, max)
        } else if max.is_finite() && max > 0.0 {
            Scale::linear(0.0, max)
        } else {
            Scale::linear(0.0, 1.0)
        }
    }

    /// Where `v` falls, from 0 (`lo`) to 1 (`hi`); values outside are pinned to the ends.
    pub fn frac(&self, v: f64) -> f64 {
        let f = if self.log {
            if v <= 0.0 {
                return 0.0;
            }
            (v.ln() - self.lo.ln()) / (self.hi.ln() - self.lo.ln())
        } else {
            (v - self.lo) / (self.hi - self.lo)
        };
        if f.is_finite() {
            f.clamp(0.0, 1.0)
        } else {
            0.0
        }
    }

    /// The tick values, ascending.
    pub fn ticks(&self) -> Vec<f64> {
        if self.log {
            let mut all = Vec::new();
            let mut v = self.lo;
            while v <= self.hi * (1.0 + 1e-9) && all.len() < 100 {
                all.push(v);
                v = one_two_five(v * 1.01, true);
            }
            if all.len() > 9 {
                // Many decades: powers of ten only.
                all.retain(|v| (v.log10() - v.log10().round()).abs() < 1e-6);
            }
            all
        } else {
            let n = ((self.hi - self.lo) / self.step).round().max(1.0) as usize;
            (0..=n.min(100))
                .map(|i| self.lo + i as f64 * self.step)
                .collect()
        }
    }

    /// A tick's label.
    pub fn label(&self, v: f64) -> String {
        if v == 0.0 {
            return "0".to_string();
        }
        let decimals = if self.log {
            (-(v.abs().log10() + 1e-9).floor()).max(0.0) as usize
        } else {
            (-(self.step.log10()) - 1e-9).ceil().max(0.0) as usize
        };
        format!("{:.*}", decimals, v)
    }
}

/// The nearest 1, 2 or 5 times a power of ten at or above `raw` (`up`) or at or below it.
fn one_two_five(raw: f64, up: bool) -> f64 {
    let raw = if raw.is_finite() && raw > 0.0 {
        raw
    } else {
        1.0
    };
    let exp = raw.log10().floor();
    let base = 10f64.powf(exp);
    let m = raw / base;
    let candidates = [1.0, 2.0, 5.0, 10.0];
    let pick = if up {
        candidates
            .iter()
            .copied()
            .find(|&c| m <= c * (1.0 + 1e-9))
            .unwrap_or(10.0)
    } else {
        candidates
            .iter()
            .rev()
            .copied()
            .find(|&c| m >= c * (1.0 - 1e-9))
            .unwrap_or(1.0)
    };
    pick * base
}

/// A tick step of 1, 2 or 5 times a power of ten near `raw`.
fn nice_step(raw: f64) -> f64 {
    if !(raw.is_finite() && raw > 0.0) {
        return 1.0;
    }
    one_two_five(raw, true)
}

/// The drawing area of a chart: the whole SVG size and the margins around the plot.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Frame {
    /// SVG width.
    pub w: f64,
    /// SVG height.
    pub h: f64,
    /// Margin left of the plot (y tick labels and title).
    pub left: f64,
    /// Margin right of the plot.
    pub right: f64,
    /// Margin above the plot (legend).
    pub top: f64,
    /// Margin below the plot (x tick labels and title).
    pub bottom: f64,
}

impl Frame {
    /// Plot width.
    pub fn pw(&self) -> f64 {
        self.w - self.left - self.right
    }

    /// Plot height.
    pub fn ph(&self) -> f64 {
        self.h - self.top - self.bottom
    }

    /// The x coordinate of a fraction of the plot width.
    pub fn x(&self, f: f64) -> f64 {
        self.left + f * self.pw()
    }

    /// The y coordinate of a fraction of the plot height (0 at the bottom).
    pub fn y(&self, f: f64) -> f64 {
        self.h - self.bottom - f * self.ph()
    }

    /// Opens the `<svg>` element.
    pub fn open(&self, out: &mut String, label: &str) {
        w!(
            out,
            r#"<svg viewBox="0 0 {} {}" role="img" aria-label="{}">"#,
            self.w,
            self.h,
            esc(label)
        );
    }

    /// The x axis: vertical grid lines at the ticks, tick labels and the title below.
    pub fn x_axis(&self, out: &mut String, scale: &Scale, title: &str) {
        let ticks = scale.ticks();
        out.push_str(r#"<g class="axis x-axis">"#);
        for &t in &ticks {
            let x = self.x(scale.frac(t));
            w!(
                out,
                r#"<line x1="{x:.1}" x2="{x:.1}" y1="{:.1}" y2="{:.1}" stroke="{GRID}"/>"#,
                self.y(0.0),
                self.y(1.0)
            );
            w!(
                out,
                r#"<text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
                self.y(0.0) + 15.0,
                esc(&scale.label(t))
            );
        }
        self.baseline(out);
        w!(
            out,
            r#"<text class="axis-title" x="{:.1}" y="{:.1}" text-anchor="middle">{}</text></g>"#,
            self.x(0.5),
            self.h - 6.0,
            esc(title)
        );
    }

    /// The plot's bottom line.
    pub fn baseline(&self, out: &mut String) {
        w!(
            out,
            r#"<line x1="{:.1}" x2="{:.1}" y1="{y:.1}" y2="{y:.1}" stroke="{MUTED}"/>"#,
            self.x(0.0),
            self.x(1.0),
            y = self.y(0.0)
        );
    }

    /// The y axis: horizontal grid lines at the ticks, tick labels (with `suffix`) and the
    /// title, rotated, on the left.
    pub fn y_axis(&self, out: &mut String, scale: &Scale, title: &str, suffix: &str) {
        out.push_str(r#"<g class="axis y-axis">"#);
        for t in scale.ticks() {
            let y = self.y(scale.frac(t));
            w!(
                out,
                r#"<line x1="{:.1}" x2="{:.1}" y1="{y:.1}" y2="{y:.1}" stroke="{GRID}"/>"#,
                self.x(0.0),
                self.x(1.0)
            );
            w!(
                out,
                r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}{}</text>"#,
                self.x(0.0) - 6.0,
                y + 4.0,
                esc(&scale.label(t)),
                esc(suffix)
            );
        }
        w!(
            out,
            r#"<line x1="{x:.1}" x2="{x:.1}" y1="{:.1}" y2="{:.1}" stroke="{MUTED}"/>"#,
            self.y(0.0),
            self.y(1.0),
            x = self.x(0.0)
        );
        let (cx, cy) = (14.0, self.y(0.5));
        w!(
            out,
            r#"<text class="axis-title" x="{cx}" y="{cy:.1}" text-anchor="middle" transform="rotate(-90 {cx} {cy:.1})">{}</text></g>"#,
            esc(title)
        );
    }

    /// A note in the middle of an empty plot.
    pub fn note(&self, out: &mut String, text: &str) {
        w!(
            out,
            r#"<text class="note" x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            self.x(0.5),
            self.y(0.62),
            esc(text)
        );
    }
}

/// How a legend entry's key is drawn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Key {
    /// A short line (line charts).
    Line,
    /// A filled square (bar charts).
    Box,
    /// A pale square with a coloured outline.
    Pale,
}

/// One legend entry.
#[derive(Clone, Debug)]
pub(crate) struct Entry {
    /// The text, unescaped.
    pub label: String,
    /// The key's colour.
    pub color: &'static str,
    /// The key's shape.
    pub key: Key,
}

/// Longest legend label, in characters.
const LEGEND_MAX_CHARS: usize = 40;
/// Height of one legend row.
const LEGEND_ROW: f64 = 18.0;

/// A legend laid out in rows across `width`, starting at `x`.
pub(crate) struct Legend {
    /// Entries with their positions (x, row).
    placed: Vec<(Entry, f64, usize)>,
    /// Rows used.
    rows: usize,
}

impl Legend {
    /// Lays out `entries` left to right, wrapping at `width`.
    pub fn new(entries: Vec<Entry>, x: f64, width: f64) -> Self {
        let mut placed = Vec::with_capacity(entries.len());
        let (mut cx, mut row) = (x, 0);
        for e in entries {
            let text_w = shorten(&e.label, LEGEND_MAX_CHARS).chars().count() as f64 * CHAR_W;
            let item_w = 20.0 + text_w + 16.0;
            if cx > x && cx + item_w > x + width {
                cx = x;
                row += 1;
            }
            placed.push((e, cx, row));
            cx += item_w;
        }
        let rows = if placed.is_empty() { 0 } else { row + 1 };
        Legend { placed, rows }
    }

    /// Height the legend needs.
    pub fn height(&self) -> f64 {
        self.rows as f64 * LEGEND_ROW
    }

    /// Draws the legend with its first row's centre at `y`.
    pub fn draw(&self, out: &mut String, y: f64) {
        out.push_str(r#"<g class="legend">"#);
        for (e, x, row) in &self.placed {
            let cy = y + *row as f64 * LEGEND_ROW;
            w!(out, "<g><title>{}</title>", esc(&e.label));
            match e.key {
                Key::Line => w!(
                    out,
                    r#"<path d="M{:.1} {cy:.1}h14" stroke="{}" stroke-width="3" stroke-linecap="round"/>"#,
                    x,
                    e.color
                ),
                Key::Box => w!(
                    out,
                    r#"<rect x="{:.1}" y="{:.1}" width="12" height="12" rx="2" fill="{}"/>"#,
                    x + 1.0,
                    cy - 6.0,
                    e.color
                ),
                Key::Pale => w!(
                    out,
                    r#"<rect x="{:.1}" y="{:.1}" width="11" height="11" rx="2" fill="{c}" fill-opacity="0.3" stroke="{c}"/>"#,
                    x + 1.5,
                    cy - 5.5,
                    c = e.color
                ),
            }
            w!(
                out,
                r#"<text class="legend-label" x="{:.1}" y="{:.1}">{}</text></g>"#,
                x + 20.0,
                cy + 4.0,
                esc(&shorten(&e.label, LEGEND_MAX_CHARS))
            );
        }
        out.push_str("</g>");
    }
}

/// A chart in its `<figure>`: `id`, a caption (a bold title and an explanation, both plain
/// text) and the SVG.
pub(crate) fn figure(id: &str, title: &str, caption: &str, svg: &str) -> String {
    format!(
        "<figure id=\"{}\">\n<figcaption><strong>{}</strong> {}</figcaption>\n{}\n</figure>\n",
        esc(id),
        esc(title),
        esc(caption),
        svg
    )
}
