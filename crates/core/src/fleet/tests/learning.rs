//! What the fleet learns from its requests: prefill rates (an endpoint's own and its model's
//! pool's), first tokens checked against the plan's prediction, and the block reuse that
//! prices evictions.

use super::*;

/// The first token of a request dispatched with its plan's prediction is reported beside it,
/// once, and only for a successful response.
#[test]
fn the_first_token_is_checked_against_the_plans_prediction_once() {
    let mut fleet = FleetBuilder::new(2).build();
    let req = Req::new(&prompt(1000, 1));
    let (plan, mut d) = send(&mut fleet, &req, 1.0);
    let predicted = plan
        .decision
        .assessment(d.endpoint)
        .unwrap()
        .predicted_ttft_s;
    assert!(predicted > 0.0, "a 1,000-token prefill takes time");
    d.predicted_ttft_s = Some(predicted);
    let check = fleet.first_token(&mut d, true, 1.25).unwrap();
    assert_eq!(check.predicted_s, predicted);
    assert!((check.measured_s - 0.25).abs() < 1e-12, "{check:?}");
    assert!((check.error_s() - (0.25 - predicted)).abs() < 1e-12);
    assert_eq!(fleet.first_token(&mut d, true, 1.5), None, "told once");

    let (_, mut failed) = send(&mut fleet, &Req::new(&prompt(1000, 2)), 2.0);
    failed.predicted_ttft_s = Some(predicted);
    assert_eq!(
        fleet.first_token(&mut failed, false, 2.1),
        None,
        "an error is no measure"
    );
    let (_, mut unplanned) = send(&mut fleet, &Req::new(&prompt(1000, 3)), 3.0);
    assert_eq!(
        fleet.first_token(&mut unplanned, true, 3.1),
        None,
        "nothing predicted"
    );
}

#[test]
fn the_prefill_rate_is_learned_from_uncontended_prefills_only() {
    let mut fleet = FleetBuilder::new(1).build();
    let (_, mut first) = send(&mut fleet, &Req::new(&prompt(1000, 1)), 0.0);
    let (_, mut second) = send(&mut fleet, &Req::new(&prompt(1000, 2)), 0.0);
    fleet.first_token(&mut first, true, 0.1); // 10k tokens/s, alone
    fleet.first_token(&mut second, true, 1.0); // queued behind the first: not a rate sample
    let rate = fleet
        .endpoint(EndpointId(0))
        .unwrap()
        .observed_prefill_rate();
    assert_eq!(rate, Some(10_000.0));
}

/// The rate each endpoint is costed at now.
fn costed_rates(fleet: &mut Fleet, now: f64) -> Vec<f64> {
    let plan = fleet.plan_every(&Req::new(&prompt(64, 999)).features(), 7, now);
    plan.facts.iter().map(|f| f.prefill_tokens_per_s).collect()
}

#[test]
fn a_new_endpoint_is_costed_at_its_own_models_rate() {
    // One router in front of two pools: a small model's engines prefill ten times faster than
    // a big model's. A big-model endpoint with no sample of its own must not be priced at
    // what the small ones measure.
    let mut builder = FleetBuilder::new(0);
    builder.specs = ["small", "big", "big", "small"]
        .iter()
        .enumerate()
        .map(|(i, model)| EndpointSpec {
            models: vec![(*model).into()],
            ..spec(&format!("e{i}"), BS)
        })
        .collect();
    let mut fleet = builder.build();
    let asking = |model: &'static str, salt: u32| Req {
        model,
        ..Req::new(&prompt(1000, salt))
    };
    let mut small = send_to(&mut fleet, &asking("small", 1), EndpointId(0), 0.0);
    fleet.first_token(&mut small, true, 0.01); // 100k tokens/s, alone
    let mut big = send_to(&mut fleet, &asking("big", 2), EndpointId(1), 0.0);
    fleet.first_token(&mut big, true, 0.1); // 10k tokens/s, alone
    let plan = fleet.plan_every(&asking("big", 3).features(), 7, 0.2);
    let rates: Vec<f64> = plan.facts.iter().map(|f| f.prefill_tokens_per_s).collect();
    assert_eq!(rates[1], 10_000.0);
    assert_eq!(
        rates[2], 10_000.0,
        "the new big endpoint takes the big pool's rate: {rates:?}"
    );
    // And a small-model request prices a new small endpoint at the small pool's.
    let plan = fleet.plan_every(&asking("small", 4).features(), 7, 0.2);
    assert_eq!(plan.facts[3].prefill_tokens_per_s, 100_000.0);
}

#[test]
fn a_busy_endpoints_frozen_prefill_rate_fades_into_the_fleets() {
    // The heavy multi-turn load's failure: e0 was judged fast by one lucky uncontended
    // prefill, then stayed busy, so its rate was never read again and it kept getting work.
    let mut fleet = FleetBuilder::new(2).build();
    let mut lucky = send_to(&mut fleet, &Req::new(&prompt(1000, 1)), EndpointId(0), 0.0);
    fleet.first_token(&mut lucky, true, 0.025); // 40k tokens/s, alone
    let mut plain = send_to(&mut fleet, &Req::new(&prompt(1000, 2)), EndpointId(1), 0.0);
    fleet.first_token(&mut plain, true, 0.1); // 10k tokens/s, alone
    // Fresh samples: a mixed fleet keeps its engines apart, each as far from the pool (25k) as
    // its one sample is credible (half).
    assert_eq!(costed_rates(&mut fleet, 0.2), vec![32_500.0, 17_500.0]);
    // A long prefill keeps e0 busy: everything sent there meanwhile runs beside it.
    let mut blocker = send_to(&mut fleet, &Req::new(&prompt(1000, 3)), EndpointId(0), 1.0);
    let mut now = 1.0;
    for i in 0..40 {
        // Two more prefills beside it: neither says anything of e0's rate.
        let mut a = send_to(
            &mut fleet,
            &Req::new(&prompt(1000, 10 + 2 * i)),
            EndpointId(0),
            now,
        );
        let mut b = send_to(
            &mut fleet,
            &Req::new(&prompt(1000, 11 + 2 * i)),
            EndpointId(0),
            now,
        );
        fleet.first_token(&mut a, true, now + 0.1);
        fleet.first_token(&mut b, true, now + 0.2);
        fleet.finished(a, None, now + 0.3);
        fleet.finished(b, None, now + 0.3);
        now += 1.0;
    }
    fleet.first_token(&mut blocker, false, now);
    fleet.finished(blocker, None, now);
    let rates = costed_rates(&mut fleet, now);
    // 80 unread samples: e0's own estimate keeps 0.9^80 of its weight.
    assert!((rates[0] - 10_000.0).abs() < 100.0, "{rates:?}");
    assert!((rates[1] - 10_000.0).abs() < 100.0, "{rates:?}");
    // One uncontended prefill on e0 brings its own rate back (two samples: two thirds of it).
    let mut alone = send_to(
        &mut fleet,
        &Req::new(&prompt(1000, 500)),
        EndpointId(0),
        now,
    );
    fleet.first_token(&mut alone, true, now + 0.025);
    let fresh = costed_rates(&mut fleet, now + 0.1)[0];
    assert!(fresh > 35_000.0, "{fresh}");
}

#[test]
fn a_first_token_fast_from_a_prefix_the_router_did_not_know_is_corrected_at_its_end() {
    // e0 learned 10k tokens/s; then a 1,000-token prompt it predicted uncached answers in
    // 10 ms: the engine had 960 tokens cached (another router's traffic), which it says at
    // the end. Read as 100k tokens/s at the first token, the sample becomes what it was.
    let mut fleet = FleetBuilder::new(1).build();
    let mut first = send_to(&mut fleet, &Req::new(&prompt(1000, 1)), EndpointId(0), 0.0);
    fleet.first_token(&mut first, true, 0.1);
    fleet.finished(first, Some(0), 0.2);
    let rate = |fleet: &Fleet| {
        fleet
            .endpoint(EndpointId(0))
            .unwrap()
            .observed_prefill_rate()
    };
    assert_eq!(rate(&fleet), Some(10_000.0));
    let mut lucky = send_to(&mut fleet, &Req::new(&prompt(1000, 2)), EndpointId(0), 1.0);
    fleet.first_token(&mut lucky, true, 1.01);
    let inflated = rate(&fleet).unwrap();
    assert!(inflated > 18_000.0, "{inflated}");
    // One more sample before it ends: the correction reaches through it.
    let mut next = send_to(&mut fleet, &Req::new(&prompt(1000, 3)), EndpointId(0), 2.0);
    fleet.first_token(&mut next, true, 2.1);
    fleet.finished(lucky, Some(960), 2.2);
    let corrected = rate(&fleet).unwrap();
    assert!((corrected - 10_000.0).abs() < 1e-6, "{corrected}");
    // A request whose engine found what the router predicted changes nothing at its end.
    fleet.finished(next, Some(0), 2.3);
    assert!((rate(&fleet).unwrap() - 10_000.0).abs() < 1e-6);
}

proptest::proptest! {
    /// Correcting a sample at a request's end gives the mean that reading it right at its
    /// first token would have given, whatever samples came between.
    #[test]
    fn a_corrected_prefill_sample_is_the_sample_read_right(
        first in 1_000.0f64..100_000.0,
        later in proptest::collection::vec(1_000.0f64..100_000.0, 0..12),
        assumed in 256u64..20_000,
        computed in 0u64..20_000,
        seconds in 0.01f64..2.0,
    ) {
        let mut wrong = EndpointState::new(EndpointId(0), spec("e", BS));
        let mut right = EndpointState::new(EndpointId(0), spec("e", BS));
        for e in [&mut wrong, &mut right] {
            e.note_prefill(10_000, 10_000.0 / first, true);
        }
        let sample = wrong.note_prefill(assumed, seconds, true).unwrap();
        // Read right: the tokens it computed, or nothing read when too few.
        let before = right.observed_prefill_rate().unwrap();
        if right.note_prefill(computed, seconds, true).is_none() {
            right.note_prefill(10_000, 10_000.0 / before, true);
        }
        for rate in &later {
            for e in [&mut wrong, &mut right] {
                e.note_prefill(10_000, 10_000.0 / rate, true);
            }
        }
        wrong.correct_prefill(sample, computed);
        let (w, r) = (wrong.observed_prefill_rate().unwrap(), right.observed_prefill_rate().unwrap());
        proptest::prop_assert!((w - r).abs() <= 1e-9 * r.max(1.0), "{} against {}", w, r);
    }

    #[test]
    fn a_costed_prefill_rate_moves_from_its_own_toward_the_pool_by_the_samples_missed(
        own in 1_000.0f64..100_000.0,
        pooled in 1_000.0f64..100_000.0,
        samples in 1u32..20,
        missed in 0u32..200,
    ) {
        let mut e = EndpointState::new(EndpointId(0), spec("e", BS));
        for _ in 0..samples {
            e.note_prefill(10_000, 10_000.0 / own, true);
        }
        for _ in 0..missed {
            e.note_prefill(10_000, 1.0, false);
        }
        let costed = e.prefill_rate_toward(pooled);
        // As far from the pool as its samples are credible, and its missed ones leave it.
        let credible = f64::from(samples) / (f64::from(samples) + 1.0);
        let kept = credible * (1.0 - PREFILL_RATE_SAMPLE_WEIGHT).powi(missed as i32);
        proptest::prop_assert!((costed - pooled).abs() <= kept * (own - pooled).abs() + 1e-6);
        proptest::prop_assert!(costed >= own.min(pooled) - 1e-6 && costed <= own.max(pooled) + 1e-6);
        if missed == 0 {
            proptest::prop_assert!((costed - pooled).abs() >= kept * (own - pooled).abs() - 1e-6);
        }
    }
}

/// An endpoint that has stored less than a cache's worth has had nothing evicted, so its own
/// hits per stored block do not yet measure reuse before eviction: its estimate starts at the
/// fleet's and moves to its own as it stores caches' worth.
#[test]
fn an_endpoints_block_reuse_starts_at_the_fleets() {
    let mut reuse = block_reuse::BlockReuse::default();
    assert_eq!(reuse.per_evicted_block_toward(0.8, Some(100), 0.0), 0.8);
    // A new tenant's first questions find nothing.
    reuse.note(0.0, 100.0, 0.0);
    assert!((reuse.per_evicted_block_toward(0.8, Some(100), 0.0) - 0.4).abs() < 1e-12);
    for _ in 0..9 {
        reuse.note(0.0, 100.0, 0.0);
    }
    // Ten caches' worth stored and never reused: its own measure (0) dominates.
    let own = reuse.per_evicted_block_toward(0.8, Some(100), 0.0);
    assert!((own - 80.0 / 1_100.0).abs() < 1e-12, "{own}");
    // Its stores fade with time, and the fleet's figure returns.
    let later = reuse.per_evicted_block_toward(0.8, Some(100), 10.0 * block_reuse::REUSE_TAU_S);
    assert!(later > 0.79, "{later}");
    // Without a capacity there is no cache's worth to measure by: its own figure.
    assert_eq!(reuse.per_evicted_block_toward(0.8, None, 0.0), 0.0);
}

/// The fleet's figure reaches a plan: a full endpoint whose own requests never found anything
/// cached still charges what a placement evicts there at the reuse the fleet measures.
#[test]
fn a_new_endpoints_evictions_are_priced_at_the_fleets_reuse() {
    let mut fleet = FleetBuilder::new(2).build();
    scrape_idle(&mut fleet, 100);
    // Endpoint 0's requests keep finding a 50-block context: the fleet measures reuse.
    let context = prompt(800, 1);
    fleet.apply_events(EndpointId(0), &[stored(&context, BS)], 0.0);
    for question in 0..4 {
        let mut tokens = context.clone();
        tokens.extend(prompt(160, 10 + question));
        let d = send_to(&mut fleet, &Req::new(&tokens), EndpointId(0), 0.1);
        fleet.finished(d, None, 0.2);
    }
    // Endpoint 1 is 90 blocks full, and none of its requests has found anything cached.
    fleet.apply_events(EndpointId(1), &[stored(&prompt(1440, 2), BS)], 0.3);
    // A 40-block prompt held nowhere stores 30 blocks past endpoint 1's 10 free ones.
    let plan = fleet.plan(&Req::new(&prompt(640, 3)).features(), 7, 0.4);
    let full = plan.decision.assessment(EndpointId(1)).unwrap();
    assert_eq!(full.cost.evicted_blocks, 30.0);
    assert!(full.cost.eviction_s > 0.0, "{:?}", full.cost);
}

#[test]
fn a_models_evictions_are_priced_at_its_own_reuse() {
    // e0 and e1 serve model "a" and its adapter, e2 model "b"; e1 and e2 are new and full.
    let mut builder = FleetBuilder::new(0);
    builder.specs = [&["a", "a-lora"][..], &["a", "a-lora"], &["b"]]
        .iter()
        .enumerate()
        .map(|(i, models)| EndpointSpec {
            models: models.iter().map(|m| (*m).into()).collect(),
            ..spec(&format!("e{i}"), BS)
        })
        .collect();
    let mut fleet = builder.build();
    scrape_idle(&mut fleet, 100);
    let asking = |model: &'static str, tokens: &[u32]| Req {
        model,
        ..Req::new(tokens)
    };
    // Model a's requests keep finding a 50-block context on e0: its reuse is measured.
    let context = prompt(800, 1);
    fleet.apply_events(EndpointId(0), &[stored(&context, BS)], 0.0);
    for question in 0..4 {
        let mut tokens = context.clone();
        tokens.extend(prompt(160, 10 + question));
        let d = send_to(&mut fleet, &asking("a", &tokens), EndpointId(0), 0.1);
        fleet.finished(d, None, 0.2);
    }
    for e in [1, 2] {
        fleet.apply_events(EndpointId(e), &[stored(&prompt(1440, e), BS)], 0.3);
    }
    // A 40-block prompt held nowhere stores 30 blocks past 10 free ones, on either.
    let eviction = |fleet: &mut Fleet, model: &'static str, e: u32| {
        let plan = fleet.plan(&asking(model, &prompt(640, 3)).features(), 7, 0.4);
        let cost = plan
            .decision
            .assessment(EndpointId(e))
            .unwrap()
            .cost
            .clone();
        assert_eq!(cost.evicted_blocks, 30.0);
        cost.eviction_s
    };
    assert!(
        eviction(&mut fleet, "a", 1) > 0.0,
        "a's reuse prices e1's evictions"
    );
    assert!(
        eviction(&mut fleet, "a-lora", 1) > 0.0,
        "an adapter shares its base's"
    );
    assert_eq!(
        eviction(&mut fleet, "b", 2),
        0.0,
        "nothing measured of b: a's reuse does not price it"
    );
}
