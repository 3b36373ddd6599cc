//! Reading an InferencePool: v1 (`inference.networking.k8s.io/v1`: `spec.selector.matchLabels`,
//! `spec.targetPorts[].number`) and the earlier v1alpha2 shape
//! (`inference.networking.x-k8s.io/v1alpha2`: a flat `spec.selector` map, `spec.targetPortNumber`).

use std::collections::BTreeMap;

use serde_json::Value;

use super::{PoolSpec, Problem};
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
    let mut problems = Vec::new();
    let mut selector = BTreeMap::new();
    for (k, v) in labels
        .as_object()
        .ok_or_else(|| bad("spec.selector must be a map of labels"))?
    {
        match v.as_str() {
            Some(v) => {
                selector.insert(k.clone(), v.to_owned());
            }
            None => problems.push(Problem::new(
                "non_string_label",
                format!("spec.selector label {k} is {v}, not a string: ignored"),
            )),
        }
    }
    if selector.is_empty() {
        return Err(bad("spec.selector selects no labels"));
    }
    let mut numbers: Vec<u64> = spec
        .get("targetPorts")
        .and_then(Value::as_array)
        .map(|list| {
            list.iter()
                .filter_map(|p| p.get("number")?.as_u64())
                .collect()
        })
        .unwrap_or_default();
    numbers.extend(spec.get("targetPortNumber").and_then(Value::as_u64));
    let mut ports = Vec::with_capacity(numbers.len());
    for n in numbers {
        match u16::try_from(n) {
            Ok(port) if port > 0 => ports.push(port),
            _ => problems.push(Problem::new(
                "port_out_of_range",
                format!("target port {n} is not a port (1-65535): ignored"),
            )),
        }
    }
    if ports.is_empty() {
        return Err(bad("the InferencePool names no target port"));
    }
    Ok(PoolSpec {
        selector,
        ports,
        problems,
    })
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

    #[test]
    fn ignored_labels_and_ports_are_reported_not_dropped_silently() {
        let pool = json!({"spec": {"selector": {"matchLabels": {"app": "vllm", "gpu": 1}},
                                   "targetPorts": [{"number": 8000}, {"number": 70000}]}});
        let spec = pool_spec(&pool).unwrap();
        assert_eq!(spec.ports, [8000]);
        assert_eq!(spec.label_selector(), "app=vllm");
        let kinds: Vec<&str> = spec.problems.iter().map(|p| p.kind).collect();
        assert_eq!(kinds, ["non_string_label", "port_out_of_range"]);
    }
}
