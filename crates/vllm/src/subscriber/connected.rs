//! The connect topology: kvroute's SUB connects to one engine's bound PUB, and reconnects with
//! growing backoff whenever the connection fails, is refused, or the publisher breaks the
//! protocol.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::sync::mpsc;
use tracing::{info, warn};

use super::feed::Feed;
use super::{
    EndpointSource, EventSink, Input, LoopContext, QUEUE, Stream, SubscriberConfig,
    SubscriberHandle, checked_message, quiet_ticks, spawn_reader,
};
use crate::zmtp::{Connection, SocketType, ZmtpError};

/// Spawns the subscriber of one engine (connect topology) on the current tokio runtime.
pub fn spawn_connected(
    source: EndpointSource,
    sink: Arc<dyn EventSink>,
    config: impl Into<SubscriberConfig>,
) -> SubscriberHandle {
    spawn_connected_after(source, sink, config, None)
}

/// [`spawn_connected`], for a sink that already holds every batch up to `resume_after` (a
/// snapshot): the first connection replays from the batch after it.
pub fn spawn_connected_after(
    source: EndpointSource,
    sink: Arc<dyn EventSink>,
    config: impl Into<SubscriberConfig>,
    resume_after: Option<u64>,
) -> SubscriberHandle {
    let config = config.into();
    let mut feed = Feed::new(
        source.endpoint,
        source.name.clone(),
        source.replay.is_some(),
        sink,
        config.held_bytes(),
    );
    if let Some(seq) = resume_after {
        feed.sequencer.resume_after(seq);
    }
    let stats = Arc::new(Mutex::new(HashMap::from([(
        source.name.clone(),
        feed.stats.clone(),
    )])));
    let stream = Stream::new(feed, source.replay.clone(), &config.timing);
    let task = tokio::spawn(run_connected(source, stream, config));
    SubscriberHandle {
        task,
        stats,
        unattributed: Arc::default(),
    }
}

async fn connect(
    source: &EndpointSource,
    config: &SubscriberConfig,
) -> Result<Connection, ZmtpError> {
    let mut conn = Connection::connect(
        &source.publisher,
        SocketType::Sub,
        config.connection_options(),
    )
    .await?;
    conn.subscribe(source.topic.as_bytes()).await?;
    Ok(conn)
}

async fn run_connected(source: EndpointSource, mut stream: Stream, config: SubscriberConfig) {
    let key = Bytes::new();
    let timing = config.timing.clone();
    let (tx, mut rx) = mpsc::channel(QUEUE);
    let ctx = LoopContext::new(tx, config);
    let mut backoff = timing.min_backoff;
    loop {
        let conn = match connect(&source, &ctx.config).await {
            Ok(conn) => conn,
            Err(error) => {
                if !stream.feed.connection_failed(&error) {
                    warn!(endpoint = %source.name, publisher = %source.publisher, %error,
                        retry_in = ?backoff, "cannot connect to KV-event publisher");
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(timing.max_backoff);
                continue;
            }
        };
        info!(endpoint = %source.name, publisher = %source.publisher, "subscribed to KV events");
        let up_since = Instant::now();
        stream.set_connected(true);
        let reader = spawn_reader(conn, ctx.queue.clone());
        stream.on_connect(&key, &ctx);

        let mut delivered = false;
        let mut quiet = quiet_ticks(timing.tail_check_after);
        let error = loop {
            let input = tokio::select! {
                input = rx.recv() => input,
                _ = quiet.tick() => {
                    stream.check_quiet(&key, Instant::now(), &ctx);
                    continue;
                }
            };
            let Some(input) = input else {
                return;
            };
            match input {
                Input::Live(frames, _queued) => {
                    if let Some(msg) = checked_message(&mut stream.feed, &source.topic, &frames) {
                        delivered = true;
                        stream.on_live(&key, msg, &ctx);
                    }
                }
                Input::Replay {
                    generation, item, ..
                } => stream.on_replay(&key, generation, item, &ctx),
                Input::Ended { error, .. } => break error,
            }
        };
        drop(reader);
        stream.set_connected(false);
        let violation = stream.feed.connection_failed(&error);
        if !violation {
            warn!(endpoint = %source.name, %error, "KV-event publisher disconnected; reconnecting");
        }
        // A publisher that breaks the protocol is retried ever more slowly; one that worked
        // (delivered, or stayed up a while) and merely went away is retried at once.
        if !violation && (delivered || up_since.elapsed() >= timing.max_backoff) {
            backoff = timing.min_backoff;
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(timing.max_backoff);
    }
}
