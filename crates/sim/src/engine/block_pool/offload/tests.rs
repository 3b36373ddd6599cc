use std::collections::VecDeque;

use kvroute_core::keys::VllmHasher;
use proptest::prelude::*;

use super::*;

fn digest(n: u32) -> VllmDigest {
    VllmHasher::new("s")
        .block_digests(&[n, n, n, n], 4, None)
        .unwrap()[0]
}

/// The naive model: one list per tier, least recently used first.
struct Naive {
    capacity: [usize; 2],
    lists: [VecDeque<u32>; 2],
}

impl Naive {
    fn tier_of(&self, n: u32) -> Option<usize> {
        (0..2).find(|&t| self.lists[t].contains(&n))
    }

    fn refresh(&mut self, n: u32) {
        if let Some(t) = self.tier_of(n) {
            self.lists[t].retain(|&x| x != n);
            self.lists[t].push_back(n);
        }
    }

    fn offload(&mut self, n: u32) {
        let Some(top) = (0..2).find(|&t| self.capacity[t] > 0) else {
            return;
        };
        if self.tier_of(n).is_some() {
            self.refresh(n);
            return;
        }
        self.lists[top].push_back(n);
        let mut tier = top;
        while tier < 2 && self.lists[tier].len() > self.capacity[tier] {
            let old = self.lists[tier].pop_front().unwrap();
            if tier == 0 && self.capacity[1] > 0 {
                self.lists[1].push_back(old);
            }
            tier += 1;
        }
    }
}

#[derive(Clone, Debug)]
enum Op {
    Offload(u32),
    Hit(u32),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u32..24).prop_map(Op::Offload),
        1 => (0u32..24).prop_map(Op::Hit),
    ]
}

proptest! {
    #[test]
    fn tiers_match_a_naive_lru_model(
        cpu in 0usize..5,
        ssd in 0usize..7,
        ops in proptest::collection::vec(op(), 0..120),
    ) {
        let mut tiers = OffloadTiers::new(cpu, ssd);
        let mut naive = Naive { capacity: [cpu, ssd], lists: Default::default() };
        let mut events = Vec::new();
        for op in ops {
            match op {
                Op::Offload(n) => {
                    tiers.offload(digest(n), &mut events);
                    naive.offload(n);
                }
                Op::Hit(n) => {
                    tiers.touch(digest(n));
                    naive.refresh(n);
                }
            }
            for tier in OffloadTier::LOCAL {
                let t = tier as usize;
                prop_assert!(tiers.len(tier) <= tiers.capacity(tier), "{tier:?} over capacity");
                let expected: Vec<VllmDigest> = naive.lists[t].iter().map(|&n| digest(n)).collect();
                prop_assert_eq!(tiers.lru_order(tier), expected, "{:?} LRU order", tier);
            }
            for n in 0..24 {
                let held = OffloadTier::LOCAL
                    .iter()
                    .filter(|t| tiers.lru_order(**t).contains(&digest(n)))
                    .count();
                prop_assert!(held <= 1, "block {n} in {held} offload tiers");
            }
        }
    }

    #[test]
    fn events_replayed_give_each_tiers_contents(
        cpu in 0usize..4,
        ssd in 0usize..5,
        ops in proptest::collection::vec(0u32..16, 0..80),
    ) {
        let mut tiers = OffloadTiers::new(cpu, ssd);
        let mut events = Vec::new();
        for n in ops {
            tiers.offload(digest(n), &mut events);
        }
        // Replaying the events on per-medium sets gives exactly what each tier holds.
        let mut replay: [std::collections::HashSet<u64>; 2] = Default::default();
        for event in &events {
            let (hashes, medium, store) = match event {
                KvEvent::BlockStored(s) => (&s.block_hashes, s.medium.as_deref(), true),
                KvEvent::BlockRemoved(r) => (&r.block_hashes, r.medium.as_deref(), false),
                other => panic!("unexpected event {other:?}"),
            };
            let t = OffloadTier::LOCAL.iter().position(|t| Some(t.medium()) == medium).unwrap();
            for h in hashes {
                if store {
                    prop_assert!(replay[t].insert(h.0), "stored twice without a removal");
                } else {
                    prop_assert!(replay[t].remove(&h.0), "removed without a store");
                }
            }
        }
        for tier in OffloadTier::LOCAL {
            let held: std::collections::HashSet<u64> =
                tiers.lru_order(tier).iter().map(VllmDigest::event_u64).collect();
            prop_assert_eq!(&replay[tier as usize], &held);
        }
    }
}

#[test]
fn a_full_cpu_tier_demotes_its_oldest_block_to_the_ssd() {
    let mut tiers = OffloadTiers::new(1, 2);
    let mut events = Vec::new();
    tiers.offload(digest(1), &mut events);
    tiers.offload(digest(2), &mut events);
    assert_eq!(tiers.find(&digest(1)), Some(OffloadTier::Ssd));
    assert_eq!(tiers.find(&digest(2)), Some(OffloadTier::Cpu));
    let media: Vec<(bool, &str)> = events
        .iter()
        .map(|e| match e {
            KvEvent::BlockStored(s) => (true, s.medium.as_deref().unwrap()),
            KvEvent::BlockRemoved(r) => (false, r.medium.as_deref().unwrap()),
            _ => unreachable!(),
        })
        .collect();
    // Room is made before the new block is stored, as vLLM's offloading manager publishes it
    // (the CPU tier's events never show it over its capacity), and the SSD copy is announced
    // before the CPU copy goes away.
    assert_eq!(
        media,
        vec![
            (true, "CPU"),
            (true, "STORAGE"),
            (false, "CPU"),
            (true, "CPU"),
        ]
    );
}
