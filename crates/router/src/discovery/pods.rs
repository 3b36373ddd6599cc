//! A pod as the router's endpoints: one per target port when it is ready and has an IP, with
//! its role from llm-d's `llm-d.ai/role` label and its KV-event addresses from the configured
//! ports (offset per further target port, as vLLM offsets them per data-parallel rank).

use k8s_openapi::api::core::v1::Pod;
use kvroute_core::schedule::Role;

use super::KubeDiscovery;
use crate::config::EndpointConfig;

/// llm-d's role label: `prefill`, `decode`, or `both` / `prefill-decode` (the default).
pub const ROLE_LABEL: &str = "llm-d.ai/role";

/// Whether the pod is running, ready and not being deleted.
pub fn ready(pod: &Pod) -> bool {
    if pod.metadata.deletion_timestamp.is_some() {
        return false;
    }
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The role its label names (unknown values serve whole requests).
pub fn role(pod: &Pod) -> Role {
    let label = pod
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(ROLE_LABEL))
        .map(String::as_str);
    match label {
        Some("prefill") => Role::Prefill,
        Some("decode") => Role::Decode,
        _ => Role::Both,
    }
}

/// The endpoints a ready pod serves (none when not ready or without an IP).
pub fn endpoints(pod: &Pod, ports: &[u16], discovery: &KubeDiscovery) -> Vec<EndpointConfig> {
    let ip = pod.status.as_ref().and_then(|s| s.pod_ip.as_deref());
    let (Some(ip), true) = (ip, ready(pod)) else {
        return Vec::new();
    };
    let name = pod.metadata.name.as_deref().unwrap_or("pod");
    let host = if ip.contains(':') {
        format!("[{ip}]")
    } else {
        ip.to_owned()
    };
    let offset = |base: Option<u16>, rank: usize| {
        base.and_then(|b| b.checked_add(u16::try_from(rank).ok()?))
            .map(|p| format!("tcp://{host}:{p}"))
    };
    ports
        .iter()
        .enumerate()
        .map(|(rank, port)| {
            let events = offset(discovery.events_port, rank);
            EndpointConfig {
                name: Some(if ports.len() > 1 {
                    format!("{name}:{port}")
                } else {
                    name.to_owned()
                }),
                url: format!("http://{host}:{port}"),
                replay: events
                    .as_ref()
                    .and_then(|_| offset(discovery.replay_port, rank)),
                events,
                topic: String::new(),
                role: role(pod),
                models: Vec::new(),
                labels: pod
                    .metadata
                    .labels
                    .clone()
                    .unwrap_or_default()
                    .into_iter()
                    .collect(),
                offload: Default::default(),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn pod(ready: &str, ip: Option<&str>, role: Option<&str>) -> Pod {
        let mut labels = json!({"app": "vllm"});
        if let Some(r) = role {
            labels[ROLE_LABEL] = json!(r);
        }
        serde_json::from_value(json!({
            "metadata": {"name": "vllm-0", "labels": labels},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": ready}]}
        }))
        .unwrap()
    }

    fn discovery() -> KubeDiscovery {
        serde_json::from_value(json!({"events_port": 5557, "replay_port": 5657})).unwrap()
    }

    #[test]
    fn a_ready_pod_is_one_endpoint_per_target_port_with_offset_event_ports() {
        let e = endpoints(
            &pod("True", Some("10.0.0.7"), None),
            &[8000, 8001],
            &discovery(),
        );
        assert_eq!(e.len(), 2);
        assert_eq!(e[0].url, "http://10.0.0.7:8000");
        assert_eq!(e[1].url, "http://10.0.0.7:8001");
        assert_eq!(e[1].events.as_deref(), Some("tcp://10.0.0.7:5558"));
        assert_eq!(e[1].replay.as_deref(), Some("tcp://10.0.0.7:5658"));
        assert_eq!(e[1].name.as_deref(), Some("vllm-0:8001"));
        assert_eq!(e[0].role, Role::Both);
        let single = endpoints(&pod("True", Some("fd00::7"), None), &[8000], &discovery());
        assert_eq!(single[0].url, "http://[fd00::7]:8000");
        assert_eq!(single[0].name.as_deref(), Some("vllm-0"));
    }

    #[test]
    fn pods_not_ready_or_without_ip_serve_nothing_and_roles_come_from_the_label() {
        assert!(endpoints(&pod("False", Some("10.0.0.7"), None), &[8000], &discovery()).is_empty());
        assert!(endpoints(&pod("True", None, None), &[8000], &discovery()).is_empty());
        assert_eq!(role(&pod("True", None, Some("decode"))), Role::Decode);
        assert_eq!(role(&pod("True", None, Some("prefill"))), Role::Prefill);
        assert_eq!(role(&pod("True", None, Some("prefill-decode"))), Role::Both);
    }
}
