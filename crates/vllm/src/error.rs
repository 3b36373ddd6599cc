//! The one error type of `kvroute-vllm`.

use thiserror::Error;

/// What went wrong speaking to a vLLM engine.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum VllmError {
    /// A KV-event payload that is not a valid batch in any known layout.
    #[error("malformed KV-event batch: {0}")]
    Decode(String),
    /// A ZMQ message whose frames are not `[topic, seq, payload]`.
    #[error("malformed KV-event message: {0}")]
    Framing(String),
    /// A ZMQ socket error of the demo publisher (connect, bind, send, receive).
    #[error("ZMQ {context}: {source}")]
    Zmq {
        /// What kvroute was doing.
        context: String,
        /// The transport error.
        #[source]
        source: zeromq::ZmqError,
    },
    /// A ZMTP connection kvroute opened itself (subscriber, replay) failed.
    #[error("ZMTP {context}: {source}")]
    Zmtp {
        /// What kvroute was doing.
        context: String,
        /// What failed.
        #[source]
        source: crate::zmtp::ZmtpError,
    },
    /// An endpoint address kvroute cannot use.
    #[error("invalid endpoint address {address:?}: {reason}")]
    Address {
        /// The address as given.
        address: String,
        /// Why it is unusable.
        reason: String,
    },
    /// A tokenizer or chat template that cannot be loaded or applied.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A `kv_transfer_params` object (or P/D setting) that does not follow the NixlConnector
    /// protocol.
    #[error("{0}")]
    KvTransfer(String),
    /// A vLLM version string kvroute cannot map to a wire layout.
    #[error("unknown vLLM version {0:?}: expected MAJOR.MINOR[.PATCH], e.g. 0.23.0")]
    Version(String),
}

impl VllmError {
    pub(crate) fn zmq(context: impl Into<String>, source: zeromq::ZmqError) -> Self {
        VllmError::Zmq {
            context: context.into(),
            source,
        }
    }
}
