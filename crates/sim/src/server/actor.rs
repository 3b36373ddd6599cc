//! The task that owns one engine: it takes requests, runs steps in (scaled) real time, hands
//! tokens to waiting HTTP handlers and publishes the step's KV events.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use kvroute_core::event::EventBatch;
use parking_lot::Mutex;
use rand::Rng;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tracing::warn;

use super::faults::Faults;
use super::lease::LeaseTable;
use super::metrics::Observed;
use crate::connector_events::ConnectorEvents;
use crate::engine::shared_fs::SharedFsHandle;
use crate::engine::{
    Engine, EngineConfig, EngineRequest, HeldBlocks, KvTransfer, RequestId, TokenOutput,
};

/// What an HTTP handler receives for its request.
#[derive(Debug)]
pub enum Delivery {
    /// One generated token.
    Token(TokenOutput),
    /// A prefill leg's held blocks, just before its last token.
    Held(HeldBlocks),
    /// The engine restarted (or failed) before finishing the request.
    Aborted(String),
}

/// A request for the engine task.
pub struct Submission {
    /// The request.
    pub request: EngineRequest,
    /// Its part in P/D.
    pub transfer: KvTransfer,
    /// The name a prefill leg's hold is known by (its request id).
    pub lease_name: Option<String>,
}

/// Commands to an engine task.
pub enum Command {
    /// Run a request; tokens go to the sender.
    Submit(Submission, mpsc::UnboundedSender<Delivery>),
    /// Release a prefill leg's held blocks (pulled, or the lease expired).
    Release(RequestId),
    /// The prefix of a request the engine holds, and its block hashes (see
    /// [`Engine::local_prefix`]).
    LocalPrefix(EngineRequest, oneshot::Sender<(usize, Vec<u64>)>),
    /// The client went away.
    Abort(RequestId),
    /// Empty the prefix cache; answers whether it did.
    ResetCache(oneshot::Sender<bool>),
    /// Restart: empty cache, events sequence back to 0, in-flight requests aborted.
    Restart,
}

/// A batch of events on its way to the publisher, with when to send it and whether it is lost.
pub struct Outgoing {
    /// The batch.
    pub batch: EventBatch,
    /// Not before this instant (event delay fault).
    pub not_before: Instant,
    /// Lost in transit (kept for replay only).
    pub lost: bool,
    /// The engine restarted just before this batch.
    pub restart: bool,
}

/// Shared state the HTTP side reads.
pub struct EngineShared {
    /// Latest engine metrics and latency observations.
    pub observed: Mutex<Observed>,
    /// Fault settings.
    pub faults: Mutex<Faults>,
    /// Prefill legs' holds (empty without P/D).
    pub leases: Mutex<LeaseTable>,
}

/// What an engine shares with the rest of its fleet.
pub struct FleetMount {
    /// The fleet's shared filesystem tier, if any.
    pub shared_fs: Option<SharedFsHandle>,
    /// When the fleet started: engine time is wall time since then, times the time scale.
    pub epoch: Instant,
    /// The engine's offloading connector: shapes its tier events.
    pub connector: ConnectorEvents,
}

/// Runs the engine until the command channel closes.
pub async fn run_engine(
    config: EngineConfig,
    mount: FleetMount,
    time_scale: f64,
    mut commands: mpsc::UnboundedReceiver<Command>,
    events: mpsc::UnboundedSender<Outgoing>,
    shared: Arc<EngineShared>,
) {
    let build = || Engine::mounted(config.clone(), mount.shared_fs.clone());
    let mut connector = mount.connector;
    let mut engine = build().expect("configuration validated at startup");
    let mut waiters: HashMap<RequestId, (mpsc::UnboundedSender<Delivery>, Instant)> =
        HashMap::new();
    let mut clock = Instant::now();
    let mut lease_names: HashMap<RequestId, String> = HashMap::new();
    let mut restart_pending = false;
    // The last step could do nothing (every free block is held for a consumer): wait for a
    // command (a release) instead of spinning.
    let mut blocked = false;
    let mut last_lag_warning: Option<Instant> = None;
    loop {
        // Take every queued command; block only when there is nothing to run.
        loop {
            let cmd = if engine.has_work() && !blocked {
                match commands.try_recv() {
                    Ok(cmd) => cmd,
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => return,
                }
            } else {
                // Idle: publish the final gauges (an abort may just have freed a slot).
                shared.observed.lock().metrics = engine.metrics();
                match commands.recv().await {
                    Some(cmd) => {
                        clock = Instant::now();
                        blocked = false;
                        cmd
                    }
                    None => return,
                }
            };
            match cmd {
                Command::Submit(submission, tx) => {
                    let id = submission.request.id;
                    match engine.add_request_with(submission.request, submission.transfer) {
                        Ok(()) => {
                            waiters.insert(id, (tx, Instant::now()));
                            if let Some(name) = submission.lease_name {
                                lease_names.insert(id, name);
                            }
                        }
                        Err(e) => {
                            let _ = tx.send(Delivery::Aborted(e.to_string()));
                        }
                    }
                }
                Command::Abort(id) => {
                    // A prefill leg whose client left after it finished: its blocks stay held
                    // for the consumer until pulled or expired (the lease releases them).
                    if !shared.leases.lock().holds(id) {
                        engine.abort(id);
                    }
                    waiters.remove(&id);
                    lease_names.remove(&id);
                }
                Command::Release(id) => {
                    engine.release(id);
                }
                Command::LocalPrefix(request, reply) => {
                    let _ = reply.send(engine.local_prefix(&request));
                }
                Command::ResetCache(reply) => {
                    let done = engine.reset_prefix_cache();
                    let _ = reply.send(done);
                    send_events(
                        &events,
                        connector.shape(engine.take_events()),
                        &shared,
                        false,
                    );
                }
                Command::Restart => {
                    for (_, (tx, _)) in waiters.drain() {
                        let _ = tx.send(Delivery::Aborted("the engine restarted".into()));
                    }
                    // A restart loses the engine's own tiers; the shared filesystem stays.
                    engine = build().expect("validated");
                    connector.reset();
                    lease_names.clear();
                    shared.leases.lock().clear();
                    restart_pending = true;
                    shared.observed.lock().started_at = unix_now();
                }
            }
            if !engine.has_work() && restart_pending {
                send_events(
                    &events,
                    Vec::new(),
                    &shared,
                    std::mem::take(&mut restart_pending),
                );
            }
        }
        if !engine.has_work() {
            continue;
        }
        let step = engine.step_at(mount.epoch.elapsed().as_secs_f64() * time_scale);
        if step.tokens.is_empty() && step.events.is_empty() && step.work == Default::default() {
            blocked = true;
            continue;
        }
        let slow = shared.faults.lock().slow_factor.max(0.01);
        let engine_seconds = step.duration_s * slow;
        let now = Instant::now();
        if now > clock + Duration::from_millis(500)
            && last_lag_warning.is_none_or(|t: Instant| t.elapsed() > Duration::from_secs(10))
        {
            warn!(
                behind_ms = (now - clock).as_millis() as u64,
                "the simulator is falling behind real time (CPU starved?): simulated latencies are longer than the model says"
            );
            last_lag_warning = Some(now);
        }
        clock = clock.max(now - Duration::from_millis(50))
            + Duration::from_secs_f64(engine_seconds / time_scale);
        // Tokio's timer has a 1 ms granularity: shorter waits would round up to a whole
        // millisecond, so they are skipped (the clock keeps the debt and later steps catch up).
        if clock > Instant::now() + Duration::from_millis(1) {
            tokio::time::sleep_until(clock).await;
        } else {
            tokio::task::yield_now().await;
        }
        {
            let mut observed = shared.observed.lock();
            observed.metrics = engine.metrics();
            for token in &step.tokens {
                if let Some((_, submitted)) = waiters.get(&token.id)
                    && token.index == 0
                {
                    // Reported latencies are in engine time: wall time scaled back.
                    observed.observe_ttft(submitted.elapsed().as_secs_f64() * time_scale);
                }
            }
        }
        for token in step.tokens {
            let id = token.id;
            let finished = token.finished.is_some();
            if finished
                && let Some(name) = lease_names.remove(&id)
                && let Some(held) = engine.held(id)
            {
                // Held until pulled or expired, whether or not the client is still there.
                shared
                    .leases
                    .lock()
                    .hold(id, name, held.clone(), Instant::now());
                if let Some((tx, _)) = waiters.get(&id) {
                    let _ = tx.send(Delivery::Held(held.clone()));
                }
            }
            let gone = match waiters.get(&id) {
                Some((tx, _)) => tx.send(Delivery::Token(token)).is_err(),
                None => true,
            };
            if gone && !finished {
                engine.abort(id);
            }
            if gone || finished {
                waiters.remove(&id);
            }
        }
        send_events(
            &events,
            connector.shape(step.events),
            &shared,
            std::mem::take(&mut restart_pending),
        );
    }
}

fn send_events(
    events: &mpsc::UnboundedSender<Outgoing>,
    batch: Vec<kvroute_core::event::KvEvent>,
    shared: &EngineShared,
    restart: bool,
) {
    if batch.is_empty() && !restart {
        return;
    }
    let (delay, drop) = {
        let faults = shared.faults.lock();
        (faults.event_delay, faults.drop_event_fraction)
    };
    let lost = drop > 0.0 && rand::rng().random_bool(drop.clamp(0.0, 1.0));
    let ts = unix_now();
    let outgoing = Outgoing {
        batch: EventBatch {
            ts,
            events: batch,
            data_parallel_rank: Some(0),
        },
        not_before: Instant::now() + delay,
        lost,
        restart,
    };
    if events.send(outgoing).is_err() {
        warn!("event publisher stopped");
    }
}

/// Seconds since the Unix epoch.
pub(super) fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}
