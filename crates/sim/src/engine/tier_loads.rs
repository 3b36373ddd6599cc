//! When an engine loads blocks from its offload tiers: in the step that admits the request, or
//! beside the batch.
//!
//! vLLM's OffloadingConnector (CPU memory, and llm-d's filesystem backend) answers
//! `get_num_new_matched_tokens` with `load_kv_async = True`: the scheduler allocates GPU blocks
//! for the hit, parks the request as `WAITING_FOR_REMOTE_KVS`, and keeps stepping the batch
//! while a worker copies the blocks in; the request is scheduled again once they have arrived,
//! and a request that would hit blocks still being loaded waits for them. No running decode
//! waits for a load. LMCache's connector, unless configured for asynchronous loading, loads in
//! the forward pass of the step that admits the request, so every sequence in that step waits
//! ([`TierLoads::InStep`]).
//!
//! Asynchronous loads from one engine's own tiers (CPU memory, local SSD) queue on its host link,
//! one transfer after another; a shared filesystem queues its loads among the whole fleet's at
//! its aggregate bandwidth ([`super::shared_fs`]).

use std::collections::HashMap;
use std::str::FromStr;

use serde::Serialize;

use super::RequestId;
use super::block_pool::BlockId;
use super::request::Sequence;

/// How an engine loads the blocks a request finds on its offload tiers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum TierLoads {
    /// Beside the batch, as vLLM's OffloadingConnector does: the request waits for its blocks,
    /// the running requests do not.
    #[default]
    Async,
    /// In the step that admits the request, as LMCache's connector does by default: the whole
    /// step waits for the load.
    InStep,
}

impl FromStr for TierLoads {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "async" => Ok(Self::Async),
            "in-step" => Ok(Self::InStep),
            other => Err(format!("unknown tier load mode `{other}` (async, in-step)")),
        }
    }
}

/// A request parked while its blocks load, and when they will all have arrived.
#[derive(Debug)]
struct Parked {
    seq: Sequence,
    ready_s: f64,
    /// The GPU blocks being filled for it.
    blocks: Vec<BlockId>,
}

/// The asynchronous loads under way on one engine.
#[derive(Debug, Default)]
pub(super) struct AsyncLoads {
    /// When the engine's host link is next free.
    link_free_s: f64,
    parked: Vec<Parked>,
    /// GPU blocks whose KV is still on its way, with when it arrives.
    arriving: HashMap<BlockId, f64>,
}

impl AsyncLoads {
    /// When a request admitted at `now_s` has its blocks: its load from the engine's own tiers
    /// (`link_load_s`) queues behind the link's earlier loads; its shared-filesystem load ends
    /// `shared_load_s` from now (the filesystem queues it among the fleet's loads); GPU blocks
    /// it hits that another request is still loading (`hit`) arrive when that load ends.
    pub(super) fn ready_at(
        &mut self,
        now_s: f64,
        link_load_s: f64,
        shared_load_s: f64,
        hit: &[BlockId],
    ) -> f64 {
        let mut ready = now_s + shared_load_s;
        if link_load_s > 0.0 {
            self.link_free_s = self.link_free_s.max(now_s) + link_load_s;
            ready = ready.max(self.link_free_s);
        }
        hit.iter()
            .filter_map(|id| self.arriving.get(id))
            .fold(ready, |r, &t| r.max(t))
    }

    /// Whether any of `hit` is still being loaded at `now_s`.
    pub(super) fn any_arriving(&self, now_s: f64, hit: &[BlockId]) -> bool {
        hit.iter()
            .any(|id| self.arriving.get(id).is_some_and(|&t| t > now_s))
    }

    /// Parks `seq` until `ready_s`; `blocks` are the GPU blocks its load fills.
    pub(super) fn park(&mut self, seq: Sequence, ready_s: f64, blocks: Vec<BlockId>) {
        for &id in &blocks {
            self.arriving.insert(id, ready_s);
        }
        self.parked.push(Parked {
            seq,
            ready_s,
            blocks,
        });
    }

    /// The parked requests whose blocks have all arrived by `now_s`, at most `limit` (the
    /// batch's free places), in the order they were parked.
    pub(super) fn take_ready(&mut self, now_s: f64, limit: usize) -> Vec<Sequence> {
        let mut ready = Vec::new();
        let mut i = 0;
        while i < self.parked.len() && ready.len() < limit {
            if self.parked[i].ready_s > now_s {
                i += 1;
                continue;
            }
            let p = self.parked.remove(i);
            for id in &p.blocks {
                self.arriving.remove(id);
            }
            ready.push(p.seq);
        }
        ready
    }

    /// The earliest time a parked request's blocks arrive.
    pub(super) fn next_ready(&self) -> Option<f64> {
        self.parked.iter().map(|p| p.ready_s).reduce(f64::min)
    }

    /// Requests parked.
    pub(super) fn len(&self) -> usize {
        self.parked.len()
    }

    /// Takes parked request `id` out (its blocks no longer arrive for anyone).
    pub(super) fn remove(&mut self, id: RequestId) -> Option<Sequence> {
        let i = self.parked.iter().position(|p| p.seq.id() == id)?;
        let p = self.parked.remove(i);
        for block in &p.blocks {
            self.arriving.remove(block);
        }
        Some(p.seq)
    }
}
