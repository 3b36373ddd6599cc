//! Endpoints discovered from Kubernetes (feature `kube`): the pods an InferencePool (or a plain
//! label selector) selects are watched, and each ready pod's `ip:port` per target port joins
//! the running router through [`crate::membership::Membership`]; a pod that stops being ready or
//! is deleted leaves (`remove_endpoint`, which makes the fleet forget it). The watch is
//! kube-runtime's: it lists, then watches from the list's `resourceVersion` with bookmarks,
//! and relists when the server answers 410 Gone.
//!
//! The pure part (`pool`, `pods`) reads InferencePools and pods; `watch` drives the router.
//! `peers` finds the router's own replicas the same way (`replicas.kubernetes`).
//! Tests use a fake API server (`crates/router/tests/discovery.rs`): no kube-apiserver can
//! run where kvroute is built and tested.

#[cfg(feature = "kube")]
pub mod peers;
#[cfg(feature = "kube")]
pub mod pods;
pub mod pool;
#[cfg(feature = "kube")]
mod watch;

use std::collections::BTreeMap;
use std::sync::Arc;

pub use crate::config::KubeDiscovery;
#[cfg(feature = "kube")]
pub use watch::start;

/// Starts discovery when configured: `None` when it is not; an error when it is configured
/// but this build has no `kube` feature, or the pool cannot be read.
pub async fn spawn(
    router: &Arc<crate::service::Router>,
) -> Result<Option<tokio::task::JoinHandle<()>>, crate::RouterError> {
    let Some(discovery) = router.config().discovery.clone() else {
        return Ok(None);
    };
    #[cfg(feature = "kube")]
    {
        start(Arc::new(router.clone()), discovery).await.map(Some)
    }
    #[cfg(not(feature = "kube"))]
    {
        let _ = discovery;
        Err(crate::RouterError::Config(
            "discovery: this kvroute was built without the `kube` feature".into(),
        ))
    }
}

/// The pods to watch and the ports each serves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolSpec {
    /// Label selector (`matchLabels`).
    pub selector: BTreeMap<String, String>,
    /// Each target port is one endpoint per pod.
    pub ports: Vec<u16>,
    /// What was ignored, and why: each is warned about and counted
    /// (`kvroute_discovery_problems_total`), never dropped silently.
    pub problems: Vec<Problem>,
}

/// Something discovery ignored.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// The metric label: `non_string_label`, `port_out_of_range` or `replay_without_events`.
    pub kind: &'static str,
    /// What exactly, for the log.
    pub detail: String,
}

impl Problem {
    fn new(kind: &'static str, detail: String) -> Self {
        Self { kind, detail }
    }
}

/// What the configuration itself makes discovery ignore: a replay port without an events port
/// (replay needs the stream), and event or replay ports that the per-port offset pushes past
/// 65535 for the `ports` watched.
pub fn config_problems(d: &KubeDiscovery, ports: usize) -> Vec<Problem> {
    let mut problems = Vec::new();
    if let (Some(replay), None) = (d.replay_port, d.events_port) {
        problems.push(Problem::new(
            "replay_without_events",
            format!("replay_port {replay} without events_port: no replay without the event stream"),
        ));
    }
    let last_rank = ports.saturating_sub(1);
    for (name, port) in [
        ("events_port", d.events_port),
        ("replay_port", d.replay_port),
    ] {
        if let Some(port) = port
            && usize::from(port) + last_rank > usize::from(u16::MAX)
        {
            problems.push(Problem::new(
                "port_out_of_range",
                format!("{name} {port} + {last_rank} (one per further target port) passes 65535"),
            ));
        }
    }
    problems
}

impl PoolSpec {
    /// The selector as the API's `labelSelector` query value.
    pub fn label_selector(&self) -> String {
        self.selector
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn discovery(events_port: Option<u16>, replay_port: Option<u16>) -> KubeDiscovery {
        KubeDiscovery {
            api_server: None,
            namespace: None,
            inference_pool: None,
            selector: BTreeMap::new(),
            target_ports: Vec::new(),
            events_port,
            replay_port,
            pool_recheck_s: 30.0,
        }
    }

    #[test]
    fn a_replay_port_without_events_and_ports_past_65535_are_reported() {
        let kinds = |d: &KubeDiscovery, ports| {
            config_problems(d, ports)
                .into_iter()
                .map(|p| p.kind)
                .collect::<Vec<_>>()
        };
        assert!(kinds(&discovery(Some(5557), Some(5558)), 4).is_empty());
        assert_eq!(
            kinds(&discovery(None, Some(5558)), 1),
            ["replay_without_events"]
        );
        assert_eq!(
            kinds(&discovery(Some(65534), None), 3),
            ["port_out_of_range"]
        );
    }
}
