//! One simulated run: a workload's sessions through one policy onto a fresh fleet, in virtual
//! time, producing the records `kvroute bench` would have measured.

use std::collections::VecDeque;
use std::sync::Arc;

use kvroute_bench::result::RequestRecord;
use kvroute_bench::workload::Workload;
use kvroute_core::keys::{RouterKey, request_extra_keys, router_keys};

use crate::SimulateError;
use crate::client::Client;
use crate::config::FleetConfig;
use crate::engines::SimEngine;
use crate::pd::{Link, Pull};
use crate::policy::{Routing, RoutingPolicy, SimRequest, Usage};
use crate::queue::{Event, Queue};
use kvroute_sim::engine::KvTransfer;

/// What a run measured.
#[derive(Debug)]
pub struct RunOutcome {
    /// Every request, in start order.
    pub records: Vec<RequestRecord>,
    /// Virtual seconds from the start to the last answer.
    pub duration_s: f64,
    /// The engines' own prefix-cache hit rate (hit tokens over looked-up tokens).
    pub engine_hit_rate: Option<f64>,
}

/// How often a held request checks again without a wake-up (the router's recheck).
const RECHECK_S: f64 = 0.05;

/// A request between its sending and its end.
struct InFlight {
    session: usize,
    engine: usize,
    record: RequestRecord,
    /// Prompt, its router keys and `max_tokens`, until the engine receives them.
    payload: Option<(Vec<u32>, Arc<Vec<RouterKey>>, u32)>,
    /// The answer (chat workloads, for the history).
    answer: Vec<u32>,
    last_token_at: f64,
    /// A disaggregated request's legs.
    pd: Option<PdLegs>,
}

/// The two legs of a disaggregated request.
struct PdLegs {
    prefill: usize,
    decode: usize,
    /// The prefill leg's engine request id, once submitted.
    prefill_id: Option<u64>,
}

struct Run<'a> {
    fleet: &'a FleetConfig,
    queue: Queue,
    client: Client<'a>,
    engines: Vec<SimEngine>,
    requests: Vec<InFlight>,
    /// Closed loop: the next session to start when one ends.
    next_session: usize,
    closed_loop: bool,
    total_sessions: usize,
    sessions_left: usize,
    last_end: f64,
    /// Requests the policy holds (flow control), in arrival order.
    held: VecDeque<usize>,
    recheck_scheduled: bool,
    /// The links of a P/D fleet.
    link: Option<Link>,
    /// Records of turns never sent, because an earlier turn of their conversation failed.
    not_sent: Vec<RequestRecord>,
}

/// Runs `workload` through `policy` on a fresh fleet. `concurrency`: closed loop with at most
/// that many sessions at once (as `kvroute bench --concurrency`); `None`: open loop.
pub fn run(
    fleet: &FleetConfig,
    workload: &Workload,
    concurrency: Option<usize>,
    policy: &mut dyn RoutingPolicy,
) -> Result<RunOutcome, SimulateError> {
    fleet.validate()?;
    let mut run = Run {
        fleet,
        queue: Queue::default(),
        client: Client::new(workload),
        engines: SimEngine::fleet((0..fleet.engines).map(|i| fleet.engine_config(i)).collect())?,
        requests: Vec::with_capacity(workload.requests()),
        next_session: 0,
        closed_loop: concurrency.is_some(),
        total_sessions: workload.sessions.len(),
        sessions_left: workload.sessions.len(),
        last_end: 0.0,
        held: VecDeque::new(),
        recheck_scheduled: false,
        link: fleet.pd.as_ref().map(Link::new),
        not_sent: Vec::new(),
    };
    let first = concurrency
        .map_or(workload.sessions.len(), |n| n.max(1))
        .min(workload.sessions.len());
    run.next_session = first;
    for s in 0..first {
        let start = if run.closed_loop {
            0.0
        } else {
            workload.sessions[s].start_s
        };
        run.schedule_turn(s, start);
    }
    run.queue.push(0.0, Event::Scrape);
    while let Some(event) = run.queue.pop() {
        let now = run.queue.now();
        match event {
            Event::Send(s) => run.send(s, now, policy),
            Event::Arrive(r) => run.arrive(r, now, policy)?,
            Event::StepDone(e) => run.step_done(e, now, policy)?,
            Event::KvEvents(e, events) => policy.kv_events(e, &events, now),
            Event::Scrape => {
                for (e, engine) in run.engines.iter().enumerate() {
                    let o = engine.observed();
                    policy.load_sample(e, o.waiting, o.running, o.kv_usage, now);
                    policy.tier_loads(e, engine.tier_load_counters(), now);
                }
                if run.sessions_left > 0 {
                    run.queue
                        .push(run.next_scrape(now, fleet.scrape_interval_s), Event::Scrape);
                }
                run.retry_held(now, policy);
            }
            Event::Recheck => {
                run.recheck_scheduled = false;
                run.retry_held(now, policy);
            }
            Event::Pull(r) => run.pull(r, now, policy)?,
            Event::Link => run.link_event(now, policy)?,
        }
    }
    let (queries, hits) = run
        .engines
        .iter()
        .map(SimEngine::prefix_cache_counters)
        .fold((0, 0), |(q, h), (dq, dh)| (q + dq, h + dh));
    let mut records: Vec<RequestRecord> = run.requests.into_iter().map(|r| r.record).collect();
    records.append(&mut run.not_sent);
    records.sort_by(|a, b| a.start_s.total_cmp(&b.start_s));
    Ok(RunOutcome {
        records,
        duration_s: run.last_end,
        engine_hit_rate: (queries > 0).then(|| hits as f64 / queries as f64),
    })
}

/// Scrape intervals in a row with nothing happening after which scrapes skip ahead: by then
/// every sample of an idle fleet is the same and whatever follows them has settled, so skipping
/// them changes no decision, while a far-off next arrival (a long think time, a sparse trace)
/// no longer costs a scrape per interval of simulated time.
const IDLE_SCRAPES_SKIPPED_AFTER: f64 = 10_000.0;

impl Run<'_> {
    /// When the scrape after one at `now` is due: one interval later, or, when nothing at all
    /// happens for more than [`IDLE_SCRAPES_SKIPPED_AFTER`] intervals (no event is due and no
    /// request is held), the last scrape on the same grid before the next event.
    fn next_scrape(&self, now: f64, interval_s: f64) -> f64 {
        let next = now + interval_s;
        match self.queue.next_at() {
            Some(at)
                if self.held.is_empty()
                    && interval_s > 0.0
                    && at - now > IDLE_SCRAPES_SKIPPED_AFTER * interval_s =>
            {
                now + ((at - now) / interval_s).floor().max(1.0) * interval_s
            }
            _ => next,
        }
    }

    /// Schedules session `s`'s next turn after its think time from `at`, or ends the session.
    fn schedule_turn(&mut self, s: usize, at: f64) {
        match self.client.think_before_next(s) {
            Some(think) => self.queue.push(at + think, Event::Send(s)),
            None => self.session_done(at),
        }
    }

    fn session_done(&mut self, at: f64) {
        self.sessions_left -= 1;
        self.last_end = self.last_end.max(at);
        if self.closed_loop && self.next_session < self.total_sessions {
            let s = self.next_session;
            self.next_session += 1;
            self.schedule_turn(s, at);
        }
    }

    fn send(&mut self, s: usize, now: f64, policy: &mut dyn RoutingPolicy) {
        let turn = self.client.next_turn(s);
        let bs = self.fleet.engine.block_size;
        let extra = request_extra_keys(turn.prompt.len() / bs, None, None);
        let keys = Arc::new(router_keys(&turn.prompt, bs, Some(&extra)).unwrap_or_default());
        self.requests.push(InFlight {
            session: s,
            engine: 0,
            record: RequestRecord {
                session: s as u64,
                turn: turn.turn as u32,
                start_s: now,
                ..RequestRecord::default()
            },
            payload: Some((turn.prompt, keys, turn.max_tokens)),
            answer: Vec::new(),
            last_token_at: now,
            pd: None,
        });
        let index = self.requests.len() - 1;
        if !self.route(index, now, policy) {
            self.held.push_back(index);
            self.schedule_recheck(now);
        }
    }

    /// Asks the policy where request `index` goes; false when it must wait.
    fn route(&mut self, index: usize, now: f64, policy: &mut dyn RoutingPolicy) -> bool {
        let request = &mut self.requests[index];
        let Some((prompt, keys, _)) = &request.payload else {
            return true;
        };
        let routing = policy.route(
            &SimRequest {
                id: index as u64,
                tokens: prompt,
                keys: keys.clone(),
                prompt_tokens: prompt.len(),
                session: request.session as u64,
            },
            now,
        );
        match routing {
            Routing::Endpoint(e) if e < self.engines.len() => {
                policy.dispatched(index as u64, e, now);
                request.engine = e;
                request.record.endpoint = Some(FleetConfig::endpoint_name(e));
                self.queue
                    .push(now + self.fleet.request_latency_s, Event::Arrive(index));
                true
            }
            Routing::Disaggregated { prefill, decode }
                if prefill < self.engines.len()
                    && decode < self.engines.len()
                    && prefill != decode
                    && self.link.is_some() =>
            {
                policy.dispatched(index as u64, decode, now);
                request.engine = prefill;
                request.pd = Some(PdLegs {
                    prefill,
                    decode,
                    prefill_id: None,
                });
                request.record.endpoint = Some(FleetConfig::endpoint_name(decode));
                self.queue
                    .push(now + self.fleet.request_latency_s, Event::Arrive(index));
                true
            }
            Routing::Disaggregated { prefill, decode } => {
                self.fail(
                    index,
                    format!("the policy disaggregated onto engines {prefill} and {decode}, which this fleet cannot do"),
                    now,
                );
                true
            }
            Routing::Wait => false,
            Routing::Endpoint(e) => {
                self.fail(
                    index,
                    format!("the policy chose endpoint {e}, which is not in the fleet"),
                    now,
                );
                true
            }
            Routing::Reject(error) => {
                self.fail(index, error, now);
                true
            }
        }
    }

    /// Request `index` ends in error, answered at `now`: its session cannot go on.
    fn fail(&mut self, index: usize, error: String, now: f64) {
        let end = now + self.fleet.response_latency_s;
        let request = &mut self.requests[index];
        request.payload = None;
        request.record.error = Some(error);
        request.record.e2e_s = end - request.record.start_s;
        // Its conversation ends here; its later turns count as failed too.
        let session = request.session;
        self.not_sent.extend(
            self.client
                .turns_left(session)
                .map(|t| RequestRecord::not_sent(session as u64, t as u32, end)),
        );
        self.session_done(end);
    }

    /// Held requests, in arrival order, ask again.
    fn retry_held(&mut self, now: f64, policy: &mut dyn RoutingPolicy) {
        let held = std::mem::take(&mut self.held);
        for index in held {
            if !self.route(index, now, policy) {
                self.held.push_back(index);
            }
        }
        self.schedule_recheck(now);
    }

    fn schedule_recheck(&mut self, now: f64) {
        if !self.held.is_empty() && !self.recheck_scheduled {
            self.recheck_scheduled = true;
            self.queue.push(now + RECHECK_S, Event::Recheck);
        }
    }

    fn arrive(
        &mut self,
        r: usize,
        now: f64,
        policy: &mut dyn RoutingPolicy,
    ) -> Result<(), SimulateError> {
        let request = &mut self.requests[r];
        if let Some(pd) = &mut request.pd {
            // The prefill leg: one token, its blocks held; the request stays for the decode leg.
            let Some((prompt, _, _)) = &request.payload else {
                return Ok(());
            };
            let engine = pd.prefill;
            return match self.engines[engine].submit_leg(r, prompt.clone(), 1, KvTransfer::Produce)
            {
                Ok((_, id)) => {
                    pd.prefill_id = Some(id);
                    self.start_step(engine, now, policy)
                }
                Err(error) => {
                    policy.finished(r as u64, None, now);
                    self.fail(r, error, now);
                    Ok(())
                }
            };
        }
        let (prompt, _, max_tokens) = request.payload.take().unwrap_or_default();
        let engine = request.engine;
        match self.engines[engine].submit(r, prompt, max_tokens) {
            Ok(answer) => {
                if self.client.is_chat() {
                    request.answer = answer;
                }
                self.start_step(engine, now, policy)
            }
            Err(error) => {
                policy.finished(r as u64, None, now);
                self.fail(r, error, now);
                Ok(())
            }
        }
    }

    fn start_step(
        &mut self,
        engine: usize,
        now: f64,
        policy: &mut dyn RoutingPolicy,
    ) -> Result<(), SimulateError> {
        let (duration, refused) = self.engines[engine].start_step(engine, now)?;
        for (r, error) in refused {
            policy.finished(r as u64, None, now);
            self.fail(r, error, now);
        }
        if let Some(duration) = duration {
            self.queue.push(now + duration, Event::StepDone(engine));
        }
        Ok(())
    }

    /// Request `r`'s decode leg reached its engine: it pulls the blocks it lacks (or, holding
    /// them all, only releases the producer's).
    fn pull(
        &mut self,
        r: usize,
        now: f64,
        policy: &mut dyn RoutingPolicy,
    ) -> Result<(), SimulateError> {
        let bs = self.fleet.engine.block_size;
        let request = &self.requests[r];
        let (Some(pd), Some((prompt, _, _)), Some(link)) =
            (&request.pd, &request.payload, &mut self.link)
        else {
            return Ok(());
        };
        let (prefill, decode) = (pd.prefill, pd.decode);
        let (local, lookup) = self.engines[decode].local_prefix(prompt);
        let wanted = lookup.min(prompt.len() / bs);
        if local >= wanted {
            if let Some(id) = pd.prefill_id {
                self.engines[prefill].release(id);
            }
            let transfer = KvTransfer::Consume {
                from: local,
                blocks: local,
            };
            self.decode_leg(r, transfer, now, policy)?;
            // Released blocks may let a prefill waiting for room run.
            return self.start_step(prefill, now, policy);
        }
        let bytes = ((wanted - local) * bs) as u64 * link.kv_bytes_per_token;
        link.start(
            now,
            prefill,
            decode,
            Pull {
                request: r,
                bytes,
                started: now,
                from: local,
                blocks: wanted,
            },
        );
        self.schedule_link(None);
        Ok(())
    }

    fn schedule_link(&mut self, handled: Option<f64>) {
        if let Some(at) = self.link.as_mut().and_then(|l| l.next_wake(handled)) {
            self.queue.push(at, Event::Link);
        }
    }

    /// Pulls finished: the producers release their blocks, the decode legs start.
    fn link_event(
        &mut self,
        now: f64,
        policy: &mut dyn RoutingPolicy,
    ) -> Result<(), SimulateError> {
        let done = self
            .link
            .as_mut()
            .map(|l| l.advance(now))
            .unwrap_or_default();
        for pull in done {
            let Some(pd) = &self.requests[pull.request].pd else {
                continue;
            };
            let (prefill, decode) = (pd.prefill, pd.decode);
            if let Some(id) = pd.prefill_id {
                self.engines[prefill].release(id);
            }
            policy.transferred(
                pull.request as u64,
                (prefill, decode),
                pull.bytes,
                now - pull.started,
                now,
            );
            let transfer = KvTransfer::Consume {
                from: pull.from,
                blocks: pull.blocks,
            };
            self.decode_leg(pull.request, transfer, now, policy)?;
            // Released blocks may let a prefill waiting for room run.
            self.start_step(prefill, now, policy)?;
        }
        self.schedule_link(Some(now));
        Ok(())
    }

    /// Request `r` runs on its decode engine with `transfer`'s blocks.
    fn decode_leg(
        &mut self,
        r: usize,
        transfer: KvTransfer,
        now: f64,
        policy: &mut dyn RoutingPolicy,
    ) -> Result<(), SimulateError> {
        let request = &mut self.requests[r];
        let (prompt, _, max_tokens) = request.payload.take().unwrap_or_default();
        let Some(decode) = request.pd.as_ref().map(|pd| pd.decode) else {
            return Ok(());
        };
        request.engine = decode;
        match self.engines[decode].submit_leg(r, prompt, max_tokens, transfer) {
            Ok((answer, _)) => {
                if self.client.is_chat() {
                    request.answer = answer;
                }
                self.start_step(decode, now, policy)
            }
            Err(error) => {
                policy.finished(r as u64, None, now);
                self.fail(r, error, now);
                Ok(())
            }
        }
    }

    fn step_done(
        &mut self,
        e: usize,
        now: f64,
        policy: &mut dyn RoutingPolicy,
    ) -> Result<(), SimulateError> {
        let step = self.engines[e].finish_step();
        let seen = now + self.fleet.response_latency_s;
        let mut capacity_changed = false;
        for token in &step.tokens {
            let r = self.engines[e].request_index(token.id);
            let request = &mut self.requests[r];
            if let Some(pd) = &request.pd
                && pd.prefill == e
                && pd.prefill_id == Some(token.id)
            {
                // The prefill leg's answer goes back to the router, which sends the decode leg.
                if token.finished.is_some() {
                    policy.prefill_done(r as u64, token.cached_tokens, now);
                    let at = seen + self.fleet.request_latency_s;
                    self.queue.push(at, Event::Pull(r));
                }
                continue;
            }
            let record = &mut request.record;
            if token.index == 0 {
                record.ttft_s = Some(seen - record.start_s);
                policy.first_token(r as u64, now);
                capacity_changed = true;
            } else {
                record.itl_s.push(seen - request.last_token_at);
            }
            request.last_token_at = seen;
            if token.finished.is_some() {
                record.prompt_tokens = token.prompt_tokens as u64;
                record.completion_tokens = token.index as u64 + 1;
                record.cached_tokens = Some(token.cached_tokens as u64);
                record.e2e_s = seen - record.start_s;
                let usage = Usage {
                    cached_tokens: token.cached_tokens,
                    completion_tokens: token.index + 1,
                };
                policy.finished(r as u64, Some(usage), now);
                capacity_changed = true;
                let session = request.session;
                let answer = std::mem::take(&mut request.answer);
                self.client.answered(session, &answer);
                self.schedule_turn(session, seen);
            }
        }
        if !step.events.is_empty() {
            self.queue.push(
                now + self.fleet.event_delay_s,
                Event::KvEvents(e, step.events),
            );
        }
        if capacity_changed && !self.held.is_empty() {
            self.retry_held(now, policy);
        }
        self.start_step(e, now, policy)
    }
}
