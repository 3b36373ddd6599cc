//! Encoding typed events exactly as a given vLLM release's publisher does (msgspec msgpack).
//!
//! Used by the demo publisher and the simulator, and checked byte for byte against payloads
//! captured from vLLM itself.

use kvroute_core::event::{BlockRemoved, BlockStored, EngineHash, EventBatch, KvEvent};
use kvroute_core::keys::{BlockExtraKeys, ExtraKey};
use rmpv::Value;

use crate::VllmError;

/// How hashes go on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum HashEncoding {
    /// Unsigned 64-bit ints (vLLM's default since 0.10.2).
    #[default]
    Int,
    /// 8-byte big-endian byte strings (what `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0` resembles;
    /// real engines send the full digest, whose last 8 bytes these are).
    Bytes,
}

/// The wire layout of one vLLM release.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EventLayout {
    /// Events as tagged maps (0.24+) rather than tagged positional arrays.
    pub map_events: bool,
    /// Fields of a positional `BlockStored`, not counting the tag.
    pub stored_fields: usize,
    /// Fields of a positional `BlockRemoved`, not counting the tag.
    pub removed_fields: usize,
    /// Whether the envelope carries `data_parallel_rank` (0.9.2+).
    pub with_rank: bool,
    /// How hashes are encoded.
    pub hashes: HashEncoding,
    /// How hashes of events below the GPU (any medium but `GPU`) are encoded: as the GPU's
    /// by default; vLLM's OffloadingConnector sends raw bytes in 0.11–0.23 (see
    /// [`offloading_connector_hashes`]).
    pub offload_hashes: HashEncoding,
}

impl EventLayout {
    /// The newest layout kvroute knows (vLLM 0.24 and later: map events).
    pub const LATEST: EventLayout = EventLayout {
        map_events: true,
        stored_fields: 14,
        removed_fields: 5,
        with_rank: true,
        hashes: HashEncoding::Int,
        offload_hashes: HashEncoding::Int,
    };

    /// The layout a vLLM version (`0.23.0`, `0.10.2`, `0.32`) publishes.
    pub fn for_vllm_version(version: &str) -> Result<EventLayout, VllmError> {
        let bad = || VllmError::Version(version.to_owned());
        let mut parts = version.trim().trim_start_matches('v').split('.');
        let major: u32 = parts.next().and_then(|p| p.parse().ok()).ok_or_else(bad)?;
        let minor: u32 = parts.next().and_then(|p| p.parse().ok()).ok_or_else(bad)?;
        let patch: u32 = match parts.next() {
            None => 0,
            Some(p) => p
                .split(|c: char| !c.is_ascii_digit())
                .next()
                .and_then(|p| p.parse().ok())
                .ok_or_else(bad)?,
        };
        if major != 0 {
            return Ok(Self::LATEST);
        }
        let v = (minor, patch);
        if v >= (24, 0) {
            return Ok(Self::LATEST);
        }
        // Positional lengths, tag excluded (vllm-wire.md §1.5).
        let stored_fields = match v {
            _ if v >= (22, 0) => 11,
            _ if v >= (20, 0) => 9,
            _ if v >= (17, 0) => 8,
            _ if v >= (14, 0) => 7,
            _ if v >= (10, 2) => 6,
            _ => 5,
        };
        let removed_fields = match v {
            _ if v >= (20, 0) => 3,
            _ if v >= (10, 2) => 2,
            _ => 1,
        };
        Ok(EventLayout {
            map_events: false,
            stored_fields,
            removed_fields,
            with_rank: v >= (9, 2),
            hashes: HashEncoding::Int,
            offload_hashes: HashEncoding::Int,
        })
    }
}

/// How vLLM's OffloadingConnector encodes its events' hashes in release `version`: raw bytes
/// in 0.11–0.23, whatever the GPU's are, since they never passed through the int conversion
/// (vllm-wire.md §1.6); ints since 0.24.
pub fn offloading_connector_hashes(version: &str) -> Result<HashEncoding, VllmError> {
    let (major, minor, _) = parse_version(version)?;
    Ok(if major == 0 && (11..24).contains(&minor) {
        HashEncoding::Bytes
    } else {
        HashEncoding::Int
    })
}

/// `(major, minor, patch)` of a vLLM version string such as `0.23.0`, `v0.33.0rc1` or `0.14`.
pub(crate) fn parse_version(version: &str) -> Result<(u32, u32, u32), VllmError> {
    let bad = || VllmError::Version(version.to_owned());
    let mut parts = version.trim().trim_start_matches('v').split('.');
    let major: u32 = parts.next().and_then(|p| p.parse().ok()).ok_or_else(bad)?;
    let minor: u32 = parts.next().and_then(|p| p.parse().ok()).ok_or_else(bad)?;
    let patch: u32 = match parts.next() {
        None => 0,
        Some(p) => p
            .split(|c: char| !c.is_ascii_digit())
            .next()
            .and_then(|p| p.parse().ok())
            .ok_or_else(bad)?,
    };
    Ok((major, minor, patch))
}

fn hash_value(h: EngineHash, enc: HashEncoding) -> Value {
    match enc {
        HashEncoding::Int => Value::from(h.0),
        HashEncoding::Bytes => Value::Binary(h.0.to_be_bytes().to_vec()),
    }
}

fn opt<T>(v: &Option<T>, f: impl FnOnce(&T) -> Value) -> Value {
    v.as_ref().map_or(Value::Nil, f)
}

fn extra_key_value(k: &ExtraKey) -> Value {
    match k {
        ExtraKey::Int(i) => Value::from(*i),
        ExtraKey::Str(s) => Value::from(s.as_str()),
        ExtraKey::Bytes(b) => Value::Binary(b.clone()),
        ExtraKey::List(items) => Value::Array(items.iter().map(extra_key_value).collect()),
    }
}

fn extra_keys_value(blocks: &[BlockExtraKeys]) -> Value {
    Value::Array(
        blocks
            .iter()
            .map(|b| {
                opt(b, |keys| {
                    Value::Array(keys.iter().map(extra_key_value).collect())
                })
            })
            .collect(),
    )
}

/// `BlockStored` fields in declaration order (values vLLM would put there; fields kvroute does
/// not model are nil).
fn stored_values(e: &BlockStored, hashes: HashEncoding) -> Vec<Value> {
    vec![
        Value::Array(
            e.block_hashes
                .iter()
                .map(|h| hash_value(*h, hashes))
                .collect(),
        ),
        opt(&e.parent_block_hash, |h| hash_value(*h, hashes)),
        Value::Array(e.token_ids.iter().map(|t| Value::from(*t)).collect()),
        Value::from(e.block_size),
        opt(&e.lora_id, |i| Value::from(*i)),
        opt(&e.medium, |m| Value::from(m.as_str())),
        opt(&e.lora_name, |n| Value::from(n.as_str())),
        opt(&e.extra_keys, |k| extra_keys_value(k)),
        opt(&e.group_idx, |g| Value::from(*g)),
        opt(&e.kv_cache_spec_kind, |k| Value::from(k.as_str())),
        Value::Nil,
        Value::Nil,
        Value::Nil,
        Value::Nil,
        Value::Nil,
    ]
}

fn removed_values(e: &BlockRemoved, hashes: HashEncoding) -> Vec<Value> {
    vec![
        Value::Array(
            e.block_hashes
                .iter()
                .map(|h| hash_value(*h, hashes))
                .collect(),
        ),
        opt(&e.medium, |m| Value::from(m.as_str())),
        opt(&e.group_idx, |g| Value::from(*g)),
        Value::Nil,
        Value::Nil,
    ]
}

/// Fields that msgspec always writes in map form (no default); the rest are omitted when nil.
const STORED_REQUIRED: usize = 7;
const REMOVED_REQUIRED: usize = 2;

/// The hash encoding of an event on `medium`.
fn hashes_on(medium: Option<&str>, layout: &EventLayout) -> HashEncoding {
    match medium {
        Some(m) if !m.eq_ignore_ascii_case("GPU") => layout.offload_hashes,
        _ => layout.hashes,
    }
}

fn event_value(event: &KvEvent, layout: &EventLayout) -> Value {
    let (tag, values, names, count, required): (&str, Vec<Value>, &[&str], usize, usize) =
        match event {
            KvEvent::BlockStored(e) => (
                "BlockStored",
                stored_values(e, hashes_on(e.medium.as_deref(), layout)),
                &super::STORED_FIELDS,
                layout.stored_fields,
                STORED_REQUIRED,
            ),
            KvEvent::BlockRemoved(e) => (
                "BlockRemoved",
                removed_values(e, hashes_on(e.medium.as_deref(), layout)),
                &super::REMOVED_FIELDS,
                layout.removed_fields,
                REMOVED_REQUIRED,
            ),
            KvEvent::AllBlocksCleared => ("AllBlocksCleared", Vec::new(), &[], 0, 0),
        };
    if layout.map_events {
        let mut entries = vec![(Value::from("type"), Value::from(tag))];
        for (i, (name, value)) in names.iter().zip(values).enumerate() {
            if i < required || !value.is_nil() {
                entries.push((Value::from(*name), value));
            }
        }
        Value::Map(entries)
    } else {
        let mut items = vec![Value::from(tag)];
        items.extend(values.into_iter().take(count));
        Value::Array(items)
    }
}

/// Encodes a batch as `layout`'s release would.
pub fn encode_batch(batch: &EventBatch, layout: &EventLayout) -> Vec<u8> {
    let mut envelope = vec![
        Value::F64(batch.ts),
        Value::Array(
            batch
                .events
                .iter()
                .map(|e| event_value(e, layout))
                .collect(),
        ),
    ];
    if layout.with_rank {
        envelope.push(Value::from(batch.data_parallel_rank.unwrap_or(0)));
    }
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &Value::Array(envelope))
        .expect("writing msgpack to a Vec cannot fail");
    out
}
