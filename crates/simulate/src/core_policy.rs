//! [`RoutingPolicy`] over today's kvroute-core pieces, used exactly as the live router's
//! service uses them: a [`KvIndex`] fed by KV events, a [`RoutingHistory`] of dispatches and its
//! short-lived predicted overlay, per-endpoint load (scrapes plus in-flight accounting, observed
//! prefill rate, recent placements) and [`schedule`] under a named [`Profile`].
//!
//! This adapter mirrors `kvroute-router`'s `service.rs`, `fleet.rs` and `accounting.rs` with the
//! router's default settings; it is the one file to replace when kvroute-core's fleet-state API
//! takes over those decisions.

use std::collections::HashMap;
use std::sync::Arc;

use kvroute_core::event::KvEvent;
use kvroute_core::history::RoutingHistory;
use kvroute_core::index::{EndpointId, IndexConfig, KvIndex, PrefixMatch};
use kvroute_core::keys::RouterKey;
use kvroute_core::schedule::{
    CacheView, Candidate, EndpointLoad, Profile, ProfileName, RequestInfo, Role, schedule,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::SimulateError;
use crate::policy::{RoutingPolicy, SimRequest};

/// The router's defaults (`kvroute-router`'s `CacheConfig` and `SchedulerConfig`).
const HISTORY_TTL_S: f64 = 300.0;
const HISTORY_CAPACITY: usize = 4 << 20;
const PREDICTED_TTL_S: f64 = 10.0;
const PREDICTED_CAPACITY: usize = 1 << 20;
const INDEX_CAPACITY: usize = 8 << 20;
const PREFILL_TOKENS_PER_S: f64 = 20_000.0;
const MAX_PREDICTION_ERROR: f64 = 0.2;
/// How long a prediction outlives its request's first byte (the router's accounting).
const PREDICTION_GRACE_S: f64 = 0.25;
/// Time constant of the recent-placements count (the router's endpoint state).
const RECENT_TAU_S: f64 = 60.0;
/// How often expired history entries are dropped (the router's housekeeping).
const HOUSEKEEPING_S: f64 = 5.0;

/// One endpoint as the router tracks it.
#[derive(Debug, Default)]
struct EndpointState {
    /// Last scrape: waiting, running, KV usage, and when.
    scraped: Option<(f64, f64, f64, f64)>,
    inflight: u32,
    inflight_prefills: u32,
    inflight_prefill_tokens: u64,
    /// Observed prefill tokens/s (EWMA; 0 until observed).
    prefill_rate: f64,
    /// Recent placements (decaying count) and when it was updated.
    recent: (f64, f64),
    /// Mean |predicted − reported| cached tokens over prompt tokens (EWMA) and its samples.
    error_ewma: f64,
    samples: u32,
}

impl EndpointState {
    fn recent_requests(&self, now: f64) -> f64 {
        self.recent.0 * (-(now - self.recent.1) / RECENT_TAU_S).exp()
    }

    fn trusted(&self) -> bool {
        !(self.samples >= 5 && self.error_ewma > MAX_PREDICTION_ERROR)
    }

    fn load(&self, now: f64, max_age: f64) -> EndpointLoad {
        let fresh = self.scraped.filter(|s| now - s.3 <= max_age);
        EndpointLoad {
            waiting: fresh.map(|s| s.0),
            running: fresh.map(|s| s.1),
            kv_usage: fresh.map(|s| s.2),
            inflight: self.inflight,
            inflight_prefills: self.inflight_prefills,
            inflight_prefill_tokens: self.inflight_prefill_tokens,
            recent_requests: self.recent_requests(now),
        }
    }
}

/// A request between its routing decision and its end.
#[derive(Debug)]
struct Tracked {
    keys: Arc<[RouterKey]>,
    prompt_tokens: usize,
    /// Cached tokens predicted on each endpoint, by index.
    predicted_cached: Vec<usize>,
    /// Set at dispatch: endpoint, uncached tokens counted into its prefill queue, and when
    /// the router received the request.
    dispatch: Option<(usize, u64, f64)>,
    routed_at: f64,
    prefill_done: bool,
}

/// A named policy on kvroute-core's scheduler, with the live router's state and defaults.
pub struct CorePolicy {
    profile: Profile,
    block_size: usize,
    scrape_max_age_s: f64,
    index: KvIndex,
    history: RoutingHistory,
    predicted: RoutingHistory,
    endpoints: Vec<EndpointState>,
    requests: HashMap<u64, Tracked>,
    rng: StdRng,
    round_robin: u64,
    last_housekeeping: f64,
}

impl CorePolicy {
    /// The policy `name` (`round-robin`, `random`, `least-load`, `approximate`, `precise`) for
    /// `endpoints` engines with `block_size`-token blocks, scraped every `scrape_interval_s`.
    pub fn new(
        name: &str,
        endpoints: usize,
        block_size: usize,
        scrape_interval_s: f64,
        seed: u64,
    ) -> Result<Self, SimulateError> {
        let profile = Profile::named(name.parse::<ProfileName>().map_err(SimulateError::Policy)?);
        let mut index = KvIndex::new(IndexConfig {
            block_size,
            capacity: INDEX_CAPACITY,
        })?;
        for i in 0..endpoints {
            index.add_endpoint(EndpointId(i as u32));
        }
        Ok(Self {
            profile,
            block_size,
            scrape_max_age_s: scrape_interval_s * 4.0 + 1.0,
            index,
            history: RoutingHistory::new(HISTORY_TTL_S, HISTORY_CAPACITY),
            predicted: RoutingHistory::new(PREDICTED_TTL_S, PREDICTED_CAPACITY),
            endpoints: (0..endpoints).map(|_| EndpointState::default()).collect(),
            requests: HashMap::new(),
            rng: StdRng::seed_from_u64(seed),
            round_robin: 0,
            last_housekeeping: 0.0,
        })
    }

    /// The router's routing history only counts for policies that score it; the live router
    /// keeps it for the explain API too, which a simulation has no use for.
    fn uses_history(&self) -> bool {
        self.profile.weights.approximate_prefix > 0.0
    }

    /// Drops expired history entries every few seconds, as the router's housekeeping does.
    fn housekeeping(&mut self, now: f64) {
        if now - self.last_housekeeping >= HOUSEKEEPING_S {
            self.last_housekeeping = now;
            self.history.expire(now);
            self.predicted.expire(now);
        }
    }
}

fn blocks_of(list: &[(EndpointId, u32)], id: EndpointId) -> u32 {
    list.iter().find(|(e, _)| *e == id).map_or(0, |(_, n)| *n)
}

impl RoutingPolicy for CorePolicy {
    fn route(&mut self, request: &SimRequest<'_>, now: f64) -> Option<usize> {
        let bs = self.block_size;
        let matches = self.index.lookup(&request.keys);
        self.housekeeping(now);
        let history = if self.uses_history() {
            self.history.longest_prefixes(&request.keys, now)
        } else {
            Vec::new()
        };
        let predicted = self.predicted.longest_prefixes(&request.keys, now);
        // vLLM always recomputes the last prompt token: at most this many blocks are reported.
        let reportable = request.prompt_tokens.saturating_sub(1) / bs;
        let mut candidates = Vec::with_capacity(self.endpoints.len());
        let mut predicted_cached = Vec::with_capacity(self.endpoints.len());
        for (i, e) in self.endpoints.iter().enumerate() {
            let id = EndpointId(i as u32);
            let precise = e.trusted().then(|| {
                matches.get(id).copied().unwrap_or(PrefixMatch {
                    endpoint: id,
                    blocks: 0,
                    gpu_blocks: 0,
                    cpu_blocks: 0,
                    storage_blocks: 0,
                })
            });
            let predicted_blocks = blocks_of(&predicted, id);
            let best = precise.map_or(0, |m| m.blocks).max(predicted_blocks) as usize;
            predicted_cached.push(best.min(reportable) * bs);
            candidates.push(Candidate {
                endpoint: id,
                healthy: true,
                serves_model: true,
                role: Role::Both,
                load: e.load(now, self.scrape_max_age_s),
                cache: CacheView {
                    precise,
                    approximate: blocks_of(&history, id),
                    predicted: predicted_blocks,
                },
                prefill_tokens_per_s: if e.prefill_rate > 0.0 {
                    e.prefill_rate
                } else {
                    PREFILL_TOKENS_PER_S
                },
            });
        }
        let info = RequestInfo {
            prompt_tokens: request.prompt_tokens,
            block_size: bs,
            // `kvroute bench` sends no session header, so the live router sees no session.
            session_endpoint: None,
            role: Role::Both,
        };
        let decision = schedule(
            &self.profile,
            &info,
            &candidates,
            self.rng.random(),
            self.round_robin,
        );
        self.round_robin += 1;
        let chosen = decision.chosen()?;
        self.requests.insert(
            request.id,
            Tracked {
                keys: request.keys.clone(),
                prompt_tokens: request.prompt_tokens,
                predicted_cached,
                dispatch: None,
                routed_at: now,
                prefill_done: false,
            },
        );
        Some(chosen.0 as usize)
    }

    fn dispatched(&mut self, request_id: u64, endpoint: usize, now: f64) {
        let uses_history = self.uses_history();
        let Some(t) = self.requests.get_mut(&request_id) else {
            return;
        };
        let predicted = t.predicted_cached[endpoint];
        let uncached = t.prompt_tokens.saturating_sub(predicted) as u64;
        // A placement: sent there for a reason other than what it holds (the router's rule).
        let best_other = t
            .predicted_cached
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != endpoint)
            .map(|(_, c)| *c)
            .max()
            .unwrap_or(0);
        let placement = predicted.saturating_sub(best_other) * 4 < t.prompt_tokens.max(1);
        let id = EndpointId(endpoint as u32);
        if uses_history {
            self.history.record(id, &t.keys, now);
        }
        self.predicted.record(id, &t.keys, now);
        let e = &mut self.endpoints[endpoint];
        if placement {
            e.recent = (e.recent_requests(now) + 1.0, now);
        }
        e.inflight += 1;
        e.inflight_prefills += 1;
        e.inflight_prefill_tokens += uncached;
        t.dispatch = Some((endpoint, uncached, t.routed_at));
    }

    fn kv_events(&mut self, endpoint: usize, events: &[KvEvent], _now: f64) {
        self.index.apply(EndpointId(endpoint as u32), events);
    }

    fn load_sample(
        &mut self,
        endpoint: usize,
        waiting: f64,
        running: f64,
        kv_usage: f64,
        now: f64,
    ) {
        self.endpoints[endpoint].scraped = Some((waiting, running, kv_usage, now));
    }

    fn first_token(&mut self, request_id: u64, now: f64) {
        let Some(t) = self.requests.get_mut(&request_id) else {
            return;
        };
        let Some((endpoint, uncached, started)) = t.dispatch else {
            return;
        };
        if std::mem::replace(&mut t.prefill_done, true) {
            return;
        }
        let e = &mut self.endpoints[endpoint];
        e.inflight_prefills -= 1;
        e.inflight_prefill_tokens -= uncached;
        let seconds = now - started;
        if uncached >= 256 && seconds > 0.0 {
            let rate = uncached as f64 / seconds;
            e.prefill_rate = if e.prefill_rate == 0.0 {
                rate
            } else {
                0.9 * e.prefill_rate + 0.1 * rate
            };
        }
        let id = EndpointId(endpoint as u32);
        self.predicted
            .shorten(id, &t.keys, now + PREDICTION_GRACE_S);
    }

    fn finished(&mut self, request_id: u64, cached_tokens: Option<usize>, _now: f64) {
        let Some(t) = self.requests.remove(&request_id) else {
            return;
        };
        let Some((endpoint, uncached, _)) = t.dispatch else {
            return;
        };
        let e = &mut self.endpoints[endpoint];
        if !t.prefill_done {
            e.inflight_prefills -= 1;
            e.inflight_prefill_tokens -= uncached;
        }
        e.inflight -= 1;
        if let Some(reported) = cached_tokens {
            let predicted = t.predicted_cached[endpoint];
            let error = predicted.abs_diff(reported) as f64 / t.prompt_tokens.max(1) as f64;
            e.error_ewma = if e.samples == 0 {
                error
            } else {
                0.8 * e.error_ewma + 0.2 * error
            };
            e.samples = e.samples.saturating_add(1);
        }
    }
}
