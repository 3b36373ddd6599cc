//! The P/D decision's own cost against the fleet's size: kvroute-core's `Fleet` planning a
//! request with P/D pricing on (`plan`, the decode pick, `plan_disagg`: the "decide" column),
//! then carrying the choice out (the prefill and decode legs dispatched, the transfer started,
//! legs and transfers ended: the "all" column), on 16 to 1,000 endpoints, one third each
//! prefill-only, decode-only and both. Links are RoCE-100; Llama-3.1-8B's KV.
//!
//! Requests: 128 conversations of 2,048 to ~6,000 tokens, each sharing a 512-token system prompt
//! with a quarter of the others, 400 a second of fleet time; each leg's first token comes
//! 50 ms after its dispatch and its end 200 ms after, and a transfer ends with its decode
//! leg's first token, so a few dozen transfers are always queued on the NICs. Every endpoint is
//! scraped every 500 ms (varied loads). No KV events (the index has its own benchmarks).
//!
//! `cargo bench -p kvroute-core --bench pd_decision [-- ENDPOINTS...]` (no criterion: a median
//! over rounds, microseconds per request).

// A benchmark reads the clock: kvroute-core's purity rules (crates/core/clippy.toml) are for
// the library, not for its measurements.
#![allow(clippy::disallowed_methods)]

use std::collections::VecDeque;
use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use kvroute_core::fleet::{
    DisaggConfig, Dispatch, EndpointSpec, Fleet, FleetConfig, LoadSample, RequestFeatures,
};
use kvroute_core::index::EndpointId;
use kvroute_core::keys::{RouterKey, router_keys};
use kvroute_core::schedule::disagg::{DisaggChoice, LinkLearning, LinkPrior};
use kvroute_core::schedule::{Profile, ProfileName, Role};

const BLOCK: usize = 16;
const RATE: f64 = 400.0;
const CONVERSATIONS: u64 = 128;

/// A small deterministic generator (xorshift).
struct Xorshift(u64);

impl Xorshift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Request `i`'s keys and prompt length: its conversation's system prompt, then its own turn.
fn request(i: u64) -> (Arc<Vec<RouterKey>>, usize) {
    let conversation = i % CONVERSATIONS;
    let system = (conversation % 4) as u32;
    let tokens = 2048 + ((i * 7919) % 4000) as usize;
    let prompt: Vec<u32> = (0..tokens as u32)
        .map(|t| {
            if t < 512 {
                system * 1_000_000 + t
            } else {
                10_000_000 + conversation as u32 * 100_000 + t
            }
        })
        .collect();
    (
        Arc::new(router_keys(&prompt, BLOCK, None).expect("keys")),
        tokens,
    )
}

fn fleet(engines: usize) -> Fleet {
    let specs = (0..engines)
        .map(|i| EndpointSpec {
            name: format!("engine-{i}"),
            models: vec!["m".into()],
            role: [Role::Prefill, Role::Decode, Role::Both][i % 3],
            has_events: true,
            block_size: BLOCK,
            offload: Default::default(),
        })
        .collect();
    let mut fleet = Fleet::new(
        FleetConfig::default(),
        Profile::named(ProfileName::Precise),
        specs,
    )
    .expect("a fleet");
    fleet.enable_disagg(DisaggConfig {
        link: LinkPrior::parse("roce-100").expect("a preset"),
        learning: LinkLearning::default(),
        kv_bytes_per_token: 131_072.0,
        leg_overhead_s: 0.005,
    });
    fleet
}

/// What happens later to a dispatched request.
enum Later {
    FirstToken(Dispatch, Option<u64>),
    End(Dispatch),
}

/// Microseconds per request (decide; all) on `engines` endpoints: the median of `rounds` rounds
/// of `per_round` requests, after `warm` requests.
fn measure(engines: usize, warm: u64, rounds: usize, per_round: u64) -> (f64, f64) {
    let mut fleet = fleet(engines);
    let mut rng = Xorshift(0x9e37_79b9_7f4a_7c15);
    let mut pending: VecDeque<(f64, Later)> = VecDeque::new();
    let mut next_scrape = 0.0;
    let mut id = 0u64;
    let (mut decide_us, mut all_us) = (Vec::new(), Vec::new());
    for round in 0..=rounds {
        let n = if round == 0 { warm } else { per_round };
        let (mut decide, mut all) = (0.0, 0.0);
        for _ in 0..n {
            let now = id as f64 / RATE;
            let (keys, tokens) = request(id);
            let features = RequestFeatures {
                model: "m",
                keys: &keys,
                prompt_tokens: tokens,
                block_size: BLOCK,
                session: None,
                role: Role::Both,
            };
            let t = Instant::now();
            while next_scrape <= now {
                for e in 0..engines {
                    let sample = LoadSample {
                        waiting: Some((rng.next() % 4) as f64),
                        running: Some((rng.next() % 32) as f64),
                        kv_usage: Some((rng.next() % 100) as f64 / 100.0),
                        num_gpu_blocks: Some(8000),
                    };
                    fleet.observe_load(EndpointId(e as u32), sample, next_scrape);
                }
                next_scrape += 0.5;
            }
            while pending.front().is_some_and(|(at, _)| *at <= now) {
                let Some((at, later)) = pending.pop_front() else {
                    break;
                };
                match later {
                    Later::FirstToken(mut dispatch, transfer) => {
                        fleet.first_token(&mut dispatch, true, at);
                        if let Some(transfer) = transfer {
                            fleet.transfer_ended(transfer);
                        }
                        pending.push_back((at + 0.15, Later::End(dispatch)));
                    }
                    Later::End(dispatch) => fleet.finished(dispatch, None, at),
                }
            }
            let t_decide = Instant::now();
            let plan = fleet.plan(&features, rng.next(), now);
            let decode = fleet.decode_pick(&plan);
            let explain = decode.and_then(|d| fleet.plan_disagg(&plan, d, tokens, BLOCK, now));
            decide += t_decide.elapsed().as_secs_f64();
            if let (Some(decode), Some(explain)) = (decode, black_box(explain)) {
                let mut transfer = None;
                if let DisaggChoice::Disaggregated { prefill } = explain.choice {
                    fleet.prefill_sent(&plan, prefill, now);
                    let leg = fleet.dispatched(&plan.predicted_cached, &features, prefill, now);
                    pending.push_back((now + 0.05, Later::FirstToken(leg, None)));
                    let cached = plan.predicted_cached[decode.0 as usize];
                    fleet.transfer_started(id, (prefill, decode), tokens, cached, BLOCK, now);
                    transfer = Some(id);
                } else {
                    fleet.prefill_sent(&plan, decode, now);
                }
                let leg = fleet.dispatched(&plan.predicted_cached, &features, decode, now);
                pending.push_back((now + 0.05, Later::FirstToken(leg, transfer)));
            }
            all += t.elapsed().as_secs_f64();
            id += 1;
        }
        if round > 0 {
            decide_us.push(decide / n as f64 * 1e6);
            all_us.push(all / n as f64 * 1e6);
        }
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    (median(decide_us), median(all_us))
}

fn main() {
    // Fleet sizes from the command line (`-- 1000`), else 16 to 1,000.
    let mut sizes: Vec<usize> = std::env::args().filter_map(|a| a.parse().ok()).collect();
    if sizes.is_empty() {
        sizes = vec![16, 64, 256, 1_000];
    }
    println!("endpoints | decide µs/request | all µs/request");
    for engines in sizes {
        let (decide, all) = measure(engines, 2_000, 7, 400);
        println!("{engines:>9} | {decide:>17.1} | {all:>14.1}");
    }
}
