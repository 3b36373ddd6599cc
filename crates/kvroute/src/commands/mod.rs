//! One module per command.

pub mod bench;
pub mod demo;
pub mod engine_args;
#[cfg(feature = "epp")]
pub mod epp;
pub mod events;
pub(crate) mod files;
pub mod fleet_args;
pub mod hash;
pub(crate) mod numbers;
pub mod pd_args;
pub mod report;
pub mod serve;
pub mod sim;
pub mod simulate;
pub mod tune;
pub mod workload;
