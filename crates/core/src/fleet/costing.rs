//! What a plan reads of each endpoint (its [`Candidate`] and the cached tokens the router
//! expects it to report), and the plan that builds it only for the endpoints that can matter:
//! those holding part of the prompt, and the least busy of the rest in the fleet's
//! [`crate::schedule::LoadOrder`] (see [`crate::schedule::schedule_pruned`]).

use super::pinned::RoomWaitTime;
use super::recent_use::Admission;
use super::{Distrust, EndpointState, Fleet, Plan, tier_learning};
use crate::index::{EndpointId, HeldBlocks, PrefixMatch, PrefixMatches};
use crate::keys::RouterKey;
use crate::schedule::{
    CacheSource, CacheView, Candidate, EndpointLoad, IndexState, PruneScope, RequestInfo, Role,
    cost, saturated, schedule_pruned,
};
use crate::tiers::TierTokens;

/// What every endpoint's view in one plan is made from.
#[derive(Clone, Copy)]
pub(super) struct PlanInputs<'a> {
    /// The model the request names.
    pub(super) model: &'a str,
    /// The request's full blocks' keys.
    pub(super) keys: &'a [RouterKey],
    /// The request's prompt length.
    pub(super) prompt_tokens: usize,
    /// Tokens per block of the request.
    pub(super) block_size: usize,
    /// The index's matches, sorted by endpoint.
    pub(super) index_matches: &'a PrefixMatches,
    /// The routing history's matches, sorted by endpoint.
    pub(super) history: &'a [(EndpointId, u32)],
    /// The predicted overlay's matches, sorted by endpoint.
    pub(super) predicted: &'a [(EndpointId, u32)],
    /// Full blocks an engine can report cached (all tokens but the last).
    pub(super) reportable: usize,
    /// The prefill rate an endpoint's own estimate shrinks toward.
    pub(super) prior_rate: f64,
    /// The prior the pruned plan's load order keys its endpoints with: the whole fleet's
    /// pooled rate, steady whatever model a request names (see [`Fleet::plan_pruned`]).
    pub(super) order_prior: f64,
    /// The block reuse an endpoint's own estimate shrinks toward: the fleet's, for the
    /// request's model (its group: [`super::model_priors`]).
    pub(super) prior_reuse: f64,
    /// The fleet's decode time (first token to end) for the request's model, for an endpoint
    /// with none of its own.
    pub(super) decode_s: Option<f64>,
    /// The plan's time.
    pub(super) now: f64,
}

/// Blocks `id` holds in a list sorted by endpoint (0 when absent).
fn blocks_in(list: &[(EndpointId, u32)], id: EndpointId) -> u32 {
    list.binary_search_by_key(&id, |(e, _)| *e)
        .map_or(0, |at| list[at].1)
}

/// What an endpoint is known to hold of a request.
struct Expected {
    verdict: Result<(), Distrust>,
    index_state: IndexState,
    index_match: Option<PrefixMatch>,
    history: u32,
    predicted: u32,
    predicted_tokens: usize,
    predicted_tiers: TierTokens,
}

/// One endpoint as a plan sees it.
pub(super) struct EndpointView {
    /// What the scheduler reads.
    pub(super) candidate: Candidate,
    /// Whether its index is trusted, or why not.
    pub(super) verdict: Result<(), Distrust>,
    /// Cached tokens it is expected to report (see [`Plan::predicted_cached`]).
    pub(super) predicted_tokens: usize,
    /// Of those, per tier below the GPU (see [`Plan::predicted_tiers`]).
    pub(super) predicted_tiers: TierTokens,
}

impl Fleet {
    /// The longest prefixes of the prompt held on the GPUs of endpoints that could serve it
    /// (healthy, not ejected, serving `model` in blocks of `block_size` tokens in `role`) and
    /// whose index is trusted, by `matches`: what a candidate that loads the prompt from a lower
    /// tier would copy into its GPU a second time. Empty where the profile reads no index.
    pub(super) fn gpu_copies(
        &self,
        matches: &PrefixMatches,
        model: &str,
        block_size: usize,
        role: Role,
        now: f64,
    ) -> cost::GpuCopies {
        let mut copies = cost::GpuCopies::default();
        if self.profile.cache != CacheSource::Precise {
            return copies;
        }
        for m in &matches.matches {
            let Some(e) = self.endpoint(m.endpoint) else {
                continue;
            };
            let eligible = e.present
                && e.healthy
                && !e.outlier.ejected(now)
                && e.spec.block_size == block_size
                && e.spec.serves(model)
                && e.spec.role.serves(role)
                && e.trust.verdict(&self.config.trust, now).is_ok();
            if eligible {
                copies.add(m.endpoint, m.gpu_blocks as usize * block_size);
            }
        }
        copies
    }

    /// What `e` is known to hold of the request, and what it is expected to report cached.
    fn expected(&self, inputs: &PlanInputs<'_>, e: &EndpointState) -> Expected {
        let bs = inputs.block_size;
        let verdict = e.trust.verdict(&self.config.trust, inputs.now);
        let index_state = match verdict {
            Ok(()) => IndexState::Trusted,
            Err(Distrust::NoEvents) => IndexState::NoEvents,
            Err(_) => IndexState::Distrusted,
        };
        let matches = &inputs.index_matches.matches;
        let index_match = matches
            .binary_search_by_key(&e.id, |m| m.endpoint)
            .ok()
            .map(|at| matches[at])
            .filter(|_| e.spec.block_size == bs);
        let history = blocks_in(inputs.history, e.id);
        let predicted = blocks_in(inputs.predicted, e.id);
        let known = match index_state {
            IndexState::Trusted => index_match.map_or(0, |m| m.blocks).max(predicted),
            IndexState::NoEvents => history.max(predicted),
            IndexState::Distrusted => predicted,
        };
        let predicted_tokens = (known as usize).min(inputs.reportable) * bs;
        let predicted_tiers = tier_learning::predicted_tier_tokens(
            index_state,
            index_match.as_ref(),
            predicted,
            predicted_tokens,
            bs,
        );
        Expected {
            verdict,
            index_state,
            index_match,
            history,
            predicted,
            predicted_tokens,
            predicted_tiers,
        }
    }

    /// `e`'s view for a plan, `held`: what its index holds.
    pub(super) fn view(
        &self,
        inputs: &PlanInputs<'_>,
        e: &EndpointState,
        held: HeldBlocks,
    ) -> EndpointView {
        let bs = inputs.block_size;
        let now = inputs.now;
        let Expected {
            verdict,
            index_state,
            index_match,
            history,
            predicted,
            predicted_tokens,
            predicted_tiers,
        } = self.expected(inputs, e);
        let same_block_size = e.spec.block_size == bs;
        // Room left in its cache: capacity less what its index holds and what its in-flight
        // prefills are about to store.
        let free_blocks = e.capacity_blocks.map(|capacity| {
            capacity as f64 - held.gpu as f64 - (e.inflight_prefill_tokens / bs as u64) as f64
        });
        // The same for its CPU tier once its events showed the tier's capacity (never taken
        // below what it holds there): what the in-flight prefills compute is offloaded there too.
        let cpu_capacity_blocks =
            (held.cpu_capacity > 0).then(|| held.cpu_capacity.max(held.cpu) as f64);
        let cpu_free_blocks = cpu_capacity_blocks.map(|capacity| {
            capacity - held.cpu as f64 - (e.inflight_prefill_tokens / bs as u64) as f64
        });
        // The prompt's prefix it holds, by last use: read only where the policy reads a cache
        // picture, part of the prompt is held and something can be lost (a search over its
        // recent requests' keys).
        let known = index_match
            .map_or(0, |m| m.blocks)
            .max(history)
            .max(predicted);
        let reads_cache = self.profile.cache != CacheSource::None;
        let room_wait = e
            .room_asked(
                inputs.keys,
                inputs.prompt_tokens,
                bs,
                inputs.decode_s,
                self.config.prefill_chunk_tokens,
                now,
            )
            .map_or_else(RoomWaitTime::default, |asked| e.pinned.room_wait_s(&asked));
        let load = e.load(now, self.config.load_sample_max_age_s);
        let prefill_tokens_per_s = e.prefill_rate_toward(inputs.prior_rate);
        // The prefix split by last use, for the GPU cache and the CPU tier (whose LRU drops
        // blocks by last use as the GPU's does), each against its capacity and whether the
        // queue ahead overflows it: read only where the policy reads a cache picture and part
        // of the prompt is held (a search over its recent requests' keys, walked once).
        let [recency, cpu_recency] = if known > 0 && reads_cache {
            // Admitted once the prefills queued ahead are done or room is made, whichever is
            // later (as the cost counts its queue).
            let admission = Admission {
                at: now
                    + cost::queued_prefill_s(&load, inputs.prompt_tokens, prefill_tokens_per_s)
                        .max(room_wait.wait_s),
                fallback_decode_s: inputs.decode_s,
            };
            e.recent.parts_for(
                &e.pinned,
                inputs.keys,
                known as usize,
                [
                    e.capacity_blocks
                        .map(|capacity| (capacity, free_blocks.is_some_and(|free| free < 0.0))),
                    cpu_capacity_blocks.map(|capacity| {
                        (
                            capacity as usize,
                            cpu_free_blocks.is_some_and(|free| free < 0.0),
                        )
                    }),
                ],
                &admission,
            )
        } else {
            [None, None]
        };
        let cache = CacheView {
            index: index_match,
            index_state,
            history,
            predicted,
            free_blocks,
            unseen_blocks: e.pinned.extra_blocks() as f64,
            capacity_blocks: e.capacity_blocks.map(|capacity| capacity as f64),
            block_reuse: e.reuse.per_evicted_block_toward(
                inputs.prior_reuse,
                e.capacity_blocks,
                now,
            ),
            recency,
            cpu_free_blocks,
            cpu_capacity_blocks,
            cpu_recency,
            offloads_to_cpu: held.cpu > 0,
            offloads_to_storage: held.storage > 0,
            tier_uncertain: inputs.index_matches.tier_uncertain(e.id),
        };
        let cache_fill = e
            .capacity_blocks
            .map_or(0.0, |capacity| held.gpu as f64 / capacity.max(1) as f64);
        let candidate = Candidate {
            cache_fill,
            endpoint: e.id,
            healthy: e.healthy,
            ejected: e.outlier.ejected(now),
            circuit_open: e.inflight >= self.config.outlier.max_inflight.max(1),
            serves_model: same_block_size && e.spec.serves(inputs.model),
            role: e.spec.role,
            load: EndpointLoad {
                room_wait_s: room_wait.wait_s,
                room_prefilled_share: room_wait.prefilled_share,
                not_fitting_per_s: e.capacity_blocks.map_or(0.0, |capacity_blocks| {
                    let blocks = inputs
                        .prompt_tokens
                        .div_ceil(bs.max(1))
                        .max(inputs.keys.len() + 1);
                    e.recent
                        .not_fitting_per_s(inputs.keys, blocks, capacity_blocks, now)
                }),
                decode_s: e.pinned.decode_s().or(inputs.decode_s).unwrap_or(0.0),
                ..load
            },
            cache,
            prefill_tokens_per_s,
            tier_rates: e
                .tier_rates
                .with_queued_shared(self.shared_backlog.tokens(e.shared_mount(), now)),
        };
        EndpointView {
            candidate,
            verdict,
            predicted_tokens,
            predicted_tiers,
        }
    }

    /// Plans with [`schedule_pruned`]: only the session's endpoint, those that hold part of the
    /// prompt as the profile's cache source counts it ([`cost::countable_blocks`]) and the
    /// least busy of the rest are viewed and costed (`held`: what an endpoint's index holds).
    /// `None` when it cannot (no more than `depth` competitors, or a picker that reads every
    /// candidate): plan every endpoint then.
    pub(super) fn plan_pruned(
        &mut self,
        inputs: &PlanInputs<'_>,
        held: impl Fn(EndpointId) -> HeldBlocks,
        info: &RequestInfo,
        random: u64,
        depth: usize,
    ) -> Option<Plan> {
        let mut expired = std::mem::take(&mut self.expired_samples);
        self.load_order.expire(inputs.now, &mut expired);
        for id in expired.drain(..) {
            self.load_changed(id);
        }
        self.expired_samples = expired;
        // Keys assume this decision's prior rate from now on; every key is set again when it
        // rose too far above the lowest one they assume.
        if self.load_order.assume_prior(inputs.order_prior) {
            for at in 0..self.endpoints.len() {
                self.load_changed(EndpointId(at as u32));
            }
        }
        // Every endpoint holding part of the prompt by any source.
        let bs = inputs.block_size;
        let mut holders = std::mem::take(&mut self.holders);
        holders.clear();
        let matches = inputs.index_matches.matches.iter();
        let by_source = matches
            .map(|m: &PrefixMatch| (m.endpoint, m.blocks))
            .chain(inputs.history.iter().copied())
            .chain(inputs.predicted.iter().copied());
        holders.extend(
            by_source
                .filter(|&(id, blocks)| blocks > 0 && (id.0 as usize) < self.endpoints.len())
                .map(|(id, _)| id),
        );
        holders.sort_unstable();
        holders.dedup();
        // Every endpoint but these holds nothing of the prompt by any source: it is expected to
        // report nothing. Of these, those whose blocks the profile's cache source counts
        // (`holding`) are walked as holders; the others hold nothing the cost counts (a routing
        // history the endpoint's trusted events overrule, say): their bound is the load order's.
        let mut holding = std::mem::take(&mut self.holding);
        holding.clear();
        let mut predicted_cached = vec![0; self.endpoints.len()];
        let mut predicted_tiers = vec![TierTokens::default(); self.endpoints.len()];
        for &id in &holders {
            let e = &self.endpoints[id.0 as usize];
            let expected = self.expected(inputs, e);
            predicted_cached[id.0 as usize] = expected.predicted_tokens;
            predicted_tiers[id.0 as usize] = expected.predicted_tiers;
            let counted = cost::countable_blocks(
                self.profile.cache,
                expected.index_state,
                expected.index_match.map_or(0, |m| m.blocks),
                expected.history,
                expected.predicted,
            );
            if counted > 0 {
                let rate = e.prefill_rate_toward(inputs.prior_rate);
                holding.push((id, (counted as usize).saturating_mul(bs), rate));
            }
        }
        let mut buffers = std::mem::take(&mut self.prune_buffers);
        let mut viewed = 0;
        let endpoints = &self.endpoints;
        let role_of = |id: EndpointId| endpoints[id.0 as usize].spec.role;
        let scope = PruneScope {
            holders: &holding,
            order: &self.load_order,
            serving: (inputs.model, inputs.block_size),
            prior_rate: inputs.prior_rate,
            roles: self
                .disagg
                .is_some()
                .then_some(&role_of as &dyn Fn(EndpointId) -> Role),
        };
        let decision = schedule_pruned(
            &self.profile,
            info,
            &scope,
            |id| {
                viewed += 1;
                let e = &self.endpoints[id.0 as usize];
                self.view(inputs, e, held(id)).candidate
            },
            random,
            depth,
            &mut buffers,
        );
        self.prune_buffers = buffers;
        self.holders = holders;
        self.holding = holding;
        self.last_plan_viewed = viewed;
        Some(Plan {
            decision: decision?,
            facts: Vec::new(),
            predicted_cached,
            predicted_tiers,
        })
    }

    /// Whether every plan sees `e` saturated until its load changes again: with its load
    /// sample while its key counts it (fresh for every plan until the order expires it), both
    /// with and without it otherwise (a plan just before the expiry may still read it).
    fn saturated_as_planned(&self, e: &EndpointState, counts_sample: bool) -> bool {
        let with_sample = saturated(
            &self.profile,
            &e.counts_with(e.sample.as_ref().map(|(s, _)| s)),
        );
        with_sample && (counts_sample || saturated(&self.profile, &e.counts_with(None)))
    }

    /// Sets `id`'s place in the load order from its load and prefill rate now, and whether a
    /// plan may use it (call whenever its in-flight counts, its load sample or its observed
    /// rate change, its health or ejection changes, or it leaves or joins).
    pub(super) fn load_changed(&mut self, id: EndpointId) {
        let Some(e) = self.endpoints.get(id.0 as usize) else {
            return;
        };
        if e.present {
            let busy = e.busy(self.load_order.counts_sample(id));
            let rate = e.prefill_rate_toward(self.load_order.prior());
            let key = self.load_order.key(&self.profile, busy, rate);
            let plannable = e.healthy && !self.load_order.ejected(id);
            let saturated = self.saturated_as_planned(e, self.load_order.counts_sample(id));
            self.load_order.serve(id, &e.spec.models, e.spec.block_size);
            self.load_order.set(id, busy, key);
            self.load_order.set_saturated(id, saturated);
            self.load_order.set_plannable(id, plannable);
        } else {
            self.load_order.remove(id);
        }
    }
}
