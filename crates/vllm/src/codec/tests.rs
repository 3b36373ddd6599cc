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
    )
        .prop_map(move |(h, p, t, bs, lid, m, ln, ek, g)| {
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
