//! Which candidates a decision keeps: the filters (health, model, queue and KV-cache limits),
//! ejected endpoints and open circuits, and when the fleet counts as saturated.

use super::*;

#[test]
fn filters_remove_unhealthy_wrong_model_and_full_endpoints() {
    let mut cands = fleet(5);
    cands[0].healthy = false;
    cands[1].serves_model = false;
    cands[2].load.waiting = Some(50.0);
    cands[3].load.kv_usage = Some(0.99);
    let mut profile = Profile::default();
    profile.filters.max_waiting = Some(10.0);
    profile.filters.max_kv_usage = Some(0.95);
    let d = schedule(&profile, &request(100), &cands, 1, 0);
    assert_eq!(d.ranking, vec![EndpointId(4)]);
    assert_eq!(d.reason, Reason::OnlyCandidate);
    let reasons: Vec<_> = d.assessments.iter().map(|a| a.rejected).collect();
    assert_eq!(
        reasons,
        vec![
            Some(Rejection::Unhealthy),
            Some(Rejection::WrongModel),
            Some(Rejection::QueueFull),
            Some(Rejection::KvCacheFull),
            None
        ]
    );
    let none = schedule(&profile, &request(100), &cands[..4], 1, 0);
    assert_eq!(none.chosen(), None);
    assert_eq!(none.reason, Reason::NoCandidate);
    // Those left out for their load may take it later: flow control may hold the request.
    assert!(none.saturated);
    // Those that cannot serve it whatever their load leave nothing to wait for.
    let never = schedule(&profile, &request(100), &cands[..2], 1, 0);
    assert_eq!(never.chosen(), None);
    assert!(!never.saturated);
}

#[test]
fn saturation_is_reported_only_when_every_competitor_is_saturated() {
    let mut cands = fleet(2);
    cands[0].load.waiting = Some(10.0);
    let d = schedule(&Profile::default(), &request(100), &cands, 0, 0);
    assert!(!d.saturated);
    cands[1].load.kv_usage = Some(0.99);
    cands[1].load.waiting = Some(1.0);
    let d = schedule(&Profile::default(), &request(100), &cands, 0, 0);
    assert!(d.saturated);
}

#[test]
fn ejected_endpoints_are_filtered_and_open_circuits_saturate() {
    let mut cands = fleet(3);
    cands[0].ejected = true;
    cands[1].circuit_open = true;
    let d = schedule(&Profile::default(), &request(100), &cands, 1, 0);
    assert_eq!(d.ranking, vec![EndpointId(2)]);
    let reasons: Vec<_> = d.assessments.iter().map(|a| a.rejected).collect();
    assert_eq!(
        reasons,
        vec![Some(Rejection::Ejected), Some(Rejection::CircuitOpen), None]
    );
    assert!(!d.saturated);
    // Nothing left but an open circuit: the request may wait for it.
    let held = schedule(&Profile::default(), &request(100), &cands[..2], 1, 0);
    assert_eq!(held.chosen(), None);
    assert!(held.saturated);
}
