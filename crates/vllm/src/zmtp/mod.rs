//! kvroute's own small ZMTP 3.x client: the wire protocol of ZeroMQ, for the sockets kvroute
//! opens towards engines (SUB to their KV-event PUB, DEALER to their replay ROUTER).
//!
//! Why not a general ZMQ library: kvroute must bound every frame and message *before* it
//! allocates (a peer declaring a 2^62-byte frame must cost one dropped connection, not the
//! process), and must put a timeout on every read. The pieces:
//! - [`decoder`]: a pure, sans-I/O frame decoder that checks each declared frame length and the
//!   running multipart total against [`Limits`] before buffering anything (fuzzed in `fuzz/`);
//! - [`wire`]: the greeting, commands (READY, SUBSCRIBE, PING/PONG, ERROR) and frame encoding;
//! - [`connection`]: one TCP connection on tokio: handshake under a timeout (greeting, the
//!   NULL mechanism, READY with the socket type), then messages in and out;
//! - [`address`]: `tcp://host:port` endpoints.
//!
//! Like libzmq with `ZMQ_MAXMSGSIZE`, a frame or message over the limit is a protocol error
//! that closes that one connection; the caller counts it and reconnects with backoff.

pub mod address;
pub mod connection;
pub mod decoder;
pub mod wire;

use std::time::Duration;

pub use connection::{Connection, SocketType};
pub use decoder::{Decoder, Item};

/// Bounds on what one peer may make kvroute buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Most bytes in one message, all its frames together (each frame also counts
    /// [`decoder::FRAME_OVERHEAD`] bytes, so a flood of empty frames is bounded too).
    pub max_message_bytes: usize,
    /// Most bytes in one command frame (READY, SUBSCRIBE, PING, ...).
    pub max_command_bytes: usize,
}

/// The default bound on a KV-event message: a million-token prompt stored in one engine step is
/// 5 to 7 MB of msgpack (3 to 5 bytes per token id, about 34 per 16-token block's hash), so
/// 16 MiB leaves headroom above the largest batch a real vLLM sends.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 16 << 20;

/// The default bound on a command: READY's properties are a few dozen bytes in practice.
pub const DEFAULT_MAX_COMMAND_BYTES: usize = 64 << 10;

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            max_command_bytes: DEFAULT_MAX_COMMAND_BYTES,
        }
    }
}

/// Why a ZMTP connection failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ZmtpError {
    /// The TCP connection failed (connect, read or write).
    #[error("connection: {0}")]
    Io(#[from] std::io::Error),
    /// The peer closed the connection.
    #[error("peer closed the connection")]
    Closed,
    /// Something took longer than allowed.
    #[error("{what} timed out after {after:?}")]
    Timeout {
        /// What was waited for.
        what: &'static str,
        /// The limit.
        after: Duration,
    },
    /// A frame or message over [`Limits`]: the connection is dropped before anything is
    /// buffered for it.
    #[error("peer declared a {what} of {declared} bytes, over the limit of {limit}")]
    TooLarge {
        /// `frame`, `message` or `command`.
        what: &'static str,
        /// The size the peer declared (for a message: the running total with this frame).
        declared: u64,
        /// The configured limit.
        limit: usize,
    },
    /// The peer broke the protocol: a bad greeting, an unsupported version or mechanism, a
    /// malformed command, an incompatible socket type, or an ERROR command.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// An address kvroute cannot use.
    #[error("invalid address {address:?}: {reason}")]
    Address {
        /// The address as given.
        address: String,
        /// Why it is unusable.
        reason: String,
    },
}

impl ZmtpError {
    /// Whether the peer broke the protocol or the limits (as opposed to the network failing):
    /// what operators count as a misbehaving publisher.
    pub fn is_protocol_violation(&self) -> bool {
        matches!(self, ZmtpError::TooLarge { .. } | ZmtpError::Protocol(_))
    }

    /// Whether the peer sent more than the limits allow.
    pub fn is_too_large(&self) -> bool {
        matches!(self, ZmtpError::TooLarge { .. })
    }

    pub(crate) fn protocol(reason: impl Into<String>) -> Self {
        ZmtpError::Protocol(reason.into())
    }
}
