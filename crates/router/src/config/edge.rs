//! The HTTP edge's sections: request limits and timeouts (`limits:`), the admin listener
//! (`admin:`) and graceful shutdown (`shutdown:`).

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

/// Request limits and timeouts, at the router's HTTP edge and towards engines.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Largest request body accepted (413 above, from the `Content-Length` header alone when
    /// the client sends one).
    pub max_body_bytes: usize,
    /// Time to connect to an engine, milliseconds.
    pub connect_timeout_ms: u64,
    /// Time for an engine to send response headers, seconds (504 after), and then its first
    /// body byte (the stream is cut after, with an SSE error event).
    pub response_timeout_s: f64,
    /// Most time between two chunks of an engine's response once its first body byte came,
    /// seconds; a stream silent for longer is cut (an SSE error event to the client, counted in
    /// `kvroute_streams_cut_total{reason="stalled"}`).
    pub stream_idle_timeout_s: f64,
    /// Time a client has to send a request's headers once it sent their first byte,
    /// milliseconds; the connection is closed after.
    pub header_timeout_ms: u64,
    /// Time a client has to send a whole request body once its headers arrived, milliseconds
    /// (408 after).
    pub body_timeout_ms: u64,
    /// Time a connection may sit idle between requests (no request in progress, no byte
    /// received), milliseconds; it is closed after.
    pub idle_timeout_ms: u64,
    /// Time a client may take none of the bytes the router is sending it (its socket's
    /// buffers full, as when it stopped reading a stream), milliseconds; the connection is
    /// closed after, which cancels its requests at their engines and releases their load. An
    /// HTTP/2 stream its client stopped reading among others that move is given up alone after
    /// as long without being asked for more (its socket keeps taking the others' bytes).
    pub write_timeout_ms: u64,
    /// Most client connections open at once on each listener (API and admin); further
    /// connections are closed at once and counted in `kvroute_connections_refused_total`.
    pub max_connections: usize,
    /// Most request-body bytes held by the router at once, across all requests of the API
    /// listener and the picker (a body is charged as its bytes arrive, never for a declared
    /// length, and held until the engine's response headers arrive); a request that would
    /// exceed it gets 503.
    pub max_buffered_bytes: usize,
    /// Most bytes of prompt tokens the tokenization cache keeps.
    pub token_cache_bytes: usize,
    /// Request bodies of at least this many bytes are parsed, tokenized and planned on a
    /// bounded pool of blocking threads rather than on the async workers, so that a huge
    /// prompt does not delay small requests.
    pub offload_above_bytes: usize,
    /// Threads of that pool working at once.
    pub offload_threads: usize,
    /// Large requests waiting for that pool at most; a request past it gets 503.
    pub offload_queue: usize,
    /// Most blocks of a prompt that are keyed, planned and recorded: a longer prompt is routed
    /// by its first blocks (its cost still counts every token), so that one huge prompt holds
    /// the fleet's lock, which every request plans under, for a bounded time.
    pub max_routed_blocks: usize,
    /// Most ext_proc streams `kvroute epp` serves at once (each is one HTTP exchange of the
    /// data plane); a stream past it is answered 503.
    pub max_picker_streams: usize,
    /// Most observer streams (Envoy's `observability_mode` filter following responses)
    /// `kvroute epp` serves at once, apart from `max_picker_streams`; one past it is ended
    /// unanswered and its request handed back when its routing stream ends.
    pub max_observer_streams: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_body_bytes: 32 << 20,
            connect_timeout_ms: 2_000,
            response_timeout_s: 300.0,
            stream_idle_timeout_s: 60.0,
            header_timeout_ms: 10_000,
            body_timeout_ms: 60_000,
            idle_timeout_ms: 60_000,
            write_timeout_ms: 60_000,
            max_connections: 4_096,
            max_buffered_bytes: 256 << 20,
            token_cache_bytes: 256 << 20,
            max_picker_streams: 4_096,
            max_observer_streams: 4_096,
            max_routed_blocks: 16_384,
            offload_above_bytes: 64 << 10,
            offload_threads: 2,
            offload_queue: 64,
        }
    }
}

/// The admin listener, apart from the OpenAI API so that metrics and routing explanations
/// (which reveal what other tenants' prompts left cached) are not exposed with it.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdminConfig {
    /// Address of `/metrics`, `/kvroute/v1/explain` and `/health`. A non-loopback address
    /// needs `token`.
    pub listen: SocketAddr,
    /// When set, admin requests (except `/health`) must carry `Authorization: Bearer <token>`.
    pub token: Option<String>,
    /// Most request-body bytes the admin listener holds at once (its own budget, apart from
    /// `limits.max_buffered_bytes`); a request that would exceed it gets 503.
    pub max_buffered_bytes: usize,
}

impl Default for AdminConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8090".parse().expect("valid literal"),
            token: None,
            max_buffered_bytes: 64 << 20,
        }
    }
}

/// Graceful shutdown: on the first SIGTERM or SIGINT the router stops accepting connections and
/// fails readiness, and in-flight requests finish; at the timeout (or a second signal) open
/// streams end with an SSE error event.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ShutdownConfig {
    /// Seconds in-flight requests may take to finish.
    pub drain_timeout_s: f64,
}

impl Default for ShutdownConfig {
    fn default() -> Self {
        Self {
            drain_timeout_s: 30.0,
        }
    }
}
