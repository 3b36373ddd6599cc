//! One module per command.

pub mod events;
pub mod hash;
pub mod sim;
