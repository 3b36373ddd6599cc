//! `kvroute sim`: a simulated vLLM engine that behaves like the real one where routing cares.
//!
//! - [`engine`]: the pure engine model (vLLM's block pool and prefix cache, continuous batching
//!   with chunked prefill and preemption, a step-time model), reusable offline.
//! - [`connector_events`]: the tier events an offloading connector (vLLM's, LMCache's)
//!   publishes, shaped from the engine's.
//! - [`link`]: the KV link between prefill and decode engines (bytes per token, bandwidth
//!   presets, transfers sharing a NIC), pure like the engine.
//! - [`server`]: the OpenAI API, `/metrics` and KV events around that model, for a fleet of
//!   engines in one process.

pub mod connector_events;
pub mod engine;
mod error;
pub mod link;
pub mod server;

pub use error::SimError;
