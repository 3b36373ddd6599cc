//! The fleet's tier observations: which of a request's predicted cached tokens sit on tiers
//! below the GPU (set on its dispatch, so that its time to first token teaches the tiers' load
//! rates), and the engines' own per-tier load counters.

use std::cell::OnceCell;

use super::{EndpointState, Fleet, IndexState};
use crate::fleet::{EndpointId, RequestFeatures};
use crate::index::PrefixMatch;
use crate::load_counters::TierLoadCounters;
use crate::tiers::{LoadTier, TierTokens, reportable_tiers};

/// Of `predicted` cached tokens (already cut to what the engine can report), those on each
/// tier below the GPU: from the index's match when the index is trusted and says at least as
/// much as the predicted overlay (the overlay's blocks are the engine's own GPU blocks to be),
/// else none.
pub(super) fn predicted_tier_tokens(
    state: IndexState,
    index_match: Option<&PrefixMatch>,
    overlay_blocks: u32,
    predicted: usize,
    block_size: usize,
) -> TierTokens {
    match (state, index_match) {
        (IndexState::Trusted, Some(m)) if m.blocks >= overlay_blocks => reportable_tiers(
            m.gpu_blocks as usize * block_size,
            [
                m.cpu_blocks as usize * block_size,
                m.storage_blocks as usize * block_size,
                m.shared_blocks as usize * block_size,
            ],
            predicted,
        ),
        _ => [0; 3],
    }
}

impl EndpointState {
    /// The name of the shared tier it mounts, if any (endpoints with the same name share the
    /// filesystem's bandwidth).
    pub fn shared_mount(&self) -> Option<&str> {
        self.spec.offload.shared.as_ref().map(|m| m.name.as_str())
    }
}

impl Fleet {
    /// The tier tokens of `predicted` cached tokens of `request` on `endpoint`, for its
    /// dispatch: read from the index at dispatch (what the plan saw, or fresher). No index
    /// lookup and no walk of the predicted overlay (`overlay`: its blocks there, walked at most
    /// once per dispatch) when the endpoint holds nothing below the GPU and the shared tier is
    /// empty.
    /// Whether they rely on tiers whose events were recently inconsistent (see
    /// [`PrefixMatches::tier_uncertain`](crate::index::PrefixMatches::tier_uncertain)).
    pub(super) fn dispatch_tier_tokens(
        &self,
        predicted: usize,
        request: &RequestFeatures<'_>,
        endpoint: EndpointId,
        now: f64,
        overlay: &OnceCell<u32>,
    ) -> (TierTokens, bool) {
        let none = ([0; 3], false);
        let (Some(e), Some(index)) = (self.endpoint(endpoint), self.index_of(endpoint)) else {
            return none;
        };
        let bs = request.block_size.max(1);
        if predicted == 0 || e.spec.block_size != bs {
            return none;
        }
        let state = match e.trust.verdict(&self.config.trust, now) {
            Ok(()) => IndexState::Trusted,
            Err(_) => return none,
        };
        // The endpoint's own shard (the shared tier is every shard's), read once; the prompt is
        // walked (overlay and index) only when something sits below the GPU.
        index.read_endpoint(endpoint, |ix| {
            let below_gpu = ix
                .endpoint_stats(endpoint)
                .is_some_and(|s| s.blocks_cpu + s.blocks_storage > 0)
                || ix.shared_tier_stats().blocks > 0;
            if !below_gpu {
                return none;
            }
            let overlay = *overlay.get_or_init(|| self.overlay_blocks(request, endpoint, now));
            let matches = ix.lookup(request.keys);
            let tiers = predicted_tier_tokens(state, matches.get(endpoint), overlay, predicted, bs);
            let uncertain = tiers.iter().any(|&t| t > 0) && matches.tier_uncertain(endpoint);
            (tiers, uncertain)
        })
    }

    /// The shared-tier loads dispatched and not done, per mount.
    pub fn shared_backlog(&self) -> &super::SharedBacklog {
        &self.shared_backlog
    }

    /// One scrape, at `now`, of `id`'s per-tier counters of tokens loaded and of the seconds
    /// its loads took (CPU, own storage, shared; cumulative, `None` where the engine does not
    /// report the tier): what the engine says it loaded, against what was predicted, and the
    /// tiers' load rates as the engine measured them (see
    /// [`TierRates::observe_engine_loads`](crate::tiers::TierRates::observe_engine_loads)).
    /// What it loaded from a shared filesystem joins that filesystem's window; once the window
    /// shows a rate, it is every mounting endpoint's ([`crate::load_counters`]).
    pub fn observe_engine_tier_loads(
        &mut self,
        id: EndpointId,
        counters: TierLoadCounters,
        now: f64,
    ) {
        let Some(e) = self.endpoints.get_mut(id.0 as usize) else {
            return;
        };
        let shared = e.tier_rates.observe_engine_loads(counters, now);
        let (Some((loaded, since)), Some(mount)) = (shared, e.shared_mount()) else {
            return;
        };
        let mount = mount.to_owned();
        let Some(rate) = self.mount_windows.add(&mount, loaded, since, now) else {
            return;
        };
        for e in &mut self.endpoints {
            if e.shared_mount() == Some(mount.as_str()) {
                e.tier_rates
                    .learn_seconds_per_token(LoadTier::Shared, 1.0 / rate);
            }
        }
    }
}
