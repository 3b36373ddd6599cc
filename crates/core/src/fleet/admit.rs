//! Hold and shed: what flow control does with a planned request. One implementation for the
//! live router (which awaits capacity between polls) and the simulator (which polls in virtual
//! time), so both hold, release and shed the same requests at the same moments.
//!
//! A request whose plan is saturated (every competing endpoint saturated, or none left but
//! for open circuit breakers) is held in the bounded queue while flow control is on. A
//! saturated plan with an empty ranking is held too: every endpoint serving the model has its
//! circuit breaker open (its in-flight cap reached), which frees up as soon as one request
//! there finishes, exactly like saturation; refusing it at once would turn a momentary burst
//! into errors. The queue's deadline bounds the wait either way.

use super::{Fleet, HoldTicket, Plan, RequestFeatures, Shed};

/// What to do with a freshly planned request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Send it down its plan's ranking now (the ranking is not empty).
    Route,
    /// Held: wait for capacity, then ask [`Fleet::poll_held`].
    Held(HoldTicket),
    /// Refused by flow control (the queue is full).
    Shed(Shed),
    /// No endpoint can take it: none serves its model, or all are unhealthy or ejected.
    NoEndpoint,
}

/// What a held request does at one poll.
#[derive(Debug)]
pub enum HeldTurn {
    /// Its turn came and an endpoint has room: send it down this plan's ranking (not empty);
    /// it has left the queue.
    Route(Plan),
    /// Its turn came and no endpoint can take it any more; it has left the queue.
    NoEndpoint,
    /// Shed: it waited its limit; it has left the queue.
    Shed(Shed),
    /// Its turn came, it was planned, and every endpoint is still saturated: wait.
    StillSaturated,
    /// Others are ahead of it in the queue: wait.
    Queued,
}

impl HeldTurn {
    /// Whether the request keeps waiting.
    pub fn waits(&self) -> bool {
        matches!(self, HeldTurn::StillSaturated | HeldTurn::Queued)
    }
}

impl Fleet {
    /// Decides at `now` what to do with `plan`, just made for a request of `priority` (higher
    /// leaves the queue first) and `bytes` of body: route it, hold it, or refuse it.
    pub fn admit(&mut self, plan: &Plan, priority: i64, bytes: usize, now: f64) -> Admission {
        if plan.decision.saturated && self.config.flow.enabled {
            return match self.flow.hold(priority, bytes, now) {
                Ok(ticket) => Admission::Held(ticket),
                Err(why) => Admission::Shed(why),
            };
        }
        if plan.decision.ranking.is_empty() {
            Admission::NoEndpoint
        } else {
            Admission::Route
        }
    }

    /// Polls a held request at `now`: when it is next in the queue it is planned again (with
    /// the fleet's seeded randomness) and leaves once an endpoint has room; it is shed once
    /// it has waited its limit. Call again on every capacity change, and now and then anyway
    /// (scrapes change load too). A request whose client went away leaves with
    /// [`super::FlowQueue::leave`].
    pub fn poll_held(
        &mut self,
        ticket: HoldTicket,
        request: &RequestFeatures<'_>,
        now: f64,
    ) -> HeldTurn {
        let expired = self.flow.expired(ticket, now);
        let turn = if self.flow.is_next(ticket) {
            let random = self.next_random();
            let plan = self.plan(request, random, now);
            if !plan.decision.saturated {
                self.flow.leave(ticket);
                return if plan.decision.ranking.is_empty() {
                    HeldTurn::NoEndpoint
                } else {
                    HeldTurn::Route(plan)
                };
            }
            HeldTurn::StillSaturated
        } else {
            HeldTurn::Queued
        };
        if expired {
            self.flow.leave(ticket);
            return HeldTurn::Shed(Shed::Timeout);
        }
        turn
    }
}
