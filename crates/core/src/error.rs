//! The one error type of `kvroute-core`.

use thiserror::Error;

/// Why a core operation refused its input. Nothing is changed when one of these is returned.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum CoreError {
    /// A block size of zero (or otherwise unusable) was given.
    #[error("invalid block size {0}: must be at least 1 token")]
    InvalidBlockSize(usize),
    /// An offloaded block size that is not a whole number of the index's blocks (at most
    /// 4,096 of them).
    #[error(
        "offload block size {offload} is not a multiple of the block size {block_size} (at most 4096 blocks)"
    )]
    OffloadBlockSize {
        /// The offloaded block size configured, in tokens.
        offload: usize,
        /// The index's block size, in tokens.
        block_size: usize,
    },
    /// A sharded index of zero shards was asked for.
    #[error("invalid index shard count {0}: must be at least 1")]
    InvalidIndexShards(usize),
    /// Fewer per-block extra-key entries than full blocks.
    #[error("extra keys given for {extra} blocks but the tokens make {blocks} full blocks")]
    ExtraKeysLength {
        /// Full blocks in the token sequence.
        blocks: usize,
        /// Entries in the extra-keys list.
        extra: usize,
    },
    /// Keys made with another block layout than this router's (a peer replica's snapshot):
    /// the same key would name other tokens.
    #[error(
        "the snapshot's keys were made with {field} {snapshot:?}, this router's with {ours:?}: they name other blocks here"
    )]
    KeyLayoutMismatch {
        /// The field that differs (`key_scheme`, `block_size`, `offload_block_size`).
        field: &'static str,
        /// The snapshot's value.
        snapshot: Option<usize>,
        /// This router's value.
        ours: Option<usize>,
    },
    /// A named preset (a KV link, a model's KV shape) that does not exist or a custom one
    /// out of range.
    #[error("{0}")]
    InvalidPreset(String),
}
