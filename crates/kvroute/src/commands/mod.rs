//! One module per command.

pub mod bench;
pub mod demo;
#[cfg(feature = "epp")]
pub mod epp;
pub mod events;
pub mod hash;
pub mod serve;
pub mod sim;
