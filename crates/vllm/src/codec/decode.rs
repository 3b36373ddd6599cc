//! Decoding a KV-event payload into typed events, whatever the vLLM release.

use kvroute_core::event::{BlockRemoved, BlockStored, EngineHash, EventBatch, KvEvent};
use kvroute_core::keys::{BlockExtraKeys, ExtraKey};
use rmpv::ValueRef;

use super::{REMOVED_FIELDS, STORED_FIELDS};
use crate::VllmError;

/// Nesting deeper than any vLLM payload (batch → events → event → extra keys → tuple) is
/// refused early, so hostile input cannot exhaust the stack.
const MAX_DEPTH: usize = 64;

/// A decoded batch plus what the decoder skipped on purpose.
#[derive(Clone, Debug, PartialEq)]
pub struct DecodedBatch {
    /// The batch's events, in order.
    pub batch: EventBatch,
    /// Event type names this decoder does not know (from a newer vLLM), skipped.
    pub unknown_events: Vec<String>,
}

type Result<T> = std::result::Result<T, VllmError>;

fn err<T>(msg: impl Into<String>) -> Result<T> {
    Err(VllmError::Decode(msg.into()))
}

fn kind(v: &ValueRef<'_>) -> &'static str {
    match v {
        ValueRef::Nil => "nil",
        ValueRef::Boolean(_) => "bool",
        ValueRef::Integer(_) => "int",
        ValueRef::F32(_) | ValueRef::F64(_) => "float",
        ValueRef::String(_) => "str",
        ValueRef::Binary(_) => "bytes",
        ValueRef::Array(_) => "array",
        ValueRef::Map(_) => "map",
        ValueRef::Ext(..) => "ext",
    }
}

/// Decodes one payload (frame 3 of a published message, or of a replayed one).
///
/// A payload that is not a batch in any known layout is an error naming what is wrong; the
/// caller counts and logs it and goes on with the next message. Never panics.
pub fn decode_batch(payload: &[u8]) -> Result<DecodedBatch> {
    let mut rd = payload;
    let root = rmpv::decode::read_value_ref_with_max_depth(&mut rd, MAX_DEPTH)
        .map_err(|e| VllmError::Decode(format!("not msgpack: {e}")))?;
    if !rd.is_empty() {
        return err(format!("{} trailing bytes after the batch", rd.len()));
    }
    let (ts, events, rank) = match &root {
        ValueRef::Array(items) if items.len() >= 2 => (&items[0], &items[1], items.get(2)),
        ValueRef::Array(items) => {
            return err(format!(
                "batch array has {} elements, expected [ts, events, dp_rank?]",
                items.len()
            ));
        }
        // Unreleased vLLM snapshots encode the envelope as a map.
        ValueRef::Map(entries) => (
            map_get(entries, "ts").unwrap_or(&ValueRef::Nil),
            map_get(entries, "events")
                .ok_or_else(|| VllmError::Decode("batch map has no \"events\"".into()))?,
            map_get(entries, "data_parallel_rank"),
        ),
        other => return err(format!("batch is a {}, expected an array", kind(other))),
    };
    let ts = match ts {
        ValueRef::F64(f) => *f,
        ValueRef::F32(f) => f64::from(*f),
        ValueRef::Integer(i) => i.as_f64().unwrap_or(0.0),
        ValueRef::Nil => 0.0,
        other => return err(format!("batch ts is a {}, expected a float", kind(other))),
    };
    let data_parallel_rank = match rank {
        None | Some(ValueRef::Nil) => None,
        Some(v) => Some(int(v, "data_parallel_rank")?),
    };
    let ValueRef::Array(items) = events else {
        return err(format!(
            "batch events is a {}, expected an array",
            kind(events)
        ));
    };
    let mut out = Vec::with_capacity(items.len());
    let mut unknown_events = Vec::new();
    for (i, item) in items.iter().enumerate() {
        match decode_event(item)
            .map_err(|e| VllmError::Decode(format!("event {i}: {}", strip(e))))?
        {
            Ok(event) => out.push(event),
            Err(unknown) => unknown_events.push(unknown),
        }
    }
    Ok(DecodedBatch {
        batch: EventBatch {
            ts,
            events: out,
            data_parallel_rank,
        },
        unknown_events,
    })
}

fn strip(e: VllmError) -> String {
    match e {
        VllmError::Decode(msg) => msg,
        other => other.to_string(),
    }
}

fn map_get<'v, 'a>(
    entries: &'v [(ValueRef<'a>, ValueRef<'a>)],
    key: &str,
) -> Option<&'v ValueRef<'a>> {
    entries
        .iter()
        .find(|(k, _)| matches!(k, ValueRef::String(s) if s.as_str() == Some(key)))
        .map(|(_, v)| v)
}

/// Field access over either event form.
enum Fields<'v, 'a> {
    Positional(&'v [ValueRef<'a>], &'static [&'static str]),
    Named(&'v [(ValueRef<'a>, ValueRef<'a>)]),
}

impl<'v, 'a> Fields<'v, 'a> {
    /// The field's value; `None` when absent (a missing trailing optional or omitted default).
    fn get(&self, name: &str) -> Option<&'v ValueRef<'a>> {
        let value = match self {
            Fields::Positional(items, names) => names
                .iter()
                .position(|n| *n == name)
                .and_then(|i| items.get(i)),
            Fields::Named(entries) => map_get(entries, name),
        };
        value.filter(|v| !matches!(v, ValueRef::Nil))
    }
}

/// `Ok(Ok(event))`, `Ok(Err(type name))` for an unknown type, or an error.
fn decode_event(item: &ValueRef<'_>) -> Result<std::result::Result<KvEvent, String>> {
    let (tag, fields) = match item {
        ValueRef::Array(items) => {
            let Some(ValueRef::String(tag)) = items.first() else {
                return err("positional event does not start with its type name");
            };
            let tag = tag
                .as_str()
                .ok_or_else(|| VllmError::Decode("type name is not UTF-8".into()))?;
            let names: &'static [&'static str] = match tag {
                "BlockStored" => &STORED_FIELDS,
                "BlockRemoved" => &REMOVED_FIELDS,
                _ => &[],
            };
            (tag, Fields::Positional(&items[1..], names))
        }
        ValueRef::Map(entries) => {
            let tag = match map_get(entries, "type") {
                Some(ValueRef::String(s)) => s
                    .as_str()
                    .ok_or_else(|| VllmError::Decode("type name is not UTF-8".into()))?,
                Some(other) => {
                    return err(format!(
                        "event type is a {}, expected a string",
                        kind(other)
                    ));
                }
                None => return err("event map has no \"type\""),
            };
            (tag, Fields::Named(entries))
        }
        other => {
            return err(format!(
                "event is a {}, expected an array or a map",
                kind(other)
            ));
        }
    };
    let event = match tag {
        "BlockStored" => KvEvent::BlockStored(BlockStored {
            block_hashes: hashes(fields.get("block_hashes"), "block_hashes")?,
            parent_block_hash: fields
                .get("parent_block_hash")
                .map(|v| hash(v, "parent_block_hash"))
                .transpose()?,
            token_ids: tokens(fields.get("token_ids"))?,
            block_size: fields
                .get("block_size")
                .map(|v| u32_field(v, "block_size"))
                .transpose()?
                .unwrap_or(0),
            lora_id: fields
                .get("lora_id")
                .map(|v| int(v, "lora_id"))
                .transpose()?,
            medium: fields
                .get("medium")
                .map(|v| string(v, "medium"))
                .transpose()?,
            lora_name: fields
                .get("lora_name")
                .map(|v| string(v, "lora_name"))
                .transpose()?,
            extra_keys: fields.get("extra_keys").map(extra_keys).transpose()?,
            group_idx: fields
                .get("group_idx")
                .map(|v| int(v, "group_idx"))
                .transpose()?,
        }),
        "BlockRemoved" => KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: hashes(fields.get("block_hashes"), "block_hashes")?,
            medium: fields
                .get("medium")
                .map(|v| string(v, "medium"))
                .transpose()?,
            group_idx: fields
                .get("group_idx")
                .map(|v| int(v, "group_idx"))
                .transpose()?,
        }),
        "AllBlocksCleared" => KvEvent::AllBlocksCleared,
        other => return Ok(Err(other.to_owned())),
    };
    Ok(Ok(event))
}

/// An engine hash: an int of any width (signed for old `builtin` hashes) or a digest as bytes,
/// of which vLLM's int form is the last 8 bytes, big-endian.
fn hash(v: &ValueRef<'_>, field: &str) -> Result<EngineHash> {
    match v {
        ValueRef::Integer(i) => match (i.as_u64(), i.as_i64()) {
            (Some(u), _) => Ok(EngineHash(u)),
            // Two's complement, as Python's builtin hash() values are published.
            (None, Some(s)) => Ok(EngineHash(s as u64)),
            (None, None) => err(format!("{field}: integer out of range")),
        },
        ValueRef::Binary(bytes) if !bytes.is_empty() => {
            let tail = &bytes[bytes.len().saturating_sub(8)..];
            let mut buf = [0u8; 8];
            buf[8 - tail.len()..].copy_from_slice(tail);
            Ok(EngineHash(u64::from_be_bytes(buf)))
        }
        other => err(format!(
            "{field}: hash is a {}, expected an int or bytes",
            kind(other)
        )),
    }
}

fn hashes(v: Option<&ValueRef<'_>>, field: &str) -> Result<Vec<EngineHash>> {
    match v {
        Some(ValueRef::Array(items)) => items.iter().map(|h| hash(h, field)).collect(),
        Some(other) => err(format!("{field} is a {}, expected an array", kind(other))),
        None => err(format!("{field} is missing")),
    }
}

fn tokens(v: Option<&ValueRef<'_>>) -> Result<Vec<u32>> {
    match v {
        None => Ok(Vec::new()),
        Some(ValueRef::Array(items)) => items.iter().map(|t| u32_field(t, "token_ids")).collect(),
        Some(other) => err(format!("token_ids is a {}, expected an array", kind(other))),
    }
}

fn int(v: &ValueRef<'_>, field: &str) -> Result<i64> {
    match v {
        ValueRef::Integer(i) => i
            .as_i64()
            .ok_or_else(|| VllmError::Decode(format!("{field}: integer out of range"))),
        other => err(format!("{field} is a {}, expected an int", kind(other))),
    }
}

fn u32_field(v: &ValueRef<'_>, field: &str) -> Result<u32> {
    match v {
        ValueRef::Integer(i) => i
            .as_u64()
            .and_then(|u| u32::try_from(u).ok())
            .ok_or_else(|| {
                VllmError::Decode(format!("{field}: {i} is not a 32-bit unsigned value"))
            }),
        other => err(format!(
            "{field} holds a {}, expected an unsigned int",
            kind(other)
        )),
    }
}

fn string(v: &ValueRef<'_>, field: &str) -> Result<String> {
    match v {
        ValueRef::String(s) => s
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| VllmError::Decode(format!("{field} is not valid UTF-8"))),
        other => err(format!("{field} is a {}, expected a string", kind(other))),
    }
}

fn extra_keys(v: &ValueRef<'_>) -> Result<Vec<BlockExtraKeys>> {
    let ValueRef::Array(blocks) = v else {
        return err(format!("extra_keys is a {}, expected an array", kind(v)));
    };
    blocks
        .iter()
        .map(|block| match block {
            ValueRef::Nil => Ok(None),
            ValueRef::Array(keys) => keys
                .iter()
                .map(extra_key)
                .collect::<Result<Vec<_>>>()
                .map(Some),
            other => err(format!(
                "extra_keys entry is a {}, expected an array or nil",
                kind(other)
            )),
        })
        .collect()
}

fn extra_key(v: &ValueRef<'_>) -> Result<ExtraKey> {
    match v {
        ValueRef::Integer(_) => int(v, "extra key").map(ExtraKey::Int),
        ValueRef::String(_) => string(v, "extra key").map(ExtraKey::Str),
        ValueRef::Binary(b) => Ok(ExtraKey::Bytes(b.to_vec())),
        ValueRef::Array(items) => items
            .iter()
            .map(extra_key)
            .collect::<Result<_>>()
            .map(ExtraKey::List),
        other => err(format!(
            "extra key is a {}, expected an int, string, bytes or tuple",
            kind(other)
        )),
    }
}
