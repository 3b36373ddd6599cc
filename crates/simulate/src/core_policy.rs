//! [`RoutingPolicy`] over kvroute-core's [`Fleet`]: the decision state and scheduler the live
//! router runs, fed the same observations at the same moments as `kvroute-router` feeds it
//! (plan, hold while saturated, dispatched once connected, first token, finished, KV events,
//! load scrapes, housekeeping every second), with the router's defaults.

use std::collections::HashMap;
use std::sync::Arc;

use kvroute_core::event::KvEvent;
use kvroute_core::fleet::{
    Admission, Dispatch, EndpointSpec, Fleet, FleetConfig as CoreFleetConfig, HeldTurn, HoldTicket,
    LoadSample, Plan, RequestFeatures, Shed,
};
use kvroute_core::index::{EndpointId, OffloadSpec, SharedMount};
use kvroute_core::keys::RouterKey;
use kvroute_core::load_counters::TierLoadCounters;
use kvroute_core::schedule::{CacheSource, PredictedTtfts, Profile, ProfileName, Role};
use kvroute_core::tiers::TierLoadMode;
use kvroute_sim::engine::TierLoads;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::SimulateError;
use crate::config::FleetConfig;
use crate::decisions::{Decided, DecisionLog};
use crate::pd_policy::{PdMode, PdRouting};
use crate::policy::{Routing, RoutingPolicy, SimRequest, Usage};

/// The model every simulated endpoint serves.
const MODEL: &str = "sim-llama-3.1-8b";
/// How often the router drops expired history (its housekeeping task).
const HOUSEKEEPING_S: f64 = 1.0;

/// A request from its plan to its end.
struct Tracked {
    keys: Arc<Vec<RouterKey>>,
    prompt_tokens: usize,
    predicted_cached: Vec<usize>,
    /// The plan's predicted time to first token at each endpoint it assessed.
    predicted_ttft_s: PredictedTtfts,
    ticket: Option<HoldTicket>,
    dispatch: Option<Dispatch>,
    /// A disaggregated request's prefill endpoint, and its leg there.
    prefill: Option<usize>,
    prefill_dispatch: Option<Dispatch>,
}

/// A scheduling profile on kvroute-core's fleet state.
pub struct CorePolicy {
    fleet: Fleet,
    block_size: usize,
    /// Each engine's GPU blocks, as its `vllm:cache_config_info` says.
    capacity_blocks: usize,
    requests: HashMap<u64, Tracked>,
    rng: StdRng,
    last_housekeeping: f64,
    /// Prefill/decode disaggregation on a P/D fleet (`pd-always`, `pd-cost`).
    pd: Option<PdRouting>,
    /// Where each decision is written, when the run traces them.
    decisions: Option<DecisionLog>,
    /// Each predicted request's time to first token less its prediction.
    ttft_errors: Vec<f64>,
}

impl CorePolicy {
    /// The named policy (`round-robin`, `random`, `least-load`, `approximate`, `precise`) on
    /// `fleet`, with the router's defaults.
    pub fn named(name: &str, fleet: &FleetConfig) -> Result<Self, SimulateError> {
        let mode = match name {
            "pd-always" => Some(PdMode::Always),
            "pd-cost" => Some(PdMode::Cost),
            _ => None,
        };
        if let Some(mode) = mode {
            // The decode pick is the precise profile's; P/D decides the rest.
            let mut policy = Self::new(
                Profile::named(ProfileName::Precise),
                CoreFleetConfig::default(),
                fleet,
            )?;
            policy.pd = Some(
                PdRouting::new(mode, fleet, &mut policy.fleet).ok_or_else(|| {
                    SimulateError::Policy(format!(
                        "{name} needs a P/D fleet (--prefill-engines, --decode-engines)"
                    ))
                })?,
            );
            return Ok(policy);
        }
        let name = name.parse::<ProfileName>().map_err(SimulateError::Policy)?;
        Self::new(Profile::named(name), CoreFleetConfig::default(), fleet)
    }

    /// `profile` on `fleet` with core's settings `config` (its load-sample age is derived from
    /// the scrape interval, as the router derives it), told how the engines load tier blocks,
    /// as an operator configures it for their connector.
    pub fn new(
        mut profile: Profile,
        mut config: CoreFleetConfig,
        fleet: &FleetConfig,
    ) -> Result<Self, SimulateError> {
        // Before anything is sized by the fleet (an endpoint per engine).
        fleet.validate()?;
        config.load_sample_max_age_s =
            CoreFleetConfig::load_sample_max_age_for(fleet.scrape_interval_s, 0.0);
        // As an operator sets it from the engines' `--max-num-batched-tokens`.
        config.prefill_chunk_tokens = fleet.engine.max_num_batched_tokens;
        profile.tiers.load_mode = match fleet.engine.tier_loads {
            TierLoads::Async => TierLoadMode::Async,
            TierLoads::InStep => TierLoadMode::InStep,
        };
        if profile.cache != CacheSource::Approximate {
            // Only the approximate source reads the routing history (every endpoint here has
            // events): entries that expire at once keep it small and change no decision. Its
            // capacity stays, as core's shared-prefix tracker is sized by it.
            config.history_ttl_s = f64::MIN_POSITIVE;
        }
        let block_size = fleet.engine.block_size;
        // Every engine mounts the fleet's shared filesystem, when it has one: its blocks
        // (medium `FS`) are the fleet's, loadable everywhere, not the writer's own storage.
        let offload = OffloadSpec {
            block_size: None,
            shared: fleet
                .engine
                .shared_fs
                .is_some()
                .then(|| SharedMount::new("shared-fs")),
        };
        let specs = (0..fleet.engines)
            .map(|i| EndpointSpec {
                name: FleetConfig::endpoint_name(i),
                models: vec![MODEL.to_owned()],
                role: fleet
                    .pd
                    .as_ref()
                    .and_then(|pd| pd.roles.get(i))
                    .map_or(Role::Both, |kv| crate::pd_policy::role(*kv)),
                has_events: true,
                block_size,
                offload: offload.clone(),
            })
            .collect();
        let mut core = Fleet::new(config, profile, specs)?;
        core.reseed(fleet.seed);
        Ok(Self {
            fleet: core,
            block_size,
            capacity_blocks: fleet.engine.num_gpu_blocks,
            requests: HashMap::new(),
            rng: StdRng::seed_from_u64(fleet.seed),
            last_housekeeping: 0.0,
            pd: None,
            decisions: None,
            ttft_errors: Vec::new(),
        })
    }

    /// Writes every decision from now on to `log` ([`crate::decisions`]).
    pub fn log_decisions(&mut self, log: DecisionLog) {
        self.decisions = Some(log);
    }

    /// Closes the decision log, if any: the first error met while writing it.
    pub fn finish_decisions(&mut self) -> Result<(), SimulateError> {
        self.decisions.take().map_or(Ok(()), DecisionLog::finish)
    }

    fn features<'a>(
        &self,
        keys: &'a Arc<Vec<RouterKey>>,
        prompt_tokens: usize,
    ) -> RequestFeatures<'a> {
        RequestFeatures {
            model: MODEL,
            keys,
            prompt_tokens,
            block_size: self.block_size,
            // `kvroute bench` sends no session header, so the live router sees no session.
            session: None,
            role: Role::Both,
        }
    }
}

/// A refusal, worded as the router answers it.
fn refuse(status: u16, message: &str) -> Routing {
    Routing::Reject(format!("HTTP {status}: {message}"))
}

fn shed(why: Shed) -> Routing {
    refuse(why.status(), why.reply())
}

fn no_endpoint() -> Routing {
    refuse(503, "no healthy endpoint serves this model; retry shortly")
}

impl CorePolicy {
    /// Sends a request core released down its plan's ranking, and remembers it until its end.
    fn go(&mut self, request: &SimRequest<'_>, plan: Plan, now: f64) -> Routing {
        let Some(chosen) = plan.decision.chosen() else {
            return no_endpoint();
        };
        let (routing, pd_choice) = self
            .pd
            .as_ref()
            .and_then(|pd| pd.choose(&mut self.fleet, &plan, request.prompt_tokens, now))
            .unwrap_or((Routing::Endpoint(chosen.0 as usize), None));
        let (engine, prefill) = match routing {
            Routing::Disaggregated { prefill, decode } => (decode, Some(prefill)),
            Routing::Endpoint(engine) => (engine, None),
            _ => (chosen.0 as usize, None),
        };
        if let Some(log) = &mut self.decisions {
            log.record(&Decided {
                at_s: now,
                request: request.id,
                session: request.session,
                prompt_tokens: request.prompt_tokens,
                endpoint: FleetConfig::endpoint_name(engine),
                prefill_endpoint: prefill.map(FleetConfig::endpoint_name),
                decision: &plan.decision,
                pd_choice: pd_choice.as_ref(),
            });
        }
        let predicted_ttft_s = PredictedTtfts::of(&plan.decision);
        self.remember(
            request,
            plan.predicted_cached,
            predicted_ttft_s,
            None,
            prefill,
        );
        routing
    }

    /// Tracks a request from its plan (or hold) to its end.
    fn remember(
        &mut self,
        request: &SimRequest<'_>,
        predicted_cached: Vec<usize>,
        predicted_ttft_s: PredictedTtfts,
        ticket: Option<HoldTicket>,
        prefill: Option<usize>,
    ) {
        let tracked = Tracked {
            keys: request.keys.clone(),
            prompt_tokens: request.prompt_tokens,
            predicted_cached,
            predicted_ttft_s,
            ticket,
            dispatch: None,
            prefill,
            prefill_dispatch: None,
        };
        self.requests.insert(request.id, tracked);
    }
}

impl RoutingPolicy for CorePolicy {
    fn route(&mut self, request: &SimRequest<'_>, now: f64) -> Routing {
        if now - self.last_housekeeping >= HOUSEKEEPING_S {
            self.last_housekeeping = now;
            self.fleet.housekeeping(now);
        }
        let features = self.features(&request.keys, request.prompt_tokens);
        // Held: core decides, at each poll, whether it leaves, waits or is shed.
        if let Some(ticket) = self.requests.get(&request.id).and_then(|t| t.ticket) {
            let plan = match self.fleet.poll_held(ticket, &features, now) {
                HeldTurn::Route(plan) => plan,
                HeldTurn::StillSaturated | HeldTurn::Queued => return Routing::Wait,
                HeldTurn::Shed(why) => {
                    self.requests.remove(&request.id);
                    return shed(why);
                }
                HeldTurn::NoEndpoint => {
                    self.requests.remove(&request.id);
                    return no_endpoint();
                }
            };
            return self.go(request, plan, now);
        }
        let plan = self.fleet.plan(&features, self.rng.random(), now);
        // The body's size, roughly: what the queue's byte bound counts.
        let bytes = request.prompt_tokens * 4;
        match self.fleet.admit(&plan, 0, bytes, now) {
            Admission::Route => self.go(request, plan, now),
            Admission::Held(ticket) => {
                self.remember(
                    request,
                    Vec::new(),
                    PredictedTtfts::default(),
                    Some(ticket),
                    None,
                );
                Routing::Wait
            }
            Admission::Shed(why) => shed(why),
            Admission::NoEndpoint => no_endpoint(),
        }
    }

    fn ttft_prediction_errors(&self) -> &[f64] {
        &self.ttft_errors
    }

    fn dispatched(&mut self, request_id: u64, endpoint: usize, now: f64) {
        let Some(mut t) = self.requests.remove(&request_id) else {
            return;
        };
        let features = self.features(&t.keys, t.prompt_tokens);
        let id = EndpointId(endpoint as u32);
        let mut predicted = t.predicted_cached.clone();
        if let Some(prefill) = t.prefill {
            // The prefill leg loads its endpoint; the decode endpoint computes (almost)
            // nothing: it pulls the rest.
            let mut leg = self.fleet.dispatched(
                &t.predicted_cached,
                &features,
                EndpointId(prefill as u32),
                now,
            );
            leg.predicted_ttft_s = t.predicted_ttft_s.at(EndpointId(prefill as u32));
            t.prefill_dispatch = Some(leg);
            if let Some(cached) = predicted.get_mut(endpoint) {
                let link = (EndpointId(prefill as u32), id);
                self.fleet.transfer_started(
                    request_id,
                    link,
                    t.prompt_tokens,
                    *cached,
                    self.block_size,
                    now,
                );
                *cached = t.prompt_tokens;
            }
        }
        let mut dispatch = self.fleet.dispatched(&predicted, &features, id, now);
        // A decode leg's wait is the P/D option's, not the plan's to predict.
        if t.prefill.is_none() {
            dispatch.predicted_ttft_s = t.predicted_ttft_s.at(id);
        }
        t.dispatch = Some(dispatch);
        self.requests.insert(request_id, t);
    }

    fn kv_events(&mut self, endpoint: usize, events: &[KvEvent], now: f64) {
        self.fleet
            .apply_events(EndpointId(endpoint as u32), events, now);
    }

    fn load_sample(
        &mut self,
        endpoint: usize,
        waiting: f64,
        running: f64,
        kv_usage: f64,
        now: f64,
    ) {
        let sample = LoadSample {
            waiting: Some(waiting),
            running: Some(running),
            kv_usage: Some(kv_usage),
            num_gpu_blocks: Some(self.capacity_blocks),
        };
        self.fleet
            .observe_load(EndpointId(endpoint as u32), sample, now);
    }

    fn tier_loads(&mut self, endpoint: usize, counters: TierLoadCounters, now: f64) {
        self.fleet
            .observe_engine_tier_loads(EndpointId(endpoint as u32), counters, now);
    }

    fn first_token(&mut self, request_id: u64, now: f64) {
        if let Some(dispatch) = self
            .requests
            .get_mut(&request_id)
            .and_then(|t| t.dispatch.as_mut())
        {
            let check = self.fleet.first_token(dispatch, true, now);
            self.ttft_errors.extend(check.map(|c| c.error_s()));
        }
    }

    fn prefill_done(&mut self, request_id: u64, cached_tokens: usize, now: f64) {
        if let Some(mut leg) = self
            .requests
            .get_mut(&request_id)
            .and_then(|t| t.prefill_dispatch.take())
        {
            let check = self.fleet.first_token(&mut leg, true, now);
            self.ttft_errors.extend(check.map(|c| c.error_s()));
            // A prefill leg generates its one token.
            leg.output_reported(1);
            self.fleet.finished(leg, Some(cached_tokens), now);
        }
    }

    fn transferred(
        &mut self,
        request_id: u64,
        link: (usize, usize),
        bytes: u64,
        seconds: f64,
        now: f64,
    ) {
        let link = (EndpointId(link.0 as u32), EndpointId(link.1 as u32));
        self.fleet
            .observe_transfer(request_id, link, bytes as f64, seconds, now);
    }

    fn finished(&mut self, request_id: u64, usage: Option<Usage>, now: f64) {
        self.fleet.transfer_ended(request_id);
        let Some(t) = self.requests.remove(&request_id) else {
            return;
        };
        if let Some(leg) = t.prefill_dispatch {
            self.fleet.finished(leg, None, now);
        }
        // A decode leg reports pulled tokens as cached: not what its own cache predicted.
        let reported = usage
            .filter(|_| t.prefill.is_none())
            .map(|u| u.cached_tokens);
        if let Some(mut dispatch) = t.dispatch {
            if let Some(usage) = usage {
                dispatch.output_reported(usage.completion_tokens);
            }
            self.fleet.finished(dispatch, reported, now);
        }
    }
}

#[cfg(test)]
mod tests {
    use kvroute_core::tiers::TierLoadMode;
    use kvroute_sim::engine::TierLoads;

    use super::CorePolicy;
    use crate::config::FleetConfig;

    #[test]
    fn the_router_is_told_how_its_engines_load_tier_blocks() {
        for (engines, router) in [
            (TierLoads::Async, TierLoadMode::Async),
            (TierLoads::InStep, TierLoadMode::InStep),
        ] {
            let mut fleet = FleetConfig::default();
            fleet.engine.tier_loads = engines;
            let policy = CorePolicy::named("precise", &fleet).unwrap();
            assert_eq!(policy.fleet.profile().tiers.load_mode, router);
        }
    }
}
