//! The one error type of `kvroute-router`.

use thiserror::Error;

/// Why the router could not start or serve.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum RouterError {
    /// A configuration problem, naming the field.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A socket could not be bound or served.
    #[error("{0}")]
    Io(String),
    /// A client did not send its request in time (answered 408).
    #[error("{0}")]
    ClientTimeout(String),
    /// A configured capacity of the router is in use (answered 503).
    #[error("{0}")]
    Overloaded(String),
}
