//! When an engine loads blocks from its offload tiers: in the step that admits the request, or
//! beside the batch.
//!
//! vLLM's OffloadingConnector (CPU memory, and llm-d's filesystem backend) answers
//! `get_num_new_matched_tokens` with `load_kv_async = True`: the scheduler allocates GPU blocks
//! for the hit, parks the request as `WAITING_FOR_REMOTE_KVS`, and keeps stepping the batch
//! while a worker copies the blocks in; once they have arrived they enter the prefix cache (and
//! their `BlockStored` events go out) and the request is scheduled again from the front of the
//! waiting queue. A request that would load blocks still being loaded is skipped (it keeps its
//! place) until they have arrived, and then finds them on the GPU. No running decode waits for
//! a load. LMCache's connector, unless configured for asynchronous loading, loads in
//! the forward pass of the step that admits the request, so every sequence in that step waits
//! ([`TierLoads::InStep`]).
//!
//! Asynchronous loads from one engine's own tiers (CPU memory, local SSD) queue on its host link,
//! one transfer after another; a shared filesystem queues its loads among the whole fleet's at
//! its aggregate bandwidth ([`super::shared_fs`]).

use std::collections::{HashMap, VecDeque};
use std::str::FromStr;

use kvroute_core::keys::VllmDigest;
use serde::Serialize;

use super::RequestId;
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

/// How long an engine with nothing to compute waits before it looks at its queue again while
/// loads are under way: vLLM's engine loop keeps scheduling (empty) steps, so a request that
/// arrives meanwhile is admitted at once, not when the first load ends.
pub(super) const LOAD_POLL_S: f64 = 1e-3;

/// A request parked while its blocks load, and when they will all have arrived.
#[derive(Debug)]
struct Parked {
    seq: Sequence,
    ready_s: f64,
}

/// The asynchronous loads under way on one engine.
#[derive(Debug, Default)]
pub(super) struct AsyncLoads {
    /// When the engine's host link is next free.
    link_free_s: f64,
    parked: VecDeque<Parked>,
    /// Offloaded blocks being loaded, each with when it arrives.
    loading: HashMap<VllmDigest, f64>,
}

impl AsyncLoads {
    /// When a request admitted at `now_s` has its blocks: its load from the engine's own tiers
    /// (`link_load_s`) queues behind the link's earlier loads; its shared-filesystem load ends
    /// `shared_load_s` from now (the filesystem queues it among the fleet's loads).
    pub(super) fn ready_at(&mut self, now_s: f64, link_load_s: f64, shared_load_s: f64) -> f64 {
        let mut ready = now_s + shared_load_s;
        if link_load_s > 0.0 {
            self.link_free_s = self.link_free_s.max(now_s) + link_load_s;
            ready = ready.max(self.link_free_s);
        }
        ready
    }

    /// Whether any of `digests` is being loaded for a parked request: a request that would
    /// load it too is delayed until it has arrived (as vLLM's OffloadingConnector delays it),
    /// and then finds it on the GPU.
    pub(super) fn any_loading<'a>(
        &self,
        mut digests: impl Iterator<Item = &'a VllmDigest>,
    ) -> bool {
        !self.loading.is_empty() && digests.any(|d| self.loading.contains_key(d))
    }

    /// Parks `seq`, whose blocks arrive at `ready_s`.
    pub(super) fn park(&mut self, seq: Sequence, ready_s: f64) {
        for digest in seq.loading_digests() {
            self.loading.insert(*digest, ready_s);
        }
        self.parked.push_back(Parked { seq, ready_s });
    }

    /// The first parked request (in the order they were parked) whose blocks have all arrived
    /// by `now_s`, if any; its blocks are no longer being loaded.
    pub(super) fn take_ready(&mut self, now_s: f64) -> Option<Sequence> {
        let i = self.parked.iter().position(|p| p.ready_s <= now_s)?;
        let p = self.parked.remove(i)?;
        for digest in p.seq.loading_digests() {
            self.loading.remove(digest);
        }
        Some(p.seq)
    }

    /// Puts back a request [`AsyncLoads::take_ready`] gave, whose blocks have arrived but for
    /// which there is no room yet: it is first again next time.
    pub(super) fn put_back(&mut self, seq: Sequence) {
        self.parked.push_front(Parked {
            seq,
            ready_s: f64::NEG_INFINITY,
        });
    }

    /// The earliest time after `now_s` a parked request's blocks arrive.
    pub(super) fn next_arrival(&self, now_s: f64) -> Option<f64> {
        self.parked
            .iter()
            .map(|p| p.ready_s)
            .filter(|&t| t > now_s)
            .reduce(f64::min)
    }

    /// Requests parked.
    pub(super) fn len(&self) -> usize {
        self.parked.len()
    }

    /// Takes parked request `id` out: its blocks will not arrive.
    pub(super) fn remove(&mut self, id: RequestId) -> Option<Sequence> {
        let i = self.parked.iter().position(|p| p.seq.id() == id)?;
        let p = self.parked.remove(i)?;
        for digest in p.seq.loading_digests() {
            self.loading.remove(digest);
        }
        Some(p.seq)
    }
}
