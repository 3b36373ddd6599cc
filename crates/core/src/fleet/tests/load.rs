//! Load and room: in-flight accounting, load samples and scrapes, queued prefills, and the
//! room a request needs beside the ones running.

use super::*;

#[test]
fn planning_alone_records_nothing() {
    let mut fleet = FleetBuilder::new(2).build();
    let req = Req::new(&prompt(320, 1));
    let plan = fleet.plan(&req.features(), 1, 0.0);
    assert!(plan.decision.chosen().is_some());
    assert!(
        fleet.history().is_empty(),
        "a refused connection must leave no history"
    );
    assert_eq!(fleet.endpoint(EndpointId(0)).unwrap().inflight(), 0);
    assert_eq!(fleet.endpoint(EndpointId(1)).unwrap().inflight(), 0);
}

/// An engine's gauges that are no finite count (`+Inf`, `NaN`) are taken as unreported: the
/// endpoint's costs stay numbers, and it does not win (or lose) a ranking by a NaN.
#[test]
fn load_gauges_that_are_not_finite_are_not_taken() {
    let mut fleet = FleetBuilder::new(2).build();
    let a = prompt(1600, 1);
    fleet.apply_events(EndpointId(0), &[stored(&a, BS)], 0.0);
    let broken = LoadSample {
        waiting: Some(f64::INFINITY),
        running: Some(f64::NAN),
        kv_usage: Some(f64::INFINITY),
        num_gpu_blocks: Some(100),
    };
    fleet.observe_load(EndpointId(0), broken, 0.0);
    let plan = fleet.plan_every(&Req::new(&a).features(), 1, 0.0);
    for e in 0..2 {
        let cost = &plan.decision.assessment(EndpointId(e)).unwrap().cost;
        assert!(cost.total_s.is_finite(), "endpoint {e}: {cost:?}");
    }
    assert_eq!(
        plan.decision.chosen(),
        Some(EndpointId(0)),
        "it holds the prompt"
    );
}

#[test]
fn queued_prefill_counts_the_cached_prefix_the_queue_ahead_evicts() {
    // A full 100-block cache holding prefix A, and a 100-block uncached prefill in flight
    // ahead: by the time the engine admits a request on A, A is evicted (an engine looks the
    // prefix up at admission), so the request's whole prompt is queued work.
    let mut fleet = FleetBuilder::new(1).build();
    let sample = gauges(0.0, 0.0, 1.0, 100);
    fleet.observe_load(EndpointId(0), sample, 0.0);
    let a = prompt(1600, 1);
    fleet.apply_events(EndpointId(0), &[stored(&a, BS)], 0.0);
    let (_, ahead) = send(&mut fleet, &Req::new(&prompt(1600, 2)), 0.0);
    assert_eq!(ahead.uncached_tokens, 1600);
    let with_question = |salt| {
        let mut tokens = a.clone();
        tokens.extend(prompt(160, salt));
        Req::new(&tokens)
    };
    let (plan, on_a) = send(&mut fleet, &with_question(3), 0.1);
    assert_eq!(plan.predicted_cached[0], 1600, "the index holds A");
    assert_eq!(on_a.uncached_tokens, 1760);
    // A request on A sent after it: A is now in use by the one ahead, which keeps it cached.
    let (_, next) = send(&mut fleet, &with_question(4), 0.2);
    assert_eq!(next.uncached_tokens, 160);
}

#[test]
fn in_flight_accounting_returns_to_zero() {
    let mut fleet = FleetBuilder::new(2).build();
    let req = Req::new(&prompt(1000, 1));
    let (_, mut d) = send(&mut fleet, &req, 0.0);
    let e = d.endpoint;
    let load = fleet.load(e, 0.0).unwrap();
    assert_eq!((load.inflight, load.inflight_prefills), (1, 1));
    assert_eq!(load.inflight_prefill_tokens, 1000);
    fleet.first_token(&mut d, true, 0.05);
    fleet.first_token(&mut d, true, 0.06); // idempotent
    let load = fleet.load(e, 0.05).unwrap();
    assert_eq!(
        (
            load.inflight,
            load.inflight_prefills,
            load.inflight_prefill_tokens
        ),
        (1, 0, 0)
    );
    fleet.finished(d, Some(0), 0.5);
    let load = fleet.load(e, 0.5).unwrap();
    assert_eq!(
        (
            load.inflight,
            load.inflight_prefills,
            load.inflight_prefill_tokens
        ),
        (0, 0, 0)
    );
}

#[test]
fn stale_load_samples_are_ignored() {
    let mut fleet = FleetBuilder::new(1).build();
    let sample = gauges(3.0, 5.0, 0.5, 1000);
    fleet.observe_load(EndpointId(0), sample, 10.0);
    assert_eq!(fleet.load(EndpointId(0), 11.0).unwrap().waiting, Some(3.0));
    let max_age = fleet.config().load_sample_max_age_s;
    assert_eq!(
        fleet
            .load(EndpointId(0), 10.0 + max_age + 1.0)
            .unwrap()
            .waiting,
        None
    );
}

/// The router counts its own requests as they change; a scrape counts everyone's, and ages.
/// Between two scrapes only what the router cannot see (another client's requests) keeps the
/// scrape's value: its own queue that drained since is not counted as still waiting, and its
/// own requests sent since are not missed.
#[test]
fn a_load_sample_ages_only_in_what_the_router_cannot_see() {
    let mut fleet = FleetBuilder::new(1).build();
    let e = EndpointId(0);
    let (_, mut first) = send(&mut fleet, &Req::new(&prompt(320, 1)), 0.0);
    let (_, mut second) = send(&mut fleet, &Req::new(&prompt(320, 2)), 0.0);
    let (_, mut third) = send(&mut fleet, &Req::new(&prompt(320, 3)), 0.0);
    fleet.first_token(&mut third, true, 0.05);
    // Its two requests wait beside another client's one; its third decodes beside two others.
    let sample = gauges(3.0, 3.0, 0.5, 1000);
    fleet.observe_load(e, sample, 0.1);
    let counts = |fleet: &Fleet, now| {
        let load = fleet.load(e, now).unwrap();
        (load.queue(), load.decoding())
    };
    assert_eq!(counts(&fleet, 0.1), (3.0, 3.0));
    // Its two start decoding: what waits is the other client's one.
    fleet.first_token(&mut first, true, 0.2);
    fleet.first_token(&mut second, true, 0.2);
    assert_eq!(counts(&fleet, 0.2), (1.0, 5.0));
    // Its three end: the other client's requests are still there until a scrape says not.
    for d in [first, second, third] {
        fleet.finished(d, Some(0), 0.3);
    }
    assert_eq!(counts(&fleet, 0.3), (1.0, 2.0));
    // One it sends now counts at once.
    send(&mut fleet, &Req::new(&prompt(320, 4)), 0.4);
    assert_eq!(counts(&fleet, 0.4), (2.0, 2.0));
}

/// A scrape's answer says how the engine stood at some moment after it was asked: requests of
/// the router's that left a stage while it was on its way may be in its counts. They are not
/// read as another client's load (a conversation's turn that just ended would otherwise push
/// its next turn off its cache until the next scrape), while another client's still are.
#[test]
fn a_request_that_ends_while_a_scrape_is_on_its_way_is_not_read_as_another_clients() {
    let mut fleet = FleetBuilder::new(1).build();
    let e = EndpointId(0);
    let (_, mut turn) = send(&mut fleet, &Req::new(&prompt(320, 1)), 0.0);
    let (_, mut waiting) = send(&mut fleet, &Req::new(&prompt(320, 2)), 0.0);
    fleet.first_token(&mut turn, true, 0.05);
    // Asked at 0.1; one request ends and the other gets its first token before the answer,
    // which counts both as they were, beside another client's waiting and running ones.
    let since = fleet.load_mark(e, 0.1);
    fleet.finished(turn, Some(0), 0.12);
    fleet.first_token(&mut waiting, true, 0.13);
    let sample = gauges(2.0, 2.0, 0.5, 1000);
    fleet.observe_scraped_load(e, sample, since);
    let load = fleet.load(e, 0.14).unwrap();
    assert_eq!(
        (load.queue(), load.decoding()),
        (1.0, 2.0),
        "the other client's waiting and running requests, and the router's one decoding"
    );
    // Read as of its answer, the ended request would have been another client's: a phantom
    // waiting one (others' total 3, of which the engine's 2 waiting).
    fleet.observe_load(e, sample, 0.14);
    let load = fleet.load(e, 0.14).unwrap();
    assert_eq!((load.queue(), load.decoding()), (2.0, 2.0));
    // Its age runs from when it was asked.
    let max_age = fleet.config().load_sample_max_age_s;
    fleet.observe_scraped_load(e, sample, since);
    assert_eq!(fleet.load(e, 0.1 + max_age + 0.01).unwrap().waiting, None);
}

/// An endpoint a scrape found saturated by the router's own queue opens as soon as that queue
/// leaves prefill, not when the scrape expires (seconds later, with the engine running dry).
#[test]
fn a_queue_a_scrape_saw_full_opens_when_the_routers_own_requests_leave_it() {
    let mut fleet = FleetBuilder::new(1).build();
    let e = EndpointId(0);
    let threshold = fleet.profile().saturation.queue as u32;
    let mut queued: Vec<Dispatch> = (0..threshold)
        .map(|i| send(&mut fleet, &Req::new(&prompt(320, i)), 0.0).1)
        .collect();
    let sample = LoadSample {
        waiting: Some(f64::from(threshold)),
        running: Some(0.0),
        kv_usage: Some(0.5),
        num_gpu_blocks: Some(1000),
    };
    fleet.observe_load(e, sample, 0.1);
    let next = Req::new(&prompt(320, 99));
    assert!(fleet.plan(&next.features(), 1, 0.1).decision.saturated);
    for d in &mut queued {
        fleet.first_token(d, true, 0.2);
    }
    assert!(
        !fleet.plan(&next.features(), 1, 0.2).decision.saturated,
        "the queue the scrape saw has left"
    );
}

/// 150-block caches; on `busy`, a first request decoded for 0.4 s (the decode time it learns,
/// with no output counted), and a 100-block request runs from 1.0, expected to end at 1.4 (101
/// blocks pinned, 49 free). Returns that request.
fn running_until_1_4_s(fleet: &mut Fleet, busy: EndpointId) -> Dispatch {
    scrape_idle(fleet, 150);
    let mut first = send_to(fleet, &Req::new(&prompt(160, 1)), busy, 0.0);
    fleet.first_token(&mut first, true, 0.1);
    fleet.finished(first, Some(0), 0.5);
    let mut running = send_to(fleet, &Req::new(&prompt(1_600, 2)), busy, 0.9);
    fleet.first_token(&mut running, true, 1.0);
    running
}

/// An engine admits a request only when its blocks fit beside those its running requests
/// pin: one whose cache a running request fills waits for that request's decode to end, and
/// the plan says so in its queue term (and sends it where it fits).
#[test]
fn a_request_that_does_not_fit_beside_running_ones_waits_for_their_end() {
    let mut fleet = FleetBuilder::new(2).build();
    let (busy, idle) = (EndpointId(0), EndpointId(1));
    let running = running_until_1_4_s(&mut fleet, busy);
    let plan = fleet.plan(&Req::new(&prompt(1_600, 3)).features(), 7, 1.1);
    // Its first token comes a whole prefill after that end: its 1,600 tokens are one chunk
    // (the engines' default 8,192 a step), which vLLM admits only once all of it fits.
    let cost = &plan.decision.assessment(busy).unwrap().cost;
    assert!(
        cost.queue_s >= 0.3 - 1e-9 && cost.room_prefilled_s == 0.0,
        "waits for the running request's end: {cost:?}"
    );
    assert_eq!(plan.decision.chosen(), Some(idle));
    // Once it ended, nothing is in the way.
    fleet.finished(running, Some(0), 1.2);
    let plan = fleet.plan(&Req::new(&prompt(1_600, 3)).features(), 7, 1.2);
    assert!(plan.decision.assessment(busy).unwrap().cost.queue_s < 0.05);
}

/// The engines' chunk (`prefill_chunk_tokens`) is what the plan counts as prefilled during a
/// wait for room: with chunks of 512 tokens (32 blocks), one of them fits in the 49 blocks a
/// running request leaves free, so 32 of the new request's 100 blocks are prefilled before
/// that request ends.
#[test]
fn the_configured_chunk_is_what_a_plan_counts_as_prefilled_during_the_wait() {
    let mut builder = FleetBuilder::new(1);
    builder.config.prefill_chunk_tokens = 512;
    let mut fleet = builder.build();
    let busy = EndpointId(0);
    running_until_1_4_s(&mut fleet, busy);
    let plan = fleet.plan(&Req::new(&prompt(1_600, 3)).features(), 7, 1.1);
    let cost = &plan.decision.assessment(busy).unwrap().cost;
    assert!((cost.room_wait_s - 0.3).abs() < 1e-9, "{cost:?}");
    assert!(
        (cost.room_prefilled_s - 0.32 * cost.prefill_s).abs() < 1e-9,
        "{cost:?}"
    );
}

#[test]
fn a_request_goes_where_the_traffic_fits_beside_it_not_where_it_holds_others_back() {
    // 150-block caches; two tenants' 100-block contexts, which do not fit in one together.
    // Endpoint 0 serves tenant A's questions, endpoint 1 tenant B's, ten a second each;
    // endpoint 0 holds B's context in CPU memory too.
    let mut fleet = FleetBuilder::new(2).build();
    let (serves_a, serves_b) = (EndpointId(0), EndpointId(1));
    scrape_idle(&mut fleet, 150);
    let (context_a, context_b) = (prompt(1_600, 1), prompt(1_600, 2));
    let question = |context: &[u32], q: u32| {
        let mut tokens = context.to_vec();
        tokens.extend(prompt(40, 100 + q));
        Req::new(&tokens)
    };
    for (endpoint, context) in [(serves_a, &context_a), (serves_b, &context_b)] {
        fleet.apply_events(endpoint, &[stored(context, BS)], 0.0);
    }
    fleet.apply_events(serves_a, &offloaded_only(&context_b, "CPU"), 0.0);
    for q in 0..10 {
        let at = f64::from(q) * 0.1;
        for (endpoint, context) in [(serves_a, &context_a), (serves_b, &context_b)] {
            let mut d = send_to(&mut fleet, &question(context, q), endpoint, at);
            fleet.first_token(&mut d, true, at + 0.02);
            fleet.finished(d, Some(1_600), at + 0.07);
        }
    }
    // Twelve of B's questions decode on endpoint 1: endpoint 0 is idle, and a load from CPU
    // memory stalls no decode there; but B's context, loaded there, pushes A's out of its
    // GPU memory, and A's questions, coming there at ten a second, would wait for it.
    for q in 10..22 {
        let mut decoding = send_to(&mut fleet, &question(&context_b, q), serves_b, 1.0);
        fleet.first_token(&mut decoding, true, 1.02);
    }
    let plan = fleet.plan(&question(&context_b, 99).features(), 7, 1.03);
    let cost = |e: EndpointId| plan.decision.assessment(e).unwrap().cost.clone();
    let (a, b) = (cost(serves_a), cost(serves_b));
    assert!(a.room_blocking_s > 0.0, "{a:?}");
    assert_eq!(b.room_blocking_s, 0.0, "B's questions fit beside it: {b:?}");
    // Endpoint 1 holds B's context on its GPU: a second GPU copy pays for what it evicts (its
    // 100 blocks and the question's, beyond the 50 free). Either charge alone sends the
    // question to endpoint 1 (every weight is 1); without both, endpoint 0 would take it.
    assert!(a.evicted_blocks > 50.0 && a.eviction_s > 0.0, "{a:?}");
    assert!(a.total_s - a.eviction_s > b.total_s, "{a:?} {b:?}");
    assert!(a.total_s - a.room_blocking_s > b.total_s, "{a:?} {b:?}");
    assert!(
        a.total_s - a.room_blocking_s - a.eviction_s < b.total_s,
        "{a:?} {b:?}"
    );
    assert_eq!(plan.decision.chosen(), Some(serves_b));
}

/// A load from CPU memory is a second GPU copy only where the GPU copy is on an endpoint that
/// could serve the request: one serving another model (the router keys name no model) leaves
/// the load priced as a block found cached.
#[test]
fn only_an_endpoint_that_could_serve_the_request_makes_a_reload_a_second_copy() {
    for serves in [true, false] {
        let mut builder = FleetBuilder::new(2);
        if !serves {
            builder.specs[1].models = vec!["another".into()];
        }
        let mut fleet = builder.build();
        scrape_idle(&mut fleet, 150);
        // Endpoint 0: 140 of its 150 blocks hold another prompt; the context (100 blocks) only
        // in CPU memory. Endpoint 1: the context on its GPU.
        let (context, filler) = (prompt(1_600, 1), prompt(2_240, 2));
        fleet.apply_events(EndpointId(0), &[stored(&filler, BS)], 0.0);
        fleet.apply_events(EndpointId(0), &offloaded_only(&context, "CPU"), 0.0);
        fleet.apply_events(EndpointId(1), &[stored(&context, BS)], 0.0);
        let mut tokens = context.clone();
        tokens.extend(prompt(40, 9));
        let plan = fleet.plan(&Req::new(&tokens).features(), 7, 0.1);
        let a = plan
            .decision
            .assessment(EndpointId(0))
            .unwrap()
            .cost
            .clone();
        assert!(a.tier_load_s > 0.0, "{a:?}");
        if serves {
            assert!(a.evicted_blocks > 90.0, "the load evicts: {a:?}");
        } else {
            assert!(a.evicted_blocks < 10.0, "only the question's blocks: {a:?}");
        }
    }
}

/// A sample dates from when its scrape was sent. Answers that each take the whole timeout, the
/// next sent at the following interval, must leave no gap in which the load reads unknown; with
/// fast scrapes four missed intervals and a second of slack still bound it.
#[test]
fn a_load_sample_lives_from_one_answer_within_the_timeout_to_the_next() {
    for (interval, timeout) in [(0.5, 2.0), (0.1, 1.5), (1.0, 0.0), (0.2, 0.05)] {
        let max_age = FleetConfig::load_sample_max_age_for(interval, timeout);
        // Sent at 0, answered at `timeout`; the next sent one interval later, answered at the
        // deadline again.
        let next_answer = timeout + interval + timeout;
        assert!(max_age >= next_answer, "{interval} {timeout}: {max_age}");
        assert!(
            max_age >= 4.0 * interval + 1.0,
            "{interval} {timeout}: {max_age}"
        );
    }
    // Not looser than it needs to be where the scrapes are fast.
    assert_eq!(FleetConfig::load_sample_max_age_for(0.5, 0.0), 3.0);
}
