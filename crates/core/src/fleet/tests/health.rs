//! Endpoint health and trust: health checks and outlier ejection, distrust of an index
//! (silence, lost events, prediction errors, a warm-up past its timeout), and endpoints
//! removed and added.

use super::*;
use crate::schedule::Reason;

#[test]
fn health_ejection_forgets_and_restoration_needs_consecutive_passes() {
    let mut fleet = FleetBuilder::new(2).build();
    let tokens = prompt(320, 4);
    fleet.apply_events(EndpointId(0), &[stored(&tokens, BS)], 0.0);
    assert_eq!(fleet.health_check(EndpointId(0), false, 1.0), None);
    assert_eq!(
        fleet.health_check(EndpointId(0), false, 2.0),
        Some(HealthChange::Ejected)
    );
    let req = Req::new(&tokens);
    let plan = fleet.plan_every(&req.features(), 1, 2.1);
    assert_eq!(plan.decision.ranking, vec![EndpointId(1)]);
    assert!(plan.facts[0].index_match.is_none());
    assert_eq!(fleet.health_check(EndpointId(0), true, 3.0), None);
    assert_eq!(
        fleet.health_check(EndpointId(0), true, 4.0),
        Some(HealthChange::Restored)
    );
    assert_eq!(
        fleet.plan(&req.features(), 1, 4.1).decision.ranking.len(),
        2
    );
}

#[test]
fn silence_counts_only_against_requests_that_should_produce_events() {
    let mut fleet = FleetBuilder::new(1).build();
    let silent = fleet.config().trust.silent_after_s;
    // Requests shorter than a block store nothing: no event is owed.
    for i in 0..5 {
        let (_, d) = send(&mut fleet, &Req::new(&prompt(10, i)), f64::from(i));
        fleet.finished(d, Some(0), f64::from(i) + 0.1);
    }
    assert_eq!(fleet.trust(EndpointId(0), silent * 3.0), Ok(()));
    // A request that stores blocks and is never answered by an event: silent.
    let (_, d) = send(&mut fleet, &Req::new(&prompt(100, 9)), 100.0);
    fleet.finished(d, None, 100.1);
    assert_eq!(fleet.trust(EndpointId(0), 100.0 + silent / 2.0), Ok(()));
    assert_eq!(
        fleet.trust(EndpointId(0), 101.0 + silent),
        Err(Distrust::Silent)
    );
    assert_eq!(
        fleet.trust_changes(101.0 + silent),
        vec![(EndpointId(0), Some(Distrust::Silent))]
    );
    fleet.apply_events(EndpointId(0), &[], 102.0 + silent);
    assert_eq!(fleet.trust(EndpointId(0), 103.0 + silent), Ok(()));
    assert_eq!(
        fleet.trust_changes(103.0 + silent),
        vec![(EndpointId(0), None)]
    );
}

#[test]
fn lost_events_and_prediction_errors_distrust_for_a_while() {
    let mut fleet = FleetBuilder::new(1).build();
    fleet.events_lost(EndpointId(0), 10.0);
    let gap = fleet.config().trust.distrust_after_gap_s;
    assert_eq!(fleet.trust(EndpointId(0), 11.0), Err(Distrust::LostEvents));
    assert_eq!(fleet.trust(EndpointId(0), 10.0 + gap + 1.0), Ok(()));
    let now = 10.0 + gap + 2.0;
    for i in 0..6 {
        let (_, d) = send(&mut fleet, &Req::new(&prompt(1000, i)), now);
        fleet.finished(d, Some(900), now); // predicted 0, reported 900
    }
    assert_eq!(
        fleet.trust(EndpointId(0), now),
        Err(Distrust::PredictionError)
    );
}

/// A distrusted index is not read, so the outcomes of requests sent meanwhile do not judge it:
/// after a while unjudged it is read again on probation, and judged afresh, by what it predicts.
#[test]
fn an_index_distrusted_for_its_predictions_is_tried_again() {
    let mut fleet = FleetBuilder::new(1).build();
    let gap = fleet.config().trust.distrust_after_gap_s;
    let judge = |fleet: &mut Fleet, reported: usize, now: f64, seed: u32| {
        for i in 0..6 {
            let (_, d) = send(fleet, &Req::new(&prompt(1000, seed + i)), now);
            fleet.finished(d, Some(reported), now); // predicted 0
        }
        // The engine's events came: it is not silent.
        fleet.apply_events(EndpointId(0), &[], now);
    };
    judge(&mut fleet, 900, 1.0, 0);
    assert_eq!(
        fleet.trust(EndpointId(0), 1.0),
        Err(Distrust::PredictionError)
    );
    // Sent while distrusted (predicted without the index): no judgement of it.
    judge(&mut fleet, 900, 2.0, 10);
    assert_eq!(
        fleet.trust(EndpointId(0), 1.0 + gap - 0.5),
        Err(Distrust::PredictionError)
    );
    let probation = 1.0 + gap + 0.5;
    assert_eq!(
        fleet.trust(EndpointId(0), probation),
        Ok(()),
        "unjudged since 1.0: read again, on probation"
    );
    // Judged afresh: its predictions are right now, and it stays trusted.
    judge(&mut fleet, 0, probation, 20);
    assert_eq!(fleet.trust(EndpointId(0), probation + 1.0), Ok(()));
    // Wrong again: distrusted again.
    judge(&mut fleet, 900, probation + 2.0, 30);
    assert_eq!(
        fleet.trust(EndpointId(0), probation + 2.0),
        Err(Distrust::PredictionError)
    );
}

#[test]
fn failing_requests_eject_an_endpoint_for_a_while_without_forgetting_its_cache() {
    let mut fleet = FleetBuilder::new(3).build();
    let req = Req::new(&prompt(320, 1));
    fleet.apply_events(EndpointId(0), &[stored(&prompt(320, 1), BS)], 0.0);
    let n = fleet.config().outlier.consecutive_failures;
    for i in 0..n {
        let e = fleet.upstream_result(EndpointId(0), UpstreamOutcome::Failure, 1.0);
        assert_eq!(e.is_some(), i + 1 == n);
    }
    let plan = fleet.plan_every(&req.features(), 7, 1.5);
    assert_ne!(plan.decision.chosen(), Some(EndpointId(0)));
    let a = plan.decision.assessment(EndpointId(0)).unwrap();
    assert_eq!(a.rejected, Some(crate::schedule::Rejection::Ejected));
    assert!(plan.facts[0].ejected_until.is_some());
    // Back after its ejection, still holding its cache.
    let later = 1.0 + fleet.config().outlier.base_ejection_s;
    let plan = fleet.plan(&req.features(), 7, later);
    assert_eq!(plan.decision.chosen(), Some(EndpointId(0)));
    assert_eq!(plan.decision.reason, Reason::Cache);
}

#[test]
fn at_most_the_configured_share_of_the_fleet_is_ejected() {
    let mut fleet = FleetBuilder::new(2).build();
    let n = fleet.config().outlier.consecutive_failures;
    let mut ejections = 0;
    for id in [EndpointId(0), EndpointId(1)] {
        for _ in 0..n {
            ejections += fleet
                .upstream_result(id, UpstreamOutcome::Failure, 0.0)
                .is_some() as u32;
        }
    }
    assert_eq!(ejections, 1, "half of two endpoints is one");
}

#[test]
fn a_removed_endpoint_is_never_planned_and_health_checks_cannot_restore_it() {
    let mut fleet = FleetBuilder::new(2).build();
    let tokens = prompt(320, 3);
    fleet.apply_events(EndpointId(1), &[stored(&tokens, BS)], 0.0);
    assert!(fleet.remove_endpoint(EndpointId(1), 1.0));
    assert!(!fleet.remove_endpoint(EndpointId(1), 1.0), "removed once");
    for _ in 0..3 {
        assert_eq!(fleet.health_check(EndpointId(1), true, 2.0), None);
    }
    let req = Req::new(&tokens);
    for t in 0..10 {
        let (plan, dispatch) = send(&mut fleet, &req, 3.0 + f64::from(t));
        assert_eq!(plan.decision.ranking, [EndpointId(0)]);
        fleet.finished(dispatch, None, 3.5 + f64::from(t));
    }
    // What it held is forgotten.
    let index = fleet.index_of(EndpointId(1)).unwrap();
    assert!(
        index
            .endpoint_stats(EndpointId(1))
            .is_none_or(|s| s.blocks_gpu == 0)
    );
}

#[test]
fn added_endpoints_take_free_slots_and_start_with_nothing_cached() {
    let mut fleet = FleetBuilder::new(2).build();
    let tokens = prompt(320, 4);
    let req = Req::new(&tokens);
    // A new endpoint with a new block size gets a new slot and its own index.
    let e2 = fleet.add_endpoint(spec("e2", 32), 0.0).unwrap();
    assert_eq!(e2, EndpointId(2));
    assert!(fleet.index_for_block_size(32).is_some());
    // A slot whose old endpoint still has a request in flight is not reused.
    fleet.apply_events(EndpointId(0), &[stored(&tokens, BS)], 0.0);
    let (plan, in_flight) = send(&mut fleet, &req, 1.0);
    assert_eq!(plan.decision.chosen(), Some(EndpointId(0)));
    fleet.remove_endpoint(EndpointId(0), 2.0);
    let e3 = fleet.add_endpoint(spec("e3", BS), 2.0).unwrap();
    assert_eq!(e3, EndpointId(3));
    // Finished, but a request planned there may still be on its way to dispatch: not yet.
    fleet.finished(in_flight, None, 3.0);
    let settled = 2.0 + FleetConfig::default().slot_reuse_after_s;
    let early = fleet
        .add_endpoint(spec("early", BS), settled - 0.5)
        .unwrap();
    assert_eq!(early, EndpointId(4));
    // Once that time has passed, the slot is free again, and the newcomer holds nothing.
    let e4 = fleet.add_endpoint(spec("e4", BS), settled).unwrap();
    assert_eq!(e4, EndpointId(0));
    let e = fleet.endpoint(e4).unwrap();
    assert!(e.present() && e.healthy() && e.inflight() == 0);
    assert_eq!(e.spec.name, "e4");
    let plan = fleet.plan(&req.features(), 1, settled + 1.0);
    assert_eq!(plan.predicted_cached[0], 0, "nothing of e0's cache is e4's");
    assert!(plan.decision.ranking.contains(&e4));
}

#[test]
fn a_warm_up_past_its_timeout_distrusts_the_endpoints_behind() {
    let mut fleet = FleetBuilder::new(2).build();
    fleet.apply_events(EndpointId(0), &[], 0.0);
    assert_eq!(fleet.warm_verdict(&[], 0.0, 1.0, 0.0), WarmVerdict::Warm);
    let behind = [EndpointId(0)];
    assert_eq!(
        fleet.warm_verdict(&behind, 0.5, 1.0, 0.5),
        WarmVerdict::Warming
    );
    assert!(fleet.trust(EndpointId(0), 0.5).is_ok());
    assert_eq!(
        fleet.warm_verdict(&behind, 1.0, 1.0, 1.0),
        WarmVerdict::TimedOut
    );
    assert!(fleet.trust(EndpointId(0), 1.0).is_err());
}
