//! `kvroute events demo`: the quick start. Several demo engines publish vLLM-shaped KV events
//! over real ZMQ sockets; kvroute subscribes to each, builds its index, survives a lost batch
//! and an engine restart, and shows that the index knows which engine holds each conversation.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use kvroute_core::index::{EndpointId, IndexConfig, KvIndex, SharedIndex};
use kvroute_core::keys::router_keys;
use kvroute_vllm::codec::EventLayout;
use kvroute_vllm::publisher::demo::{DemoConfig, DemoEngine};
use kvroute_vllm::publisher::{Publisher, PublisherConfig, ReplayFraming};
use kvroute_vllm::subscriber::{
    EndpointSource, EventSink, SubscriberHandle, Timing, spawn_connected,
};

use crate::commands::numbers::parse_duration;

/// Arguments of `kvroute events demo`.
#[derive(Args)]
pub struct DemoArgs {
    /// Demo engines to run.
    #[arg(long, default_value_t = 3)]
    engines: u32,
    /// How long to publish.
    #[arg(long, default_value = "6s", value_parser = parse_duration)]
    duration: Duration,
    /// Batches per second per engine.
    #[arg(long, default_value_t = 50.0, value_parser = crate::commands::numbers::rate)]
    rate: f64,
}

struct Engine {
    id: EndpointId,
    name: String,
    version: &'static str,
    publisher: Publisher,
    model: DemoEngine,
    subscriber: SubscriberHandle,
}

/// Engines alternate between the array layout (vLLM 0.23) and the map layout (0.33).
const VERSIONS: [&str; 2] = ["0.23.0", "0.33.0"];

/// Runs the demo and prints what the index learned; fails if it disagrees with the engines.
pub async fn run(args: DemoArgs) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(args.engines >= 1, "--engines must be at least 1");
    anyhow::ensure!(
        args.rate > 0.0 && args.rate.is_finite(),
        "--rate must be a positive number"
    );
    let index = Arc::new(SharedIndex::new(KvIndex::new(IndexConfig::default())?));
    let mut engines = Vec::new();
    for i in 0..args.engines {
        let version = VERSIONS[i as usize % VERSIONS.len()];
        let publisher = Publisher::bind(PublisherConfig {
            address: "tcp://127.0.0.1:0".into(),
            connect: false,
            replay_address: Some("tcp://127.0.0.1:0".into()),
            topic: format!("kv@engine-{i}@demo-model"),
            layout: EventLayout::for_vllm_version(version)?,
            replay_framing: ReplayFraming::for_vllm_version(version)?,
            buffer_steps: 10_000,
        })
        .await
        .context("binding a demo engine's sockets")?;
        let id = EndpointId(i);
        let name = format!("engine-{i}");
        let subscriber = spawn_connected(
            EndpointSource {
                endpoint: id,
                name: name.clone(),
                publisher: publisher.address().to_owned(),
                replay: publisher.replay_address().map(str::to_owned),
                topic: format!("kv@engine-{i}@demo-model"),
            },
            index.clone() as Arc<dyn EventSink>,
            Timing::default(),
        );
        let model = DemoEngine::new(DemoConfig {
            seed: 100 + u64::from(i),
            capacity_blocks: 1500,
            ..DemoConfig::default()
        });
        println!(
            "{name}: vLLM {version} wire format, PUB {} , replay {}",
            publisher.address(),
            publisher.replay_address().unwrap_or("-")
        );
        engines.push(Engine {
            id,
            name,
            version,
            publisher,
            model,
            subscriber,
        });
    }

    let started = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / args.rate));
    let (mut lost_once, mut restarted) = (false, false);
    let mut step = 0u64;
    while started.elapsed() < args.duration {
        tick.tick().await;
        step += 1;
        let third = started.elapsed() >= args.duration / 3;
        let two_thirds = started.elapsed() >= args.duration * 2 / 3;
        for (i, engine) in engines.iter_mut().enumerate() {
            let batch = engine.model.step(step as f64);
            if i == 0 && third && !lost_once {
                // Simulate a dropped message: the subscriber must notice and replay it.
                engine.publisher.publish_lost(&batch);
                lost_once = true;
                println!(
                    "  t={:.1}s  engine-0: one batch lost in transit (subscriber must replay it)",
                    started.elapsed().as_secs_f64()
                );
                continue;
            }
            if i == engines_len_last(args.engines) && two_thirds && !restarted {
                engine.publisher.restart();
                engine.model.reset();
                restarted = true;
                println!(
                    "  t={:.1}s  {}: engine restarted (cache empty, sequence back to 0)",
                    started.elapsed().as_secs_f64(),
                    engine.name
                );
            }
            engine.publisher.publish(&batch).await?;
        }
    }
    // The subscribers drain and finish any replay: wait until the index agrees with every
    // engine on its block count and on the conversations the report checks, or DRAIN_TIMEOUT
    // passes (the report then shows where they differ).
    let deadline = tokio::time::Instant::now() + DRAIN_TIMEOUT;
    while !(engines.iter().all(|e| index_agrees(&index, e))
        && conversation_checks(&index, &engines)?
            .iter()
            .all(|c| c.right))
    {
        if tokio::time::Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    report(&index, &engines)
}

/// How long the demo waits for its subscribers to catch up with the engines before reporting.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(10);

/// Whether the index holds as many GPU blocks for `engine` as the engine itself does.
fn index_agrees(index: &SharedIndex, engine: &Engine) -> bool {
    let held = index.endpoint_stats(engine.id).map_or(0, |s| s.blocks_gpu);
    held as usize == engine.model.cached_blocks()
}

fn engines_len_last(engines: u32) -> usize {
    engines as usize - 1
}

fn report(index: &SharedIndex, engines: &[Engine]) -> anyhow::Result<ExitCode> {
    println!();
    println!(
        "{:<10} {:<8} {:>8} {:>7} {:>6} {:>8} {:>9} {:>10} {:>8}",
        "endpoint",
        "vLLM",
        "batches",
        "gaps",
        "lost",
        "restarts",
        "replayed",
        "blocks(idx)",
        "(engine)"
    );
    let mut consistent = true;
    for e in engines {
        let (_, feed) = e.subscriber.stats().into_iter().next().unwrap_or_default();
        let held = index.endpoint_stats(e.id).map_or(0, |s| s.blocks_gpu);
        consistent &= index_agrees(index, e);
        println!(
            "{:<10} {:<8} {:>8} {:>7} {:>6} {:>8} {:>9} {:>10} {:>8}",
            e.name,
            e.version,
            feed.batches,
            feed.gaps,
            feed.lost_batches,
            feed.restarts,
            feed.replayed_batches,
            held,
            e.model.cached_blocks()
        );
    }
    println!();
    println!("Longest cached prefix per conversation (blocks of 16 tokens), as the index sees it:");
    let checks = conversation_checks(index, engines)?;
    for c in &checks {
        println!("  {}", c.line);
    }
    let checked = checks.len();
    let right = checks.iter().filter(|c| c.right).count();
    println!();
    if consistent && right == checked {
        println!("OK: the index matches every engine's cache ({checked} conversations checked).");
        Ok(ExitCode::SUCCESS)
    } else {
        println!(
            "MISMATCH: the index disagrees with the engines ({right}/{checked} conversations right)."
        );
        Ok(ExitCode::from(2))
    }
}

/// One conversation the report checks: its line, and whether the index finds on its engine the
/// prefix the engine really holds.
struct ConversationCheck {
    line: String,
    right: bool,
}

/// The first three conversations of every engine, looked up in the index.
fn conversation_checks(
    index: &SharedIndex,
    engines: &[Engine],
) -> anyhow::Result<Vec<ConversationCheck>> {
    let mut checks = Vec::new();
    for owner in engines {
        for (c, tokens) in owner.model.conversations().iter().enumerate().take(3) {
            let keys = router_keys(tokens, 16, None)?;
            let matches = index.lookup(&keys);
            let truth = owner
                .model
                .block_hashes(tokens)
                .iter()
                .take_while(|h| owner.model.is_cached(**h))
                .count() as u32;
            let best = matches.matches.iter().max_by_key(|m| m.blocks);
            let cells: Vec<String> = engines
                .iter()
                .map(|e| format!("{}={}", e.name, matches.blocks(e.id)))
                .collect();
            checks.push(ConversationCheck {
                line: format!(
                    "{}/conv-{c:<2} {:>4} blocks: {}  -> route to {}",
                    owner.name,
                    keys.len(),
                    cells.join(" "),
                    best.map_or("any (no cache)".to_string(), |m| format!(
                        "engine-{}",
                        m.endpoint.0
                    ))
                ),
                right: matches.blocks(owner.id) == truth,
            });
        }
    }
    Ok(checks)
}
