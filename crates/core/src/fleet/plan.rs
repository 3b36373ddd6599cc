//! Planning: ranking the endpoints for a request and charging the copy rent of the plan.

use super::endpoint::RatePool;
use super::{EndpointFacts, Fleet, IndexLookup, Plan, RANKING_DEPTH, RequestFeatures, costing};
use crate::index::{EndpointId, HeldBlocks, PrefixMatches};
use crate::schedule::{
    CacheSource, RequestInfo, Role, amortize, decoders_saturated, schedule, schedule_near_best,
};

impl Fleet {
    /// Plans a request at `now`: every endpoint that can come near the best costed (those
    /// holding part of the prompt the cost counts and the least busy of the rest, see
    /// [`Fleet::prune_costing`]; every endpoint where that cannot be told), the best ranked.
    /// The decision's ranking holds the winner and the next best, [`RANKING_DEPTH`] (or the
    /// retry policy's attempts, if more) in all, and breakdowns for those: the same winner and
    /// head of the ranking as [`Fleet::plan_every`], at a fraction of the work on a large
    /// fleet. `random` is a uniformly random `u64` (ties, sampling).
    pub fn plan(&mut self, request: &RequestFeatures<'_>, random: u64, now: f64) -> Plan {
        self.plan_with(request, None, random, now)
    }

    /// [`Fleet::plan`] with the request's index matches read beforehand, outside whatever
    /// lock guards the fleet ([`Fleet::lookup_targets`] or [`Fleet::lookup_target`], then
    /// [`LookupTarget::run`](super::LookupTarget::run)); a lookup read
    /// before an endpoint's cache picture was dropped is not used (the index is walked again).
    pub fn plan_with(
        &mut self,
        request: &RequestFeatures<'_>,
        lookup: Option<IndexLookup>,
        random: u64,
        now: f64,
    ) -> Plan {
        let depth = (!self.rank_every).then(|| self.ranking_depth());
        let mut plan = self.plan_ranked(request, lookup, random, now, depth);
        self.apply_copy_rent(request, &mut plan, now, true);
        plan
    }

    /// Plans a request at `now` as [`Fleet::plan`] does, with every candidate ranked and
    /// broken down, and the facts behind each (the explain API).
    pub fn plan_every(&mut self, request: &RequestFeatures<'_>, random: u64, now: f64) -> Plan {
        let mut plan = self.plan_ranked(request, None, random, now, None);
        self.apply_copy_rent(request, &mut plan, now, false);
        plan
    }

    /// An endpoint joined or left (or the fleet was built): whether copies are bought with
    /// rent, which they are under the cheapest picker with a cache picture while every present
    /// endpoint serves whole requests.
    pub(super) fn roles_changed(&mut self) {
        self.copies_by_rent = self.profile.picker == crate::schedule::Picker::Cheapest
            && self.profile.cache != CacheSource::None
            && self
                .endpoints
                .iter()
                .filter(|e| e.present)
                .all(|e| e.spec.role == Role::Both);
    }

    /// How many candidates a routing plan ranks and breaks down: [`RANKING_DEPTH`], or the retry
    /// policy's attempts if more.
    fn ranking_depth(&self) -> usize {
        RANKING_DEPTH.max(usize::try_from(self.config.retry.max_attempts).unwrap_or(usize::MAX))
    }

    /// Credits a copy of the request's shared prefix with the rent its holders' requests paid
    /// ([`crate::schedule::amortize`]), where the profile chooses by cost from a cache picture
    /// and every endpoint serves whole requests (on a fleet of prefill and decode roles the P/D
    /// decision places the legs). Only the head of the ranking a routing plan breaks down
    /// competes, so that an explanation shows what routing does. `routing`: the plan routes a
    /// request (its dispatch settles the rent), not an explanation.
    fn apply_copy_rent(
        &mut self,
        request: &RequestFeatures<'_>,
        plan: &mut Plan,
        now: f64,
        routing: bool,
    ) {
        let keys = request.keys.as_slice();
        let shared = if self.copies_by_rent {
            self.shared.shared_blocks(keys)
        } else {
            0
        };
        let Some(prefix) = shared.checked_sub(1).and_then(|last| keys.get(last)) else {
            return;
        };
        let bs = request.block_size.max(1);
        let shared_tokens = shared * bs;
        let rent_s = self.copy_rents.rent(prefix.0, now);
        let endpoints = &self.endpoints;
        let cold = |id: EndpointId| {
            let e = endpoints.get(id.0 as usize)?;
            Some(e.reuse.cold_share() * e.capacity_blocks? as f64)
        };
        let head = self.ranking_depth();
        let outcome = amortize::apply_rent(
            &self.profile,
            &mut plan.decision,
            amortize::SharedPrefix {
                tokens: shared_tokens,
                prompt_tokens: request.prompt_tokens,
                block_size: bs,
                rent_s,
            },
            head,
            cold,
        );
        if let (true, Some(outcome)) = (routing, outcome) {
            self.copy_rents
                .plan(prefix.0, shared_tokens, outcome.paid_s, now);
        }
        plan.decision.copy = outcome;
    }

    /// Plans a request by cost, ranking the best `depth` candidates (`None`: every one), with
    /// its index matches from `lookup` when usable.
    fn plan_ranked(
        &mut self,
        request: &RequestFeatures<'_>,
        lookup: Option<IndexLookup>,
        random: u64,
        now: f64,
        depth: Option<usize>,
    ) -> Plan {
        let bs = request.block_size.max(1);
        let keys = request.keys.as_slice();
        // An endpoint not yet observed is assumed as fast as the observed ones serving the same
        // model (a model's engines are mostly uniform; another model's may be ten times faster
        // or slower); the configured rate is the prior when none is observed yet.
        // One pass pools both: the model's endpoints for the costs, the whole fleet for the
        // pruned plan's load order, whose keys must not be set again whenever consecutive
        // requests name models of different speeds (its bound scales to either prior).
        let (mut fleet_pool, mut model_pool) = (RatePool::default(), RatePool::default());
        for e in self.endpoints.iter().filter(|e| e.present) {
            fleet_pool.add(e);
            if e.spec.serves(request.model) {
                model_pool.add(e);
            }
        }
        let model = self.model_priors.slot(request.model);
        let default_rate = self.config.default_prefill_tokens_per_s;
        let prior_rate = model_pool.rate().unwrap_or(default_rate);
        let order_prior = fleet_pool.rate().unwrap_or(default_rate);
        let session_endpoint = request.session.and_then(|s| self.sessions.get(s));
        // Only the cheapest-cost picker can be pruned (the others read every candidate).
        let pruned = self.prune
            && self.profile.picker == crate::schedule::Picker::Cheapest
            && depth.is_some_and(|depth| self.endpoints.len() > depth);
        let index = self.index_for_block_size(bs).cloned();
        let looked_up = self.usable_lookup(lookup, bs);
        let history = self.history.longest_prefixes(keys, now);
        let predicted = self.predicted.longest_prefixes(keys, now);
        let no_matches = PrefixMatches::default();
        let base = costing::PlanInputs {
            model: request.model,
            keys,
            prompt_tokens: request.prompt_tokens,
            block_size: bs,
            index_matches: &no_matches,
            history: &history,
            predicted: &predicted,
            reportable: request.prompt_tokens.saturating_sub(1) / bs,
            prior_rate,
            order_prior,
            prior_reuse: self.model_priors.reuse(model),
            decode_s: self.model_priors.decode_s(model),
            now,
        };
        self.round_robin = self.round_robin.wrapping_add(1);
        // The request's matches: walked before the fleet's lock was taken, else now (one
        // shard's read guard at a time). Each endpoint's fill as its shard last published it:
        // nothing here waits for a writer.
        let walked;
        let index_matches = match (&looked_up, &index) {
            (Some(matches), _) => matches,
            (None, Some(index)) => {
                walked = index.lookup(keys);
                &walked
            }
            (None, None) => &no_matches,
        };
        let info = RequestInfo {
            prompt_tokens: request.prompt_tokens,
            block_size: bs,
            session_endpoint,
            role: request.role,
            gpu_copies: self.gpu_copies(index_matches, request.model, bs, request.role, now),
            prefix_key: self
                .profile
                .picker
                .hashed_prefix_tokens()
                .and_then(|tokens| {
                    // Router keys chain their parents: the last key of the prefix hashes all of it.
                    let blocks = tokens.div_ceil(bs).clamp(1, keys.len().max(1));
                    keys.get(blocks - 1).map(|k| k.0)
                }),
        };
        let held = |id| {
            index
                .as_ref()
                .map_or_else(HeldBlocks::default, |index| index.held_blocks(id))
        };
        if let (true, Some(depth)) = (pruned, depth) {
            let inputs = costing::PlanInputs {
                index_matches,
                ..base
            };
            if let Some(plan) = self.plan_pruned(&inputs, held, &info, random, depth) {
                return plan;
            }
        }
        let ids = self.endpoints.iter().map(|e| e.id);
        let held_blocks: Vec<HeldBlocks> = match &index {
            Some(index) => index.held_blocks_of(ids),
            None => vec![HeldBlocks::default(); self.endpoints.len()],
        };
        let inputs = costing::PlanInputs {
            index_matches,
            ..base
        };
        let mut candidates = std::mem::take(&mut self.candidates);
        candidates.clear();
        self.last_plan_viewed = self.endpoints.len();
        let explain = depth.is_none();
        let mut facts = Vec::with_capacity(if explain { self.endpoints.len() } else { 0 });
        let mut predicted_cached = Vec::with_capacity(self.endpoints.len());
        let mut predicted_tiers = Vec::with_capacity(self.endpoints.len());
        for e in &self.endpoints {
            let view = self.view(&inputs, e, held_blocks[e.id.0 as usize]);
            predicted_cached.push(view.predicted_tokens);
            predicted_tiers.push(view.predicted_tiers);
            if explain {
                facts.push(EndpointFacts {
                    endpoint: e.id,
                    healthy: e.healthy,
                    ejected_until: e.outlier.ejected_until(now),
                    index_distrust: view.verdict.err(),
                    index_match: view.candidate.cache.index,
                    history_blocks: view.candidate.cache.history,
                    predicted_blocks: view.candidate.cache.predicted,
                    load: view.candidate.load.clone(),
                    prefill_tokens_per_s: view.candidate.prefill_tokens_per_s,
                });
            }
            candidates.push(view.candidate);
        }
        let mut decision = match depth {
            Some(depth) => schedule_near_best(
                &self.profile,
                &info,
                &candidates,
                random,
                self.round_robin,
                depth,
                &mut self.rank_buffers,
            ),
            None => schedule(&self.profile, &info, &candidates, random, self.round_robin),
        };
        if let (Some(depth), Some(_)) = (depth, &self.disagg) {
            self.rank_buffers.rank_role_heads(
                &self.profile,
                &info,
                &candidates,
                &mut decision,
                depth,
            );
        }
        if self.disagg.is_some() {
            decision.saturated =
                decoders_saturated(&self.profile, &info, &candidates, decision.saturated);
        }
        self.candidates = candidates;
        Plan {
            decision,
            facts,
            predicted_cached,
            predicted_tiers,
        }
    }
}
