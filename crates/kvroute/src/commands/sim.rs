//! `kvroute sim`: simulated vLLM engines, for laptops, demos and tests.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use kvroute_sim::connector_events::OffloadEvents;
use kvroute_sim::engine::EngineConfig;
use kvroute_sim::server::faults::Faults;
use kvroute_sim::server::pd::PdConfig;
use kvroute_sim::server::{SimConfig, start};
use kvroute_vllm::nixl::KvLoadFailurePolicy;

use super::engine_args::EngineArgs;
use super::numbers::parse_duration;
use super::pd_args::PdFleetArgs;

/// Arguments of `kvroute sim`.
#[derive(Args)]
pub struct SimArgs {
    /// Engines to run; engine i listens on port + i, events-port + i, replay-port + i
    /// (default 1, or 0 beside --prefill-engines/--decode-engines).
    #[arg(long)]
    engines: Option<usize>,
    #[command(flatten)]
    pd: PdFleetArgs,
    /// P/D: how long a producer holds blocks nobody pulls, in engine time (default: the
    /// release's: 120 s before 0.20, 480 s before 0.33, the 30 s heartbeat lease of 0.33).
    #[arg(long, value_parser = parse_duration)]
    kv_lease: Option<Duration>,
    /// P/D: what a consumer does when a pull fails: fail (vLLM's default) or recompute.
    #[arg(long, default_value = "fail", value_parser = parse_policy)]
    kv_load_failure_policy: KvLoadFailurePolicy,
    /// P/D: side-channel port of engine 0 (vLLM's VLLM_NIXL_SIDE_CHANNEL_PORT); engine i
    /// uses + i.
    #[arg(long, default_value_t = 5600)]
    side_channel_port: u16,
    /// Host to bind.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// HTTP port of engine 0.
    #[arg(long, default_value_t = 8001)]
    port: u16,
    /// KV-event PUB port of engine 0 (vLLM's default is 5557).
    #[arg(long, default_value_t = 5557)]
    events_port: u16,
    /// Replay ROUTER port of engine 0 (0 disables replay).
    #[arg(long, default_value_t = 6557)]
    replay_port: u16,
    /// Served model name.
    #[arg(long, default_value = "sim-llama-3.1-8b")]
    model: String,
    /// LoRA adapters to serve besides the base model (comma-separated names).
    #[arg(long, value_delimiter = ',')]
    lora_modules: Vec<String>,
    /// vLLM release whose KV-event wire format to speak.
    #[arg(long, default_value = "0.33.0")]
    vllm_version: String,
    /// KV-event topic (vLLM's default is empty).
    #[arg(long, default_value = "")]
    topic: String,
    /// Tier events as this offloading connector publishes them: vllm (OffloadingConnector
    /// placeholders), vllm-self-describing (its self_describing_kv_events payload) or lmcache
    /// (LMCache: stores only, its own chunk hashes).
    #[arg(long, default_value = "vllm")]
    offload_events: OffloadEvents,
    #[command(flatten)]
    engine: EngineArgs,
    /// Simulated seconds per wall second (10: ten times faster than real time). The engines'
    /// metrics report simulated seconds (latency histograms, KV transfer and tier load times),
    /// so a router learns rates from them in simulated time: keep 1 to measure what a router
    /// learns.
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// A HuggingFace tokenizer.json instead of the built-in tokenizer.
    #[arg(long)]
    tokenizer: Option<std::path::PathBuf>,
    /// A .jinja chat template (default: the one in tokenizer_config.json beside --tokenizer).
    #[arg(long, requires = "tokenizer")]
    chat_template: Option<std::path::PathBuf>,
    /// Fault: fraction of KV-event batches lost in transit (replay still has them).
    #[arg(long, default_value_t = 0.0)]
    drop_event_fraction: f64,
    /// Fault: delay before each event batch is published.
    #[arg(long, default_value = "0ms", value_parser = parse_duration)]
    event_delay: Duration,
    /// Fault: step time multiplier (2.0: twice as slow).
    #[arg(long, default_value_t = 1.0)]
    slow_factor: f64,
}

fn parse_policy(text: &str) -> Result<KvLoadFailurePolicy, String> {
    text.parse()
        .map_err(|e: kvroute_vllm::VllmError| e.to_string())
}

impl SimArgs {
    /// The fleet's size and P/D settings.
    fn fleet(&self) -> anyhow::Result<(usize, Option<PdConfig>)> {
        let (engines, roles) = self.pd.roles(self.engines, 1)?;
        anyhow::ensure!(engines > 0, "the fleet has no engines");
        let Some(roles) = roles else {
            return Ok((engines, None));
        };
        Ok((
            engines,
            Some(PdConfig {
                lease: self.kv_lease,
                load_failure_policy: self.kv_load_failure_policy,
                link: self.pd.link(),
                kv_bytes_per_token: self.engine.kv_bytes_per_token() as u64,
                side_channel_port: self.side_channel_port,
                ..PdConfig::new(roles)
            }),
        ))
    }

    fn config(&self) -> anyhow::Result<SimConfig> {
        anyhow::ensure!(
            (0.0..=1.0).contains(&self.drop_event_fraction),
            "--drop-event-fraction must be between 0 and 1"
        );
        let (engines, pd) = self.fleet()?;
        Ok(SimConfig {
            model: self.model.clone(),
            lora_modules: self.lora_modules.clone(),
            host: self.host.clone(),
            port: self.port,
            events_port: self.events_port,
            replay_port: (self.replay_port != 0).then_some(self.replay_port),
            engines,
            engine: EngineConfig {
                tier_loads: self
                    .engine
                    .tier_loads()
                    .unwrap_or(self.offload_events.tier_loads()),
                ..self.engine.engine_config()?
            },
            time_scale: self.time_scale,
            vllm_version: self.vllm_version.clone(),
            topic: self.topic.clone(),
            offload_events: self.offload_events,
            replay_buffer_steps: 10_000,
            faults: Faults {
                drop_event_fraction: self.drop_event_fraction,
                event_delay: self.event_delay,
                slow_factor: self.slow_factor,
                ..Faults::default()
            },
            tokenizer: self
                .tokenizer
                .clone()
                .map(|t| (t, self.chat_template.clone())),
            pd,
        })
    }
}

/// Runs the engines until interrupted.
pub fn run(args: SimArgs) -> anyhow::Result<ExitCode> {
    let config = args.config()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let fleet = start(config.clone()).await.context("starting the simulated engines")?;
        println!(
            "kvroute sim: {} engine(s) serving {:?}, {} GPU blocks of {} tokens each, vLLM {} events",
            fleet.endpoints.len(),
            config.model,
            config.engine.num_gpu_blocks,
            config.engine.block_size,
            config.vllm_version
        );
        for ep in &fleet.endpoints {
            println!("  engine {}: {}  events {}  replay {}", ep.index, ep.url, ep.events, ep.replay.as_deref().unwrap_or("-"));
            if let Some(role) = ep.kv_role {
                println!("    kv_role {}  side channel {}", role.vllm_name(), ep.side_channel.as_deref().unwrap_or("-"));
            }
        }
        tokio::signal::ctrl_c().await.context("waiting for Ctrl-C")?;
        Ok(ExitCode::SUCCESS)
    })
}

#[cfg(test)]
mod tests {
    use clap::Parser;
    use kvroute_sim::engine::TierLoads;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        sim: SimArgs,
    }

    fn tier_loads(args: &[&str]) -> TierLoads {
        let cli = Cli::try_parse_from(std::iter::once("sim").chain(args.iter().copied())).unwrap();
        cli.sim.config().unwrap().engine.tier_loads
    }

    #[test]
    fn engines_load_tiers_as_their_connector_does_unless_told() {
        assert_eq!(
            tier_loads(&[]),
            TierLoads::Async,
            "vLLM's OffloadingConnector"
        );
        assert_eq!(
            tier_loads(&["--offload-events", "vllm-self-describing"]),
            TierLoads::Async
        );
        assert_eq!(
            tier_loads(&["--offload-events", "lmcache"]),
            TierLoads::InStep,
            "LMCache loads in the step by default"
        );
        assert_eq!(
            tier_loads(&["--offload-events", "lmcache", "--tier-loads", "async"]),
            TierLoads::Async
        );
        assert_eq!(tier_loads(&["--tier-loads", "in-step"]), TierLoads::InStep);
    }
}
