//! Live KV-event ingestion over ZMQ.
//!
//! Two topologies, as vLLM supports both:
//! - **connect** ([`spawn_connected`]): kvroute's SUB connects to each engine's bound PUB
//!   (`tcp://engine:5557`, data-parallel rank r on port + r), one task per endpoint, so a slow
//!   or dead engine never stalls another.
//! - **bind** ([`spawn_bound`]): kvroute binds one SUB and engines connect to it; each message's
//!   topic (`kv@<host:port>@<model>`, as llm-d uses, or a configured name) says which endpoint
//!   it comes from.
//!
//! Every stream goes through a [`sequencer::Sequencer`]: gaps are filled from the engine's
//! replay ROUTER socket, a backwards sequence purges the endpoint, and what cannot be recovered
//! is reported ([`EventSink::unfilled_gap`], [`FeedStats`]) rather than silently absorbed.
//!
//! The sockets are kvroute's own bounded ZMTP client ([`crate::zmtp`]): a publisher that sends
//! a frame or message over [`SubscriberConfig::limits`], or otherwise breaks the protocol, loses
//! that one connection (counted in [`FeedStats::protocol_errors`], logged rate-limited) and is
//! reconnected to with growing backoff.

mod bound;
mod connected;
mod feed;
pub mod log_limit;
mod quiet;
mod replay;
pub mod sequencer;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvroute_core::event::EventBatch;
use kvroute_core::index::{EndpointId, SharedIndex};
use parking_lot::Mutex;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::task::JoinHandle;
use tracing::warn;

use sequencer::Action;

pub use bound::{BoundSubscriber, TopicResolver, TopicSource, endpoint_from_topic, spawn_bound};
pub use connected::{spawn_connected, spawn_connected_after};
use feed::Feed;
pub use feed::FeedStats;
use quiet::TailChecks;
pub use replay::{ReplayError, ReplayItem, fetch_replay, parse_replay_reply};

use crate::VllmError;
use crate::codec::parse_frames;
use crate::zmtp::connection::{Heartbeat, Options};
use crate::zmtp::{Connection, Limits, ZmtpError};

/// Where decoded batches go: the KV index, a printer, or both.
pub trait EventSink: Send + Sync + 'static {
    /// Applies one decoded batch of `endpoint`'s, in sequence order.
    fn apply(&self, endpoint: EndpointId, seq: u64, batch: &EventBatch);
    /// The engine restarted: forget what it held.
    fn purge(&self, endpoint: EndpointId);
    /// Batches `from..=to` are lost for good; the endpoint's picture may be stale.
    fn unfilled_gap(&self, _endpoint: EndpointId, _from: u64, _to: u64) {}
}

impl EventSink for SharedIndex {
    fn apply(&self, endpoint: EndpointId, _seq: u64, batch: &EventBatch) {
        SharedIndex::apply(self, endpoint, &batch.events);
    }

    fn purge(&self, endpoint: EndpointId) {
        self.clear_endpoint(endpoint);
    }
}

/// Timing of a subscriber's connections and replays.
#[derive(Clone, Debug)]
pub struct Timing {
    /// How long one connection attempt may take.
    pub connect_timeout: Duration,
    /// How long the ZMTP handshake (greeting, READY) and any one write may take.
    pub handshake_timeout: Duration,
    /// Silence after which a ZMTP 3.1 publisher is pinged, and after which it is given up.
    pub heartbeat: Heartbeat,
    /// First wait after a failed connection; doubles up to `max_backoff`.
    pub min_backoff: Duration,
    /// Longest wait between connection attempts.
    pub max_backoff: Duration,
    /// How long a replay may stay silent before it is abandoned.
    pub replay_timeout: Duration,
    /// Silence on a stream after which its replay socket is asked for anything published
    /// after the last batch applied (a PUB socket drops what overflows its high-water mark, and
    /// with nothing published after it the loss would not show); asked again at doubling
    /// intervals, at most a minute apart, while the stream stays quiet and connected. At
    /// least 10 ms.
    pub tail_check_after: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(5),
            handshake_timeout: Duration::from_secs(5),
            heartbeat: Heartbeat::default(),
            min_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(10),
            replay_timeout: Duration::from_secs(2),
            tail_check_after: Duration::from_secs(1),
        }
    }
}

/// A subscriber's timing and bounds.
#[derive(Clone, Debug, Default)]
pub struct SubscriberConfig {
    /// Timeouts and backoff.
    pub timing: Timing,
    /// Bounds on what one publisher may make kvroute buffer.
    pub limits: Limits,
}

impl From<Timing> for SubscriberConfig {
    fn from(timing: Timing) -> Self {
        Self {
            timing,
            limits: Limits::default(),
        }
    }
}

impl SubscriberConfig {
    /// Payload bytes of live messages a stream may hold while a replay is in flight: what its
    /// queue holds, [`QUEUED_LARGEST_MESSAGES`] of the largest.
    fn held_bytes(&self) -> usize {
        queued_bytes(self.limits)
    }

    fn connection_options(&self) -> Options {
        Options {
            connect_timeout: self.timing.connect_timeout,
            handshake_timeout: self.timing.handshake_timeout,
            limits: self.limits,
            heartbeat: self.timing.heartbeat,
        }
    }
}

/// One engine endpoint's event sources, for the connect topology.
#[derive(Clone, Debug)]
pub struct EndpointSource {
    /// The index's id for this endpoint.
    pub endpoint: EndpointId,
    /// A name for logs (usually the engine's HTTP address).
    pub name: String,
    /// The engine's PUB address, e.g. `tcp://10.0.0.5:5557`.
    pub publisher: String,
    /// The engine's replay ROUTER address, if it has one.
    pub replay: Option<String>,
    /// The engine's topic (`""` accepts any, as vLLM's default topic is empty).
    pub topic: String,
}

type StatsMap = Arc<Mutex<HashMap<String, Arc<Mutex<FeedStats>>>>>;

/// A running subscriber task. Dropping the handle stops it.
pub struct SubscriberHandle {
    task: JoinHandle<()>,
    stats: StatsMap,
    /// Counters of publisher connections not yet tied to an endpoint (bind topology: those
    /// that failed before their first message named a topic).
    unattributed: Arc<Mutex<FeedStats>>,
}

impl SubscriberHandle {
    /// A snapshot of every stream's counters, by endpoint name.
    pub fn stats(&self) -> Vec<(String, FeedStats)> {
        let mut all: Vec<_> = self
            .stats
            .lock()
            .iter()
            .map(|(name, s)| (name.clone(), s.lock().clone()))
            .collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }

    /// Counters of publisher connections that failed before naming their endpoint (bind
    /// topology only; the connect topology counts every failure on its endpoint).
    pub fn unattributed_stats(&self) -> FeedStats {
        self.unattributed.lock().clone()
    }

    /// Stops the subscriber.
    pub fn stop(&self) {
        self.task.abort();
    }
}

impl Drop for SubscriberHandle {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Everything an event loop reacts to.
enum Input {
    /// A message from a publisher connection, with its share of the queue's byte budget.
    Live(Vec<Bytes>, QueuedBytes),
    /// An answer of a replay, with its share of the queue's byte budget.
    Replay {
        feed: Bytes,
        generation: u64,
        item: ReplayItem,
        queued: QueuedBytes,
    },
    /// A publisher connection ended; `last_topic` is the topic of its last message, if any.
    Ended {
        last_topic: Option<Bytes>,
        error: ZmtpError,
    },
}

/// The address a data-parallel rank publishes on: vLLM adds the rank to the port after the last
/// colon of a TCP address.
pub fn address_for_rank(address: &str, rank: u16) -> Result<String, VllmError> {
    if rank == 0 {
        return Ok(address.to_owned());
    }
    let bad = |reason: &str| VllmError::Address {
        address: address.to_owned(),
        reason: reason.to_owned(),
    };
    if !address.starts_with("tcp://") {
        return Err(bad("data-parallel offsets apply only to tcp:// addresses"));
    }
    let (host, port) = address.rsplit_once(':').ok_or_else(|| bad("no port"))?;
    let port: u16 = port.parse().map_err(|_| bad("port is not a number"))?;
    let port = port
        .checked_add(rank)
        .ok_or_else(|| bad("port + rank overflows"))?;
    Ok(format!("{host}:{port}"))
}

/// A feed plus the replay in flight for it; a generation number tells the answers of the
/// current replay from those of an abandoned one.
struct Stream {
    feed: Feed,
    replay_address: Option<String>,
    generation: u64,
    replay_task: Option<JoinHandle<()>>,
    /// When to ask the replay socket for a lost tail while the stream is quiet.
    tail_checks: TailChecks,
}

impl Stream {
    fn new(feed: Feed, replay_address: Option<String>, timing: &Timing) -> Self {
        Self {
            feed,
            replay_address,
            generation: 0,
            replay_task: None,
            tail_checks: TailChecks::new(timing.tail_check_after, Instant::now()),
        }
    }

    /// Asks the replay socket for the stream's tail when a check is due (the stream has been
    /// quiet a while) and the sequencer has none in flight.
    fn check_quiet(&mut self, key: &Bytes, now: Instant, ctx: &LoopContext) {
        // A departed engine (bound topology) is asked again when it speaks again.
        if !self.tail_checks.due(now) || !self.feed.stats.lock().connected {
            return;
        }
        let actions = self.feed.sequencer.on_quiet();
        if actions.is_empty() {
            return;
        }
        self.tail_checks.checked(now);
        self.feed.stats.lock().tail_checks += 1;
        self.run(key, actions, false, ctx);
    }

    /// Carries out actions, starting the replay they ask for.
    fn run(&mut self, key: &Bytes, actions: Vec<Action>, replayed: bool, ctx: &LoopContext) {
        let replay = self.feed.execute(actions, replayed);
        {
            // A tail check is routine, not a sign of being behind (replica warm-up waits for
            // every stream caught up at once).
            let mut stats = self.feed.stats.lock();
            stats.caught_up = stats.connected && !self.feed.sequencer.catching_up();
        }
        let Some(from) = replay else {
            // No replay in flight (one ended, or a tail check the live stream made moot): its
            // fetch, if still running, has nothing left to deliver.
            if !self.feed.sequencer.replaying()
                && let Some(task) = self.replay_task.take()
            {
                task.abort();
            }
            return;
        };
        let Some(address) = self.replay_address.clone() else {
            return;
        };
        self.generation += 1;
        if let Some(task) = self.replay_task.take() {
            task.abort();
        }
        let generation = self.generation;
        let queue = ctx.queue.clone();
        let key = key.clone();
        let options = ctx.config.connection_options();
        let replay_timeout = ctx.config.timing.replay_timeout;
        self.replay_task = Some(tokio::spawn(async move {
            // One item in hand at a time: the queue's byte budget bounds the rest.
            let (items_tx, mut items_rx) = mpsc::channel(1);
            let fetch = tokio::spawn(fetch_replay(
                address,
                from,
                options,
                replay_timeout,
                items_tx,
            ));
            while let Some(item) = items_rx.recv().await {
                let size = match &item {
                    ReplayItem::Batch(msg) => msg.frame_bytes() + 8,
                    _ => 0,
                };
                let Some(queued) = queue.reserve(size).await else {
                    break;
                };
                let input = Input::Replay {
                    feed: key.clone(),
                    generation,
                    item,
                    queued,
                };
                if queue.tx.send(input).await.is_err() {
                    break;
                }
            }
            fetch.abort();
        }));
    }

    fn on_live(&mut self, key: &Bytes, msg: crate::codec::RawMessage, ctx: &LoopContext) {
        self.tail_checks.heard(Instant::now());
        let actions = self.feed.sequencer.on_live(msg);
        self.run(key, actions, false, ctx);
    }

    fn on_connect(&mut self, key: &Bytes, ctx: &LoopContext) {
        self.tail_checks.heard(Instant::now());
        let actions = self.feed.sequencer.on_connect();
        self.run(key, actions, false, ctx);
    }

    fn on_replay(&mut self, key: &Bytes, generation: u64, item: ReplayItem, ctx: &LoopContext) {
        // An answer to a replay replaced by a newer one, or given up (a tail check the live
        // stream made moot): nothing to apply, log or count.
        if generation != self.generation || !self.feed.sequencer.replaying() {
            return;
        }
        let actions = match item {
            ReplayItem::Batch(msg) => self.feed.sequencer.on_replayed(msg),
            ReplayItem::End => self.feed.sequencer.on_replay_end(),
            ReplayItem::Failed(reason) => {
                warn!(endpoint = %self.feed.name, %reason, "KV-event replay failed");
                self.feed.sequencer.on_replay_failed()
            }
            ReplayItem::Refused { reason, oversized } => {
                self.feed.count_protocol_error(oversized, &reason);
                self.feed.sequencer.on_replay_failed()
            }
        };
        self.run(key, actions, true, ctx);
    }

    fn set_connected(&self, up: bool) {
        let mut stats = self.feed.stats.lock();
        if up && !stats.connected {
            stats.connects += 1;
        }
        if !up && stats.connected {
            stats.disconnects += 1;
        }
        stats.connected = up;
        if !up {
            stats.caught_up = false;
        }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if let Some(task) = self.replay_task.take() {
            task.abort();
        }
    }
}

/// The ticks at which an event loop looks for quiet streams: every `tail_check_after`,
/// kept between [`quiet::MIN_SPACING`] and an hour (a zero or huge setting must not spin or
/// overflow).
fn quiet_ticks(tail_check_after: Duration) -> tokio::time::Interval {
    let period = tail_check_after.clamp(quiet::MIN_SPACING, Duration::from_secs(3600));
    let mut ticks = tokio::time::interval(period);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks
}

struct LoopContext {
    queue: LiveQueue,
    config: SubscriberConfig,
}

impl LoopContext {
    fn new(tx: mpsc::Sender<Input>, config: SubscriberConfig) -> Self {
        Self {
            queue: LiveQueue::new(tx, config.limits),
            config,
        }
    }
}

/// Messages queued between a subscriber's connections and its event loop.
const QUEUE: usize = 4096;

/// Bytes of live messages queued at once, in messages of the largest size allowed: a fast
/// publisher waits on the event loop instead of growing the queue.
pub(super) const QUEUED_LARGEST_MESSAGES: usize = 4;

/// The live queue's budget in bytes under `limits`: [`QUEUED_LARGEST_MESSAGES`] of the largest
/// message.
fn queued_bytes(limits: Limits) -> usize {
    limits
        .max_message_bytes
        .saturating_mul(QUEUED_LARGEST_MESSAGES)
}

/// A message's bytes in the queue's budget, given back when the event loop drops it.
struct QueuedBytes {
    _permit: OwnedSemaphorePermit,
}

/// Where a subscriber's connections and replays send what they read: the event loop's queue,
/// bounded in messages and in bytes.
#[derive(Clone)]
struct LiveQueue {
    tx: mpsc::Sender<Input>,
    bytes: Arc<Semaphore>,
}

impl LiveQueue {
    fn new(tx: mpsc::Sender<Input>, limits: Limits) -> Self {
        let budget = queued_bytes(limits);
        Self {
            tx,
            bytes: Arc::new(Semaphore::new(budget.min(Semaphore::MAX_PERMITS))),
        }
    }

    /// Waits until `size` more bytes fit the budget (a message is at most the limit, a quarter
    /// of the budget); `None` if the budget is gone.
    async fn reserve(&self, size: usize) -> Option<QueuedBytes> {
        let wanted = u32::try_from(size.max(1)).unwrap_or(u32::MAX);
        let permit = self.bytes.clone().acquire_many_owned(wanted).await.ok()?;
        Some(QueuedBytes { _permit: permit })
    }

    /// Queues a live message once its bytes fit the budget; `false` when the event loop is
    /// gone.
    async fn send(&self, frames: Vec<Bytes>) -> bool {
        let size: usize = frames.iter().map(Bytes::len).sum();
        let Some(queued) = self.reserve(size).await else {
            return false;
        };
        self.tx.send(Input::Live(frames, queued)).await.is_ok()
    }
}

/// Aborts a task when dropped: a task that serves another ends with it, also when that one is
/// aborted (a stopped or resubscribed endpoint's subscriber).
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Reads one publisher connection until it fails, passing its messages to the event loop; the
/// reader ends, and its connection closes, when the returned guard is dropped.
fn spawn_reader(conn: Connection, queue: LiveQueue) -> AbortOnDrop {
    AbortOnDrop(tokio::spawn(read_publisher(conn, queue)))
}

/// Reads one publisher connection until it fails, passing its messages and then its end to the
/// event loop.
async fn read_publisher(mut conn: Connection, queue: LiveQueue) {
    let mut last_topic = None;
    loop {
        match conn.recv().await {
            Ok(frames) => {
                last_topic = frames.first().cloned();
                if !queue.send(frames).await {
                    return;
                }
            }
            Err(error) => {
                let _ = queue.tx.send(Input::Ended { last_topic, error }).await;
                return;
            }
        }
    }
}

/// Splits frames and checks the topic, counting what is wrong (and logging it, rate-limited).
fn checked_message(
    feed: &mut Feed,
    topic: &str,
    frames: &[Bytes],
) -> Option<crate::codec::RawMessage> {
    let parsed = parse_frames(frames).and_then(|msg| {
        if msg.seq == replay::END_MARKER_SEQ {
            // Its successor does not exist: no publisher numbers a live batch so.
            Err(crate::VllmError::Framing(format!(
                "live sequence number {} is the replay end marker's",
                msg.seq
            )))
        } else {
            Ok(msg)
        }
    });
    let msg = match parsed {
        Ok(msg) => msg,
        Err(e) => {
            {
                let mut stats = feed.stats.lock();
                stats.framing_errors += 1;
                if frames.len() == 3 {
                    stats.bad_sequence_length += 1;
                } else {
                    stats.bad_frame_count += 1;
                }
            }
            if let log_limit::Verdict::Log { suppressed } =
                feed.bad_input_log.check(std::time::Instant::now())
            {
                warn!(endpoint = %feed.name, error = %e, suppressed, "dropping malformed KV-event message");
            }
            return None;
        }
    };
    if !topic.is_empty() && msg.topic.as_ref() != topic.as_bytes() {
        feed.stats.lock().topic_mismatches += 1;
        return None;
    }
    Some(msg)
}

/// The sequence number of the replay end marker.
pub fn replay_end_marker_seq() -> u64 {
    replay::END_MARKER_SEQ
}

#[cfg(test)]
mod tests {
    use futures::FutureExt;

    use super::*;

    #[tokio::test]
    async fn the_queue_holds_at_most_four_largest_messages_of_bytes() {
        let (tx, mut rx) = mpsc::channel(QUEUE);
        let queue = LiveQueue::new(
            tx,
            Limits {
                max_message_bytes: 100,
                max_command_bytes: 10,
            },
        );
        let message = || vec![Bytes::from(vec![0u8; 60]), Bytes::from(vec![0u8; 40])];
        for _ in 0..QUEUED_LARGEST_MESSAGES {
            assert!(queue.send(message()).await);
        }
        assert!(
            queue.send(message()).now_or_never().is_none(),
            "a fifth waits for the event loop"
        );
        drop(rx.recv().await);
        assert_eq!(queue.send(message()).now_or_never(), Some(true));
    }

    /// A sink that records the gaps it is told of and the batches it applied.
    #[derive(Default)]
    struct GapRecorder {
        gaps: parking_lot::Mutex<Vec<(u64, u64)>>,
        applied: parking_lot::Mutex<Vec<u64>>,
    }

    impl EventSink for GapRecorder {
        fn apply(&self, _endpoint: EndpointId, seq: u64, _batch: &EventBatch) {
            self.applied.lock().push(seq);
        }
        fn purge(&self, _endpoint: EndpointId) {}
        fn unfilled_gap(&self, _endpoint: EndpointId, from: u64, to: u64) {
            self.gaps.lock().push((from, to));
        }
    }

    fn feed(sink: Arc<GapRecorder>) -> Feed {
        Feed::new(EndpointId(0), "e0".into(), false, sink, 1 << 20)
    }

    fn frames(seq: u64, payload: &[u8]) -> Vec<Bytes> {
        vec![
            Bytes::new(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            Bytes::copy_from_slice(payload),
        ]
    }

    #[test]
    fn an_undecodable_batch_is_reported_lost() {
        let sink = Arc::new(GapRecorder::default());
        let mut feed = feed(sink.clone());
        let msg = checked_message(&mut feed, "", &frames(7, b"\xc1\xc1")).unwrap();
        let actions = feed.sequencer.on_live(msg);
        feed.execute(actions, false);
        assert_eq!(
            *sink.gaps.lock(),
            vec![(7, 7)],
            "the fleet is told its picture may be stale"
        );
        assert!(sink.applied.lock().is_empty());
        let stats = feed.stats.lock();
        assert_eq!((stats.decode_errors, stats.lost_batches), (1, 1));
    }

    #[test]
    fn a_live_batch_numbered_as_the_replay_end_marker_is_refused() {
        let sink = Arc::new(GapRecorder::default());
        let mut feed = feed(sink);
        let end = replay::END_MARKER_SEQ;
        assert!(checked_message(&mut feed, "", &frames(end, b"\x90")).is_none());
        assert_eq!(feed.stats.lock().framing_errors, 1);
    }
}
