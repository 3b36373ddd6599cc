//! Arbitrary and near-valid YAML into the configuration loader: it never panics, and every
//! refusal names a problem. The stable-toolchain counterpart of `fuzz/`'s `router_config`.

use kvroute_router::config::RouterConfig;
use proptest::prelude::*;

/// Valid shapes with arbitrary scalars where the loader validates.
fn near_valid_yaml() -> impl Strategy<Value = String> {
    let scalar = prop_oneof![
        Just("0".to_owned()),
        Just("-1".to_owned()),
        Just("1e309".to_owned()),
        Just(".nan".to_owned()),
        Just("''".to_owned()),
        Just("[]".to_owned()),
        Just("{}".to_owned()),
        Just("'0.0.0.0:1'".to_owned()),
        any::<u64>().prop_map(|n| n.to_string()),
        "[a-z:/.0-9]{0,16}".prop_map(|s| format!("'{s}'")),
    ];
    (scalar.clone(), scalar.clone(), scalar.clone(), scalar).prop_map(|(a, b, c, d)| {
        format!(
            "listen: {a}\nadmin: {{listen: {b}, token: {c}}}\nmodels: [{{name: m, block_size: {d}}}]\n\
             endpoints: [{{url: {a}, events: {b}}}]\nlimits: {{max_body_bytes: {c}, max_buffered_bytes: {d}}}\n\
             scheduler: {{prefill_tokens_per_s: {a}, weights: {{load: {b}}}}}\n"
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn arbitrary_text_loads_or_says_why(text in "(?s).{0,300}") {
        if let Err(e) = RouterConfig::from_yaml(&text) {
            prop_assert!(e.to_string().len() > "invalid configuration: ".len());
        }
    }

    #[test]
    fn near_valid_configs_load_or_say_why(text in near_valid_yaml()) {
        if let Err(e) = RouterConfig::from_yaml(&text) {
            prop_assert!(e.to_string().len() > "invalid configuration: ".len(), "{}", text);
        }
    }
}
