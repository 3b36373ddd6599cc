//! `kvroute`: the command-line tool. Parses arguments, sets up logging and a runtime, and hands
//! each command to its module; the logic lives in the library crates.

mod commands;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// KV-cache-aware routing for vLLM fleets.
#[derive(Parser)]
#[command(name = "kvroute", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Compute block keys for token ids: the router's key chain and vLLM's sha256_cbor hashes.
    Hash(commands::hash::HashArgs),
    /// Work with vLLM KV events: decode, watch a live engine, publish a demo stream.
    #[command(subcommand)]
    Events(commands::events::EventsCommand),
    /// Measure a workload against any OpenAI-compatible endpoint; `bench compare` renders runs.
    Bench(Box<commands::bench::BenchArgs>),
    /// The whole story on a laptop: simulated engines, five routing policies, one report.
    Demo(commands::demo::DemoArgs),
    /// Pick endpoints for a Gateway API Inference Extension gateway (Envoy ext_proc).
    #[cfg(feature = "epp")]
    Epp(commands::epp::EppArgs),
    /// Draw a chart from a table of figures (`--bars`: a grouped bar chart, SVG).
    Report(commands::report::ReportArgs),
    /// Run the KV-cache-aware router in front of vLLM engines.
    Serve(commands::serve::ServeArgs),
    /// Run simulated vLLM engines (OpenAI API, prefix cache, KV events, metrics), no GPU needed.
    Sim(Box<commands::sim::SimArgs>),
    /// Simulate a fleet in virtual time: a workload through routing policies, bench's results.
    Simulate(Box<commands::simulate::SimulateArgs>),
    /// Search a policy's parameters for a workload on a simulated fleet; prints YAML for serve.
    Tune(Box<commands::tune::TuneArgs>),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let default_level = match &cli.command {
        Command::Hash(_) | Command::Report(_) => "warn",
        Command::Events(cmd) => cmd.default_log_level(),
        Command::Sim(_) | Command::Serve(_) => "info",
        #[cfg(feature = "epp")]
        Command::Epp(_) => "info",
        Command::Demo(_) | Command::Bench(_) | Command::Simulate(_) | Command::Tune(_) => "error",
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level)),
        )
        .init();
    let result = match cli.command {
        Command::Hash(args) => commands::hash::run(args),
        Command::Report(args) => commands::report::run(args),
        Command::Events(cmd) => commands::events::run(cmd),
        Command::Sim(args) => commands::sim::run(*args),
        Command::Serve(args) => commands::serve::run(args),
        Command::Simulate(args) => commands::simulate::run(*args),
        Command::Tune(args) => commands::tune::run(*args),
        #[cfg(feature = "epp")]
        Command::Epp(args) => commands::epp::run(args),
        Command::Bench(args) => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .map_err(anyhow::Error::from)
            .and_then(|rt| rt.block_on(commands::bench::run(*args))),
        Command::Demo(args) => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .map_err(anyhow::Error::from)
            .and_then(|rt| rt.block_on(commands::demo::run(args))),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kvroute: error: {}", described(&e));
            exit_code(&e)
        }
    }
}

/// The error and its causes, joined by `: ` as anyhow's `{:#}` joins them, leaving out a cause
/// whose text ends the one before it (an error that prints its source and also returns it), so
/// that no message is read twice.
fn described(e: &anyhow::Error) -> String {
    let mut text = String::new();
    let mut previous = String::new();
    for cause in e.chain() {
        let this = cause.to_string();
        if !(previous == this || previous.ends_with(&format!(": {this}"))) {
            if !text.is_empty() {
                text.push_str(": ");
            }
            text.push_str(&this);
        }
        previous = this;
    }
    text
}

/// The one mapping from an error that stopped a command to the process's exit status: the
/// router's own errors say theirs (an unusable configuration: 78, sysexits' EX_CONFIG);
/// anything else is 1.
fn exit_code(e: &anyhow::Error) -> ExitCode {
    let code = e
        .chain()
        .find_map(|cause| cause.downcast_ref::<kvroute_router::RouterError>())
        .map_or(1, kvroute_router::RouterError::exit_code);
    ExitCode::from(code)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error that prints its source and also returns it.
    #[derive(Debug)]
    struct Embeds(std::io::Error);

    impl std::fmt::Display for Embeds {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "reading the stream: {}", self.0)
        }
    }

    impl std::error::Error for Embeds {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn a_cause_already_said_is_not_said_again() {
        let io = std::io::Error::other("connection refused");
        let e = anyhow::Error::new(Embeds(io)).context("subscribing to engine-a");
        assert_eq!(
            described(&e),
            "subscribing to engine-a: reading the stream: connection refused"
        );
        // Causes that do not repeat each other are all said, in order.
        let plain = anyhow::anyhow!("refused")
            .context("connecting")
            .context("starting");
        assert_eq!(described(&plain), "starting: connecting: refused");
        // A short cause whose words the context happens to hold is its own: said.
        let short = anyhow::anyhow!("timed out").context("the probe timed out waiting");
        assert_eq!(described(&short), "the probe timed out waiting: timed out");
    }
}
