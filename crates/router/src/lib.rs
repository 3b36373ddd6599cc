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
//!
//! Public: the configuration ([`config`]), [`server`] (start a router), `epp` (start the
//! picker; feature `epp`) and the error type. Every other module is the crate's own.

// Some crate-private code serves only the picker or Kubernetes discovery (the pipeline's
// `route` for ext_proc, membership's runtime add/remove); without both features it is
// compiled but unused. The full build (`kvroute`'s defaults, CI) still reports dead code.
#![cfg_attr(
    not(all(feature = "epp", feature = "kube")),
    allow(dead_code, unused_imports)
)]

mod accounting;
mod admin;
mod budget;
pub mod config;
mod descriptors;
mod discovery;
mod edge;
mod endpoint;
#[cfg(feature = "epp")]
pub mod epp;
mod error;
mod events;
mod fleet_handle;
mod flow;
mod forward;
mod forwarding;
mod journal;
mod membership;
#[cfg(any(test, feature = "test-support"))]
mod memory;
mod metrics;
mod offload;
mod pd;
mod pipeline;
mod probes;
mod proxy;
mod registry;
mod replica;
mod replica_state;
mod reply;
pub mod server;
mod service;
mod shutdown;
mod tokenize;
mod transfer;
mod upstream;

pub use error::{ProbeError, RouterError};

#[cfg(feature = "test-support")]
#[doc(hidden)]
pub mod testing;
