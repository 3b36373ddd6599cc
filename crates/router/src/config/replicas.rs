//! The `replicas:` section: other router replicas serving the same fleet, listed or found in
//! Kubernetes, and the checks of a Kubernetes API server and label selector.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::invalid;
use crate::RouterError;

/// Running several replicas active-active: each subscribes to every engine's events; a
/// starting one copies a running peer's index (and the event sequence it reflects) before its
/// readiness check (`/health` on the API listener) answers 200.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReplicasConfig {
    /// The other replicas' admin listeners (`http://host:port`), asked in turn for a snapshot
    /// of their index at start (and this replica answers theirs, read from its index).
    pub peers: Vec<String>,
    /// Most seconds to wait for a warm index at start (a snapshot applied and every endpoint's
    /// events caught up); after that the replica reports ready anyway, with the endpoints not
    /// caught up marked untrusted.
    pub warm_timeout_s: f64,
    /// With peers: tell them where each request went, and record theirs (predicted blocks,
    /// history, placements). Measured in docs/benchmarks.md, "Router replicas".
    pub share_dispatches: bool,
    /// With dispatches shared: also count each peer's request as queued prefill at its engine
    /// until the peer says its first token came (one more small message per request per peer).
    pub share_load: bool,
    /// Peers found in Kubernetes (feature `kube`), besides `peers`: the ready pods of the
    /// router's own Deployment, by label, each reached on its admin port.
    pub kubernetes: Option<PeerDiscovery>,
}

/// Replica peers found in Kubernetes: the ready pods a label selector picks (the router
/// Deployment's own pods), watched, each a peer at `http://<pod IP>:<admin_port>`; this
/// replica's own pod is left out.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerDiscovery {
    /// The API server's URL, unauthenticated (e.g. `kubectl proxy`'s); default: the in-cluster
    /// service account, else the kubeconfig.
    #[serde(default)]
    pub api_server: Option<String>,
    /// The namespace of the router's pods (default: the client's, usually the pod's own).
    #[serde(default)]
    pub namespace: Option<String>,
    /// The label selector of the router's pods (`matchLabels`), e.g. its Deployment's.
    pub selector: BTreeMap<String, String>,
    /// The admin listener's port on every router pod.
    pub admin_port: u16,
    /// This replica's own pod name, left out of its peers (default: `$POD_NAME`, else
    /// `$HOSTNAME`, which Kubernetes sets to the pod's name). Should it be unset or wrong, the
    /// replica still leaves itself out once its first peer message reaches its own admin
    /// listener (it carries the replica's id, `x-kvroute-replica`), and drops that message.
    #[serde(default)]
    pub self_pod: Option<String>,
}

/// An API server's URL, checked at start rather than retried forever at run time.
pub(super) fn check_api_server(field: &str, url: Option<&str>) -> Result<(), RouterError> {
    if let Some(url) = url {
        let parsed: Result<axum::http::Uri, _> = url.parse();
        if !parsed.is_ok_and(|u| u.scheme().is_some() && u.host().is_some()) {
            return Err(invalid(field, format!("{url:?} is not an http(s) URL")));
        }
    }
    Ok(())
}

/// A label selector's labels: sent as `key=value` pairs joined by commas, so a key or value
/// holding one of those would select other pods, or fail the watch forever.
pub(super) fn check_selector(
    field: &str,
    selector: &std::collections::BTreeMap<String, String>,
) -> Result<(), RouterError> {
    let malformed = |text: &str| text.contains([',', '=', ' ', '!']);
    if let Some((key, value)) = selector
        .iter()
        .find(|(k, v)| k.is_empty() || malformed(k) || malformed(v))
    {
        return Err(invalid(
            field,
            format!("{key:?}: {value:?} is not a label (no empty key; no ',', '=', '!' or spaces)"),
        ));
    }
    Ok(())
}

impl PeerDiscovery {
    /// What would otherwise fail only at run time, retried forever: the API server's URL, the
    /// selector's labels (`key=value` pairs joined by commas on the wire) and the port.
    pub(super) fn validate(&self) -> Result<(), RouterError> {
        check_api_server("replicas.kubernetes.api_server", self.api_server.as_deref())?;
        check_selector("replicas.kubernetes.selector", &self.selector)?;
        if self.admin_port == 0 {
            return Err(invalid(
                "replicas.kubernetes.admin_port",
                "must be the router pods' admin port, not 0",
            ));
        }
        Ok(())
    }

    /// This replica's own pod name: configured, else from the environment.
    pub fn own_pod(&self) -> Option<String> {
        self.self_pod
            .clone()
            .or_else(|| std::env::var("POD_NAME").ok())
            .or_else(|| std::env::var("HOSTNAME").ok())
            .filter(|name| !name.is_empty())
    }
}

impl Default for ReplicasConfig {
    fn default() -> Self {
        Self {
            peers: Vec::new(),
            warm_timeout_s: 30.0,
            share_dispatches: true,
            share_load: true,
            kubernetes: None,
        }
    }
}
