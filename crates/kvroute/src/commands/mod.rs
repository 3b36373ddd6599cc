//! One module per command.

pub mod events;
pub mod hash;
pub mod serve;
pub mod sim;
