//! A small engine model that produces a realistic KV-event stream: multi-turn conversations
//! sharing system prompts, a bounded cache with least-recently-used eviction, and real vLLM
//! `sha256_cbor` block hashes. It stands in for vLLM in the quick start and the tests until the
//! full simulator (`kvroute sim`) takes over.

use std::collections::{BTreeMap, HashMap};

use kvroute_core::event::{BlockRemoved, BlockStored, EngineHash, EventBatch, KvEvent};
use kvroute_core::keys::VllmHasher;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Shape of a demo engine's traffic.
#[derive(Clone, Debug)]
pub struct DemoConfig {
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks the engine's cache holds.
    pub capacity_blocks: usize,
    /// Distinct system prompts shared by conversations.
    pub system_prompts: usize,
    /// Tokens in each system prompt.
    pub system_prompt_tokens: usize,
    /// Conversations in flight.
    pub conversations: usize,
    /// vLLM hash seed.
    pub hash_seed: String,
    /// Random seed of the traffic.
    pub seed: u64,
}

impl Default for DemoConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            capacity_blocks: 2_000,
            system_prompts: 3,
            system_prompt_tokens: 512,
            conversations: 24,
            hash_seed: kvroute_core::keys::VLLM_DEFAULT_SEED.to_owned(),
            seed: 1,
        }
    }
}

/// One engine's cache and traffic.
pub struct DemoEngine {
    config: DemoConfig,
    rng: StdRng,
    hasher: VllmHasher,
    system_prompts: Vec<Vec<u32>>,
    conversations: Vec<Vec<u32>>,
    /// Cached block hash → last-use tick; `lru` orders the same by tick.
    cached: HashMap<EngineHash, u64>,
    lru: BTreeMap<u64, EngineHash>,
    tick: u64,
}

impl DemoEngine {
    /// A fresh engine with an empty cache.
    pub fn new(config: DemoConfig) -> Self {
        let mut rng = StdRng::seed_from_u64(config.seed);
        let system_prompts = (0..config.system_prompts)
            .map(|_| random_tokens(&mut rng, config.system_prompt_tokens))
            .collect();
        let hasher = VllmHasher::new(&config.hash_seed);
        Self {
            config,
            rng,
            hasher,
            system_prompts,
            conversations: Vec::new(),
            cached: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
        }
    }

    /// Conversation histories so far (token ids), for checking an index against.
    pub fn conversations(&self) -> &[Vec<u32>] {
        &self.conversations
    }

    /// Whether the engine caches the block with this hash.
    pub fn is_cached(&self, hash: EngineHash) -> bool {
        self.cached.contains_key(&hash)
    }

    /// Number of blocks cached now.
    pub fn cached_blocks(&self) -> usize {
        self.cached.len()
    }

    /// Engine hashes of every full block of `tokens`.
    pub fn block_hashes(&self, tokens: &[u32]) -> Vec<EngineHash> {
        self.hasher
            .block_digests(tokens, self.config.block_size, None)
            .expect("block size is positive")
            .iter()
            .map(|d| EngineHash(d.event_u64()))
            .collect()
    }

    /// Serves one more turn of some conversation and returns the step's events.
    pub fn step(&mut self, ts: f64) -> EventBatch {
        let turn =
            if self.conversations.len() < self.config.conversations || self.rng.random_bool(0.1) {
                let system = self.rng.random_range(0..self.system_prompts.len().max(1));
                let mut history = self.system_prompts.get(system).cloned().unwrap_or_default();
                let question = self.rng.random_range(16..200);
                history.extend(random_tokens(&mut self.rng, question));
                if self.conversations.len() < self.config.conversations {
                    self.conversations.push(history);
                    self.conversations.len() - 1
                } else {
                    let slot = self.rng.random_range(0..self.conversations.len());
                    self.conversations[slot] = history;
                    slot
                }
            } else {
                let slot = self.rng.random_range(0..self.conversations.len());
                let reply = self.rng.random_range(16..160);
                let question = self.rng.random_range(8..120);
                let extra = random_tokens(&mut self.rng, reply + question);
                self.conversations[slot].extend(extra);
                slot
            };
        let tokens = self.conversations[turn].clone();
        let events = self.serve(&tokens);
        EventBatch {
            ts,
            events,
            data_parallel_rank: Some(0),
        }
    }

    /// Prefills `tokens`: stores the blocks not yet cached (evicting the least recently used
    /// first, one `BlockRemoved` per block as vLLM does) and marks the whole prefix used.
    pub fn serve(&mut self, tokens: &[u32]) -> Vec<KvEvent> {
        let bs = self.config.block_size;
        let hashes = self.block_hashes(tokens);
        let hit = hashes
            .iter()
            .take_while(|h| self.cached.contains_key(h))
            .count();
        let mut events = Vec::new();
        let needed = hashes.len() - hit;
        let mut candidates = self.lru.len();
        while self.cached.len() + needed > self.config.capacity_blocks && candidates > 0 {
            candidates -= 1;
            let Some((_, victim)) = self.lru.pop_first() else {
                break;
            };
            if hashes[..hit].contains(&victim) {
                // In use by this request: keep it.
                self.lru.insert(self.tick, victim);
                self.cached.insert(victim, self.tick);
                self.tick += 1;
                continue;
            }
            self.cached.remove(&victim);
            events.push(KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![victim],
                medium: Some("GPU".into()),
                group_idx: None,
            }));
        }
        if needed > 0 {
            events.push(KvEvent::BlockStored(BlockStored {
                block_hashes: hashes[hit..].to_vec(),
                parent_block_hash: hit.checked_sub(1).map(|p| hashes[p]),
                token_ids: tokens[hit * bs..hashes.len() * bs].to_vec(),
                block_size: bs as u32,
                medium: Some("GPU".into()),
                ..Default::default()
            }));
        }
        // Touch the prefix last block first, so that when the request's blocks are freed the
        // tail is evicted before the shared head (vLLM frees in reverse order too).
        for h in hashes.iter().rev() {
            if let Some(old) = self.cached.insert(*h, self.tick) {
                self.lru.remove(&old);
            }
            self.lru.insert(self.tick, *h);
            self.tick += 1;
        }
        events
    }

    /// Forgets everything, as a restarted engine would.
    pub fn reset(&mut self) {
        self.cached.clear();
        self.lru.clear();
    }
}

fn random_tokens(rng: &mut StdRng, n: usize) -> Vec<u32> {
    (0..n).map(|_| rng.random_range(100..150_000)).collect()
}
