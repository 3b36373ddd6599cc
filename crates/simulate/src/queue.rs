//! Virtual time: a priority queue of future events, earliest first, ties in insertion order
//! (so a run is deterministic).

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use kvroute_core::event::KvEvent;

/// Something that happens at a point in virtual time.
#[derive(Debug)]
pub enum Event {
    /// Session `0` sends its next turn.
    Send(usize),
    /// Request `0` reaches its engine.
    Arrive(usize),
    /// Engine `0` finishes its current step.
    StepDone(usize),
    /// KV events of an engine reach the router.
    KvEvents(usize, Vec<KvEvent>),
    /// The router scrapes every engine's load.
    Scrape,
    /// Held requests check again whether an endpoint has room.
    Recheck,
    /// A P/D transfer on the link may have finished.
    Link,
    /// Request `0`'s prefill leg answered and its decode leg reached the decode engine: the
    /// pull starts.
    Pull(usize),
}

struct Scheduled {
    at: f64,
    seq: u64,
    event: Event,
}

impl PartialEq for Scheduled {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Scheduled {}

impl PartialOrd for Scheduled {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Scheduled {
    /// Reversed, so that the max-heap pops the earliest event first.
    fn cmp(&self, other: &Self) -> Ordering {
        other
            .at
            .total_cmp(&self.at)
            .then_with(|| other.seq.cmp(&self.seq))
    }
}

/// Future events and the current time.
#[derive(Default)]
pub struct Queue {
    heap: BinaryHeap<Scheduled>,
    seq: u64,
    now: f64,
}

impl Queue {
    /// Current virtual time, seconds.
    pub fn now(&self) -> f64 {
        self.now
    }

    /// Schedules `event` at `at` (never before now).
    pub fn push(&mut self, at: f64, event: Event) {
        self.seq += 1;
        self.heap.push(Scheduled {
            at: at.max(self.now),
            seq: self.seq,
            event,
        });
    }

    /// When the next event is due, if any.
    pub fn next_at(&self) -> Option<f64> {
        self.heap.peek().map(|s| s.at)
    }

    /// The next event, advancing time to it.
    pub fn pop(&mut self) -> Option<Event> {
        let next = self.heap.pop()?;
        self.now = next.at;
        Some(next.event)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn earliest_first_then_insertion_order() {
        let mut q = Queue::default();
        q.push(2.0, Event::Send(2));
        q.push(1.0, Event::Send(1));
        q.push(1.0, Event::Send(3));
        let order: Vec<usize> = std::iter::from_fn(|| match q.pop()? {
            Event::Send(s) => Some(s),
            _ => None,
        })
        .collect();
        assert_eq!(order, vec![1, 3, 2]);
        assert_eq!(q.now(), 2.0);
    }
}
