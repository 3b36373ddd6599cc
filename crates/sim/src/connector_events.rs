//! The tier events an engine publishes, shaped as the chosen offloading connector publishes them
//! (`kvroute sim --offload-events`; `shared/reference/vllm-wire.md` §6).
//!
//! The engine model ([`crate::engine`]) describes its tiers below the GPU canonically: one
//! event per block, naming its vLLM hash and the tier's medium, a store when a block lands on a
//! tier and a removal when it leaves. [`ConnectorEvents`] turns that into one connector's
//! stream; the GPU's own events pass unchanged:
//! - [`OffloadEvents::Vllm`]: vLLM's OffloadingConnector, default payload. A placeholder per
//!   offloaded chunk (here one block): its hash, no tokens, no parent, `block_size` 0 (the
//!   offloaded block size before 0.20). Each store gets its own removal (a block stored twice
//!   is removed twice: consumers must reference-count, as vLLM documents); the engine model
//!   writes a block through once, so it stores none twice.
//! - [`OffloadEvents::VllmSelfDescribing`]: the same connector with
//!   `self_describing_kv_events`: each offloaded block with its real parent hash, its tokens,
//!   the GPU block size and its LoRA and extra keys; removals as above.
//! - [`OffloadEvents::Lmcache`]: LMCache's connector. It stores on write, so every block the
//!   GPU stores is announced at once with LMCache's own chunk hash (a chain over the tokens, not
//!   vLLM's hash), its tokens and its parent chunk's hash, on medium `cpu`; nothing is ever
//!   removed. The engine's tier moves are not published: the stream cannot say what a tier
//!   dropped, or that a block moved to the SSD or the shared filesystem (the error that costs
//!   is measured by the index-consistency test and recorded in `docs/tiers.md`).
//!
//! What is remembered is bounded: tokens and parents of at most `capacity_blocks` blocks (the
//! engine's blocks on every tier), the oldest forgotten first; an offloaded block whose GPU
//! store was forgotten is published as a placeholder.

use std::collections::{HashMap, VecDeque};
use std::str::FromStr;

use kvroute_core::event::{BlockRemoved, BlockStored, EngineHash, KvEvent};

/// Which connector's tier events a simulated engine publishes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OffloadEvents {
    /// vLLM's OffloadingConnector, placeholder payload (its default).
    #[default]
    Vllm,
    /// vLLM's OffloadingConnector with `self_describing_kv_events`.
    VllmSelfDescribing,
    /// LMCache's connector: stores only, its own hashes.
    Lmcache,
}

impl FromStr for OffloadEvents {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "vllm" => Ok(Self::Vllm),
            "vllm-self-describing" => Ok(Self::VllmSelfDescribing),
            "lmcache" => Ok(Self::Lmcache),
            other => Err(format!(
                "unknown offload event shape `{other}` (vllm, vllm-self-describing, lmcache)"
            )),
        }
    }
}

/// The medium LMCache's events carry (as its connector publishes them).
pub const LMCACHE_MEDIUM: &str = "cpu";

impl OffloadEvents {
    /// How this connector loads the blocks a request finds on its tiers: vLLM's
    /// OffloadingConnector beside the batch, LMCache (without its asynchronous loading) in the
    /// admitting step.
    pub fn tier_loads(self) -> crate::engine::TierLoads {
        match self {
            Self::Vllm | Self::VllmSelfDescribing => crate::engine::TierLoads::Async,
            Self::Lmcache => crate::engine::TierLoads::InStep,
        }
    }
}

/// What a GPU store said of one block.
#[derive(Clone, Debug)]
struct BlockInfo {
    parent: Option<EngineHash>,
    /// The GPU store's event, its block's own tokens and extra keys only.
    store: BlockStored,
    /// The block's LMCache chunk hash.
    lmcache: u64,
    /// Its position in `order` (a block stored again moves to the back).
    generation: u64,
}

/// One engine's connector: what it has published, to shape what comes next.
#[derive(Debug)]
pub struct ConnectorEvents {
    shape: OffloadEvents,
    block_size: usize,
    /// The offloaded block size in placeholders (vLLM before 0.20), else 0.
    placeholder_block_size: u32,
    capacity_blocks: usize,
    blocks: HashMap<EngineHash, BlockInfo>,
    /// `blocks` by age: (hash, generation), oldest first; stale entries are skipped.
    order: VecDeque<(EngineHash, u64)>,
    generation: u64,
    /// Stores announced per block on each of the engine's own tiers (CPU, storage), not yet
    /// removed: (medium, count). A shared tier's blocks are the fleet's, not counted here.
    announced: HashMap<EngineHash, Vec<(String, u32)>>,
}

impl ConnectorEvents {
    /// A connector publishing `shape` for an engine of `block_size`-token blocks holding at
    /// most `capacity_blocks` blocks on all its tiers, speaking vLLM release `vllm_version`.
    pub fn new(
        shape: OffloadEvents,
        block_size: usize,
        capacity_blocks: usize,
        vllm_version: &str,
    ) -> Self {
        let before_0_20 = minor_version(vllm_version).is_some_and(|minor| minor < 20);
        Self {
            shape,
            block_size: block_size.max(1),
            placeholder_block_size: if before_0_20 { block_size as u32 } else { 0 },
            capacity_blocks: capacity_blocks.max(1),
            blocks: HashMap::new(),
            order: VecDeque::new(),
            generation: 0,
            announced: HashMap::new(),
        }
    }

    /// The engine's events of one step, as the connector publishes them.
    pub fn shape(&mut self, events: Vec<KvEvent>) -> Vec<KvEvent> {
        let lmcache = self.shape == OffloadEvents::Lmcache;
        let mut out = Vec::with_capacity(events.len());
        for event in events {
            match event {
                KvEvent::BlockStored(stored) if is_gpu(stored.medium.as_deref()) => {
                    let chunks = self.remember(&stored);
                    out.push(KvEvent::BlockStored(stored));
                    out.extend(chunks);
                }
                KvEvent::BlockRemoved(removed) if is_gpu(removed.medium.as_deref()) => {
                    out.push(KvEvent::BlockRemoved(removed));
                }
                KvEvent::BlockStored(stored) if !lmcache => out.extend(self.offloaded(stored)),
                KvEvent::BlockRemoved(removed) if !lmcache => out.extend(self.dropped(removed)),
                // LMCache publishes no tier moves.
                KvEvent::BlockStored(_) | KvEvent::BlockRemoved(_) => {}
                KvEvent::AllBlocksCleared => {
                    self.announced.clear();
                    out.push(KvEvent::AllBlocksCleared);
                }
            }
        }
        out
    }

    /// Forgets everything (the engine restarted).
    pub fn reset(&mut self) {
        self.blocks.clear();
        self.order.clear();
        self.announced.clear();
    }

    /// Remembers the blocks of a GPU store; for LMCache, its stores of the same blocks.
    fn remember(&mut self, stored: &BlockStored) -> Vec<KvEvent> {
        let bs = self.block_size;
        let mut parent = stored.parent_block_hash;
        let mut lmcache = Vec::new();
        for (i, &hash) in stored.block_hashes.iter().enumerate() {
            let Some(tokens) = stored.token_ids.get(i * bs..(i + 1) * bs) else {
                break;
            };
            let parent_chunk = parent.and_then(|p| self.blocks.get(&p)).map(|b| b.lmcache);
            let chunk = lmcache_hash(parent_chunk, tokens);
            let store = BlockStored {
                block_hashes: vec![hash],
                parent_block_hash: parent,
                token_ids: tokens.to_vec(),
                extra_keys: stored
                    .extra_keys
                    .as_ref()
                    .and_then(|keys| keys.get(i).cloned().map(|k| vec![k])),
                ..stored.clone()
            };
            if self.shape == OffloadEvents::Lmcache {
                lmcache.push(KvEvent::BlockStored(BlockStored {
                    block_hashes: vec![EngineHash(chunk)],
                    parent_block_hash: parent_chunk.map(EngineHash),
                    medium: Some(LMCACHE_MEDIUM.into()),
                    group_idx: None,
                    ..store.clone()
                }));
            }
            self.generation += 1;
            self.blocks.insert(
                hash,
                BlockInfo {
                    parent,
                    store,
                    lmcache: chunk,
                    generation: self.generation,
                },
            );
            self.order.push_back((hash, self.generation));
            parent = Some(hash);
        }
        while self.blocks.len() > self.capacity_blocks
            || self.order.len() > 2 * self.capacity_blocks
        {
            let Some((oldest, generation)) = self.order.pop_front() else {
                break;
            };
            if self
                .blocks
                .get(&oldest)
                .is_some_and(|b| b.generation == generation)
            {
                self.blocks.remove(&oldest);
            }
        }
        lmcache
    }

    /// A block stored on a tier below the GPU, in the connector's shape.
    fn offloaded(&mut self, stored: BlockStored) -> Vec<KvEvent> {
        let medium = stored.medium.clone().unwrap_or_default();
        let own_tier = is_own_tier(&medium);
        let mut out = Vec::with_capacity(stored.block_hashes.len());
        for &hash in &stored.block_hashes {
            if own_tier {
                let held = self.announced.entry(hash).or_default();
                match held.iter_mut().find(|(m, _)| *m == medium) {
                    Some((_, count)) => *count += 1,
                    None => held.push((medium.clone(), 1)),
                }
            }
            let info = self.blocks.get(&hash);
            out.push(KvEvent::BlockStored(match (self.shape, info) {
                (OffloadEvents::VllmSelfDescribing, Some(info)) => BlockStored {
                    parent_block_hash: info.parent,
                    medium: Some(medium.clone()),
                    group_idx: None,
                    ..info.store.clone()
                },
                _ => BlockStored {
                    block_hashes: vec![hash],
                    block_size: self.placeholder_block_size,
                    medium: Some(medium.clone()),
                    ..BlockStored::default()
                },
            }));
        }
        out
    }

    /// A block dropped from a tier below the GPU: one removal per store announced there.
    fn dropped(&mut self, removed: BlockRemoved) -> Vec<KvEvent> {
        let medium = removed.medium.clone().unwrap_or_default();
        let mut out = Vec::with_capacity(removed.block_hashes.len());
        for &hash in &removed.block_hashes {
            let mut count = 1;
            if let Some(held) = self.announced.get_mut(&hash)
                && let Some(at) = held.iter().position(|(m, _)| *m == medium)
            {
                count = held.swap_remove(at).1;
                if held.is_empty() {
                    self.announced.remove(&hash);
                }
            }
            for _ in 0..count {
                out.push(KvEvent::BlockRemoved(BlockRemoved {
                    block_hashes: vec![hash],
                    ..removed.clone()
                }));
            }
        }
        out
    }
}

/// Whether `medium` is one of the engine's own tiers below the GPU (CPU memory, storage).
fn is_own_tier(medium: &str) -> bool {
    medium.eq_ignore_ascii_case("CPU") || medium.eq_ignore_ascii_case("STORAGE")
}

fn is_gpu(medium: Option<&str>) -> bool {
    medium.is_none_or(|m| m.eq_ignore_ascii_case("GPU"))
}

/// LMCache's chunk hash: a chain (FNV-1a, 64 bits) over the parent chunk's hash and the tokens
/// (its own token database, unrelated to vLLM's block hashes).
fn lmcache_hash(parent: Option<u64>, tokens: &[u32]) -> u64 {
    const PRIME: u64 = 0x100_0000_01b3;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let bytes = parent
        .unwrap_or(0)
        .to_le_bytes()
        .into_iter()
        .chain(tokens.iter().flat_map(|t| t.to_le_bytes()));
    for b in bytes {
        h = (h ^ u64::from(b)).wrapping_mul(PRIME);
    }
    h
}

/// The minor version of a `0.x.y` release string.
fn minor_version(version: &str) -> Option<u32> {
    let mut parts = version.trim().trim_start_matches('v').split('.');
    match parts.next()? {
        "0" => parts.next()?.parse().ok(),
        _ => None,
    }
}

#[cfg(test)]
mod tests;
