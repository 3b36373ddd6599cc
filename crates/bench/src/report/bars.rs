//! A grouped bar chart from any table of figures: groups along the x axis (e.g. links), one bar
//! per series in each group (e.g. policies), the value on the y axis (e.g. TTFT p90), linear
//! from zero or logarithmic when the values span decades. The table is plain data
//! ([`BarTable`], JSON), so a script or `kvroute report --bars` can draw any sweep's table, and
//! the SVG stands alone (a file for docs, or inline in a page).

use serde::{Deserialize, Serialize};

use super::esc;
use super::svg::{CHAR_W, Entry, Frame, Key, Legend, MUTED, Scale, color};

/// One series: its name (in the legend) and one value per group (`null`: no bar there).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BarSeries {
    /// The series' name.
    pub name: String,
    /// Its value in each group, in the table's group order.
    pub values: Vec<Option<f64>>,
}

/// A grouped bar chart's data.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BarTable {
    /// The chart's title (the SVG's accessible label and its heading).
    pub title: String,
    /// The y axis' title, e.g. `TTFT p90 (ms)`.
    pub y_label: String,
    /// A suffix for the y tick labels, e.g. ` ms` (none by default).
    #[serde(default)]
    pub unit: String,
    /// Logarithmic y axis: `true`, `false`, or absent to choose (log when the positive values
    /// span more than 30 times).
    #[serde(default)]
    pub log: Option<bool>,
    /// The groups, left to right.
    pub groups: Vec<String>,
    /// The series, drawn in this order within each group.
    pub series: Vec<BarSeries>,
}

/// Why a table cannot be drawn.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum BarTableError {
    /// A series has more or fewer values than there are groups.
    #[error("series {series:?} has {values} values for {groups} groups")]
    Shape {
        /// The series.
        series: String,
        /// Its values.
        values: usize,
        /// The groups.
        groups: usize,
    },
    /// A value is negative or not finite.
    #[error("series {series:?} has a value that is negative or not a number in group {group:?}")]
    Value {
        /// The series.
        series: String,
        /// The group.
        group: String,
    },
}

impl BarTable {
    /// Checks that every series has one value per group, each finite and not negative.
    pub fn validate(&self) -> Result<(), BarTableError> {
        for s in &self.series {
            if s.values.len() != self.groups.len() {
                return Err(BarTableError::Shape {
                    series: s.name.clone(),
                    values: s.values.len(),
                    groups: self.groups.len(),
                });
            }
            for (group, v) in self.groups.iter().zip(&s.values) {
                if v.is_some_and(|v| !v.is_finite() || v < 0.0) {
                    return Err(BarTableError::Value {
                        series: s.name.clone(),
                        group: group.clone(),
                    });
                }
            }
        }
        Ok(())
    }

    fn values(&self) -> impl Iterator<Item = f64> + '_ {
        self.series
            .iter()
            .flat_map(|s| s.values.iter().flatten().copied())
    }

    fn scale(&self) -> Scale {
        let positive = self.values().filter(|v| *v > 0.0);
        let (min, max) = positive.fold((f64::INFINITY, 0.0f64), |(lo, hi), v| {
            (lo.min(v), hi.max(v))
        });
        match self.log {
            Some(true) if max > 0.0 => Scale::log(min, max),
            Some(_) => Scale::linear(0.0, max.max(1e-9)),
            None => Scale::auto(min, max, 30.0),
        }
    }
}

/// Width of one group's slot when there is room, and the chart's bounds.
const SLOT_W: f64 = 150.0;
const MIN_W: f64 = 480.0;
const MAX_W: f64 = 1400.0;

/// `table` as a standalone SVG document (with its namespace and a title line). Missing values
/// draw no bar; each bar carries a tooltip with its series, group and value.
pub fn bar_chart_svg(table: &BarTable) -> Result<String, BarTableError> {
    table.validate()?;
    let scale = table.scale();
    let width = (90.0 + SLOT_W * table.groups.len() as f64).clamp(MIN_W, MAX_W);
    let entries = table
        .series
        .iter()
        .enumerate()
        .map(|(i, s)| Entry {
            label: s.name.clone(),
            color: color(i),
            key: Key::Box,
        })
        .collect();
    // Room for the widest tick label and the rotated axis title beside it.
    let widest = scale
        .ticks()
        .iter()
        .map(|t| (scale.label(*t).chars().count() + table.unit.chars().count()) as f64)
        .fold(0.0, f64::max);
    let left = (34.0 + widest * CHAR_W).max(60.0);
    let legend = Legend::new(entries, left, width - left - 16.0);
    let mut frame = Frame {
        w: width,
        h: 0.0,
        left,
        right: 16.0,
        top: 34.0 + legend.height() + 8.0,
        bottom: 44.0,
    };
    frame.h = frame.top + 260.0 + frame.bottom;
    let mut out = String::new();
    w!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {} {}" width="{}" height="{}" role="img" aria-label="{}" font-family="system-ui, sans-serif" font-size="11">"#,
        frame.w,
        frame.h,
        frame.w,
        frame.h,
        esc(&table.title)
    );
    w!(
        out,
        r##"<rect width="100%" height="100%" fill="#ffffff"/><text x="{left:.1}" y="18" font-size="13" font-weight="600" fill="#24292f">{}</text>"##,
        esc(&table.title)
    );
    out.push_str(&format!(r#"<g fill="{MUTED}">"#));
    legend.draw(&mut out, 34.0);
    frame.y_axis(&mut out, &scale, &table.y_label, &table.unit);
    out.push_str("</g>");
    draw_bars(&mut out, &frame, &scale, table);
    frame.baseline(&mut out);
    out.push_str("</svg>\n");
    Ok(out)
}

/// The bars and the group labels.
fn draw_bars(out: &mut String, frame: &Frame, scale: &Scale, table: &BarTable) {
    let groups = table.groups.len().max(1) as f64;
    let slot = frame.pw() / groups;
    let n = table.series.len().max(1) as f64;
    let bar = (slot * 0.8 / n).min(40.0);
    let y0 = frame.y(0.0);
    for (g, group) in table.groups.iter().enumerate() {
        let start = frame.x(0.0) + slot * g as f64 + (slot - bar * n) / 2.0;
        for (i, series) in table.series.iter().enumerate() {
            let Some(v) = series.values[g] else {
                continue;
            };
            let top = frame.y(scale.frac(v));
            w!(
                out,
                r#"<rect x="{:.1}" y="{top:.1}" width="{:.1}" height="{:.1}" fill="{}"><title>{}, {}: {}{}</title></rect>"#,
                start + bar * i as f64,
                (bar - 1.0).max(1.0),
                (y0 - top).max(0.0),
                color(i),
                esc(&series.name),
                esc(group),
                esc(&figure(v)),
                esc(&table.unit)
            );
        }
        let fits = ((slot / CHAR_W) as usize).max(4);
        w!(
            out,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle" fill="{MUTED}">{}</text>"#,
            frame.x(0.0) + slot * (g as f64 + 0.5),
            y0 + 16.0,
            esc(&super::shorten(group, fits))
        );
    }
}

/// A value as a tooltip shows it: three significant digits, no exponent.
fn figure(v: f64) -> String {
    if v == 0.0 {
        return "0".into();
    }
    let decimals = (2 - v.abs().log10().floor() as i32).max(0) as usize;
    format!("{v:.decimals$}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(values: [[Option<f64>; 3]; 2]) -> BarTable {
        BarTable {
            title: "TTFT p90 <by link>".into(),
            y_label: "TTFT p90 (ms)".into(),
            unit: " ms".into(),
            log: None,
            groups: vec!["tcp".into(), "roce-100".into(), "ib-400".into()],
            series: vec![
                BarSeries {
                    name: "aggregated".into(),
                    values: values[0].to_vec(),
                },
                BarSeries {
                    name: "always".into(),
                    values: values[1].to_vec(),
                },
            ],
        }
    }

    fn bars(svg: &str) -> Vec<(f64, f64)> {
        svg.split("<rect x=\"")
            .skip(1)
            // A bar holds its tooltip; the legend's keys close at once.
            .filter(|r| !r.split('>').next().unwrap_or("").ends_with('/'))
            .map(|r| {
                let number = |key: &str| -> f64 {
                    let at = r.find(key).unwrap() + key.len();
                    r[at..].split('"').next().unwrap().parse().unwrap()
                };
                (number("y=\""), number("height=\""))
            })
            .collect()
    }

    #[test]
    fn each_value_is_a_bar_as_tall_as_it_is_and_missing_ones_draw_none() {
        let t = table([
            [Some(400.0), Some(400.0), None],
            [Some(800.0), Some(200.0), Some(100.0)],
        ]);
        let svg = bar_chart_svg(&t).unwrap();
        assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
        assert!(svg.contains("TTFT p90 &lt;by link&gt;"), "escaped title");
        let drawn = bars(&svg);
        assert_eq!(drawn.len(), 5, "{svg}");
        // Linear from zero: 800 is twice as tall as 400, and 400 as tall in both groups.
        let (h400, h800) = (drawn[0].1, drawn[1].1);
        assert!((h800 - 2.0 * h400).abs() < 0.2, "{h400} {h800}");
        assert!((drawn[2].1 - h400).abs() < 0.2);
        assert!(svg.contains("<title>always, tcp: 800 ms</title>"), "{svg}");
    }

    #[test]
    fn values_spanning_decades_go_on_a_log_axis() {
        let t = table([
            [Some(400.0), Some(500.0), Some(450.0)],
            [Some(80_000.0), Some(700.0), Some(600.0)],
        ]);
        let drawn = bars(&bar_chart_svg(&t).unwrap());
        // On a log axis 80 s is not 200 times as tall as 400 ms.
        assert!(drawn[1].1 < 20.0 * drawn[0].1, "{drawn:?}");
        let linear = BarTable {
            log: Some(false),
            ..t
        };
        let drawn = bars(&bar_chart_svg(&linear).unwrap());
        assert!(drawn[1].1 > 100.0 * drawn[0].1, "{drawn:?}");
    }

    #[test]
    fn a_table_of_the_wrong_shape_or_values_is_refused() {
        let mut t = table([[Some(1.0); 3]; 2]);
        t.series[1].values.pop();
        assert!(matches!(
            bar_chart_svg(&t),
            Err(BarTableError::Shape { values: 2, .. })
        ));
        let t = table([[Some(1.0), Some(f64::NAN), None], [None; 3]]);
        assert!(matches!(
            bar_chart_svg(&t),
            Err(BarTableError::Value { .. })
        ));
        let t = table([[Some(-1.0), None, None], [None; 3]]);
        assert!(bar_chart_svg(&t).is_err());
    }

    #[test]
    fn a_table_reads_from_json() {
        let t: BarTable = serde_json::from_str(
            r#"{"title": "t", "y_label": "ms", "groups": ["a", "b"],
                "series": [{"name": "s", "values": [1.5, null]}]}"#,
        )
        .unwrap();
        assert_eq!(t.series[0].values, vec![Some(1.5), None]);
        assert_eq!(t.log, None);
        assert!(bar_chart_svg(&t).is_ok());
    }
}
