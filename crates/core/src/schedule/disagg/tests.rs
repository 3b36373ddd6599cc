//! The P/D choice on the arithmetic a user can check by hand: Llama-3.1-8B (128 KiB of KV per
//! token, ~31k prompt tokens/s on an H100), links at the measured nixlbench figures.

use proptest::prelude::*;

use super::*;

const KIB: f64 = 1024.0;
/// Seconds per prompt token prefilled.
const PREFILL_S: f64 = 32e-6;
const ROCE: LinkPrior = LinkPrior {
    bandwidth_bytes_per_s: 12.1e9,
    latency_s: 50e-6,
};
const TCP: LinkPrior = LinkPrior {
    bandwidth_bytes_per_s: 0.55e9,
    latency_s: 1e-3,
};
const D: EndpointId = EndpointId(0);
const P: EndpointId = EndpointId(1);
const P2: EndpointId = EndpointId(2);

fn request(prompt_tokens: usize) -> PdRequest {
    PdRequest {
        prompt_tokens,
        block_size: 16,
        kv_bytes_per_token: 128.0 * KIB,
        leg_overhead_s: 5e-3,
    }
}

/// An endpoint holding `cached` tokens of a `prompt`-token request, with `queue_s` of queued
/// work and `decodes` running decodes (each stalled by its prefill).
fn side(
    endpoint: EndpointId,
    prompt: usize,
    cached: usize,
    queue_s: f64,
    decodes: f64,
) -> SideCost {
    let prefill_s = (prompt - cached) as f64 * PREFILL_S;
    SideCost {
        endpoint,
        cost: Cost {
            queue_s,
            prefill_s,
            stalling_s: prefill_s,
            decode_interference_s: prefill_s * decodes,
            ..Cost::default()
        },
        cached_tokens: cached,
        link_backlog_bytes: 0.0,
        queue_inflow: 0.0,
    }
}

fn book(prior: LinkPrior) -> LinkBook {
    LinkBook::new(prior, LinkLearning::default())
}

/// The choice for a `prompt`-token request with nothing cached, D decoding 2 sequences, P idle.
fn choose(prompt: usize, links: &LinkBook, now: f64) -> DisaggExplain {
    decide(
        request(prompt),
        &side(D, prompt, 0, 0.0, 2.0),
        &[side(P, prompt, 0, 0.0, 0.0)],
        links,
        now,
    )
}

#[test]
fn a_short_prompt_stays_aggregated_and_a_long_one_disaggregates_on_a_fast_link() {
    let links = book(ROCE);
    // 64 tokens: 2 ms of prefill stalls 2 decodes 4 ms; P/D pays the same 2 ms, 0.74 ms of
    // transfer and the 5 ms second leg.
    let short = choose(64, &links, 0.0);
    assert_eq!(short.choice, DisaggChoice::Aggregated, "{short:#?}");
    assert!((short.aggregated.total_s - 6.144e-3).abs() < 1e-6);
    // 8192 tokens: 262 ms of prefill stalls 2 decodes 524 ms; the 1.07 GB move in 89 ms.
    let long = choose(8192, &links, 0.0);
    assert_eq!(
        long.choice,
        DisaggChoice::Disaggregated { prefill: P },
        "{long:#?}"
    );
    let pd = &long.disaggregated[0];
    assert_eq!(pd.transfer_tokens, 8192);
    assert!((pd.transfer_s - (50e-6 + 8192.0 * 128.0 * KIB / 12.1e9)).abs() < 1e-9);
    assert!((long.chosen_s - pd.total_s).abs() < 1e-12);
    assert!(pd.total_s < long.aggregated.total_s);
}

#[test]
fn the_same_long_prompt_stays_aggregated_over_tcp() {
    // 1.07 GB at 0.55 GB/s is 1.95 s: more than the 786 ms aggregated costs.
    let slow = choose(8192, &book(TCP), 0.0);
    assert_eq!(slow.choice, DisaggChoice::Aggregated, "{slow:#?}");
    assert!(slow.disaggregated[0].transfer_s > 1.9);
}

#[test]
fn only_the_blocks_the_decode_endpoint_lacks_move_and_a_cached_decode_stays_aggregated() {
    let links = book(ROCE);
    let explain = decide(
        request(8192),
        &side(D, 8192, 8000, 0.0, 2.0),
        &[side(P, 8192, 0, 0.0, 0.0)],
        &links,
        0.0,
    );
    // 8000 cached tokens are 500 blocks; the other 12 full blocks move.
    assert_eq!(explain.disaggregated[0].transfer_tokens, 12 * 16);
    assert_eq!(explain.choice, DisaggChoice::Aggregated, "{explain:#?}");
}

#[test]
fn the_cheapest_prefill_endpoint_wins_and_the_decode_endpoint_is_not_its_own_producer() {
    let links = book(ROCE);
    let busy = side(P, 8192, 0, 1.0, 0.0);
    let warm = side(P2, 8192, 4096, 0.0, 0.0);
    let explain = decide(
        request(8192),
        &side(D, 8192, 0, 0.0, 2.0),
        &[busy, warm, side(D, 8192, 0, 0.0, 2.0)],
        &links,
        0.0,
    );
    assert_eq!(explain.choice, DisaggChoice::Disaggregated { prefill: P2 });
    assert_eq!(explain.disaggregated.len(), 2, "D is the aggregated option");
    assert!(explain.disaggregated[0].total_s <= explain.disaggregated[1].total_s);
}

#[test]
fn a_queued_decode_endpoint_drains_while_the_prefill_runs_elsewhere() {
    // D has 1 s of queued prefills and no decodes, P is idle, 8192 tokens over RoCE. Aggregated:
    // 1 s + 262 ms. P/D: the prefill (262 ms) and the pull (89 ms) run while D's queue drains,
    // so the decode leg starts at 1 s, then the 5 ms second leg: 1.005 s, not 1.356 s.
    let explain = decide(
        request(8192),
        &side(D, 8192, 0, 1.0, 0.0),
        &[side(P, 8192, 0, 0.0, 0.0)],
        &book(ROCE),
        0.0,
    );
    let pd = &explain.disaggregated[0];
    assert!((pd.total_s - 1.005).abs() < 1e-9, "{pd:#?}");
    assert_eq!(
        explain.choice,
        DisaggChoice::Disaggregated { prefill: P },
        "{explain:#?}"
    );
}

#[test]
fn work_still_reaching_the_decode_endpoint_keeps_its_queue_ahead_of_the_decode_leg() {
    let with_inflow = |inflow: f64| {
        let mut decode = side(D, 8192, 0, 1.0, 0.0);
        decode.queue_inflow = inflow;
        decide(
            request(8192),
            &decode,
            &[side(P, 8192, 0, 0.0, 0.0)],
            &book(ROCE),
            0.0,
        )
    };
    // Work arriving as fast as D drains it: the leg finds D's 1 s queue as it is now,
    // 262 + 89 ms later (1.356 s), and aggregated (1.262 s) is cheaper.
    let steady = with_inflow(1.0);
    let ready = steady.disaggregated[0].total_s - 1.0 - 5e-3;
    assert!((steady.disaggregated[0].decode_queue_s - 1.0).abs() < 1e-9);
    assert_eq!(steady.choice, DisaggChoice::Aggregated, "{steady:#?}");
    // Half as fast: half of the 351 ms is drained.
    let half = with_inflow(0.5);
    assert!((half.disaggregated[0].decode_queue_s - (1.0 - 0.5 * ready)).abs() < 1e-9);
}

#[test]
fn a_busy_link_is_a_queue_the_transfer_waits_behind() {
    let links = book(ROCE);
    let mut producer = side(P, 8192, 0, 0.0, 0.0);
    let idle = choose(8192, &links, 0.0);
    assert_eq!(idle.choice, DisaggChoice::Disaggregated { prefill: P });
    // 6 GB already queued on the producer's NIC: 0.5 s more before this transfer ends.
    producer.link_backlog_bytes = 6e9;
    let busy = decide(
        request(8192),
        &side(D, 8192, 0, 0.0, 2.0),
        &[producer],
        &links,
        0.0,
    );
    let (before, after) = (&idle.disaggregated[0], &busy.disaggregated[0]);
    assert!((after.transfer_s - before.transfer_s - 6e9 / 12.1e9).abs() < 1e-9);
    assert_eq!(after.link_backlog_bytes, 6e9);
    assert_eq!(busy.choice, DisaggChoice::Aggregated, "{busy:#?}");
}

#[test]
fn a_transfer_within_the_links_latency_teaches_no_bandwidth() {
    let mut links = book(ROCE);
    // Took no longer than the latency: no bandwidth can be read from it (it would be infinite).
    links.observe_transfer(P, D, 1e9, ROCE.latency_s, 0.0);
    assert!(
        (links.bandwidth(P, D, 1.0) - ROCE.bandwidth_bytes_per_s).abs() < 1.0,
        "{}",
        links.bandwidth(P, D, 1.0)
    );
}

#[test]
fn bandwidth_is_learned_per_pair_and_a_slow_pair_loses_the_choice() {
    // D decodes one sequence: aggregated costs 262 ms of prefill + 262 ms of stall.
    let choose = |links: &LinkBook, now: f64| {
        decide(
            request(8192),
            &side(D, 8192, 0, 0.0, 1.0),
            &[side(P, 8192, 0, 0.0, 0.0)],
            links,
            now,
        )
    };
    let mut links = book(ROCE);
    assert_eq!(
        choose(&links, 0.0).choice,
        DisaggChoice::Disaggregated { prefill: P }
    );
    // This pair moves at 1/3.5 of the rated speed (a strike only past 4x): 310 ms for the
    // prompt's KV, so P/D (577 ms) no longer pays.
    let slow = ROCE.bandwidth_bytes_per_s / 3.5;
    let bytes = 1e9;
    for i in 0..12 {
        links.observe_transfer(P, D, bytes, 50e-6 + bytes / slow, f64::from(i));
    }
    let learned = links.bandwidth(P, D, 20.0);
    assert!((learned / slow - 1.0).abs() < 0.01, "{learned}");
    assert_eq!(
        links.health(P, D, 20.0),
        LinkHealth::Healthy { samples: 12 }
    );
    assert!(
        (links.bandwidth(P2, D, 20.0) - ROCE.bandwidth_bytes_per_s).abs() < 1.0,
        "other pairs keep the configured link"
    );
    let explain = choose(&links, 20.0);
    assert_eq!(explain.choice, DisaggChoice::Aggregated, "{explain:#?}");
}

#[test]
fn a_pair_is_quarantined_after_repeated_failures_then_probed_and_healed_or_requarantined() {
    let mut links = book(ROCE);
    links.observe_failure(P, D, 0.0);
    links.observe_failure(P, D, 1.0);
    assert_eq!(links.health(P, D, 1.0), LinkHealth::Healthy { samples: 0 });
    links.observe_failure(P, D, 2.0);
    assert_eq!(
        links.health(P, D, 2.0),
        LinkHealth::Quarantined { until: 32.0 }
    );
    // Quarantined: listed with its arithmetic, never chosen.
    let explain = choose(8192, &links, 10.0);
    assert_eq!(explain.choice, DisaggChoice::Aggregated);
    assert!(!explain.disaggregated[0].eligible);
    assert!(explain.disaggregated[0].total_s < explain.aggregated.total_s);
    // A late failure of a transfer already in flight does not extend it.
    links.observe_failure(P, D, 11.0);
    assert_eq!(
        links.health(P, D, 11.0),
        LinkHealth::Quarantined { until: 32.0 }
    );
    // After it: probed at the configured speed.
    assert_eq!(links.health(P, D, 32.0), LinkHealth::Probing);
    assert_eq!(
        choose(8192, &links, 32.0).choice,
        DisaggChoice::Disaggregated { prefill: P }
    );
    // A degraded probe (20x slower than rated: RDMA fell back to TCP) re-quarantines, twice as
    // long.
    let bytes = 1e9;
    links.observe_transfer(P, D, bytes, 20.0 * bytes / ROCE.bandwidth_bytes_per_s, 33.0);
    assert_eq!(
        links.health(P, D, 33.0),
        LinkHealth::Quarantined { until: 93.0 }
    );
    // A good probe heals it.
    links.observe_transfer(P, D, bytes, bytes / ROCE.bandwidth_bytes_per_s, 93.0);
    assert_eq!(links.health(P, D, 93.0), LinkHealth::Healthy { samples: 1 });
    links.forget(P);
    assert_eq!(links.health(P, D, 93.0), LinkHealth::Healthy { samples: 0 });
}

fn arb_side(endpoint: EndpointId, prompt: usize) -> impl Strategy<Value = SideCost> {
    (0..=prompt, 0.0..2.0f64, 0.0..64.0f64)
        .prop_map(move |(cached, queue, decodes)| side(endpoint, prompt, cached, queue, decodes))
}

fn arb_case() -> impl Strategy<Value = (usize, SideCost, Vec<SideCost>, f64)> {
    (16usize..32_768).prop_flat_map(|prompt| {
        (
            Just(prompt),
            arb_side(D, prompt),
            proptest::collection::vec(
                (2u32..6).prop_flat_map(move |e| arb_side(EndpointId(e), prompt)),
                0..4,
            ),
            0.1e9..60e9f64,
        )
    })
}

proptest! {
    #[test]
    fn the_choice_is_the_cheapest_eligible_option_and_every_total_is_its_terms(
        (prompt, decode, prefills, bandwidth) in arb_case()
    ) {
        let links = book(LinkPrior { bandwidth_bytes_per_s: bandwidth, latency_s: 1e-4 });
        let explain = decide(request(prompt), &decode, &prefills, &links, 0.0);
        let a = &explain.aggregated;
        prop_assert!((a.total_s - (a.queue_s + a.prefill_s + a.tier_load_s + a.decode_interference_s)).abs() < 1e-9);
        for o in &explain.disaggregated {
            let sum = o.prefill_queue_s + o.prefill_s + o.prefill_tier_load_s + o.prefill_interference_s
                + o.transfer_s + o.decode_queue_s + o.leg_overhead_s;
            prop_assert!(o.decode_queue_s <= decode.cost.queue_s + 1e-12, "no inflow: it only drains");
            prop_assert!((o.total_s - sum).abs() < 1e-9);
            prop_assert!(o.transfer_tokens <= prompt);
        }
        let best_pd = explain.disaggregated.iter().filter(|o| o.eligible).map(|o| o.total_s).fold(f64::INFINITY, f64::min);
        match explain.choice {
            DisaggChoice::Aggregated => prop_assert!(a.total_s <= best_pd),
            DisaggChoice::Disaggregated { .. } => {
                prop_assert!(best_pd < a.total_s);
                prop_assert!((explain.chosen_s - best_pd).abs() < 1e-12);
            }
        }
    }

    #[test]
    fn a_faster_link_never_turns_a_pd_choice_back_to_aggregated(
        (prompt, decode, prefills, bandwidth) in arb_case()
    ) {
        let at = |bw: f64| {
            let links = book(LinkPrior { bandwidth_bytes_per_s: bw, latency_s: 1e-4 });
            decide(request(prompt), &decode, &prefills, &links, 0.0).choice
        };
        if at(bandwidth) != DisaggChoice::Aggregated {
            prop_assert_ne!(at(bandwidth * 2.0), DisaggChoice::Aggregated);
        }
    }
}

#[test]
fn a_fast_healthy_link_is_never_struck_by_timing_noise_and_a_degraded_one_still_is() {
    // A 2,048-token pull of Llama-3.1-8B's KV on roce-100 is predicted at ~22 ms: 4x is 89 ms,
    // which a router's scheduling jitter (~90 ms, up to an engine step) crosses on its own.
    let bytes = 2048.0 * 131_072.0;
    let predicted = ROCE.latency_s + bytes / ROCE.bandwidth_bytes_per_s;
    assert!((predicted - 0.0222).abs() < 1e-3, "{predicted}");
    let mut links = book(ROCE);
    let mut now = 0.0;
    for i in 0..600u32 {
        // Jitter from none to 200 ms (twice the observed ~90 ms), with runs of several noisy
        // transfers in a row.
        let jitter = f64::from((i * 37) % 100) / 100.0 * 0.2;
        links.observe_transfer(P, D, bytes, predicted + jitter, now);
        assert!(
            !matches!(links.health(P, D, now), LinkHealth::Quarantined { .. }),
            "quarantined by noise at transfer {i} (jitter {jitter})"
        );
        now += 0.5;
    }
    // RDMA fallen back to TCP: the same pulls take 22 times as long (~490 ms, far past the
    // floor): three strikes quarantine the pair.
    for _ in 0..3 {
        links.observe_transfer(P, D, bytes, predicted * 22.0, now);
        now += 0.5;
    }
    assert!(matches!(
        links.health(P, D, now),
        LinkHealth::Quarantined { .. }
    ));
}

const IB: LinkPrior = LinkPrior {
    bandwidth_bytes_per_s: 49.5e9,
    latency_s: 50e-6,
};

/// The long-prompt sweep's request.
const LONG_PROMPT: usize = 12_160;

/// The choice over IB for [`LONG_PROMPT`], nothing cached: D with `d_decodes` running decodes
/// at the usual rate, P with `p_decodes` and a learned prefill rate `p_rate` times the usual
/// (its prefill and the stall it imposes shrink alike); and the prefill's seconds at D's rate.
fn long_prompt_choice(d_decodes: f64, p_decodes: f64, p_rate: f64) -> (DisaggExplain, f64) {
    let d = side(D, LONG_PROMPT, 0, 0.0, d_decodes);
    let mut p = side(P, LONG_PROMPT, 0, 0.0, p_decodes);
    p.cost.prefill_s /= p_rate;
    p.cost.stalling_s /= p_rate;
    p.cost.decode_interference_s /= p_rate;
    let explain = decide(request(LONG_PROMPT), &d, &[p], &book(IB), 0.0);
    (explain, LONG_PROMPT as f64 * PREFILL_S)
}

#[test]
fn a_few_percent_faster_learned_rate_beside_as_many_decodes_keeps_the_request_aggregated() {
    // The long-prompt sweep's tail: D and P of one model, three decodes each, P's learned
    // rate 5% above D's. Moving the prefill saves no stall (as many decodes wait either way)
    // and costs the transfer and the second leg; priced at each engine's own rate, the 5%
    // times four (the request and three decodes) outweighed both.
    let (explain, at_d) = long_prompt_choice(3.0, 3.0, 1.05);
    assert_eq!(explain.choice, DisaggChoice::Aggregated, "{explain:#?}");
    let o = &explain.disaggregated[0];
    // The stall on P's decodes: three of them, for the prefill's seconds at D's rate.
    assert!(
        (o.prefill_interference_s - 3.0 * at_d).abs() < 1e-9,
        "{o:#?}"
    );
    // Its own prefill still counts at its own rate in the time to first token.
    assert!((o.prefill_s - at_d / 1.05).abs() < 1e-9);
}

#[test]
fn a_prefill_endpoint_with_fewer_decodes_still_takes_the_long_prompt() {
    // D decodes four sequences, P one (and learned 5% slower): moving the prefill spares three
    // decodes its seconds, far more than the transfer and the second leg.
    let (explain, at_d) = long_prompt_choice(4.0, 1.0, 0.95);
    assert_eq!(
        explain.choice,
        DisaggChoice::Disaggregated { prefill: P },
        "{explain:#?}"
    );
    assert!((explain.disaggregated[0].prefill_interference_s - at_d).abs() < 1e-9);
}

#[test]
fn the_stall_on_a_prefill_endpoint_counts_only_the_tokens_it_lacks() {
    // P holds half the prompt, D nothing: P's stall is half the prefill at D's rate.
    let prompt = 8_192;
    let d = side(D, prompt, 0, 0.0, 2.0);
    let p = side(P, prompt, 4_096, 0.0, 2.0);
    let explain = decide(request(prompt), &d, &[p], &book(ROCE), 0.0);
    let at_d_half = 4_096.0 * PREFILL_S;
    assert!((explain.disaggregated[0].prefill_interference_s - 2.0 * at_d_half).abs() < 1e-9);
}
