//! Kubernetes discovery against a fake API server (no kube-apiserver can run here): an axum
//! server speaking list + watch for pods (resourceVersion, bookmarks, 410 Gone) and serving an
//! InferencePool only as v1alpha2 (`inference.networking.x-k8s.io`, the seed's), so that the
//! v1 → v1alpha2 fallback runs too.

use std::collections::{BTreeSet, VecDeque};
use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use kvroute_router::config::RouterConfig;
use kvroute_router::server::{RunningRouter, start};
use kvroute_testkit::eventually;
use parking_lot::Mutex;
use serde_json::{Value, json};
use tokio::sync::mpsc;

/// What the fake API server answers: one pod list per (re)list, one scripted stream per watch.
#[derive(Default)]
struct Fake {
    lists: Mutex<VecDeque<Value>>,
    watches: Mutex<VecDeque<mpsc::UnboundedReceiver<Value>>>,
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
    assert_eq!(param("labelSelector"), Some("app=vllm"));
    if param("watch") != Some("true") {
        let mut lists = fake.lists.lock();
        let body = if lists.len() > 1 {
            lists.pop_front().unwrap()
        } else {
            lists.front().cloned().unwrap()
        };
        return axum::Json(body).into_response();
    }
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

async fn pool_v1alpha2() -> Response {
    axum::Json(
        json!({"apiVersion": "inference.networking.x-k8s.io/v1alpha2", "kind": "InferencePool",
        "metadata": {"name": "pool", "namespace": "llm"},
        "spec": {"selector": {"app": "vllm"}, "targetPortNumber": 8000,
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
    let endpoints = router.router.endpoints();
    let fleet = router.router.fleet();
    endpoints
        .iter()
        .zip(fleet.endpoints())
        .filter(|(_, s)| s.present())
        .map(|(e, _)| e.config.url.clone())
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_pods_join_and_leave_through_list_watch_bookmarks_and_410_relists() {
    let fake = Arc::new(Fake::default());
    fake.lists
        .lock()
        .push_back(list(vec![pod("a", "10.0.0.1", true, 5)], 10));
    // After the 410, a relist finds only c: b vanished while the watch was down.
    fake.lists
        .lock()
        .push_back(list(vec![pod("c", "10.0.0.3", true, 20)], 21));
    let (watch, rx) = mpsc::unbounded_channel();
    fake.watches.lock().push_back(rx);
    let api = fake_api(fake.clone()).await;

    let yaml = format!(
        "listen: 127.0.0.1:0\nadmin: {{listen: 127.0.0.1:0}}\nmodels: [{{name: m}}]\n\
         discovery: {{api_server: 'http://{api}', namespace: llm, inference_pool: pool, events_port: 5557}}\n"
    );
    let running = start(RouterConfig::from_yaml(&yaml).unwrap())
        .await
        .unwrap();

    expect(&running, &["http://10.0.0.1:8000"]).await;
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
