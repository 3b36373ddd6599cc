//! Driving the router from the Kubernetes API: read the pool, then watch its pods and turn
//! each change into endpoints joining or leaving; the pool is read again every
//! `discovery.pool_recheck_s`, and a changed selector or target ports restarts the watch.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Client, ResourceExt};
use kvroute_core::index::EndpointId;
use tokio::task::JoinHandle;
use tokio::time::{Duration, Instant, MissedTickBehavior};
use tracing::{info, warn};

use super::{KubeDiscovery, PoolSpec, pods, pool};
use crate::RouterError;
use crate::config::EndpointConfig;
use crate::membership::Membership;

/// The selector and ports to watch: the pool's, or the configured ones.
async fn resolve(client: &Client, ns: &str, d: &KubeDiscovery) -> Result<PoolSpec, RouterError> {
    let Some(name) = &d.inference_pool else {
        if d.selector.is_empty() || d.target_ports.is_empty() {
            return Err(RouterError::Config(
                "discovery: name an inference_pool, or a selector and target_ports".into(),
            ));
        }
        return Ok(PoolSpec {
            selector: d.selector.clone(),
            ports: d.target_ports.clone(),
            problems: Vec::new(),
        });
    };
    let mut last = String::new();
    for (group, version) in pool::APIS {
        let gvk = GroupVersionKind::gvk(group, version, "InferencePool");
        let api: Api<DynamicObject> =
            Api::namespaced_with(client.clone(), ns, &ApiResource::from_gvk(&gvk));
        match api.get(name).await {
            Ok(object) => {
                let value = serde_json::to_value(&object)
                    .map_err(|e| RouterError::Config(e.to_string()))?;
                return pool::pool_spec(&value);
            }
            Err(e) => last = format!("{group}/{version}: {e}"),
        }
    }
    Err(RouterError::Config(format!(
        "discovery: cannot read InferencePool {ns}/{name} ({last})"
    )))
}

/// Connects (to `api_server`, or with the in-cluster or kubeconfig credentials), resolves
/// the pool and starts watching its pods.
pub async fn start(
    router: Arc<dyn Membership>,
    discovery: KubeDiscovery,
) -> Result<JoinHandle<()>, RouterError> {
    let no_client = |e: &dyn std::fmt::Display| {
        RouterError::Config(format!("discovery: no Kubernetes client: {e}"))
    };
    let client = match &discovery.api_server {
        Some(url) => {
            let url = url.parse().map_err(|e| no_client(&e))?;
            Client::try_from(kube::Config::new(url)).map_err(|e| no_client(&e))?
        }
        None => Client::try_default().await.map_err(|e| no_client(&e))?,
    };
    run(router, client, discovery).await
}

/// Resolves the pool with `client` and starts watching its pods.
pub async fn run(
    router: Arc<dyn Membership>,
    client: Client,
    discovery: KubeDiscovery,
) -> Result<JoinHandle<()>, RouterError> {
    let ns = discovery
        .namespace
        .clone()
        .unwrap_or_else(|| client.default_namespace().to_owned());
    let mut spec = resolve(&client, &ns, &discovery).await?;
    report_problems(router.as_ref(), &mut spec, &discovery);
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let recheck = Duration::from_secs_f64(discovery.pool_recheck_s);
    Ok(tokio::spawn(async move {
        let mut members = Members::default();
        let mut pool_read = tokio::time::interval_at(Instant::now() + recheck, recheck);
        pool_read.set_missed_tick_behavior(MissedTickBehavior::Delay);
        loop {
            info!(namespace = %ns, selector = %spec.label_selector(), ports = ?spec.ports, "watching pods");
            let config = watcher::Config::default().labels(&spec.label_selector());
            // Backoff between failed polls: without it an unreachable API server is a busy
            // loop.
            let mut stream = watcher::watcher(pods.clone(), config)
                .default_backoff()
                .boxed();
            // A new watch lists again: the pods it no longer selects leave at its end.
            spec = loop {
                tokio::select! {
                    event = stream.next() => match event {
                        Some(Ok(event)) => {
                            members.apply(router.as_ref(), event, &spec.ports, &discovery);
                        }
                        // The watcher retries with backoff (and relists after 410 Gone) on
                        // its own.
                        Some(Err(e)) => warn!(error = %e, "pod watch failed; retrying"),
                        None => return,
                    },
                    _ = pool_read.tick(), if discovery.inference_pool.is_some() => {
                        if let Some(mut changed) =
                            pool_changed(&client, &ns, &discovery, &spec).await
                        {
                            report_problems(router.as_ref(), &mut changed, &discovery);
                            break changed;
                        }
                    }
                }
            };
        }
    }))
}

/// Warns about and counts what the pool's spec and the configuration make discovery ignore.
fn report_problems(router: &dyn Membership, spec: &mut PoolSpec, discovery: &KubeDiscovery) {
    spec.problems
        .extend(super::config_problems(discovery, spec.ports.len()));
    for problem in &spec.problems {
        router.ignored(problem.kind, &problem.detail);
    }
}

/// How long re-reading the pool may hold up the pod watch.
const POOL_READ_TIMEOUT: Duration = Duration::from_secs(5);

/// The pool read again, if its selector or target ports changed; a pool that cannot be read
/// keeps the last one, with a warning.
async fn pool_changed(
    client: &Client,
    ns: &str,
    discovery: &KubeDiscovery,
    current: &PoolSpec,
) -> Option<PoolSpec> {
    // Bounded: while a slow API server answers, pod events wait behind the read.
    let read = tokio::time::timeout(POOL_READ_TIMEOUT, resolve(client, ns, discovery)).await;
    let read = read.unwrap_or_else(|_| {
        Err(RouterError::Config(format!(
            "no answer within {POOL_READ_TIMEOUT:?}"
        )))
    });
    match read {
        Ok(new) if new.selector != current.selector || new.ports != current.ports => {
            info!(from_selector = %current.label_selector(), from_ports = ?current.ports,
                selector = %new.label_selector(), ports = ?new.ports,
                "the InferencePool changed; watching its pods anew");
            Some(new)
        }
        Ok(_) => None,
        Err(e) => {
            warn!(error = %e, "cannot read the InferencePool again; keeping its last selector and ports");
            None
        }
    }
}

/// The endpoints each pod put in the router, by pod name.
#[derive(Default)]
struct Members {
    pods: HashMap<String, Vec<(EndpointConfig, EndpointId)>>,
    /// The endpoints of each pod the router refused (one clashing with a present endpoint: a
    /// pod given the address of one deleted before its deletion was seen). Tried again
    /// whenever an endpoint leaves, and when the pod changes.
    refused: HashMap<String, Vec<EndpointConfig>>,
    /// Pods seen during a (re)list, until it is done.
    relisting: Option<HashSet<String>>,
}

impl Members {
    fn apply(
        &mut self,
        router: &dyn Membership,
        event: Event<Pod>,
        ports: &[u16],
        d: &KubeDiscovery,
    ) {
        match event {
            Event::Init => self.relisting = Some(HashSet::new()),
            Event::InitApply(pod) => {
                if let Some(seen) = self.relisting.as_mut() {
                    seen.insert(pod.name_any());
                }
                self.update(router, &pod, ports, d);
            }
            Event::InitDone => {
                // A relist replaces what was known: pods that vanished meanwhile leave, those
                // with only refused endpoints too (or one would join for a pod long gone).
                if let Some(seen) = self.relisting.take() {
                    let known: HashSet<&String> =
                        self.pods.keys().chain(self.refused.keys()).collect();
                    let gone: Vec<String> = known
                        .into_iter()
                        .filter(|p| !seen.contains(*p))
                        .cloned()
                        .collect();
                    for pod in gone {
                        self.leave(router, &pod);
                    }
                }
            }
            Event::Apply(pod) => self.update(router, &pod, ports, d),
            Event::Delete(pod) => self.leave(router, &pod.name_any()),
        }
    }

    /// Brings the pod's endpoints in line with what it serves now.
    fn update(&mut self, router: &dyn Membership, pod: &Pod, ports: &[u16], d: &KubeDiscovery) {
        let name = pod.name_any();
        let wanted = pods::endpoints(pod, ports, d);
        let current: Vec<EndpointConfig> = self
            .pods
            .get(&name)
            .map(|list| list.iter().map(|(c, _)| c.clone()).collect())
            .unwrap_or_default();
        let refused = self.refused.get(&name).map_or(&[][..], Vec::as_slice);
        let known: Vec<EndpointConfig> = current.iter().chain(refused).cloned().collect();
        if same(&known, &wanted) {
            // Unchanged: the endpoints it has stay (their cache picture with them), and those
            // refused are tried again.
            if let Some(configs) = self.refused.remove(&name) {
                self.join(router, &name, configs);
            }
            return;
        }
        self.leave(router, &name);
        self.join(router, &name, wanted);
    }

    /// Adds the pod's endpoints `configs` beside those it has, keeping those refused.
    fn join(&mut self, router: &dyn Membership, pod: &str, configs: Vec<EndpointConfig>) {
        for config in configs {
            match router.add_endpoint(config.clone()) {
                Ok(id) => self
                    .pods
                    .entry(pod.to_owned())
                    .or_default()
                    .push((config, id)),
                Err(e) => {
                    warn!(pod = %pod, error = %e, "cannot add the pod's endpoint; trying again when an endpoint leaves or the pod changes");
                    self.refused.entry(pod.to_owned()).or_default().push(config);
                }
            }
        }
    }

    fn leave(&mut self, router: &dyn Membership, pod: &str) {
        self.refused.remove(pod);
        let gone = self.pods.remove(pod).unwrap_or_default();
        for (_, id) in &gone {
            router.remove_endpoint(*id);
        }
        // What clashed with a leaving endpoint may join now.
        if !gone.is_empty() {
            for (pod, configs) in std::mem::take(&mut self.refused) {
                self.join(router, &pod, configs);
            }
        }
    }
}

/// Whether two endpoint lists, in any order, name the same addresses, roles, events and
/// offloaded tiers (the shared-KV mount a pod's label names): what the fleet takes only when an
/// endpoint joins, so that a change re-adds it. A pod's list is one endpoint per port: a few.
fn same(a: &[EndpointConfig], b: &[EndpointConfig]) -> bool {
    let same_endpoint = |x: &EndpointConfig, y: &EndpointConfig| {
        x.url == y.url
            && x.role == y.role
            && x.events == y.events
            && x.offload_spec() == y.offload_spec()
    };
    a.len() == b.len() && a.iter().all(|x| b.iter().any(|y| same_endpoint(x, y)))
}

#[cfg(test)]
mod tests {
    use parking_lot::Mutex;
    use serde_json::json;

    use super::*;

    /// A router that refuses the endpoints whose URL it is told to, and records the rest.
    #[derive(Default)]
    struct Router {
        refuse: Mutex<HashSet<String>>,
        present: Mutex<HashMap<u32, String>>,
        next: Mutex<u32>,
        removed: Mutex<Vec<u32>>,
    }

    impl Membership for Router {
        fn add_endpoint(&self, config: EndpointConfig) -> Result<EndpointId, RouterError> {
            if self.refuse.lock().contains(&config.url) {
                return Err(RouterError::Config(format!("{} clashes", config.url)));
            }
            let mut next = self.next.lock();
            *next += 1;
            self.present.lock().insert(*next, config.url);
            Ok(EndpointId(*next))
        }

        fn remove_endpoint(&self, id: EndpointId) -> bool {
            self.removed.lock().push(id.0);
            self.present.lock().remove(&id.0).is_some()
        }

        fn ignored(&self, _: &'static str, _: &str) {}
    }

    impl Router {
        fn urls(&self) -> HashSet<String> {
            self.present.lock().values().cloned().collect()
        }
    }

    fn pod(name: &str, ip: &str) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {"app": "vllm"}},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}
        }))
        .unwrap()
    }

    fn discovery() -> KubeDiscovery {
        serde_json::from_value(json!({"events_port": 5557})).unwrap()
    }

    fn urls(list: &[&str]) -> HashSet<String> {
        list.iter().map(|u| (*u).to_owned()).collect()
    }

    #[test]
    fn a_refused_endpoint_is_tried_again_and_its_pods_others_are_kept() {
        let router = Router::default();
        let (d, ports) = (discovery(), [8000, 8001]);
        let mut members = Members::default();
        router.refuse.lock().insert("http://10.0.0.1:8001".into());
        members.update(&router, &pod("a", "10.0.0.1"), &ports, &d);
        members.update(&router, &pod("x", "10.0.0.9"), &ports, &d);
        assert_eq!(
            router.urls(),
            urls(&[
                "http://10.0.0.1:8000",
                "http://10.0.0.9:8000",
                "http://10.0.0.9:8001"
            ])
        );
        // The pod seen again unchanged: its joined endpoint stays (no churn, its cache picture
        // with it); the refused one is tried again, and refused again.
        members.update(&router, &pod("a", "10.0.0.1"), &ports, &d);
        assert!(router.removed.lock().is_empty());
        assert_eq!(router.urls().len(), 3);
        // What it clashed with is gone: the next endpoint to leave lets it in.
        router.refuse.lock().clear();
        members.leave(&router, "x");
        assert_eq!(
            router.urls(),
            urls(&["http://10.0.0.1:8000", "http://10.0.0.1:8001"])
        );
        // A pod that leaves takes its refused endpoints with it.
        router.refuse.lock().insert("http://10.0.0.7:8000".into());
        members.update(&router, &pod("b", "10.0.0.7"), &ports, &d);
        members.leave(&router, "b");
        assert!(members.refused.is_empty());
    }

    #[test]
    fn a_relist_forgets_a_refused_pod_that_vanished_meanwhile() {
        let router = Router::default();
        let (d, ports) = (discovery(), [8000]);
        let mut members = Members::default();
        members.update(&router, &pod("a", "10.0.0.1"), &ports, &d);
        router.refuse.lock().insert("http://10.0.0.2:8000".into());
        members.update(&router, &pod("b", "10.0.0.2"), &ports, &d);
        // The watch broke; the relist finds only a: b was deleted meanwhile.
        for event in [
            Event::Init,
            Event::InitApply(pod("a", "10.0.0.1")),
            Event::InitDone,
        ] {
            members.apply(&router, event, &ports, &d);
        }
        // Its address freed and an endpoint leaving: nothing of b may join.
        router.refuse.lock().clear();
        members.leave(&router, "a");
        assert!(router.urls().is_empty(), "{:?}", router.urls());
    }
}
