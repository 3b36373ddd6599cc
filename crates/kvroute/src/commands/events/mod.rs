//! `kvroute events ...`: the operator's tools for vLLM KV events.

mod decode;
mod demo;
mod publish;
mod watch;

use std::process::ExitCode;
use std::time::Duration;

use clap::Subcommand;

/// The `events` subcommands.
#[derive(Subcommand)]
pub enum EventsCommand {
    /// Decode KV-event payloads (hex, one per line on stdin) into JSON lines, one per event.
    Decode,
    /// Connect to a live engine and print its events and running statistics.
    Watch(watch::WatchArgs),
    /// Publish a realistic demo event stream in vLLM's wire format, with replay.
    PublishDemo(publish::PublishArgs),
    /// Run demo engines, subscribe to them and show the index following them (quick start).
    Demo(demo::DemoArgs),
}

impl EventsCommand {
    /// The log level when `RUST_LOG` is not set.
    pub fn default_log_level(&self) -> &'static str {
        match self {
            EventsCommand::Decode => "warn",
            EventsCommand::Demo(_) => "warn",
            _ => "info",
        }
    }
}

/// Runs an `events` subcommand.
pub fn run(cmd: EventsCommand) -> anyhow::Result<ExitCode> {
    match cmd {
        EventsCommand::Decode => decode::run(),
        EventsCommand::Watch(args) => runtime()?.block_on(watch::run(args)),
        EventsCommand::PublishDemo(args) => runtime()?.block_on(publish::run(args)),
        EventsCommand::Demo(args) => runtime()?.block_on(demo::run(args)),
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?)
}

/// Parses durations such as `500ms`, `10s`, `2m`.
pub(crate) fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a duration like 500ms, 10s or 2m"))?;
    let seconds = match unit {
        "ms" => value / 1000.0,
        "s" | "" => value,
        "m" => value * 60.0,
        _ => return Err(format!("unknown unit {unit:?} in {text:?}: use ms, s or m")),
    };
    crate::commands::numbers::duration_of(seconds).map_err(|e| format!("{text:?}: {e}"))
}
