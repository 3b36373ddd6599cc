//! Pure, synchronous logic at the heart of kvroute.
//!
//! This crate owns block keys and hash chains ([`keys`]), the typed KV-cache events that
//! engines publish ([`event`]), the KV block index that answers "which endpoint holds the
//! longest prefix of this prompt" ([`index`]), the router's own routing history ([`history`]),
//! the cost-model scheduler that weighs cache against load ([`schedule`]) and the fleet state
//! every decision reads, fed by observations and planned against ([`fleet`]).
//!
//! It must not do I/O, spawn tasks or read the clock: time is always a parameter. That keeps
//! every routing decision testable without a socket and lets an offline simulator run the very
//! same code as the live router.

pub mod error;
pub mod event;
pub mod fleet;
pub mod history;
pub mod index;
pub mod keys;
pub mod load_counters;
pub mod random;
mod run_slab;
pub mod schedule;
pub mod tiers;

pub use error::CoreError;
