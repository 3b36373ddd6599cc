//! Offloading connectors' KV events, release by release: each shape decodes to the events
//! vLLM meant, and an index fed only by them holds each block on the tiers the engine does.
//!
//! The fixtures (`tests/data/offload-events.jsonl`) are written by
//! `tests/python/offload_fixtures.py` with msgspec structs declared like each release's.

use std::collections::BTreeMap;

use kvroute_core::event::Tier;
use kvroute_core::index::{EndpointId, IndexConfig, KvIndex, OffloadSpec};
use kvroute_core::keys::router_keys;
use kvroute_vllm::codec::decode_batch;
use serde_json::Value;

const E: EndpointId = EndpointId(0);

fn lines() -> Vec<Value> {
    include_str!("data/offload-events.jsonl")
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn tier_name(t: Tier) -> &'static str {
    match t {
        Tier::Gpu => "GPU",
        Tier::Cpu => "CPU",
        Tier::Storage => "STORAGE",
    }
}

#[test]
fn every_offload_shape_decodes_to_the_events_vllm_meant() {
    let all = lines();
    for line in &all {
        let case = line["case"].as_str().unwrap();
        let payload = hex::decode(line["payload_hex"].as_str().unwrap()).unwrap();
        let decoded = decode_batch(&payload).unwrap_or_else(|e| panic!("{case}: {e}"));
        assert!(decoded.unknown_events.is_empty(), "{case}");
        let got = serde_json::to_value(&decoded.batch.events).unwrap();
        let want = line["expect"].as_array().unwrap();
        assert_eq!(got.as_array().unwrap().len(), want.len(), "{case}");
        for (g, w) in got.as_array().unwrap().iter().zip(want) {
            for (field, value) in w.as_object().unwrap() {
                assert_eq!(&g[field], value, "{case} seq {} field {field}", line["seq"]);
            }
        }
    }
    // Every shape of vllm-wire.md §6 is covered.
    let cases: Vec<&str> = all.iter().map(|l| l["case"].as_str().unwrap()).collect();
    for needle in [
        "0.13.0-bytes-chunks",
        "0.17.0-bytes-chunks",
        "0.21.0-bytes-placeholders",
        "placeholders-CPU",
        "placeholders-FS",
        "placeholders-OBJ",
        "placeholders-STORAGE",
        "placeholders-cpu",
        "self-describing",
        "lmcache",
    ] {
        assert!(cases.iter().any(|c| c.contains(needle)), "no {needle} case");
    }
}

#[test]
fn an_index_fed_each_shape_holds_each_block_on_the_right_tiers() {
    let prompt: Vec<u32> = (1000..1000 + 8 * 16).collect();
    let keys = router_keys(&prompt, 16, None).unwrap();
    let mut by_case: BTreeMap<String, Vec<Value>> = BTreeMap::new();
    for line in lines() {
        let case = line["case"].as_str().unwrap().to_owned();
        by_case.entry(case).or_default().push(line);
    }
    assert!(by_case.len() >= 10);
    for (case, messages) in by_case {
        let last = messages.last().unwrap();
        let mut ix = KvIndex::new(IndexConfig {
            block_size: 16,
            capacity: 1 << 16,
        })
        .unwrap();
        let offload = last["index"]["offload_block_size"].as_u64();
        ix.set_offload(
            E,
            &OffloadSpec {
                block_size: offload.map(|b| b as usize),
                shared: None,
            },
        )
        .unwrap();
        for m in &messages {
            let payload = hex::decode(m["payload_hex"].as_str().unwrap()).unwrap();
            ix.apply(E, &decode_batch(&payload).unwrap().batch.events);
        }
        let stats = ix.endpoint_stats(E).unwrap();
        assert_eq!(stats.offload_orphans, 0, "{case}: {stats:#?}");
        for (i, key) in keys.iter().enumerate() {
            let want: Vec<&str> = last["after"][i.to_string()]
                .as_array()
                .map(|a| a.iter().map(|t| t.as_str().unwrap()).collect())
                .unwrap_or_default();
            let got: Vec<&str> = Tier::ALL
                .into_iter()
                .filter(|t| ix.holds(E, *key, *t))
                .map(tier_name)
                .collect();
            let mut want_sorted = want.clone();
            want_sorted.sort_by_key(|t| ["GPU", "CPU", "STORAGE"].iter().position(|n| n == t));
            assert_eq!(got, want_sorted, "{case}: block {i}");
        }
    }
}
