//! What each profile and picker reads: cache sources (a distrusted index, the routing history,
//! the predicted overlay), random, round-robin and softmax picks, session affinity, and the
//! prefix-hash ring.

use super::*;

#[test]
fn a_distrusted_index_counts_as_empty_and_no_events_uses_history() {
    let mut cands = fleet(3);
    cands[0].cache.index = gpu_match(0, 60);
    cands[0].cache.index_state = IndexState::Distrusted;
    cands[1].cache.history = 30;
    cands[1].cache.index_state = IndexState::NoEvents;
    let d = schedule(&Profile::default(), &request(1000), &cands, 3, 0);
    assert_eq!(d.assessment(EndpointId(0)).unwrap().cached_tokens, 0);
    assert_eq!(d.assessment(EndpointId(1)).unwrap().cached_tokens, 480);
    assert_eq!(d.chosen(), Some(EndpointId(1)));
}

#[test]
fn the_predicted_overlay_covers_the_window_before_events() {
    let mut cands = fleet(2);
    cands[1].cache.predicted = 40;
    let d = schedule(&Profile::default(), &request(1000), &cands, 3, 0);
    assert_eq!(d.chosen(), Some(EndpointId(1)));
}

#[test]
fn approximate_uses_the_history_and_least_load_ignores_caches() {
    let mut cands = fleet(2);
    cands[0].cache.index = gpu_match(0, 50);
    cands[1].cache.history = 50;
    let approx = Profile::named(ProfileName::Approximate);
    assert_eq!(chosen(&approx, &request(1000), &cands, 5), 1);
    busy(&mut cands[1], 1, 100);
    let least = Profile::named(ProfileName::LeastLoad);
    for r in 0..16 {
        assert_eq!(chosen(&least, &request(1000), &cands, r), 0);
    }
}

#[test]
fn ties_are_broken_at_random_and_round_robin_rotates() {
    let cands = fleet(4);
    for profile in [
        Profile::named(ProfileName::Random),
        Profile::named(ProfileName::Precise),
    ] {
        let winners: std::collections::HashSet<_> = (0..64u64)
            .map(|r| {
                chosen(
                    &profile,
                    &request(10),
                    &cands,
                    r.wrapping_mul(0x1234_5678_9abc_def1),
                )
            })
            .collect();
        assert_eq!(winners.len(), 4, "every endpoint wins some ties");
    }
    let rr = Profile::named(ProfileName::RoundRobin);
    let order: Vec<_> = (0..8)
        .map(|i| {
            schedule(&rr, &request(10), &cands, 0, i)
                .chosen()
                .unwrap()
                .0
        })
        .collect();
    assert_eq!(order, vec![0, 1, 2, 3, 0, 1, 2, 3]);
}

#[test]
fn softmax_spreads_among_near_equal_candidates() {
    let mut cands = fleet(2);
    cands[0].cache.index = gpu_match(0, 10);
    cands[1].cache.index = gpu_match(1, 9);
    let profile = Profile {
        picker: Picker::Softmax {
            temperature_s: 0.005,
        },
        ..Profile::default()
    };
    let wins0 = (0..400u64)
        .filter(|r| {
            chosen(
                &profile,
                &request(200),
                &cands,
                r.wrapping_mul(0x9e37_79b9_7f4a_7c15),
            ) == 0
        })
        .count();
    assert!((200..380).contains(&wins0), "{wins0}");
}

#[test]
fn session_affinity_is_a_credit_in_seconds() {
    let mut cands = fleet(2);
    busy(&mut cands[1], 1, 100);
    let mut req = request(1000);
    req.session_endpoint = Some(EndpointId(1));
    let profile = Profile {
        session_affinity_s: 0.5,
        ..Profile::default()
    };
    let d = schedule(&profile, &req, &cands, 0, 0);
    assert_eq!(d.chosen(), Some(EndpointId(1)));
    assert_eq!(d.reason, Reason::Session);
}

#[test]
fn prefix_hash_keeps_a_prefix_home_and_overflows_past_the_load_bound() {
    let profile = Profile::named(ProfileName::PrefixHash);
    let mut cands = fleet(4);
    let with_key = |key: u64| RequestInfo {
        prefix_key: Some(key),
        ..request(1_000)
    };
    // Costs are ignored: a prefix has one home whatever the random input.
    let home = chosen(&profile, &with_key(7), &cands, 1);
    for random in 0..20 {
        assert_eq!(chosen(&profile, &with_key(7), &cands, random), home);
    }
    // Different prefixes spread over the ring.
    let homes: std::collections::HashSet<u32> = (0..64)
        .map(|k| chosen(&profile, &with_key(k), &cands, 0))
        .collect();
    assert_eq!(homes.len(), 4, "{homes:?}");
    // The home above (1 + 0.25) × the mean load: the next endpoint on the ring takes it.
    cands[home as usize].load.inflight = 10;
    for (i, c) in cands.iter_mut().enumerate() {
        if i as u32 != home {
            c.load.inflight = 2;
        }
    }
    let d = schedule(&profile, &with_key(7), &cands, 0, 0);
    assert_ne!(d.chosen(), Some(EndpointId(home)));
    assert_eq!(d.reason, Reason::PrefixHash);
    assert_eq!(d.ranking.len(), 4, "every endpoint stays a fallback");
}
