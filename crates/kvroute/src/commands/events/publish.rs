//! `kvroute events publish-demo`: a live vLLM-shaped event stream for trying the tools.

use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use clap::Args;
use kvroute_vllm::codec::EventLayout;
use kvroute_vllm::publisher::demo::{DemoConfig, DemoEngine};
use kvroute_vllm::publisher::{Publisher, PublisherConfig, ReplayFraming};
use tracing::info;

/// Arguments of `kvroute events publish-demo`.
#[derive(Args)]
pub struct PublishArgs {
    /// PUB address to bind.
    #[arg(long, default_value = "tcp://127.0.0.1:5557")]
    address: String,
    /// Replay ROUTER address to bind ("none" disables replay).
    #[arg(long, default_value = "tcp://127.0.0.1:5558")]
    replay: String,
    /// vLLM version whose wire layout and replay framing to use.
    #[arg(long, default_value = "0.33.0")]
    vllm_version: String,
    /// Topic (frame 1).
    #[arg(long, default_value = "")]
    topic: String,
    /// Batches per second.
    #[arg(long, default_value_t = 20.0, value_parser = crate::commands::numbers::rate)]
    rate: f64,
    /// Stop after this many batches (default: run until interrupted).
    #[arg(long)]
    steps: Option<u64>,
    /// Blocks the simulated cache holds.
    #[arg(long, default_value_t = 2000)]
    capacity_blocks: usize,
    /// Random seed of the traffic.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// Publishes until interrupted or `--steps` batches are out.
pub async fn run(args: PublishArgs) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        args.rate > 0.0 && args.rate.is_finite(),
        "--rate must be a positive number"
    );
    let layout = EventLayout::for_vllm_version(&args.vllm_version)?;
    let replay_framing = ReplayFraming::for_vllm_version(&args.vllm_version)?;
    let mut publisher = Publisher::bind(PublisherConfig {
        address: args.address.clone(),
        connect: false,
        replay_address: (args.replay != "none").then(|| args.replay.clone()),
        topic: args.topic.clone(),
        layout,
        replay_framing,
        buffer_steps: 10_000,
    })
    .await
    .context("starting the demo publisher")?;
    info!(
        publisher = publisher.address(),
        replay = publisher.replay_address().unwrap_or("none"),
        vllm = %args.vllm_version,
        "publishing demo KV events"
    );
    let mut engine = DemoEngine::new(DemoConfig {
        capacity_blocks: args.capacity_blocks,
        seed: args.seed,
        ..DemoConfig::default()
    });
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / args.rate));
    let mut sent = 0u64;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = tokio::signal::ctrl_c() => break,
        }
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs_f64();
        let batch = engine.step(now);
        publisher.publish(&batch).await?;
        sent += 1;
        if args.steps.is_some_and(|limit| sent >= limit) {
            break;
        }
    }
    info!(batches = sent, "demo publisher stopped");
    Ok(ExitCode::SUCCESS)
}
