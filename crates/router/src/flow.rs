//! Flow control's waiting: a request planned while every endpoint is saturated waits in core's
//! bounded queue and is polled again, in queue order, whenever capacity may have freed up. It
//! binds to an endpoint only then (late binding), or is shed with `Retry-After`. What to hold,
//! release and shed is core's decision ([`kvroute_core::fleet::Fleet::admit`] and
//! [`kvroute_core::fleet::Fleet::poll_held`], which the simulator runs too); this module only
//! waits between polls.

use std::time::Duration;

use kvroute_core::fleet::{HeldTurn, HoldTicket, Plan, RequestFeatures, Shed};
use kvroute_vllm::openai::ApiError;
use tokio::time::Instant;

use crate::service::Router;

/// How often a held request checks again even without a wake-up (scrapes change load too).
const RECHECK: Duration = Duration::from_millis(50);

/// Takes the ticket out of the queue however the wait ends (the client may go away).
struct Held<'a> {
    router: &'a Router,
    ticket: HoldTicket,
    since: Instant,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.router.fleet().flow_mut().leave(self.ticket);
        let m = self.router.metrics();
        m.flow_wait_seconds
            .observe(self.since.elapsed().as_secs_f64());
        self.router.capacity_changed();
    }
}

/// Counts a shed request and says why in OpenAI's shape (503 timed out, 429 queue full).
pub(crate) fn shed(router: &Router, why: Shed) -> ApiError {
    router
        .metrics()
        .shed
        .get_or_create(&crate::metrics::ReasonLabel {
            reason: why.as_str(),
        })
        .inc();
    match why.status() {
        429 => ApiError::rate_limited(why.reply()),
        _ => ApiError::unavailable(why.reply()),
    }
}

/// How a held request's wait ended without a plan.
pub(crate) enum NotReleased {
    /// Flow control shed it.
    Shed(Shed),
    /// No endpoint can take it any more.
    NoEndpoint,
}

/// Waits, holding `ticket` (core's [`kvroute_core::fleet::Admission::Held`] for the request of
/// `features`),
/// until core releases the request with the plan made at that moment, or sheds it.
pub(crate) async fn wait_for_capacity(
    router: &Router,
    features: &RequestFeatures<'_>,
    ticket: HoldTicket,
) -> Result<Plan, NotReleased> {
    let held = Held {
        router,
        ticket,
        since: Instant::now(),
    };
    loop {
        let notified = router.capacity_notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        match router.poll_held(features, ticket) {
            HeldTurn::Route(plan) => {
                drop(held);
                return Ok(plan);
            }
            HeldTurn::NoEndpoint => {
                drop(held);
                return Err(NotReleased::NoEndpoint);
            }
            HeldTurn::Shed(why) => {
                drop(held);
                return Err(NotReleased::Shed(why));
            }
            HeldTurn::StillSaturated | HeldTurn::Queued => {}
        }
        let _ = tokio::time::timeout(RECHECK, notified).await;
    }
}
