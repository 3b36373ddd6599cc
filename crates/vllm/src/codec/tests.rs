use kvroute_core::event::{BlockRemoved, BlockStored, EngineHash, EventBatch, KvEvent};
use kvroute_core::keys::ExtraKey;
use proptest::prelude::*;

use super::*;

struct Fixture {
    version: String,
    seq: u64,
    payload: Vec<u8>,
    expect: serde_json::Value,
}

fn fixtures() -> Vec<Fixture> {
    let files = [
        include_str!("../../tests/data/vllm-0.10.2.jsonl"),
        include_str!("../../tests/data/vllm-0.23.0.jsonl"),
        include_str!("../../tests/data/vllm-0.32.0.jsonl"),
    ];
    files
        .iter()
        .flat_map(|f| f.lines().filter(|l| !l.trim().is_empty()))
        .map(|line| {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            Fixture {
                version: v["vllm"].as_str().unwrap().to_owned(),
                seq: v["seq"].as_u64().unwrap(),
                payload: hex::decode(v["payload_hex"].as_str().unwrap()).unwrap(),
                expect: v["expect"].clone(),
            }
        })
        .collect()
}

#[test]
fn every_fixture_decodes_to_its_expected_events() {
    let all = fixtures();
    assert_eq!(all.len(), 15);
    for fx in &all {
        let decoded = decode_batch(&fx.payload)
            .unwrap_or_else(|e| panic!("vLLM {} seq {}: {e}", fx.version, fx.seq));
        assert!(decoded.unknown_events.is_empty());
        let got = serde_json::to_value(&decoded.batch.events).unwrap();
        let want = fx.expect.as_array().unwrap();
        assert_eq!(got.as_array().unwrap().len(), want.len());
        for (g, w) in got.as_array().unwrap().iter().zip(want) {
            for (field, value) in w.as_object().unwrap() {
                assert_eq!(
                    &g[field], value,
                    "vLLM {} seq {} field {field}",
                    fx.version, fx.seq
                );
            }
        }
    }
}

#[test]
fn our_encoder_reproduces_vllm_bytes_where_hashes_are_ints() {
    let mut exact = 0;
    for fx in fixtures() {
        let decoded = decode_batch(&fx.payload).unwrap().batch;
        let layout = EventLayout::for_vllm_version(&fx.version).unwrap();
        let ours = encode_batch(&decoded, &layout);
        // Offloading events before 0.24 publish 32-byte digests, which the u64 form cannot
        // reproduce; everything else must match vLLM byte for byte.
        let byte_hashes = fx.payload.windows(2).any(|w| w == [0xc4, 0x20]);
        if !byte_hashes {
            assert_eq!(
                hex::encode(&ours),
                hex::encode(&fx.payload),
                "vLLM {} seq {}",
                fx.version,
                fx.seq
            );
            exact += 1;
        }
        assert_eq!(decode_batch(&ours).unwrap().batch, decoded);
    }
    assert!(exact >= 13, "only {exact} payloads compared byte for byte");
}

#[test]
fn version_strings_map_to_layouts() {
    let l = |v| EventLayout::for_vllm_version(v).unwrap();
    assert_eq!((l("0.9.0").stored_fields, l("0.9.0").with_rank), (5, false));
    assert_eq!(l("0.10.2").stored_fields, 6);
    assert_eq!(l("0.13.1").stored_fields, 6);
    assert_eq!(l("0.14").stored_fields, 7);
    assert_eq!(l("0.19.0").stored_fields, 8);
    assert_eq!(l("0.21.0").removed_fields, 3);
    assert_eq!(l("0.23.0").stored_fields, 11);
    assert!(l("0.24.0").map_events);
    assert!(l("v0.33.0rc1").map_events);
    assert!(EventLayout::for_vllm_version("latest").is_err());
    assert!(EventLayout::for_vllm_version("0").is_err());
}

#[test]
fn the_offloading_connectors_hashes_are_raw_bytes_from_0_11_to_0_23_only() {
    let hash = 0x0102_0304_0506_0708u64;
    let batch = |medium: &str| EventBatch {
        ts: 1.0,
        events: vec![KvEvent::BlockStored(BlockStored {
            block_hashes: vec![EngineHash(hash)],
            medium: Some(medium.into()),
            ..BlockStored::default()
        })],
        data_parallel_rank: Some(0),
    };
    // msgpack bin 8 of length 8, then the hash big-endian.
    let mut as_bytes = vec![0xc4, 8];
    as_bytes.extend(hash.to_be_bytes());
    let carries_bytes = |encoded: Vec<u8>| {
        encoded
            .windows(as_bytes.len())
            .any(|w| w == as_bytes.as_slice())
    };
    for (version, offload_bytes) in [
        ("0.10.2", false),
        ("0.13.0", true),
        ("0.23.0", true),
        ("0.24.0", false),
    ] {
        let mut layout = EventLayout::for_vllm_version(version).unwrap();
        assert!(
            !carries_bytes(encode_batch(&batch("CPU"), &layout)),
            "{version}: ints, as vLLM's event classes encode them"
        );
        layout.offload_hashes = offloading_connector_hashes(version).unwrap();
        assert_eq!(
            carries_bytes(encode_batch(&batch("CPU"), &layout)),
            offload_bytes,
            "{version}"
        );
        assert!(
            !carries_bytes(encode_batch(&batch("GPU"), &layout)),
            "{version}: GPU hashes are ints"
        );
        let decoded = decode_batch(&encode_batch(&batch("CPU"), &layout)).unwrap();
        assert_eq!(decoded.batch, batch("CPU"), "{version}");
    }
}

#[test]
fn hashes_of_every_width_and_sign_decode() {
    // [ts, [["BlockRemoved", [fixint, uint8, uint16, uint32, uint64, int8, int64, bin32]]]]
    let mut hashes = vec![
        rmpv::Value::from(5u64),
        rmpv::Value::from(200u64),
        rmpv::Value::from(60_000u64),
        rmpv::Value::from(4_000_000_000u64),
        rmpv::Value::from(u64::MAX),
        rmpv::Value::from(-3i64),
        rmpv::Value::from(i64::MIN),
    ];
    let mut digest = vec![0u8; 32];
    digest[24..].copy_from_slice(&0x0102_0304_0506_0708u64.to_be_bytes());
    hashes.push(rmpv::Value::Binary(digest));
    let batch = rmpv::Value::Array(vec![
        rmpv::Value::F64(1.0),
        rmpv::Value::Array(vec![rmpv::Value::Array(vec![
            rmpv::Value::from("BlockRemoved"),
            rmpv::Value::Array(hashes),
        ])]),
    ]);
    let mut bytes = Vec::new();
    rmpv::encode::write_value(&mut bytes, &batch).unwrap();
    let decoded = decode_batch(&bytes).unwrap().batch;
    let KvEvent::BlockRemoved(r) = &decoded.events[0] else {
        panic!("{decoded:?}")
    };
    let want: Vec<u64> = vec![
        5,
        200,
        60_000,
        4_000_000_000,
        u64::MAX,
        (-3i64) as u64,
        i64::MIN as u64,
        0x0102_0304_0506_0708,
    ];
    assert_eq!(r.block_hashes.iter().map(|h| h.0).collect::<Vec<_>>(), want);
    assert_eq!(r.medium, None, "a 0.9 event has no medium");
    assert_eq!(decoded.data_parallel_rank, None);
}

#[test]
fn unknown_keys_and_trailing_fields_are_ignored_unknown_types_reported() {
    let map_event = rmpv::Value::Map(vec![
        (rmpv::Value::from("type"), rmpv::Value::from("BlockRemoved")),
        (
            rmpv::Value::from("block_hashes"),
            rmpv::Value::Array(vec![rmpv::Value::from(7u64)]),
        ),
        (rmpv::Value::from("medium"), rmpv::Value::from("GPU")),
        (
            rmpv::Value::from("brand_new_field"),
            rmpv::Value::from(true),
        ),
    ]);
    let long_array = rmpv::Value::Array(vec![
        rmpv::Value::from("BlockRemoved"),
        rmpv::Value::Array(vec![rmpv::Value::from(8u64)]),
        rmpv::Value::from("CPU"),
        rmpv::Value::Nil,
        rmpv::Value::from("LOCAL"),
        rmpv::Value::Nil,
        rmpv::Value::from("a field from the future"),
    ]);
    let future = rmpv::Value::Map(vec![(
        rmpv::Value::from("type"),
        rmpv::Value::from("BlockMoved"),
    )]);
    let batch = rmpv::Value::Array(vec![
        rmpv::Value::F64(2.5),
        rmpv::Value::Array(vec![map_event, long_array, future]),
        rmpv::Value::from(3),
    ]);
    let mut bytes = Vec::new();
    rmpv::encode::write_value(&mut bytes, &batch).unwrap();
    let d = decode_batch(&bytes).unwrap();
    assert_eq!(d.unknown_events, vec!["BlockMoved".to_string()]);
    assert_eq!(d.batch.data_parallel_rank, Some(3));
    assert_eq!(d.batch.events.len(), 2);
    assert_eq!(d.batch.events[1].block_count(), 1);
}

#[test]
fn malformed_payloads_name_what_is_wrong() {
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (vec![], "not msgpack"),
        (vec![0x91, 0xcb], "not msgpack"),
        (
            vec![0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x90, 0x00],
            "trailing",
        ),
        (vec![0x05], "batch is a int"),
        (vec![0x91, 0x00], "1 elements"),
        (
            vec![0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x05],
            "events is a int",
        ),
        (
            vec![0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x05],
            "event 0: event is a int",
        ),
    ];
    for (bytes, want) in cases {
        let e = decode_batch(&bytes).unwrap_err().to_string();
        assert!(e.contains(want), "{bytes:02x?}: {e}");
    }
    // A token id that is not a u32 is refused with the field named.
    let bad = rmpv::Value::Array(vec![
        rmpv::Value::F64(0.0),
        rmpv::Value::Array(vec![rmpv::Value::Array(vec![
            rmpv::Value::from("BlockStored"),
            rmpv::Value::Array(vec![rmpv::Value::from(1u64)]),
            rmpv::Value::Nil,
            rmpv::Value::Array(vec![rmpv::Value::from(-1i64)]),
            rmpv::Value::from(16),
        ])]),
    ]);
    let mut bytes = Vec::new();
    rmpv::encode::write_value(&mut bytes, &bad).unwrap();
    let e = decode_batch(&bytes).unwrap_err().to_string();
    assert!(e.contains("event 0: token_ids"), "{e}");
}

fn arb_hash() -> impl Strategy<Value = EngineHash> {
    any::<u64>().prop_map(EngineHash)
}

fn arb_extra_key() -> impl Strategy<Value = ExtraKey> {
    let leaf = prop_oneof![
        any::<i64>().prop_map(ExtraKey::Int),
        "[a-z0-9-]{0,12}".prop_map(ExtraKey::Str),
        proptest::collection::vec(any::<u8>(), 0..40).prop_map(ExtraKey::Bytes),
    ];
    leaf.prop_recursive(2, 8, 3, |inner| {
        proptest::collection::vec(inner, 0..3).prop_map(ExtraKey::List)
    })
}

fn arb_event(full: bool) -> impl Strategy<Value = KvEvent> {
    let medium = proptest::option::of(prop_oneof![
        Just("GPU".to_string()),
        Just("CPU".to_string()),
        Just("STORAGE".to_string())
    ]);
    let stored = (
        proptest::collection::vec(arb_hash(), 0..6),
        proptest::option::of(arb_hash()),
        proptest::collection::vec(any::<u32>(), 0..40),
        0u32..300,
        proptest::option::of(any::<i64>()),
        medium.clone(),
        proptest::option::of("[a-z]{1,8}"),
        proptest::option::of(proptest::collection::vec(
            proptest::option::of(proptest::collection::vec(arb_extra_key(), 0..3)),
            0..4,
        )),
        proptest::option::of(0i64..4),
        proptest::option::of("[a-z_]{1,16}"),
    )
        .prop_map(move |(h, p, t, bs, lid, m, ln, ek, g, kind)| {
            KvEvent::BlockStored(BlockStored {
                block_hashes: h,
                parent_block_hash: p,
                token_ids: t,
                block_size: bs,
                lora_id: lid,
                medium: m,
                lora_name: if full { ln } else { None },
                extra_keys: if full { ek } else { None },
                group_idx: if full { g } else { None },
                kv_cache_spec_kind: if full { kind } else { None },
            })
        });
    let removed = (
        proptest::collection::vec(arb_hash(), 0..6),
        medium,
        proptest::option::of(0i64..4),
    )
        .prop_map(move |(h, m, g)| {
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: h,
                medium: m,
                group_idx: if full { g } else { None },
            })
        });
    prop_oneof![4 => stored, 3 => removed, 1 => Just(KvEvent::AllBlocksCleared)]
}

fn arb_batch(full: bool) -> impl Strategy<Value = EventBatch> {
    (
        -1e12f64..1e12,
        proptest::collection::vec(arb_event(full), 0..6),
        0i64..8,
    )
        .prop_map(|(ts, events, rank)| EventBatch {
            ts,
            events,
            data_parallel_rank: Some(rank),
        })
}

proptest! {
    /// Whatever a 0.23 (array) or 0.24+ (map) publisher sends, we read back exactly.
    #[test]
    fn encode_then_decode_is_identity(batch in arb_batch(true), map in any::<bool>(), bytes_hashes in any::<bool>()) {
        let mut layout = if map { EventLayout::LATEST } else { EventLayout::for_vllm_version("0.23.0").unwrap() };
        if bytes_hashes {
            layout.hashes = HashEncoding::Bytes;
        }
        let decoded = decode_batch(&encode_batch(&batch, &layout)).unwrap();
        prop_assert_eq!(decoded.batch, batch);
    }

    /// Older layouts drop the newer fields but keep the rest.
    #[test]
    fn old_layouts_round_trip_their_fields(batch in arb_batch(false)) {
        let layout = EventLayout::for_vllm_version("0.10.2").unwrap();
        let decoded = decode_batch(&encode_batch(&batch, &layout)).unwrap();
        prop_assert_eq!(decoded.batch, batch);
    }

    /// Arbitrary bytes never panic the decoder.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_batch(&bytes);
    }

    /// Valid payloads with bytes flipped, cut or inserted never panic the decoder, and whatever
    /// it accepts re-encodes to something it accepts again.
    #[test]
    fn mutated_payloads_never_panic(
        batch in arb_batch(true),
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..3), 1..8),
    ) {
        let mut bytes = encode_batch(&batch, &EventLayout::LATEST);
        for (at, byte, op) in edits {
            if bytes.is_empty() {
                break;
            }
            let i = at.index(bytes.len());
            match op {
                0 => bytes[i] = byte,
                1 => bytes.truncate(i),
                _ => bytes.insert(i, byte),
            }
        }
        if let Ok(decoded) = decode_batch(&bytes) {
            let again = encode_batch(&decoded.batch, &EventLayout::LATEST);
            prop_assert!(decode_batch(&again).is_ok());
        }
    }
}

/// The decoder as it was before it read msgpack directly: parse the payload into an `rmpv`
/// tree, then convert the tree. Kept as the executable definition of what `decode_batch`
/// accepts and returns.
mod reference {
    use kvroute_core::event::{BlockRemoved, BlockStored, EngineHash, EventBatch, KvEvent};
    use kvroute_core::keys::{BlockExtraKeys, ExtraKey};
    use rmpv::ValueRef;

    use super::super::{DecodedBatch, REMOVED_FIELDS, STORED_FIELDS};

    type Result<T> = std::result::Result<T, String>;

    fn err<T>(msg: impl Into<String>) -> Result<T> {
        Err(msg.into())
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

    /// `Err` holds a short message; the tests compare only its class (see `failure_class`).
    pub(super) fn decode_batch(payload: &[u8]) -> Result<DecodedBatch> {
        let mut rd = payload;
        let root = rmpv::decode::read_value_ref_with_max_depth(&mut rd, 64)
            .map_err(|e| format!("not msgpack: {e}"))?;
        if !rd.is_empty() {
            return err(format!("{} trailing bytes after the batch", rd.len()));
        }
        let (ts, events, rank) = match &root {
            ValueRef::Array(items) if items.len() >= 2 => (&items[0], &items[1], items.get(2)),
            ValueRef::Array(items) => return err(format!("batch array has {}", items.len())),
            ValueRef::Map(entries) => (
                map_get(entries, "ts").unwrap_or(&ValueRef::Nil),
                map_get(entries, "events").ok_or("batch map has no \"events\"")?,
                map_get(entries, "data_parallel_rank"),
            ),
            other => return err(format!("batch is a {}", kind(other))),
        };
        let ts = match ts {
            ValueRef::F64(f) => *f,
            ValueRef::F32(f) => f64::from(*f),
            ValueRef::Integer(i) => i.as_f64().unwrap_or(0.0),
            ValueRef::Nil => 0.0,
            other => return err(format!("batch ts is a {}", kind(other))),
        };
        let data_parallel_rank = match rank {
            None | Some(ValueRef::Nil) => None,
            Some(v) => Some(int(v)?),
        };
        let ValueRef::Array(items) = events else {
            return err(format!("batch events is a {}", kind(events)));
        };
        let mut out = Vec::new();
        let mut unknown_events = Vec::new();
        for (i, item) in items.iter().enumerate() {
            match decode_event(item).map_err(|e| format!("event {i}: {e}"))? {
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

    fn map_get<'v, 'a>(
        entries: &'v [(ValueRef<'a>, ValueRef<'a>)],
        key: &str,
    ) -> Option<&'v ValueRef<'a>> {
        entries
            .iter()
            .find(|(k, _)| matches!(k, ValueRef::String(s) if s.as_str() == Some(key)))
            .map(|(_, v)| v)
    }

    enum Fields<'v, 'a> {
        Positional(&'v [ValueRef<'a>], &'static [&'static str]),
        Named(&'v [(ValueRef<'a>, ValueRef<'a>)]),
    }

    impl<'v, 'a> Fields<'v, 'a> {
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

    fn decode_event(item: &ValueRef<'_>) -> Result<std::result::Result<KvEvent, String>> {
        let (tag, fields) = match item {
            ValueRef::Array(items) => {
                let Some(ValueRef::String(tag)) = items.first() else {
                    return err("positional event does not start with its type name");
                };
                let tag = tag.as_str().ok_or("type name is not UTF-8")?;
                let names: &'static [&'static str] = match tag {
                    "BlockStored" => &STORED_FIELDS,
                    "BlockRemoved" => &REMOVED_FIELDS,
                    _ => &[],
                };
                (tag, Fields::Positional(&items[1..], names))
            }
            ValueRef::Map(entries) => {
                let tag = match map_get(entries, "type") {
                    Some(ValueRef::String(s)) => s.as_str().ok_or("type name is not UTF-8")?,
                    Some(other) => return err(format!("event type is a {}", kind(other))),
                    None => return err("event map has no \"type\""),
                };
                (tag, Fields::Named(entries))
            }
            other => return err(format!("event is a {}", kind(other))),
        };
        let opt_int = |name| fields.get(name).map(int).transpose();
        let opt_string = |name| fields.get(name).map(string).transpose();
        let event = match tag {
            "BlockStored" => KvEvent::BlockStored(BlockStored {
                block_hashes: hashes(fields.get("block_hashes"))?,
                parent_block_hash: fields.get("parent_block_hash").map(hash).transpose()?,
                token_ids: match fields.get("token_ids") {
                    None => Vec::new(),
                    Some(ValueRef::Array(items)) => {
                        items.iter().map(u32_value).collect::<Result<_>>()?
                    }
                    Some(other) => return err(format!("token_ids is a {}", kind(other))),
                },
                block_size: fields
                    .get("block_size")
                    .map(u32_value)
                    .transpose()?
                    .unwrap_or(0),
                lora_id: opt_int("lora_id")?,
                medium: opt_string("medium")?,
                lora_name: opt_string("lora_name")?,
                extra_keys: fields.get("extra_keys").map(extra_keys).transpose()?,
                group_idx: opt_int("group_idx")?,
                kv_cache_spec_kind: opt_string("kv_cache_spec_kind")?,
            }),
            "BlockRemoved" => KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: hashes(fields.get("block_hashes"))?,
                medium: opt_string("medium")?,
                group_idx: opt_int("group_idx")?,
            }),
            "AllBlocksCleared" => KvEvent::AllBlocksCleared,
            other => return Ok(Err(other.to_owned())),
        };
        Ok(Ok(event))
    }

    fn hash(v: &ValueRef<'_>) -> Result<EngineHash> {
        match v {
            ValueRef::Integer(i) => match (i.as_u64(), i.as_i64()) {
                (Some(u), _) => Ok(EngineHash(u)),
                (None, Some(s)) => Ok(EngineHash(s as u64)),
                (None, None) => err("integer out of range"),
            },
            ValueRef::Binary(bytes) if !bytes.is_empty() => {
                let tail = &bytes[bytes.len().saturating_sub(8)..];
                let mut buf = [0u8; 8];
                buf[8 - tail.len()..].copy_from_slice(tail);
                Ok(EngineHash(u64::from_be_bytes(buf)))
            }
            other => err(format!("hash is a {}", kind(other))),
        }
    }

    fn hashes(v: Option<&ValueRef<'_>>) -> Result<Vec<EngineHash>> {
        match v {
            Some(ValueRef::Array(items)) => items.iter().map(hash).collect(),
            Some(other) => err(format!("block_hashes is a {}", kind(other))),
            None => err("block_hashes is missing"),
        }
    }

    fn int(v: &ValueRef<'_>) -> Result<i64> {
        match v {
            ValueRef::Integer(i) => i.as_i64().ok_or_else(|| "integer out of range".into()),
            other => err(format!("{} is not an int", kind(other))),
        }
    }

    fn u32_value(v: &ValueRef<'_>) -> Result<u32> {
        match v {
            ValueRef::Integer(i) => i
                .as_u64()
                .and_then(|u| u32::try_from(u).ok())
                .ok_or_else(|| format!("{i} is not a 32-bit unsigned value")),
            other => err(format!("{} is not an unsigned int", kind(other))),
        }
    }

    fn string(v: &ValueRef<'_>) -> Result<String> {
        match v {
            ValueRef::String(s) => s
                .as_str()
                .map(str::to_owned)
                .ok_or_else(|| "not UTF-8".into()),
            other => err(format!("{} is not a string", kind(other))),
        }
    }

    fn extra_keys(v: &ValueRef<'_>) -> Result<Vec<BlockExtraKeys>> {
        let ValueRef::Array(blocks) = v else {
            return err(format!("extra_keys is a {}", kind(v)));
        };
        blocks
            .iter()
            .map(|block| match block {
                ValueRef::Nil => Ok(None),
                ValueRef::Array(keys) => {
                    keys.iter().map(extra_key).collect::<Result<_>>().map(Some)
                }
                other => err(format!("extra_keys entry is a {}", kind(other))),
            })
            .collect()
    }

    fn extra_key(v: &ValueRef<'_>) -> Result<ExtraKey> {
        match v {
            ValueRef::Integer(_) => int(v).map(ExtraKey::Int),
            ValueRef::String(_) => string(v).map(ExtraKey::Str),
            ValueRef::Binary(b) => Ok(ExtraKey::Bytes(b.to_vec())),
            ValueRef::Array(items) => items
                .iter()
                .map(extra_key)
                .collect::<Result<_>>()
                .map(ExtraKey::List),
            other => err(format!("extra key is a {}", kind(other))),
        }
    }
}

/// What kind of failure an error message reports: not msgpack, trailing bytes, or a batch that is
/// well-formed msgpack but wrong.
fn failure_class(msg: &str) -> u8 {
    if msg.contains("not msgpack") {
        0
    } else if msg.contains("trailing bytes after the batch") {
        1
    } else {
        2
    }
}

/// Checks that `decode_batch` and the tree-based reference agree on `bytes`: the same batch
/// (`ts` compared bit for bit, so NaN agrees with itself), or both an error of the same class.
fn agrees_with_reference(bytes: &[u8]) -> Result<(), TestCaseError> {
    let bits = |d: DecodedBatch| {
        (
            d.batch.ts.to_bits(),
            d.batch.events,
            d.batch.data_parallel_rank,
            d.unknown_events,
        )
    };
    match (decode_batch(bytes), reference::decode_batch(bytes)) {
        (Ok(ours), Ok(theirs)) => prop_assert_eq!(bits(ours), bits(theirs)),
        (Err(ours), Err(theirs)) => {
            let ours = ours.to_string();
            prop_assert_eq!(
                failure_class(&ours),
                failure_class(&theirs),
                "{:02x?}: {} / reference: {}",
                bytes,
                ours,
                theirs
            );
        }
        (ours, theirs) => prop_assert!(
            false,
            "{:02x?}: decoder {:?}, reference {:?}",
            bytes,
            ours.map(|_| ()),
            theirs.map(|_| ())
        ),
    }
    Ok(())
}

fn encode_value(v: &rmpv::Value) -> Vec<u8> {
    let mut bytes = Vec::new();
    rmpv::encode::write_value(&mut bytes, v).unwrap();
    bytes
}

/// Flips, cuts or inserts bytes.
fn mutate(bytes: &mut Vec<u8>, edits: &[(prop::sample::Index, u8, u8)]) {
    for (at, byte, op) in edits {
        if bytes.is_empty() {
            break;
        }
        let i = at.index(bytes.len());
        match op {
            0 => bytes[i] = *byte,
            1 => bytes.truncate(i),
            _ => bytes.insert(i, *byte),
        }
    }
}

fn arb_edits(max: usize) -> impl Strategy<Value = Vec<(prop::sample::Index, u8, u8)>> {
    proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..3), 0..max)
}

fn arb_layout() -> impl Strategy<Value = EventLayout> {
    (
        prop::sample::select(vec![
            "0.9.0", "0.9.2", "0.10.2", "0.14.0", "0.17.0", "0.20.0", "0.23.0", "0.33.0",
        ]),
        any::<bool>(),
    )
        .prop_map(|(version, bytes_hashes)| {
            let mut layout = EventLayout::for_vllm_version(version).unwrap();
            if bytes_hashes {
                layout.hashes = HashEncoding::Bytes;
            }
            layout
        })
}

/// Map keys and strings the decoder looks for, so generated values hit its field paths.
const WORDS: [&str; 29] = [
    "type",
    "ts",
    "events",
    "data_parallel_rank",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "BlockMoved",
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
    "GPU",
    "CPU",
    "",
    "x",
    "Type",
    "block_hashes ",
];

fn arb_scalar() -> impl Strategy<Value = rmpv::Value> {
    use rmpv::Value;
    prop_oneof![
        Just(Value::Nil),
        any::<bool>().prop_map(Value::from),
        (0u64..200).prop_map(Value::from),
        (-200i64..0).prop_map(Value::from),
        any::<u32>().prop_map(Value::from),
        (u64::from(u32::MAX) - 2..u64::from(u32::MAX) + 3).prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::F64),
        any::<f32>().prop_map(Value::F32),
        prop::sample::select(WORDS.to_vec()).prop_map(Value::from),
        proptest::collection::vec(any::<u8>(), 0..12).prop_map(Value::Binary),
        (any::<i8>(), proptest::collection::vec(any::<u8>(), 0..5))
            .prop_map(|(t, d)| Value::Ext(t, d)),
    ]
}

fn arb_value() -> impl Strategy<Value = rmpv::Value> {
    arb_scalar().prop_recursive(4, 32, 5, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..5).prop_map(rmpv::Value::Array),
            proptest::collection::vec((arb_scalar(), inner), 0..5).prop_map(rmpv::Value::Map),
        ]
    })
}

/// A value for field `name`: usually of the type vLLM sends (often nil), sometimes anything.
fn arb_field(name: &'static str) -> BoxedStrategy<rmpv::Value> {
    use rmpv::Value;
    let hash = prop_oneof![
        any::<u64>().prop_map(Value::from),
        (0u64..300).prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        proptest::collection::vec(any::<u8>(), 0..33).prop_map(Value::Binary),
    ];
    let small = (-2i64..300).prop_map(Value::from);
    let string = prop::sample::select(vec!["GPU", "CPU", "", "lora-a"]).prop_map(Value::from);
    let typical = match name {
        "block_hashes" => proptest::collection::vec(hash, 0..5)
            .prop_map(Value::Array)
            .boxed(),
        "parent_block_hash" => hash.boxed(),
        "token_ids" => proptest::collection::vec(
            prop_oneof![
                any::<u32>().prop_map(Value::from),
                (0u32..200).prop_map(Value::from),
            ],
            0..20,
        )
        .prop_map(Value::Array)
        .boxed(),
        "block_size" | "lora_id" | "group_idx" => small.boxed(),
        "medium" | "lora_name" | "locality" => string.boxed(),
        "extra_keys" => proptest::collection::vec(
            prop_oneof![
                Just(Value::Nil),
                proptest::collection::vec(arb_value(), 0..3).prop_map(Value::Array),
            ],
            0..3,
        )
        .prop_map(Value::Array)
        .boxed(),
        _ => arb_value().boxed(),
    };
    prop_oneof![24 => typical, 6 => Just(rmpv::Value::Nil), 1 => arb_value()].boxed()
}

/// A field name of either event type, and a value for it.
fn arb_named_field() -> impl Strategy<Value = (rmpv::Value, rmpv::Value)> {
    prop_oneof![
        12 => prop::sample::select(STORED_FIELDS.to_vec())
            .prop_flat_map(|name| (Just(rmpv::Value::from(name)), arb_field(name))),
        1 => (arb_scalar(), arb_value()),
    ]
}

/// Events that are often nearly right: known tags and field names, values of plausible and
/// implausible types, fields in any order, duplicate keys, the tag anywhere in a map.
fn arb_wild_event() -> impl Strategy<Value = rmpv::Value> {
    use rmpv::Value;
    let tag = prop::sample::select(vec![
        "BlockStored",
        "BlockStored",
        "BlockRemoved",
        "AllBlocksCleared",
        "BlockMoved",
    ]);
    let positional = (tag.clone(), 0usize..16, 0u8..8).prop_flat_map(|(tag, len, swap)| {
        // Mostly the tag's own field order, sometimes the other type's.
        let removed = (tag == "BlockRemoved") != (swap == 0);
        let names: &'static [&'static str] = if removed {
            &REMOVED_FIELDS
        } else {
            &STORED_FIELDS
        };
        let fields: Vec<_> = (0..len)
            .map(|i| {
                names
                    .get(i)
                    .map_or_else(|| arb_value().boxed(), |n| arb_field(n))
            })
            .collect();
        (Just(tag), fields).prop_map(|(tag, fields)| {
            let mut items = vec![Value::from(tag)];
            items.extend(fields);
            Value::Array(items)
        })
    });
    let named = (
        tag,
        arb_field("block_hashes"),
        proptest::collection::vec(arb_named_field(), 0..10),
        any::<prop::sample::Index>(),
        0u8..8,
    )
        .prop_map(|(tag, hashes, mut entries, at, how)| {
            if how < 6 {
                entries.insert(0, (Value::from("block_hashes"), hashes));
            }
            let typed = (Value::from("type"), Value::from(tag));
            match how % 4 {
                0 | 3 => entries.insert(0, typed),
                1 => entries.insert(at.index(entries.len() + 1), typed),
                _ => {
                    entries.insert(0, typed);
                    entries.push((Value::from("type"), Value::from("BlockMoved")));
                }
            }
            if how == 7 {
                entries.retain(|(k, _)| k.as_str() != Some("type"));
            }
            Value::Map(entries)
        });
    prop_oneof![4 => positional, 4 => named, 1 => arb_value()]
}

fn arb_wild_batch() -> impl Strategy<Value = rmpv::Value> {
    use rmpv::Value;
    let ts = prop_oneof![
        6 => any::<f64>().prop_map(Value::F64),
        1 => Just(Value::Nil),
        1 => arb_scalar(),
    ];
    let rank = prop_oneof![6 => (0i64..8).prop_map(Value::from), 1 => arb_scalar()];
    let events = prop_oneof![
        12 => proptest::collection::vec(arb_wild_event(), 0..4).prop_map(Value::Array),
        1 => arb_value(),
    ];
    // Other keys, and the envelope's own again (the first occurrence counts).
    let envelope_key = prop_oneof![
        prop::sample::select(vec!["ts", "events", "data_parallel_rank"]).prop_map(Value::from),
        arb_scalar(),
    ];
    prop_oneof![
        4 => (ts.clone(), events.clone(), rank.clone(), proptest::collection::vec(arb_value(), 0..3), prop_oneof![1 => 0usize..2, 6 => 2usize..6])
            .prop_map(|(ts, events, rank, more, len)| {
                let mut items = vec![ts, events, rank];
                items.extend(more);
                items.truncate(len);
                Value::Array(items)
            }),
        2 => (ts, events, rank, proptest::collection::vec((envelope_key, arb_value()), 0..3), any::<u8>())
            .prop_map(|(ts, events, rank, mut entries, mut keep)| {
                if keep >= 32 {
                    keep |= 2; // mostly with events
                }
                for (i, (k, v)) in [("ts", ts), ("events", events), ("data_parallel_rank", rank)]
                    .into_iter()
                    .enumerate()
                {
                    if keep & (1 << i) != 0 {
                        let at = usize::from(keep) % (entries.len() + 1);
                        entries.insert(at, (Value::from(k), v));
                    }
                }
                Value::Map(entries)
            }),
        1 => arb_value(),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    /// Payloads from every release layout, intact or with bytes flipped, cut or inserted, decode
    /// exactly as the tree-based reference decodes them.
    #[test]
    fn decoder_matches_reference_on_encoded_batches(
        batch in arb_batch(true),
        layout in arb_layout(),
        map in any::<bool>(),
        edits in arb_edits(6),
    ) {
        let mut layout = layout;
        layout.map_events |= map;
        let mut bytes = encode_batch(&batch, &layout);
        agrees_with_reference(&bytes)?;
        mutate(&mut bytes, &edits);
        agrees_with_reference(&bytes)?;
    }

    /// Nearly-right batches (wrong types, unknown and duplicate keys, the tag anywhere, odd
    /// envelopes), intact or mutated, decode exactly as the reference decodes them.
    #[test]
    fn decoder_matches_reference_on_wild_batches(value in arb_wild_batch(), edits in arb_edits(4)) {
        let mut bytes = encode_value(&value);
        agrees_with_reference(&bytes)?;
        mutate(&mut bytes, &edits);
        agrees_with_reference(&bytes)?;
    }

    /// Arbitrary bytes: both decoders refuse or accept alike.
    #[test]
    fn decoder_matches_reference_on_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
        agrees_with_reference(&bytes)?;
    }
}

/// Nesting limits: values nested around the depth limit, in the fields the decoder reads
/// (extra keys) and in those it skips (unknown keys, extra envelope elements), are accepted or
/// refused exactly as the reference's `rmpv` parse accepts or refuses them.
#[test]
fn nesting_limit_matches_reference() {
    use rmpv::Value;
    let leaves = [
        Value::from(7),
        Value::from("s"),
        Value::Binary(vec![1]),
        Value::Ext(1, vec![2]),
        Value::Nil,
        Value::Array(vec![]),
    ];
    for leaf in &leaves {
        let mut nested = leaf.clone();
        for depth in 0..40 {
            let extra_keys_event = Value::Map(vec![
                (Value::from("type"), Value::from("BlockStored")),
                (
                    Value::from("block_hashes"),
                    Value::Array(vec![Value::from(1u64)]),
                ),
                (
                    Value::from("extra_keys"),
                    Value::Array(vec![Value::Array(vec![nested.clone()])]),
                ),
            ]);
            let unknown_key_event = Value::Map(vec![
                (Value::from("type"), Value::from("BlockRemoved")),
                (Value::from("block_hashes"), Value::Array(vec![])),
                (Value::from("brand_new"), nested.clone()),
            ]);
            let positional = Value::Array(vec![
                Value::from("BlockRemoved"),
                Value::Array(vec![]),
                Value::Nil,
                Value::Nil,
                nested.clone(),
            ]);
            for events in [
                vec![extra_keys_event],
                vec![unknown_key_event],
                vec![positional],
            ] {
                let batch = Value::Array(vec![Value::F64(1.0), Value::Array(events)]);
                agrees_with_reference(&encode_value(&batch))
                    .unwrap_or_else(|e| panic!("leaf {leaf}, depth {depth}: {e}"));
            }
            let envelope = Value::Array(vec![
                Value::F64(1.0),
                Value::Array(vec![]),
                Value::from(0),
                nested.clone(),
            ]);
            agrees_with_reference(&encode_value(&envelope))
                .unwrap_or_else(|e| panic!("leaf {leaf}, depth {depth}: {e}"));
            nested = Value::Array(vec![nested]);
        }
    }
}

/// Every msgpack int encoding, minimal or not, at the edges of the ranges the fields accept,
/// and the reserved byte 0xc1 (which `rmpv` reads as nil), decode as the reference decodes them.
#[test]
fn int_encodings_and_reserved_byte_match_reference() {
    let values: [i128; 12] = [
        0,
        5,
        127,
        255,
        65_535,
        i128::from(u32::MAX),
        i128::from(u32::MAX) + 1,
        i128::from(i64::MAX),
        i128::from(u64::MAX),
        -1,
        -33,
        i128::from(i64::MIN),
    ];
    let mut encodings: Vec<Vec<u8>> =
        vec![vec![0xc0], vec![0xc1], vec![0xc2], vec![0xca, 0, 0, 0, 0]];
    for v in values {
        if (0..128).contains(&v) {
            encodings.push(vec![v as u8]);
        }
        if (-32..0).contains(&v) {
            encodings.push(vec![v as i8 as u8]);
        }
        for (marker, bytes) in [(0xcc, 1), (0xcd, 2), (0xce, 4), (0xcf, 8)] {
            if v >= 0 && v >> (8 * bytes) == 0 {
                let mut e = vec![marker];
                e.extend_from_slice(&(v as u64).to_be_bytes()[8 - bytes..]);
                encodings.push(e);
            }
        }
        for (marker, bytes) in [(0xd0u8, 1usize), (0xd1, 2), (0xd2, 4), (0xd3, 8)] {
            let bits = 8 * bytes as u32;
            if v >= -(1i128 << (bits - 1)) && v < (1i128 << (bits - 1)) {
                let mut e = vec![marker];
                e.extend_from_slice(&(v as i64).to_be_bytes()[8 - bytes..]);
                encodings.push(e);
            }
        }
    }
    let header = [0x93, 0xcb, 0x3f, 0xf0, 0, 0, 0, 0, 0, 0, 0x91];
    for e in &encodings {
        // ["BlockStored", [h], h, [t, t], size, lora_id] with every slot holding `e`.
        let mut payload = header.to_vec();
        payload.extend_from_slice(&[0x96, 0xab]);
        payload.extend_from_slice(b"BlockStored");
        payload.push(0x91);
        payload.extend_from_slice(e);
        payload.extend_from_slice(e);
        payload.push(0x92);
        payload.extend_from_slice(e);
        payload.extend_from_slice(e);
        payload.extend_from_slice(e);
        payload.extend_from_slice(e);
        payload.extend_from_slice(e); // data_parallel_rank
        agrees_with_reference(&payload).unwrap_or_else(|err| panic!("{e:02x?}: {err}"));
        // As the batch's ts, and with the token array cut short.
        let mut ts = vec![0x92];
        ts.extend_from_slice(e);
        ts.push(0x90);
        agrees_with_reference(&ts).unwrap_or_else(|err| panic!("{e:02x?}: {err}"));
        payload.truncate(payload.len() - 2 * e.len());
        agrees_with_reference(&payload).unwrap_or_else(|err| panic!("{e:02x?}: {err}"));
    }
}
