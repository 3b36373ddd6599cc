//! Copy rent for a shared prefix: the rent a busier holder's requests pay, and when it buys a
//! copy of the prefix elsewhere.

use super::*;
use crate::tiers::TierLoadMode;

/// Three endpoints and a 1,760-token prompt whose first 1,600 tokens are a shared prefix that
/// only endpoint 0 holds; endpoint 0 has `holder_queue` requests queued (of 64 uncached tokens
/// each) and endpoint 2 `other_queue`. Caches of 1,000 blocks, full (`free` blocks free).
fn shared_prefix_fleet(holder_queue: u32, other_queue: u32, free: f64) -> Vec<Candidate> {
    let mut cands = fleet(3);
    cands[0].cache.index = gpu_match(0, 100);
    busy(&mut cands[0], holder_queue, 64 * u64::from(holder_queue));
    busy(&mut cands[2], other_queue, 64 * u64::from(other_queue));
    for c in &mut cands {
        c.cache.capacity_blocks = Some(1_000.0);
        c.cache.free_blocks = Some(free);
        c.cache.block_reuse = 1.0;
    }
    cands
}

const SHARED: usize = 1_600;

/// Room its hits do not reach, the same on every endpoint.
fn cold(blocks: f64) -> impl Fn(EndpointId) -> Option<f64> {
    move |_| Some(blocks)
}

/// The shared prefix of [`shared_prefix_fleet`]'s prompt with `rent_s` paid.
fn shared(rent_s: f64) -> amortize::SharedPrefix {
    amortize::SharedPrefix {
        tokens: SHARED,
        prompt_tokens: 1_760,
        block_size: 16,
        rent_s,
    }
}

#[test]
fn a_copy_is_bought_once_the_rent_paid_exceeds_what_it_costs() {
    let profile = Profile::default();
    let req = request(1_760);
    let cands = shared_prefix_fleet(2, 0, 1_000.0);
    // Alone, the request stays with the busier holder: the copy's prefill costs more than
    // the wait it saves.
    let mut d = schedule(&profile, &req, &cands, 1, 0);
    assert_eq!(d.chosen(), Some(EndpointId(0)));
    let holder = d.assessment(EndpointId(0)).unwrap().cost.total_s;
    let copy = d.assessment(EndpointId(1)).unwrap().cost.total_s;
    assert!(copy > holder);
    let unpaid = amortize::apply_rent(&profile, &mut d, shared(0.0), 8, cold(0.0)).unwrap();
    assert_eq!(d.chosen(), Some(EndpointId(0)));
    assert!(unpaid.bought.is_none());
    // It pays rent: what a copy would save it wherever the copy went.
    assert!(unpaid.paid_s > 0.0, "{unpaid:?}");
    // Once the rent paid covers the copy's extra cost, the copy is bought where it is cheapest
    // after the credit, and the credit never exceeds the rent.
    let rent = copy - holder + 1e-3;
    let mut d = schedule(&profile, &req, &cands, 1, 0);
    let bought = amortize::apply_rent(&profile, &mut d, shared(rent), 8, cold(0.0)).unwrap();
    let (at, credit) = bought.bought.expect("a copy");
    assert_ne!(at, EndpointId(0));
    assert_eq!(d.chosen(), Some(at));
    assert_eq!(d.reason, Reason::CopyRent);
    assert!(credit <= rent && credit > 0.0, "{bought:?}");
    // Short of it, no copy.
    let mut d = schedule(&profile, &req, &cands, 1, 0);
    let short = amortize::apply_rent(&profile, &mut d, shared(rent / 2.0), 8, cold(0.0));
    assert!(short.unwrap().bought.is_none());
    assert_eq!(d.chosen(), Some(EndpointId(0)));
}

#[test]
fn rent_is_paid_back_while_an_endpoint_lacking_the_prefix_is_busier_than_its_holder() {
    let profile = Profile::default();
    let mut d = schedule(
        &profile,
        &request(1_760),
        &shared_prefix_fleet(2, 4, 1_000.0),
        1,
        0,
    );
    assert_eq!(d.chosen(), Some(EndpointId(0)));
    let outcome = amortize::apply_rent(&profile, &mut d, shared(0.0), 8, cold(0.0)).unwrap();
    // Negative: it pays back what noise may have paid in, so a balanced fleet nets nothing.
    assert!(outcome.paid_s < 0.0, "{outcome:?}");
}

#[test]
fn a_copy_is_not_bought_into_room_the_endpoints_hits_use() {
    let profile = Profile::default();
    let req = request(1_760);
    // Full caches: the copy evicts. Whatever the rent, no copy where every block is reused.
    let cands = shared_prefix_fleet(2, 0, 0.0);
    let mut d = schedule(&profile, &req, &cands, 1, 0);
    let outcome = amortize::apply_rent(&profile, &mut d, shared(1e6), 8, cold(50.0)).unwrap();
    assert!(outcome.bought.is_none());
    assert_eq!(d.chosen(), Some(EndpointId(0)));
    // Where the 100 missing blocks fit in room no hit reaches, it is bought.
    let mut d = schedule(&profile, &req, &cands, 1, 0);
    let outcome = amortize::apply_rent(&profile, &mut d, shared(1e6), 8, cold(100.0)).unwrap();
    assert!(outcome.bought.is_some());
}

#[test]
fn no_copy_is_credited_where_the_capacity_is_unknown() {
    let profile = Profile::default();
    let mut d = schedule(
        &profile,
        &request(1_760),
        &shared_prefix_fleet(2, 0, 1_000.0),
        1,
        0,
    );
    let unknown = |_: EndpointId| None;
    let outcome = amortize::apply_rent(&profile, &mut d, shared(1e6), 8, unknown).unwrap();
    assert!(outcome.bought.is_none());
    assert_eq!(d.chosen(), Some(EndpointId(0)));
}

#[test]
fn a_shared_prefixs_rent_pays_only_for_the_shared_part_of_a_copy() {
    // A new question: endpoint 0 holds its 1,600-token shared prefix and nothing of its own
    // 640 tokens; it is somewhat busy, the others are idle and hold nothing.
    let profile = Profile::default();
    let mut cands = shared_prefix_fleet(1, 0, 1_000.0);
    cands[0].cache.index = gpu_match(0, 100);
    let mut d = schedule(&profile, &request(2_240), &cands, 1, 0);
    assert_eq!(d.chosen(), Some(EndpointId(0)));
    let holder = d.assessment(EndpointId(0)).unwrap().cost.clone();
    let prefix = amortize::SharedPrefix {
        prompt_tokens: 2_240,
        ..shared(1e6)
    };
    let outcome = amortize::apply_rent(&profile, &mut d, prefix, 8, cold(1_000.0)).unwrap();
    let (at, credit) = outcome.bought.expect("a copy, with rent to spare");
    let copy = d.assessment(at).unwrap().cost.clone();
    // What acquiring the prefix adds there: its cost less what it would cost holding what the
    // holder holds (the holder's prefill of the question, its own queue, nothing stalled).
    assert_eq!(copy.decode_interference_s, 0.0);
    assert_eq!(copy.eviction_s, 0.0);
    let adds = copy.total_s - (holder.prefill_s + copy.queue_s);
    // The credit is the shared prefix's share of it (1,600 of the 2,240 tokens it lacks), not
    // all of it: the question's own part is the question's to pay for.
    assert!(
        (credit - adds * 1_600.0 / 2_240.0).abs() < 1e-9,
        "{credit} vs {adds}"
    );
}

#[test]
fn a_shared_prefixs_rent_does_not_pay_for_moving_a_conversations_own_history() {
    // Endpoint 0 holds a conversation: a 320-token system prompt (shared) and 1,440 tokens of
    // its own history. It is somewhat busy; the others hold nothing.
    let profile = Profile::default();
    let mut cands = shared_prefix_fleet(2, 0, 1_000.0);
    cands[0].cache.index = gpu_match(0, 110);
    let mut d = schedule(&profile, &request(1_776), &cands, 1, 0);
    assert_eq!(d.chosen(), Some(EndpointId(0)));
    let system = amortize::SharedPrefix {
        tokens: 320,
        prompt_tokens: 1_776,
        block_size: 16,
        rent_s: 1e6,
    };
    // Whatever the system prompt's requests paid, the history stays where it is.
    let outcome = amortize::apply_rent(&profile, &mut d, system, 8, cold(1_000.0)).unwrap();
    assert!(outcome.bought.is_none(), "{outcome:?}");
    assert_eq!(d.chosen(), Some(EndpointId(0)));
}

#[test]
fn a_copy_is_bought_by_a_new_conversation_not_by_a_later_turn_it_would_uproot() {
    let profile = Profile::default();
    // A later turn: its holder, the busier endpoint, holds the 1,600-token shared prefix and
    // 160 tokens of the conversation's own history. However much rent was paid, it stays
    // with its history, and pays rent.
    let mut cands = shared_prefix_fleet(2, 0, 1_000.0);
    cands[0].cache.index = gpu_match(0, 110);
    let mut d = schedule(&profile, &request(1_776), &cands, 1, 0);
    assert_eq!(d.chosen(), Some(EndpointId(0)));
    let later_turn = amortize::SharedPrefix {
        prompt_tokens: 1_776,
        ..shared(1e6)
    };
    let stays = amortize::apply_rent(&profile, &mut d, later_turn, 8, cold(1_000.0)).unwrap();
    assert!(stays.bought.is_none(), "{stays:?}");
    assert_eq!(d.chosen(), Some(EndpointId(0)));
    assert!(stays.paid_s > 0.0, "{stays:?}");
    // A new conversation under the same prefix finds only the prefix there: it buys the copy.
    let cands = shared_prefix_fleet(2, 0, 1_000.0);
    let mut d = schedule(&profile, &request(1_760), &cands, 1, 0);
    let buys = amortize::apply_rent(&profile, &mut d, shared(1e6), 8, cold(1_000.0)).unwrap();
    assert!(buys.bought.is_some(), "{buys:?}");
    assert_ne!(d.chosen(), Some(EndpointId(0)));
}

#[test]
fn a_holder_reloading_the_prefix_from_cpu_memory_pays_that_reload_as_rent() {
    // Endpoint 0 holds the shared prefix only in CPU memory (an engine keeping more contexts
    // than its GPU memory holds reloads each in turn); no queue anywhere.
    let profile = Profile::default();
    let mut cands = shared_prefix_fleet(0, 0, 1_000.0);
    cands[0].cache.index = cpu_match(0, 100);
    let mut d = schedule(&profile, &request(1_760), &cands, 1, 0);
    assert_eq!(d.chosen(), Some(EndpointId(0)));
    let reload_s = d.assessment(EndpointId(0)).unwrap().cost.tier_load_s;
    assert!(reload_s > 0.0);
    // A copy in room would stay in GPU memory, so the reload is what it saves each request.
    let outcome = amortize::apply_rent(&profile, &mut d, shared(0.0), 8, cold(0.0)).unwrap();
    assert!(outcome.bought.is_none());
    let paid = outcome.paid_s;
    assert!(
        (paid - profile.weights.prefix * reload_s).abs() < 1e-9,
        "{outcome:?}, reload {reload_s}"
    );
    // Where loads run in the step, they stall the running decodes too: that stall is rent as
    // well (a copy in GPU memory stalls them only for its prefill).
    let mut profile = Profile::default();
    profile.tiers.load_mode = TierLoadMode::InStep;
    for c in &mut cands {
        c.load.running = Some(4.0);
    }
    let mut d = schedule(&profile, &request(1_760), &cands, 1, 0);
    assert_eq!(d.chosen(), Some(EndpointId(0)));
    let holder = d.assessment(EndpointId(0)).unwrap().cost.clone();
    assert!(holder.decode_interference_s > 0.0);
    let stall_per_s = holder.decode_interference_s / holder.stalling_s;
    let outcome = amortize::apply_rent(&profile, &mut d, shared(0.0), 8, cold(0.0)).unwrap();
    let expected =
        holder.tier_load_s * (profile.weights.prefix + profile.weights.load * stall_per_s);
    assert!(
        (outcome.paid_s - expected).abs() < 1e-9,
        "{outcome:?}, expected {expected}"
    );
}
