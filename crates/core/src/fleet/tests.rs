//! Decision tests with a manual clock and no sockets: the fleet is fed observations as the
//! router would feed them, and its plans are checked.

use super::*;
use crate::event::{BlockStored, EngineHash, KvEvent};
use crate::index::{EndpointRestore, HeldEntry, KeyLayout};
use crate::keys::router_keys;
use crate::load_counters::TierLoadCounters;
use crate::schedule::{ProfileName, Reason};

const BS: usize = 16;
const MODEL: &str = "m";

/// A fleet under construction.
struct FleetBuilder {
    specs: Vec<EndpointSpec>,
    config: FleetConfig,
    profile: Profile,
}

impl FleetBuilder {
    fn new(endpoints: usize) -> Self {
        Self {
            specs: (0..endpoints).map(|i| spec(&format!("e{i}"), BS)).collect(),
            config: FleetConfig::default(),
            profile: Profile::default(),
        }
    }

    fn build(self) -> Fleet {
        Fleet::new(self.config, self.profile, self.specs).unwrap()
    }
}

fn spec(name: &str, block_size: usize) -> EndpointSpec {
    EndpointSpec {
        name: name.into(),
        models: vec![MODEL.into()],
        role: Role::Both,
        has_events: true,
        block_size,
        offload: Default::default(),
    }
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32).map(|t| t.wrapping_mul(31) ^ salt).collect()
}

/// What an engine publishes after prefilling `tokens` (its full blocks, one chain).
fn stored(tokens: &[u32], block_size: usize) -> KvEvent {
    let keys = router_keys(tokens, block_size, None).unwrap();
    let full = keys.len() * block_size;
    KvEvent::BlockStored(BlockStored {
        block_hashes: keys.iter().map(|k| EngineHash(k.0 ^ 0x55)).collect(),
        parent_block_hash: None,
        token_ids: tokens[..full].to_vec(),
        block_size: block_size as u32,
        ..Default::default()
    })
}

/// A scrape's vLLM gauges: `waiting` and `running` requests, `kv_usage` (0–1), and the cache's
/// capacity in blocks.
fn gauges(waiting: f64, running: f64, kv_usage: f64, num_gpu_blocks: usize) -> LoadSample {
    LoadSample {
        waiting: Some(waiting),
        running: Some(running),
        kv_usage: Some(kv_usage),
        num_gpu_blocks: Some(num_gpu_blocks),
    }
}

/// Every endpoint of `fleet` scraped at time 0 idle, with a cache of `num_gpu_blocks` blocks.
fn scrape_idle(fleet: &mut Fleet, num_gpu_blocks: usize) {
    let sample = gauges(0.0, 0.0, 0.0, num_gpu_blocks);
    for at in 0..fleet.endpoints().len() {
        fleet.observe_load(EndpointId(at as u32), sample, 0.0);
    }
}

/// A request as the router prepares it.
struct Req {
    keys: Arc<Vec<RouterKey>>,
    tokens: usize,
    session: Option<String>,
    model: &'static str,
    block_size: usize,
}

impl Req {
    fn new(tokens: &[u32]) -> Self {
        Self::sized(tokens, BS)
    }

    fn sized(tokens: &[u32], block_size: usize) -> Self {
        Self {
            keys: Arc::new(router_keys(tokens, block_size, None).unwrap()),
            tokens: tokens.len(),
            session: None,
            model: MODEL,
            block_size,
        }
    }

    fn features(&self) -> RequestFeatures<'_> {
        RequestFeatures {
            model: self.model,
            keys: &self.keys,
            prompt_tokens: self.tokens,
            block_size: self.block_size,
            session: self.session.as_deref(),
            role: Role::Both,
        }
    }
}

/// Plans, dispatches to the choice, and returns the dispatch.
fn send(fleet: &mut Fleet, req: &Req, now: f64) -> (Plan, Dispatch) {
    let plan = fleet.plan(&req.features(), 7, now);
    let chosen = plan.decision.chosen().expect("a candidate");
    let dispatch = fleet.dispatched(&plan.predicted_cached, &req.features(), chosen, now);
    (plan, dispatch)
}

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

/// Sends `req` to `endpoint` (whatever the plan says) at `now`.
fn send_to(fleet: &mut Fleet, req: &Req, endpoint: EndpointId, now: f64) -> Dispatch {
    let plan = fleet.plan(&req.features(), 7, now);
    fleet.dispatched(&plan.predicted_cached, &req.features(), endpoint, now)
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

/// An engine admits a request only when its blocks fit beside those its running requests
/// pin: one whose cache a running request fills waits for that request's decode to end, and
/// the plan says so in its queue term (and sends it where it fits).
#[test]
fn a_request_that_does_not_fit_beside_running_ones_waits_for_their_end() {
    let mut fleet = FleetBuilder::new(2).build();
    let (busy, idle) = (EndpointId(0), EndpointId(1));
    scrape_idle(&mut fleet, 150);
    // A first request there decodes for 0.4 s: the decode time it learns.
    let mut first = send_to(&mut fleet, &Req::new(&prompt(160, 1)), busy, 0.0);
    fleet.first_token(&mut first, true, 0.1);
    fleet.finished(first, Some(0), 0.5);
    // A 100-block request runs there from 1.0 (expected to end at 1.4).
    let mut running = send_to(&mut fleet, &Req::new(&prompt(1_600, 2)), busy, 0.9);
    fleet.first_token(&mut running, true, 1.0);
    let plan = fleet.plan(&Req::new(&prompt(1_600, 3)).features(), 7, 1.1);
    let queue_s = plan.decision.assessment(busy).unwrap().cost.queue_s;
    assert!(
        queue_s >= 0.3 - 1e-9,
        "waits for the running request's end: {queue_s}"
    );
    assert_eq!(plan.decision.chosen(), Some(idle));
    // Once it ended, nothing is in the way.
    fleet.finished(running, Some(0), 1.2);
    let plan = fleet.plan(&Req::new(&prompt(1_600, 3)).features(), 7, 1.2);
    assert!(plan.decision.assessment(busy).unwrap().cost.queue_s < 0.05);
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
fn retries_are_budgeted() {
    let mut fleet = FleetBuilder::new(2).build();
    let floor = (fleet.config().retry.min_retries_per_s * fleet.config().retry.window_s) as usize;
    let granted = (0..1000).filter(|_| fleet.try_retry(0.0)).count();
    assert_eq!(granted, floor);
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

// ---------------------------------------------------------------------------------------------
// Tiers below the GPU.

/// What an offloading connector publishes for `tokens` (one hash per block, no tokens), and
/// the GPU's removal of the same blocks: the prefix survives on `medium` only.
fn offloaded_only(tokens: &[u32], medium: &str) -> Vec<KvEvent> {
    let KvEvent::BlockStored(gpu) = stored(tokens, BS) else {
        unreachable!()
    };
    vec![
        KvEvent::BlockStored(gpu.clone()),
        KvEvent::BlockStored(BlockStored {
            block_hashes: gpu.block_hashes.clone(),
            medium: Some(medium.into()),
            ..Default::default()
        }),
        KvEvent::BlockRemoved(crate::event::BlockRemoved {
            block_hashes: gpu.block_hashes,
            medium: Some("GPU".into()),
            group_idx: None,
        }),
    ]
}

#[test]
fn a_prefix_only_on_cpu_is_credited_when_loading_beats_recomputing() {
    let mut fleet = FleetBuilder::new(2).build();
    let shared = prompt(2048, 9);
    fleet.apply_events(EndpointId(0), &offloaded_only(&shared, "CPU"), 0.0);
    let mut tokens = shared.clone();
    tokens.extend(prompt(256, 10));
    let plan = fleet.plan(&Req::new(&tokens).features(), 1, 0.0);
    assert_eq!(plan.decision.chosen(), Some(EndpointId(0)));
    let on_cpu = plan.decision.assessment(EndpointId(0)).unwrap();
    let recompute = plan.decision.assessment(EndpointId(1)).unwrap();
    let cpu = on_cpu.cost.tiers.tiers[crate::tiers::LoadTier::Cpu as usize];
    assert_eq!(cpu.tokens, 2048);
    assert!(!cpu.slower_than_recompute);
    assert!(on_cpu.predicted_ttft_s < recompute.predicted_ttft_s);
    assert_eq!(plan.predicted_tiers[0], [2048, 0, 0]);
    assert!(!on_cpu.tier_uncertain);
}

#[test]
fn a_tier_slower_than_recompute_gets_no_credit_and_explain_says_so() {
    let mut fleet = FleetBuilder::new(2).build();
    // A storage tier at 5k tokens/s against a 20k tokens/s prefill.
    fleet.profile.tiers.storage_tokens_per_s = 5_000.0;
    let shared = prompt(2048, 11);
    fleet.apply_events(EndpointId(0), &offloaded_only(&shared, "STORAGE"), 0.0);
    let plan = fleet.plan(&Req::new(&shared).features(), 1, 0.0);
    assert_eq!(
        plan.decision.chosen(),
        Some(EndpointId(1)),
        "recomputing wins"
    );
    let slow = plan.decision.assessment(EndpointId(0)).unwrap();
    let storage = slow.cost.tiers.tiers[crate::tiers::LoadTier::Storage as usize];
    assert!(storage.slower_than_recompute, "{storage:?}");
    assert!(storage.seconds > storage.recompute_s);
}

#[test]
fn a_shared_tier_prefix_is_a_hit_on_every_endpoint_that_mounts_it() {
    // Endpoints 0 and 1 declare the mount in their specs, as the router's config does.
    let mut builder = FleetBuilder::new(3);
    for e in [0, 1] {
        builder.specs[e].offload = lustre();
    }
    let mut fleet = builder.build();
    let doc = prompt(1024, 12);
    // Endpoint 0 wrote the blocks to the filesystem and then lost them from its GPU.
    fleet.apply_events(EndpointId(0), &offloaded_only(&doc, "FS"), 0.0);
    // Endpoint 0 is busy: the shared copy lets endpoint 1 serve it at load cost.
    for i in 0..3 {
        send(&mut fleet, &Req::new(&prompt(4096, 100 + i)), 0.0);
    }
    let plan = fleet.plan_every(&Req::new(&doc).features(), 1, 0.0);
    let m1 = plan.facts[1].index_match.unwrap();
    assert_eq!((m1.blocks, m1.shared_blocks), (64, 64));
    assert!(
        plan.facts[2].index_match.is_none(),
        "endpoint 2 mounts nothing"
    );
    // The whole prompt is there, but the engine recomputes its last block: never reported.
    assert_eq!(plan.predicted_tiers[1], [0, 0, 1024 - BS]);
    assert_ne!(plan.decision.chosen(), Some(EndpointId(2)));
}

#[test]
fn a_shared_load_waits_for_the_loads_already_sent_to_the_filesystem() {
    // Endpoints 0 and 1 mount the filesystem; endpoint 2 does not, and recomputes.
    let mut builder = FleetBuilder::new(3);
    for e in [0, 1] {
        builder.specs[e].offload = lustre();
    }
    let mut fleet = builder.build();
    let (first, second) = (prompt(2048, 21), prompt(2048, 22));
    for doc in [&first, &second] {
        fleet.apply_events(EndpointId(0), &offloaded_only(doc, "FS"), 0.0);
    }
    // Alone, a shared load (2,048 tokens at 25k tokens/s, 0.08 s) beats recomputing (at 20k
    // tokens/s, 0.1 s): the first goes to a mounted endpoint.
    let (plan, mut loading) = send(&mut fleet, &Req::new(&first), 0.0);
    assert_ne!(plan.decision.chosen(), Some(EndpointId(2)));
    // While it loads, the second would wait for its tokens on the filesystem (0.16 s in all):
    // the endpoint that recomputes is faster, though a mounted one is idle.
    let shared = crate::tiers::LoadTier::Shared as usize;
    let plan = fleet.plan_every(&Req::new(&second).features(), 1, 0.0);
    let idle_mounted = EndpointId(if loading.endpoint == EndpointId(0) {
        1
    } else {
        0
    });
    let queued = plan
        .decision
        .assessment(idle_mounted)
        .unwrap()
        .cost
        .tiers
        .tiers[shared];
    assert_eq!(queued.queued_tokens, (2048 - BS) as f64, "{queued:?}");
    assert!(queued.slower_than_recompute, "{queued:?}");
    assert_eq!(plan.decision.chosen(), Some(EndpointId(2)));
    // Once its first token came, the filesystem is free again.
    fleet.first_token(&mut loading, true, 0.05);
    let plan = fleet.plan_every(&Req::new(&second).features(), 1, 0.05);
    let free = plan
        .decision
        .assessment(idle_mounted)
        .unwrap()
        .cost
        .tiers
        .tiers[shared];
    assert_eq!(free.queued_tokens, 0.0);
    assert_ne!(plan.decision.chosen(), Some(EndpointId(2)));
}

#[test]
fn a_shared_tier_lesson_leaves_out_the_wait_for_loads_sent_ahead_of_it() {
    // The filesystem reads 40k tokens/s in all (the configured rate is 25k); every round,
    // endpoint 1's load is sent first and endpoint 0's waits for it.
    let mut builder = FleetBuilder::new(2);
    for e in [0, 1] {
        builder.specs[e].offload = lustre();
    }
    let mut fleet = builder.build();
    let (prefill_rate, fs_rate) = (10_000.0, 40_000.0);
    // Rounds 0.5 s apart: the engines announce nothing here, and 30 s of silence would
    // distrust their events.
    let mut now = 0.0;
    // Endpoint 0's own line: untiered requests alone, of several sizes.
    now = teach_prefill_line(&mut fleet, EndpointId(0), prefill_rate, 500, now, 0.5);
    let doc = prompt(4096, 15);
    fleet.apply_events(EndpointId(1), &offloaded_only(&doc, "FS"), now);
    for i in 0..40 {
        let request = |salt| {
            let mut tokens = doc.clone();
            tokens.extend(prompt(512, salt));
            Req::new(&tokens)
        };
        let (ahead, waiting) = (request(600 + 2 * i), request(601 + 2 * i));
        let plan = fleet.plan(&ahead.features(), 7, now);
        let mut first = fleet.dispatched(
            &plan.predicted_cached,
            &ahead.features(),
            EndpointId(1),
            now,
        );
        let plan = fleet.plan(&waiting.features(), 7, now);
        let mut second = fleet.dispatched(
            &plan.predicted_cached,
            &waiting.features(),
            EndpointId(0),
            now,
        );
        assert_eq!(second.tier_tokens, [0, 0, 4096]);
        let first_at = now + 4096.0 / fs_rate + 512.0 / prefill_rate;
        let second_at = now + 8192.0 / fs_rate + 512.0 / prefill_rate;
        fleet.first_token(&mut first, true, first_at);
        fleet.first_token(&mut second, true, second_at);
        for d in [first, second] {
            let cached = d.predicted_cached;
            fleet.finished(d, Some(cached), second_at);
        }
        now += 0.5;
    }
    let shared = crate::tiers::LoadTier::Shared;
    let rates = fleet.endpoint(EndpointId(0)).unwrap().tier_rates();
    let learned = rates.rate(shared, &fleet.profile.tiers);
    assert!(rates.samples[shared as usize] > 30, "{rates:?}");
    assert!(
        (learned - fs_rate).abs() / fs_rate < 0.05,
        "learned {learned:.0} tokens/s, the filesystem reads {fs_rate:.0}"
    );
}

fn lustre() -> crate::index::OffloadSpec {
    crate::index::OffloadSpec {
        block_size: None,
        shared: Some(crate::index::SharedMount::new("lustre")),
    }
}

#[test]
fn an_endpoint_joining_later_mounts_what_its_spec_says_even_in_a_reused_slot() {
    let mut builder = FleetBuilder::new(2);
    builder.specs[0].offload = lustre();
    let mut fleet = builder.build();
    let doc = prompt(1024, 12);
    fleet.apply_events(EndpointId(0), &offloaded_only(&doc, "FS"), 0.0);
    // A pod that mounts the filesystem joins: the shared copy is a hit there at once.
    let mut mounted = spec("joined", BS);
    mounted.offload = lustre();
    let joined = fleet.add_endpoint(mounted, 1.0).unwrap();
    let plan = fleet.plan_every(&Req::new(&doc).features(), 1, 1.0);
    let m = plan.facts[joined.0 as usize].index_match.unwrap();
    assert_eq!(m.shared_blocks, 64);
    // It leaves, and a pod without the mount takes its slot: no shared credit there.
    assert!(fleet.remove_endpoint(joined, 2.0));
    let t = 2.0 + FleetConfig::default().slot_reuse_after_s;
    let again = fleet.add_endpoint(spec("unmounted", BS), t).unwrap();
    assert_eq!(again, joined, "the slot is reused");
    let plan = fleet.plan_every(&Req::new(&doc).features(), 1, t);
    assert!(plan.facts[again.0 as usize].index_match.is_none());
}

#[test]
fn tier_load_rates_are_learned_from_requests_that_loaded() {
    let mut fleet = FleetBuilder::new(1).build();
    let (prefill_rate, cpu_rate) = (10_000.0, 60_000.0);
    let mut now = 0.0;
    // Learn the prefill rate first, from uncached prompts of several sizes (what a request
    // takes without loads).
    for i in 0..5 {
        let len = 1000 + 400 * i as usize;
        let (_, mut d) = send(&mut fleet, &Req::new(&prompt(len, 200 + i)), now);
        now += len as f64 / prefill_rate;
        fleet.first_token(&mut d, true, now);
        fleet.finished(d, Some(0), now);
    }
    let shared = prompt(4096, 13);
    fleet.apply_events(EndpointId(0), &offloaded_only(&shared, "CPU"), now);
    for i in 0..40 {
        let mut tokens = shared.clone();
        tokens.extend(prompt(512, 300 + i));
        let req = Req::new(&tokens);
        let (plan, mut d) = send(&mut fleet, &req, now);
        // The dispatch carries the plan's tier tokens: nobody has to copy them over.
        assert_eq!(plan.predicted_tiers[0], [4096, 0, 0]);
        assert_eq!(d.tier_tokens, [4096, 0, 0]);
        now += 512.0 / prefill_rate + 4096.0 / cpu_rate;
        fleet.first_token(&mut d, true, now);
        let cached = d.predicted_cached;
        fleet.finished(d, Some(cached), now);
        // The engine's own blocks for the new part are not announced here: the prefix stays
        // on the CPU tier only.
    }
    let e = fleet.endpoint(EndpointId(0)).unwrap();
    let learned = e
        .tier_rates()
        .rate(crate::tiers::LoadTier::Cpu, &fleet.profile.tiers);
    assert!(
        (learned - cpu_rate).abs() / cpu_rate < 0.05,
        "learned {learned:.0} tokens/s, true {cpu_rate:.0}"
    );
    assert_eq!(e.tier_rates().predicted_tokens, [40 * 4096, 0, 0]);
    assert_eq!(e.tier_rates().found_tokens, [40 * 4096, 0, 0]);
}

#[test]
fn a_request_that_shared_its_endpoint_teaches_no_tier_rate() {
    let mut fleet = FleetBuilder::new(1).build();
    let id = EndpointId(0);
    let shared = prompt(1024, 22);
    fleet.apply_events(id, &offloaded_only(&shared, "CPU"), 0.0);
    // A request decoding there already: the tiered one's first token waits on its steps.
    let busy = Req::new(&prompt(512, 23));
    let plan = fleet.plan(&busy.features(), 7, 0.0);
    let mut first = fleet.dispatched(&plan.predicted_cached, &busy.features(), id, 0.0);
    fleet.first_token(&mut first, true, 0.05);
    let mut tokens = shared.clone();
    tokens.extend(prompt(256, 24));
    let tiers = serve_on(&mut fleet, &Req::new(&tokens), id, 0.1, 0.2);
    assert_eq!(tiers, [1024, 0, 0]);
    let rates = fleet.endpoint(id).unwrap().tier_rates();
    assert_eq!(rates.samples, [0; 3], "not alone: no lesson");
    assert_eq!(rates.predicted_tokens, [1024, 0, 0], "still counted");
    fleet.finished(first, Some(0), 0.3);
}

/// Sends `req` to `endpoint` at `now`; its first token comes `ttft` later and the engine
/// reports its predicted cached tokens. Returns the dispatch's tier tokens.
fn serve_on(fleet: &mut Fleet, req: &Req, endpoint: EndpointId, now: f64, ttft: f64) -> TierTokens {
    let plan = fleet.plan(&req.features(), 7, now);
    let mut d = fleet.dispatched(&plan.predicted_cached, &req.features(), endpoint, now);
    fleet.first_token(&mut d, true, now + ttft);
    let (cached, tiers) = (d.predicted_cached, d.tier_tokens);
    fleet.finished(d, Some(cached), now + ttft);
    tiers
}

/// Serves five uncached prompts of several sizes (1,000 to 2,600 tokens, seeds from `seed`) on
/// `endpoint` at `prefill_rate`, `spacing` seconds apart from `now`: the endpoint's own prefill
/// line, which tier lessons need. The time after them.
fn teach_prefill_line(
    fleet: &mut Fleet,
    endpoint: EndpointId,
    prefill_rate: f64,
    seed: u32,
    mut now: f64,
    spacing: f64,
) -> f64 {
    for i in 0..5 {
        let len = 1000 + 400 * i as usize;
        let req = Req::new(&prompt(len, seed + i as u32));
        serve_on(fleet, &req, endpoint, now, len as f64 / prefill_rate);
        now += spacing;
    }
    now
}

#[test]
fn tier_lessons_wait_for_the_endpoints_own_line() {
    // Endpoint 0 has only served tiered requests: it cannot tell their loads from the rest of
    // their time (the fleet's prefill rate is an average, not its fixed part and slope), so
    // it learns nothing and the configured rate stands, until it has run untiered ones alone.
    let mut fleet = FleetBuilder::new(2).build();
    let (prefill_rate, cpu_rate) = (8_000.0, 60_000.0);
    let mut now = 0.0;
    now = teach_prefill_line(&mut fleet, EndpointId(1), prefill_rate, 400, now, 0.3);
    let shared = prompt(4096, 14);
    fleet.apply_events(EndpointId(0), &offloaded_only(&shared, "CPU"), now);
    let tiered = |fleet: &mut Fleet, now: &mut f64, salt: u32| {
        let mut tokens = shared.clone();
        tokens.extend(prompt(1024, salt));
        let ttft = 1024.0 / prefill_rate + 4096.0 / cpu_rate;
        let tiers = serve_on(fleet, &Req::new(&tokens), EndpointId(0), *now, ttft);
        assert_eq!(tiers, [4096, 0, 0]);
        // Well within the trust's patience for the suffix blocks nobody announces here.
        *now += 0.3;
    };
    for i in 0..10 {
        tiered(&mut fleet, &mut now, 500 + i);
    }
    let rates = *fleet.endpoint(EndpointId(0)).unwrap().tier_rates();
    assert_eq!(rates.samples, [0; 3], "no line of its own: no lesson");
    now = teach_prefill_line(&mut fleet, EndpointId(0), prefill_rate, 800, now, 0.3);
    for i in 0..30 {
        tiered(&mut fleet, &mut now, 900 + i);
    }
    let learned = fleet
        .endpoint(EndpointId(0))
        .unwrap()
        .tier_rates()
        .rate(crate::tiers::LoadTier::Cpu, &fleet.profile.tiers);
    assert!(
        (learned - cpu_rate).abs() / cpu_rate < 0.05,
        "learned {learned:.0} tokens/s, true {cpu_rate:.0}"
    );
}

#[test]
fn tier_lessons_leave_out_what_every_request_pays_whatever_it_loads() {
    // Every first token costs a fixed 30 ms (a step's fixed cost and the decodes batched with
    // it) plus 32 µs per uncached token; the CPU loads 200k tokens/s. A request that loads a
    // 512-token prefix and computes 256 new tokens must teach the CPU rate, not the 30 ms.
    let (fixed, per_token, cpu_rate) = (0.030, 32e-6, 200_000.0);
    let ttft = |uncached: usize, loaded: usize| {
        fixed + uncached as f64 * per_token + loaded as f64 / cpu_rate
    };
    let mut fleet = FleetBuilder::new(1).build();
    let id = EndpointId(0);
    let mut now = 0.0;
    for i in 0..10 {
        let len = 300 + 200 * i;
        serve_on(
            &mut fleet,
            &Req::new(&prompt(len, 600 + i as u32)),
            id,
            now,
            ttft(len, 0),
        );
        now += 0.3;
    }
    let shared = prompt(512, 21);
    fleet.apply_events(id, &offloaded_only(&shared, "CPU"), now);
    for i in 0..40 {
        let mut tokens = shared.clone();
        tokens.extend(prompt(256, 700 + i));
        let tiers = serve_on(&mut fleet, &Req::new(&tokens), id, now, ttft(256, 512));
        assert_eq!(tiers, [512, 0, 0]);
        now += 0.3;
    }
    let learned = fleet
        .endpoint(id)
        .unwrap()
        .tier_rates()
        .rate(crate::tiers::LoadTier::Cpu, &fleet.profile.tiers);
    assert!(
        (learned - cpu_rate).abs() / cpu_rate < 0.1,
        "learned {learned:.0} tokens/s, true {cpu_rate:.0}"
    );
}

#[test]
fn tier_tokens_never_exceed_what_the_engine_can_report() {
    let mut fleet = FleetBuilder::new(1).build();
    // The whole prompt, every block of it, survives on the CPU only.
    let doc = prompt(2048, 15);
    fleet.apply_events(EndpointId(0), &offloaded_only(&doc, "CPU"), 0.0);
    let req = Req::new(&doc);
    let plan = fleet.plan(&req.features(), 7, 0.0);
    assert_eq!(plan.predicted_cached[0], 2048 - BS);
    assert_eq!(plan.predicted_tiers[0], [2048 - BS, 0, 0]);
    let d = fleet.dispatched(&plan.predicted_cached, &req.features(), EndpointId(0), 0.0);
    assert_eq!(d.tier_tokens, [2048 - BS, 0, 0]);
    // The engine finds all it can: every predicted tier token counts as found.
    fleet.finished(d, Some(2048 - BS), 1.0);
    let rates = fleet.endpoint(EndpointId(0)).unwrap().tier_rates();
    assert_eq!(rates.found_tokens, rates.predicted_tokens);
}

#[test]
fn the_engines_tier_counters_are_counted_and_split_partial_finds() {
    let mut fleet = FleetBuilder::new(1).build();
    let id = EndpointId(0);
    fleet.observe_engine_tier_loads(id, tokens_only([Some(100.0), None, Some(0.0)]), 0.0);
    let cpu = prompt(1024, 16);
    fleet.apply_events(id, &offloaded_only(&cpu, "CPU"), 0.0);
    let mut tokens = cpu.clone();
    tokens.extend(prompt(512, 17));
    let req = Req::new(&tokens);
    let plan = fleet.plan(&req.features(), 7, 0.0);
    let d = fleet.dispatched(&plan.predicted_cached, &req.features(), id, 0.0);
    assert_eq!(d.tier_tokens, [1024, 0, 0]);
    fleet.finished(d, Some(1024), 1.0);
    // The engine's counters: it loaded all 1,024 from the CPU.
    fleet.observe_engine_tier_loads(id, tokens_only([Some(1124.0), None, Some(0.0)]), 1.0);
    let rates = *fleet.endpoint(id).unwrap().tier_rates();
    assert_eq!(rates.engine_loaded_tokens, [1024, 0, 0]);
    assert_eq!(rates.engine_found_fraction[0], Some(1.0));
    assert_eq!(rates.engine_found_fraction[1], None, "not reported");
    // A counter that goes backwards (a restart) adds nothing.
    fleet.observe_engine_tier_loads(id, tokens_only([Some(10.0), None, Some(0.0)]), 2.0);
    let rates = fleet.endpoint(id).unwrap().tier_rates();
    assert_eq!(rates.engine_loaded_tokens, [1024, 0, 0]);
}

/// An engine's per-tier counters of tokens loaded, without load times.
fn tokens_only(tokens: [Option<f64>; 3]) -> TierLoadCounters {
    TierLoadCounters {
        tokens,
        seconds: [None; 3],
    }
}

/// Tokens and load seconds loaded from the CPU tier and the shared one so far.
fn loaded(cpu: (f64, f64), shared: (f64, f64)) -> TierLoadCounters {
    TierLoadCounters {
        tokens: [Some(cpu.0), None, Some(shared.0)],
        seconds: [Some(cpu.1), None, Some(shared.1)],
    }
}

/// Under load no request runs alone, so none teaches a tier's rate by its time to first
/// token; the engine's own counters do: 100,000 CPU tokens in loads of 0.5 s in all, within a
/// five-second window, is 200,000 tokens per second, whatever else ran beside them.
#[test]
fn an_engines_load_counters_teach_its_cpu_tiers_rate_whatever_runs_beside() {
    let mut fleet = FleetBuilder::new(1).build();
    let id = EndpointId(0);
    let _busy: Vec<_> = (0..8)
        .map(|i| send(&mut fleet, &Req::new(&prompt(512, 100 + i)), 0.0).1)
        .collect();
    let cpu = crate::tiers::LoadTier::Cpu;
    let configured = fleet.profile.tiers.tokens_per_s(cpu);
    let rate = |fleet: &Fleet| fleet.endpoint(id).unwrap().tier_rates().learned[cpu as usize];
    fleet.observe_engine_tier_loads(id, loaded((0.0, 0.0), (0.0, 0.0)), 0.0);
    fleet.observe_engine_tier_loads(id, loaded((40_000.0, 0.2), (0.0, 0.0)), 2.0);
    assert_eq!(rate(&fleet), None, "a window of 2 s says nothing yet");
    let rates = *fleet.endpoint(id).unwrap().tier_rates();
    assert_eq!(rates.rate(cpu, &fleet.profile.tiers), configured);
    fleet.observe_engine_tier_loads(id, loaded((100_000.0, 0.5), (0.0, 0.0)), 5.0);
    let learned = rate(&fleet).unwrap();
    assert!((learned - 200_000.0).abs() < 1e-6, "{learned}");
    let rates = fleet.endpoint(id).unwrap().tier_rates();
    assert_eq!(rates.engine_loaded_tokens[cpu as usize], 100_000);
    // Loads that overlap for the whole next window: the link read 30,000 tokens a second.
    fleet.observe_engine_tier_loads(id, loaded((250_000.0, 10.5), (0.0, 0.0)), 10.0);
    let learned = rate(&fleet).unwrap();
    let expected = 1.0 / (0.8 / 200_000.0 + 0.2 / 30_000.0);
    assert!(
        (learned - expected).abs() < 1e-6,
        "{learned} against {expected}"
    );
}

/// A shared filesystem is one device for every endpoint that mounts it: its rate is what all
/// of them loaded over a window, and it becomes every mounting endpoint's, not the share one
/// endpoint's loads saw (the shared backlog already charges the queue ahead).
#[test]
fn a_shared_filesystems_rate_is_learned_from_all_its_endpoints_loads_together() {
    let mut builder = FleetBuilder::new(3);
    builder.specs[0].offload = lustre();
    builder.specs[1].offload = lustre();
    let mut fleet = builder.build();
    let shared = crate::tiers::LoadTier::Shared;
    for id in [EndpointId(0), EndpointId(1)] {
        fleet.observe_engine_tier_loads(id, loaded((0.0, 0.0), (0.0, 0.0)), 0.0);
    }
    // Each endpoint reads 30,000 tokens a second in loads that overlap (1.5 s of load time
    // per second): together the filesystem read 60,000 tokens a second.
    for second in 1..=6 {
        let t = f64::from(second);
        for id in [EndpointId(0), EndpointId(1)] {
            let counters = loaded((0.0, 0.0), (30_000.0 * t, 1.5 * t));
            fleet.observe_engine_tier_loads(id, counters, t);
        }
    }
    // The window is read at the first scrape that completes it, before the other endpoint's
    // last second is in: at least the two endpoints' loads together over all but that
    // second, never more than the filesystem's 60,000, and far above one endpoint's share.
    for id in [EndpointId(0), EndpointId(1)] {
        let learned = fleet.endpoint(id).unwrap().tier_rates().learned[shared as usize];
        let learned = learned.expect("learned from the window");
        assert!(
            (50_000.0..=60_000.0).contains(&learned),
            "{id:?}: {learned}"
        );
    }
    let unmounted = fleet.endpoint(EndpointId(2)).unwrap().tier_rates();
    assert_eq!(
        unmounted.learned[shared as usize], None,
        "it mounts nothing"
    );
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
