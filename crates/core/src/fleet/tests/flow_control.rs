//! Flow control and retries: the circuit breaker, requests held while every circuit is open,
//! retry verdicts and budgets, the passthrough rotation, and how deep a routing plan ranks.

use super::*;

#[test]
fn the_circuit_breaker_skips_a_full_endpoint() {
    let mut b = FleetBuilder::new(2);
    b.config.outlier.max_inflight = 1;
    let mut fleet = b.build();
    let req = Req::new(&prompt(320, 1));
    let (_, first) = send(&mut fleet, &req, 0.0);
    let (plan, second) = send(&mut fleet, &req, 0.0);
    assert_ne!(first.endpoint, second.endpoint);
    assert!(!plan.decision.saturated);
    let plan = fleet.plan(&req.features(), 7, 0.0);
    assert_eq!(plan.decision.chosen(), None);
    assert!(plan.decision.saturated, "flow control may hold it");
    fleet.finished(first, None, 0.1);
    assert!(
        fleet
            .plan(&req.features(), 7, 0.1)
            .decision
            .chosen()
            .is_some()
    );
}

#[test]
fn retries_are_budgeted() {
    let mut fleet = FleetBuilder::new(2).build();
    let floor = (fleet.config().retry.min_retries_per_s * fleet.config().retry.window_s) as usize;
    let granted = (0..1000).filter(|_| fleet.try_retry(0.0)).count();
    assert_eq!(granted, floor);
}

#[test]
fn an_open_circuit_everywhere_is_held_and_released_when_a_request_finishes() {
    let mut b = FleetBuilder::new(1);
    b.config.outlier.max_inflight = 1;
    b.config.flow.max_requests = 2;
    b.config.flow.max_wait_s = 5.0;
    let mut fleet = b.build();
    let req = Req::new(&prompt(320, 1));
    let (_, first) = send(&mut fleet, &req, 0.0);
    // Saturated with an empty ranking: held, not refused.
    let plan = fleet.plan(&req.features(), 7, 0.0);
    assert!(plan.decision.ranking.is_empty());
    let Admission::Held(second) = fleet.admit(&plan, 0, 100, 0.0) else {
        panic!("a request meeting open circuit breakers everywhere is held");
    };
    let Admission::Held(third) = fleet.admit(&plan, 0, 100, 0.1) else {
        panic!("the queue has room for two");
    };
    assert_eq!(
        fleet.admit(&plan, 0, 100, 0.2),
        Admission::Shed(Shed::QueueFull)
    );
    assert!(matches!(
        fleet.poll_held(second, &req.features(), 0.5),
        HeldTurn::StillSaturated
    ));
    assert!(matches!(
        fleet.poll_held(third, &req.features(), 0.5),
        HeldTurn::Queued
    ));
    fleet.finished(first, None, 1.0);
    let HeldTurn::Route(plan) = fleet.poll_held(second, &req.features(), 1.0) else {
        panic!("released once the endpoint has room");
    };
    assert_eq!(plan.decision.chosen(), Some(EndpointId(0)));
    assert_eq!(fleet.flow().len(), 1, "the released request left the queue");
    let dispatched = fleet.dispatched(&plan.predicted_cached, &req.features(), EndpointId(0), 1.0);
    assert!(fleet.poll_held(third, &req.features(), 4.0).waits());
    assert!(matches!(
        fleet.poll_held(third, &req.features(), 5.1),
        HeldTurn::Shed(Shed::Timeout)
    ));
    assert!(fleet.flow().is_empty());
    fleet.finished(dispatched, None, 6.0);
}

#[test]
fn an_unsaturated_plan_routes_and_no_endpoint_is_refused() {
    let mut fleet = FleetBuilder::new(1).build();
    let req = Req::new(&prompt(320, 1));
    let plan = fleet.plan(&req.features(), 7, 0.0);
    assert_eq!(fleet.admit(&plan, 0, 100, 0.0), Admission::Route);
    let mut other = Req::new(&prompt(320, 1));
    other.model = "not-served";
    let plan = fleet.plan(&other.features(), 7, 0.0);
    assert_eq!(fleet.admit(&plan, 0, 100, 0.0), Admission::NoEndpoint);
    assert!(fleet.flow().is_empty());
}

#[test]
fn retries_only_retryable_failures_within_attempts_and_budget() {
    let mut b = FleetBuilder::new(2);
    b.config.retry.min_retries_per_s = 0.1;
    b.config.retry.window_s = 10.0;
    let mut fleet = b.build();
    assert_eq!(fleet.config().retry.attempts(5), 2);
    assert_eq!(fleet.config().retry.attempts(1), 1);
    assert_eq!(
        fleet.retry_verdict(AttemptFailure::Timeout, 0, 2, 0.0),
        RetryVerdict::NotRetryable
    );
    assert_eq!(
        fleet.retry_verdict(AttemptFailure::Connect, 1, 2, 0.0),
        RetryVerdict::LastAttempt
    );
    assert_eq!(
        fleet.retry_verdict(AttemptFailure::ServerError, 0, 2, 0.0),
        RetryVerdict::Retry
    );
    assert_eq!(
        fleet.retry_verdict(AttemptFailure::Connect, 0, 2, 0.0),
        RetryVerdict::BudgetSpent
    );
}

#[test]
fn the_passthrough_rotation_covers_every_available_endpoint_from_a_seeded_start() {
    let rotations = |seed| {
        let mut fleet = FleetBuilder::new(3).build();
        fleet.reseed(seed);
        assert!(fleet.remove_endpoint(EndpointId(1), 0.0));
        (0..8)
            .map(|_| fleet.passthrough_rotation(0.0))
            .collect::<Vec<_>>()
    };
    let drawn = rotations(42);
    assert_eq!(drawn, rotations(42), "the same seed, the same rotations");
    for r in &drawn {
        let mut sorted = r.clone();
        sorted.sort();
        assert_eq!(sorted, vec![EndpointId(0), EndpointId(2)]);
    }
    assert!(drawn.iter().any(|r| r[0] == EndpointId(0)));
    assert!(drawn.iter().any(|r| r[0] == EndpointId(2)));
}

/// On a fleet larger than the ranking, a routing plan ranks the best few (never fewer than the
/// retry policy's attempts) with the winner and head of the explain API's full ranking.
#[test]
fn a_routing_plan_ranks_the_head_of_the_full_ranking() {
    let mut builder = FleetBuilder::new(30);
    builder.config.retry.max_attempts = 12;
    let mut fleet = builder.build();
    let tokens = prompt(64, 5);
    let req = Req::new(&tokens);
    fleet.apply_events(EndpointId(7), &[stored(&tokens, BS)], 0.0);
    for random in 0..20 {
        let routed = fleet.plan(&req.features(), random, 1.0);
        let every = fleet.plan_every(&req.features(), random, 1.0);
        assert_eq!(
            routed.decision.ranking.len(),
            12,
            "the retry policy's attempts"
        );
        assert_eq!(every.decision.ranking.len(), 30);
        assert_eq!(
            routed.decision.chosen(),
            Some(EndpointId(7)),
            "the prefix's holder"
        );
        assert_eq!(routed.decision.ranking[..], every.decision.ranking[..12]);
        assert!(routed.facts.is_empty() && every.facts.len() == 30);
        assert_eq!(routed.predicted_cached, every.predicted_cached);
    }
}
