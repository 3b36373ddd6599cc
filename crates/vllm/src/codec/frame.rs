//! The three-frame message around each payload: `[topic, seq (8 bytes big-endian), payload]`.

use bytes::Bytes;

use crate::VllmError;

/// One published (or replayed) message, frames split but the payload not yet decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RawMessage {
    /// Frame 1, the publisher's topic (often empty).
    pub topic: Bytes,
    /// Frame 2, the publisher's batch sequence number.
    pub seq: u64,
    /// Frame 3, the msgpack batch.
    pub payload: Bytes,
}

impl RawMessage {
    /// Bytes its topic and payload hold (what keeping it costs; the sequence frame aside).
    pub fn frame_bytes(&self) -> usize {
        self.topic.len() + self.payload.len()
    }
}

/// Reads an 8-byte big-endian sequence frame.
pub fn parse_seq(frame: &[u8]) -> Result<u64, VllmError> {
    let bytes: [u8; 8] = frame.try_into().map_err(|_| {
        VllmError::Framing(format!(
            "sequence frame is {} bytes, expected 8",
            frame.len()
        ))
    })?;
    Ok(u64::from_be_bytes(bytes))
}

/// Splits a live PUB message into its three frames.
pub fn parse_frames(frames: &[Bytes]) -> Result<RawMessage, VllmError> {
    match frames {
        [topic, seq, payload] => Ok(RawMessage {
            topic: topic.clone(),
            seq: parse_seq(seq)?,
            payload: payload.clone(),
        }),
        other => Err(VllmError::Framing(format!(
            "{} frames, expected 3 (topic, sequence, payload)",
            other.len()
        ))),
    }
}
