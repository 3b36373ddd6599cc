//! Kubernetes discovery against a fake API server (no kube-apiserver can run here): an axum
//! server speaking list + watch for pods (resourceVersion, bookmarks, 410 Gone, a watch the
//! server ends) and serving an InferencePool only as v1alpha2 (`inference.networking.x-k8s.io`,
//! the seed's), so that the v1 → v1alpha2 fallback runs too. kube's own client talks to it over
//! HTTP; simulated engines on loopback addresses stand in for the pods.

use std::collections::{BTreeSet, VecDeque};
use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicUsize, Ordering};

use axum::body::Body;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use kvroute_router::server::{RunningRouter, start};
use kvroute_sim::server::{SimConfig, SimFleet, start as start_sim};
use kvroute_testkit::eventually;
use parking_lot::Mutex;
use serde_json::{Value, json};
use tokio::sync::mpsc;

mod common;
mod replicas_common;

use common::config_builder::ConfigBuilder;
use common::fleet_view::present_endpoints;

const MODEL: &str = "sim-llama-3.1-8b";

/// What the fake API server answers: one pod list per (re)list, one scripted stream per watch,
/// the pool's target port; and what it was asked: lists, each watch's `resourceVersion`.
#[derive(Default)]
struct Fake {
    lists: Mutex<VecDeque<Value>>,
    watches: Mutex<VecDeque<mpsc::UnboundedReceiver<Value>>>,
    /// The pool's target port (changed by a test: the pool edited while discovery runs).
    port: AtomicU16,
    /// The label selector lists and watches must name (default: `app=vllm`, the engines').
    selector: Option<&'static str>,
    list_calls: AtomicUsize,
    watch_versions: Mutex<Vec<String>>,
}

fn pod(name: &str, ip: &str, ready: bool, rv: u32) -> Value {
    json!({"apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "llm", "resourceVersion": rv.to_string(),
                     "labels": {"app": "vllm", "llm-d.ai/role": "decode"}},
        "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]}})
}

fn list(items: Vec<Value>, rv: u32) -> Value {
    json!({"apiVersion": "v1", "kind": "PodList", "metadata": {"resourceVersion": rv.to_string()}, "items": items})
}

fn event(kind: &str, object: Value) -> Value {
    json!({"type": kind, "object": object})
}

fn status(code: u16, reason: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
           "message": reason, "reason": reason, "code": code})
}

async fn pods(State(fake): State<Arc<Fake>>, Query(q): Query<Vec<(String, String)>>) -> Response {
    let param = |k: &str| q.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
    assert_eq!(
        param("labelSelector"),
        Some(fake.selector.unwrap_or("app=vllm"))
    );
    if param("watch") != Some("true") {
        fake.list_calls.fetch_add(1, Ordering::Relaxed);
        let mut lists = fake.lists.lock();
        let body = if lists.len() > 1 {
            lists.pop_front().unwrap()
        } else {
            lists.front().cloned().unwrap()
        };
        return axum::Json(body).into_response();
    }
    fake.watch_versions
        .lock()
        .push(param("resourceVersion").unwrap_or_default().to_owned());
    let Some(rx) = fake.watches.lock().pop_front() else {
        // No more scripted watches: hold this one open, empty.
        let stream = futures::stream::pending::<Result<String, Infallible>>();
        return Body::from_stream(stream).into_response();
    };
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        let line = rx.recv().await?;
        Some((Ok::<_, Infallible>(format!("{line}\n")), rx))
    });
    Body::from_stream(stream).into_response()
}

async fn pool_v1() -> Response {
    (StatusCode::NOT_FOUND, axum::Json(status(404, "NotFound"))).into_response()
}

async fn pool_v1alpha2(State(fake): State<Arc<Fake>>) -> Response {
    axum::Json(
        json!({"apiVersion": "inference.networking.x-k8s.io/v1alpha2", "kind": "InferencePool",
        "metadata": {"name": "pool", "namespace": "llm"},
        "spec": {"selector": {"app": "vllm"}, "targetPortNumber": fake.port.load(Ordering::Relaxed),
                 "extensionRef": {"name": "kvroute-epp"}}}),
    )
    .into_response()
}

async fn fake_api(fake: Arc<Fake>) -> std::net::SocketAddr {
    let app = axum::Router::new()
        .route("/api/v1/namespaces/llm/pods", get(pods))
        .route(
            "/apis/inference.networking.k8s.io/v1/namespaces/llm/inferencepools/pool",
            get(pool_v1),
        )
        .route(
            "/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/llm/inferencepools/pool",
            get(pool_v1alpha2),
        )
        .with_state(fake);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// The URLs of the endpoints present in the fleet.
fn members(router: &RunningRouter) -> BTreeSet<String> {
    present_endpoints(&router.router)
        .into_iter()
        .map(|e| e.url)
        .collect()
}

async fn expect(router: &RunningRouter, want: &[&str]) {
    let want: BTreeSet<String> = want.iter().map(|u| (*u).to_owned()).collect();
    eventually("the pool's members", || {
        let now = members(router);
        (now == want, now)
    })
    .await;
}

/// A pool targeting port 8000 whose first list holds one ready pod, `a` at 10.0.0.1.
/// A router discovering the pool `fake` serves (with one watch to come, whose sender is
/// returned), once it found pod a.
async fn router_on_pool(fake: &Arc<Fake>) -> (RunningRouter, mpsc::UnboundedSender<Value>) {
    let (watch, rx) = mpsc::unbounded_channel();
    fake.watches.lock().push_back(rx);
    let api = fake_api(fake.clone()).await;
    let config = ConfigBuilder::new("m")
        .discovery(&format!("http://{api}"), "llm", "pool", 5557)
        .build();
    let running = start(config).await.unwrap();
    expect(&running, &["http://10.0.0.1:8000"]).await;
    (running, watch)
}

fn pool_of_pod_a() -> Arc<Fake> {
    let fake = Arc::new(Fake {
        port: 8000.into(),
        ..Fake::default()
    });
    fake.lists
        .lock()
        .push_back(list(vec![pod("a", "10.0.0.1", true, 5)], 10));
    fake
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_pods_join_and_leave_through_list_watch_bookmarks_and_410_relists() {
    let fake = pool_of_pod_a();
    // After the 410, a relist finds only c: b vanished while the watch was down.
    fake.lists
        .lock()
        .push_back(list(vec![pod("c", "10.0.0.3", true, 20)], 21));
    let (running, watch) = router_on_pool(&fake).await;
    let a = running.router.endpoints()[0].clone();
    assert_eq!(a.config.events.as_deref(), Some("tcp://10.0.0.1:5557"));
    assert_eq!(a.config.role, kvroute_core::schedule::Role::Decode);

    watch
        .send(event("ADDED", pod("b", "10.0.0.2", true, 11)))
        .unwrap();
    expect(&running, &["http://10.0.0.1:8000", "http://10.0.0.2:8000"]).await;
    watch
        .send(event(
            "BOOKMARK",
            json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"resourceVersion": "12"}}),
        ))
        .unwrap();
    watch
        .send(event("MODIFIED", pod("a", "10.0.0.1", false, 13)))
        .unwrap();
    expect(&running, &["http://10.0.0.2:8000"]).await;
    watch.send(event("ERROR", status(410, "Expired"))).unwrap();
    drop(watch);
    expect(&running, &["http://10.0.0.3:8000"]).await;
}

/// An InferencePool edited while discovery runs (its target port moved): the pool is read
/// again, and the pods' endpoints move to the new port.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edited_pool_moves_its_pods_endpoints() {
    let fake = pool_of_pod_a();
    let api = fake_api(fake.clone()).await;
    let config = ConfigBuilder::new("m")
        .discovery(&format!("http://{api}"), "llm", "pool", 5557)
        .with(|c| c.discovery.as_mut().unwrap().pool_recheck_s = 0.2)
        .build();
    let running = start(config).await.unwrap();
    expect(&running, &["http://10.0.0.1:8000"]).await;
    fake.port.store(9000, Ordering::Relaxed);
    expect(&running, &["http://10.0.0.1:9000"]).await;
}

/// A pod given the address of one whose deletion is not yet seen (Kubernetes reuses pod IPs)
/// clashes with it and is refused; it joins once the old pod leaves, with no change of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_refused_for_a_clash_joins_once_the_clashing_pod_leaves() {
    let fake = pool_of_pod_a();
    let (running, watch) = router_on_pool(&fake).await;
    let router = running.router.clone();
    let names = move || -> BTreeSet<String> {
        present_endpoints(&router)
            .into_iter()
            .filter_map(|e| e.name)
            .collect()
    };
    let want =
        |pods: &[&str]| -> BTreeSet<String> { pods.iter().map(|p| (*p).to_owned()).collect() };
    // b comes with a's address and is refused; c, after it, joins (so b was seen by then).
    watch
        .send(event("ADDED", pod("b", "10.0.0.1", true, 11)))
        .unwrap();
    watch
        .send(event("ADDED", pod("c", "10.0.0.3", true, 12)))
        .unwrap();
    eventually("c joins beside a, b refused", || {
        let now = names();
        (now == want(&["a", "c"]), now)
    })
    .await;
    watch
        .send(event("DELETED", pod("a", "10.0.0.1", true, 13)))
        .unwrap();
    eventually("b joins once a left", || {
        let now = names();
        (now == want(&["b", "c"]), now)
    })
    .await;
}

/// A running pod whose shared-KV mount label is set, changed, then removed: each time it rejoins
/// with the mount its label names now (the fleet takes an endpoint's mount only as it joins).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pods_shared_kv_mount_follows_its_label() {
    let fake = pool_of_pod_a();
    let (running, watch) = router_on_pool(&fake).await;
    let router = running.router.clone();
    let mounts = || -> Vec<Option<String>> {
        present_endpoints(&router)
            .iter()
            .map(|e| e.offload_spec().shared.map(|m| m.name))
            .collect()
    };
    assert_eq!(mounts(), [None]);

    let mounted = |mount: Option<&str>, rv| {
        let mut labels = json!({"app": "vllm", "llm-d.ai/role": "decode"});
        if let Some(mount) = mount {
            labels[kvroute_router::config::SHARED_MOUNT_LABEL] = json!(mount);
        }
        event("MODIFIED", labelled("a", "10.0.0.1", true, rv, labels))
    };
    for (rv, mount) in [(11, Some("nfs-a")), (12, Some("nfs-b")), (13, None)] {
        watch.send(mounted(mount, rv)).unwrap();
        let want = vec![mount.map(str::to_owned)];
        eventually("a's mount follows its label", || {
            let now = mounts();
            (now == want, now)
        })
        .await;
    }
}

/// `pod`, with other labels.
fn labelled(name: &str, ip: &str, ready: bool, rv: u32, labels: Value) -> Value {
    let mut p = pod(name, ip, ready, rv);
    p["metadata"]["labels"] = labels;
    p
}

/// One simulated engine bound to `host` (a loopback address standing in for a pod IP).
async fn engine_at(host: &str, port: u16, events_port: u16) -> SimFleet {
    start_sim(SimConfig {
        host: host.into(),
        port,
        events_port,
        replay_port: None,
        time_scale: 10.0,
        ..SimConfig::default()
    })
    .await
    .unwrap()
}

/// A steady stream of completions through the router, one at a time: `begun` counts those
/// started, `served` says who served each (by sequence number: the endpoint's name, or the
/// status of a failure).
#[derive(Default)]
struct Traffic {
    begun: AtomicUsize,
    stop: AtomicBool,
    served: Mutex<Vec<(usize, String)>>,
}

async fn send_steadily(addr: std::net::SocketAddr, traffic: Arc<Traffic>) {
    let client = reqwest::Client::new();
    while !traffic.stop.load(Ordering::Relaxed) {
        let i = traffic.begun.fetch_add(1, Ordering::SeqCst);
        let response = client
            .post(format!("http://{addr}/v1/completions"))
            .json(&json!({"model": MODEL, "prompt": format!("request {i} ").repeat(20), "max_tokens": 1}))
            .send()
            .await
            .unwrap();
        let who = match response.status().as_u16() {
            200 => common::served_by(&response),
            status => format!("status {status}"),
        };
        traffic.served.lock().push((i, who));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_join_when_ready_and_leave_when_deleted_or_relabelled_while_requests_flow() {
    // Two engines on loopback addresses that stand in for pod IPs, on the pool's port.
    let (port, events) = (
        kvroute_testkit::free_ports(1),
        kvroute_testkit::free_ports(1),
    );
    let a_engine = engine_at("127.0.0.2", port, events).await;
    let b_engine = engine_at("127.0.0.3", port, events).await;
    let fake = Arc::new(Fake {
        port: port.into(),
        ..Fake::default()
    });
    let vllm = || json!({"app": "vllm"});
    fake.lists.lock().push_back(list(
        vec![
            labelled("a", "127.0.0.2", true, 5, vllm()),
            labelled("b", "127.0.0.3", false, 6, vllm()),
        ],
        10,
    ));
    let (watch, rx) = mpsc::unbounded_channel();
    fake.watches.lock().push_back(rx);
    let (rewatch, rx) = mpsc::unbounded_channel();
    fake.watches.lock().push_back(rx);
    let api = fake_api(fake.clone()).await;
    let config = ConfigBuilder::new(MODEL)
        .discovery(&format!("http://{api}"), "llm", "pool", events)
        .build();
    let running = start(config).await.unwrap();
    let (a, b) = (
        format!("http://127.0.0.2:{port}"),
        format!("http://127.0.0.3:{port}"),
    );
    // b is listed but not ready: only a joins.
    expect(&running, &[&a]).await;

    // b becomes ready.
    watch
        .send(event(
            "MODIFIED",
            labelled("b", "127.0.0.3", true, 11, vllm()),
        ))
        .unwrap();
    expect(&running, &[&a, &b]).await;

    // Requests flow; both serve some.
    let traffic = Arc::new(Traffic::default());
    let sender = tokio::spawn(send_steadily(running.addr, traffic.clone()));
    eventually("both pods serve", || {
        let names: BTreeSet<String> = traffic
            .served
            .lock()
            .iter()
            .map(|(_, n)| n.clone())
            .collect();
        (names.contains("a") && names.contains("b"), names)
    })
    .await;

    // b is deleted mid-stream: once it has left, no request goes to it.
    watch
        .send(event(
            "DELETED",
            labelled("b", "127.0.0.3", true, 12, vllm()),
        ))
        .unwrap();
    expect(&running, &[&a]).await;
    let left = traffic.begun.load(Ordering::SeqCst);
    eventually("ten requests begun after b left", || {
        let done = traffic.served.lock().len();
        (done >= left + 10, done)
    })
    .await;
    let after: Vec<(usize, String)> = traffic
        .served
        .lock()
        .iter()
        .filter(|(i, _)| *i >= left)
        .cloned()
        .collect();
    assert!(
        after.iter().all(|(_, who)| who == "a"),
        "after b left every request went to a: {after:?}"
    );

    // b is back, then its role label changes: it rejoins with the new role.
    watch
        .send(event("ADDED", labelled("b", "127.0.0.3", true, 13, vllm())))
        .unwrap();
    expect(&running, &[&a, &b]).await;
    watch
        .send(event(
            "MODIFIED",
            labelled(
                "b",
                "127.0.0.3",
                true,
                14,
                json!({"app": "vllm", "llm-d.ai/role": "prefill"}),
            ),
        ))
        .unwrap();
    let router = running.router.clone();
    eventually("b's role follows its label", || {
        let roles: Vec<_> = present_endpoints(&router)
            .into_iter()
            .map(|e| (e.url, e.role))
            .collect();
        let ok = roles.contains(&(b.clone(), kvroute_core::schedule::Role::Prefill));
        (ok, roles)
    })
    .await;
    // b's selector label changes: the API server sends the pod as DELETED, and it leaves.
    watch
        .send(event(
            "DELETED",
            labelled("b", "127.0.0.3", true, 15, json!({"app": "other"})),
        ))
        .unwrap();
    expect(&running, &[&a]).await;

    // The watch times out (the server ends it): the client watches again from the last
    // resourceVersion, without a relist, and events flow on the new watch.
    drop(watch);
    rewatch
        .send(event("ADDED", labelled("b", "127.0.0.3", true, 16, vllm())))
        .unwrap();
    expect(&running, &[&a, &b]).await;
    assert_eq!(fake.list_calls.load(Ordering::Relaxed), 1, "no relist");
    assert_eq!(
        fake.watch_versions.lock().as_slice(),
        ["10", "15"],
        "each watch resumes from the last resourceVersion seen"
    );
    traffic.stop.store(true, Ordering::Relaxed);
    sender.await.unwrap();
    let served = traffic.served.lock();
    assert!(
        served.iter().all(|(_, who)| !who.starts_with("status")),
        "every request succeeded: {served:?}"
    );
    drop((a_engine, b_engine));
}

/// A router pod of the Deployment `kvroute` (label `app=kvroute`).
fn router_pod(name: &str, ip: &str, ready: bool, rv: u32) -> Value {
    labelled(name, ip, ready, rv, json!({"app": "kvroute"}))
}

/// Replica peers found in Kubernetes (`replicas.kubernetes`): a starting replica lists the
/// router's pods from the fake API server, leaves its own out, warms up from the ready one (a
/// real replica on loopback), and follows the pods as they become ready or are deleted.
/// Replica A of the peer-discovery tests: running on 127.0.0.1 at the router pods' admin
/// port, its own (static) peer absent, and ready.
async fn running_replica_a(
    client: &reqwest::Client,
    engines: &SimFleet,
    admin_port: u16,
) -> RunningRouter {
    use kvroute_router::config::ReplicasConfig;
    let static_peers = ReplicasConfig {
        peers: vec!["http://127.0.0.1:1".to_owned()],
        warm_timeout_s: 1.0,
        ..ReplicasConfig::default()
    };
    let a =
        replicas_common::replica(replicas_common::config(engines, admin_port, static_peers)).await;
    replicas_common::until_ready(client, &a).await;
    a
}

/// A fake API server listing the router Deployment's pods (`app=kvroute`), first `pods`.
fn router_pods_api(pods: Vec<Value>) -> Arc<Fake> {
    let fake = Arc::new(Fake {
        selector: Some("app=kvroute"),
        ..Fake::default()
    });
    fake.lists.lock().push_back(list(pods, 10));
    fake
}

/// Peers found through the fake API server at `api`: the `app=kvroute` pods in `llm`, at
/// `admin_port`, this replica's own pod named `self_pod`.
fn discovered_peers(
    api: std::net::SocketAddr,
    admin_port: u16,
    self_pod: &str,
) -> kvroute_router::config::ReplicasConfig {
    use kvroute_router::config::{PeerDiscovery, ReplicasConfig};
    ReplicasConfig {
        warm_timeout_s: 10.0,
        kubernetes: Some(PeerDiscovery {
            api_server: Some(format!("http://{api}")),
            namespace: Some("llm".into()),
            selector: [("app".to_owned(), "kvroute".to_owned())].into(),
            admin_port,
            self_pod: Some(self_pod.into()),
        }),
        ..ReplicasConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_finds_its_peers_among_the_routers_pods_and_warms_up_from_them() {
    use replicas_common::{admin_json, complete, config, explain, fleet, replica, until_ready};

    let engines = fleet(1, 10_000, Default::default()).await;
    let client = reqwest::Client::new();
    // A: a running replica (its own peers static and absent), on the pods' admin port.
    let admin_port = kvroute_testkit::free_ports(1);
    let a = running_replica_a(&client, &engines, admin_port).await;
    let prompt = "a document the running replica has seen. ".repeat(30);
    complete(&client, &a, &prompt).await;

    // The Deployment's pods: A (ready, on 127.0.0.1), B itself, C not ready yet.
    let fake = router_pods_api(vec![
        router_pod("router-a", "127.0.0.1", true, 5),
        router_pod("router-b", "127.0.0.2", true, 6),
        router_pod("router-c", "127.0.0.3", false, 7),
    ]);
    let (watch, rx) = mpsc::unbounded_channel();
    fake.watches.lock().push_back(rx);
    let api = fake_api(fake.clone()).await;
    let discovered = discovered_peers(api, admin_port, "router-b");
    let b = replica(config(&engines, 0, discovered)).await;
    until_ready(&client, &b).await;
    let a_url = format!("http://127.0.0.1:{admin_port}");
    let status = admin_json(&client, &b, "/kvroute/v1/replica").await;
    assert_eq!(status["state"], "warm", "{status}");
    assert_eq!(status["peer"], a_url.as_str(), "{status}");
    assert_eq!(status["peers"], json!([a_url]), "{status}");
    // A's index came with the snapshot: B matches the prompt's blocks on the engine.
    let plan = explain(&client, &b, &prompt).await;
    let blocks = plan["blocks"].as_u64().unwrap();
    let indexed = plan["endpoints"][0]["matched_blocks"]["index"]["total"].as_u64();
    assert_eq!(indexed, Some(blocks), "{plan}");

    // The pods change: B's peers follow.
    let peers = |want: Vec<String>| {
        let b = &b;
        async move {
            eventually("B's peers", || {
                let now = b.router.replica().peers().to_vec();
                (now == want, now)
            })
            .await;
        }
    };
    watch
        .send(event(
            "MODIFIED",
            router_pod("router-c", "127.0.0.3", true, 11),
        ))
        .unwrap();
    let c_url = format!("http://127.0.0.3:{admin_port}");
    peers(vec![a_url, c_url.clone()]).await;
    watch
        .send(event(
            "DELETED",
            router_pod("router-a", "127.0.0.1", true, 12),
        ))
        .unwrap();
    peers(vec![c_url]).await;
}

/// A replica that does not recognise its own pod (no `POD_NAME`, or another name) finds itself
/// among the router's pods: its first peer message to its own admin listener carries its own
/// replica id, so it is dropped (the request is not counted twice) and answered 409 with that
/// id, and the address it was sent to leaves its peers; the real peer stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_does_not_know_its_pod_name_leaves_itself_out_of_its_peers() {
    use replicas_common::{complete, config, fleet, replica, until_ready};

    let engines = fleet(1, 10_000, Default::default()).await;
    let client = reqwest::Client::new();
    // A: a running replica on 127.0.0.1, B: this one on 127.0.0.2, both on the pods' admin port.
    let admin_port = kvroute_testkit::free_ports(1);
    let a = running_replica_a(&client, &engines, admin_port).await;

    let fake = router_pods_api(vec![
        router_pod("router-a", "127.0.0.1", true, 5),
        router_pod("router-b", "127.0.0.2", true, 6),
    ]);
    let api = fake_api(fake.clone()).await;
    // Not its pod's name: as when POD_NAME is unset and HOSTNAME differs.
    let discovered = discovered_peers(api, admin_port, "router-elsewhere");
    let mut b_config = config(&engines, 0, discovered);
    b_config.admin.listen = std::net::SocketAddr::from(([127, 0, 0, 2], admin_port));
    let b = replica(b_config).await;
    until_ready(&client, &b).await;
    let (a_url, b_url) = (
        format!("http://127.0.0.1:{admin_port}"),
        format!("http://127.0.0.2:{admin_port}"),
    );
    assert_eq!(b.router.replica().peers().to_vec(), [a_url.clone(), b_url]);

    // A request through B: its dispatch goes to A, and to B itself, which drops it.
    let prompt = "a prompt the replica shares with its peers. ".repeat(20);
    complete(&client, &b, &prompt).await;
    eventually("B leaves itself out of its peers", || {
        let now = b.router.replica().peers().to_vec();
        (now == [a_url.clone()], now)
    })
    .await;
    let peer_load = b.router.fleet().peer_load_stats().clone();
    assert_eq!(
        peer_load.started, 0,
        "B counted its own request as a peer's"
    );
    eventually("A counts B's request", || {
        let started = a.router.fleet().peer_load_stats().started;
        (started == 1, started)
    })
    .await;
    // Its dispatch, and perhaps its prefill-done message sent before the first was dropped.
    let rendered = b.router.metrics().render();
    let own = kvroute_testkit::sample(&rendered, "kvroute_replica_self_messages_total");
    assert!(own.is_some_and(|n| (1.0..=2.0).contains(&n)), "{rendered}");
}
