//! `--offload-config FILE`: the seed's tiered-offload shape, read into an engine's tiers.
//!
//! ```yaml
//! kv_cache:
//!   tiered_offload:
//!     tiers:
//!       gpu_memory: {}                  # the GPU pool, sized by --num-gpu-blocks/--kv-cache-gib
//!       cpu_memory: {capacity_gb: 64, bandwidth_gbps: 25}
//!       local_ssd: {path: /mnt/nvme0, capacity_gb: 800, bandwidth_gbps: 6, latency_ms: 0.1}
//!       shared_fs: {path: /mnt/lustre, capacity_gb: 20000, bandwidth_gbps: 10, latency_ms: 1}
//! ```
//!
//! Capacities become blocks at the engine's block size and KV bytes per token; bandwidth and
//! latency become the step-time model's load costs. A tier left out is absent; a tier left
//! without `bandwidth_gbps` or `latency_ms` keeps the model's default. `path` is recorded for
//! the reader (the simulator writes nothing to disk). Unknown keys are refused, so a typo does
//! not silently drop a tier.

use serde::Deserialize;

use super::EngineConfig;
use super::shared_fs::SharedFsConfig;
use crate::SimError;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    kv_cache: KvCache,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct KvCache {
    tiered_offload: TieredOffload,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TieredOffload {
    tiers: Tiers,
}

/// The tiers of the file, each optional.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct Tiers {
    gpu_memory: Option<TierSpec>,
    cpu_memory: Option<TierSpec>,
    local_ssd: Option<TierSpec>,
    shared_fs: Option<TierSpec>,
}

/// One tier's size and speed.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct TierSpec {
    /// Where the tier lives on a real node; accepted for the seed's shape, not used.
    #[serde(rename = "path")]
    _path: Option<String>,
    capacity_gb: Option<f64>,
    bandwidth_gbps: Option<f64>,
    latency_ms: Option<f64>,
}

impl TierSpec {
    fn blocks(&self, name: &str, block_bytes: f64) -> Result<usize, SimError> {
        let gb = self.capacity_gb.ok_or_else(|| {
            SimError::Config(format!("offload tier {name}: capacity_gb is required"))
        })?;
        positive(name, "capacity_gb", gb)?;
        Ok((gb * f64::from(1u32 << 30) / block_bytes) as usize)
    }

    fn seconds_per_block(&self, name: &str, block_bytes: f64) -> Result<Option<f64>, SimError> {
        self.bandwidth_gbps
            .map(|gbps| positive(name, "bandwidth_gbps", gbps).map(|g| block_bytes / (g * 1e9)))
            .transpose()
    }

    fn latency_s(&self, name: &str) -> Result<Option<f64>, SimError> {
        match self.latency_ms {
            Some(ms) if !(ms >= 0.0 && ms.is_finite()) => Err(SimError::Config(format!(
                "offload tier {name}: latency_ms must be 0 or more"
            ))),
            other => Ok(other.map(|ms| ms / 1e3)),
        }
    }
}

fn positive(tier: &str, field: &str, value: f64) -> Result<f64, SimError> {
    if value > 0.0 && value.is_finite() {
        Ok(value)
    } else {
        Err(SimError::Config(format!(
            "offload tier {tier}: {field} must be a positive number, got {value}"
        )))
    }
}

/// Reads the seed's tiered-offload YAML into `config`'s tiers (capacities and load costs).
pub fn apply_offload_config(yaml: &str, config: &mut EngineConfig) -> Result<(), SimError> {
    let file: File = serde_yaml_ng::from_str(yaml)
        .map_err(|e| SimError::Config(format!("offload config: {e}")))?;
    let tiers = file.kv_cache.tiered_offload.tiers;
    let block_bytes = (config.block_size * config.kv_bytes_per_token) as f64;
    if let Some(gpu) = &tiers.gpu_memory
        && gpu.capacity_gb.is_some()
    {
        return Err(SimError::Config(
            "offload tier gpu_memory: size the GPU pool with --num-gpu-blocks or --kv-cache-gib"
                .into(),
        ));
    }
    config.num_cpu_blocks = 0;
    config.num_ssd_blocks = 0;
    config.shared_fs = None;
    if let Some(cpu) = &tiers.cpu_memory {
        config.num_cpu_blocks = cpu.blocks("cpu_memory", block_bytes)?;
        if let Some(s) = cpu.seconds_per_block("cpu_memory", block_bytes)? {
            config.latency.cpu_load_per_block_s = s;
        }
        if cpu.latency_s("cpu_memory")?.is_some_and(|l| l > 0.0) {
            return Err(SimError::Config(
                "offload tier cpu_memory: latency_ms is not modelled (host loads cost bandwidth only)"
                    .into(),
            ));
        }
    }
    if let Some(ssd) = &tiers.local_ssd {
        config.num_ssd_blocks = ssd.blocks("local_ssd", block_bytes)?;
        if let Some(s) = ssd.seconds_per_block("local_ssd", block_bytes)? {
            config.latency.ssd_load_per_block_s = s;
        }
        if let Some(l) = ssd.latency_s("local_ssd")? {
            config.latency.ssd_load_latency_s = l;
        }
    }
    if let Some(fs) = &tiers.shared_fs {
        let mut shared = SharedFsConfig {
            capacity_blocks: fs.blocks("shared_fs", block_bytes)?,
            ..SharedFsConfig::default()
        };
        if let Some(gbps) = fs.bandwidth_gbps {
            shared.bandwidth_bytes_per_s = positive("shared_fs", "bandwidth_gbps", gbps)? * 1e9;
        }
        if let Some(l) = fs.latency_s("shared_fs")? {
            shared.latency_s = l;
        }
        config.shared_fs = Some(shared);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEED: &str = "
kv_cache:
  tiered_offload:
    tiers:
      gpu_memory: {}
      cpu_memory: {capacity_gb: 2, bandwidth_gbps: 20}
      local_ssd: {path: /mnt/nvme0, capacity_gb: 4, bandwidth_gbps: 5, latency_ms: 0.2}
      shared_fs: {path: /mnt/lustre, capacity_gb: 8, bandwidth_gbps: 10, latency_ms: 1}
";

    #[test]
    fn the_seeds_shape_sizes_every_tier_in_blocks_and_seconds() {
        let mut config = EngineConfig::default();
        apply_offload_config(SEED, &mut config).unwrap();
        // 16 tokens x 128 KiB = 2 MiB per block.
        assert_eq!((config.num_cpu_blocks, config.num_ssd_blocks), (1024, 2048));
        let block = 2.0 * f64::from(1u32 << 20);
        assert!((config.latency.cpu_load_per_block_s - block / 20e9).abs() < 1e-15);
        assert!((config.latency.ssd_load_per_block_s - block / 5e9).abs() < 1e-15);
        assert!((config.latency.ssd_load_latency_s - 0.2e-3).abs() < 1e-15);
        let fs = config.shared_fs.unwrap();
        assert_eq!(fs.capacity_blocks, 4096);
        assert_eq!((fs.bandwidth_bytes_per_s, fs.latency_s), (10e9, 1e-3));
    }

    #[test]
    fn typos_and_bad_numbers_are_refused_with_the_tier_named() {
        let mut config = EngineConfig::default();
        let typo = SEED.replace("local_ssd", "local_sdd");
        let e = apply_offload_config(&typo, &mut config).unwrap_err();
        assert!(e.to_string().contains("local_sdd"), "{e}");
        let zero = SEED.replace("capacity_gb: 4", "capacity_gb: 0");
        let e = apply_offload_config(&zero, &mut config).unwrap_err();
        assert!(e.to_string().contains("local_ssd: capacity_gb"), "{e}");
    }
}
