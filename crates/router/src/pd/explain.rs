//! The P/D part of `/kvroute/v1/explain`: what core would decide for the request now, and every
//! option's arithmetic, with endpoint names (nothing is recorded).

use kvroute_core::fleet::Plan;
use serde_json::{Value, json};

use crate::pipeline::Prepared;
use crate::service::Router;

/// The P/D choice for `prepared` under `plan` (`null` when `pd.mode` is `off`).
pub fn explain(router: &Router, prepared: &Prepared, plan: &Plan) -> Value {
    if !router.config().pd.orchestrates() {
        return Value::Null;
    }
    let now = router.now();
    let fleet = router.fleet();
    let Some(decode) = fleet.decode_pick(plan) else {
        return json!({"choice": {"mode": "aggregated"}, "reason": "no_decode_endpoint"});
    };
    let explain = fleet.plan_disagg(
        plan,
        decode,
        prepared.prompt_tokens,
        prepared.model.block_size,
        now,
    );
    drop(fleet);
    let mut value = serde_json::to_value(explain).unwrap_or(Value::Null);
    name_endpoints(router, &mut value);
    value
}

/// Replaces the endpoint ids under `endpoint`, `prefill` and `decode` keys with names.
fn name_endpoints(router: &Router, value: &mut Value) {
    match value {
        Value::Object(map) => {
            for (key, v) in map.iter_mut() {
                let id = v.as_u64().and_then(|id| u32::try_from(id).ok());
                match (key.as_str(), id) {
                    ("endpoint" | "prefill" | "decode", Some(id)) => {
                        let id = kvroute_core::index::EndpointId(id);
                        *v = Value::String(router.endpoint(id).name.clone());
                    }
                    _ => name_endpoints(router, v),
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(|v| name_endpoints(router, v)),
        _ => {}
    }
}
