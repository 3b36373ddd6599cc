//! The engine-model flags `kvroute sim` and `kvroute simulate` share: blocks, batching, tiers
//! and the step-time model.

use anyhow::Context;
use clap::Args;
use kvroute_sim::engine::latency::{LLAMA_8B_KV_BYTES_PER_TOKEN, LatencyModel};
use kvroute_sim::engine::offload_config::apply_offload_config;
use kvroute_sim::engine::shared_fs::SharedFsConfig;
use kvroute_sim::engine::{EngineConfig, TierLoads};

/// One engine's model.
#[derive(Args)]
pub struct EngineArgs {
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// GPU KV blocks per engine (default: derived from --kv-cache-gib).
    #[arg(long)]
    num_gpu_blocks: Option<usize>,
    /// GPU memory for the KV cache, in GiB, when --num-gpu-blocks is not given.
    #[arg(long, default_value_t = 4.0)]
    kv_cache_gib: f64,
    /// KV-cache bytes per token, or a model preset: llama-3.1-8b (131072, bf16),
    /// llama-3.1-70b (327680). Sizes the cache, and the KV a P/D transfer moves.
    #[arg(long, default_value_t = LLAMA_8B_KV_BYTES_PER_TOKEN, value_parser = parse_kv_bytes)]
    kv_bytes_per_token: usize,
    /// CPU offload tier, in blocks (0: none).
    #[arg(long, default_value_t = 0)]
    num_cpu_blocks: usize,
    /// Local SSD offload tier below the CPU tier, in blocks (0: none).
    #[arg(long, default_value_t = 0)]
    num_ssd_blocks: usize,
    /// Offload tiers in the seed's shape (kv_cache.tiered_offload.tiers: cpu_memory, local_ssd,
    /// shared_fs with capacity_gb, bandwidth_gbps, latency_ms); replaces the tier flags.
    #[arg(long, value_name = "FILE")]
    offload_config: Option<std::path::PathBuf>,
    /// Shared filesystem tier the whole fleet mounts, in blocks (0: none).
    #[arg(long, default_value_t = 0)]
    shared_fs_blocks: usize,
    /// Aggregate read bandwidth of the shared filesystem, GB/s (all loads share it).
    #[arg(long, default_value_t = SharedFsConfig::default().bandwidth_bytes_per_s / 1e9)]
    shared_fs_gbps: f64,
    /// Access latency of one shared-filesystem load, seconds.
    #[arg(long, default_value_t = SharedFsConfig::default().latency_s)]
    shared_fs_latency_s: f64,
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
    /// Cost of loading one block from the SSD tier, seconds.
    #[arg(long, default_value_t = LatencyModel::default().ssd_load_per_block_s)]
    ssd_load_per_block_s: f64,
    /// Access latency of one load from the SSD tier (per request, or per step with
    /// --tier-loads in-step), seconds.
    #[arg(long, default_value_t = LatencyModel::default().ssd_load_latency_s)]
    ssd_load_latency_s: f64,
    /// How blocks found on the offload tiers load: async (beside the batch, as vLLM's
    /// OffloadingConnector loads them) or in-step (the admitting step waits, as LMCache's
    /// connector loads by default). Default: async; `kvroute sim --offload-events lmcache`:
    /// in-step.
    #[arg(long)]
    tier_loads: Option<TierLoads>,
}

fn parse_kv_bytes(text: &str) -> Result<usize, String> {
    kvroute_sim::link::kv_bytes_per_token(text)
        .map(|b| b as usize)
        .map_err(|e| e.to_string())
}

impl EngineArgs {
    /// KV-cache bytes per token.
    pub fn kv_bytes_per_token(&self) -> usize {
        self.kv_bytes_per_token
    }

    /// The tier load mode given on the command line, if any.
    pub fn tier_loads(&self) -> Option<TierLoads> {
        self.tier_loads
    }

    /// The engine configuration the flags describe.
    pub fn engine_config(&self) -> anyhow::Result<EngineConfig> {
        anyhow::ensure!(self.block_size > 0, "--block-size must be at least 1");
        let num_gpu_blocks = match self.num_gpu_blocks {
            Some(n) => n,
            None => {
                anyhow::ensure!(
                    self.kv_cache_gib > 0.0
                        && self.kv_cache_gib <= MAX_KV_CACHE_GIB
                        && self.kv_bytes_per_token > 0,
                    "--kv-cache-gib must be within 0–{MAX_KV_CACHE_GIB} and --kv-bytes-per-token positive"
                );
                (self.kv_cache_gib * (1u64 << 30) as f64
                    / (self.kv_bytes_per_token * self.block_size) as f64) as usize
            }
        };
        let mut config = EngineConfig {
            block_size: self.block_size,
            num_gpu_blocks,
            num_cpu_blocks: self.num_cpu_blocks,
            num_ssd_blocks: self.num_ssd_blocks,
            shared_fs: (self.shared_fs_blocks > 0).then_some(SharedFsConfig {
                capacity_blocks: self.shared_fs_blocks,
                bandwidth_bytes_per_s: self.shared_fs_gbps * 1e9,
                latency_s: self.shared_fs_latency_s,
            }),
            kv_bytes_per_token: self.kv_bytes_per_token,
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_model_len: self.max_model_len,
            hash_seed: self.hash_seed.clone(),
            tier_loads: self.tier_loads.unwrap_or_default(),
            latency: LatencyModel {
                step_overhead_s: self.step_overhead_s,
                prefill_per_token_s: self.prefill_per_token_s,
                decode_per_seq_s: self.decode_per_seq_s,
                decode_per_context_token_s: self.decode_per_context_token_s,
                cpu_load_per_block_s: self.cpu_load_per_block_s,
                ssd_load_per_block_s: self.ssd_load_per_block_s,
                ssd_load_latency_s: self.ssd_load_latency_s,
            },
        };
        if let Some(path) = &self.offload_config {
            let yaml = super::files::read_bounded(
                path,
                MAX_OFFLOAD_CONFIG_BYTES,
                "an offload configuration",
            )
            .with_context(|| format!("reading --offload-config {}", path.display()))?;
            apply_offload_config(&yaml, &mut config)
                .with_context(|| format!("--offload-config {}", path.display()))?;
        }
        Ok(config)
    }
}

/// The largest KV cache a simulated engine may have, GiB (a node of eight 192 GiB GPUs is under
/// 2 TiB).
const MAX_KV_CACHE_GIB: f64 = 1_048_576.0;

/// An offload configuration is a few tiers: anything larger is not one.
const MAX_OFFLOAD_CONFIG_BYTES: u64 = 1 << 20;
