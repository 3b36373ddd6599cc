//! `kvroute events watch`: what a live engine publishes, decoded, with running statistics —
//! the first tool to reach for when cache-aware routing "does nothing".

use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use kvroute_core::event::EventBatch;
use kvroute_core::index::{EndpointId, IndexConfig, KvIndex, SharedIndex};
use kvroute_vllm::subscriber::{
    EndpointSource, EventSink, Timing, address_for_rank, spawn_connected,
};
use serde_json::json;

use crate::commands::numbers::parse_duration;

/// Arguments of `kvroute events watch`.
#[derive(Args)]
pub struct WatchArgs {
    /// The engine's PUB address (vLLM's default is tcp://HOST:5557).
    publisher: String,
    /// The engine's replay ROUTER address, if it has one.
    #[arg(long)]
    replay: Option<String>,
    /// Data-parallel rank: its sockets are on port + rank.
    #[arg(long, default_value_t = 0)]
    dp_rank: u16,
    /// Only accept this topic (vLLM's default topic is empty: accept all).
    #[arg(long, default_value = "")]
    topic: String,
    /// The engine's block size, for the index statistics.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Print statistics only, not every event.
    #[arg(long)]
    quiet: bool,
    /// How often to print statistics.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    stats_every: Duration,
    /// Stop after this long (default: until interrupted).
    #[arg(long, value_parser = parse_duration)]
    duration: Option<Duration>,
}

const ENDPOINT: EndpointId = EndpointId(0);

/// Prints every decoded event, then hands the batch to the index.
struct PrintingSink {
    index: Arc<SharedIndex>,
    quiet: bool,
}

impl EventSink for PrintingSink {
    fn apply(&self, endpoint: EndpointId, seq: u64, batch: &EventBatch) {
        if !self.quiet {
            let mut out = std::io::stdout().lock();
            for event in &batch.events {
                let line = json!({"seq": seq, "ts": batch.ts, "event": event});
                let _ = writeln!(out, "{line}");
            }
        }
        self.index.apply(endpoint, &batch.events);
    }

    fn purge(&self, endpoint: EndpointId) {
        println!("{}", json!({"engine_restarted": true}));
        self.index.clear_endpoint(endpoint);
    }

    fn unfilled_gap(&self, _endpoint: EndpointId, from: u64, to: u64) {
        println!("{}", json!({"lost_batches": {"from": from, "to": to}}));
    }
}

/// Watches until interrupted or `--duration` elapses.
pub async fn run(args: WatchArgs) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        !args.stats_every.is_zero(),
        "--stats-every must be longer than 0"
    );
    let publisher = address_for_rank(&args.publisher, args.dp_rank)?;
    let replay = args
        .replay
        .as_deref()
        .map(|r| address_for_rank(r, args.dp_rank))
        .transpose()?;
    let index = Arc::new(SharedIndex::new(KvIndex::new(IndexConfig {
        block_size: args.block_size,
        ..IndexConfig::default()
    })?));
    let sink = Arc::new(PrintingSink {
        index: index.clone(),
        quiet: args.quiet,
    });
    let handle = spawn_connected(
        EndpointSource {
            endpoint: ENDPOINT,
            name: publisher.clone(),
            publisher,
            replay,
            topic: args.topic.clone(),
        },
        sink,
        Timing::default(),
    );
    let print_stats = || {
        for (name, feed) in handle.stats() {
            let line = json!({"stats": {"endpoint": name, "stream": feed, "index": index.endpoint_stats(ENDPOINT)}});
            println!("{line}");
        }
    };
    let mut every = tokio::time::interval(args.stats_every);
    every.tick().await;
    let stop = async {
        match args.duration {
            Some(d) => tokio::time::sleep(d).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(stop);
    loop {
        tokio::select! {
            _ = every.tick() => print_stats(),
            _ = &mut stop => break,
            _ = tokio::signal::ctrl_c() => break,
        }
    }
    print_stats();
    Ok(ExitCode::SUCCESS)
}
