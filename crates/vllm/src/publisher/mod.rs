//! A KV-event publisher with vLLM's framing and replay protocol.
//!
//! It binds a PUB socket (`[topic, seq, payload]` per batch) and, optionally, a ROUTER replay
//! socket that answers `[identity, empty, start_seq]` with every buffered batch from `start_seq`
//! and an end marker, in the pre-0.26 or 0.26+ framing. The demo command and the tests use it as
//! a live peer; [`demo::DemoEngine`] gives it a realistic stream to publish.

pub mod demo;

use std::collections::VecDeque;
use std::sync::Arc;

use bytes::Bytes;
use kvroute_core::event::EventBatch;
use parking_lot::Mutex;
use tokio::task::JoinHandle;
use tracing::{debug, warn};
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::VllmError;
use crate::codec::{EventLayout, encode_batch};
use crate::subscriber::replay_end_marker_seq;

/// How replay replies are framed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ReplayFraming {
    /// vLLM up to 0.25: `[empty, seq, payload]`.
    Legacy,
    /// vLLM 0.26 and later: `[empty, topic, seq, payload]`.
    #[default]
    WithTopic,
}

impl ReplayFraming {
    /// The framing a vLLM version uses.
    pub fn for_vllm_version(version: &str) -> Result<Self, VllmError> {
        let (major, minor, _) = crate::codec::parse_version(version)?;
        Ok(if (major, minor) >= (0, 26) {
            ReplayFraming::WithTopic
        } else {
            ReplayFraming::Legacy
        })
    }
}

/// Settings of a [`Publisher`].
#[derive(Clone, Debug)]
pub struct PublisherConfig {
    /// PUB address, e.g. `tcp://127.0.0.1:5557` (port 0 picks a free one when binding).
    pub address: String,
    /// Connect the PUB socket to a bound subscriber instead of binding it (vLLM connects when
    /// its endpoint names a host rather than `*`).
    pub connect: bool,
    /// ROUTER replay bind address; `None` disables replay.
    pub replay_address: Option<String>,
    /// Topic sent as frame 1.
    pub topic: String,
    /// Wire layout of the payloads.
    pub layout: EventLayout,
    /// Framing of replay replies.
    pub replay_framing: ReplayFraming,
    /// Batches kept for replay (vLLM's `buffer_steps`).
    pub buffer_steps: usize,
}

impl Default for PublisherConfig {
    fn default() -> Self {
        Self {
            address: "tcp://127.0.0.1:5557".into(),
            connect: false,
            replay_address: Some("tcp://127.0.0.1:5558".into()),
            topic: String::new(),
            layout: EventLayout::LATEST,
            replay_framing: ReplayFraming::WithTopic,
            buffer_steps: 10_000,
        }
    }
}

type ReplayBuffer = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

/// A running publisher.
pub struct Publisher {
    socket: PubSocket,
    config: PublisherConfig,
    address: String,
    replay_address: Option<String>,
    next_seq: u64,
    buffer: ReplayBuffer,
    replay_task: Option<JoinHandle<()>>,
}

impl Publisher {
    /// Binds the sockets.
    pub async fn bind(config: PublisherConfig) -> Result<Self, VllmError> {
        let mut socket = PubSocket::new();
        let address = if config.connect {
            socket
                .connect(&config.address)
                .await
                .map_err(|e| VllmError::zmq(format!("connect {}", config.address), e))?;
            config.address.clone()
        } else {
            socket
                .bind(&config.address)
                .await
                .map_err(|e| VllmError::zmq(format!("bind {}", config.address), e))?
                .to_string()
        };
        let buffer: ReplayBuffer = Arc::default();
        let (replay_address, replay_task) = match &config.replay_address {
            None => (None, None),
            Some(addr) => {
                let mut router = RouterSocket::new();
                let bound = router
                    .bind(addr)
                    .await
                    .map_err(|e| VllmError::zmq(format!("bind {addr}"), e))?
                    .to_string();
                let task = tokio::spawn(serve_replay(
                    router,
                    buffer.clone(),
                    Bytes::from(config.topic.clone().into_bytes()),
                    config.replay_framing,
                ));
                (Some(bound), Some(task))
            }
        };
        Ok(Self {
            socket,
            config,
            address,
            replay_address,
            next_seq: 0,
            buffer,
            replay_task,
        })
    }

    /// The PUB address subscribers should connect to.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// The replay address, if replay is on.
    pub fn replay_address(&self) -> Option<&str> {
        self.replay_address.as_deref()
    }

    /// The sequence number the next batch will get.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// Encodes, buffers and publishes a batch; returns its sequence number.
    pub async fn publish(&mut self, batch: &EventBatch) -> Result<u64, VllmError> {
        let (seq, payload) = self.record(batch);
        let mut msg = ZmqMessage::from(Bytes::from(self.config.topic.clone().into_bytes()));
        msg.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
        msg.push_back(payload);
        self.socket
            .send(msg)
            .await
            .map_err(|e| VllmError::zmq("publish", e))?;
        Ok(seq)
    }

    /// Buffers a batch for replay without sending it live, as if the network lost it.
    pub fn publish_lost(&mut self, batch: &EventBatch) -> u64 {
        self.record(batch).0
    }

    fn record(&mut self, batch: &EventBatch) -> (u64, Bytes) {
        let seq = self.next_seq;
        self.next_seq += 1;
        let payload = Bytes::from(encode_batch(batch, &self.config.layout));
        // Without a replay socket nobody can ask for old batches: keep none.
        if self.replay_address.is_some() {
            let mut buffer = self.buffer.lock();
            buffer.push_back((seq, payload.clone()));
            while buffer.len() > self.config.buffer_steps {
                buffer.pop_front();
            }
        }
        (seq, payload)
    }

    /// Simulates an engine restart: the sequence starts again at 0 and the replay buffer empties.
    pub fn restart(&mut self) {
        self.next_seq = 0;
        self.buffer.lock().clear();
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        if let Some(task) = self.replay_task.take() {
            task.abort();
        }
    }
}

async fn serve_replay(
    mut router: RouterSocket,
    buffer: ReplayBuffer,
    topic: Bytes,
    framing: ReplayFraming,
) {
    loop {
        let request = match router.recv().await {
            Ok(msg) => msg.into_vec(),
            Err(e) => {
                warn!(error = %e, "replay socket closed");
                return;
            }
        };
        // vLLM accepts exactly [identity, empty, start_seq (8 bytes)] and ignores anything else.
        let start = match request.as_slice() {
            [_, empty, seq] if empty.is_empty() && seq.len() == 8 => {
                u64::from_be_bytes(seq[..].try_into().expect("length checked"))
            }
            _ => {
                warn!(frames = request.len(), "invalid replay request ignored");
                continue;
            }
        };
        let identity = request[0].clone();
        let batches: Vec<(u64, Bytes)> = buffer
            .lock()
            .iter()
            .filter(|(s, _)| *s >= start)
            .cloned()
            .collect();
        debug!(start, count = batches.len(), "serving replay");
        let reply = |seq: u64, topic: Bytes, payload: Bytes| {
            let mut msg = ZmqMessage::from(identity.clone());
            msg.push_back(Bytes::new());
            if framing == ReplayFraming::WithTopic {
                msg.push_back(topic);
            }
            msg.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
            msg.push_back(payload);
            msg
        };
        for (seq, payload) in batches {
            if router
                .send(reply(seq, topic.clone(), payload))
                .await
                .is_err()
            {
                break;
            }
        }
        // The end marker's topic frame is empty even when the topic is not.
        let _ = router
            .send(reply(replay_end_marker_seq(), Bytes::new(), Bytes::new()))
            .await;
    }
}
