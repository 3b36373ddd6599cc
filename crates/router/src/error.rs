//! The router's error types: [`RouterError`], which says who failed, whether a retry may help,
//! the OpenAI-shaped answer it becomes and the process exit status it maps to; and
//! [`ProbeError`], why a health check or a scrape of an engine failed.

use kvroute_vllm::openai::{ApiError, Fault};
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

/// sysexits' EX_CONFIG: the configuration is unusable.
const EX_CONFIG: u8 = 78;

impl RouterError {
    /// The OpenAI-shaped answer to a client whose request hit this error.
    pub fn api_error(&self) -> ApiError {
        match self {
            RouterError::ClientTimeout(m) => ApiError::client_timeout(m.clone()),
            RouterError::Overloaded(m) => ApiError::unavailable(m.clone()),
            RouterError::Config(_) | RouterError::Io(_) => ApiError::new(500, self.to_string()),
        }
    }

    /// Who failed.
    pub fn fault(&self) -> Fault {
        self.api_error().fault()
    }

    /// Whether the same request may succeed if sent again.
    pub fn retry_allowed(&self) -> bool {
        self.api_error().retry_allowed()
    }

    /// The exit status of a process that stops on this error.
    pub fn exit_code(&self) -> u8 {
        match self {
            RouterError::Config(_) => EX_CONFIG,
            _ => 1,
        }
    }
}

/// Why a health check or a scrape of an engine failed.
#[derive(Debug, Error)]
pub enum ProbeError {
    /// The request could not be built (an invalid endpoint address).
    #[error(transparent)]
    Invalid(#[from] http::Error),
    /// No response headers in time.
    #[error("timed out")]
    Timeout,
    /// The request failed (connection refused, reset, ...).
    #[error(transparent)]
    Request(#[from] hyper_util::client::legacy::Error),
    /// The body did not arrive in time.
    #[error("timed out reading the body")]
    BodyTimeout,
    /// The body could not be read, or was too large.
    #[error("{0}")]
    Body(Box<dyn std::error::Error + Send + Sync>),
    /// The engine answered with a status other than 200.
    #[error("answered {0}")]
    Status(u16),
}

impl ProbeError {
    /// A short name for the kind of failure, for a metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            ProbeError::Invalid(_) => "invalid",
            ProbeError::Timeout => "timeout",
            ProbeError::Request(_) => "request",
            ProbeError::BodyTimeout => "body_timeout",
            ProbeError::Body(_) => "body",
            ProbeError::Status(_) => "status",
        }
    }
}
