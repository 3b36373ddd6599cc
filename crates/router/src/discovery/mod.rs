//! Endpoints discovered from Kubernetes (feature `kube`): the pods an InferencePool (or a plain
//! label selector) selects are watched, and each ready pod's `ip:port` per target port joins
//! the running router ([`Router::add_endpoint`]); a pod that stops being ready or is deleted
//! leaves ([`Router::remove_endpoint`], which makes the fleet forget it). The watch is
//! kube-runtime's: it lists, then watches from the list's `resourceVersion` with bookmarks,
//! and relists when the server answers 410 Gone.
//!
//! The pure part (`pool`, `pods`) reads InferencePools and pods; `watch` drives the router.
//! Tests use a fake API server (`crates/router/tests/discovery.rs`): no kube-apiserver can
//! run where kvroute is built and tested.

#[cfg(feature = "kube")]
pub mod pods;
pub mod pool;
#[cfg(feature = "kube")]
mod watch;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

#[cfg(feature = "kube")]
pub use watch::{run, start};

/// Starts discovery when configured: `None` when it is not; an error when it is configured
/// but this build has no `kube` feature, or the pool cannot be read.
pub async fn spawn(
    router: &std::sync::Arc<crate::service::Router>,
) -> Result<Option<tokio::task::JoinHandle<()>>, crate::RouterError> {
    let Some(discovery) = router.config().discovery.clone() else {
        return Ok(None);
    };
    #[cfg(feature = "kube")]
    {
        start(router.clone(), discovery).await.map(Some)
    }
    #[cfg(not(feature = "kube"))]
    {
        let _ = discovery;
        Err(crate::RouterError::Config(
            "discovery: this kvroute was built without the `kube` feature".into(),
        ))
    }
}

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
}

/// The pods to watch and the ports each serves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolSpec {
    /// Label selector (`matchLabels`).
    pub selector: BTreeMap<String, String>,
    /// Each target port is one endpoint per pod.
    pub ports: Vec<u16>,
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
