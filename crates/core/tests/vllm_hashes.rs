//! vLLM's `sha256_cbor` chain against ground truth produced by vLLM's own code.

use kvroute_core::keys::{BlockExtraKeys, ExtraKey, VllmHasher};
use serde_json::Value;

fn extra_keys(case: &Value) -> Option<Vec<BlockExtraKeys>> {
    let blocks = case["extra_keys"].as_array()?;
    Some(
        blocks
            .iter()
            .map(|block| {
                block.as_array().map(|keys| {
                    keys.iter()
                        .map(|k| ExtraKey::Str(k.as_str().expect("string extra key").into()))
                        .collect()
                })
            })
            .collect(),
    )
}

#[test]
fn every_fixture_case_matches_vllm() {
    let text = include_str!("data/vllm-block-hashes.jsonl");
    let mut cases = 0;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let case: Value = serde_json::from_str(line).unwrap();
        assert_eq!(case["algo"], "sha256_cbor");
        let hasher = VllmHasher::new(case["seed"].as_str().unwrap());
        assert_eq!(
            hasher.none_hash().to_hex(),
            case["none_hash"].as_str().unwrap()
        );

        let tokens: Vec<u32> = serde_json::from_value(case["token_ids"].clone()).unwrap();
        let block_size = case["block_size"].as_u64().unwrap() as usize;
        let extra = extra_keys(&case);
        let digests = hasher
            .block_digests(&tokens, block_size, extra.as_deref())
            .unwrap();

        let want_hex: Vec<String> = serde_json::from_value(case["digests"].clone()).unwrap();
        let want_u64: Vec<u64> = serde_json::from_value(case["event_u64"].clone()).unwrap();
        let got_hex: Vec<String> = digests.iter().map(|d| d.to_hex()).collect();
        let got_u64: Vec<u64> = digests.iter().map(|d| d.event_u64()).collect();
        assert_eq!(got_hex, want_hex, "digests for case {line}");
        assert_eq!(got_u64, want_u64, "event u64 for case {line}");
        cases += 1;
    }
    assert!(cases >= 25, "fixture file looks truncated: {cases} cases");
}
