//! `kvroute sim`: simulated vLLM engines, for laptops, demos and tests.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use kvroute_sim::engine::EngineConfig;
use kvroute_sim::engine::latency::{LLAMA_8B_KV_BYTES_PER_TOKEN, LatencyModel};
use kvroute_sim::server::faults::Faults;
use kvroute_sim::server::{SimConfig, start};

use super::events::parse_duration;

/// Arguments of `kvroute sim`.
#[derive(Args)]
pub struct SimArgs {
    /// Engines to run; engine i listens on port + i, events-port + i, replay-port + i.
    #[arg(long, default_value_t = 1)]
    engines: usize,
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
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// GPU KV blocks per engine (default: derived from --kv-cache-gib).
    #[arg(long)]
    num_gpu_blocks: Option<usize>,
    /// GPU memory for the KV cache, in GiB, when --num-gpu-blocks is not given.
    #[arg(long, default_value_t = 4.0)]
    kv_cache_gib: f64,
    /// KV-cache bytes per token (Llama-3.1-8B bf16: 131072).
    #[arg(long, default_value_t = LLAMA_8B_KV_BYTES_PER_TOKEN)]
    kv_bytes_per_token: usize,
    /// CPU offload tier, in blocks (0: none).
    #[arg(long, default_value_t = 0)]
    num_cpu_blocks: usize,
    /// Most sequences in a batch.
    #[arg(long, default_value_t = 256)]
    max_num_seqs: usize,
    /// Most tokens computed per step (chunked prefill budget).
    #[arg(long, default_value_t = 8192)]
    max_num_batched_tokens: usize,
    /// Longest prompt plus output.
    #[arg(long, default_value_t = 32768)]
    max_model_len: usize,
    /// vLLM's hash seed (PYTHONHASHSEED, or vLLM's default).
    #[arg(long, default_value = kvroute_core::keys::VLLM_DEFAULT_SEED)]
    hash_seed: String,
    /// Simulated seconds per wall second (10: ten times faster than real time).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Fixed cost of every step, seconds.
    #[arg(long, default_value_t = LatencyModel::default().step_overhead_s)]
    step_overhead_s: f64,
    /// Prefill cost per uncached prompt token, seconds.
    #[arg(long, default_value_t = LatencyModel::default().prefill_per_token_s)]
    prefill_per_token_s: f64,
    /// Decode cost per sequence per step, seconds.
    #[arg(long, default_value_t = LatencyModel::default().decode_per_seq_s)]
    decode_per_seq_s: f64,
    /// Decode cost per context token per step, seconds.
    #[arg(long, default_value_t = LatencyModel::default().decode_per_context_token_s)]
    decode_per_context_token_s: f64,
    /// Cost of loading one block from the CPU tier, seconds.
    #[arg(long, default_value_t = LatencyModel::default().cpu_load_per_block_s)]
    cpu_load_per_block_s: f64,
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

impl SimArgs {
    fn config(&self) -> anyhow::Result<SimConfig> {
        anyhow::ensure!(self.block_size > 0, "--block-size must be at least 1");
        anyhow::ensure!(
            (0.0..=1.0).contains(&self.drop_event_fraction),
            "--drop-event-fraction must be between 0 and 1"
        );
        let num_gpu_blocks = match self.num_gpu_blocks {
            Some(n) => n,
            None => {
                anyhow::ensure!(
                    self.kv_cache_gib > 0.0 && self.kv_bytes_per_token > 0,
                    "--kv-cache-gib and --kv-bytes-per-token must be positive"
                );
                (self.kv_cache_gib * (1u64 << 30) as f64
                    / (self.kv_bytes_per_token * self.block_size) as f64) as usize
            }
        };
        Ok(SimConfig {
            model: self.model.clone(),
            lora_modules: self.lora_modules.clone(),
            host: self.host.clone(),
            port: self.port,
            events_port: self.events_port,
            replay_port: (self.replay_port != 0).then_some(self.replay_port),
            engines: self.engines,
            engine: EngineConfig {
                block_size: self.block_size,
                num_gpu_blocks,
                num_cpu_blocks: self.num_cpu_blocks,
                max_num_seqs: self.max_num_seqs,
                max_num_batched_tokens: self.max_num_batched_tokens,
                max_model_len: self.max_model_len,
                hash_seed: self.hash_seed.clone(),
                latency: LatencyModel {
                    step_overhead_s: self.step_overhead_s,
                    prefill_per_token_s: self.prefill_per_token_s,
                    decode_per_seq_s: self.decode_per_seq_s,
                    decode_per_context_token_s: self.decode_per_context_token_s,
                    cpu_load_per_block_s: self.cpu_load_per_block_s,
                },
            },
            time_scale: self.time_scale,
            vllm_version: self.vllm_version.clone(),
            topic: self.topic.clone(),
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
        }
        tokio::signal::ctrl_c().await.context("waiting for Ctrl-C")?;
        Ok(ExitCode::SUCCESS)
    })
}
