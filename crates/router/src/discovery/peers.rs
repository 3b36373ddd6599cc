//! Replica peers found in Kubernetes (`replicas.kubernetes`, feature `kube`): the ready pods of
//! the router's own Deployment, picked by label and watched, each a peer at its pod IP and the
//! admin port; this replica's own pod is left out (by name here; should the name not match,
//! by the replica id its first peer message to itself carries). Every change replaces the peer list the
//! replica shares dispatches with; the first list also lets a starting replica's warm-up ask
//! them for a snapshot. The watch is kube-runtime's, as for engine pods ([`super::watch`]).

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Client, ResourceExt};
use tokio::task::JoinHandle;
use tracing::{error, info, warn};

use super::pods;
use crate::config::PeerDiscovery;
use crate::service::Router;

/// The peer a router pod is: `http://<pod IP>:<admin_port>` when it is ready and not this
/// replica's own pod (`own`).
pub fn peer_url(pod: &Pod, admin_port: u16, own: Option<&str>) -> Option<String> {
    if own.is_some_and(|own| pod.metadata.name.as_deref() == Some(own)) || !pods::ready(pod) {
        return None;
    }
    let ip = pod.status.as_ref()?.pod_ip.as_deref()?;
    Some(if ip.contains(':') {
        format!("http://[{ip}]:{admin_port}")
    } else {
        format!("http://{ip}:{admin_port}")
    })
}

/// Starts watching the router's pods; the peer list follows them.
pub(crate) fn spawn(router: &Arc<Router>, discovery: PeerDiscovery) -> JoinHandle<()> {
    let router = router.clone();
    tokio::spawn(async move {
        let client = match &discovery.api_server {
            Some(url) => url
                .parse()
                .map_err(|e: http::uri::InvalidUri| e.to_string())
                .and_then(|url| {
                    Client::try_from(kube::Config::new(url)).map_err(|e| e.to_string())
                }),
            None => Client::try_default().await.map_err(|e| e.to_string()),
        };
        let client = match client {
            Ok(client) => client,
            Err(e) => {
                error!(error = %e, "replicas.kubernetes: no Kubernetes client; only replicas.peers are peers");
                let configured = router.config().replicas.peers.clone();
                router.replica().set_peers(&configured, Vec::new());
                return;
            }
        };
        watch(router, client, discovery).await;
    })
}

async fn watch(router: Arc<Router>, client: Client, discovery: PeerDiscovery) {
    let ns = discovery
        .namespace
        .clone()
        .unwrap_or_else(|| client.default_namespace().to_owned());
    let own = discovery.own_pod();
    let selector = discovery
        .selector
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",");
    info!(namespace = %ns, %selector, own_pod = ?own, "watching the router's pods for replica peers");
    let api: Api<Pod> = Api::namespaced(client, &ns);
    let config = watcher::Config::default().labels(&selector);
    let mut stream = watcher::watcher(api, config).default_backoff().boxed();
    let mut peers = Peers::default();
    while let Some(event) = stream.next().await {
        match event {
            Ok(event) => {
                if peers.apply(event, discovery.admin_port, own.as_deref()) {
                    let found: Vec<String> = peers.urls();
                    info!(peers = ?found, "replica peers changed");
                    let configured = &router.config().replicas.peers;
                    router.replica().set_peers(configured, found);
                }
            }
            Err(e) => warn!(error = %e, "router pod watch failed; retrying"),
        }
    }
}

/// The peers found, by pod name.
#[derive(Default)]
struct Peers {
    pods: BTreeMap<String, String>,
    /// Pods seen during a (re)list, until it is done.
    relisting: Option<HashSet<String>>,
}

impl Peers {
    /// Applies a watch event; whether the peer list is to be published (it changed, or a list
    /// just completed).
    fn apply(&mut self, event: Event<Pod>, admin_port: u16, own: Option<&str>) -> bool {
        match event {
            Event::Init => {
                self.relisting = Some(HashSet::new());
                false
            }
            Event::InitApply(pod) => {
                if let Some(seen) = self.relisting.as_mut() {
                    seen.insert(pod.name_any());
                }
                self.update(&pod, admin_port, own);
                false
            }
            Event::InitDone => {
                if let Some(seen) = self.relisting.take() {
                    self.pods.retain(|name, _| seen.contains(name));
                }
                true
            }
            Event::Apply(pod) => self.update(&pod, admin_port, own),
            Event::Delete(pod) => self.pods.remove(&pod.name_any()).is_some(),
        }
    }

    /// Whether the pod's peer changed.
    fn update(&mut self, pod: &Pod, admin_port: u16, own: Option<&str>) -> bool {
        let name = pod.name_any();
        match peer_url(pod, admin_port, own) {
            Some(url) => self.pods.insert(name, url.clone()) != Some(url),
            None => self.pods.remove(&name).is_some(),
        }
    }

    fn urls(&self) -> Vec<String> {
        self.pods.values().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn pod(name: &str, ip: &str, ready: bool) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]}
        }))
        .unwrap()
    }

    #[test]
    fn ready_router_pods_but_this_one_are_peers_on_the_admin_port() {
        assert_eq!(
            peer_url(&pod("router-a", "10.0.0.7", true), 9091, Some("router-b")),
            Some("http://10.0.0.7:9091".to_owned())
        );
        assert_eq!(
            peer_url(&pod("router-a", "fd00::7", true), 9091, None),
            Some("http://[fd00::7]:9091".to_owned())
        );
        assert_eq!(
            peer_url(&pod("router-b", "10.0.0.8", true), 9091, Some("router-b")),
            None
        );
        assert_eq!(
            peer_url(&pod("router-c", "10.0.0.9", false), 9091, None),
            None
        );
    }

    #[test]
    fn a_relist_drops_pods_that_vanished_and_publishes_the_list() {
        let mut peers = Peers::default();
        assert!(peers.apply(Event::Apply(pod("a", "10.0.0.1", true)), 9091, None));
        assert!(!peers.apply(Event::Apply(pod("a", "10.0.0.1", true)), 9091, None));
        assert!(!peers.apply(Event::Init, 9091, None));
        assert!(!peers.apply(Event::InitApply(pod("b", "10.0.0.2", true)), 9091, None));
        assert!(peers.apply(Event::InitDone, 9091, None));
        assert_eq!(peers.urls(), ["http://10.0.0.2:9091"]);
        assert!(peers.apply(Event::Apply(pod("b", "10.0.0.2", false)), 9091, None));
        assert!(peers.urls().is_empty());
    }
}
