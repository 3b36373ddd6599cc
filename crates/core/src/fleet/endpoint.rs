//! One endpoint's state as decisions read it: health, the last load sample, the router's own
//! in-flight accounting, its observed prefill rate, recent placements and index trust. Every
//! update takes `now` in seconds.

use serde::{Deserialize, Serialize};

use super::block_reuse::BlockReuse;
use super::decay::Decaying;
use super::outlier::Outlier;
use super::pinned::{PinnedBlocks, RoomAsked};
use super::recent_use::RecentUse;
use super::trust::Trust;
use crate::index::{EndpointId, OffloadSpec};
use crate::keys::RouterKey;
use crate::schedule::{EndpointLoad, Role};
use crate::tiers::TierRates;

/// Weight of one sample in the prefill rate's exponentially weighted mean (the last ten
/// samples carry two thirds of it). A prefill that could not be sampled ages the estimate by
/// the same step.
pub const PREFILL_RATE_SAMPLE_WEIGHT: f64 = 0.1;

/// Samples of its own rate that the pooled rate counts as, for an endpoint's prefill rate: its
/// first sample weighs as much as the pool, its ninth nine tenths.
const PREFILL_RATE_PRIOR_SAMPLES: f64 = 1.0;

/// Fewest uncached tokens whose time to first token says something about the prefill rate.
const MIN_RATE_SAMPLE_TOKENS: u64 = 256;

/// Where the router's own accounting of an endpoint stood when a scrape of its load was sent:
/// how many of the requests it counts there had left each stage by then. Given back with the
/// scrape's sample, the difference says which requests the engine may still have counted that
/// the router no longer does (see [`super::Fleet::observe_scraped_load`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LoadMark {
    /// When it was taken, seconds.
    pub(super) at: f64,
    /// Requests that had left their prefill (a first token, or an end without one).
    pub(super) prefills_ended: u64,
    /// Requests that had ended.
    pub(super) ended: u64,
    /// Of those, the ones past their first token.
    pub(super) decodes_ended: u64,
}

impl LoadMark {
    /// The mark of an endpoint the fleet does not know, taken at `now` (a sample given back
    /// with it is not kept).
    pub(super) fn unknown(now: f64) -> Self {
        Self {
            at: now,
            prefills_ended: 0,
            ended: 0,
            decodes_ended: 0,
        }
    }
}

/// A prefill-rate sample an endpoint took at a request's first token, kept with the request
/// until its end, when the engine says how much of the prompt it found cached: a prefix the
/// router did not know was cached makes a first token come many times faster than the
/// prefill it predicted (and one it predicted and the engine had lost, slower).
#[derive(Clone, Copy, Debug)]
pub(super) struct PrefillSample {
    /// The endpoint's samples taken before it.
    index: u64,
    /// Its weight in the mean when taken (1 for the first, which set it).
    weight: f64,
    /// The tokens it assumed computed, and the seconds they took.
    tokens: u64,
    seconds: f64,
    /// The mean before it (0 before the first).
    before: f64,
}

/// A pooled prefill rate, tokens/s, built one endpoint at a time (so that one pass over the
/// fleet can pool several sets of endpoints): the endpoints' observed rates, each weighted by
/// [`EndpointState::prefill_rate_weight`] (their plain mean when none weighs anything; `None`
/// when none is observed).
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct RatePool {
    weighted: f64,
    weights: f64,
    sum: f64,
    count: usize,
}

impl RatePool {
    /// Adds `e`'s observed rate, if it has one.
    pub(super) fn add(&mut self, e: &EndpointState) {
        let Some(rate) = e.observed_prefill_rate() else {
            return;
        };
        let w = e.prefill_rate_weight();
        self.weighted += w * rate;
        self.weights += w;
        self.sum += rate;
        self.count += 1;
    }

    /// The pooled rate (`None` when no endpoint added had one).
    pub(super) fn rate(&self) -> Option<f64> {
        if self.count == 0 {
            None
        } else if self.weights > 1e-6 {
            Some(self.weighted / self.weights)
        } else {
            Some(self.sum / self.count as f64)
        }
    }
}

/// What the router is told about an endpoint when it joins the fleet.
#[derive(Clone, Debug, PartialEq)]
pub struct EndpointSpec {
    /// Name for logs, metrics and explanations.
    pub name: String,
    /// Models (and adapters) it serves.
    pub models: Vec<String>,
    /// Its role.
    pub role: Role,
    /// Whether KV events are configured for it.
    pub has_events: bool,
    /// Tokens per block of the model it serves.
    pub block_size: usize,
    /// How its offloading connector's events are read: the chunk size of its offloaded
    /// blocks, and the fleet-wide shared tier it mounts (whose blocks every mounting endpoint
    /// can load).
    pub offload: OffloadSpec,
}

impl EndpointSpec {
    /// Whether it serves `model` (a model or one of its adapters, by name).
    pub fn serves(&self, model: &str) -> bool {
        self.models.iter().any(|m| m == model)
    }
}

/// A scraped load sample (vLLM's gauges).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LoadSample {
    /// `vllm:num_requests_waiting`.
    pub waiting: Option<f64>,
    /// `vllm:num_requests_running`.
    pub running: Option<f64>,
    /// `vllm:kv_cache_usage_perc` (0–1).
    pub kv_usage: Option<f64>,
    /// `num_gpu_blocks` of `vllm:cache_config_info`: the cache's capacity in blocks.
    pub num_gpu_blocks: Option<usize>,
}

/// Consecutive health-check results that change an endpoint's health.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HealthPolicy {
    /// Failed checks that eject a healthy endpoint.
    pub unhealthy_after: u32,
    /// Passed checks that bring an ejected endpoint back.
    pub healthy_after: u32,
}

impl Default for HealthPolicy {
    fn default() -> Self {
        Self {
            unhealthy_after: 2,
            healthy_after: 2,
        }
    }
}

/// A change of health a check caused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HealthChange {
    /// Ejected: everything known of its cache was forgotten.
    Ejected,
    /// Back in service.
    Restored,
}

/// Time constant of the recent-placements count, seconds.
pub const PLACEMENT_TAU_S: f64 = 60.0;

/// One endpoint's state.
#[derive(Debug, Clone)]
pub struct EndpointState {
    /// Its id.
    pub id: EndpointId,
    /// What it was registered with.
    pub spec: EndpointSpec,
    pub(super) healthy: bool,
    pub(super) failures: u32,
    pub(super) successes: u32,
    pub(super) sample: Option<(LoadSample, f64)>,
    pub(super) inflight: u32,
    pub(super) inflight_prefills: u32,
    pub(super) inflight_prefill_tokens: u64,
    /// Of the requests it counted in flight, those that have left their prefill so far
    /// (cumulative, as the next two: what a [`LoadMark`] reads).
    pub(super) prefills_ended: u64,
    /// Those that have ended.
    pub(super) ended: u64,
    /// Those that have ended past their first token.
    pub(super) decodes_ended: u64,
    /// Observed prefill rate, tokens/s (EWMA of uncontended prefills; 0 until observed).
    pub(super) prefill_rate: f64,
    /// Prefills it computed beside others since its last rate sample: samples it could not
    /// read, so its own rate has aged by as many EWMA steps.
    pub(super) prefills_unsampled: u32,
    /// Rate samples taken so far.
    prefill_samples: u64,
    /// Its tiers' load rates, learned from requests that loaded from them.
    pub(super) tier_rates: TierRates,
    /// Recent placements.
    pub(super) placements: Decaying,
    pub(super) trust: Trust,
    /// When everything known of its cache was last forgotten.
    pub(super) forgotten_at: Option<f64>,
    /// Its cache's capacity in blocks, once a sample said.
    pub(super) capacity_blocks: Option<usize>,
    /// How much its requests recently reused cached blocks.
    pub(super) reuse: BlockReuse,
    /// The blocks the router's in-flight requests pin there.
    pub(super) pinned: PinnedBlocks,
    /// The blocks its last requests used, newest last (what its cache evicts last).
    pub(super) recent: RecentUse,
    /// Passive outlier detection.
    pub(super) outlier: Outlier,
    /// False once removed from the fleet (its id may be reused by a later endpoint).
    pub(super) present: bool,
}

impl EndpointState {
    /// What a request with `keys` and `prompt_tokens` asks at `now` of this endpoint's cache,
    /// for [`PinnedBlocks::room_wait_s`] or [`PinnedBlocks::admitted_room_wait_s`]; `None`
    /// where the capacity is unknown (it waits for nothing then). `fallback_decode_s`: the
    /// decode time to expect where this endpoint has none yet; `chunk_tokens`: the most prompt
    /// tokens it prefills in one step.
    pub(super) fn room_asked<'a>(
        &self,
        keys: &'a [RouterKey],
        prompt_tokens: usize,
        block_size: usize,
        fallback_decode_s: Option<f64>,
        chunk_tokens: usize,
        now: f64,
    ) -> Option<RoomAsked<'a>> {
        Some(RoomAsked {
            keys,
            prompt_tokens,
            block_size,
            capacity_blocks: self.capacity_blocks?,
            fallback_decode_s,
            chunk_tokens,
            now,
        })
    }

    pub(super) fn new(id: EndpointId, spec: EndpointSpec) -> Self {
        let trust = Trust::new(spec.has_events);
        Self {
            id,
            spec,
            healthy: true,
            failures: 0,
            successes: 0,
            sample: None,
            inflight: 0,
            inflight_prefills: 0,
            inflight_prefill_tokens: 0,
            prefills_ended: 0,
            ended: 0,
            decodes_ended: 0,
            prefill_rate: 0.0,
            prefills_unsampled: 0,
            prefill_samples: 0,
            tier_rates: TierRates::default(),
            placements: Decaying::default(),
            trust,
            forgotten_at: None,
            capacity_blocks: None,
            reuse: BlockReuse::default(),
            pinned: PinnedBlocks::default(),
            recent: RecentUse::default(),
            outlier: Outlier::default(),
            present: true,
        }
    }

    /// Its tiers' load rates as learned so far.
    pub fn tier_rates(&self) -> &TierRates {
        &self.tier_rates
    }

    /// Whether it is part of the fleet (false once removed: never planned, never restored).
    pub fn present(&self) -> bool {
        self.present
    }

    /// When everything known of its cache was last forgotten (restart, ejection), if ever.
    pub fn forgotten_at(&self) -> Option<f64> {
        self.forgotten_at
    }

    /// Passing health checks.
    pub fn healthy(&self) -> bool {
        self.healthy
    }

    /// Whether failed requests have it ejected at `now`.
    pub fn ejected(&self, now: f64) -> bool {
        self.outlier.ejected(now)
    }

    /// Requests in flight through the router.
    pub fn inflight(&self) -> u32 {
        self.inflight
    }

    /// Observed prefill rate in tokens/s, or `None` until observed.
    pub fn observed_prefill_rate(&self) -> Option<f64> {
        (self.prefill_rate > 0.0).then_some(self.prefill_rate)
    }

    /// How far its own rate counts against the pool's, 0–1: its credibility,
    /// `n / (n + PREFILL_RATE_PRIOR_SAMPLES)` for the `n` samples it has taken, aged by the EWMA's
    /// weight for the samples it has missed since, `(1 − PREFILL_RATE_SAMPLE_WEIGHT)^missed` (0
    /// until observed).
    pub fn prefill_rate_weight(&self) -> f64 {
        if self.prefill_rate > 0.0 {
            let samples = self.prefill_samples as f64;
            let credibility = samples / (samples + PREFILL_RATE_PRIOR_SAMPLES);
            credibility
                * (1.0 - PREFILL_RATE_SAMPLE_WEIGHT).powi(self.prefills_unsampled.min(1_000) as i32)
        } else {
            0.0
        }
    }

    /// Its prefill rate for costing, tokens/s: its own observed rate shrunk toward `pooled`
    /// (the pooled rate of the endpoints serving the request's model) by
    /// [`EndpointState::prefill_rate_weight`]. A first sample is not yet its rate: one prefill
    /// that met a cold engine or a burst of other work would otherwise price every later one
    /// there, and a turn whose history is cached there would be sent away to compute it all
    /// elsewhere. Each prefill it computed beside others is a sample it could not read; the
    /// EWMA takes the pooled rate in its place. With fresh samples its own rate stands (a
    /// mixed fleet tells its engines apart); under deep queues, where no endpoint's own rate
    /// can be read, a rate frozen by chance fades into the pool.
    pub fn prefill_rate_toward(&self, pooled: f64) -> f64 {
        let own = self.prefill_rate_weight();
        own * self.prefill_rate + (1.0 - own) * pooled
    }

    /// Placements decayed to `now`.
    pub fn recent_placements(&self, now: f64) -> f64 {
        self.placements.at(now, PLACEMENT_TAU_S)
    }

    /// One of the requests it counts in flight left its prefill: its first token came, or it
    /// ended without one. `uncached_tokens`: what it was to compute.
    pub(super) fn prefill_ended(&mut self, uncached_tokens: u64) {
        self.inflight_prefills = self.inflight_prefills.saturating_sub(1);
        self.inflight_prefill_tokens = self.inflight_prefill_tokens.saturating_sub(uncached_tokens);
        self.prefills_ended += 1;
    }

    /// One of the requests it counts in flight ended, `decoding` (past its first token) or not
    /// (its prefill left already, by [`EndpointState::prefill_ended`]).
    pub(super) fn request_ended(&mut self, decoding: bool) {
        self.inflight = self.inflight.saturating_sub(1);
        self.ended += 1;
        if decoding {
            self.decodes_ended += 1;
        }
    }

    /// Where its accounting stands at `now`, for a scrape sent then.
    pub(super) fn load_mark(&self, now: f64) -> LoadMark {
        LoadMark {
            at: now,
            prefills_ended: self.prefills_ended,
            ended: self.ended,
            decodes_ended: self.decodes_ended,
        }
    }

    /// Keeps `sample`, scraped from a request sent at `since`, as the load of requests that
    /// are not the router's own (see [`EndpointState::counts_with`]).
    ///
    /// The engine rendered its counts at some moment between the question and the answer, so
    /// the router's requests it may hold are those in flight now and those that ended
    /// meanwhile: all are taken as counted, so that a request just ended is never read as
    /// another client's (which would send the next turn of its conversation away from its
    /// cache until the next scrape). The error left is the other way: a request of the
    /// router's the engine did not count when it rendered (sent during the scrape, or earlier
    /// and not yet admitted; ended during the scrape before the engine counted) hides one of
    /// another client's, until the next scrape; it grows with the router's request rate
    /// times the scrape's latency, while the router's own requests are always counted fresh.
    /// Other clients' requests are the engine's total less those; of them, the waiting ones
    /// are its waiting count less the router's requests that were before their first token
    /// during the scrape (a request being prefilled is counted running by vLLM, so the split
    /// is uncertain, never the total). An engine that reports only one of the two counts has
    /// it less the router's requests in that state: its running count, then, keeps the
    /// router's requests being prefilled as other clients' (more load, never less).
    /// A count or fraction that is not a finite number of 0 or more (an engine's `+Inf` or
    /// `NaN`) is taken as not reported: one would make every cost at the endpoint NaN.
    pub(super) fn observe_sample(&mut self, sample: LoadSample, since: LoadMark) {
        let usable = |value: Option<f64>| value.filter(|v| v.is_finite() && *v >= 0.0);
        let less = |count: f64, own: u64| (count - own as f64).max(0.0);
        let ended = self.ended.saturating_sub(since.ended);
        let before_first_token = u64::from(self.inflight_prefills)
            + self.prefills_ended.saturating_sub(since.prefills_ended);
        let decoding = u64::from(self.inflight.saturating_sub(self.inflight_prefills))
            + self.decodes_ended.saturating_sub(since.decodes_ended);
        let (waiting, running) = match (usable(sample.waiting), usable(sample.running)) {
            (Some(waiting), Some(running)) => {
                // Two finite counts may still sum past the largest f64.
                let total = (waiting + running).min(f64::MAX);
                let others = less(total, u64::from(self.inflight) + ended);
                let waiting = less(waiting, before_first_token).min(others);
                (Some(waiting), Some(others - waiting))
            }
            (waiting, running) => (
                waiting.map(|w| less(w, before_first_token)),
                running.map(|r| less(r, decoding)),
            ),
        };
        let sample = LoadSample {
            kv_usage: usable(sample.kv_usage),
            waiting,
            running,
            ..sample
        };
        self.sample = Some((sample, since.at));
    }

    /// The waiting and running counts of its load with `others` (another source's requests,
    /// as [`EndpointState::observe_sample`] keeps them) added to the router's own, as they are
    /// now. The router's own requests are counted as they change (dispatch, first token, end),
    /// so only the part it cannot see ages with the scrape: a queue that drained since the
    /// last scrape is not taken as still there, and requests sent since are not missed.
    pub(super) fn counts_with(&self, others: Option<&LoadSample>) -> EndpointLoad {
        let sample = others.copied().unwrap_or_default();
        let own_decoding = self.inflight.saturating_sub(self.inflight_prefills);
        EndpointLoad {
            waiting: sample
                .waiting
                .map(|w| w + f64::from(self.inflight_prefills)),
            running: sample.running.map(|r| r + f64::from(own_decoding)),
            kv_usage: sample.kv_usage,
            inflight: self.inflight,
            inflight_prefills: self.inflight_prefills,
            ..EndpointLoad::default()
        }
    }

    /// Load for scoring at `now`: the router's own counters, plus what the last sample, if
    /// younger than `max_age_s`, said of other requests.
    pub fn load(&self, now: f64, max_age_s: f64) -> EndpointLoad {
        let sample = self
            .sample
            .as_ref()
            .filter(|(_, at)| now - at <= max_age_s)
            .map(|(s, _)| s);
        EndpointLoad {
            inflight_prefill_tokens: self.inflight_prefill_tokens,
            recent_uncached_tokens: self
                .reuse
                .stored_per_request()
                .map(|blocks| blocks * self.spec.block_size as f64),
            recent_placements: self.recent_placements(now),
            ..self.counts_with(sample)
        }
    }

    /// Its requests decoding and queued as [`EndpointState::load`] counts them
    /// ([`EndpointLoad::decoding`] + [`EndpointLoad::queue`]), with its load sample if
    /// `with_sample` (and it has one), else the router's own counts only: never more than with
    /// the sample.
    pub(super) fn busy(&self, with_sample: bool) -> f64 {
        let sample = self.sample.as_ref().filter(|_| with_sample).map(|(s, _)| s);
        let load = self.counts_with(sample);
        load.decoding() + load.queue()
    }

    pub(super) fn note_placement(&mut self, now: f64) {
        self.placements.add(now, PLACEMENT_TAU_S);
    }

    /// Observes a prefill: `tokens` uncached tokens took `seconds` to the first token;
    /// `alone`: it was the only prefill in flight there (a rate sample). A prefill computed
    /// beside others says nothing of the rate and ages the estimate by one sample. Returns the
    /// sample taken, for [`EndpointState::correct_prefill`] once the request ends.
    pub(super) fn note_prefill(
        &mut self,
        tokens: u64,
        seconds: f64,
        alone: bool,
    ) -> Option<PrefillSample> {
        if tokens < MIN_RATE_SAMPLE_TOKENS || seconds <= 0.0 {
            return None; // too small to say anything about the prefill rate
        }
        if !alone {
            self.prefills_unsampled = self.prefills_unsampled.saturating_add(1);
            return None;
        }
        let before = self.prefill_rate;
        let weight = if before == 0.0 {
            1.0
        } else {
            PREFILL_RATE_SAMPLE_WEIGHT
        };
        self.prefill_rate = (1.0 - weight) * before + weight * (tokens as f64 / seconds);
        self.prefills_unsampled = 0;
        let index = self.prefill_samples;
        self.prefill_samples += 1;
        Some(PrefillSample {
            index,
            weight,
            tokens,
            seconds,
            before,
        })
    }

    /// The request whose first token took `sample` computed `computed` tokens, by the engine's
    /// count: the sample is replaced by what it should have read (or, too few tokens to read
    /// anything, by the mean it found), in the mean as it is now. The mean is linear in its
    /// samples, so replacing one taken `k` samples ago moves it by its weight × (1 − w)^k ×
    /// the difference, whatever came since.
    pub(super) fn correct_prefill(&mut self, sample: PrefillSample, computed: u64) {
        if computed == sample.tokens || self.prefill_rate <= 0.0 {
            return;
        }
        let read = sample.tokens as f64 / sample.seconds;
        let should_have_read = if computed >= MIN_RATE_SAMPLE_TOKENS {
            computed as f64 / sample.seconds
        } else if sample.before > 0.0 {
            sample.before
        } else {
            // The first sample read nothing: there is no mean to fall back on.
            return;
        };
        let since = self.prefill_samples.saturating_sub(sample.index + 1);
        let kept = (1.0 - PREFILL_RATE_SAMPLE_WEIGHT).powi(since.min(1_000) as i32);
        let corrected = self.prefill_rate + sample.weight * kept * (should_have_read - read);
        if corrected > 0.0 && corrected.is_finite() {
            self.prefill_rate = corrected;
        }
    }

    /// Applies one health-check result.
    pub(super) fn health_check(&mut self, ok: bool, policy: &HealthPolicy) -> Option<HealthChange> {
        if ok {
            self.failures = 0;
            self.successes = self.successes.saturating_add(1);
            if !self.healthy && self.successes >= policy.healthy_after {
                self.healthy = true;
                return Some(HealthChange::Restored);
            }
        } else {
            self.successes = 0;
            self.failures = self.failures.saturating_add(1);
            if self.healthy && self.failures >= policy.unhealthy_after.max(1) {
                self.healthy = false;
                return Some(HealthChange::Ejected);
            }
        }
        None
    }
}
