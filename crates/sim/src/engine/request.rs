//! One request inside the engine: its tokens, how far its KV cache is computed, its blocks, and
//! the vLLM hashes of its full blocks.

use kvroute_core::keys::{BlockExtraKeys, ExtraKey, VllmDigest, VllmHasher};
use serde::Serialize;

use super::RequestId;
use super::block_pool::{BlockId, BlockPool, FullBlocks, OffloadTier};
use super::transfer::KvTransfer;

/// A request as the server hands it to the engine.
#[derive(Clone, Debug)]
pub struct EngineRequest {
    /// Unique within the engine.
    pub id: RequestId,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// The tokens the engine will "generate", one per decode step (at least one).
    pub output: Vec<u32>,
    /// LoRA adapter, hashed into every block as vLLM does.
    pub lora_name: Option<String>,
    /// Cache salt, hashed into the first block as vLLM does.
    pub cache_salt: Option<String>,
}

/// Why a sequence stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum FinishReason {
    /// All of its output was produced.
    Done,
}

/// One generated token.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TokenOutput {
    /// The request.
    pub id: RequestId,
    /// The token.
    pub token: u32,
    /// 0 for the first output token.
    pub index: usize,
    /// Set on the request's last token.
    pub finished: Option<FinishReason>,
    /// Prompt length.
    pub prompt_tokens: usize,
    /// Prompt tokens served from the prefix cache (GPU and CPU tiers), as vLLM reports them.
    pub cached_tokens: usize,
}

/// Blocks of a prompt's prefix found in the caches.
#[derive(Debug, Default)]
pub(crate) struct PrefixHit {
    /// GPU blocks, in order.
    pub gpu: Vec<BlockId>,
    /// Following blocks found in the offload tiers, each with the tier it loads from.
    pub offloaded: Vec<(VllmDigest, OffloadTier)>,
    /// Following blocks a KV producer supplies (a P/D decode leg's pulled blocks).
    pub external: Vec<VllmDigest>,
}

impl PrefixHit {
    /// Offloaded blocks loaded from `tier`.
    pub(crate) fn loaded_from(&self, tier: OffloadTier) -> usize {
        self.offloaded.iter().filter(|(_, t)| *t == tier).count()
    }

    pub(crate) fn total_blocks(&self) -> usize {
        self.gpu.len() + self.offloaded.len() + self.external.len()
    }
}

#[derive(Debug)]
pub(crate) struct Sequence {
    request: EngineRequest,
    hasher: VllmHasher,
    block_size: usize,
    /// Prompt, then generated tokens.
    tokens: Vec<u32>,
    generated: usize,
    /// Tokens whose KV is computed.
    computed: usize,
    blocks: Vec<BlockId>,
    /// Digests of the first `digests.len()` full blocks of `tokens`.
    digests: Vec<VllmDigest>,
    /// Leading blocks registered in the prefix cache.
    registered: usize,
    cached_tokens: Option<usize>,
    transfer: KvTransfer,
    /// Blocks being loaded into its GPU blocks, registered in the prefix cache once they have
    /// arrived ([`Sequence::finish_loading`]).
    loading: Option<PrefixHit>,
}

impl Sequence {
    pub(crate) fn new(request: EngineRequest, hasher: &VllmHasher, block_size: usize) -> Self {
        Self::with_transfer(request, hasher, block_size, KvTransfer::None)
    }

    pub(crate) fn with_transfer(
        request: EngineRequest,
        hasher: &VllmHasher,
        block_size: usize,
        transfer: KvTransfer,
    ) -> Self {
        Self {
            tokens: request.prompt.clone(),
            request,
            hasher: hasher.clone(),
            block_size,
            generated: 0,
            computed: 0,
            blocks: Vec::new(),
            digests: Vec::new(),
            registered: 0,
            cached_tokens: None,
            transfer,
            loading: None,
        }
    }

    pub(crate) fn id(&self) -> RequestId {
        self.request.id
    }

    /// How the request takes part in P/D.
    pub(crate) fn transfer(&self) -> KvTransfer {
        self.transfer
    }

    /// Prompt length.
    pub(crate) fn prompt_len(&self) -> usize {
        self.request.prompt.len()
    }

    /// Engine hashes (as events publish them) of the first `n` full blocks.
    pub(crate) fn block_hashes(&mut self, n: usize) -> Vec<u64> {
        self.ensure_digests(n);
        self.digests[..n.min(self.digests.len())]
            .iter()
            .map(VllmDigest::event_u64)
            .collect()
    }

    pub(crate) fn len(&self) -> usize {
        self.tokens.len()
    }

    pub(crate) fn computed(&self) -> usize {
        self.computed
    }

    pub(crate) fn finished(&self) -> bool {
        self.generated >= self.request.output.len()
    }

    /// Prefilling (the prompt, or everything again after a preemption) rather than decoding.
    pub(crate) fn in_prefill(&self) -> bool {
        self.generated == 0 || self.tokens.len() - self.computed > 1
    }

    pub(crate) fn tokens_to_compute(&self) -> usize {
        self.tokens.len() - self.computed
    }

    pub(crate) fn blocks_needed(&self, tokens: usize, block_size: usize) -> usize {
        (self.computed + tokens)
            .div_ceil(block_size)
            .saturating_sub(self.blocks.len())
    }

    pub(crate) fn add_blocks(&mut self, blocks: Vec<BlockId>) {
        self.blocks.extend(blocks);
    }

    pub(crate) fn take_blocks(&mut self) -> Vec<BlockId> {
        self.registered = 0;
        std::mem::take(&mut self.blocks)
    }

    /// Whether it was admitted before (it runs again after a preemption).
    pub(crate) fn admitted_before(&self) -> bool {
        self.cached_tokens.is_some()
    }

    /// Forgets computed KV: the sequence will be prefilled again (tokens kept).
    pub(crate) fn preempt(&mut self) {
        self.computed = 0;
        self.registered = 0;
        // The producer released its blocks after the pull: a preempted decode leg recomputes.
        if let KvTransfer::Consume { .. } = self.transfer {
            self.transfer = KvTransfer::None;
        }
    }

    fn extra_keys(&self, block: usize) -> Option<Vec<ExtraKey>> {
        let mut keys = Vec::new();
        if let Some(lora) = &self.request.lora_name {
            keys.push(ExtraKey::Str(lora.clone()));
        }
        if block == 0
            && let Some(salt) = &self.request.cache_salt
        {
            keys.push(ExtraKey::Str(salt.clone()));
        }
        (!keys.is_empty()).then_some(keys)
    }

    fn extra_range(&self, start: usize, end: usize) -> Vec<BlockExtraKeys> {
        (start..end).map(|b| self.extra_keys(b)).collect()
    }

    fn ensure_digests(&mut self, blocks: usize) {
        let bs = self.block_size;
        while self.digests.len() < blocks.min(self.tokens.len() / bs) {
            let i = self.digests.len();
            let extra = self.extra_keys(i);
            let digest = self.hasher.block_digest(
                self.digests.last(),
                &self.tokens[i * bs..(i + 1) * bs],
                extra.as_deref(),
            );
            self.digests.push(digest);
        }
    }

    /// Digests of the blocks a prefix lookup may use: vLLM always computes the last prompt
    /// token, so only full blocks of all tokens but the last count.
    pub(crate) fn lookup_blocks(&mut self) -> Vec<VllmDigest> {
        let n = (self.tokens.len() - 1) / self.block_size;
        self.ensure_digests(n);
        self.digests[..n].to_vec()
    }

    /// Digests of all its full blocks (the last prompt token's included).
    pub(crate) fn full_blocks(&mut self) -> &[VllmDigest] {
        let n = self.tokens.len() / self.block_size;
        self.ensure_digests(n);
        &self.digests[..n]
    }

    pub(crate) fn prefix_hit(&mut self, pool: &BlockPool) -> PrefixHit {
        let digests = self.lookup_blocks();
        let gpu: Vec<BlockId> = digests.iter().map_while(|d| pool.lookup(d)).collect();
        let offloaded: Vec<(VllmDigest, OffloadTier)> = digests[gpu.len()..]
            .iter()
            .map_while(|d| pool.offloaded_in(d).map(|t| (*d, t)))
            .collect();
        let local = gpu.len() + offloaded.len();
        let external = match self.transfer {
            KvTransfer::Consume { from, blocks } if local >= from && blocks > local => {
                digests[local..blocks.min(digests.len())].to_vec()
            }
            _ => Vec::new(),
        };
        PrefixHit {
            gpu,
            offloaded,
            external,
        }
    }

    /// Starts running with the cached prefix (GPU blocks referenced by the caller, offloaded blocks
    /// loaded into the first of the fresh `blocks`).
    pub(crate) fn admit(&mut self, hit: PrefixHit, blocks: Vec<BlockId>, pool: &mut BlockPool) {
        self.admit_loading(hit, blocks);
        self.finish_loading(pool);
    }

    /// Takes its blocks while its offloaded and pulled blocks load into the first of the fresh
    /// `blocks`: they enter the prefix cache only when [`Sequence::finish_loading`] says they
    /// have arrived, as vLLM caches a request's blocks once its asynchronous load is done.
    pub(crate) fn admit_loading(&mut self, hit: PrefixHit, blocks: Vec<BlockId>) {
        let bs = self.block_size;
        let gpu = hit.gpu.len();
        let loaded = hit.offloaded.len() + hit.external.len();
        self.blocks = hit.gpu.clone();
        self.blocks.extend(blocks);
        self.computed = (gpu + loaded) * bs;
        self.registered = gpu;
        self.cached_tokens.get_or_insert(self.computed);
        self.loading = (loaded > 0).then_some(hit);
    }

    /// The digests of the offloaded blocks it is loading.
    pub(crate) fn loading_digests(&self) -> impl Iterator<Item = &VllmDigest> {
        self.loading
            .iter()
            .flat_map(|hit| hit.offloaded.iter().map(|(d, _)| d))
    }

    /// Its loaded blocks have arrived: they enter the prefix cache.
    pub(crate) fn finish_loading(&mut self, pool: &mut BlockPool) {
        let Some(hit) = self.loading.take() else {
            return;
        };
        let bs = self.block_size;
        let gpu = hit.gpu.len();
        let loaded = hit.offloaded.len() + hit.external.len();
        let parent = gpu.checked_sub(1).map(|p| self.digests[p]);
        let extra = self.extra_range(gpu, gpu + loaded);
        let digests: Vec<VllmDigest> = hit
            .offloaded
            .iter()
            .map(|(d, _)| d)
            .chain(&hit.external)
            .copied()
            .collect();
        pool.cache_full_blocks(
            &self.blocks[gpu..gpu + loaded],
            FullBlocks {
                digests: &digests,
                parent: parent.as_ref(),
                tokens: &self.tokens[gpu * bs..(gpu + loaded) * bs],
                extra: &extra,
                lora_name: self.request.lora_name.as_deref(),
            },
        );
        // Last block first, so that the prefix's head is the tier's most recently used, as
        // vLLM's LRU offloading manager touches a request's blocks.
        for (digest, _) in hit.offloaded.into_iter().rev() {
            pool.unpin_offloaded(&digest);
            pool.touch_offloaded(digest);
        }
        self.registered = gpu + loaded;
    }

    /// Its next `n` tokens are scheduled: the blocks they fill enter the prefix cache now, as
    /// vLLM's `allocate_slots` caches them when it allocates the step's slots, so a request
    /// scheduled later in the same step already finds them.
    pub(crate) fn cache_scheduled(&mut self, n: usize, pool: &mut BlockPool) {
        let bs = self.block_size;
        let full = (self.computed + n).min(self.tokens.len()) / bs;
        if full > self.registered {
            self.ensure_digests(full);
            let parent = self.registered.checked_sub(1).map(|p| self.digests[p]);
            let extra = self.extra_range(self.registered, full);
            pool.cache_full_blocks(
                &self.blocks[self.registered..full],
                FullBlocks {
                    digests: &self.digests[self.registered..full],
                    parent: parent.as_ref(),
                    tokens: &self.tokens[self.registered * bs..full * bs],
                    extra: &extra,
                    lora_name: self.request.lora_name.as_deref(),
                },
            );
            self.registered = full;
        }
    }

    /// Computes `n` more tokens' KV (scheduled, and cached, by [`Sequence::cache_scheduled`]):
    /// a sequence whose tokens are all computed produces its next output token.
    pub(crate) fn advance(&mut self, n: usize) -> Option<TokenOutput> {
        self.computed += n;
        if self.computed < self.tokens.len() || self.finished() {
            return None;
        }
        let token = self.request.output[self.generated];
        self.tokens.push(token);
        self.generated += 1;
        Some(TokenOutput {
            id: self.request.id,
            token,
            index: self.generated - 1,
            finished: self.finished().then_some(FinishReason::Done),
            prompt_tokens: self.request.prompt.len(),
            cached_tokens: self.cached_tokens.unwrap_or(0),
        })
    }
}
