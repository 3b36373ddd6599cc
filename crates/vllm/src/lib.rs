//! vLLM's wire formats and clients, for kvroute.
//!
//! - [`codec`]: the KV-event batch format of every vLLM release (decode and encode).
//! - [`subscriber`]: live ingestion from an engine's ZMQ PUB socket with gap replay over its
//!   ROUTER socket, feeding a [`kvroute_core::index::SharedIndex`].
//! - [`zmtp`]: kvroute's own bounded ZMTP 3.x client (SUB and DEALER), under the subscriber.
//! - [`nixl`]: the NixlConnector P/D protocol (`kv_transfer_params`, roles, leases) per release.
//! - [`publisher`]: a small publisher with vLLM's framing and replay, for demos and tests.
//!
//! This crate knows bytes and sockets; it makes no routing decisions.

pub mod codec;
mod error;
pub mod metrics;
pub mod nixl;
pub mod openai;

pub use error::VllmError;
pub mod publisher;
pub mod subscriber;
pub mod tokenizer;
pub mod zmtp;
