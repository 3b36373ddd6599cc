//! The one error type of `kvroute-core`.

use thiserror::Error;

/// Why a core operation refused its input. Nothing is changed when one of these is returned.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum CoreError {
    /// A block size of zero (or otherwise unusable) was given.
    #[error("invalid block size {0}: must be at least 1 token")]
    InvalidBlockSize(usize),
    /// Fewer per-block extra-key entries than full blocks.
    #[error("extra keys given for {extra} blocks but the tokens make {blocks} full blocks")]
    ExtraKeysLength {
        /// Full blocks in the token sequence.
        blocks: usize,
        /// Entries in the extra-keys list.
        extra: usize,
    },
}
