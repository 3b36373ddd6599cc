//! The fleet's picture of each engine's cache: lookups read before a plan, predictions and
//! their retirement, forgetting an endpoint, block sizes per model, peers' dispatches, a
//! sharded index and restored snapshots.

use super::*;
use crate::index::{EndpointRestore, HeldEntry, KeyLayout};

/// A fleet of `endpoints` whose `holder` holds an 800-token prompt (salt `salt`), and that
/// prompt as a request.
fn holding(endpoints: usize, holder: EndpointId, salt: u32) -> (Fleet, Req) {
    let mut fleet = FleetBuilder::new(endpoints).build();
    let tokens = prompt(800, salt);
    fleet.apply_events(holder, &[stored(&tokens, BS)], 0.0);
    (fleet, Req::new(&tokens))
}

#[test]
fn a_plan_with_its_lookup_read_beforehand_decides_as_one_that_looks_up_itself() {
    // Three endpoints cost every one; sixty-four, more than a plan ranks, take the pruned path.
    for endpoints in [3, 64] {
        let (mut fleet, req) = holding(endpoints, EndpointId(2), 5);
        let lookup = fleet.lookup_target(BS).run(&req.keys);
        let with = fleet.plan_with(&req.features(), Some(lookup), 1, 0.1);
        let without = fleet.plan(&req.features(), 1, 0.1);
        assert_eq!(with.decision.chosen(), Some(EndpointId(2)));
        assert_eq!(with.decision.chosen(), without.decision.chosen());
        assert_eq!(with.predicted_cached, without.predicted_cached);
        assert_eq!(with.predicted_cached[2], 784);
    }
}

#[test]
fn a_plan_credits_the_lookup_it_is_given_not_the_index_since() {
    // Both paths (every endpoint costed; pruned).
    for endpoints in [3, 64] {
        let (mut fleet, req) = holding(endpoints, EndpointId(2), 7);
        let lookup = fleet.lookup_target(BS).run(&req.keys);
        // Another engine stores the prompt between the walk and the plan (events race
        // decisions): the plan goes by its walk, which the next one will not.
        fleet.apply_events(EndpointId(0), &[stored(&prompt(800, 7), BS)], 0.05);
        let with = fleet.plan_with(&req.features(), Some(lookup), 1, 0.1);
        assert_eq!(
            (with.predicted_cached[0], with.predicted_cached[2]),
            (0, 784)
        );
        let fresh = fleet.plan(&req.features(), 1, 0.1);
        assert_eq!(
            (fresh.predicted_cached[0], fresh.predicted_cached[2]),
            (784, 784)
        );
    }
}

#[test]
fn a_lookup_read_before_an_endpoint_was_forgotten_is_not_used() {
    let (mut fleet, req) = holding(2, EndpointId(1), 6);
    let lookup = fleet.lookup_target(BS).run(&req.keys);
    assert_eq!(lookup.matches.blocks(EndpointId(1)), 50);
    // The engine restarted between the lookup and the plan.
    fleet.forget_endpoint(EndpointId(1), 0.1);
    let plan = fleet.plan_with(&req.features(), Some(lookup), 1, 0.2);
    assert_eq!(
        plan.predicted_cached,
        vec![0, 0],
        "its old cache is not credited"
    );
    // A lookup of another block size is not used either.
    let (mut fleet, req) = holding(2, EndpointId(1), 6);
    let elsewhere = fleet.lookup_target(2 * BS).run(&req.keys);
    let plan = fleet.plan_with(&req.features(), Some(elsewhere), 1, 0.1);
    assert_eq!(
        plan.predicted_cached[1], 784,
        "looked up again with its own block size"
    );
}

#[test]
fn forgetting_an_endpoint_drops_everything_known_of_its_cache() {
    let mut fleet = FleetBuilder::new(2).build();
    let tokens = prompt(800, 3);
    let mut req = Req::new(&tokens);
    req.session = Some("s".into());
    let (_, mut d) = send(&mut fleet, &req, 0.0);
    let e = d.endpoint;
    fleet.apply_events(e, &[stored(&tokens, BS)], 0.01);
    fleet.first_token(&mut d, true, 0.02);
    let plan = fleet.plan(&req.features(), 1, 0.03);
    assert_eq!(plan.predicted_cached[e.0 as usize], 784);
    // The engine restarted (or was ejected, or its pod left).
    fleet.forget_endpoint(e, 0.04);
    let plan = fleet.plan_every(&req.features(), 1, 0.05);
    assert_eq!(
        plan.predicted_cached,
        vec![0, 0],
        "nothing predicted on an emptied engine"
    );
    assert_eq!(plan.facts[e.0 as usize].history_blocks, 0);
    assert_eq!(plan.facts[e.0 as usize].predicted_blocks, 0);
    assert!(plan.facts[e.0 as usize].index_match.is_none());
    fleet.finished(d, None, 0.06);
}

#[test]
fn only_requests_prefilled_in_the_engines_present_life_count_as_its_recent_use() {
    let mut fleet = FleetBuilder::new(1).build();
    let req = Req::new(&prompt(320, 5));
    let kept = |fleet: &Fleet| fleet.endpoints[0].recent.ended_count();
    // Refused or failed before its first token: it never reached the cache.
    let (_, d) = send(&mut fleet, &req, 0.0);
    fleet.finished(d, None, 0.1);
    assert_eq!(kept(&fleet), 0);
    let (_, mut d) = send(&mut fleet, &req, 1.0);
    fleet.first_token(&mut d, true, 1.1);
    fleet.finished(d, None, 1.5);
    assert_eq!(kept(&fleet), 1);
    // Sent before the engine restarted: its blocks went with the old process.
    let (_, mut d) = send(&mut fleet, &req, 2.0);
    fleet.first_token(&mut d, true, 2.1);
    fleet.forget_endpoint(EndpointId(0), 2.2);
    assert_eq!(kept(&fleet), 0);
    fleet.finished(d, None, 2.5);
    assert_eq!(kept(&fleet), 0);
}

#[test]
fn a_prediction_retires_shortly_after_the_first_token() {
    let mut fleet = FleetBuilder::new(2).build();
    let tokens = prompt(640, 5);
    let req = Req::new(&tokens);
    let (_, mut d) = send(&mut fleet, &req, 0.0);
    let e = d.endpoint.0 as usize;
    assert_eq!(
        fleet.plan_every(&req.features(), 1, 1.0).facts[e].predicted_blocks,
        40
    );
    fleet.first_token(&mut d, true, 2.0);
    let grace = fleet.config().prediction_grace_s;
    assert_eq!(
        fleet
            .plan_every(&req.features(), 1, 2.0 + grace / 2.0)
            .facts[e]
            .predicted_blocks,
        40
    );
    assert_eq!(
        fleet
            .plan_every(&req.features(), 1, 2.0 + grace * 2.0)
            .facts[e]
            .predicted_blocks,
        0
    );
    fleet.finished(d, None, 3.0);
}

#[test]
fn each_model_matches_with_its_own_block_size() {
    let specs = vec![spec("small", 16), {
        let mut s = spec("large", 32);
        s.models = vec!["big".into()];
        s
    }];
    let mut fleet = Fleet::new(FleetConfig::default(), Profile::default(), specs).unwrap();
    let tokens = prompt(640, 6);
    fleet.apply_events(EndpointId(1), &[stored(&tokens, 32)], 0.0);
    let mut req = Req::sized(&tokens, 32);
    req.model = "big";
    let plan = fleet.plan_every(&req.features(), 1, 0.1);
    assert_eq!(
        plan.decision.ranking,
        vec![EndpointId(1)],
        "only the large endpoint serves it"
    );
    assert_eq!(plan.facts[1].index_match.map(|m| m.blocks), Some(20));
    assert_eq!(
        plan.predicted_cached[1], 608,
        "all full blocks but the last token's"
    );
}

#[test]
fn a_peer_replicas_dispatch_steers_the_next_same_prefix_request_without_load() {
    let mut fleet = FleetBuilder::new(4).build();
    let req = Req::new(&prompt(2000, 9));
    // Another replica sent it to e2 a moment ago: its blocks are not stored yet.
    fleet.peer_dispatched(&req.features(), EndpointId(2), true, 0.0);
    let plan = fleet.plan_every(&req.features(), 3, 0.01);
    assert_eq!(plan.decision.chosen(), Some(EndpointId(2)));
    assert_eq!(plan.facts[2].predicted_blocks, 125);
    // The placement counts there; the in-flight load stays the sender's.
    let load = fleet.load(EndpointId(2), 0.01).unwrap();
    assert!(load.recent_placements > 0.9, "{load:?}");
    assert_eq!((load.inflight, load.inflight_prefill_tokens), (0, 0));
    // A new conversation goes elsewhere: e2 has the most recent placements.
    let other = Req::new(&prompt(2000, 10));
    let plan = fleet.plan(&other.features(), 3, 0.01);
    assert_ne!(plan.decision.chosen(), Some(EndpointId(2)));
    // Without the engine's events, the prediction ends soon after the prefill would have
    // (2,000 tokens at the assumed 20,000 tokens/s: 0.2 s twice, plus the grace).
    let plan = fleet.plan_every(&req.features(), 3, 1.0);
    assert_eq!(plan.facts[2].predicted_blocks, 0);
}

#[test]
fn a_sharded_index_plans_as_one_index_does() {
    // Five endpoints holding different prefixes of one prompt, with small caches so that what
    // each holds (read per shard) weighs on its cost; three shards must plan as one.
    let plan_with = |shards: usize| {
        let mut builder = FleetBuilder::new(5);
        builder.config.index_shards = shards;
        let mut fleet = builder.build();
        let tokens = prompt(1600, 9);
        for e in 0..5usize {
            let sample = gauges(0.0, e as f64, 0.5, 120);
            fleet.observe_load(EndpointId(e as u32), sample, 0.0);
            let held = &tokens[..(e + 1) * 320];
            fleet.apply_events(EndpointId(e as u32), &[stored(held, BS)], 0.0);
            fleet.apply_events(
                EndpointId(e as u32),
                &[stored(&prompt(160 * e, 50), BS)],
                0.0,
            );
        }
        let plan = fleet.plan_every(&Req::new(&tokens).features(), 3, 0.1);
        let matches: Vec<_> = plan.facts.iter().map(|f| f.index_match).collect();
        (plan.decision.ranking, plan.predicted_cached, matches)
    };
    let one = plan_with(1);
    assert_eq!(
        one.2[4].map(|m| m.blocks),
        Some(100),
        "the last holds the whole prompt"
    );
    assert_eq!(plan_with(3), one);
}

#[test]
fn a_peers_snapshot_is_restored_in_one_step_only_when_its_keys_are_laid_out_alike() {
    let e0 = EndpointId(0);
    let tokens = prompt(64, 9);
    let mut source = FleetBuilder::new(1).build();
    source.apply_events(e0, &[stored(&tokens, BS)], 0.0);
    let blocks: Vec<HeldEntry> = source
        .index_of(e0)
        .unwrap()
        .read_endpoint(e0, |ix| ix.endpoint_blocks(e0).collect());
    assert_eq!(blocks.len(), 4);
    let layout = source.key_layout(e0).unwrap();
    let restore = |layout, trusted| EndpointRestore {
        layout,
        blocks: blocks.clone(),
        trusted,
        tier_uncertain: false,
        tracked_group: None,
    };
    let matched = |fleet: &mut Fleet| {
        let plan = fleet.plan_every(&Req::new(&tokens).features(), 1, 1.0);
        plan.facts[0].index_match.map_or(0, |m| m.blocks)
    };

    // Keys made with another block size (offloaded chunk size, key chain) name other tokens:
    // refused, and nothing changes.
    let mut target = FleetBuilder::new(1).build();
    let larger = KeyLayout {
        block_size: 32,
        ..layout
    };
    assert_eq!(
        target.restore_endpoint(e0, restore(larger, true), 1.0),
        Err(CoreError::KeyLayoutMismatch {
            field: "block_size",
            snapshot: Some(32),
            ours: Some(BS),
        })
    );
    let chunked = KeyLayout {
        offload_block_size: Some(64),
        ..layout
    };
    assert!(matches!(
        target.restore_endpoint(e0, restore(chunked, true), 1.0),
        Err(CoreError::KeyLayoutMismatch {
            field: "offload_block_size",
            ..
        })
    ));
    let rekeyed = KeyLayout {
        key_scheme: layout.key_scheme + 1,
        ..layout
    };
    assert!(matches!(
        target.restore_endpoint(e0, restore(rekeyed, true), 1.0),
        Err(CoreError::KeyLayoutMismatch {
            field: "key_scheme",
            ..
        })
    ));
    assert_eq!(matched(&mut target), 0);

    // Alike: the blocks are the endpoint's, trusted as if its events had arrived.
    assert_eq!(
        target.restore_endpoint(e0, restore(layout, true), 1.0),
        Ok(Some(4))
    );
    assert_eq!(matched(&mut target), 4);
    assert!(target.trust(e0, 1.0).is_ok());

    // What the peer did not trust is not trusted here either.
    let mut wary = FleetBuilder::new(1).build();
    assert_eq!(
        wary.restore_endpoint(e0, restore(layout, false), 1.0),
        Ok(Some(4))
    );
    assert!(wary.trust(e0, 1.0).is_err());
}
