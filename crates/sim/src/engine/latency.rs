//! How long one engine step takes.
//!
//! A step's time grows with the prompt tokens it prefills (compute-bound), the sequences it
//! decodes and the context they attend to (memory-bound), and, where the connector loads in the
//! step ([`super::tier_loads`]), the blocks it loads back from the offload tiers
//! (transfer-bound). Cached prompt tokens are not recomputed, which is the whole point
//! of prefix caching and of routing to where the cache is.
//!
//! The defaults approximate Llama-3.1-8B in bf16 on one H100 SXM, from public figures:
//! - H100 SXM: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3 (NVIDIA's datasheet); PCIe Gen5 x16,
//!   ~50 GB/s per direction in practice for host transfers.
//! - Llama-3.1-8B: ~8.0e9 parameters (16 GB of bf16 weights), 32 layers, 8 KV heads of dimension
//!   128, so the KV cache costs 2 x 32 x 8 x 128 x 2 bytes = 128 KiB per token (Meta's model
//!   card and config).
//! - Prefill: ~2 x 8e9 = 16 GFLOP per token; at ~50% of peak that is ~32 us per token
//!   (~31k tokens/s, in line with published vLLM prefill throughput for 8B models on H100).
//! - Decode: each step streams the weights once (16 GB / 3.35 TB/s = ~4.8 ms) plus each
//!   sequence's KV (128 KiB / 3.35 TB/s = ~39 ns per context token); a few us of per-sequence
//!   overhead. That gives ~5-7 ms inter-token latency at low batch, as commonly reported.
//! - CPU tier: one 16-token block is 2 MiB; at ~25 GB/s effective, ~80 us per block.
//! - SSD tier: a datacenter NVMe drive reads ~6 GB/s sequentially (e.g. Samsung PM1743 Gen5
//!   ~13 GB/s, Gen4 drives ~6-7 GB/s), so ~350 us per 2 MiB block, plus ~100 us of access
//!   latency (file open and first read) for each load from it.

use serde::{Deserialize, Serialize};

/// Coefficients of the step-time model, in seconds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LatencyModel {
    /// Fixed cost of any step (weights streamed once, launches).
    pub step_overhead_s: f64,
    /// Per prompt token computed (not per cached token).
    pub prefill_per_token_s: f64,
    /// Per sequence decoded in the step.
    pub decode_per_seq_s: f64,
    /// Per context token attended by decoding sequences.
    pub decode_per_context_token_s: f64,
    /// Per block loaded from the CPU tier.
    pub cpu_load_per_block_s: f64,
    /// Per block loaded from the local SSD tier.
    #[serde(default = "default_ssd_load_per_block_s")]
    pub ssd_load_per_block_s: f64,
    /// Once per load from the SSD tier (access latency): per request loading beside the batch,
    /// per step loading in it.
    #[serde(default = "default_ssd_load_latency_s")]
    pub ssd_load_latency_s: f64,
}

fn default_ssd_load_per_block_s() -> f64 {
    350e-6
}

fn default_ssd_load_latency_s() -> f64 {
    100e-6
}

impl Default for LatencyModel {
    fn default() -> Self {
        Self {
            step_overhead_s: 4.8e-3,
            prefill_per_token_s: 32e-6,
            decode_per_seq_s: 10e-6,
            decode_per_context_token_s: 39e-9,
            cpu_load_per_block_s: 80e-6,
            ssd_load_per_block_s: default_ssd_load_per_block_s(),
            ssd_load_latency_s: default_ssd_load_latency_s(),
        }
    }
}

/// The work of one step.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepWork {
    /// Prompt tokens computed.
    pub prefill_tokens: usize,
    /// Sequences decoded.
    pub decode_seqs: usize,
    /// Context tokens of the decoded sequences.
    pub context_tokens: usize,
    /// Blocks loaded from the CPU tier.
    pub cpu_blocks_loaded: usize,
    /// Blocks loaded from the SSD tier.
    pub ssd_blocks_loaded: usize,
    /// Seconds spent loading from the shared filesystem (its bandwidth is shared by the fleet,
    /// so the tier prices each load).
    pub shared_fs_load_s: f64,
    /// Seconds the engine waited for an asynchronous tier load, having nothing else to run.
    pub load_wait_s: f64,
}

impl LatencyModel {
    /// Duration of a step doing `work`, in seconds (0 for no work).
    pub fn step_seconds(&self, work: &StepWork) -> f64 {
        if *work == StepWork::default() {
            return 0.0;
        }
        let waited = StepWork {
            load_wait_s: work.load_wait_s,
            ..StepWork::default()
        };
        if *work == waited {
            return work.load_wait_s;
        }
        self.step_overhead_s
            + work.prefill_tokens as f64 * self.prefill_per_token_s
            + work.decode_seqs as f64 * self.decode_per_seq_s
            + work.context_tokens as f64 * self.decode_per_context_token_s
            + self.load_seconds(work.cpu_blocks_loaded, work.ssd_blocks_loaded)
            + work.shared_fs_load_s
            + work.load_wait_s
    }

    /// Time to load `cpu` blocks from the CPU tier and `ssd` from the SSD tier in one go (the
    /// SSD's access latency once, if any).
    pub fn load_seconds(&self, cpu: usize, ssd: usize) -> f64 {
        let ssd_s = if ssd == 0 {
            0.0
        } else {
            self.ssd_load_latency_s + ssd as f64 * self.ssd_load_per_block_s
        };
        cpu as f64 * self.cpu_load_per_block_s + ssd_s
    }

    /// Scales every coefficient by `factor` (a slower or faster engine).
    pub fn scaled(&self, factor: f64) -> Self {
        Self {
            step_overhead_s: self.step_overhead_s * factor,
            prefill_per_token_s: self.prefill_per_token_s * factor,
            decode_per_seq_s: self.decode_per_seq_s * factor,
            decode_per_context_token_s: self.decode_per_context_token_s * factor,
            cpu_load_per_block_s: self.cpu_load_per_block_s * factor,
            ssd_load_per_block_s: self.ssd_load_per_block_s * factor,
            ssd_load_latency_s: self.ssd_load_latency_s * factor,
        }
    }
}

/// KV-cache bytes per token of Llama-3.1-8B in bf16 (see the module doc).
pub const LLAMA_8B_KV_BYTES_PER_TOKEN: usize = 2 * 32 * 8 * 128 * 2;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slowed_down_engine_takes_longer_at_every_step_and_every_load() {
        let base = LatencyModel::default();
        let slow = base.scaled(2.0);
        let work = StepWork {
            prefill_tokens: 300,
            decode_seqs: 4,
            context_tokens: 2_000,
            cpu_blocks_loaded: 8,
            ssd_blocks_loaded: 8,
            ..StepWork::default()
        };
        let (fast_s, slow_s) = (base.step_seconds(&work), slow.step_seconds(&work));
        assert!((slow_s - 2.0 * fast_s).abs() < 1e-12, "{fast_s} {slow_s}");
        let (fast_load, slow_load) = (base.load_seconds(8, 8), slow.load_seconds(8, 8));
        assert!(
            (slow_load - 2.0 * fast_load).abs() < 1e-12,
            "{fast_load} {slow_load}"
        );
    }
}
