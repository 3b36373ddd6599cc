//! Endpoints discovered from Kubernetes (feature `kube`): the pods an InferencePool (or a plain
//! label selector) selects are watched, and each ready pod's `ip:port` per target port joins
//! the running router through [`crate::membership::Membership`]; a pod that stops being ready or
//! is deleted leaves (`remove_endpoint`, which makes the fleet forget it). The watch is
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
use std::sync::Arc;

pub use crate::config::KubeDiscovery;
#[cfg(feature = "kube")]
pub use watch::{run, start};

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
