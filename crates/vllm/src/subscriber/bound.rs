//! The bind topology: kvroute listens, engines connect, and each message's topic says which
//! endpoint it comes from. Every publisher connection is read on its own task; one that breaks
//! the protocol loses only its own connection.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use kvroute_core::index::EndpointId;
use parking_lot::Mutex;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, mpsc};
use tokio::task::JoinSet;
use tracing::{debug, info, warn};

use super::feed::Feed;
use super::log_limit::{LogLimiter, Verdict};
use super::{
    AbortOnDrop, EventSink, FeedStats, Input, LiveQueue, LoopContext, QUEUE, StatsMap, Stream,
    SubscriberConfig, SubscriberHandle, checked_message, quiet_ticks, read_publisher,
};
use crate::VllmError;
use crate::zmtp::{Connection, SocketType, ZmtpError, connection};

/// Most publishers connected at once; more are refused until one leaves.
pub const MAX_PUBLISHERS: usize = 1024;

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

/// Listens on `address` (bind topology) and demultiplexes the publishers' messages by topic.
pub async fn spawn_bound(
    address: &str,
    resolve: TopicResolver,
    sink: Arc<dyn EventSink>,
    config: impl Into<SubscriberConfig>,
) -> Result<BoundSubscriber, VllmError> {
    let (listener, bound) = connection::bind(address)
        .await
        .map_err(|source| VllmError::Zmtp {
            context: format!("bind {address}"),
            source,
        })?;
    let config = config.into();
    let stats: StatsMap = Arc::default();
    let unattributed: Arc<Mutex<FeedStats>> = Arc::default();
    let (tx, rx) = mpsc::channel(QUEUE);
    let ctx = LoopContext::new(tx, config.clone());
    let acceptor = tokio::spawn(accept_publishers(listener, config, ctx.queue.clone()));
    let demux = Demux {
        ctx,
        resolve,
        sink,
        stats: stats.clone(),
        unattributed: unattributed.clone(),
        unattributed_log: LogLimiter::new(),
        streams: HashMap::new(),
        unresolved: 0,
    };
    let task = tokio::spawn(demux.run(rx, AbortOnDrop(acceptor)));
    Ok(BoundSubscriber {
        handle: SubscriberHandle {
            task,
            stats,
            unattributed,
        },
        address: bound,
    })
}

/// Accepts publishers, at most [`MAX_PUBLISHERS`] at once, each read on its own task (all of
/// them end with this one).
async fn accept_publishers(listener: TcpListener, config: SubscriberConfig, queue: LiveQueue) {
    let slots = Arc::new(Semaphore::new(MAX_PUBLISHERS));
    let mut publishers = JoinSet::new();
    loop {
        while publishers.try_join_next().is_some() {}
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return;
        };
        let (socket, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(error) => {
                warn!(%error, "cannot accept a KV-event publisher; retrying");
                tokio::time::sleep(config.timing.min_backoff).await;
                continue;
            }
        };
        let options = config.connection_options();
        let queue = queue.clone();
        publishers.spawn(async move {
            let _slot = slot;
            let conn = async {
                let mut conn = Connection::handshake(socket, SocketType::Sub, options).await?;
                conn.subscribe(b"").await?;
                Ok::<_, ZmtpError>(conn)
            };
            match conn.await {
                Ok(conn) => {
                    debug!(%peer, "KV-event publisher connected");
                    read_publisher(conn, queue).await;
                }
                Err(error) => {
                    let _ = queue
                        .tx
                        .send(Input::Ended {
                            last_topic: None,
                            error,
                        })
                        .await;
                }
            }
        });
    }
}

/// The bound subscriber's event loop: one [`Stream`] per topic.
struct Demux {
    ctx: LoopContext,
    resolve: TopicResolver,
    sink: Arc<dyn EventSink>,
    stats: StatsMap,
    unattributed: Arc<Mutex<FeedStats>>,
    unattributed_log: LogLimiter,
    streams: HashMap<Bytes, Stream>,
    unresolved: u64,
}

impl Demux {
    async fn run(mut self, mut rx: mpsc::Receiver<Input>, _acceptor: AbortOnDrop) {
        let mut quiet = quiet_ticks(self.ctx.config.timing.tail_check_after);
        loop {
            let input = tokio::select! {
                input = rx.recv() => input,
                _ = quiet.tick() => {
                    for (topic, stream) in &mut self.streams {
                        stream.check_quiet(topic, std::time::Instant::now(), &self.ctx);
                    }
                    continue;
                }
            };
            let Some(input) = input else {
                return;
            };
            match input {
                Input::Live(frames, _queued) => self.on_live(frames),
                Input::Replay {
                    feed,
                    generation,
                    item,
                    queued: _queued,
                } => {
                    if let Some(stream) = self.streams.get_mut(&feed) {
                        stream.on_replay(&feed, generation, item, &self.ctx);
                    }
                }
                Input::Ended { last_topic, error } => self.on_ended(last_topic, &error),
            }
        }
    }

    fn on_live(&mut self, frames: Vec<Bytes>) {
        let Some(topic) = frames.first().cloned() else {
            return;
        };
        if !self.streams.contains_key(&topic) {
            let name = String::from_utf8_lossy(&topic).into_owned();
            let Some(source) = (self.resolve)(&name) else {
                self.unresolved += 1;
                if self.unresolved.is_power_of_two() {
                    warn!(topic = %name, dropped = self.unresolved, "KV events on a topic that names no known endpoint");
                }
                return;
            };
            let feed = Feed::new(
                source.endpoint,
                source.name.clone(),
                source.replay.is_some(),
                self.sink.clone(),
                self.ctx.config.held_bytes(),
            );
            self.stats
                .lock()
                .insert(source.name.clone(), feed.stats.clone());
            let mut stream = Stream::new(feed, source.replay, &self.ctx.config.timing);
            stream.set_connected(true);
            info!(endpoint = %source.name, topic = %name, "new KV-event publisher");
            stream.on_connect(&topic, &self.ctx);
            self.streams.insert(topic.clone(), stream);
        }
        let stream = self.streams.get_mut(&topic).expect("inserted above");
        // Back after its connection ended.
        stream.set_connected(true);
        if let Some(msg) = checked_message(&mut stream.feed, "", &frames) {
            stream.on_live(&topic, msg, &self.ctx);
        }
    }

    /// A publisher connection ended: a protocol violation is counted on its endpoint when its
    /// messages named one, else among the unattributed.
    fn on_ended(&mut self, last_topic: Option<Bytes>, error: &ZmtpError) {
        if let Some(stream) = last_topic.and_then(|t| self.streams.get_mut(&t)) {
            // Not checked for a lost tail while gone: it may never come back.
            stream.set_connected(false);
            if !stream.feed.connection_failed(error) {
                debug!(endpoint = %stream.feed.name, %error, "KV-event publisher left");
            }
            return;
        }
        if !error.is_protocol_violation() {
            debug!(%error, "KV-event publisher left before naming its topic");
            return;
        }
        {
            let mut stats = self.unattributed.lock();
            stats.protocol_errors += 1;
            stats.oversized_messages += u64::from(error.is_too_large());
        }
        if let Verdict::Log { suppressed } = self.unattributed_log.check(std::time::Instant::now())
        {
            warn!(%error, suppressed, "a KV-event publisher broke the protocol; dropping its connection");
        }
    }
}
