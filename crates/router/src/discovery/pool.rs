//! Reading an InferencePool: v1 (`inference.networking.k8s.io/v1`: `spec.selector.matchLabels`,
//! `spec.targetPorts[].number`) and the earlier v1alpha2 shape
//! (`inference.networking.x-k8s.io/v1alpha2`: a flat `spec.selector` map, `spec.targetPortNumber`).

use std::collections::BTreeMap;

use serde_json::Value;

use super::PoolSpec;
use crate::RouterError;

/// The InferencePool APIs tried, newest first, as (group, version): v1 moved to the
/// `k8s.io` group; the earlier v1alpha2 (the Gateway API Inference Extension before 1.0, the
/// seed's) lives in `x-k8s.io`.
pub const APIS: [(&str, &str); 2] = [
    ("inference.networking.k8s.io", "v1"),
    ("inference.networking.x-k8s.io", "v1alpha2"),
];

/// The selector and ports of an InferencePool object (as JSON), of either version.
pub fn pool_spec(object: &Value) -> Result<PoolSpec, RouterError> {
    let spec = object
        .get("spec")
        .ok_or_else(|| bad("the InferencePool has no spec"))?;
    let selector = spec
        .get("selector")
        .ok_or_else(|| bad("the InferencePool has no spec.selector"))?;
    // v1: {matchLabels: {...}}; v1alpha2: the labels themselves.
    let labels = selector.get("matchLabels").unwrap_or(selector);
    let selector: BTreeMap<String, String> = labels
        .as_object()
        .ok_or_else(|| bad("spec.selector must be a map of labels"))?
        .iter()
        .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned())))
        .collect();
    if selector.is_empty() {
        return Err(bad("spec.selector selects no labels"));
    }
    let mut ports: Vec<u16> = spec
        .get("targetPorts")
        .and_then(Value::as_array)
        .map(|list| {
            list.iter()
                .filter_map(|p| p.get("number")?.as_u64())
                .filter_map(|n| u16::try_from(n).ok())
                .collect()
        })
        .unwrap_or_default();
    if let Some(n) = spec.get("targetPortNumber").and_then(Value::as_u64) {
        ports.extend(u16::try_from(n).ok());
    }
    if ports.is_empty() {
        return Err(bad("the InferencePool names no target port"));
    }
    Ok(PoolSpec { selector, ports })
}

fn bad(why: &str) -> RouterError {
    RouterError::Config(format!("discovery.inference_pool: {why}"))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn v1_pools_give_match_labels_and_every_target_port() {
        let pool = json!({"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "spec": {"selector": {"matchLabels": {"app": "vllm", "tier": "gpu"}},
                     "targetPorts": [{"number": 8000}, {"number": 8001}],
                     "endpointPickerRef": {"name": "kvroute-epp", "port": {"number": 9002}}}});
        let spec = pool_spec(&pool).unwrap();
        assert_eq!(spec.ports, [8000, 8001]);
        assert_eq!(spec.label_selector(), "app=vllm,tier=gpu");
    }

    #[test]
    fn v1alpha2_pools_give_the_flat_selector_and_target_port_number() {
        let pool = json!({"spec": {"selector": {"app": "vllm"}, "targetPortNumber": 8000,
                                   "extensionRef": {"name": "epp"}}});
        let spec = pool_spec(&pool).unwrap();
        assert_eq!(spec.ports, [8000]);
        assert_eq!(spec.label_selector(), "app=vllm");
    }

    #[test]
    fn pools_without_selector_or_port_are_refused() {
        for pool in [
            json!({}),
            json!({"spec": {"targetPortNumber": 8000}}),
            json!({"spec": {"selector": {}, "targetPortNumber": 8000}}),
            json!({"spec": {"selector": {"app": "x"}}}),
            json!({"spec": {"selector": {"app": "x"}, "targetPortNumber": 70000}}),
        ] {
            assert!(pool_spec(&pool).is_err(), "{pool}");
        }
    }
}
