//! The one error edge: every refusal, of `kvroute serve`, the admin listener, the replicas'
//! endpoints and the picker alike, becomes an OpenAI-shaped response here, and is counted.

use axum::body::Body;
use axum::response::Response;
use kvroute_vllm::openai::ApiError;

use crate::service::Router;

/// An OpenAI-shaped error response (the shared mapping of [`ApiError::to_response`]), counted.
pub fn error_response(router: &Router, e: &ApiError) -> Response {
    count(router, e);
    e.to_response().map(Body::from)
}

/// Counts a refusal the router answers itself (`kvroute_rejected_total`, by status): every
/// driver's refusals, the proxy's and the picker's, are counted here.
pub(crate) fn count(router: &Router, e: &ApiError) {
    router
        .metrics()
        .rejected
        .get_or_create(&crate::metrics::StatusLabel { status: e.status })
        .inc();
}
