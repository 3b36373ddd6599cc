//! The fleet's P/D call on a small fleet with a manual clock: who may decode and prefill, the
//! link state it prices with, and what the caller's reports change.

use std::sync::Arc;

use super::*;
use crate::fleet::{EndpointSpec, FleetConfig, RequestFeatures};
use crate::keys::router_keys;
use crate::schedule::disagg::{DisaggChoice, LinkHealth, LinkLearning};
use crate::schedule::{Profile, ProfileName};

const BS: usize = 16;

/// A fleet of one endpoint per role, `e0`, `e1`, …, all serving model `m`.
pub(super) fn fleet(roles: &[Role]) -> Fleet {
    let specs = roles
        .iter()
        .enumerate()
        .map(|(i, role)| EndpointSpec {
            name: format!("e{i}"),
            models: vec!["m".into()],
            role: *role,
            has_events: true,
            block_size: BS,
            offload: Default::default(),
        })
        .collect();
    Fleet::new(
        FleetConfig::default(),
        Profile::named(ProfileName::Precise),
        specs,
    )
    .unwrap()
}

/// P/D pricing over the `link` preset.
pub(super) fn config(link: &str) -> DisaggConfig {
    DisaggConfig {
        link: LinkPrior::parse(link).unwrap(),
        learning: LinkLearning::default(),
        kv_bytes_per_token: 131_072.0,
        leg_overhead_s: 0.005,
    }
}

/// The plan of a fresh prompt of `tokens` tokens at time 0.
pub(super) fn plan(fleet: &mut Fleet, tokens: usize) -> Plan {
    plan_at(fleet, tokens, 0.0)
}

fn plan_at(fleet: &mut Fleet, tokens: usize, now: f64) -> Plan {
    let prompt: Vec<u32> = (0..tokens as u32).collect();
    let keys = Arc::new(router_keys(&prompt, BS, None).unwrap());
    let features = RequestFeatures {
        model: "m",
        keys: &keys,
        prompt_tokens: tokens,
        block_size: BS,
        session: None,
        role: Role::Both,
    };
    fleet.plan(&features, 7, now)
}

#[test]
fn off_until_enabled_and_only_decoders_decode() {
    let mut f = fleet(&[Role::Prefill, Role::Decode, Role::Both]);
    let p = plan(&mut f, 4096);
    let decode = f.decode_pick(&p).unwrap();
    assert_ne!(
        decode,
        EndpointId(0),
        "a prefill-only endpoint never decodes"
    );
    assert!(f.plan_disagg(&p, decode, 4096, BS, 0.0).is_none());
    assert!(f.links().is_none());
    f.enable_disagg(config("ib-400"));
    let explain = f.plan_disagg(&p, decode, 4096, BS, 0.0).unwrap();
    let candidates = f.prefill_candidates(&p, decode);
    assert!(candidates.contains(&EndpointId(0)));
    assert!(!candidates.contains(&decode));
    assert!(!candidates.contains(&EndpointId(1)) || decode == EndpointId(1));
    assert_eq!(explain.disaggregated.len(), candidates.len());
    assert_eq!(explain.aggregated.endpoint, decode);
}

#[test]
fn transfers_queue_on_both_nics_until_they_end() {
    let mut f = fleet(&[Role::Prefill, Role::Prefill, Role::Decode]);
    f.enable_disagg(config("tcp"));
    let (p0, p1, d) = (EndpointId(0), EndpointId(1), EndpointId(2));
    let bytes = f.transfer_started(1, (p0, d), 1000, 0, BS, 0.0);
    // 62 full blocks move.
    assert_eq!(bytes, 992.0 * 131_072.0);
    let p = plan(&mut f, 2048);
    let explain = f.plan_disagg(&p, d, 2048, BS, 0.0).unwrap();
    // Both prefill candidates share the decode endpoint's NIC: the backlog is ahead of each.
    for option in &explain.disaggregated {
        assert_eq!(option.link_backlog_bytes, bytes, "{option:?}");
    }
    // A second transfer into the same NIC waits behind the first; it learns only its share.
    let second = f.transfer_started(2, (p1, d), 1000, 0, BS, 0.0);
    assert_eq!(f.transfer_ended(2), bytes);
    assert_eq!(f.transfer_ended(1), 0.0);
    assert_eq!(f.transfer_ended(1), 0.0, "ending twice changes nothing");
    let explain = f.plan_disagg(&p, d, 2048, BS, 0.0).unwrap();
    assert!(
        explain
            .disaggregated
            .iter()
            .all(|o| o.link_backlog_bytes == 0.0)
    );
    assert!(second > 0.0);
}

#[test]
fn observed_transfers_teach_the_pair_and_failures_quarantine_it() {
    let mut f = fleet(&[Role::Prefill, Role::Decode]);
    f.enable_disagg(config("tcp"));
    let link = (EndpointId(0), EndpointId(1));
    let prior = f.links().unwrap().bandwidth(link.0, link.1, 0.0);
    // A transfer twice as fast as the preset: the pair's bandwidth is learned.
    let bytes = f.transfer_started(1, link, 4096, 0, BS, 0.0);
    f.observe_transfer(1, link, bytes, bytes / prior / 2.0 + 1e-3, 1.0);
    let learned = f.links().unwrap().bandwidth(link.0, link.1, 1.0);
    assert!(learned > 1.5 * prior, "{learned} vs {prior}");
    for (i, now) in [2.0, 3.0, 4.0].into_iter().enumerate() {
        f.transfer_started(10 + i as u64, link, 4096, 0, BS, 0.0);
        f.observe_failure(10 + i as u64, link, now);
    }
    assert!(matches!(
        f.links().unwrap().health(link.0, link.1, 4.0),
        LinkHealth::Quarantined { .. }
    ));
    let p = plan(&mut f, 4096);
    let explain = f.plan_disagg(&p, link.1, 4096, BS, 4.0).unwrap();
    assert!(!explain.disaggregated[0].eligible);
    assert_eq!(explain.choice, DisaggChoice::Aggregated);
    // The pair's backlog left with the failures.
    assert_eq!(explain.disaggregated[0].link_backlog_bytes, 0.0);
    // An endpoint that leaves takes its pairs with it.
    f.remove_endpoint(link.0, 5.0);
    assert_eq!(
        f.links().unwrap().health(link.0, link.1, 5.0),
        LinkHealth::Healthy { samples: 0 }
    );
}

#[test]
fn a_transfer_whose_endpoint_left_teaches_nothing_to_the_endpoint_that_takes_its_slot() {
    let mut f = fleet(&[Role::Prefill, Role::Decode]);
    f.enable_disagg(config("tcp"));
    let link = (EndpointId(0), EndpointId(1));
    let prior = f.links().unwrap().bandwidth(link.0, link.1, 0.0);
    // Transfers from the prefill endpoint are in flight when its pod goes away.
    let bytes = f.transfer_started(1, link, 4096, 0, BS, 0.0);
    for id in 10..13 {
        f.transfer_started(id, link, 4096, 0, BS, 0.0);
    }
    f.remove_endpoint(link.0, 0.5);
    // Reported before the slot is reused: nothing to teach, the pair is gone.
    f.observe_failure(10, link, 0.6);
    // A new pod takes the slot once it may; the old transfers' reports arrive after.
    let t = 0.5 + FleetConfig::default().slot_reuse_after_s;
    let spec = EndpointSpec {
        name: "new".into(),
        models: vec!["m".into()],
        role: Role::Prefill,
        has_events: true,
        block_size: BS,
        offload: Default::default(),
    };
    assert_eq!(
        f.add_endpoint(spec, t).unwrap(),
        link.0,
        "the slot is reused"
    );
    f.observe_transfer(1, link, bytes, 100.0 * bytes / prior, t + 0.5);
    f.observe_failure(11, link, t + 1.0);
    f.observe_failure(12, link, t + 2.0);
    let links = f.links().unwrap();
    assert_eq!(links.bandwidth(link.0, link.1, t + 2.0), prior);
    assert_eq!(
        links.health(link.0, link.1, t + 2.0),
        LinkHealth::Healthy { samples: 0 }
    );
    // Each report ended its transfer.
    assert_eq!(f.transfers_tracked(), 0);
    // The new pod's own transfers teach its pair.
    let bytes = f.transfer_started(2, link, 4096, 0, BS, t + 3.0);
    f.observe_transfer(2, link, bytes, 2.0 * bytes / prior, t + 4.0);
    assert!(f.links().unwrap().bandwidth(link.0, link.1, t + 4.0) < prior);
}

#[test]
fn the_inflow_is_the_recent_work_per_second_and_fades() {
    let mut state = DisaggState::new(config("tcp"));
    let (a, b) = (EndpointId(0), EndpointId(1));
    assert_eq!(state.inflow_rate(a, 0.0), 0.0);
    // One window's worth of work in one window: it arrives about as fast as it drains.
    for i in 0..50 {
        state.record_inflow(a, 0.1, f64::from(i) * 0.1);
    }
    let rate = state.inflow_rate(a, 5.0);
    assert!((0.5..1.0).contains(&rate), "{rate}");
    // Nothing more arrives: it fades, and other endpoints never saw any.
    assert!(state.inflow_rate(a, 30.0) < 0.01);
    assert_eq!(state.inflow_rate(b, 5.0), 0.0);
    // An endpoint that leaves is forgotten.
    state.forget(a);
    assert_eq!(state.inflow_rate(a, 5.0), 0.0);
}

#[test]
fn the_prefill_work_counts_where_it_is_sent_not_where_it_was_priced() {
    let mut f = fleet(&[Role::Prefill, Role::Both]);
    f.enable_disagg(config("tcp"));
    let (prefill, decode) = (EndpointId(0), EndpointId(1));
    let p = plan(&mut f, 8192);
    // Over tcp an 8k prompt stays aggregated by cost; pricing it records nothing.
    let explain = f.plan_disagg(&p, decode, 8192, BS, 0.0).unwrap();
    assert_eq!(explain.choice, DisaggChoice::Aggregated);
    let state = f.disagg.as_ref().unwrap();
    assert_eq!(state.inflow_rate(decode, 0.0), 0.0);
    // `pd.mode: always` sends it to the prefill endpoint: the work reaches that one only.
    f.prefill_sent(&p, prefill, 0.0);
    let state = f.disagg.as_ref().unwrap();
    assert!(state.inflow_rate(prefill, 0.0) > 0.0);
    assert_eq!(state.inflow_rate(decode, 0.0), 0.0);
    // Its prefill failed: the decode endpoint computes it again, and that counts there.
    f.prefill_sent(&p, decode, 0.0);
    assert!(f.disagg.as_ref().unwrap().inflow_rate(decode, 0.0) > 0.0);
}

#[test]
fn a_transfer_whose_end_is_not_seen_leaves_the_nics_when_the_link_predicts_it_done() {
    let mut f = fleet(&[Role::Prefill, Role::Decode]);
    f.enable_disagg(config("tcp"));
    let (p0, d) = (EndpointId(0), EndpointId(1));
    let bytes = f.transfer_started(1, (p0, d), 4096, 0, BS, 0.0);
    f.transfer_unobserved(1, 0.0);
    let predicted = f.links().unwrap().transfer_s(p0, d, bytes, 0.0);
    let backlog = |f: &mut Fleet, now: f64| {
        let p = plan_at(f, 2048, now);
        f.plan_disagg(&p, d, 2048, BS, now).unwrap().disaggregated[0].link_backlog_bytes
    };
    assert_eq!(
        backlog(&mut f, predicted / 2.0),
        bytes,
        "the pull is under way"
    );
    assert_eq!(backlog(&mut f, predicted * 1.01), 0.0, "the pull is over");
    // A second transfer then has nothing ahead of it, and an observed one stays until it ends.
    let second = f.transfer_started(2, (p0, d), 4096, 0, BS, predicted * 1.01);
    assert_eq!(f.transfer_ended(2), 0.0);
    assert!(second > 0.0);
    f.transfer_started(3, (p0, d), 4096, 0, BS, 0.0);
    assert_eq!(backlog(&mut f, 50.0), bytes);
    // Until it expires: its end was lost (the one predicted done was not).
    assert_eq!(backlog(&mut f, 1e6), 0.0);
    f.transfer_started(4, (p0, d), 4096, 0, BS, 1e6);
    assert_eq!(
        f.take_transfers_dropped(),
        TransfersDropped {
            expired: 1,
            evicted: 0
        }
    );
}

#[test]
fn a_large_fleet_ranks_the_head_of_each_role_not_every_candidate() {
    let roles: Vec<Role> = (0..48)
        .map(|i| {
            if i % 4 == 0 {
                Role::Decode
            } else {
                Role::Prefill
            }
        })
        .collect();
    let mut f = fleet(&roles);
    f.enable_disagg(config("ib-400"));
    let p = plan(&mut f, 4096);
    let depth = crate::fleet::RANKING_DEPTH;
    assert!(
        p.decision.assessments.len() < roles.len(),
        "{} breakdowns: every candidate's",
        p.decision.assessments.len()
    );
    let ranked = |fits: fn(Role) -> bool| {
        p.decision
            .ranking
            .iter()
            .filter(|e| fits(roles[e.0 as usize]))
            .count()
    };
    assert!(ranked(Role::decodes) >= depth, "{:?}", p.decision.ranking);
    assert!(ranked(Role::prefills) >= depth, "{:?}", p.decision.ranking);
    // Every ranked endpoint is broken down, and pairing finds its options among them.
    for e in &p.decision.ranking {
        assert!(p.decision.assessment(*e).is_some());
    }
    let decode = f.decode_pick(&p).unwrap();
    let explain = f.plan_disagg(&p, decode, 4096, BS, 0.0).unwrap();
    assert!(explain.disaggregated.len() >= depth);
}

#[test]
fn transfers_whose_end_is_never_reported_expire_and_their_backlog_goes() {
    let mut f = fleet(&[Role::Prefill, Role::Decode]);
    f.enable_disagg(config("roce-100"));
    let link = (EndpointId(0), EndpointId(1));
    // A flood of transfers nobody reports over (a lost end each).
    for id in 0..1000 {
        f.transfer_started(id, link, 2048, 0, BS, f64::from(id as u32) * 1e-3);
    }
    let p = plan(&mut f, 2048);
    assert!(
        f.plan_disagg(&p, link.1, 2048, BS, 1.0)
            .unwrap()
            .disaggregated[0]
            .link_backlog_bytes
            > 0.0
    );
    assert_eq!(f.take_transfers_dropped(), TransfersDropped::default());
    // Past each one's expiry (ten times its predicted time behind those ahead of it: 1,000 ×
    // 268 MB at 12.1 GB/s is 22 s, 220 s for the last): their bytes are no backlog, and the
    // next start sweeps them, counted.
    let later = 1000.0;
    let p = plan_at(&mut f, 2048, later);
    let explain = f.plan_disagg(&p, link.1, 2048, BS, later).unwrap();
    assert_eq!(explain.disaggregated[0].link_backlog_bytes, 0.0);
    f.transfer_started(5000, link, 2048, 0, BS, later);
    assert_eq!(f.transfers_tracked(), 1);
    assert_eq!(
        f.take_transfers_dropped(),
        TransfersDropped {
            expired: 1000,
            evicted: 0
        }
    );
    assert_eq!(
        f.take_transfers_dropped(),
        TransfersDropped::default(),
        "taken once"
    );
    // One whose end is reported is not dropped.
    f.transfer_ended(5000);
    f.transfer_started(5001, link, 2048, 0, BS, later + TRANSFER_EXPIRY_FLOOR_S);
    assert_eq!(f.take_transfers_dropped(), TransfersDropped::default());
}

#[test]
fn the_transfers_tracked_stay_bounded_under_a_flood() {
    let mut f = fleet(&[Role::Prefill, Role::Decode]);
    f.enable_disagg(config("tcp"));
    // A smaller cap than MAX_TRANSFERS, for a quick test: each start reads every transfer.
    let cap = 2000;
    f.disagg.as_mut().unwrap().max_transfers = cap;
    let link = (EndpointId(0), EndpointId(1));
    let flood = cap as u64 + 500;
    for id in 0..flood {
        // All within the expiry: only the cap bounds them.
        f.transfer_started(id, link, 32, 0, BS, id as f64 * 1e-6);
        assert!(f.transfers_tracked() <= cap);
    }
    assert_eq!(f.transfers_tracked(), cap);
    assert_eq!(
        f.take_transfers_dropped(),
        TransfersDropped {
            expired: 0,
            evicted: 500
        }
    );
    // The oldest went: the first ids are no longer tracked, the last are.
    assert_eq!(f.transfer_ended(0), 0.0);
    assert!(
        f.transfer_ended(flood - 1) > 0.0,
        "the newest waits behind the others"
    );
}

/// An id may be used again once its transfer ended (ids are unique among those in flight): at
/// the cap the oldest transfer in flight goes, not the newest that reuses an ended one's id.
#[test]
fn at_the_cap_the_oldest_goes_even_when_an_id_is_used_again() {
    let mut f = fleet(&[Role::Prefill, Role::Decode]);
    f.enable_disagg(config("tcp"));
    f.disagg.as_mut().unwrap().max_transfers = 3;
    let link = (EndpointId(0), EndpointId(1));
    f.transfer_started(1, link, 2048, 0, BS, 0.0);
    f.transfer_started(2, link, 2048, 0, BS, 1e-6);
    f.transfer_ended(1);
    // Id 1 again, behind transfer 2's bytes; then two more reach and pass the cap.
    f.transfer_started(1, link, 2048, 0, BS, 2e-6);
    f.transfer_started(3, link, 2048, 0, BS, 3e-6);
    f.transfer_started(4, link, 2048, 0, BS, 4e-6);
    assert_eq!(f.transfers_tracked(), 3);
    assert_eq!(
        f.take_transfers_dropped(),
        TransfersDropped {
            expired: 0,
            evicted: 1
        }
    );
    assert_eq!(f.transfer_ended(2), 0.0, "the oldest in flight was dropped");
    assert!(
        f.transfer_ended(1) > 0.0,
        "the newest id 1 is still tracked"
    );
}

/// Under P/D a request decodes on a decode-capable endpoint, split or whole: with every one of
/// those saturated, flow control may hold it however idle the dedicated producers are. Without
/// P/D the producers serve whole requests and keep it flowing; in a fleet where nothing can
/// decode, the producers' own load decides.
#[test]
fn saturated_decoders_hold_a_request_whatever_the_producers_room() {
    let full = |f: &mut Fleet, ids: &[u32]| {
        let queue = f.profile().saturation.queue;
        for id in ids {
            let sample = crate::fleet::LoadSample {
                waiting: Some(queue),
                running: Some(0.0),
                kv_usage: Some(0.5),
                num_gpu_blocks: Some(1000),
            };
            f.observe_load(EndpointId(*id), sample, 0.0);
        }
    };
    let mut f = fleet(&[Role::Prefill, Role::Decode, Role::Decode]);
    full(&mut f, &[1, 2]);
    assert!(
        !plan(&mut f, 4096).decision.saturated,
        "without P/D the idle producer serves it whole"
    );
    f.enable_disagg(config("ib-400"));
    let p = plan(&mut f, 4096);
    assert!(p.decision.saturated, "every decoder is saturated");
    assert!(matches!(
        f.admit(&p, 0, 100, 0.0),
        crate::fleet::Admission::Held(_)
    ));

    let mut producers = fleet(&[Role::Prefill, Role::Prefill]);
    producers.enable_disagg(config("ib-400"));
    full(&mut producers, &[0]);
    assert!(!plan(&mut producers, 4096).decision.saturated);
    full(&mut producers, &[1]);
    assert!(plan(&mut producers, 4096).decision.saturated);
}
