//! The routing history's tests: examples, and every operation checked against a naive
//! per-block model (the table of (block, endpoint) → expiry the history used to be).

use std::collections::VecDeque;

use hashbrown::HashMap;
use proptest::prelude::*;

use super::*;

fn keys(n: u64, salt: u64) -> Vec<RouterKey> {
    (0..n).map(|i| RouterKey(i * 1000 + salt)).collect()
}

#[test]
fn remembers_prefixes_until_they_expire() {
    let mut h = RoutingHistory::new(10.0, 100);
    h.record(EndpointId(1), &keys(5, 0), 0.0);
    h.record(EndpointId(2), &keys(2, 0), 5.0);
    assert_eq!(
        h.longest_prefixes(&keys(8, 0), 6.0),
        vec![(EndpointId(1), 5), (EndpointId(2), 2)]
    );
    assert_eq!(
        h.longest_prefixes(&keys(8, 0), 12.0),
        vec![(EndpointId(2), 2)]
    );
    h.expire(20.0);
    assert!(h.is_empty());
    assert_eq!(h.runs(), 0, "nothing kept once everything expired");
}

#[test]
fn shortening_only_brings_expiry_forward() {
    let mut h = RoutingHistory::new(10.0, 100);
    h.record(EndpointId(1), &keys(3, 0), 0.0);
    h.shorten(EndpointId(1), &keys(3, 0), 2.0);
    h.shorten(EndpointId(1), &keys(3, 0), 5.0);
    assert_eq!(
        h.longest_prefixes(&keys(3, 0), 1.0),
        vec![(EndpointId(1), 3)]
    );
    assert_eq!(h.longest_prefixes(&keys(3, 0), 3.0), vec![]);
}

#[test]
fn capacity_drops_the_oldest_records() {
    let mut h = RoutingHistory::new(100.0, 6);
    h.record(EndpointId(1), &keys(4, 0), 0.0);
    h.record(EndpointId(2), &keys(4, 7), 1.0);
    assert_eq!(h.len(), 6);
    assert_eq!(h.longest_prefixes(&keys(4, 0), 2.0), vec![]);
    assert_eq!(
        h.longest_prefixes(&keys(4, 7), 2.0),
        vec![(EndpointId(2), 4)]
    );
}

#[test]
fn a_conversation_is_a_few_runs_not_one_entry_per_block() {
    let mut h = RoutingHistory::new(100.0, 1 << 20);
    // A 32-block system prompt, then ten conversations of ten 50-block turns each.
    let system: Vec<RouterKey> = (0..32).map(RouterKey).collect();
    for c in 0..10u64 {
        let mut prompt = system.clone();
        for turn in 0..10u64 {
            prompt.extend((0..50).map(|i| RouterKey(1_000_000 * (c + 1) + 100 * turn + i)));
            h.record(EndpointId(c as u32), &prompt, turn as f64);
        }
        let found = h.longest_prefixes(&prompt, 10.0);
        let expected: Vec<_> = (0..=c as u32)
            .map(|e| (EndpointId(e), if e == c as u32 { 532 } else { 32 }))
            .collect();
        assert_eq!(
            found, expected,
            "its own turns, and the others' system prompt"
        );
    }
    assert_eq!(
        h.runs(),
        1 + 10 * 10,
        "the system prompt, and each turn's own blocks"
    );
}

#[test]
fn forgetting_an_endpoint_leaves_the_others_records_whole() {
    let mut h = RoutingHistory::new(10.0, 6);
    h.record(EndpointId(0), &keys(3, 0), 10.0);
    h.record(EndpointId(1), &keys(1, 7), 30.0);
    // Its prefix again, expiring earlier: the record ends at the prefix's own run.
    h.record(EndpointId(0), &keys(2, 0), 0.0);
    // Drops only the first record (the second's expiry stops it).
    h.expire(25.0);
    // Endpoint 2 sent nothing: forgetting it changes nothing.
    h.forget_endpoint(EndpointId(2));
    h.record(EndpointId(0), &keys(2, 9), 0.0);
    // Over capacity: drops endpoint 1's record and the first block of `keys(2, 0)`'s.
    h.record(EndpointId(4), &keys(3, 8), 0.0);
    assert_eq!(h.len(), 6);
    assert_eq!(
        h.longest_prefixes(&keys(2, 9), 0.0),
        vec![(EndpointId(0), 2)],
        "a record no capacity or expiry dropped is still there"
    );
}

/// The history as a table of (block, endpoint) → expiry, with one record per block sent: what
/// `RoutingHistory` must answer as.
struct PerBlock {
    ttl_s: f64,
    capacity: usize,
    entries: HashMap<RouterKey, Vec<(EndpointId, f64)>>,
    order: VecDeque<(RouterKey, EndpointId, f64)>,
}

impl PerBlock {
    fn new(ttl_s: f64, capacity: usize) -> Self {
        Self {
            ttl_s,
            capacity: capacity.max(1),
            entries: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    fn holder(&mut self, key: RouterKey, endpoint: EndpointId) -> Option<&mut f64> {
        let holders = self.entries.get_mut(&key)?;
        holders
            .iter_mut()
            .find(|(e, _)| *e == endpoint)
            .map(|(_, x)| x)
    }

    fn record(&mut self, endpoint: EndpointId, keys: &[RouterKey], now: f64) {
        let expiry = now + self.ttl_s;
        for key in keys {
            match self.holder(*key, endpoint) {
                Some(x) => *x = expiry,
                None => self
                    .entries
                    .entry(*key)
                    .or_default()
                    .push((endpoint, expiry)),
            }
            self.order.push_back((*key, endpoint, expiry));
        }
        while self.order.len() > self.capacity {
            self.drop_oldest();
        }
    }

    fn drop_oldest(&mut self) {
        let (key, endpoint, expiry) = self.order.pop_front().expect("a record");
        if self.holder(key, endpoint).is_some_and(|x| *x <= expiry) {
            let holders = self.entries.get_mut(&key).expect("held");
            holders.retain(|(e, _)| *e != endpoint);
            if holders.is_empty() {
                self.entries.remove(&key);
            }
        }
    }

    fn shorten(&mut self, endpoint: EndpointId, keys: &[RouterKey], expiry: f64) {
        for key in keys {
            if let Some(x) = self.holder(*key, endpoint) {
                *x = x.min(expiry);
            }
        }
    }

    fn expire(&mut self, now: f64) {
        while self.order.front().is_some_and(|(_, _, x)| *x <= now) {
            self.drop_oldest();
        }
    }

    fn forget_endpoint(&mut self, endpoint: EndpointId) {
        self.entries.retain(|_, holders| {
            holders.retain(|(e, _)| *e != endpoint);
            !holders.is_empty()
        });
        self.order.retain(|(_, e, _)| *e != endpoint);
    }

    /// Each endpoint's own walk along the keys.
    fn longest_prefixes(&self, keys: &[RouterKey], now: f64) -> Vec<(EndpointId, u32)> {
        let mut endpoints: Vec<EndpointId> = self
            .entries
            .values()
            .flat_map(|holders| holders.iter().map(|(e, _)| *e))
            .collect();
        endpoints.sort();
        endpoints.dedup();
        endpoints
            .into_iter()
            .map(|e| {
                let held = keys
                    .iter()
                    .take_while(|k| {
                        self.entries
                            .get(*k)
                            .is_some_and(|hs| hs.iter().any(|(x, at)| *x == e && *at > now))
                    })
                    .count();
                (e, held as u32)
            })
            .filter(|(_, n)| *n > 0)
            .collect()
    }
}

/// A chain of router keys for a path of small choices: key `i` names the choices up to `i`, as
/// router keys name their prefix. Few choices, so that chains share prefixes and branch.
fn chain(choices: &[u8]) -> Vec<RouterKey> {
    let mut key = 0x51_7cc1_b727_220au64;
    choices
        .iter()
        .map(|&c| {
            key = (key ^ u64::from(c))
                .wrapping_mul(0x9e37_79b9_7f4a_7c15)
                .rotate_left(29);
            RouterKey(key)
        })
        .collect()
}

#[derive(Debug, Clone)]
enum Op {
    Record(u32, Vec<u8>, f64),
    Shorten(u32, Vec<u8>, f64),
    Expire(f64),
    Forget(u32),
}

fn op() -> impl Strategy<Value = Op> {
    let choices = proptest::collection::vec(0u8..3, 0..14);
    prop_oneof![
        6 => (0u32..4, choices.clone(), 0.0f64..40.0).prop_map(|(e, c, t)| Op::Record(e, c, t)),
        3 => (0u32..4, choices, 0.0f64..40.0).prop_map(|(e, c, t)| Op::Shorten(e, c, t)),
        1 => (0.0f64..40.0).prop_map(Op::Expire),
        1 => (0u32..4).prop_map(Op::Forget),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Whatever is recorded, shortened, expired or forgotten (times in any order, capacity
    /// reached or not), the history answers every lookup as the per-block table does, holds as
    /// many records, and never more than its capacity.
    #[test]
    fn answers_as_the_per_block_table(
        ops in proptest::collection::vec(op(), 0..60),
        capacity in prop_oneof![1usize..12, 12usize..80, Just(10_000usize)],
        queries in proptest::collection::vec(proptest::collection::vec(0u8..3, 1..16), 1..6),
    ) {
        let (mut h, mut naive) = (RoutingHistory::new(5.0, capacity), PerBlock::new(5.0, capacity));
        let mut now = 0.0;
        for op in ops {
            match op {
                Op::Record(e, c, t) => {
                    now = t;
                    h.record(EndpointId(e), &chain(&c), t);
                    naive.record(EndpointId(e), &chain(&c), t);
                }
                Op::Shorten(e, c, t) => {
                    h.shorten(EndpointId(e), &chain(&c), t);
                    naive.shorten(EndpointId(e), &chain(&c), t);
                }
                Op::Expire(t) => {
                    h.expire(t);
                    naive.expire(t);
                }
                Op::Forget(e) => {
                    h.forget_endpoint(EndpointId(e));
                    naive.forget_endpoint(EndpointId(e));
                }
            }
            prop_assert_eq!(h.len(), naive.order.len());
            prop_assert!(h.len() <= capacity);
            prop_assert!(h.runs() <= h.len() + 14, "runs are bounded by the blocks held");
            for q in &queries {
                let q = chain(q);
                for at in [now, now + 2.0, now + 4.5] {
                    prop_assert_eq!(h.longest_prefixes(&q, at), naive.longest_prefixes(&q, at));
                }
            }
        }
    }
}
