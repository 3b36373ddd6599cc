//! The engine model: one vLLM engine's prefix cache, continuous batching and step timing,
//! pure and synchronous so that the simulated server and an offline cluster simulator run the
//! same code. The caller adds requests and calls [`Engine::step`]; each step says how long it
//! took, which tokens it produced and which KV events it published.

pub mod block_pool;
pub mod latency;
mod lru;
pub mod offload_config;
mod request;
pub mod shared_fs;
pub mod tier_loads;
pub mod transfer;

use std::collections::{HashMap, VecDeque};

use kvroute_core::event::KvEvent;
use kvroute_core::keys::VllmHasher;
use serde::Serialize;

use crate::SimError;
use block_pool::{BlockPool, OffloadTier, OffloadTiers};
use latency::{LatencyModel, StepWork};
use request::Sequence;
pub use request::{EngineRequest, FinishReason, TokenOutput};
use shared_fs::{SharedFs, SharedFsConfig, SharedFsHandle};
use tier_loads::AsyncLoads;
pub use tier_loads::TierLoads;
pub use transfer::{HeldBlocks, KvTransfer};

/// Identifies a request inside one engine.
pub type RequestId = u64;

/// Settings of one simulated engine.
#[derive(Clone, Debug, Serialize)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// Blocks in the GPU pool, as vLLM counts them (`--num-gpu-blocks-override`): one is its
    /// null block, so `num_gpu_blocks - 1` hold KV.
    pub num_gpu_blocks: usize,
    /// Blocks in the CPU offload tier (0: none).
    pub num_cpu_blocks: usize,
    /// Blocks in the local SSD offload tier, below the CPU tier (0: none).
    pub num_ssd_blocks: usize,
    /// Most sequences in the running batch.
    pub max_num_seqs: usize,
    /// Most tokens one step computes (chunked prefill budget).
    pub max_num_batched_tokens: usize,
    /// Longest prompt plus output accepted.
    pub max_model_len: usize,
    /// vLLM's NONE_HASH seed.
    pub hash_seed: String,
    /// The shared filesystem tier the fleet mounts (`None`: none). Engines built together by
    /// a fleet ([`Engine::mounted`]) share one; [`Engine::new`] mounts a private one.
    pub shared_fs: Option<SharedFsConfig>,
    /// KV-cache bytes per token (sizes the bytes an offload tier loads).
    pub kv_bytes_per_token: usize,
    /// Whether blocks found on the offload tiers load beside the batch (vLLM's
    /// OffloadingConnector) or in the step that admits the request (LMCache's default).
    pub tier_loads: TierLoads,
    /// Step timing.
    pub latency: LatencyModel,
}

impl EngineConfig {
    /// One engine holding, in each of its own tiers (GPU, CPU, SSD), what `engines` engines of
    /// this configuration hold together: the engine of the pooled-cache ceiling. The shared
    /// filesystem is the fleet's already, so it stays as it is.
    pub fn pooled(&self, engines: usize) -> EngineConfig {
        EngineConfig {
            num_gpu_blocks: self.num_gpu_blocks.saturating_mul(engines),
            num_cpu_blocks: self.num_cpu_blocks.saturating_mul(engines),
            num_ssd_blocks: self.num_ssd_blocks.saturating_mul(engines),
            ..self.clone()
        }
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            num_gpu_blocks: 4096,
            num_cpu_blocks: 0,
            num_ssd_blocks: 0,
            shared_fs: None,
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            max_model_len: 32_768,
            hash_seed: kvroute_core::keys::VLLM_DEFAULT_SEED.to_owned(),
            kv_bytes_per_token: latency::LLAMA_8B_KV_BYTES_PER_TOKEN,
            tier_loads: TierLoads::default(),
            latency: LatencyModel::default(),
        }
    }
}

/// Gauges and counters with vLLM's meanings (they back the `/metrics` endpoint).
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct EngineMetrics {
    /// Requests in the running batch.
    pub num_requests_running: usize,
    /// Requests waiting to be scheduled.
    pub num_requests_waiting: usize,
    /// 1 - free/total GPU blocks (evictable cached blocks count as free).
    pub kv_cache_usage: f64,
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_cache_queries: u64,
    /// Of those, tokens found in the GPU prefix cache.
    pub prefix_cache_hits: u64,
    /// Tokens found outside the GPU (offload tiers and a P/D producer), as vLLM's connector
    /// counters report them.
    pub external_prefix_cache_hits: u64,
    /// Of those, tokens loaded from the CPU tier.
    pub cpu_hit_tokens: u64,
    /// Of those, tokens loaded from the SSD tier.
    pub ssd_hit_tokens: u64,
    /// Of those, tokens loaded from the shared filesystem.
    pub shared_fs_hit_tokens: u64,
    /// KV bytes loaded from the CPU tier.
    pub cpu_bytes_loaded: u64,
    /// KV bytes loaded from the SSD tier.
    pub ssd_bytes_loaded: u64,
    /// KV bytes loaded from the shared filesystem.
    pub shared_fs_bytes_loaded: u64,
    /// Seconds the loads from each tier took (CPU, SSD, shared filesystem), counted when the
    /// load is scheduled, as its tokens are: a CPU or SSD load its transfer time, a shared load
    /// from its request to its end (its wait in the filesystem's queue included).
    pub tier_load_seconds: [f64; 3],
    /// Requests preempted for lack of blocks.
    pub num_preemptions: u64,
    /// Prompt tokens received.
    pub prompt_tokens: u64,
    /// Tokens generated.
    pub generation_tokens: u64,
    /// Blocks in the GPU prefix cache.
    pub cached_blocks: usize,
    /// Blocks in the CPU tier.
    pub cpu_blocks: usize,
    /// Blocks in the SSD tier.
    pub ssd_blocks: usize,
    /// Blocks in the mounted shared filesystem (fleet-wide; 0 when not mounted).
    pub shared_fs_blocks: usize,
}

/// A prompt's cached prefix, in blocks, by the tier each block is served from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixTiers {
    /// Leading blocks on the GPU.
    pub gpu: usize,
    /// Following blocks loaded from the CPU tier.
    pub cpu: usize,
    /// Following blocks loaded from the SSD tier.
    pub ssd: usize,
    /// Following blocks loaded from the shared filesystem.
    pub shared_fs: usize,
}

/// What one step did.
#[derive(Debug, Default)]
pub struct StepOutput {
    /// How long the step took, in engine seconds.
    pub duration_s: f64,
    /// One token per sequence that produced one.
    pub tokens: Vec<TokenOutput>,
    /// KV events the step published, in order.
    pub events: Vec<KvEvent>,
    /// The work the step did.
    pub work: StepWork,
}

/// One simulated engine.
#[derive(Debug)]
pub struct Engine {
    config: EngineConfig,
    hasher: VllmHasher,
    pool: BlockPool,
    waiting: VecDeque<Sequence>,
    running: Vec<Sequence>,
    metrics: EngineMetrics,
    /// The engine's clock: where the last step ended, in engine seconds.
    clock_s: f64,
    /// Finished prefill legs' blocks, pinned for their consumer.
    held: HashMap<RequestId, (HeldBlocks, Vec<block_pool::BlockId>)>,
    /// Requests waiting for their blocks to load beside the batch ([`TierLoads::Async`]).
    loads: AsyncLoads,
}

/// The longest any one latency of the model may be, seconds (a step overhead, a token's
/// prefill, a block's load): an hour is no engine's, and the live simulator turns a step's
/// seconds into a timer that a longer one would overflow.
pub const MAX_LATENCY_S: f64 = 3600.0;

impl Engine {
    /// An engine with an empty cache (and, if configured, a shared filesystem of its own).
    pub fn new(config: EngineConfig) -> Result<Self, SimError> {
        let shared = config.shared_fs.clone().map(SharedFs::handle);
        Self::mounted(config, shared)
    }

    /// An engine with an empty cache mounting the fleet's shared filesystem, if any.
    pub fn mounted(config: EngineConfig, shared: Option<SharedFsHandle>) -> Result<Self, SimError> {
        if config.block_size == 0 || config.num_gpu_blocks < 2 || config.max_num_seqs == 0 {
            return Err(SimError::Config(
                "block size and max sequences must be at least 1, GPU blocks at least 2".into(),
            ));
        }
        if config.kv_bytes_per_token == 0 {
            return Err(SimError::Config(
                "kv_bytes_per_token must be at least 1 (it sizes what the tiers load)".into(),
            ));
        }
        if config.max_num_batched_tokens < config.block_size {
            return Err(SimError::Config(format!(
                "max_num_batched_tokens ({}) must be at least the block size ({})",
                config.max_num_batched_tokens, config.block_size
            )));
        }
        let l = &config.latency;
        if [
            l.step_overhead_s,
            l.prefill_per_token_s,
            l.decode_per_seq_s,
            l.decode_per_context_token_s,
            l.cpu_load_per_block_s,
            l.ssd_load_per_block_s,
            l.ssd_load_latency_s,
        ]
        .iter()
        .any(|s| !(0.0..=MAX_LATENCY_S).contains(s))
        {
            return Err(SimError::Config(format!(
                "every latency must be within 0–{MAX_LATENCY_S} s: {l:?}"
            )));
        }
        if let Some(fs) = &config.shared_fs
            && !(fs.bandwidth_bytes_per_s > 0.0
                && fs.bandwidth_bytes_per_s.is_finite()
                && fs.latency_s >= 0.0
                && fs.latency_s.is_finite())
        {
            return Err(SimError::Config(
                "the shared filesystem needs a positive bandwidth and a latency of 0 or more"
                    .into(),
            ));
        }
        let mut engine = Self {
            hasher: VllmHasher::new(&config.hash_seed),
            // vLLM keeps one block of its pool back as the null block: never allocated.
            pool: BlockPool::with_tiers(
                config.block_size,
                config.num_gpu_blocks - 1,
                OffloadTiers::new(config.num_cpu_blocks, config.num_ssd_blocks),
            ),
            config,
            waiting: VecDeque::new(),
            running: Vec::new(),
            metrics: EngineMetrics::default(),
            clock_s: 0.0,
            held: HashMap::new(),
            loads: AsyncLoads::default(),
        };
        if let Some(shared) = shared {
            engine.mount_shared_fs(shared);
        }
        Ok(engine)
    }

    /// The engine's settings.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Queues a request. Refused when it could never fit (too long for the model or the pool).
    pub fn add_request(&mut self, request: EngineRequest) -> Result<(), SimError> {
        self.add_request_with(request, KvTransfer::None)
    }

    /// Refuses a request that could never run.
    fn validate(&self, request: &EngineRequest) -> Result<(), SimError> {
        let total = request.prompt.len() + request.output.len();
        if total > self.config.max_model_len {
            return Err(SimError::TooLong {
                tokens: total,
                max_model_len: self.config.max_model_len,
            });
        }
        let blocks = total.div_ceil(self.config.block_size);
        let usable = self.pool.capacity();
        if blocks > usable {
            return Err(SimError::TooLong {
                tokens: total,
                max_model_len: usable * self.config.block_size,
            });
        }
        if request.prompt.is_empty() {
            return Err(SimError::EmptyPrompt);
        }
        if request.output.is_empty() {
            return Err(SimError::NoOutput);
        }
        Ok(())
    }

    /// Cancels a request wherever it is; its blocks are freed (and stay cached).
    pub fn abort(&mut self, id: RequestId) -> bool {
        if self.release(id) {
            return true;
        }
        if let Some(i) = self.waiting.iter().position(|s| s.id() == id) {
            self.waiting.remove(i);
            return true;
        }
        let running = self.running.iter().position(|s| s.id() == id);
        let seq = match running {
            Some(i) => Some(self.running.remove(i)),
            None => self.loads.remove(id),
        };
        match seq {
            Some(mut seq) => {
                for digest in seq.loading_digests() {
                    self.pool.unpin_offloaded(digest);
                }
                self.pool.free(&seq.take_blocks());
                true
            }
            None => false,
        }
    }

    /// Whether a step would do anything.
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty() || self.loads.len() > 0
    }

    /// Empties the prefix cache, as vLLM's `/reset_prefix_cache` does; refused (false) while
    /// requests hold blocks.
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.running.is_empty() && self.loads.len() == 0 && self.pool.reset()
    }

    /// The KV events produced outside a step (a cache reset).
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.pool.take_events()
    }

    /// Current gauges and counters.
    pub fn metrics(&self) -> EngineMetrics {
        EngineMetrics {
            num_requests_running: self.running.len(),
            // vLLM keeps a request whose blocks are loading in its waiting queue.
            num_requests_waiting: self.waiting.len() + self.loads.len(),
            kv_cache_usage: self.pool.usage(),
            cached_blocks: self.pool.cached_blocks(),
            cpu_blocks: self.pool.cpu_blocks(),
            ssd_blocks: self.pool.offloaded_blocks(OffloadTier::Ssd),
            shared_fs_blocks: self.pool.shared().map_or(0, |s| block_pool::lock(s).len()),
            ..self.metrics.clone()
        }
    }

    /// Full blocks of `tokens` the engine would serve from its GPU cache right now (vLLM's
    /// rule: the last prompt token is always computed). For tests and diagnostics.
    pub fn cached_prefix_blocks(
        &self,
        tokens: &[u32],
        lora: Option<&str>,
        salt: Option<&str>,
    ) -> usize {
        let mut seq = self.probe(tokens, lora, salt);
        seq.lookup_blocks()
            .iter()
            .take_while(|d| self.pool.lookup(d).is_some())
            .count()
    }

    /// A sequence for `tokens` that is never run: what a lookup of its prefix would hash.
    fn probe(&self, tokens: &[u32], lora: Option<&str>, salt: Option<&str>) -> Sequence {
        Sequence::new(
            EngineRequest {
                id: 0,
                prompt: tokens.to_vec(),
                output: Vec::new(),
                lora_name: lora.map(str::to_owned),
                cache_salt: salt.map(str::to_owned),
            },
            &self.hasher,
            self.config.block_size,
        )
    }

    /// Mounts the fleet's shared filesystem tier: this engine writes evicted blocks there and
    /// loads blocks any engine wrote.
    pub fn mount_shared_fs(&mut self, shared: SharedFsHandle) {
        self.pool.mount_shared(shared);
    }

    /// Where the full blocks of `tokens` the engine would serve from cache right now are, tier
    /// by tier (the GPU run first, then the blocks it would load). For tests and diagnostics.
    pub fn prefix_tiers(
        &self,
        tokens: &[u32],
        lora: Option<&str>,
        salt: Option<&str>,
    ) -> PrefixTiers {
        let mut seq = self.probe(tokens, lora, salt);
        let hit = seq.prefix_hit(&self.pool);
        PrefixTiers {
            gpu: hit.gpu.len(),
            cpu: hit.loaded_from(OffloadTier::Cpu),
            ssd: hit.loaded_from(OffloadTier::Ssd),
            shared_fs: hit.loaded_from(OffloadTier::SharedFs),
        }
    }

    /// Runs one step starting where the last one ended (see [`Engine::step_at`]).
    pub fn step(&mut self) -> StepOutput {
        self.step_at(self.clock_s)
    }

    /// Runs one scheduler step starting at `now_s` (the time tier loads queue at): requests
    /// whose blocks have loaded join the batch, running sequences continue (decode or the next
    /// prefill chunk), preempting the newest when blocks run out, then, in a step that preempted
    /// none, waiting requests are admitted FCFS while the token budget and batch size allow. A
    /// step with nothing to run while loads are under way waits for the first of them.
    pub fn step_at(&mut self, now_s: f64) -> StepOutput {
        let bs = self.config.block_size;
        let mut budget = self.config.max_num_batched_tokens;
        let mut work = StepWork::default();
        // Tokens each scheduled sequence computes this step, by index in `running`.
        let mut scheduled: Vec<usize> = Vec::with_capacity(self.running.len());

        let preemptions_before = self.metrics.num_preemptions;
        let mut i = 0;
        while i < self.running.len() {
            let want = self.running[i].tokens_to_compute().min(budget);
            if want == 0 {
                scheduled.push(0);
                i += 1;
                continue;
            }
            let needed = self.running[i].blocks_needed(want, bs);
            match self.allocate_or_preempt(needed, i) {
                Allocation::Granted(blocks) => {
                    self.running[i].add_blocks(blocks);
                    self.running[i].cache_scheduled(want, &mut self.pool);
                    budget -= want;
                    scheduled.push(want);
                    i += 1;
                }
                Allocation::SelfPreempted => {} // running[i] is gone; do not advance
            }
        }

        // A step that had to preempt a running request admits nothing new, as vLLM's scheduler
        // skips its waiting queue then: the blocks it freed are for the requests still running.
        // With none left running, vLLM's next pass (which computes nothing until then) admits
        // at once: so does this one.
        let admits = self.metrics.num_preemptions == preemptions_before || self.running.is_empty();
        // Requests whose blocks have arrived come first, from the front of the waiting queue
        // as in vLLM.
        while admits && self.running.len() < self.config.max_num_seqs && budget > 0 {
            let Some(mut seq) = self.loads.take_ready(now_s) else {
                break;
            };
            seq.finish_loading(&mut self.pool);
            let want = seq.tokens_to_compute().min(budget);
            let Some(blocks) = self.pool.allocate(seq.blocks_needed(want, bs)) else {
                if !self.running.is_empty() {
                    // Running requests will free blocks: it waits for them, as in vLLM.
                    self.loads.put_back(seq);
                    break;
                }
                // Nothing runs to free any: the blocks it and other loaded requests hold would
                // deadlock a small cache, so it gives them back (they stay cached, now on the
                // GPU) and queues again first, as a preempted request does.
                self.pool.free(&seq.take_blocks());
                seq.preempt();
                self.metrics.num_preemptions += 1;
                self.waiting.push_front(seq);
                continue;
            };
            seq.add_blocks(blocks);
            seq.cache_scheduled(want, &mut self.pool);
            budget -= want;
            scheduled.push(want);
            self.running.push(seq);
        }

        // Requests that would load blocks another request is loading wait, keeping their place.
        let mut delayed = Vec::new();
        while admits && self.running.len() < self.config.max_num_seqs && budget > 0 {
            let Some(mut seq) = self.waiting.pop_front() else {
                break;
            };
            self.pool.touch_offloaded_request(seq.full_blocks());
            let hit = seq.prefix_hit(&self.pool);
            if self.config.tier_loads == TierLoads::Async
                && self.loads.any_loading(hit.offloaded.iter().map(|(d, _)| d))
            {
                delayed.push(seq);
                continue;
            }
            let computed = hit.total_blocks() * bs;
            let (cpu, ssd) = (
                hit.loaded_from(OffloadTier::Cpu),
                hit.loaded_from(OffloadTier::Ssd),
            );
            let own_load_s = self.config.latency.load_seconds(cpu, ssd);
            // Beside the batch, a request that loads anything, or hits blocks another request
            // is still loading, waits for them without taking part in this step.
            let parks = self.config.tier_loads == TierLoads::Async
                && (own_load_s > 0.0 || hit.loaded_from(OffloadTier::SharedFs) > 0);
            let want = if parks {
                0
            } else {
                (seq.len() - computed).min(budget)
            };
            let needed = (computed + want).div_ceil(bs) - hit.gpu.len();
            // Room first, as vLLM's `allocate_slots`: its free hit blocks are no room, and a
            // request that must wait leaves the free queue's order as it was.
            let free_hits = hit.gpu.iter().filter(|&&id| self.pool.is_free(id)).count();
            if self.pool.free_blocks() < needed + free_hits {
                self.waiting.push_front(seq);
                break;
            }
            // Take the hit blocks first, so allocating the rest cannot evict them, nor the GPU
            // blocks it evicts push them out of their offload tier: they stay until loaded.
            for &id in &hit.gpu {
                self.pool.touch(id);
            }
            for &(digest, _) in &hit.offloaded {
                self.pool.pin_offloaded(digest);
            }
            let Some(blocks) = self.pool.allocate(needed) else {
                for (digest, _) in &hit.offloaded {
                    self.pool.unpin_offloaded(digest);
                }
                self.pool.free(&hit.gpu);
                self.waiting.push_front(seq);
                break;
            };
            if !seq.admitted_before() {
                // A preempted request's lookup again is counted apart by vLLM
                // (`preempted_queries`), not in the prefix-cache counters it exports.
                self.metrics.prefix_cache_queries += seq.len() as u64;
                self.metrics.prefix_cache_hits += (hit.gpu.len() * bs) as u64;
                self.metrics.external_prefix_cache_hits +=
                    ((hit.offloaded.len() + hit.external.len()) * bs) as u64;
            }
            self.metrics.cpu_hit_tokens += (cpu * bs) as u64;
            self.metrics.ssd_hit_tokens += (ssd * bs) as u64;
            let block_bytes = (bs * self.config.kv_bytes_per_token) as u64;
            self.metrics.cpu_bytes_loaded += cpu as u64 * block_bytes;
            self.metrics.ssd_bytes_loaded += ssd as u64 * block_bytes;
            let latency = &self.config.latency;
            self.metrics.tier_load_seconds[0] += latency.load_seconds(cpu, 0);
            self.metrics.tier_load_seconds[1] += latency.load_seconds(0, ssd);
            let shared: Vec<_> = hit
                .offloaded
                .iter()
                .filter(|(_, t)| *t == OffloadTier::SharedFs)
                .map(|(d, _)| *d)
                .collect();
            let mut shared_fs_load_s = 0.0;
            if let Some(fs) = self.pool.shared().filter(|_| !shared.is_empty()) {
                let bytes = shared.len() as u64 * block_bytes;
                shared_fs_load_s = block_pool::lock(fs).load(&shared, bytes, now_s);
                self.metrics.tier_load_seconds[2] += shared_fs_load_s;
                self.metrics.shared_fs_hit_tokens += (shared.len() * bs) as u64;
                self.metrics.shared_fs_bytes_loaded += bytes;
            }
            if parks {
                let ready_s = self.loads.ready_at(now_s, own_load_s, shared_fs_load_s);
                seq.admit_loading(hit, blocks);
                self.loads.park(seq, ready_s);
                continue;
            }
            work.cpu_blocks_loaded += cpu;
            work.ssd_blocks_loaded += ssd;
            work.shared_fs_load_s += shared_fs_load_s;
            seq.admit(hit, blocks, &mut self.pool);
            seq.cache_scheduled(want, &mut self.pool);
            budget -= want;
            scheduled.push(want);
            self.running.push(seq);
        }
        for seq in delayed.into_iter().rev() {
            self.waiting.push_front(seq);
        }

        let mut tokens = Vec::new();
        for (seq, &n) in self.running.iter_mut().zip(&scheduled) {
            if n == 0 {
                continue;
            }
            if seq.in_prefill() {
                work.prefill_tokens += n;
            } else {
                work.decode_seqs += 1;
                work.context_tokens += seq.computed();
            }
            if let Some(out) = seq.advance(n) {
                tokens.push(out);
            }
        }
        self.metrics.generation_tokens += tokens.len() as u64;
        let (finished, kept): (Vec<Sequence>, Vec<Sequence>) = std::mem::take(&mut self.running)
            .into_iter()
            .partition(Sequence::finished);
        self.running = kept;
        for seq in finished {
            self.retire(seq);
        }
        if work == StepWork::default()
            && let Some(ready_s) = self.loads.next_arrival(now_s)
        {
            // Nothing to compute: the engine waits for the first load to end, looking at its
            // queue again meanwhile.
            work.load_wait_s = (ready_s - now_s).min(tier_loads::LOAD_POLL_S);
        }
        let duration_s = self.config.latency.step_seconds(&work);
        self.clock_s = now_s + duration_s;
        StepOutput {
            duration_s,
            tokens,
            events: self.pool.take_events(),
            work,
        }
    }

    /// Allocates `needed` blocks for `running[index]`, preempting the newest running sequences
    /// (possibly `index` itself) until they fit, as vLLM's recompute preemption does.
    fn allocate_or_preempt(&mut self, needed: usize, index: usize) -> Allocation {
        loop {
            if let Some(blocks) = self.pool.allocate(needed) {
                return Allocation::Granted(blocks);
            }
            let victim = self.running.len() - 1;
            let mut seq = self.running.remove(victim);
            self.pool.free(&seq.take_blocks());
            seq.preempt();
            self.metrics.num_preemptions += 1;
            self.waiting.push_front(seq);
            if victim == index {
                return Allocation::SelfPreempted;
            }
        }
    }
}

enum Allocation {
    Granted(Vec<block_pool::BlockId>),
    SelfPreempted,
}

#[cfg(test)]
mod async_load_tests;
#[cfg(test)]
mod tests;
