//! The router's per-request decision work against the fleet's size: kvroute-core's `Fleet`
//! (through the simulator's [`CorePolicy`], with the router's defaults) planning, dispatching
//! and completing requests on 8 to 1,000 endpoints.
//!
//! Requests are Mooncake-shaped: 512 blocks of 16 tokens, the first 32 shared by every request
//! (a system prompt, as the trace's first hash id), the rest unique. 400 requests a second of
//! fleet time; each request's first token comes 50 ms after its dispatch and its end 200 ms
//! after. Every endpoint is scraped every 500 ms. No KV events: the index has its own
//! benchmarks (crates/core/benches); this measures what grows with the endpoints. "route" is
//! the policy's `route` (core's `plan`, and its housekeeping once a second of fleet time);
//! "all" adds the scrapes, `dispatched`, `first_token` and `finished`.
//!
//! `cargo bench -p kvroute-simulate --bench plan [-- ENDPOINTS...]` (no criterion: a median over
//! rounds).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use kvroute_core::keys::{RouterKey, router_keys, router_keys_from};
use kvroute_simulate::config::FleetConfig;
use kvroute_simulate::core_policy::CorePolicy;
use kvroute_simulate::{Routing, RoutingPolicy, SimRequest, Usage};

const BLOCK: usize = 16;
const BLOCKS: usize = 512;
const SHARED: usize = 32;
const RATE: f64 = 400.0;

/// The router keys of request `i`: the shared blocks, then blocks of its own.
fn keys(shared: &[RouterKey], i: u64) -> Arc<Vec<RouterKey>> {
    let mut x = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let own: Vec<u32> = (0..(BLOCKS - SHARED) * BLOCK)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 100_000) as u32
        })
        .collect();
    let parent = *shared.last().expect("shared blocks");
    let mut keys = shared.to_vec();
    keys.extend(router_keys_from(parent, &own, BLOCK, None).expect("keys"));
    Arc::new(keys)
}

/// Microseconds per request (route, dispatch, first token, end) on `engines` endpoints: the
/// median of rounds of `per_round` requests, after `warm` requests.
fn measure(engines: usize, warm: u64, rounds: usize, per_round: u64) -> (f64, f64) {
    let fleet = FleetConfig {
        engines,
        ..FleetConfig::default()
    };
    let mut policy = CorePolicy::named("precise", &fleet).expect("a named policy");
    let shared_tokens: Vec<u32> = (0..(SHARED * BLOCK) as u32).collect();
    let shared = router_keys(&shared_tokens, BLOCK, None).expect("keys");
    let mut pending: VecDeque<(u64, f64, bool)> = VecDeque::new();
    let mut next_scrape = 0.0;
    let mut id = 0u64;
    let mut route_s = Vec::new();
    let mut total_s = Vec::new();
    for round in 0..=rounds {
        let n = if round == 0 { warm } else { per_round };
        let (mut routing, mut rest) = (0.0, 0.0);
        for _ in 0..n {
            let now = id as f64 / RATE;
            let request_keys = keys(&shared, id);
            let t = Instant::now();
            while next_scrape <= now {
                for e in 0..engines {
                    policy.load_sample(e, 0.0, 4.0, 0.5, next_scrape);
                }
                next_scrape += 0.5;
            }
            while let Some(&(r, at, first)) = pending.front() {
                if at > now {
                    break;
                }
                pending.pop_front();
                if first {
                    policy.first_token(r, at);
                    pending.push_back((r, at + 0.15, false));
                } else {
                    let usage = Usage {
                        cached_tokens: 0,
                        completion_tokens: 32,
                    };
                    policy.finished(r, Some(usage), at);
                }
            }
            let t_route = Instant::now();
            let routed = policy.route(
                &SimRequest {
                    id,
                    tokens: &[],
                    keys: request_keys,
                    prompt_tokens: BLOCKS * BLOCK,
                    session: id,
                },
                now,
            );
            routing += t_route.elapsed().as_secs_f64();
            if let Routing::Endpoint(e) = routed {
                policy.dispatched(id, e, now);
                pending.push_back((id, now + 0.05, true));
            }
            rest += t.elapsed().as_secs_f64();
            id += 1;
        }
        if round > 0 {
            route_s.push(routing / n as f64 * 1e6);
            total_s.push(rest / n as f64 * 1e6);
        }
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    (median(route_s), median(total_s))
}

fn main() {
    // Fleet sizes from the command line (`-- 1000`), else 8 to 1,000.
    let mut sizes: Vec<usize> = std::env::args().filter_map(|a| a.parse().ok()).collect();
    if sizes.is_empty() {
        sizes = vec![8, 64, 256, 1_000];
    }
    println!("endpoints | route µs/request | all µs/request");
    for engines in sizes {
        let (route, total) = measure(engines, 4_000, 7, 500);
        println!("{engines:>9} | {route:>16.1} | {total:>14.1}");
    }
}
