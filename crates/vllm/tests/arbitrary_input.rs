//! Untrusted input into every parser but the KV-event decoder (whose own property tests live
//! in `codec::tests`): arbitrary and near-valid input never panics, and every refusal says
//! what is wrong. The stable-toolchain counterpart of the cargo-fuzz targets in `fuzz/`.

use bytes::Bytes;
use kvroute_vllm::codec::{decode_batch, parse_frames};
use kvroute_vllm::metrics::parse_engine_metrics;
use kvroute_vllm::openai::{parse_chat, parse_completion};
use kvroute_vllm::subscriber::parse_replay_reply;
use proptest::collection::vec;
use proptest::prelude::*;

/// JSON-ish bodies: valid shapes with arbitrary values where routing reads.
fn near_valid_body() -> impl Strategy<Value = String> {
    let value = prop_oneof![
        Just("null".to_owned()),
        Just("[]".to_owned()),
        Just("[[]]".to_owned()),
        Just(r#"[{"type":"image_url"}]"#.to_owned()),
        Just(r#""\ud800""#.to_owned()),
        Just(r#""\udc00\ud800""#.to_owned()),
        any::<i64>().prop_map(|n| n.to_string()),
        vec(any::<i64>(), 0..4).prop_map(|v| format!("{v:?}")),
        ".{0,12}".prop_map(|s| serde_json::to_string(&s).unwrap()),
    ];
    (value.clone(), value).prop_map(|(a, b)| {
        format!(r#"{{"model":"m","prompt":{a},"messages":[{{"role":"user","content":{b}}}],"max_tokens":{a}}}"#)
    })
}

fn metric_line() -> impl Strategy<Value = String> {
    (
        prop_oneof![
            Just("vllm:num_requests_waiting"),
            Just("vllm:num_requests_running"),
            Just("vllm:kv_cache_usage_perc"),
            Just("vllm:cache_config_info"),
            Just("# TYPE vllm:x"),
        ],
        "(\\{[a-z_]{0,8}=\"[^\"]{0,8}\"\\})?",
        "[-+0-9.eNaIinf ]{0,14}",
    )
        .prop_map(|(name, labels, value)| format!("{name}{labels} {value}"))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Any frames: a message is three frames with an 8-byte sequence, or a framing error.
    #[test]
    fn frames_parse_or_say_why(frames in vec(vec(any::<u8>(), 0..24), 0..5)) {
        let frames: Vec<Bytes> = frames.into_iter().map(Bytes::from).collect();
        match parse_frames(&frames) {
            Ok(msg) => {
                prop_assert_eq!(frames.len(), 3);
                prop_assert_eq!(frames[1].len(), 8);
                let _ = decode_batch(&msg.payload);
            }
            Err(e) => prop_assert!(e.to_string().contains("malformed"), "{e}"),
        }
        if let Err(e) = parse_replay_reply(&frames) {
            prop_assert!(!e.to_string().is_empty());
        }
    }

    /// Arbitrary bytes into both OpenAI parsers: a request or a 400 with a message.
    #[test]
    fn request_bytes_parse_or_are_a_400(body in vec(any::<u8>(), 0..256)) {
        for result in [parse_completion(&body), parse_chat(&body)] {
            if let Err(e) = result {
                prop_assert_eq!(e.status, 400);
                prop_assert!(!e.message.is_empty());
            }
        }
    }

    /// Near-valid bodies (odd prompts, content, surrogates) never panic either parser.
    #[test]
    fn near_valid_requests_parse_or_are_a_400(body in near_valid_body()) {
        for result in [parse_completion(body.as_bytes()), parse_chat(body.as_bytes())] {
            if let Err(e) = result {
                prop_assert_eq!(e.status, 400, "{}", body);
            }
        }
    }

    /// Arbitrary text and near-valid exposition into the engine-metrics parser.
    #[test]
    fn metrics_text_never_panics(noise in ".{0,200}", lines in vec(metric_line(), 0..8)) {
        let _ = parse_engine_metrics(&noise);
        let _ = parse_engine_metrics(&lines.join("\n"));
    }
}
