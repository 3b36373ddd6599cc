//! The pipeline's flow control on tokio's paused clock: a held request is shed exactly when it
//! has waited its limit, and released as soon as the endpoint has room, with no real waiting.

use std::sync::Arc;
use std::time::Duration;

use axum::http::HeaderMap;
use bytes::Bytes;
use kvroute_core::fleet::Shed;
use kvroute_core::index::EndpointId;
use tokio::time::Instant;

use super::{Api, route};
use crate::config::RouterConfig;
use crate::pipeline::Prepared;
use crate::service::Router;

/// One endpoint whose circuit breaker opens at one request in flight, holding requests up to
/// 5 s; one request already occupies it.
fn occupied_router() -> (Arc<Router>, kvroute_core::fleet::Dispatch) {
    let yaml = "models: [{name: m}]\noutlier: {max_inflight: 1}\nflow: {max_wait_s: 5}\nendpoints:\n  - {name: e0, url: 'http://127.0.0.1:1'}\n";
    let router = Arc::new(Router::new(RouterConfig::from_yaml(yaml).unwrap()).unwrap());
    let dispatch = router.dispatched(&[], &Prepared::uncached(&router).features(), EndpointId(0));
    (router, dispatch)
}

fn body() -> Bytes {
    Bytes::from_static(br#"{"model": "m", "prompt": "hello there", "max_tokens": 1}"#)
}

#[tokio::test(start_paused = true)]
async fn a_held_request_is_shed_when_it_has_waited_its_limit() {
    let (router, _busy) = occupied_router();
    let started = Instant::now();
    let refused = route(&router, Api::Completions, &HeaderMap::new(), &body())
        .await
        .err()
        .expect("shed");
    assert_eq!(refused.shed, Some(Shed::Timeout));
    assert_eq!(refused.error.status, 503);
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(5) && waited < Duration::from_millis(5100),
        "shed after its 5 s, not before: {waited:?}"
    );
    assert!(router.fleet().flow().is_empty(), "it left the queue");
}

#[tokio::test(start_paused = true)]
async fn a_held_request_is_released_when_the_endpoint_frees_up() {
    let (router, busy) = occupied_router();
    let held = {
        let router = router.clone();
        tokio::spawn(async move {
            route(&router, Api::Completions, &HeaderMap::new(), &body())
                .await
                .map(|routed| routed.plan.decision.ranking)
        })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        router.fleet().flow().len(),
        1,
        "held while the endpoint is full"
    );
    let now = router.now();
    router.fleet().finished(busy, None, now);
    router.capacity_changed();
    let started = Instant::now();
    let ranking = held.await.unwrap().ok().expect("released");
    assert_eq!(ranking, vec![EndpointId(0)]);
    assert!(
        started.elapsed() < Duration::from_millis(100),
        "released at once"
    );
    assert!(router.fleet().flow().is_empty());
}
