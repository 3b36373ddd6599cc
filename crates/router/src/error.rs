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
}
