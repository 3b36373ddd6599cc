//! The figures a report shows for each run, shared by the terminal table and the HTML summary:
//! how each is read from a run, formatted, and compared between runs.

use crate::result::{Percentiles, RunResult};

/// Which way a figure improves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Better {
    /// More is better (throughput, hit rate).
    Higher,
    /// Less is better (latency, errors, imbalance).
    Lower,
    /// Neither (request counts, durations).
    Neither,
}

/// How a figure is written and how two runs' values are compared.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Unit {
    /// A whole number; not compared.
    Count,
    /// Seconds of wall time, one decimal; not compared.
    Seconds,
    /// A rate per second; compared relatively.
    PerSecond,
    /// Seconds shown as milliseconds; compared relatively.
    Millis,
    /// A fraction shown as a percentage; compared in percentage points.
    Percent,
    /// A ratio, two decimals; compared relatively.
    Ratio,
}

/// One row of a comparison.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Metric {
    /// The row's label, with its unit.
    pub label: &'static str,
    /// How values are written and compared.
    pub unit: Unit,
    /// Which way is better.
    pub better: Better,
    /// The run's value, if it has one.
    pub value: fn(&RunResult) -> Option<f64>,
}

impl Metric {
    /// The run's value as text, `-` when it has none.
    pub fn show(&self, run: &RunResult) -> String {
        match (self.value)(run) {
            Some(v) => format_value(self.unit, v),
            None => "-".to_string(),
        }
    }

    /// The change from `base` to `v`, as text (`-63%`, `+12.5 pp`), and whether it is an
    /// improvement (`None` when neither). `None` when the figure is not compared or the change
    /// cannot be expressed (a relative change from zero).
    pub fn delta(&self, base: f64, v: f64) -> Option<(String, Option<bool>)> {
        let (d, text) = match self.unit {
            Unit::Count | Unit::Seconds => return None,
            Unit::Percent => {
                let d = (v - base) * 100.0;
                (d, format!("{} pp", signed(d, 1)))
            }
            Unit::PerSecond | Unit::Millis | Unit::Ratio => {
                if base.abs() < 1e-12 {
                    return None;
                }
                let d = (v - base) / base.abs() * 100.0;
                (d, format!("{}%", signed(d, 0)))
            }
        };
        let negligible = match self.unit {
            Unit::Percent => d.abs() < 0.05,
            _ => d.abs() < 0.5,
        };
        let good = match self.better {
            _ if negligible => None,
            Better::Higher => Some(d > 0.0),
            Better::Lower => Some(d < 0.0),
            Better::Neither => None,
        };
        Some((text, good))
    }
}

/// `v` with an explicit sign (a true minus sign) and `decimals` decimals; `±0` when it rounds
/// to zero.
fn signed(v: f64, decimals: usize) -> String {
    let s = format!("{:.*}", decimals, v.abs());
    if s.chars().all(|c| c == '0' || c == '.') {
        format!("±{s}")
    } else if v < 0.0 {
        format!("\u{2212}{s}")
    } else {
        format!("+{s}")
    }
}

/// `v` written for `unit`.
pub(crate) fn format_value(unit: Unit, v: f64) -> String {
    if !v.is_finite() {
        return "-".to_string();
    }
    match unit {
        Unit::Count => format!("{v:.0}"),
        Unit::Seconds => format!("{v:.1}"),
        Unit::PerSecond => {
            if v.abs() >= 100.0 {
                format!("{v:.1}")
            } else {
                format!("{v:.2}")
            }
        }
        Unit::Millis => format_ms(v),
        Unit::Percent => format!("{:.1}%", v * 100.0),
        Unit::Ratio => format!("{v:.2}"),
    }
}

/// Seconds as milliseconds, with three significant figures or more.
pub(crate) fn format_ms(seconds: f64) -> String {
    let ms = seconds * 1e3;
    let a = ms.abs();
    if a < 1.0 {
        format!("{ms:.3}")
    } else if a < 10.0 {
        format!("{ms:.2}")
    } else if a < 1000.0 {
        format!("{ms:.1}")
    } else {
        format!("{ms:.0}")
    }
}

/// Whether a percentile block holds data (a run with no successful request has none).
fn present(p: &Percentiles) -> bool {
    p.count > 0 || p.p50 != 0.0 || p.p99 != 0.0 || p.mean != 0.0
}

/// A percentile field when the block holds data.
fn pct(p: &Percentiles, v: f64) -> Option<f64> {
    (present(p) && v.is_finite()).then_some(v)
}

/// A finite value.
fn finite(v: f64) -> Option<f64> {
    v.is_finite().then_some(v)
}

/// The rows comparing `runs`. The engine hit rate appears only when some run has it.
pub(crate) fn metrics(runs: &[RunResult]) -> Vec<Metric> {
    let mut rows = vec![
        Metric {
            label: "requests",
            unit: Unit::Count,
            better: Better::Neither,
            value: |r| Some(r.summary.requests as f64),
        },
        Metric {
            label: "errors",
            unit: Unit::Count,
            better: Better::Lower,
            value: |r| Some(r.summary.errors as f64),
        },
        Metric {
            label: "duration (s)",
            unit: Unit::Seconds,
            better: Better::Neither,
            value: |r| finite(r.summary.duration_s),
        },
        Metric {
            label: "req/s",
            unit: Unit::PerSecond,
            better: Better::Higher,
            value: |r| finite(r.summary.requests_per_s),
        },
        Metric {
            label: "output tok/s",
            unit: Unit::PerSecond,
            better: Better::Higher,
            value: |r| finite(r.summary.output_tokens_per_s),
        },
        Metric {
            label: "prefix-cache hit rate",
            unit: Unit::Percent,
            better: Better::Higher,
            value: |r| finite(r.summary.hit_rate),
        },
    ];
    if runs.iter().any(|r| r.summary.engine_hit_rate.is_some()) {
        rows.push(Metric {
            label: "engine hit rate",
            unit: Unit::Percent,
            better: Better::Higher,
            value: |r| r.summary.engine_hit_rate.and_then(finite),
        });
    }
    if runs.iter().any(|r| r.summary.tier_tokens.is_some()) {
        rows.extend(tier_rows());
    }
    rows.extend([
        Metric {
            label: "TTFT p50 (ms)",
            unit: Unit::Millis,
            better: Better::Lower,
            value: |r| pct(&r.summary.ttft, r.summary.ttft.p50),
        },
        Metric {
            label: "TTFT p90 (ms)",
            unit: Unit::Millis,
            better: Better::Lower,
            value: |r| pct(&r.summary.ttft, r.summary.ttft.p90),
        },
        Metric {
            label: "TTFT p99 (ms)",
            unit: Unit::Millis,
            better: Better::Lower,
            value: |r| pct(&r.summary.ttft, r.summary.ttft.p99),
        },
        Metric {
            label: "TTFT mean (ms)",
            unit: Unit::Millis,
            better: Better::Lower,
            value: |r| pct(&r.summary.ttft, r.summary.ttft.mean),
        },
        Metric {
            label: "E2E p50 (ms)",
            unit: Unit::Millis,
            better: Better::Lower,
            value: |r| pct(&r.summary.e2e, r.summary.e2e.p50),
        },
        Metric {
            label: "E2E p99 (ms)",
            unit: Unit::Millis,
            better: Better::Lower,
            value: |r| pct(&r.summary.e2e, r.summary.e2e.p99),
        },
        Metric {
            label: "ITL p50 (ms)",
            unit: Unit::Millis,
            better: Better::Lower,
            value: |r| pct(&r.summary.itl, r.summary.itl.p50),
        },
        Metric {
            label: "ITL p99 (ms)",
            unit: Unit::Millis,
            better: Better::Lower,
            value: |r| pct(&r.summary.itl, r.summary.itl.p99),
        },
        Metric {
            label: "load imbalance (max/mean)",
            unit: Unit::Ratio,
            better: Better::Lower,
            value: |r| {
                let v = r.summary.load_imbalance;
                (v.is_finite() && v > 0.0).then_some(v)
            },
        },
    ]);
    rows
}

/// The rows of where the engines found the prompt tokens, tier by tier (for runs that read
/// the engines' tier counters). Not compared: more tokens loaded from a slower tier is better
/// than recomputing them and worse than finding them on the GPU.
fn tier_rows() -> [Metric; 4] {
    let tokens = |label, value| Metric {
        label,
        unit: Unit::Count,
        better: Better::Neither,
        value,
    };
    [
        tokens("tokens found on GPU", |r| {
            r.summary.tier_tokens.as_ref().map(|t| t.gpu as f64)
        }),
        tokens("tokens loaded from CPU", |r| {
            r.summary.tier_tokens.as_ref().map(|t| t.cpu as f64)
        }),
        tokens("tokens loaded from SSD", |r| {
            r.summary.tier_tokens.as_ref().map(|t| t.ssd as f64)
        }),
        tokens("tokens loaded from shared FS", |r| {
            r.summary.tier_tokens.as_ref().map(|t| t.shared_fs as f64)
        }),
    ]
}

/// Which runs hold the best value of `metric`: empty unless at least two runs have a value and
/// they differ.
pub(crate) fn best(metric: &Metric, runs: &[RunResult]) -> Vec<bool> {
    let values: Vec<Option<f64>> = runs.iter().map(|r| (metric.value)(r)).collect();
    let present: Vec<f64> = values.iter().flatten().copied().collect();
    let mut flags = vec![false; runs.len()];
    if present.len() < 2 || metric.better == Better::Neither {
        return flags;
    }
    let (lo, hi) = present
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &v| {
            (lo.min(v), hi.max(v))
        });
    // Values that look the same once written are the same to the reader.
    let shown = |v: f64| format_value(metric.unit, v);
    if shown(lo) == shown(hi) {
        return flags;
    }
    let target = shown(if metric.better == Better::Higher {
        hi
    } else {
        lo
    });
    for (flag, v) in flags.iter_mut().zip(&values) {
        *flag = v.is_some_and(|v| shown(v) == target);
    }
    flags
}
