//! Read-only views of a running router's fleet for assertions, so that tests neither hold its
//! lock nor depend on how core's `Fleet` is laid out.

use kvroute_core::index::EndpointId;
use kvroute_router::config::EndpointConfig;
use kvroute_router::testing::Router;

/// Requests the router holds under flow control right now.
pub fn held_requests(router: &Router) -> usize {
    router.fleet().flow().len()
}

/// The configurations of the endpoints present in the fleet (joined, not yet removed), in
/// endpoint-id order.
pub fn present_endpoints(router: &Router) -> Vec<EndpointConfig> {
    let endpoints = router.endpoints();
    let fleet = router.fleet();
    endpoints
        .iter()
        .zip(fleet.endpoints())
        .filter(|(_, state)| state.present())
        .map(|(endpoint, _)| endpoint.config.clone())
        .collect()
}

/// When (router clock, seconds) the router last forgot endpoint `id`'s cached blocks (an engine
/// restart), if ever.
pub fn forgotten_at(router: &Router, id: EndpointId) -> Option<f64> {
    router.fleet().endpoint(id).and_then(|e| e.forgotten_at())
}
