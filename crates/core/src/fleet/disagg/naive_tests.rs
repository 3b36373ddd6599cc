//! The P/D decision computed once per plan gives the very plan and choice of the path it
//! replaced, kept here as the naive model: every role's candidates costed again to rank them,
//! each NIC's backlog summed per candidate, each pair's link read three times. Randomized fleets
//! (roles, loads, cached prefixes, transfers in flight, learned and quarantined links).

use std::sync::Arc;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;
use crate::fleet::{EndpointSpec, FleetConfig, LoadSample, RANKING_DEPTH, RequestFeatures};
use crate::keys::router_keys;
use crate::schedule::disagg::{
    AggregatedOption, DisaggChoice, LinkHealth, PdOption, stall_at_decode_rate,
};
use crate::schedule::{
    Assessment, Candidate, Decision, Profile, ProfileName, RankBuffers, RequestInfo, assess, cost,
    rejection, schedule_near_best, tie_key,
};

const BS: usize = 16;

/// The ranking of each role's head, the naive way: every competing candidate costed again per
/// role, in cost order, exact ties broken by the request's random key (as the fleet ranks).
fn naive_rank_roles(
    profile: &Profile,
    request: &RequestInfo,
    candidates: &[Candidate],
    decision: &mut Decision,
    depth: usize,
    random: u64,
) {
    let order = |(total, at): (f64, usize)| (total, tie_key(random, candidates[at].endpoint.0));
    let by_cost = |a: &(f64, usize), b: &(f64, usize)| {
        let (a, b) = (order(*a), order(*b));
        a.0.total_cmp(&b.0).then(a.1.cmp(&b.1))
    };
    let mut added: Vec<(f64, usize)> = Vec::new();
    for role_fits in [Role::decodes as fn(Role) -> bool, Role::prefills] {
        let mut best: Vec<(f64, usize)> = candidates
            .iter()
            .enumerate()
            .filter(|(_, c)| role_fits(c.role) && rejection(profile, request, c).is_none())
            .map(|(at, c)| (cost::assess(profile, request, c).0.total_s, at))
            .collect();
        best.sort_by(by_cost);
        best.truncate(depth);
        for (total, at) in best {
            let ranked = decision.ranking.contains(&candidates[at].endpoint);
            if !ranked && !added.iter().any(|(_, a)| *a == at) {
                added.push((total, at));
            }
        }
    }
    added.sort_by(by_cost);
    for (_, at) in added {
        let c = &candidates[at];
        decision.ranking.push(c.endpoint);
        decision.assessments.push(assess(profile, request, c));
    }
    decision.assessments.sort_by_key(|a| a.endpoint);
}

/// A NIC's backlog as it was: a pass over the transfers per endpoint.
fn naive_backlog(state: &DisaggState, endpoint: EndpointId, now: f64) -> f64 {
    state
        .transfers
        .values()
        .filter(|t| (t.prefill == endpoint || t.decode == endpoint) && t.queued(now))
        .map(|t| t.bytes)
        .sum()
}

/// The P/D choice as it was: sides one by one, each pair's health, bandwidth and transfer time
/// read separately.
fn naive_plan_disagg(
    fleet: &Fleet,
    plan: &Plan,
    decode: EndpointId,
    prompt_tokens: usize,
    now: f64,
) -> Option<DisaggExplain> {
    let state = fleet.disagg.as_ref()?;
    let side = |e: EndpointId| {
        plan.decision.assessment(e).map(|a| SideCost {
            endpoint: e,
            cost: a.cost.clone(),
            cached_tokens: a.cached_tokens,
            link_backlog_bytes: naive_backlog(state, e, now),
            queue_inflow: state.inflow_rate(e, now),
        })
    };
    let decode_side = side(decode)?;
    let prefills: Vec<SideCost> = fleet
        .prefill_candidates(plan, decode)
        .into_iter()
        .filter_map(side)
        .collect();
    let links = &state.links;
    let d = &decode_side.cost;
    let aggregated = AggregatedOption {
        endpoint: decode,
        queue_s: d.queue_s,
        prefill_s: d.prefill_s,
        tier_load_s: d.tier_load_s,
        decode_interference_s: d.decode_interference_s,
        total_s: d.queue_s + d.prefill_s + d.tier_load_s + d.decode_interference_s,
    };
    let pulled = (prompt_tokens / BS).saturating_sub(decode_side.cached_tokens / BS);
    let transfer_tokens = pulled * BS;
    let transfer_bytes = transfer_tokens as f64 * state.config.kv_bytes_per_token;
    let mut options: Vec<PdOption> = prefills
        .iter()
        .map(|p| {
            let link = links.health(p.endpoint, decode, now);
            let backlog = p
                .link_backlog_bytes
                .max(decode_side.link_backlog_bytes)
                .max(0.0);
            let transfer_s = if transfer_bytes > 0.0 {
                links.transfer_s(p.endpoint, decode, transfer_bytes + backlog, now)
            } else {
                0.0
            };
            let c = &p.cost;
            let stall_s = stall_at_decode_rate(prompt_tokens, &decode_side, p);
            let ready_s = c.queue_s + c.prefill_s + c.tier_load_s + transfer_s;
            let inflow = decode_side.queue_inflow.max(0.0);
            let decode_wait_s = (d.queue_s + (inflow - 1.0) * ready_s).max(0.0);
            PdOption {
                prefill: p.endpoint,
                decode,
                prefill_queue_s: c.queue_s,
                prefill_s: c.prefill_s,
                prefill_tier_load_s: c.tier_load_s,
                prefill_interference_s: stall_s,
                transfer_tokens,
                transfer_bytes,
                link_backlog_bytes: backlog,
                bandwidth_bytes_per_s: links.bandwidth(p.endpoint, decode, now),
                link,
                transfer_s,
                decode_queue_s: decode_wait_s,
                leg_overhead_s: state.config.leg_overhead_s,
                total_s: ready_s + decode_wait_s + stall_s + state.config.leg_overhead_s,
                eligible: !matches!(link, LinkHealth::Quarantined { .. }),
            }
        })
        .collect();
    options.sort_by(|a, b| {
        b.eligible
            .cmp(&a.eligible)
            .then(a.total_s.total_cmp(&b.total_s))
            .then(a.prefill.cmp(&b.prefill))
    });
    let (choice, chosen_s) = match options.first() {
        Some(best) if best.eligible && best.total_s < aggregated.total_s => (
            DisaggChoice::Disaggregated {
                prefill: best.prefill,
            },
            best.total_s,
        ),
        _ => (DisaggChoice::Aggregated, aggregated.total_s),
    };
    Some(DisaggExplain {
        choice,
        chosen_s,
        aggregated,
        disaggregated: options,
    })
}

fn random_fleet(rng: &mut StdRng) -> Fleet {
    let n = rng.random_range(3..40);
    let specs = (0..n)
        .map(|i| EndpointSpec {
            name: format!("e{i}"),
            models: vec!["m".into()],
            role: [Role::Prefill, Role::Decode, Role::Both][rng.random_range(0..3)],
            has_events: true,
            block_size: BS,
            offload: Default::default(),
        })
        .collect();
    let mut fleet = Fleet::new(
        FleetConfig::default(),
        Profile::named(ProfileName::Precise),
        specs,
    )
    .unwrap();
    // The naive path reads every candidate of the plan: cost them all.
    fleet.prune_costing(false);
    let link = ["tcp", "roce-100", "ib-400"][rng.random_range(0..3)];
    fleet.enable_disagg(DisaggConfig {
        link: LinkPrior::parse(link).unwrap(),
        learning: LinkLearning::default(),
        kv_bytes_per_token: 131_072.0,
        leg_overhead_s: 0.005,
    });
    fleet
}

fn prompt_keys(conversation: u32, tokens: usize) -> Arc<Vec<crate::keys::RouterKey>> {
    let prompt: Vec<u32> = (0..tokens as u32)
        .map(|t| conversation * 1_000_000 + t)
        .collect();
    Arc::new(router_keys(&prompt, BS, None).unwrap())
}

#[test]
fn plans_and_choices_match_the_naive_path_on_random_fleets() {
    let mut disaggregated = 0;
    for seed in 0..120 {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut fleet = random_fleet(&mut rng);
        let n = fleet.endpoints.len() as u32;
        let mut now = 0.0;
        for step in 0..60u64 {
            now += rng.random_range(0.0..0.2);
            if rng.random_bool(0.3) {
                for e in 0..n {
                    let sample = LoadSample {
                        waiting: Some(rng.random_range(0.0..6.0_f64).floor()),
                        running: Some(rng.random_range(0.0..40.0_f64).floor()),
                        kv_usage: Some(rng.random_range(0.0..1.0)),
                        num_gpu_blocks: Some(4000),
                    };
                    fleet.observe_load(EndpointId(e), sample, now);
                }
            }
            let tokens = rng.random_range(16..9000);
            let keys = prompt_keys(rng.random_range(0..6), tokens);
            let features = RequestFeatures {
                model: "m",
                keys: &keys,
                prompt_tokens: tokens,
                block_size: BS,
                session: None,
                role: Role::Both,
            };
            let random = rng.random();
            let plan = fleet.plan(&features, random, now);
            // The naive path on the same candidates, random key and round.
            let depth = RANKING_DEPTH
                .max(usize::try_from(fleet.config.retry.max_attempts).unwrap_or(usize::MAX));
            let info = RequestInfo {
                prompt_tokens: tokens,
                block_size: BS,
                session_endpoint: None,
                role: Role::Both,
                prefix_key: None,
                gpu_copies: Default::default(),
            };
            let mut naive = schedule_near_best(
                &fleet.profile,
                &info,
                &fleet.candidates,
                random,
                fleet.round_robin,
                depth,
                &mut RankBuffers::default(),
            );
            naive_rank_roles(
                &fleet.profile,
                &info,
                &fleet.candidates,
                &mut naive,
                depth,
                random,
            );
            // Saturation as P/D reads it: over the decode-capable competitors, when any.
            let decoders: Vec<Assessment> = fleet
                .candidates
                .iter()
                .filter(|c| c.role.decodes())
                .map(|c| assess(&fleet.profile, &info, c))
                .filter(|a| a.rejected.is_none())
                .collect();
            if !decoders.is_empty() {
                naive.saturated = decoders.iter().all(|a| a.saturated);
            }
            assert_eq!(plan.decision, naive, "seed {seed} step {step}");
            let Some(decode) = fleet.decode_pick(&plan) else {
                continue;
            };
            let explain = fleet.plan_disagg(&plan, decode, tokens, BS, now);
            assert_eq!(
                explain,
                naive_plan_disagg(&fleet, &plan, decode, tokens, now),
                "seed {seed} step {step}"
            );
            // Act on it: dispatch, a transfer in flight, some ending, learned or failing.
            let explain = explain.unwrap();
            let prefill = match explain.choice {
                DisaggChoice::Disaggregated { prefill } => {
                    disaggregated += 1;
                    prefill
                }
                DisaggChoice::Aggregated => match explain.disaggregated.first() {
                    Some(o) if rng.random_bool(0.5) => o.prefill,
                    _ => {
                        fleet.dispatched(&plan.predicted_cached, &features, decode, now);
                        continue;
                    }
                },
            };
            fleet.prefill_sent(&plan, prefill, now);
            fleet.dispatched(&plan.predicted_cached, &features, prefill, now);
            let cached = plan.predicted_cached[decode.0 as usize];
            let bytes = fleet.transfer_started(step, (prefill, decode), tokens, cached, BS, now);
            match rng.random_range(0..4) {
                0 => fleet.transfer_unobserved(step, now),
                1 => {
                    let seconds = rng.random_range(0.0..2.0);
                    fleet.observe_transfer(step, (prefill, decode), bytes, seconds, now);
                }
                2 => fleet.observe_failure(step, (prefill, decode), now),
                _ => {}
            }
        }
    }
    assert!(
        disaggregated > 100,
        "the fleets disaggregate: {disaggregated}"
    );
}
