//! Pruned plans against plans that cost every endpoint, on random fleets driven as the router
//! drives them: the same decision (winner, reason, saturation, head of the ranking and its
//! breakdowns) and the same expected cached tokens, whatever the loads, samples (fresh or
//! expired), caches, sessions, peers, departures and arrivals.

use proptest::prelude::*;

use super::*;
use crate::event::{BlockStored, EngineHash, KvEvent};
use crate::keys::router_keys;
use crate::schedule::{CacheSource, Picker};

const BS: usize = 16;
const MODEL: &str = "m";

fn spec(i: usize, model: &str) -> EndpointSpec {
    spec_at(i, model, BS)
}

/// Endpoint `i` serving `model` at `block_size` tokens per block.
fn spec_at(i: usize, model: &str, block_size: usize) -> EndpointSpec {
    EndpointSpec {
        name: format!("e{i}"),
        models: vec![model.into()],
        role: Role::Both,
        has_events: i % 5 != 4,
        block_size,
        offload: Default::default(),
    }
}

/// The model (and block size) endpoint `i` of a mixed fleet serves.
fn mixed_spec(i: usize) -> EndpointSpec {
    match i % 7 {
        6 => spec(i, "other"),
        5 if i % 2 == 1 => spec_at(i, MODEL, 2 * BS),
        _ => spec(i, MODEL),
    }
}

/// Endpoint `i` of a mixed fleet (`mixed_spec`) whose roles, with `pd`, are prefill, decode
/// or both in turn (the roles of four endpoints in five keep their order; the fifth's follow).
fn fleet_spec(pd: bool, i: usize) -> EndpointSpec {
    let role = match (pd, i % 5) {
        (false, _) => Role::Both,
        (true, 4) => [Role::Decode, Role::Prefill, Role::Both][(i / 5) % 3],
        (true, r) => [Role::Prefill, Role::Decode, Role::Both, Role::Prefill][r],
    };
    EndpointSpec {
        role,
        ..mixed_spec(i)
    }
}

/// P/D pricing over RoCE, for a model of Llama-3.1-8B's KV size.
fn pd_config() -> DisaggConfig {
    DisaggConfig {
        link: crate::schedule::disagg::LinkPrior::parse("roce-100").unwrap(),
        learning: Default::default(),
        kv_bytes_per_token: 131_072.0,
        leg_overhead_s: 0.005,
    }
}

/// Prompt `p` of a few families: prompts of one family share a prefix of `shared` blocks.
fn tokens(p: u8, shared: u8, len: u8) -> Vec<u32> {
    let family = u32::from(p % 3);
    let shared = usize::from(shared) * BS;
    (0..(usize::from(len) + 1) * BS)
        .map(|t| {
            if t < shared {
                family * 1_000_003 + t as u32
            } else {
                u32::from(p) * 7_919 + t as u32 * 31
            }
        })
        .collect()
}

/// An engine's event: it stored `tokens` on the GPU, or (`cpu`) offloaded them to its CPU.
fn stored_on(tokens: &[u32], cpu: bool) -> KvEvent {
    let keys = router_keys(tokens, BS, None).unwrap();
    KvEvent::BlockStored(BlockStored {
        block_hashes: keys.iter().map(|k| EngineHash(k.0 ^ 0x55)).collect(),
        parent_block_hash: None,
        token_ids: tokens[..keys.len() * BS].to_vec(),
        block_size: BS as u32,
        medium: cpu.then(|| "CPU".to_string()),
        ..Default::default()
    })
}

fn stored(tokens: &[u32]) -> KvEvent {
    stored_on(tokens, false)
}

/// One step a router takes.
#[derive(Clone, Debug)]
enum Step {
    /// Time passes (seconds, a tenth each).
    Wait(u8),
    /// A load sample of an endpoint: waiting, running, capacity (`None`: not reported).
    Sample(u8, u8, u8, Option<u16>),
    /// A load sample of every endpoint: waiting (4 or more saturates), a nearly full cache.
    SampleAll(u8, bool),
    /// A request (prompt, shared blocks, length in blocks, session) is planned and sent.
    Request(u8, u8, u8, Option<u8>),
    /// The oldest request in flight gets its first token (after seconds / 100).
    FirstToken(u8),
    /// The oldest request in flight ends.
    Finish,
    /// Endpoints from the first, so many, publish that they stored a prompt (on their GPU, or
    /// offloaded to their CPU).
    Stored(u8, u8, u8, u8, bool, u8),
    /// Health checks of an endpoint fail until it is taken out, or pass until it is restored.
    Unhealthy(u8),
    Healthy(u8),
    /// Requests sent to an endpoint fail until it is ejected for a while, or one succeeds.
    Failed(u8),
    Succeeded(u8),
    /// An endpoint leaves, or one joins.
    Leave(u8),
    Join,
    /// Another replica's prefill starts on an endpoint (uncached blocks), or the oldest
    /// reaches its first token.
    Peer(u8, u8),
    PeerDone,
    /// The oldest peer request not yet ended ends (after its first token or without one).
    PeerEnded,
}

fn arb_step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => (0u8..40).prop_map(Step::Wait),
        4 => (any::<u8>(), prop_oneof![3 => 0u8..4, 1 => 0u8..64], 0u8..12, proptest::option::of(100u16..400))
            .prop_map(|(e, w, r, c)| Step::Sample(e, w, r, c)),
        1 => (0u8..8, any::<bool>()).prop_map(|(w, full)| Step::SampleAll(w, full)),
        6 => (prop_oneof![1 => any::<u8>(), 2 => 0u8..6], 0u8..6, 1u8..30, proptest::option::of(0u8..6))
            .prop_map(|(p, s, l, session)| Step::Request(p, s, l, session)),
        3 => (1u8..50).prop_map(Step::FirstToken),
        2 => Just(Step::Finish),
        3 => (any::<u8>(), 0u8..6, 0u8..6, 1u8..30, any::<bool>(), prop_oneof![3 => Just(1u8), 1 => 2u8..30])
            .prop_map(|(e, p, s, l, cpu, n)| Step::Stored(e, p, s, l, cpu, n)),
        1 => (0u8..6).prop_map(Step::Unhealthy),
        1 => (0u8..6).prop_map(Step::Healthy),
        1 => (0u8..6).prop_map(Step::Failed),
        1 => (0u8..6).prop_map(Step::Succeeded),
        1 => any::<u8>().prop_map(Step::Leave),
        1 => Just(Step::Join),
        1 => (any::<u8>(), 1u8..40).prop_map(|(e, b)| Step::Peer(e, b)),
        1 => Just(Step::PeerDone),
        1 => Just(Step::PeerEnded),
    ]
}

fn arb_profile() -> impl Strategy<Value = Profile> {
    (
        0u8..3,
        prop_oneof![Just(0.1f64), 0.0f64..0.6],
        prop_oneof![Just(1.0f64), 0.0f64..3.0],
        prop_oneof![Just(1.0f64), 0.0f64..3.0],
        prop_oneof![Just(0.0f64), 0.0f64..0.5],
    )
        .prop_map(|(source, relative, load, interference, affinity)| {
            let sources = [
                CacheSource::Precise,
                CacheSource::Approximate,
                CacheSource::None,
            ];
            let mut p = Profile {
                cache: sources[usize::from(source)],
                session_affinity_s: affinity,
                ..Profile::default()
            };
            p.balance.relative = relative;
            p.weights.load = load;
            p.weights.decode_interference = interference;
            p
        })
}

/// Plans `features` pruned and unpruned; both must agree.
fn plan_both(fleet: &mut Fleet, features: &RequestFeatures<'_>, random: u64, now: f64) -> Plan {
    fleet.prune_costing(false);
    let every = fleet.plan(features, random, now);
    fleet.prune_costing(true);
    let pruned = fleet.plan(features, random, now);
    assert_eq!(pruned.decision, every.decision, "the pruned decision");
    assert_eq!(pruned.predicted_cached, every.predicted_cached);
    assert_eq!(pruned.predicted_tiers, every.predicted_tiers);
    pruned
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Costing only the endpoints that hold part of the prompt and the least busy of the
    /// rest decides exactly as costing every endpoint.
    #[test]
    fn a_pruned_plan_decides_as_costing_every_endpoint(
        endpoints in 9usize..48,
        profile in arb_profile(),
        steps in proptest::collection::vec(arb_step(), 1..160),
        pd in any::<bool>(),
        seed: u64,
    ) {
        let fleet_spec = |i| fleet_spec(pd, i);
        let specs = (0..endpoints).map(fleet_spec).collect();
        let mut fleet = Fleet::new(FleetConfig::default(), profile, specs).unwrap();
        if pd {
            fleet.enable_disagg(pd_config());
        }
        let mut now = 0.0;
        let mut inflight: std::collections::VecDeque<Dispatch> = Default::default();
        let mut random = seed;
        let (mut peers_started, mut peers_done, mut peers_ended) = (0u64, 0u64, 0u64);
        let pick = |fleet: &Fleet, e: u8| EndpointId(u32::from(e) % fleet.endpoints().len() as u32);
        for step in steps {
            random = random.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            match step {
                Step::Wait(tenths) => now += f64::from(tenths) / 10.0,
                Step::Sample(e, waiting, running, capacity) => {
                    let sample = LoadSample {
                        waiting: Some(f64::from(waiting)),
                        running: Some(f64::from(running)),
                        kv_usage: Some(0.5),
                        num_gpu_blocks: capacity.map(usize::from),
                    };
                    let id = pick(&fleet, e);
                    fleet.observe_load(id, sample, now);
                }
                Step::SampleAll(waiting, full) => {
                    for e in 0..fleet.endpoints().len() as u32 {
                        let sample = LoadSample {
                            waiting: Some(f64::from(waiting)),
                            running: Some(f64::from(2 + e % 5)),
                            kv_usage: Some(if full { 0.97 } else { 0.5 }),
                            num_gpu_blocks: None,
                        };
                        fleet.observe_load(EndpointId(e), sample, now);
                    }
                }
                Step::Request(p, shared, len, session) => {
                    let prompt = tokens(p, shared, len);
                    let keys = Arc::new(router_keys(&prompt, BS, None).unwrap());
                    let session = session.map(|s| format!("s{s}"));
                    // Some requests name the other model: each model's prior rate is its own
                    // endpoints', while the load order keeps the whole fleet's.
                    let features = RequestFeatures {
                        model: if p % 5 == 4 { "other" } else { MODEL },
                        keys: &keys,
                        prompt_tokens: prompt.len(),
                        block_size: BS,
                        session: session.as_deref(),
                        role: Role::Both,
                    };
                    let plan = plan_both(&mut fleet, &features, random, now);
                    if let Some(chosen) = plan.decision.chosen() {
                        let d = fleet.dispatched(&plan.predicted_cached, &features, chosen, now);
                        inflight.push_back(d);
                    }
                }
                Step::FirstToken(hundredths) => {
                    if let Some(d) = inflight.iter_mut().find(|d| !d.prefill_done()) {
                        let at = d.dispatched_at.max(now) + f64::from(hundredths) / 100.0;
                        fleet.first_token(d, true, at);
                        now = at;
                    }
                }
                Step::Finish => {
                    if let Some(d) = inflight.pop_front() {
                        fleet.finished(d, Some(0), now);
                    }
                }
                Step::Stored(e, p, shared, len, cpu, n) => {
                    let event = stored_on(&tokens(p, shared, len), cpu);
                    for k in 0..n {
                        let id = pick(&fleet, e.wrapping_add(k));
                        fleet.apply_events(id, std::slice::from_ref(&event), now);
                    }
                }
                Step::Unhealthy(e) => {
                    let id = pick(&fleet, e);
                    fail_health_checks(&mut fleet, id, now);
                }
                Step::Healthy(e) => {
                    let id = pick(&fleet, e);
                    for _ in 0..fleet.config.health.healthy_after {
                        fleet.health_check(id, true, now);
                    }
                }
                Step::Failed(e) => {
                    let id = pick(&fleet, e);
                    fail_requests(&mut fleet, id, now);
                }
                Step::Succeeded(e) => {
                    let id = pick(&fleet, e);
                    fleet.upstream_result(id, UpstreamOutcome::Success, now);
                }
                Step::Leave(e) => {
                    let id = pick(&fleet, e);
                    fleet.remove_endpoint(id, now);
                }
                Step::Join => {
                    let at = fleet.endpoints().len();
                    fleet.add_endpoint(fleet_spec(at), now).unwrap();
                }
                Step::Peer(e, blocks) => {
                    let id = pick(&fleet, e);
                    // Every other peer posts its ends (its requests then count as decoding).
                    let shares_end = peers_started % 2 == 0;
                    fleet.peer_prefill_started(
                        peers_started,
                        id,
                        u64::from(blocks) * BS as u64,
                        shares_end,
                        now,
                    );
                    peers_started += 1;
                }
                Step::PeerDone => {
                    fleet.peer_prefill_done(peers_done, now);
                    peers_done += 1;
                }
                Step::PeerEnded => {
                    fleet.peer_request_ended(peers_ended, now);
                    peers_ended += 1;
                }
            }
        }
    }
}

/// In a large idle fleet, a request whose prompt one endpoint holds costs that endpoint and
/// the few least busy of the rest, not every endpoint: the work follows what can win.
#[test]
fn a_plan_costs_the_holders_and_the_least_busy_only() {
    let mut fleet = fleet_of(200, FleetConfig::default());
    // Every endpoint busy with 4 decodes but 20, which are idle.
    for e in 0..200u32 {
        let running = if e % 10 == 0 { 0.0 } else { 4.0 };
        fleet.observe_load(EndpointId(e), decoding(running), 0.0);
    }
    let prompt = tokens(1, 0, 40);
    fleet.apply_events(EndpointId(7), &[stored(&prompt)], 0.0);
    let keys = Arc::new(router_keys(&prompt, BS, None).unwrap());
    let features = request_for(&keys, &prompt);
    let plan = plan_both(&mut fleet, &features, 1, 0.1);
    assert_eq!(plan.decision.chosen(), Some(EndpointId(7)));
    let viewed = fleet.last_plan_viewed();
    assert!(viewed < 40, "{viewed} endpoints viewed of 200");
    // Once the samples expire, the busy ones count only the router's own requests (none):
    // every endpoint is idle and costs the same, and the random tie-break reads them all.
    let plan = plan_both(&mut fleet, &features, 1, 30.0);
    assert_eq!(plan.decision.chosen(), Some(EndpointId(7)));
    assert_eq!(fleet.last_plan_viewed(), 200);
}

/// Endpoints the router once sent the prompt's prefix to, whose events say they hold none of
/// it (trusted events overrule the routing history), are no holders: bounded as holding
/// nothing, the busy ones among them are not costed (the first scale round's P/D decision
/// viewed a hundred such endpoints per request at 1,000 endpoints).
#[test]
fn a_routing_history_that_trusted_events_overrule_makes_no_holder() {
    let config = FleetConfig {
        predicted_ttl_s: 1.0,
        ..FleetConfig::default()
    };
    let mut fleet = fleet_of(200, config);
    let prompt = tokens(1, 30, 40);
    let keys = Arc::new(router_keys(&prompt, BS, None).unwrap());
    let features = request_for(&keys, &prompt);
    // Endpoints 20-139 each served a request sharing the prompt's first 30 blocks.
    for e in 20..140u32 {
        let other = tokens(4, 30, 35);
        let other_keys = Arc::new(router_keys(&other, BS, None).unwrap());
        let request = request_for(&other_keys, &other);
        let plan = fleet.plan(&request, 0, 0.0);
        let mut d = fleet.dispatched(&plan.predicted_cached, &request, EndpointId(e), 0.0);
        fleet.first_token(&mut d, true, 0.01);
        fleet.finished(d, Some(0), 0.02);
    }
    // Later, 20 endpoints are idle, those that served the prefix decode one request each
    // (bounded as holding 30 of the 41 blocks, they would be costed before the idle ones), the
    // rest decode four, and endpoint 7 holds the whole prompt.
    for e in 0..200u32 {
        let running = match e {
            _ if e % 10 == 0 => 0.0,
            20..140 => 1.0,
            _ => 4.0,
        };
        fleet.observe_load(EndpointId(e), decoding(running), 2.0);
    }
    fleet.apply_events(EndpointId(7), &[stored(&prompt)], 2.0);
    let plan = plan_both(&mut fleet, &features, 1, 2.1);
    assert_eq!(plan.decision.chosen(), Some(EndpointId(7)));
    let viewed = fleet.last_plan_viewed();
    assert!(viewed < 40, "{viewed} endpoints viewed of 200");
}

/// A hot prefix held by a dozen endpoints, each busy with a few decodes: each holder is bounded
/// by what it holds, so the holders are costed before the busier endpoints that hold nothing,
/// and every holder within the balance tolerance is costed, beyond the head of the ranking too:
/// the one with no placements wins.
#[test]
fn holders_are_bounded_by_what_they_hold_and_balanced() {
    let mut fleet = fleet_of(100, FleetConfig::default());
    let prompt = tokens(1, 0, 60);
    let prefix = &prompt[..40 * BS];
    let keys = Arc::new(router_keys(&prompt, BS, None).unwrap());
    let features = request_for(&keys, &prompt);
    // Holders 0–11, a little busier each (costs within 4% of each other); the rest busier.
    for e in 0..100u32 {
        let running = if e < 12 {
            2.0 + 0.01 * f64::from(e)
        } else {
            4.0
        };
        fleet.observe_load(EndpointId(e), decoding(running), 0.0);
        if e < 12 {
            fleet.apply_events(EndpointId(e), &[stored(prefix)], 0.0);
        }
    }
    // A placement on each holder but the last.
    for e in 0..11u32 {
        let other = tokens(9 + e as u8, 0, 2);
        let other_keys = Arc::new(router_keys(&other, BS, None).unwrap());
        let request = RequestFeatures {
            keys: &other_keys,
            prompt_tokens: other.len(),
            ..features.clone()
        };
        let plan = fleet.plan(&request, 0, 0.0);
        let mut d = fleet.dispatched(&plan.predicted_cached, &request, EndpointId(e), 0.0);
        fleet.first_token(&mut d, true, 0.01);
        fleet.finished(d, Some(0), 0.02);
    }
    for random in 0..10 {
        let plan = plan_both(&mut fleet, &features, random, 1.0);
        assert_eq!(plan.decision.chosen(), Some(EndpointId(11)));
        assert_eq!(plan.decision.reason, crate::schedule::Reason::Balance);
        let viewed = fleet.last_plan_viewed();
        assert!(viewed < 40, "{viewed} endpoints viewed of 100");
    }
}

/// A picker other than the cheapest reads every candidate: it is never pruned.
#[test]
fn pickers_that_read_every_candidate_are_not_pruned() {
    let specs = (0..20).map(|i| spec(i * 5, MODEL)).collect();
    let profile = Profile {
        picker: Picker::RoundRobin,
        ..Profile::default()
    };
    let mut fleet = Fleet::new(FleetConfig::default(), profile, specs).unwrap();
    let prompt = tokens(1, 0, 4);
    let keys = Arc::new(router_keys(&prompt, BS, None).unwrap());
    let features = request_for(&keys, &prompt);
    let plan = fleet.plan(&features, 3, 0.0);
    assert_eq!(plan.decision.ranking.len(), 20);
    assert_eq!(fleet.last_plan_viewed(), 20);
}

/// A request for `prompt` (keys in `keys`), without a session.
fn request_for<'a>(keys: &'a Arc<Vec<RouterKey>>, prompt: &[u32]) -> RequestFeatures<'a> {
    RequestFeatures {
        model: MODEL,
        keys,
        prompt_tokens: prompt.len(),
        block_size: BS,
        session: None,
        role: Role::Both,
    }
}

/// A load sample of an endpoint decoding `running` requests, none waiting.
fn decoding(running: f64) -> LoadSample {
    LoadSample {
        waiting: Some(0.0),
        running: Some(running),
        kv_usage: Some(0.5),
        num_gpu_blocks: Some(10_000),
    }
}

/// `endpoints` endpoints serving [`MODEL`], each with events, under `config`.
fn fleet_of(endpoints: usize, config: FleetConfig) -> Fleet {
    let specs = (0..endpoints).map(|i| spec(i * 5, MODEL)).collect();
    Fleet::new(config, Profile::default(), specs).unwrap()
}

/// A load sample whose freshness cannot be told (a NaN age limit, or a NaN scrape time) is
/// never fresh for the cost model, so the load order must not count it either: the endpoint it
/// names is as idle as the router's own counts say, and wins.
#[test]
fn a_sample_that_is_never_fresh_does_not_count_in_the_load_order() {
    let mut fleet = fleet_of(
        16,
        FleetConfig {
            load_sample_max_age_s: f64::NAN,
            ..FleetConfig::default()
        },
    );
    let swamped = LoadSample {
        waiting: Some(100.0),
        running: Some(100.0),
        kv_usage: Some(0.5),
        num_gpu_blocks: None,
    };
    fleet.observe_load(EndpointId(0), swamped, 0.0);
    // Every other endpoint has one request of the router's own in flight.
    let mut in_flight = Vec::new();
    for e in 1..16u32 {
        let other = tokens(40 + e as u8, 0, 2);
        let other_keys = Arc::new(router_keys(&other, BS, None).unwrap());
        let request = request_for(&other_keys, &other);
        in_flight.push(fleet.dispatched(&[], &request, EndpointId(e), 0.0));
    }
    let prompt = tokens(1, 0, 20);
    let keys = Arc::new(router_keys(&prompt, BS, None).unwrap());
    let plan = plan_both(&mut fleet, &request_for(&keys, &prompt), 7, 0.5);
    assert_eq!(plan.decision.chosen(), Some(EndpointId(0)));
}

/// A fleet configured with a prior prefill rate that is not a number bounds nothing with it:
/// once rates are observed, the keys are set again with the pooled rate, and every near-equal
/// idle endpoint is still read by balancing.
#[test]
fn a_prior_rate_that_is_not_a_number_bounds_nothing() {
    let mut fleet = fleet_of(
        40,
        FleetConfig {
            default_prefill_tokens_per_s: f64::NAN,
            ..FleetConfig::default()
        },
    );
    // One prefill observed alone on endpoint 0: the fleet's pooled rate from now on.
    let first = tokens(2, 0, 64);
    let first_keys = Arc::new(router_keys(&first, BS, None).unwrap());
    let request = request_for(&first_keys, &first);
    let mut d = fleet.dispatched(&[], &request, EndpointId(0), 0.0);
    fleet.first_token(&mut d, true, 0.05);
    fleet.finished(d, Some(0), 0.1);
    assert!(
        fleet
            .endpoint(EndpointId(0))
            .unwrap()
            .observed_prefill_rate()
            .is_some()
    );
    let prompt = tokens(1, 0, 20);
    let keys = Arc::new(router_keys(&prompt, BS, None).unwrap());
    for random in 0..20 {
        plan_both(&mut fleet, &request_for(&keys, &prompt), random, 1.0);
    }
}

/// Something done to one endpoint of a fleet.
type EndpointStep = Box<dyn Fn(&mut Fleet, EndpointId)>;

/// An endpoint's spec by its number.
type SpecOf = Box<dyn Fn(usize) -> EndpointSpec>;

/// `id`'s health checks fail at `now` until it is taken out.
fn fail_health_checks(fleet: &mut Fleet, id: EndpointId, now: f64) {
    for _ in 0..fleet.config.health.unhealthy_after {
        fleet.health_check(id, false, now);
    }
}

/// Requests sent to `id` fail at `now` until it is ejected.
fn fail_requests(fleet: &mut Fleet, id: EndpointId, now: f64) {
    for _ in 0..fleet.config.outlier.consecutive_failures {
        fleet.upstream_result(id, UpstreamOutcome::Failure, now);
    }
}

/// Views of a plan for a fresh prompt on a fleet of 100 endpoints of [`MODEL`] (endpoint `e`
/// busy with `2 + e % 10` decodes) and `idle` idle endpoints, built by `idle_spec`, that
/// `sideline` (called with each idle one) may take out of competition. Every plan must decide
/// as costing every endpoint.
fn views_beside_idle(
    idle: usize,
    idle_spec: impl Fn(usize) -> EndpointSpec,
    sideline: impl Fn(&mut Fleet, EndpointId),
) -> (usize, Plan) {
    let specs = (0..100)
        .map(|i| spec(i, MODEL))
        .chain((100..100 + idle).map(idle_spec))
        .collect();
    let mut fleet = Fleet::new(FleetConfig::default(), Profile::default(), specs).unwrap();
    for e in 0..100u32 {
        fleet.observe_load(EndpointId(e), decoding(2.0 + f64::from(e % 10)), 0.0);
    }
    for e in 100..(100 + idle) as u32 {
        sideline(&mut fleet, EndpointId(e));
    }
    let prompt = tokens(1, 0, 30);
    let keys = Arc::new(router_keys(&prompt, BS, None).unwrap());
    let plan = plan_both(&mut fleet, &request_for(&keys, &prompt), 3, 0.5);
    (fleet.last_plan_viewed(), plan)
}

/// Idle endpoints that no request of the model can use (another model, another block size,
/// failing health checks, ejected) are not walked: a plan views as many endpoints as without
/// them, though they are the least busy of the fleet.
#[test]
fn endpoints_that_cannot_compete_are_not_viewed() {
    let (alone, plan) = views_beside_idle(0, |i| spec(i, MODEL), |_, _| {});
    assert!(alone < 40, "{alone} endpoints viewed of 100");
    assert!(plan.decision.chosen().is_some_and(|e| e.0 % 10 == 0));
    let shapes: [(&str, SpecOf, EndpointStep); 4] = [
        (
            "another model",
            Box::new(|i| spec(i, "other")),
            Box::new(|_, _| {}),
        ),
        (
            "another block size",
            Box::new(|i| spec_at(i, MODEL, 2 * BS)),
            Box::new(|_, _| {}),
        ),
        (
            "unhealthy",
            Box::new(|i| spec(i, MODEL)),
            Box::new(|fleet, id| fail_health_checks(fleet, id, 0.0)),
        ),
        (
            "ejected",
            Box::new(|i| spec(i, MODEL)),
            Box::new(|fleet, id| fail_requests(fleet, id, 0.0)),
        ),
    ];
    for (shape, idle_spec, sideline) in shapes {
        let (viewed, plan) = views_beside_idle(100, idle_spec, sideline);
        assert_eq!(viewed, alone, "{shape}: endpoints viewed");
        let chosen = plan.decision.chosen().unwrap();
        assert!(chosen.0 < 100, "{shape}: chose {chosen:?}");
    }
}

/// An endpoint taken out of competition returns to its model's order when it recovers: once
/// healthy again, or once its ejection ends, the idle endpoints win again.
#[test]
fn endpoints_return_to_their_order_when_they_recover() {
    let recover: [(&str, EndpointStep, EndpointStep, f64); 2] = [
        (
            "health",
            Box::new(|fleet, id| fail_health_checks(fleet, id, 0.0)),
            Box::new(|fleet, id| {
                for _ in 0..fleet.config.health.healthy_after {
                    fleet.health_check(id, true, 0.2);
                }
            }),
            0.5,
        ),
        (
            "ejection",
            Box::new(|fleet, id| fail_requests(fleet, id, 0.0)),
            Box::new(|_, _| {}),
            FleetConfig::default().outlier.base_ejection_s,
        ),
    ];
    for (shape, fail, restore, at) in recover {
        let specs = (0..40).map(|i| spec(i, MODEL)).collect();
        let mut fleet = Fleet::new(FleetConfig::default(), Profile::default(), specs).unwrap();
        for e in 4..40u32 {
            fleet.observe_load(EndpointId(e), decoding(4.0), 0.0);
        }
        let prompt = tokens(1, 0, 30);
        let keys = Arc::new(router_keys(&prompt, BS, None).unwrap());
        fail(&mut fleet, EndpointId(3));
        let plan = plan_both(&mut fleet, &request_for(&keys, &prompt), 3, 0.1);
        assert!(plan.decision.chosen().is_some_and(|e| e.0 < 3), "{shape}");
        restore(&mut fleet, EndpointId(3));
        // Its load is not touched: only its recovery returns it.
        let mut chosen = std::collections::BTreeSet::new();
        for draw in 0..40u64 {
            let random = draw.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            let plan = plan_both(&mut fleet, &request_for(&keys, &prompt), random, at);
            chosen.insert(plan.decision.chosen().unwrap().0);
        }
        assert!(
            chosen.contains(&3),
            "{shape}: idle endpoints chosen {chosen:?}"
        );
    }
}

/// A load sample of an endpoint decoding `running` requests with one queued, its cache at
/// `kv_usage` (0.95 or more saturates it).
fn queued(kv_usage: f64, running: f64) -> LoadSample {
    LoadSample {
        waiting: Some(1.0),
        kv_usage: Some(kv_usage),
        ..decoding(running)
    }
}

/// In a saturated fleet (every cache full, requests queued) a plan views as many endpoints as
/// in the same fleet unsaturated: that every competitor is saturated is known without viewing
/// them all. One unsaturated endpoint, however busy, says the fleet is not saturated, and is
/// viewed once to tell.
#[test]
fn a_saturated_fleet_is_pruned() {
    let prompt = tokens(1, 0, 30);
    let keys = Arc::new(router_keys(&prompt, BS, None).unwrap());
    let features = request_for(&keys, &prompt);
    let mut viewed = Vec::new();
    let mut fleets = Vec::new();
    for kv_usage in [0.5, 0.97] {
        let mut fleet = fleet_of(200, FleetConfig::default());
        for e in 0..200u32 {
            fleet.observe_load(
                EndpointId(e),
                queued(kv_usage, 2.0 + f64::from(e % 10)),
                0.0,
            );
        }
        let plan = plan_both(&mut fleet, &features, 3, 0.5);
        assert_eq!(plan.decision.saturated, kv_usage > 0.95);
        viewed.push(fleet.last_plan_viewed());
        fleets.push(fleet);
    }
    assert!(viewed[0] < 100, "{} endpoints viewed of 200", viewed[0]);
    assert_eq!(viewed[1], viewed[0], "endpoints viewed, saturated");
    // Endpoint 199 decodes more than any but its cache has room: not saturated.
    let fleet = &mut fleets[1];
    fleet.observe_load(EndpointId(199), queued(0.5, 40.0), 0.5);
    let plan = plan_both(fleet, &features, 3, 0.6);
    assert!(!plan.decision.saturated);
    assert_ne!(plan.decision.chosen(), Some(EndpointId(199)));
    assert_eq!(fleet.last_plan_viewed(), viewed[0] + 1);
}

/// A fleet of prefill and decode roles is pruned too: its plan ranks the best of each role and
/// views far fewer than every endpoint. Its decoders all saturated (full caches, requests
/// queued) hold the request, however idle its producers; one decoder with room, however busy
/// (so costlier than the head of the decoders, and not costed), says they are not.
#[test]
fn a_pd_fleet_is_pruned_and_held_only_when_its_decoders_are_saturated() {
    let prompt = tokens(1, 0, 30);
    let keys = Arc::new(router_keys(&prompt, BS, None).unwrap());
    let features = request_for(&keys, &prompt);
    let roles = [Role::Prefill, Role::Decode, Role::Both];
    let specs = (0..200)
        .map(|i| EndpointSpec {
            role: roles[i % 3],
            ..spec(i, MODEL)
        })
        .collect();
    let mut fleet = Fleet::new(FleetConfig::default(), Profile::default(), specs).unwrap();
    fleet.enable_disagg(pd_config());
    for e in 0..200u32 {
        let sample = match roles[e as usize % 3] {
            Role::Prefill => decoding(0.0),
            _ => queued(0.97, 2.0 + f64::from(e % 10)),
        };
        fleet.observe_load(EndpointId(e), sample, 0.0);
    }
    let plan = plan_both(&mut fleet, &features, 3, 0.5);
    assert!(plan.decision.saturated, "every decoder is saturated");
    let depth = crate::fleet::RANKING_DEPTH;
    for fits in [Role::decodes as fn(Role) -> bool, Role::prefills] {
        let ranked = plan.decision.ranking.iter();
        let of_role = ranked.filter(|e| fits(roles[e.0 as usize % 3])).count();
        assert!(of_role >= depth, "{:?}", plan.decision.ranking);
    }
    let viewed = fleet.last_plan_viewed();
    assert!(viewed < 100, "{viewed} endpoints viewed of 200");
    // Endpoint 199 (decode-only) decodes more than any but its cache has room.
    assert_eq!(roles[199 % 3], Role::Decode);
    fleet.observe_load(EndpointId(199), queued(0.5, 200.0), 0.5);
    let plan = plan_both(&mut fleet, &features, 3, 0.6);
    assert!(!plan.decision.saturated, "a decoder has room");
    assert!(!plan.decision.ranking.contains(&EndpointId(199)));
    assert_eq!(fleet.last_plan_viewed(), viewed + 1);
}

/// A P/D fleet with fewer producers than a role's head holds (4 of 200 endpoints): the walk
/// cannot end a stream before it has met them all, but it passes over the decoders past their
/// own role's stop without viewing them, so the plan views a few dozen endpoints, not all.
#[test]
fn a_role_with_fewer_members_than_its_head_does_not_make_a_plan_view_everything() {
    let prompt = tokens(1, 0, 30);
    let keys = Arc::new(router_keys(&prompt, BS, None).unwrap());
    let features = request_for(&keys, &prompt);
    let role = |i: usize| if i < 4 { Role::Prefill } else { Role::Decode };
    let specs = (0..200)
        .map(|i| EndpointSpec {
            role: role(i),
            ..spec(i, MODEL)
        })
        .collect();
    let mut fleet = Fleet::new(FleetConfig::default(), Profile::default(), specs).unwrap();
    fleet.enable_disagg(pd_config());
    for e in 0..200u32 {
        let running = if e < 4 { 0.0 } else { f64::from(1 + e % 7) };
        fleet.observe_load(EndpointId(e), decoding(running), 0.0);
    }
    let plan = plan_both(&mut fleet, &features, 3, 0.5);
    for producer in 0..4 {
        assert!(plan.decision.ranking.contains(&EndpointId(producer)));
    }
    let viewed = fleet.last_plan_viewed();
    assert!(viewed < 80, "{viewed} endpoints viewed of 200");
}

/// Endpoints ejected while they hold the prompt (an ejection keeps the engine's cache) are not
/// viewed either: a plan views as many as if they held nothing.
#[test]
fn ejected_holders_are_not_viewed() {
    // The prompt `views_beside_idle` plans.
    let prompt = tokens(1, 0, 30);
    let mut viewed = Vec::new();
    for hold in [false, true] {
        let (count, plan) = views_beside_idle(
            40,
            |i| spec(i, MODEL),
            |fleet, id| {
                if hold {
                    fleet.apply_events(id, &[stored(&prompt)], 0.0);
                }
                fail_requests(fleet, id, 0.0);
            },
        );
        assert!(plan.decision.chosen().is_some_and(|e| e.0 < 100));
        viewed.push(count);
    }
    assert_eq!(viewed[1], viewed[0], "endpoints viewed");
}
