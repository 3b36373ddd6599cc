//! Prefill/decode disaggregation inside one engine: a prefill leg whose finished blocks stay
//! pinned until a consumer pulls them (or the lease expires), and a decode leg whose prompt
//! blocks arrive from a producer instead of being computed. The transfer itself (side channel,
//! link time, lease deadline) is the caller's: the engine stays pure.

use serde::Serialize;

use super::block_pool::BlockId;
use super::request::Sequence;
use super::{Engine, EngineRequest, RequestId};
use crate::SimError;

/// How a request takes part in P/D.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub enum KvTransfer {
    /// An ordinary request.
    #[default]
    None,
    /// A prefill leg (`do_remote_decode`): its full prompt blocks are held when it finishes.
    Produce,
    /// A decode leg (`do_remote_prefill`): full prompt blocks `from..blocks` were pulled from
    /// a producer, after the engine's own cached prefix of `from` blocks. If that prefix shrank
    /// before admission (evicted), the pulled blocks no longer join it and are recomputed. As
    /// vLLM does, the last prompt token is always computed locally.
    Consume {
        /// Blocks the engine had cached when it pulled.
        from: usize,
        /// Full prompt blocks available after the pull.
        blocks: usize,
    },
}

/// The blocks a finished prefill leg holds for its consumer.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct HeldBlocks {
    /// Block ids, in prompt order (the `remote_block_ids` a producer returns).
    pub block_ids: Vec<BlockId>,
    /// The blocks' engine hashes, as KV events publish them.
    pub hashes: Vec<u64>,
}

impl Engine {
    /// Queues a request that takes part in P/D (see [`KvTransfer`]).
    pub fn add_request_with(
        &mut self,
        request: EngineRequest,
        transfer: KvTransfer,
    ) -> Result<(), SimError> {
        self.validate(&request)?;
        self.metrics.prompt_tokens += request.prompt.len() as u64;
        self.waiting.push_back(Sequence::with_transfer(
            request,
            &self.hasher,
            self.config.block_size,
            transfer,
        ));
        Ok(())
    }

    /// Blocks held for request `id`, if it is a finished prefill leg whose hold is not
    /// released yet.
    pub fn held(&self, id: RequestId) -> Option<&HeldBlocks> {
        self.held.get(&id).map(|(held, _)| held)
    }

    /// Releases the blocks held for `id` (pulled, or the lease expired): they stay cached and
    /// become evictable. False when nothing was held.
    pub fn release(&mut self, id: RequestId) -> bool {
        match self.held.remove(&id) {
            Some((_, blocks)) => {
                self.pool.free(&blocks);
                true
            }
            None => false,
        }
    }

    /// The request's prefix the engine holds (GPU, then CPU tier), in blocks, and the engine
    /// hashes of every block a prefix hit may cover (all full blocks but for the last token).
    pub fn local_prefix(&self, request: &EngineRequest) -> (usize, Vec<u64>) {
        let mut seq = Sequence::new(request.clone(), &self.hasher, self.config.block_size);
        let hit = seq.prefix_hit(&self.pool);
        let blocks = seq.lookup_blocks().len();
        (hit.total_blocks(), seq.block_hashes(blocks))
    }

    /// Requests whose blocks are held.
    pub fn held_requests(&self) -> usize {
        self.held.len()
    }

    /// Ends a finished sequence: a prefill leg keeps its full prompt blocks, the rest is freed.
    pub(super) fn retire(&mut self, mut seq: Sequence) {
        let mut blocks = seq.take_blocks();
        if seq.transfer() != KvTransfer::Produce {
            self.pool.free(&blocks);
            return;
        }
        let full = (seq.prompt_len() / self.config.block_size).min(blocks.len());
        let tail = blocks.split_off(full);
        self.pool.free(&tail);
        let held = HeldBlocks {
            block_ids: blocks.clone(),
            hashes: seq.block_hashes(full),
        };
        self.held.insert(seq.id(), (held, blocks));
    }
}
