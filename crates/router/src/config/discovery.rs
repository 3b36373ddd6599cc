//! The `discovery:` section: where endpoints come from when Kubernetes finds them.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Where the endpoints come from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KubeDiscovery {
    /// The API server's URL, unauthenticated (e.g. `kubectl proxy`'s `http://127.0.0.1:8001`);
    /// default: the in-cluster service account, else the kubeconfig.
    #[serde(default)]
    pub api_server: Option<String>,
    /// The namespace of the pool and its pods (default: the client's, usually the pod's own).
    #[serde(default)]
    pub namespace: Option<String>,
    /// An InferencePool (`inference.networking.k8s.io/v1`, or the earlier
    /// `inference.networking.x-k8s.io/v1alpha2`) naming the selector and target ports.
    #[serde(default)]
    pub inference_pool: Option<String>,
    /// A plain label selector, instead of a pool.
    #[serde(default)]
    pub selector: BTreeMap<String, String>,
    /// The engines' HTTP ports, with `selector` (a pool names its own).
    #[serde(default)]
    pub target_ports: Vec<u16>,
    /// The engines' KV-event PUB port (vLLM's default 5557), offset like the target port for
    /// each further target port (data-parallel ranks); none: approximate mode.
    #[serde(default)]
    pub events_port: Option<u16>,
    /// The engines' replay ROUTER port, offset the same way.
    #[serde(default)]
    pub replay_port: Option<u16>,
    /// Seconds between two reads of the InferencePool (at least 0.1): a changed selector or
    /// target ports restarts the pod watch with them (pods no longer selected leave, ports
    /// move).
    #[serde(default = "default_pool_recheck_s")]
    pub pool_recheck_s: f64,
}

fn default_pool_recheck_s() -> f64 {
    30.0
}
