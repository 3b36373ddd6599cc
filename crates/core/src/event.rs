//! KV-cache events as vLLM publishes them, in typed form.
//!
//! `kvroute-vllm` decodes the wire bytes (every release's layout) into these types; the index
//! applies them. Field names follow vLLM's, so the JSON form of an event reads like vLLM's own.

use serde::{Deserialize, Serialize};

use crate::keys::BlockExtraKeys;

/// A block hash as the engine publishes it (the low 64 bits of its digest). Opaque to the router.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct EngineHash(pub u64);

/// Where a cached block lives, fastest first. A hit on a slower tier is worth less.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Tier {
    /// GPU memory: reused for free.
    Gpu = 0,
    /// Host memory (CPU offload): costs a transfer.
    Cpu = 1,
    /// Local disk or remote storage: costs a slower transfer.
    Storage = 2,
}

impl Tier {
    /// Every tier, fastest first.
    pub const ALL: [Tier; 3] = [Tier::Gpu, Tier::Cpu, Tier::Storage];

    /// The tier a vLLM `medium` string names. Matching ignores case; vLLM has used `GPU`, `CPU`,
    /// `STORAGE`, `FS`, `OBJ` and (Mooncake store) `cpu`. A missing medium (vLLM before 0.10.2)
    /// is the GPU pool; any other name is treated as storage, the slowest tier, so that an
    /// unknown medium never earns more credit than it may deserve.
    pub fn from_medium(medium: Option<&str>) -> Tier {
        match medium {
            None => Tier::Gpu,
            Some(m) if m.eq_ignore_ascii_case("GPU") => Tier::Gpu,
            Some(m) if m.eq_ignore_ascii_case("CPU") => Tier::Cpu,
            Some(_) => Tier::Storage,
        }
    }
}

/// New full blocks committed to an engine's prefix cache.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct BlockStored {
    /// Hashes of the new blocks, in chain order.
    pub block_hashes: Vec<EngineHash>,
    /// Hash of the block before `block_hashes[0]`; `None` when the first new block starts a chain.
    pub parent_block_hash: Option<EngineHash>,
    /// All tokens of the new blocks, concatenated. Empty for offloading placeholders.
    pub token_ids: Vec<u32>,
    /// Tokens per block; 0 in offloading placeholders.
    pub block_size: u32,
    /// Adapter integer id (deprecated by vLLM in favour of `lora_name`).
    pub lora_id: Option<i64>,
    /// Storage medium string as published (`GPU`, `CPU`, `STORAGE`, ...); `None` before 0.10.2.
    pub medium: Option<String>,
    /// LoRA adapter name (0.14+).
    pub lora_name: Option<String>,
    /// Per-block extra hash keys (0.17+).
    pub extra_keys: Option<Vec<BlockExtraKeys>>,
    /// KV-cache group index (0.20+); 0 for plain models.
    pub group_idx: Option<i64>,
    /// The attention kind of the group's layers (0.22+): `full_attention`, `mla_attention`,
    /// `sliding_window`, `mamba`, ... A hybrid model numbers its groups in the order their
    /// kinds first appear among its layers, so group 0 may be a sliding-window or Mamba group;
    /// this says which group holds whole prefixes.
    #[serde(default)]
    pub kv_cache_spec_kind: Option<String>,
}

/// Blocks evicted from one tier of an engine's cache.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct BlockRemoved {
    /// Hashes of the evicted blocks.
    pub block_hashes: Vec<EngineHash>,
    /// Storage medium string as published; `None` before 0.10.2.
    pub medium: Option<String>,
    /// KV-cache group index (0.20+).
    pub group_idx: Option<i64>,
}

/// One KV-cache event.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type")]
pub enum KvEvent {
    /// Blocks stored.
    BlockStored(BlockStored),
    /// Blocks removed.
    BlockRemoved(BlockRemoved),
    /// The engine's prefix cache was reset.
    AllBlocksCleared,
}

/// One published batch: the events of one engine scheduler step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EventBatch {
    /// Engine wall-clock time at the end of the step, in seconds since the Unix epoch.
    pub ts: f64,
    /// The step's events, in order.
    pub events: Vec<KvEvent>,
    /// Data-parallel rank of the publishing engine (0.9.2+).
    pub data_parallel_rank: Option<i64>,
}

impl KvEvent {
    /// Number of blocks the event names (0 for `AllBlocksCleared`).
    pub fn block_count(&self) -> usize {
        match self {
            KvEvent::BlockStored(e) => e.block_hashes.len(),
            KvEvent::BlockRemoved(e) => e.block_hashes.len(),
            KvEvent::AllBlocksCleared => 0,
        }
    }
}
