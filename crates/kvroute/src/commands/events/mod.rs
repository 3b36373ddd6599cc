//! `kvroute events ...`: the operator's tools for vLLM KV events.

mod decode;
mod demo;
mod publish;
mod watch;

use std::process::ExitCode;

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
