//! The one error type of `kvroute-sim`.

use thiserror::Error;

/// Why the simulator refused something.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum SimError {
    /// An unusable setting.
    #[error("invalid simulator configuration: {0}")]
    Config(String),
    /// A request longer than the model (or the whole cache) allows.
    #[error(
        "this model's maximum context length is {max_model_len} tokens, but the request has {tokens}"
    )]
    TooLong {
        /// Prompt plus output tokens.
        tokens: usize,
        /// The limit.
        max_model_len: usize,
    },
    /// A request without prompt tokens.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// A request that asks for no output.
    #[error("max_tokens must be at least 1")]
    NoOutput,
    /// A socket or server failure.
    #[error("{0}")]
    Io(String),
}
