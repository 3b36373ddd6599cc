//! Several router replicas serving one fleet, active-active: each subscribes to every engine's
//! KV events; a starting one copies a running peer's index before it reports ready.
//!
//! Warm start, in order (see [`warm`]):
//! 1. ask the peers in `replicas.peers`, in turn, for a snapshot of each endpoint (`GET
//!    /kvroute/v1/snapshot?endpoint=URL` on their admin listener, one endpoint per answer): the
//!    blocks its index holds (engine hash, router key, tiers) and the sequence number of the
//!    last engine batch they reflect;
//! 2. apply it, then subscribe to each engine resuming after that sequence: the engine's replay
//!    buffer fills the few batches published since, so nothing is lost or applied twice;
//! 3. report ready (`/health` on the API listener) once every subscriber caught up; after
//!    `replicas.warm_timeout_s`, ready anyway with the endpoints not caught up untrusted.
//!
//! Without a peer that answers, step 2 subscribes from the start of each engine's replay buffer.

mod batch;
pub mod share;
mod snapshot;
pub mod warm;

pub use batch::receive_batch;
pub use snapshot::snapshot;
pub use warm::{ready, status};
