//! A request's life on the fleet: dispatched, its first token, finished, and its upstream
//! result and retries.

use std::cell::OnceCell;

use super::pinned::{RoomWaitTime, prefill_done_at};
use super::{
    Dispatch, Ejection, EndpointState, Fleet, RequestFeatures, TtftCheck, UpstreamOutcome,
};
use crate::index::EndpointId;
use crate::tiers::LoadTier;

impl Fleet {
    /// Records that `request` was sent to `endpoint` at `now` (call once the connection to the
    /// engine is made): routing history, predicted overlay, session, placement and in-flight
    /// load. `predicted_cached` is its plan's (empty for a request sent unplanned).
    pub fn dispatched(
        &mut self,
        predicted_cached: &[usize],
        request: &RequestFeatures<'_>,
        endpoint: EndpointId,
        now: f64,
    ) -> Dispatch {
        let slot = endpoint.0 as usize;
        let model = self.model_priors.slot(request.model);
        let predicted = predicted_cached.get(slot).copied().unwrap_or(0);
        // Read before this request enters the predicted overlay; walked at most once, by
        // whichever of the two reads below needs it first.
        let overlay = OnceCell::new();
        let (tier_tokens, tier_uncertain) =
            self.dispatch_tier_tokens(predicted, request, endpoint, now, &overlay);
        let shared_load = self.endpoints.get(slot).and_then(|e| {
            self.shared_backlog.dispatched(
                e.shared_mount(),
                tier_tokens[LoadTier::Shared as usize],
                e.tier_rates.rate(LoadTier::Shared, &self.profile.tiers),
                now,
            )
        });
        // Queued prefill work counts what the engine will compute when it admits the request:
        // the queue ahead may evict part of what is cached now.
        let uncached = request
            .prompt_tokens
            .saturating_sub(self.expected_cached(predicted, request, endpoint, now, &overlay))
            as u64;
        // A placement: a request this endpoint does not hold much more of than the others or
        // than what conversations share (a new conversation, an uncached prompt). Placements
        // are what balancing evens out.
        let bs = request.block_size.max(1);
        // Measured and recorded in one walk (what was shared before this request).
        let shared_blocks = self.shared.record_shared(request.keys);
        // What its plan said its shared prefix's requests pay, settled by whether it went to a
        // holder.
        if let Some(prefix) = shared_blocks
            .checked_sub(1)
            .and_then(|last| request.keys.get(last))
            .filter(|_| self.copies_by_rent)
        {
            self.copy_rents.dispatched(prefix.0, predicted, now);
        }
        let shared = shared_blocks * bs;
        let best_other = predicted_cached
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != slot)
            .map(|(_, c)| *c)
            .max()
            .unwrap_or(0);
        let advantage = predicted.saturating_sub(best_other.max(shared));
        let placement = advantage * 4 < request.prompt_tokens.max(1);
        self.history.record(endpoint, request.keys, now);
        self.predicted.record(endpoint, request.keys, now);
        if let Some(session) = request.session {
            self.sessions.set(session, endpoint);
        }
        self.retry_budget.request(&self.config.retry, now);
        let expects_event = request.prompt_tokens / bs > predicted / bs;
        let mut rate_sample = false;
        let mut quiet = false;
        if let Some(e) = self.endpoints.get_mut(slot) {
            if placement {
                e.note_placement(now);
            }
            let blocks = (request.prompt_tokens / bs) as f64;
            let hits = ((predicted / bs) as f64).min(blocks);
            e.reuse.note(hits, blocks - hits, now);
            // Where in its eviction order it finds them: how much room a copy may take there.
            if let (true, Some(capacity)) = (self.copies_by_rent, e.capacity_blocks) {
                let by_depth =
                    e.recent
                        .hit_depths(&e.pinned, request.keys, hits as usize, capacity);
                e.reuse.note_depths(&by_depth);
            }
            self.model_priors
                .note_reuse(model, hits, blocks - hits, now);
            rate_sample = e.inflight_prefills == 0;
            quiet = e.inflight == 0;
            if tier_uncertain {
                e.tier_rates.uncertain_requests = e.tier_rates.uncertain_requests.saturating_add(1);
            }
            // The earliest its prefill can end: once the prefill queued ahead of it is done,
            // or the admitted requests' ends make room for its blocks, whichever is later,
            // then its own. Without the room wait, requests queued behind a full cache were
            // each expected to end a decode time after their own prefills, as if all ran at
            // once, and the waits behind them read short (traced: a closed loop of 8 requests
            // per engine whose caches hold two, predicted 1.9 s, measured 3.8 s).
            let rate = match e.prefill_rate {
                r if r > 0.0 => r,
                _ => self.config.default_prefill_tokens_per_s.max(1.0),
            };
            let room_wait = e
                .room_asked(
                    request.keys,
                    request.prompt_tokens,
                    bs,
                    self.model_priors.decode_s(model),
                    self.config.prefill_chunk_tokens,
                    now,
                )
                .map_or_else(RoomWaitTime::default, |asked| {
                    e.pinned.admitted_room_wait_s(&asked)
                });
            let queued_s = e.inflight_prefill_tokens as f64 / rate;
            let prefill_s = uncached as f64 / rate;
            let prefill_end = now
                + prefill_done_at(
                    queued_s,
                    room_wait.wait_s,
                    prefill_s,
                    room_wait.prefilled_share,
                );
            e.pinned.pin(
                self.next_pin,
                request.keys.clone(),
                request.prompt_tokens,
                bs,
                prefill_end,
                prefill_s,
            );
            e.inflight += 1;
            e.inflight_prefills += 1;
            e.inflight_prefill_tokens = e.inflight_prefill_tokens.saturating_add(uncached);
            e.trust.dispatched(expects_event, now);
        }
        let index_trusted = self
            .endpoints
            .get(slot)
            .is_some_and(|e| e.trust.verdict(&self.config.trust, now).is_ok());
        let pin = self.next_pin;
        self.next_pin += 1;
        self.load_changed(endpoint);
        Dispatch {
            endpoint,
            uncached_tokens: uncached,
            predicted_cached: predicted,
            prompt_tokens: request.prompt_tokens,
            dispatched_at: now,
            placement,
            tier_tokens,
            tier_uncertain,
            index_trusted,
            tier_seconds: None,
            prefill_sample: None,
            fit_sample: None,
            shared_load,
            keys: request.keys.clone(),
            pin,
            model,
            prefill_done: false,
            rate_sample,
            quiet,
            output_tokens: None,
            predicted_ttft_s: None,
        }
    }

    /// The blocks of `request`'s prompt the predicted overlay says were just sent to `endpoint`
    /// (not expired at `now`).
    pub(super) fn overlay_blocks(
        &self,
        request: &RequestFeatures<'_>,
        endpoint: EndpointId,
        now: f64,
    ) -> u32 {
        self.predicted
            .longest_prefixes(request.keys, now)
            .iter()
            .find(|(id, _)| *id == endpoint)
            .map_or(0, |(_, blocks)| *blocks)
    }

    /// Of the `predicted` cached tokens of `request` on `endpoint`, those still cached when the
    /// engine admits it: the queue ahead may evict the rest first (see
    /// [`cost::survival`](crate::schedule::cost::survival)), except the blocks of requests just
    /// sent there, which those use first.
    fn expected_cached(
        &self,
        predicted: usize,
        request: &RequestFeatures<'_>,
        endpoint: EndpointId,
        now: f64,
        overlay: &OnceCell<u32>,
    ) -> usize {
        let Some(e) = self.endpoint(endpoint) else {
            return predicted;
        };
        let (Some(capacity), Some(index)) = (e.capacity_blocks, self.index_of(endpoint)) else {
            return predicted;
        };
        let bs = request.block_size.max(1);
        let held = index.gpu_blocks(endpoint);
        let free = capacity as f64 - held as f64 - (e.inflight_prefill_tokens / bs as u64) as f64;
        let survival = crate::schedule::cost::survival_of(free, capacity as f64);
        if survival >= 1.0 {
            return predicted;
        }
        let overlay_blocks = *overlay.get_or_init(|| self.overlay_blocks(request, endpoint, now));
        let in_use = (overlay_blocks as usize * bs).min(predicted);
        in_use + ((predicted - in_use) as f64 * survival) as usize
    }

    /// A request another router replica sent to `endpoint` at `now` (`placement`: it counted as
    /// a placement there, see [`Dispatch::placement`]): recorded as if sent from here in the
    /// routing history, the predicted overlay, the shared prefixes, the session and the
    /// endpoint's recent placements, so that replicas do not race same-prefix requests or new
    /// conversations onto different (or the same) endpoints. Its in-flight load is counted
    /// apart, until its first token: [`Fleet::peer_prefill_started`].
    pub fn peer_dispatched(
        &mut self,
        request: &RequestFeatures<'_>,
        endpoint: EndpointId,
        placement: bool,
        now: f64,
    ) {
        let Some(e) = self
            .endpoints
            .get_mut(endpoint.0 as usize)
            .filter(|e| e.present)
        else {
            return;
        };
        if placement {
            e.note_placement(now);
        }
        // No first token comes from a peer's request to cut its prediction short: it lasts as
        // long as twice the whole prompt's prefill takes there, plus the grace its events need.
        // Longer, it steers requests to blocks the engine may have evicted since.
        let rate = e
            .observed_prefill_rate()
            .unwrap_or(self.config.default_prefill_tokens_per_s);
        let lifetime = self.config.prediction_grace_s + 2.0 * request.prompt_tokens as f64 / rate;
        self.history.record(endpoint, request.keys, now);
        self.predicted.record(endpoint, request.keys, now);
        self.predicted.shorten(
            endpoint,
            request.keys,
            now + lifetime.min(self.config.predicted_ttl_s),
        );
        self.shared.record(request.keys);
        if let Some(session) = request.session {
            self.sessions.set(session, endpoint);
        }
    }

    fn end_prefill(&mut self, dispatch: &mut Dispatch) -> Option<&mut EndpointState> {
        if dispatch.prefill_done {
            return None;
        }
        dispatch.prefill_done = true;
        if let Some(load) = dispatch.shared_load.take() {
            self.shared_backlog.finished(load);
        }
        let e = self.endpoints.get_mut(dispatch.endpoint.0 as usize)?;
        e.prefill_ended(dispatch.uncached_tokens);
        // Its callers set the endpoint's place in the load order once they are done with it.
        Some(e)
    }

    /// The request's first token arrived at `now` (`ok`: a successful response): its prefill
    /// is done, so from now on the engine's events, not the prediction, say what it holds.
    /// Returns its time to first token beside its plan's prediction, for a successful request
    /// dispatched with one, the first time it is told.
    pub fn first_token(
        &mut self,
        dispatch: &mut Dispatch,
        ok: bool,
        now: f64,
    ) -> Option<TtftCheck> {
        let check = dispatch
            .predicted_ttft_s
            .filter(|p| ok && !dispatch.prefill_done && p.is_finite())
            .map(|predicted_s| TtftCheck {
                predicted_s,
                measured_s: now - dispatch.dispatched_at,
            })
            .filter(|c| c.measured_s.is_finite());
        self.note_first_token(dispatch, ok, now);
        check
    }

    fn note_first_token(&mut self, dispatch: &mut Dispatch, ok: bool, now: f64) {
        let (tokens, seconds, sample) = (
            dispatch.uncached_tokens,
            now - dispatch.dispatched_at,
            dispatch.rate_sample && ok,
        );
        let tiered = dispatch.tier_tokens.iter().any(|&t| t > 0);
        // The shared-tier tokens queued ahead of its load were waited for, not loaded; its
        // tier loads, at the rates the cost charges them apart from its prefill, are left out
        // of its prefill-rate sample, and so is that wait.
        let (waited_s, loads_s) = match self.endpoint(dispatch.endpoint) {
            Some(e) => {
                let tiers = &self.profile.tiers;
                let waited_s = dispatch.shared_load.map_or(0.0, |load| {
                    load.ahead_tokens() / e.tier_rates.rate(LoadTier::Shared, tiers)
                });
                let loads_s: f64 = e
                    .tier_rates
                    .load_seconds(dispatch.tier_tokens, tiers)
                    .iter()
                    .sum();
                (waited_s, loads_s + waited_s)
            }
            None => (0.0, 0.0),
        };
        let Some(e) = self.end_prefill(dispatch) else {
            return;
        };
        e.pinned.first_token(dispatch.pin, now);
        // A tier lesson needs a request that ran alone (under load the decodes batched with it
        // inflate what is left to its loads, and the tier is learned far too slow: measured,
        // docs/benchmarks.md) on a certain tier prediction, and the endpoint's own line of what
        // a request takes without loads (its fixed part and per-token slope, fitted to its
        // untiered requests that ran alone): not the prefill rate, an average that spreads the
        // fixed part over typical prompts and would leave most of it to a tier lesson.
        if sample
            && dispatch.quiet
            && tiered
            && !dispatch.tier_uncertain
            && let Some((fixed, per_token)) = e.tier_rates.baseline.line()
        {
            // The loads are learned once the engine says how much it found cached.
            dispatch.tier_seconds = Some(seconds - fixed - tokens as f64 * per_token - waited_s);
        }
        if ok {
            // Every prefill teaches the prefill rate, a tiered one net of its loads; one whose
            // loads took all its time says nothing of the rate.
            let net_s = seconds - loads_s;
            let (seconds, sample) = if net_s > 0.0 {
                (net_s, sample)
            } else {
                (seconds, false)
            };
            dispatch.prefill_sample = e.note_prefill(tokens, seconds, sample);
            if sample && dispatch.quiet && !tiered {
                dispatch.fit_sample = e.tier_rates.baseline.observe(tokens as f64, seconds);
            }
        }
        // Its own prefill rate is part of its key in the load order.
        self.load_changed(dispatch.endpoint);
        if !dispatch.keys.is_empty() {
            let expiry = now + self.config.prediction_grace_s;
            self.predicted
                .shorten(dispatch.endpoint, &dispatch.keys, expiry);
        }
    }

    /// The request ended at `now` (completed, failed, or abandoned by its client);
    /// `reported_cached`: the engine's `cached_tokens`, if it said.
    pub fn finished(&mut self, mut dispatch: Dispatch, reported_cached: Option<usize>, now: f64) {
        let decoding = dispatch.prefill_done;
        self.end_prefill(&mut dispatch);
        if let Some(e) = self.endpoints.get_mut(dispatch.endpoint.0 as usize) {
            e.request_ended(decoding);
            if let Some(ended) = e.pinned.unpin(dispatch.pin, now, dispatch.output_tokens) {
                if let Some(decode_s) = ended.decode_s {
                    self.model_priors.note_decode(dispatch.model, decode_s);
                }
                // Its blocks are in the cache only if it was prefilled (it had a first token)
                // in the engine's present life (sent after what was known of it was forgotten).
                let this_life = e.forgotten_at.is_none_or(|at| dispatch.dispatched_at >= at);
                if ended.decode_s.is_some() && this_life {
                    e.recent.ended(ended.keys, now);
                }
            }
            if let Some(reported) = reported_cached {
                // What it computed by the engine's count: the prompt less what it found cached.
                let computed = dispatch.prompt_tokens.saturating_sub(reported) as u64;
                if let Some(sample) = dispatch.prefill_sample {
                    e.correct_prefill(sample, computed);
                }
                if let Some(sample) = dispatch.fit_sample {
                    e.tier_rates.baseline.correct(sample, computed as f64);
                }
                if dispatch.index_trusted {
                    e.trust.prediction(
                        dispatch.predicted_cached,
                        reported,
                        dispatch.prompt_tokens,
                        &self.config.trust,
                        now,
                    );
                }
                e.tier_rates.note_outcome(
                    dispatch.tier_tokens,
                    dispatch.predicted_cached,
                    reported,
                );
                if let (Some(seconds), Some((_, per_token))) =
                    (dispatch.tier_seconds, e.tier_rates.baseline.line())
                {
                    // Tier tokens the engine recomputed cost the line's per-token time.
                    let rate = 1.0 / per_token;
                    e.tier_rates.observe_reported(
                        dispatch.tier_tokens,
                        seconds,
                        dispatch.predicted_cached,
                        reported,
                        rate,
                        &self.profile.tiers,
                    );
                }
            }
        }
        self.load_changed(dispatch.endpoint);
    }

    /// How a request sent to `id` went at `now` (a refused connection counts, though nothing
    /// was dispatched): consecutive failures eject the endpoint for a while (its cache is not
    /// forgotten: the engine kept it). At most `outlier.max_ejected_fraction` of the fleet is
    /// ejected at once, and one endpoint always may be.
    pub fn upstream_result(
        &mut self,
        id: EndpointId,
        outcome: UpstreamOutcome,
        now: f64,
    ) -> Option<Ejection> {
        // Counting ejections reads every endpoint: only a failure needs it.
        let may_eject = outcome == UpstreamOutcome::Failure && {
            let ejected = self
                .endpoints
                .iter()
                .filter(|e| e.outlier.ejected(now))
                .count();
            let cap =
                (self.config.outlier.max_ejected_fraction * self.endpoints.len() as f64).floor();
            ejected == 0 || (ejected as f64) < cap
        };
        let policy = &self.config.outlier;
        let outlier = &mut self.endpoints.get_mut(id.0 as usize)?.outlier;
        let ejection = outlier.result(outcome, policy, may_eject, now);
        if ejection.is_some() {
            // Out of its model's load order until the ejection ends.
            let until = outlier.ejected_until(now);
            self.load_order.ejected_until(id, until);
            self.load_changed(id);
        }
        ejection
    }

    /// Takes one retry from the fleet's budget at `now`, or says it is spent (see
    /// [`RetryPolicy`](super::RetryPolicy)).
    pub fn try_retry(&mut self, now: f64) -> bool {
        self.retry_budget.try_retry(&self.config.retry, now)
    }
}
