//! Where a conversation's turns go: follow-up turns stay with their history, with the
//! engines' events and without them.

use super::*;
use crate::schedule::{ProfileName, Reason};

#[test]
fn follow_up_turns_stay_with_their_history_at_zero_load() {
    // The first round's repro: 3 idle engines, 6 conversations of 4 turns sent one at a time,
    // one shared system prompt. Every follow-up must go where its history is.
    let mut fleet = FleetBuilder::new(3).build();
    let system = prompt(400, 99);
    // Every engine has served the system prompt before (else the one that has is cheaper for
    // every new conversation at zero load, and rightly so).
    for e in 0..3 {
        fleet.apply_events(EndpointId(e), &[stored(&system, BS)], 0.0);
    }
    let mut now = 0.0;
    let mut homes = vec![None; 6];
    let mut histories: Vec<Vec<u32>> = vec![system.clone(); 6];
    for turn in 0..4 {
        for (c, history) in histories.iter_mut().enumerate() {
            history.extend(prompt(150 + 40 * turn, (c * 10 + turn) as u32 + 1000));
            let req = Req::new(history);
            let (plan, mut d) = send(&mut fleet, &req, now);
            if let Some(home) = homes[c] {
                assert_eq!(
                    d.endpoint, home,
                    "turn {turn} of conversation {c}: {:?}",
                    plan.decision
                );
                assert_eq!(plan.decision.reason, Reason::Cache);
            }
            homes[c] = Some(d.endpoint);
            now += 0.05;
            fleet.first_token(&mut d, true, now);
            fleet.apply_events(d.endpoint, &[stored(history, BS)], now);
            history.extend(prompt(60, (c * 10 + turn) as u32 + 5000)); // the answer
            now += 0.2;
            fleet.finished(d, None, now);
        }
    }
    // New conversations cost the same everywhere: placements spread them, two per engine.
    for e in 0..3 {
        let n = homes.iter().filter(|h| **h == Some(EndpointId(e))).count();
        assert_eq!(n, 2, "{homes:?}");
    }
}

/// Real vLLM on a busy CPU, once in CI: a conversation's first turn met a slow moment on an
/// engine that had measured nothing else, its one sample priced every prefill there at a
/// tenth of the other engine's rate, and the next turn was sent away from its 22 cached
/// blocks to compute all 25 elsewhere. One sample is not yet an engine's rate.
#[test]
fn a_turn_stays_with_its_history_where_one_slow_prefill_was_measured() {
    let mut fleet = FleetBuilder::new(2).build();
    let (fast, slow) = (EndpointId(0), EndpointId(1));
    // The fast engine's samples were taken long ago (their placements have decayed: balancing
    // would favour it among near-equal costs), the slow one's just now.
    let mut now = 0.0;
    for salt in 0..4 {
        let mut d = send_to(&mut fleet, &Req::new(&prompt(1000, salt)), fast, now);
        fleet.first_token(&mut d, true, now + 0.1); // 10k tokens/s, alone
        fleet.finished(d, Some(0), now + 0.2);
        now += 0.3;
    }
    now = 10.0 * super::endpoint::PLACEMENT_TAU_S;
    let mut history = prompt(368, 77);
    let mut first = send_to(&mut fleet, &Req::new(&history), slow, now);
    fleet.first_token(&mut first, true, now + 0.5); // 736 tokens/s, alone: a slow moment
    fleet.apply_events(slow, &[stored(&history, BS)], now + 0.5);
    fleet.finished(first, Some(0), now + 0.6);
    history.extend(prompt(32, 78));
    let (plan, next) = send(&mut fleet, &Req::new(&history), now + 0.7);
    assert_eq!(next.endpoint, slow, "{:?}", plan.decision);
    assert_eq!(plan.decision.reason, Reason::Cache);
}

#[test]
fn approximate_mode_follows_the_routers_own_history() {
    let mut builder = FleetBuilder::new(3);
    builder.profile = Profile::named(ProfileName::Approximate);
    for s in &mut builder.specs {
        s.has_events = false;
    }
    let mut fleet = builder.build();
    let mut history = prompt(500, 8);
    let (_, d) = send(&mut fleet, &Req::new(&history), 0.0);
    let home = d.endpoint;
    fleet.finished(d, None, 0.5);
    for turn in 0..3 {
        history.extend(prompt(200, 100 + turn));
        let (plan, d) = send(&mut fleet, &Req::new(&history), 1.0 + f64::from(turn));
        assert_eq!(d.endpoint, home);
        assert_eq!(plan.decision.reason, Reason::Cache);
        fleet.finished(d, None, 1.5 + f64::from(turn));
    }
}
