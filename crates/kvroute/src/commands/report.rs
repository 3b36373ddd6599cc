//! `kvroute report`: charts drawn from tables of figures, for docs and tickets. `--bars FILE`
//! reads a grouped bar table (JSON, [`kvroute_bench::report::BarTable`]: groups, series and
//! their values, e.g. a sweep's TTFT p90 by link and policy) and writes the chart as SVG.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use kvroute_bench::report::{BarTable, bar_chart_svg};

/// Arguments of `kvroute report`.
#[derive(Args)]
pub struct ReportArgs {
    /// A grouped bar table as JSON: {"title", "y_label", "unit"?, "log"?, "groups": [...],
    /// "series": [{"name", "values": [one number or null per group]}]}.
    #[arg(long, value_name = "FILE")]
    bars: PathBuf,
    /// Where to write the SVG (standard output when absent).
    #[arg(long, value_name = "FILE")]
    out: Option<PathBuf>,
}

/// The largest table read: a chart's table is a few kilobytes; this bounds a wrong path (a
/// device, a trace) to a clear error instead of memory.
const MAX_TABLE_BYTES: u64 = 16 << 20;

/// Runs `kvroute report`.
pub fn run(args: ReportArgs) -> anyhow::Result<ExitCode> {
    let text = super::files::read_bounded(&args.bars, MAX_TABLE_BYTES, "a bar table")
        .with_context(|| format!("cannot read {}", args.bars.display()))?;
    let table: BarTable = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a grouped bar table", args.bars.display()))?;
    let svg =
        bar_chart_svg(&table).with_context(|| format!("cannot draw {}", args.bars.display()))?;
    match &args.out {
        Some(path) => {
            std::fs::write(path, svg).with_context(|| format!("cannot write {}", path.display()))?
        }
        None => print!("{svg}"),
    }
    Ok(ExitCode::SUCCESS)
}
