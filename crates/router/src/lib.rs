//! `kvroute serve`: the KV-cache-aware OpenAI router.
//!
//! Clients change only their `base_url`. Each request is parsed once, tokenized, cut into
//! block keys, scored against every endpoint (cache held, load, predicted TTFT) by
//! `kvroute-core`'s scheduler, and proxied with its response streamed through unbuffered.
//! Alongside: a KV-event subscriber per endpoint feeding the index, health checks with
//! ejection, load scraping, the explain API and the router's own metrics.
//!
//! This crate knows HTTP and configuration; wire formats live in `kvroute-vllm` and every
//! routing decision in `kvroute-core`.

pub mod accounting;
pub mod admin;
pub mod budget;
pub mod config;
pub mod descriptors;
pub mod discovery;
pub mod edge;
pub mod endpoint;
#[cfg(feature = "epp")]
pub mod epp;
mod error;
mod events;
mod fleet_handle;
mod flow;
pub mod forwarding;
mod journal;
pub mod membership;
pub mod memory;
pub mod metrics;
pub mod offload;
mod pipeline;
mod probes;
pub mod proxy;
mod registry;
pub mod replica;
mod replica_state;
mod reply;
pub mod server;
pub mod service;
pub mod shutdown;
pub mod tiers_metrics;
pub mod tokenize;
pub mod upstream;

pub use error::{ProbeError, RouterError};
