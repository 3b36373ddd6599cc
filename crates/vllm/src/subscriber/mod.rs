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

mod feed;
pub mod log_limit;
mod replay;
pub mod sequencer;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvroute_core::event::EventBatch;
use kvroute_core::index::{EndpointId, SharedIndex};
use parking_lot::Mutex;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tracing::{info, warn};
use zeromq::{Socket, SocketEvent, SocketOptions, SocketRecv, SubSocket};

use sequencer::Action;

use feed::Feed;
pub use feed::FeedStats;
pub use replay::{ReplayError, ReplayItem, fetch_replay, parse_replay_reply};

use crate::VllmError;
use crate::codec::parse_frames;

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
    /// First wait after a failed connection; doubles up to `max_backoff`.
    pub min_backoff: Duration,
    /// Longest wait between connection attempts.
    pub max_backoff: Duration,
    /// How long a replay may stay silent before it is abandoned.
    pub replay_timeout: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(5),
            min_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(10),
            replay_timeout: Duration::from_secs(2),
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
    Live(Vec<Bytes>),
    SocketEvent(SocketEvent),
    Replay {
        feed: Bytes,
        generation: u64,
        item: ReplayItem,
    },
    Closed(String),
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

fn socket_options(timing: &Timing) -> SocketOptions {
    let mut options = SocketOptions::default();
    options.connect_timeout(timing.connect_timeout);
    options
}

/// A feed plus the replay in flight for it; a generation number tells the answers of the
/// current replay from those of an abandoned one.
struct Stream {
    feed: Feed,
    replay_address: Option<String>,
    generation: u64,
    replay_task: Option<JoinHandle<()>>,
}

impl Stream {
    fn new(feed: Feed, replay_address: Option<String>) -> Self {
        Self {
            feed,
            replay_address,
            generation: 0,
            replay_task: None,
        }
    }

    /// Carries out actions, starting the replay they ask for.
    fn run(&mut self, key: &Bytes, actions: Vec<Action>, replayed: bool, ctx: &LoopContext) {
        let replay = self.feed.execute(actions, replayed);
        {
            let mut stats = self.feed.stats.lock();
            stats.caught_up =
                stats.connected && replay.is_none() && !self.feed.sequencer.replaying();
        }
        let Some(from) = replay else {
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
        let tx = ctx.tx.clone();
        let key = key.clone();
        let timing = ctx.timing.clone();
        self.replay_task = Some(tokio::spawn(async move {
            let (items_tx, mut items_rx) = mpsc::channel(1024);
            let fetch = tokio::spawn(fetch_replay(
                address,
                from,
                timing.connect_timeout,
                timing.replay_timeout,
                items_tx,
            ));
            while let Some(item) = items_rx.recv().await {
                let input = Input::Replay {
                    feed: key.clone(),
                    generation,
                    item,
                };
                if tx.send(input).await.is_err() {
                    break;
                }
            }
            fetch.abort();
        }));
    }

    fn on_live(&mut self, key: &Bytes, msg: crate::codec::RawMessage, ctx: &LoopContext) {
        let actions = self.feed.sequencer.on_live(msg);
        self.run(key, actions, false, ctx);
    }

    fn on_connect(&mut self, key: &Bytes, ctx: &LoopContext) {
        let actions = self.feed.sequencer.on_connect();
        self.run(key, actions, false, ctx);
    }

    fn on_replay(&mut self, key: &Bytes, generation: u64, item: ReplayItem, ctx: &LoopContext) {
        if generation != self.generation {
            return;
        }
        let actions = match item {
            ReplayItem::Batch(msg) => self.feed.sequencer.on_replayed(msg),
            ReplayItem::End => self.feed.sequencer.on_replay_end(),
            ReplayItem::Failed(reason) => {
                warn!(endpoint = %self.feed.name, %reason, "KV-event replay failed");
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

struct LoopContext {
    tx: mpsc::Sender<Input>,
    timing: Timing,
}

/// Spawns the subscriber of one engine (connect topology) on the current tokio runtime.
pub fn spawn_connected(
    source: EndpointSource,
    sink: Arc<dyn EventSink>,
    timing: Timing,
) -> SubscriberHandle {
    spawn_connected_after(source, sink, timing, None)
}

/// [`spawn_connected`], for a sink that already holds every batch up to `resume_after` (a
/// snapshot): the first connection replays from the batch after it.
pub fn spawn_connected_after(
    source: EndpointSource,
    sink: Arc<dyn EventSink>,
    timing: Timing,
    resume_after: Option<u64>,
) -> SubscriberHandle {
    let mut feed = Feed::new(
        source.endpoint,
        source.name.clone(),
        source.replay.is_some(),
        sink,
    );
    if let Some(seq) = resume_after {
        feed.sequencer.resume_after(seq);
    }
    let stats = Arc::new(Mutex::new(HashMap::from([(
        source.name.clone(),
        feed.stats.clone(),
    )])));
    let stream = Stream::new(feed, source.replay.clone());
    let task = tokio::spawn(run_connected(source, stream, timing));
    SubscriberHandle { task, stats }
}

async fn run_connected(source: EndpointSource, mut stream: Stream, timing: Timing) {
    let key = Bytes::new();
    let mut backoff = timing.min_backoff;
    loop {
        let mut sub = SubSocket::with_options(socket_options(&timing));
        let monitor = sub.monitor();
        if let Err(e) = sub.connect(&source.publisher).await {
            warn!(endpoint = %source.name, publisher = %source.publisher, error = %e,
                retry_in = ?backoff, "cannot connect to KV-event publisher");
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(timing.max_backoff);
            continue;
        }
        backoff = timing.min_backoff;
        if let Err(e) = sub.subscribe(&source.topic).await {
            warn!(endpoint = %source.name, error = %e, "cannot subscribe; reconnecting");
            continue;
        }
        info!(endpoint = %source.name, publisher = %source.publisher, "subscribed to KV events");
        stream.set_connected(true);
        let (tx, mut rx) = mpsc::channel(4096);
        let ctx = LoopContext {
            tx: tx.clone(),
            timing: timing.clone(),
        };
        let reader = spawn_reader(sub, monitor, tx);
        stream.on_connect(&key, &ctx);

        let mut down = false;
        while let Some(input) = rx.recv().await {
            match input {
                Input::Live(frames) => {
                    if let Some(msg) = checked_message(&mut stream.feed, &source.topic, &frames) {
                        stream.on_live(&key, msg, &ctx);
                    }
                }
                Input::Replay {
                    generation, item, ..
                } => stream.on_replay(&key, generation, item, &ctx),
                Input::SocketEvent(SocketEvent::Disconnected(_)) => {
                    stream.set_connected(false);
                    down = true;
                    warn!(endpoint = %source.name, "KV-event publisher disconnected; reconnecting");
                }
                Input::SocketEvent(SocketEvent::Connected(..)) if down => {
                    down = false;
                    stream.set_connected(true);
                    info!(endpoint = %source.name, "KV-event publisher reconnected; catching up");
                    stream.on_connect(&key, &ctx);
                }
                Input::SocketEvent(_) => {}
                Input::Closed(reason) => {
                    warn!(endpoint = %source.name, %reason, "KV-event socket closed; reconnecting");
                    break;
                }
            }
        }
        reader.abort();
        stream.set_connected(false);
        tokio::time::sleep(backoff).await;
    }
}

/// Splits frames and checks the topic, counting what is wrong (and logging it, rate-limited).
fn checked_message(
    feed: &mut Feed,
    topic: &str,
    frames: &[Bytes],
) -> Option<crate::codec::RawMessage> {
    let msg = match parse_frames(frames) {
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

fn spawn_reader(
    mut sub: SubSocket,
    mut monitor: futures::channel::mpsc::Receiver<SocketEvent>,
    tx: mpsc::Sender<Input>,
) -> JoinHandle<()> {
    let events = tx.clone();
    let monitor_task = tokio::spawn(async move {
        use futures::StreamExt;
        while let Some(event) = monitor.next().await {
            if events.send(Input::SocketEvent(event)).await.is_err() {
                break;
            }
        }
    });
    tokio::spawn(async move {
        loop {
            match sub.recv().await {
                Ok(msg) => {
                    if tx.send(Input::Live(msg.into_vec())).await.is_err() {
                        break;
                    }
                }
                Err(e) => {
                    let _ = tx.send(Input::Closed(e.to_string())).await;
                    break;
                }
            }
        }
        monitor_task.abort();
    })
}

/// What the bind topology knows about a topic's publisher.
#[derive(Clone, Debug)]
pub struct TopicSource {
    /// The index's id for this endpoint.
    pub endpoint: EndpointId,
    /// A name for logs.
    pub name: String,
    /// The publisher's replay ROUTER address, if known.
    pub replay: Option<String>,
}

/// Maps a message topic to its endpoint; `None` drops the topic's messages (counted).
pub type TopicResolver = Box<dyn FnMut(&str) -> Option<TopicSource> + Send>;

/// The endpoint name in an llm-d style topic `kv@<host:port>@<model>`.
pub fn endpoint_from_topic(topic: &str) -> Option<&str> {
    let mut parts = topic.splitn(3, '@');
    match (parts.next(), parts.next()) {
        (Some(_), Some(endpoint)) if !endpoint.is_empty() => Some(endpoint),
        _ => None,
    }
}

/// A bound subscriber: its handle plus the address it listens on (with the real port when
/// `tcp://host:0` was asked for).
pub struct BoundSubscriber {
    /// The running task.
    pub handle: SubscriberHandle,
    /// Where engines should connect.
    pub address: String,
}

/// Binds one SUB socket that engines connect to (bind topology) and demultiplexes by topic.
pub async fn spawn_bound(
    address: &str,
    mut resolve: TopicResolver,
    sink: Arc<dyn EventSink>,
    timing: Timing,
) -> Result<BoundSubscriber, VllmError> {
    let mut sub = SubSocket::with_options(socket_options(&timing));
    let monitor = sub.monitor();
    let bound = sub
        .bind(address)
        .await
        .map_err(|e| VllmError::zmq(format!("bind {address}"), e))?;
    sub.subscribe("")
        .await
        .map_err(|e| VllmError::zmq("subscribe", e))?;
    let stats: StatsMap = Arc::default();
    let stats_out = stats.clone();
    let task = tokio::spawn(async move {
        let (tx, mut rx) = mpsc::channel(4096);
        let ctx = LoopContext {
            tx: tx.clone(),
            timing,
        };
        let _reader = spawn_reader(sub, monitor, tx);
        let mut streams: HashMap<Bytes, Stream> = HashMap::new();
        let mut unresolved: u64 = 0;
        while let Some(input) = rx.recv().await {
            match input {
                Input::Live(frames) => {
                    let Some(topic) = frames.first().cloned() else {
                        continue;
                    };
                    if !streams.contains_key(&topic) {
                        let name = String::from_utf8_lossy(&topic).into_owned();
                        let Some(source) = resolve(&name) else {
                            unresolved += 1;
                            if unresolved.is_power_of_two() {
                                warn!(topic = %name, dropped = unresolved, "KV events on a topic that names no known endpoint");
                            }
                            continue;
                        };
                        let feed = Feed::new(
                            source.endpoint,
                            source.name.clone(),
                            source.replay.is_some(),
                            sink.clone(),
                        );
                        stats.lock().insert(source.name.clone(), feed.stats.clone());
                        let mut stream = Stream::new(feed, source.replay);
                        stream.set_connected(true);
                        info!(endpoint = %source.name, topic = %name, "new KV-event publisher");
                        stream.on_connect(&topic, &ctx);
                        streams.insert(topic.clone(), stream);
                    }
                    let stream = streams.get_mut(&topic).expect("inserted above");
                    if let Some(msg) = checked_message(&mut stream.feed, "", &frames) {
                        stream.on_live(&topic, msg, &ctx);
                    }
                }
                Input::Replay {
                    feed,
                    generation,
                    item,
                } => {
                    if let Some(stream) = streams.get_mut(&feed) {
                        stream.on_replay(&feed, generation, item, &ctx);
                    }
                }
                Input::SocketEvent(_) => {}
                Input::Closed(reason) => {
                    warn!(%reason, "bound KV-event socket closed");
                    break;
                }
            }
        }
    });
    Ok(BoundSubscriber {
        handle: SubscriberHandle {
            task,
            stats: stats_out,
        },
        address: bound.to_string(),
    })
}

/// The sequence number of the replay end marker.
pub fn replay_end_marker_seq() -> u64 {
    replay::END_MARKER_SEQ
}
