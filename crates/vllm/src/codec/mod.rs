//! vLLM's KV-event wire format: one msgpack batch per published message.
//!
//! The envelope is a positional array `[ts, events]` (0.9.0) or `[ts, events, dp_rank]`
//! (0.9.2+). Events are tagged positional arrays up to 0.23 (`["BlockStored", hashes, ...]`,
//! fields only ever appended) and maps tagged by `"type"` from 0.24. Decoding dispatches on the
//! msgpack type of each event, so one decoder reads every release and mixed fleets. See
//! `shared/reference/vllm-wire.md` §1 for the history this encodes.

mod decode;
mod encode;
pub(crate) mod frame;

pub use decode::{DecodedBatch, decode_batch};
pub(crate) use encode::parse_version;
pub use encode::{EventLayout, HashEncoding, encode_batch, offloading_connector_hashes};
pub use frame::{RawMessage, parse_frames};

/// Field names of `BlockStored`, in declaration (positional) order.
pub(crate) const STORED_FIELDS: [&str; 15] = [
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
];

/// Field names of `BlockRemoved`, in declaration order.
pub(crate) const REMOVED_FIELDS: [&str; 5] = [
    "block_hashes",
    "medium",
    "group_idx",
    "locality",
    "ownership",
];

#[cfg(test)]
mod tests;
