//! Flow control's waiting: a request planned while every endpoint is saturated waits in core's
//! bounded queue and is planned again, in queue order, whenever capacity may have freed up. It
//! binds to an endpoint only then (late binding), or is shed with `Retry-After`.

use std::time::{Duration, Instant};

use kvroute_core::fleet::{HoldTicket, Plan, Shed};
use kvroute_vllm::openai::ApiError;

use crate::service::{Prepared, Router};

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
        .get_or_create(&vec![("reason", why.as_str().to_owned())])
        .inc();
    match why {
        Shed::Timeout => ApiError::unavailable(
            "every endpoint stayed saturated while the request waited; retry shortly",
        ),
        Shed::QueueFull | Shed::QueueBytes => ApiError::rate_limited(
            "the router is holding as many requests as it may; retry shortly",
        ),
    }
}

/// Holds `prepared` until an endpoint has room, then returns the plan made at that moment, or
/// why it was shed (count it with [`shed`]).
pub async fn wait_for_capacity(
    router: &Router,
    prepared: &Prepared,
    priority: i64,
    bytes: usize,
) -> Result<Plan, Shed> {
    let ticket = {
        let now = router.now();
        router.fleet().flow_mut().hold(priority, bytes, now)
    }?;
    let held = Held {
        router,
        ticket,
        since: Instant::now(),
    };
    loop {
        let notified = router.capacity_notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let (next, expired) = {
            let now = router.now();
            let fleet = router.fleet();
            let flow = fleet.flow();
            (flow.is_next(ticket), flow.expired(ticket, now))
        };
        if next {
            let plan = router.plan(prepared);
            // Saturated with an empty ranking: every endpoint left has its circuit breaker
            // open; wait for one to free up like for a saturated one.
            if !plan.decision.saturated {
                drop(held);
                return Ok(plan);
            }
        }
        if expired {
            drop(held);
            return Err(Shed::Timeout);
        }
        let _ = tokio::time::timeout(RECHECK, notified).await;
    }
}
