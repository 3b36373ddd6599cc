//! Flow control: while every eligible endpoint is saturated, a request waits in the router, in
//! a bounded queue, rather than bind early to an engine queue where it can no longer move. It
//! leaves in priority order (then arrival) once an endpoint has room, and is shed when it has
//! waited too long or the queue is full.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Flow-control settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FlowConfig {
    /// Hold requests while every endpoint is saturated (else send them anyway).
    pub enabled: bool,
    /// Most requests held at once.
    pub max_requests: usize,
    /// Most request-body bytes held at once.
    pub max_bytes: usize,
    /// Seconds a request may be held before it is shed (answered 503 with `Retry-After`).
    pub max_wait_s: f64,
}

impl Default for FlowConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            max_requests: 1024,
            max_bytes: 256 << 20,
            max_wait_s: 30.0,
        }
    }
}

/// Why a request was shed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Shed {
    /// The queue holds `max_requests` already.
    QueueFull,
    /// The queue holds `max_bytes` already.
    QueueBytes,
    /// It waited `max_wait_s`.
    Timeout,
}

impl Shed {
    /// The label used in metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Shed::QueueFull => "queue_full",
            Shed::QueueBytes => "queue_bytes",
            Shed::Timeout => "timeout",
        }
    }

    /// The HTTP status a shed request is answered with: 503 when it waited too long (every
    /// endpoint stayed saturated), 429 when the queue was full.
    pub fn status(self) -> u16 {
        match self {
            Shed::Timeout => 503,
            Shed::QueueFull | Shed::QueueBytes => 429,
        }
    }

    /// The reply's message, the same from the router and the simulator.
    pub fn reply(self) -> &'static str {
        match self {
            Shed::Timeout => {
                "every endpoint stayed saturated while the request waited; retry shortly"
            }
            Shed::QueueFull | Shed::QueueBytes => {
                "the router is holding as many requests as it may; retry shortly"
            }
        }
    }
}

/// A held request's place in the queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HoldTicket {
    /// Higher priorities leave first (stored negated so the map's order is leaving order).
    neg_priority: i64,
    arrival: u64,
}

#[derive(Debug)]
struct Held {
    bytes: usize,
    deadline: f64,
}

/// The queue of held requests.
#[derive(Debug)]
pub struct FlowQueue {
    config: FlowConfig,
    held: BTreeMap<HoldTicket, Held>,
    bytes: usize,
    arrivals: u64,
}

impl FlowQueue {
    /// An empty queue.
    pub fn new(config: FlowConfig) -> Self {
        Self {
            config,
            held: BTreeMap::new(),
            bytes: 0,
            arrivals: 0,
        }
    }

    /// The settings.
    pub fn config(&self) -> &FlowConfig {
        &self.config
    }

    /// Holds a request of `bytes` with `priority` (higher leaves first) at `now`.
    pub fn hold(&mut self, priority: i64, bytes: usize, now: f64) -> Result<HoldTicket, Shed> {
        if self.held.len() >= self.config.max_requests {
            return Err(Shed::QueueFull);
        }
        if self.bytes.saturating_add(bytes) > self.config.max_bytes {
            return Err(Shed::QueueBytes);
        }
        self.arrivals += 1;
        let ticket = HoldTicket {
            // A client's priority header can say i64::MIN, which has no negation.
            neg_priority: priority.saturating_neg(),
            arrival: self.arrivals,
        };
        self.held.insert(
            ticket,
            Held {
                bytes,
                deadline: now + self.config.max_wait_s,
            },
        );
        self.bytes += bytes;
        Ok(ticket)
    }

    /// Whether `ticket` is next to leave.
    pub fn is_next(&self, ticket: HoldTicket) -> bool {
        self.held.keys().next() == Some(&ticket)
    }

    /// Whether `ticket` has waited its limit at `now`.
    pub fn expired(&self, ticket: HoldTicket, now: f64) -> bool {
        self.held.get(&ticket).is_none_or(|h| now >= h.deadline)
    }

    /// When `ticket` will have waited its limit.
    pub fn deadline(&self, ticket: HoldTicket) -> Option<f64> {
        self.held.get(&ticket).map(|h| h.deadline)
    }

    /// Takes `ticket` out of the queue (it leaves, is shed, or its client went away).
    pub fn leave(&mut self, ticket: HoldTicket) {
        if let Some(h) = self.held.remove(&ticket) {
            self.bytes -= h.bytes;
        }
    }

    /// Requests held.
    pub fn len(&self) -> usize {
        self.held.len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.held.is_empty()
    }

    /// Body bytes held.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue(max_requests: usize, max_bytes: usize) -> FlowQueue {
        FlowQueue::new(FlowConfig {
            enabled: true,
            max_requests,
            max_bytes,
            max_wait_s: 5.0,
        })
    }

    #[test]
    fn leaves_by_priority_then_arrival() {
        let mut q = queue(10, 1000);
        let a = q.hold(0, 10, 0.0).unwrap();
        let b = q.hold(5, 10, 1.0).unwrap();
        let c = q.hold(5, 10, 2.0).unwrap();
        assert!(q.is_next(b));
        q.leave(b);
        assert!(q.is_next(c));
        q.leave(c);
        assert!(q.is_next(a));
        q.leave(a);
        assert!(q.is_empty());
        assert_eq!(q.bytes(), 0);
        // The extremes a header can say keep their order.
        let lowest = q.hold(i64::MIN, 10, 3.0).unwrap();
        let highest = q.hold(i64::MAX, 10, 4.0).unwrap();
        let plain = q.hold(0, 10, 5.0).unwrap();
        assert!(q.is_next(highest));
        q.leave(highest);
        assert!(q.is_next(plain));
        q.leave(plain);
        assert!(q.is_next(lowest));
    }

    #[test]
    fn bounded_in_requests_and_bytes_and_time() {
        let mut q = queue(2, 100);
        let a = q.hold(0, 60, 0.0).unwrap();
        assert_eq!(q.hold(0, 50, 0.0), Err(Shed::QueueBytes));
        q.hold(0, 40, 0.0).unwrap();
        assert_eq!(q.hold(0, 0, 0.0), Err(Shed::QueueFull));
        assert!(!q.expired(a, 4.9));
        assert!(q.expired(a, 5.0));
        assert_eq!(q.deadline(a), Some(5.0));
    }
}
