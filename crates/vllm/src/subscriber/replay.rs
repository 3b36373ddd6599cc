//! Fetching missed batches from an engine's replay ROUTER socket.
//!
//! The request is `[empty, start_seq (8 bytes big-endian)]` from a DEALER (vLLM's ROUTER wants
//! exactly `[identity, empty, start]`). The engine answers one message per buffered batch with
//! `seq >= start`, then an end marker whose sequence is `-1` (all ones). Up to vLLM 0.25 a reply
//! is `[empty, seq, payload]`; from 0.26 it carries the topic too, `[empty, topic, seq,
//! payload]`. Both are accepted, told apart by their frame count. A fresh DEALER per replay
//! keeps a dead replay socket from poisoning the next request. Replies are bounded like live
//! messages (see [`crate::zmtp`]).

use std::time::Duration;

use bytes::Bytes;
use tokio::sync::mpsc;

use crate::codec::{RawMessage, frame::parse_seq};
use crate::zmtp::connection::Options;
use crate::zmtp::{Connection, SocketType, ZmtpError};

/// The end-of-replay marker's sequence (`-1` as a signed 64-bit integer).
pub const END_MARKER_SEQ: u64 = u64::MAX;

/// One answer from a replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplayItem {
    /// A replayed batch.
    Batch(RawMessage),
    /// The end marker: nothing more is buffered.
    End,
    /// The replay could not be completed.
    Failed(String),
    /// The replay socket broke the protocol or the size limits; its connection was dropped.
    Refused {
        /// What it did.
        reason: String,
        /// Whether it declared a frame or message over the limit.
        oversized: bool,
    },
}

/// Why a replay could not be completed.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// No connection to the replay socket.
    #[error("connect: {0}")]
    Connect(ZmtpError),
    /// The request could not be sent.
    #[error("send: {0}")]
    Send(ZmtpError),
    /// The engine went quiet mid-replay.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// A reply could not be received.
    #[error("receive: {0}")]
    Receive(ZmtpError),
    /// A reply in no known framing.
    #[error(transparent)]
    Reply(#[from] crate::VllmError),
    /// The engine said the replay failed.
    #[error("{0}")]
    Failed(String),
}

/// Parses one reply to a DEALER, in either framing.
pub fn parse_replay_reply(frames: &[Bytes]) -> Result<ReplayItem, crate::VllmError> {
    let frames = match frames.split_first() {
        Some((first, rest)) if first.is_empty() => rest,
        _ => frames,
    };
    let (topic, seq, payload) = match frames {
        [seq, payload] => (Bytes::new(), seq, payload),
        [topic, seq, payload] => (topic.clone(), seq, payload),
        other => {
            return Err(crate::VllmError::Framing(format!(
                "replay reply has {} frames, expected [seq, payload] or [topic, seq, payload]",
                other.len()
            )));
        }
    };
    let seq = parse_seq(seq)?;
    if seq == END_MARKER_SEQ {
        return Ok(ReplayItem::End);
    }
    Ok(ReplayItem::Batch(RawMessage {
        topic,
        seq,
        payload: payload.clone(),
    }))
}

/// Asks `address` for every batch from `start` on and sends each answer to `out`, ending with
/// [`ReplayItem::End`] or [`ReplayItem::Failed`].
pub async fn fetch_replay(
    address: String,
    start: u64,
    options: Options,
    idle_timeout: Duration,
    out: mpsc::Sender<ReplayItem>,
) {
    let result = fetch(&address, start, options, idle_timeout, &out).await;
    let last = match result {
        Ok(()) => ReplayItem::End,
        Err(ReplayError::Connect(e) | ReplayError::Send(e) | ReplayError::Receive(e))
            if e.is_protocol_violation() =>
        {
            ReplayItem::Refused {
                reason: format!("{address}: {e}"),
                oversized: e.is_too_large(),
            }
        }
        Err(reason) => ReplayItem::Failed(format!("{address}: {reason}")),
    };
    let _ = out.send(last).await;
}

async fn fetch(
    address: &str,
    start: u64,
    options: Options,
    idle_timeout: Duration,
    out: &mpsc::Sender<ReplayItem>,
) -> Result<(), ReplayError> {
    let mut dealer = Connection::connect(address, SocketType::Dealer, options)
        .await
        .map_err(ReplayError::Connect)?;
    let request = [Bytes::new(), Bytes::copy_from_slice(&start.to_be_bytes())];
    dealer.send(&request).await.map_err(ReplayError::Send)?;
    loop {
        let reply = tokio::time::timeout(idle_timeout, dealer.recv())
            .await
            .map_err(|_| ReplayError::Timeout(idle_timeout))?
            .map_err(ReplayError::Receive)?;
        match parse_replay_reply(&reply)? {
            ReplayItem::Batch(msg) => {
                if out.send(ReplayItem::Batch(msg)).await.is_err() {
                    return Ok(());
                }
            }
            ReplayItem::End => return Ok(()),
            ReplayItem::Failed(reason) | ReplayItem::Refused { reason, .. } => {
                return Err(ReplayError::Failed(reason));
            }
        }
    }
}
