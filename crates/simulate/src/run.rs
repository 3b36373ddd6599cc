//! One simulated run: a workload's sessions through one policy onto a fresh fleet, in virtual
//! time, producing the records `kvroute bench` would have measured.

use std::sync::Arc;

use kvroute_bench::result::RequestRecord;
use kvroute_bench::workload::Workload;
use kvroute_core::keys::{request_extra_keys, router_keys};

use crate::SimulateError;
use crate::client::Client;
use crate::config::FleetConfig;
use crate::engines::SimEngine;
use crate::policy::{RoutingPolicy, SimRequest};
use crate::queue::{Event, Queue};

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

/// A request between its sending and its end.
struct InFlight {
    session: usize,
    engine: usize,
    record: RequestRecord,
    /// Prompt and `max_tokens`, until the engine receives them.
    payload: Option<(Vec<u32>, u32)>,
    /// The answer (chat workloads, for the history).
    answer: Vec<u32>,
    last_token_at: f64,
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
        engines: (0..fleet.engines)
            .map(|_| SimEngine::new(fleet.engine.clone()))
            .collect::<Result<_, _>>()?,
        requests: Vec::with_capacity(workload.requests()),
        next_session: 0,
        closed_loop: concurrency.is_some(),
        total_sessions: workload.sessions.len(),
        sessions_left: workload.sessions.len(),
        last_end: 0.0,
    };
    let first = concurrency.map_or(workload.sessions.len(), |n| n.max(1));
    for s in 0..first.min(workload.sessions.len()) {
        let start = if run.closed_loop {
            0.0
        } else {
            workload.sessions[s].start_s
        };
        run.schedule_turn(s, start);
    }
    run.next_session = first;
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
                }
                if run.sessions_left > 0 {
                    run.queue.push(now + fleet.scrape_interval_s, Event::Scrape);
                }
            }
        }
    }
    let (queries, hits) = run
        .engines
        .iter()
        .map(SimEngine::prefix_cache_counters)
        .fold((0, 0), |(q, h), (dq, dh)| (q + dq, h + dh));
    let mut records: Vec<RequestRecord> = run.requests.into_iter().map(|r| r.record).collect();
    records.sort_by(|a, b| a.start_s.total_cmp(&b.start_s));
    Ok(RunOutcome {
        records,
        duration_s: run.last_end,
        engine_hit_rate: (queries > 0).then(|| hits as f64 / queries as f64),
    })
}

impl Run<'_> {
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
        let index = self.requests.len();
        let bs = self.fleet.engine.block_size;
        let extra = request_extra_keys(turn.prompt.len() / bs, None, None);
        let keys: Arc<[_]> = router_keys(&turn.prompt, bs, Some(&extra))
            .unwrap_or_default()
            .into();
        let request = SimRequest {
            id: index as u64,
            tokens: &turn.prompt,
            keys,
            prompt_tokens: turn.prompt.len(),
            session: s as u64,
        };
        let chosen = policy.route(&request, now);
        let mut record = RequestRecord {
            session: s as u64,
            turn: turn.turn as u32,
            start_s: now,
            ..RequestRecord::default()
        };
        let engine = match chosen {
            Some(e) if e < self.engines.len() => e,
            _ => {
                record.error =
                    Some("HTTP 503: no healthy endpoint serves this model; retry shortly".into());
                self.requests.push(failed(s, record));
                self.session_done(now);
                return;
            }
        };
        policy.dispatched(index as u64, engine, now);
        record.endpoint = Some(FleetConfig::endpoint_name(engine));
        self.requests.push(InFlight {
            session: s,
            engine,
            record,
            payload: Some((turn.prompt, turn.max_tokens)),
            answer: Vec::new(),
            last_token_at: now,
        });
        self.queue
            .push(now + self.fleet.request_latency_s, Event::Arrive(index));
    }

    fn arrive(
        &mut self,
        r: usize,
        now: f64,
        policy: &mut dyn RoutingPolicy,
    ) -> Result<(), SimulateError> {
        let request = &mut self.requests[r];
        let (prompt, max_tokens) = request.payload.take().unwrap_or_default();
        let engine = request.engine;
        match self.engines[engine].submit(r, prompt, max_tokens) {
            Ok(answer) => {
                if self.client.is_chat() {
                    request.answer = answer;
                }
                self.start_step(engine, now)
            }
            Err(error) => {
                let end = now + self.fleet.response_latency_s;
                request.record.error = Some(error);
                request.record.e2e_s = end - request.record.start_s;
                policy.finished(r as u64, None, now);
                self.session_done(end);
                Ok(())
            }
        }
    }

    fn start_step(&mut self, engine: usize, now: f64) -> Result<(), SimulateError> {
        if let Some(duration) = self.engines[engine].start_step(engine, now)? {
            self.queue.push(now + duration, Event::StepDone(engine));
        }
        Ok(())
    }

    fn step_done(
        &mut self,
        e: usize,
        now: f64,
        policy: &mut dyn RoutingPolicy,
    ) -> Result<(), SimulateError> {
        let step = self.engines[e].finish_step();
        let seen = now + self.fleet.response_latency_s;
        for token in &step.tokens {
            let r = self.engines[e].request_index(token.id);
            let request = &mut self.requests[r];
            let record = &mut request.record;
            if token.index == 0 {
                record.ttft_s = Some(seen - record.start_s);
                policy.first_token(r as u64, now);
            } else {
                record.itl_s.push(seen - request.last_token_at);
            }
            request.last_token_at = seen;
            if token.finished.is_some() {
                record.prompt_tokens = token.prompt_tokens as u64;
                record.completion_tokens = token.index as u64 + 1;
                record.cached_tokens = Some(token.cached_tokens as u64);
                record.e2e_s = seen - record.start_s;
                policy.finished(r as u64, Some(token.cached_tokens), now);
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
        self.start_step(e, now)
    }
}

fn failed(session: usize, record: RequestRecord) -> InFlight {
    InFlight {
        session,
        engine: 0,
        record,
        payload: None,
        answer: Vec::new(),
        last_token_at: 0.0,
    }
}
