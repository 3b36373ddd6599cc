//! The **select** phase: core decides, on a fresh plan, to route the request, hold it under
//! flow control (released by core as capacity frees up) or refuse it.

use kvroute_core::fleet::{Admission, Plan, Shed};
use kvroute_vllm::openai::ApiError;

use super::Prepared;
use super::{Refused, RequestContext};
use crate::flow;
use crate::service::Router;

/// The plan to send `prepared` down: `plan` at once, or the one made when core released it
/// from the flow-control queue; or why it is refused.
pub(super) async fn select(
    router: &Router,
    prepared: &Prepared,
    plan: Plan,
    context: &RequestContext,
    bytes: usize,
) -> Result<Plan, Refused> {
    let admission = {
        let now = router.now();
        router.fleet().admit(&plan, context.priority, bytes, now)
    };
    match admission {
        Admission::Route => Ok(plan),
        Admission::Held(ticket) => flow::wait_for_capacity(router, &prepared.features(), ticket)
            .await
            .map_err(|why| match why {
                flow::NotReleased::Shed(why) => shed(router, why),
                flow::NotReleased::NoEndpoint => no_endpoint(),
            }),
        Admission::Shed(why) => Err(shed(router, why)),
        Admission::NoEndpoint => Err(no_endpoint()),
    }
}

/// Flow control shed the request: counted, and answered 503 or 429.
fn shed(router: &Router, why: Shed) -> Refused {
    Refused {
        error: flow::shed(router, why),
        shed: Some(why),
    }
}

/// No endpoint can take the request.
fn no_endpoint() -> Refused {
    ApiError::unavailable("no healthy endpoint serves this model; retry shortly").into()
}
