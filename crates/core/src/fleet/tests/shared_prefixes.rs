//! Shared prefixes and their copies: new conversations spread once a system prompt's holder
//! fills up, and copies are bought with the rent a busier holder's requests pay.

use super::*;
use crate::schedule::Reason;

#[test]
fn new_conversations_spread_once_the_system_prompts_holder_fills_up() {
    // Nothing is cached anywhere at first; caches of 300 blocks; a 400-token system prompt;
    // conversations of two turns that each add 1,200 tokens.
    let mut fleet = FleetBuilder::new(3).build();
    for e in 0..3 {
        let sample = LoadSample {
            num_gpu_blocks: Some(300),
            ..LoadSample::default()
        };
        fleet.observe_load(EndpointId(e), sample, 0.0);
    }
    let system = prompt(400, 77);
    let mut now = 0.0;
    let mut homes = Vec::new();
    for c in 0..9u32 {
        let mut history = system.clone();
        let mut turns = Vec::new();
        for t in 0..2u32 {
            history.extend(prompt(1_200, 2_000 + 10 * c + t));
            let (_, mut d) = send(&mut fleet, &Req::new(&history), now);
            turns.push(d.endpoint);
            now += 0.05;
            fleet.first_token(&mut d, true, now);
            fleet.apply_events(d.endpoint, &[stored(&history, BS)], now);
            fleet.finished(d, None, now);
            now += 0.05;
        }
        assert_eq!(
            turns[1], turns[0],
            "a follow-up turn stays with its history"
        );
        homes.push(turns[0]);
    }
    // The first conversations go where the system prompt is while its cache has room; once it
    // is full, a new conversation there would evict blocks that are being reused, which costs
    // more than copying the prompt elsewhere: they spread, each endpoint copying it once.
    assert_eq!(homes[1], homes[0], "{homes:?}");
    for e in 0..3 {
        assert!(homes.contains(&EndpointId(e)), "{homes:?}");
    }
}

/// The 1,600-token system prompt of [`shared_system_prompt`].
fn system_prompt() -> Vec<u32> {
    prompt(1_600, 5)
}

/// Question `q`: the system prompt and 160 tokens of its own.
fn question(q: u32) -> Req {
    let mut tokens = system_prompt();
    tokens.extend(prompt(160, 1_000 + q));
    Req::new(&tokens)
}

/// Three endpoints with caches of 2,000 blocks, where questions 0 to 2 made the system prompt
/// shared: they ended, cached where they went. Returns the fleet and the time after them.
fn shared_system_prompt() -> (Fleet, f64) {
    let mut fleet = FleetBuilder::new(3).build();
    scrape_idle(&mut fleet, 2_000);
    let system = system_prompt();
    let mut now = 0.0;
    for q in 0..3 {
        let (_, mut d) = send(&mut fleet, &question(q), now);
        now += 0.1;
        fleet.first_token(&mut d, true, now);
        fleet.apply_events(d.endpoint, &[stored(&system, BS)], now);
        fleet.finished(d, None, now);
    }
    (fleet, now)
}

#[test]
fn a_busier_holders_rent_buys_a_copy_before_a_single_request_would() {
    let (mut fleet, mut now) = shared_system_prompt();
    let holder = send(&mut fleet, &question(3), now).1.endpoint;
    // Then questions keep arriving while the holder's answers never end: it stays the busiest.
    let mut copied = None;
    for q in 4..40 {
        now += 0.01;
        let (plan, d) = send(&mut fleet, &question(q), now);
        if d.endpoint != holder {
            copied = Some((q, plan));
            break;
        }
    }
    let (q, plan) = copied.expect("a copy of the shared prefix");
    assert!(
        q > 4,
        "not at the first busy request: rent must have been paid first"
    );
    assert_eq!(plan.decision.reason, Reason::CopyRent);
    let copy = plan.decision.copy.expect("the rent account");
    let (at, credit) = copy.bought.expect("bought");
    // Bought with the rent: on its own cost the request would have stayed.
    let own = plan.decision.assessment(at).unwrap().cost.total_s;
    let held = plan.decision.assessment(holder).unwrap().cost.total_s;
    assert!(own > held, "{own} vs {held}");
    assert!(own - credit < held);
    assert!(credit <= copy.rent_s);
}

#[test]
fn copies_are_bought_with_rent_again_once_the_last_prefill_endpoint_leaves() {
    let (mut fleet, now) = shared_system_prompt();
    let rent_kept = |fleet: &mut Fleet, now: f64| {
        fleet
            .plan_every(&question(99).features(), 7, now)
            .decision
            .copy
            .is_some()
    };
    assert!(
        rent_kept(&mut fleet, now),
        "whole-request fleet: rent is kept"
    );
    // A prefill endpoint joins: its P/D decision places the legs, no rent is kept.
    let prefill = fleet
        .add_endpoint(
            EndpointSpec {
                role: Role::Prefill,
                ..spec("p", BS)
            },
            now,
        )
        .unwrap();
    assert!(!rent_kept(&mut fleet, now), "a P/D fleet keeps no rent");
    // It leaves: the fleet serves whole requests again.
    assert!(fleet.remove_endpoint(prefill, now));
    assert!(
        rent_kept(&mut fleet, now),
        "rent is kept again once the fleet has no prefill endpoint"
    );
}
