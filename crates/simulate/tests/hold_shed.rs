//! The live router and `kvroute simulate` hold and shed the same requests: one sequence (a
//! long request occupies the only engine, whose circuit breaker then opens; two more are
//! held; a fourth finds the queue full; the held ones are released in order as the engine
//! frees up) is played through `kvroute serve` in front of a simulated engine and through the
//! simulator's core policy with the same configuration, and their decisions are compared.

use std::sync::Arc;
use std::time::Duration;

use kvroute_core::index::EndpointId;
use kvroute_router::config::RouterConfig;
use kvroute_router::server::RunningRouter;
use kvroute_sim::engine::EngineConfig;
use kvroute_sim::server::{SimConfig, start as start_sim};
use kvroute_simulate::config::FleetConfig;
use kvroute_simulate::core_policy::CorePolicy;
use kvroute_simulate::policy::{Routing, RoutingPolicy, SimRequest};
use kvroute_testkit::{eventually, http_get, sample};

const MODEL: &str = "sim-llama-3.1-8b";

/// What flow control did with one request.
#[derive(Clone, Debug, PartialEq)]
enum Decision {
    /// Sent at once.
    Routed,
    /// Held, then sent.
    HeldThenRouted,
    /// Refused with this status.
    Shed(u16),
}

/// One endpoint whose circuit breaker opens at one request in flight; room to hold two.
const FLOW: &str = "outlier: {max_inflight: 1}\nflow: {max_requests: 2, max_wait_s: 60}";

fn words(n: usize, seed: usize) -> String {
    (0..n)
        .map(|i| format!("w{}x{}", (i * 7919 + seed * 104_729) % 100_000, seed))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Requests the router holds now, from its admin `/metrics`.
fn held_now(router: &RunningRouter) -> f64 {
    sample(
        &http_get(router.admin_addr, "/metrics"),
        "kvroute_flow_queue_requests",
    )
    .unwrap_or(0.0)
}

/// Plays the sequence through a live router; returns each request's decision.
async fn live() -> Vec<Decision> {
    let engine = start_sim(SimConfig {
        port: 0,
        events_port: 0,
        replay_port: Some(0),
        engine: EngineConfig {
            num_gpu_blocks: 4096,
            max_model_len: 16_384,
            ..EngineConfig::default()
        },
        time_scale: 10.0,
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let client = reqwest::Client::new();
    // Prefill slowed down: the long request keeps the engine busy while the others arrive.
    let faults = client
        .post(format!("{}/sim/faults", engine.endpoints[0].url))
        .json(&serde_json::json!({"slow_factor": 200.0}))
        .send()
        .await
        .unwrap();
    assert!(faults.status().is_success());
    let ep = &engine.endpoints[0];
    let yaml = format!(
        "listen: 127.0.0.1:0\nadmin: {{listen: 127.0.0.1:0}}\nmodels: [{{name: {MODEL}}}]\n{FLOW}\nendpoints:\n  - {{name: e0, url: '{}', events: '{}', replay: '{}'}}\n",
        ep.url,
        ep.events,
        ep.replay.as_deref().unwrap_or_default()
    );
    let router = Arc::new(
        kvroute_router::server::start(RouterConfig::from_yaml(&yaml).unwrap())
            .await
            .unwrap(),
    );
    let send = |prompt: String| {
        let (client, addr) = (client.clone(), router.addr);
        tokio::spawn(async move {
            client
                .post(format!("http://{addr}/v1/completions"))
                .json(&serde_json::json!({"model": MODEL, "prompt": prompt, "max_tokens": 2}))
                .timeout(Duration::from_secs(120))
                .send()
                .await
                .unwrap()
                .status()
                .as_u16()
        })
    };
    let long = send(words(600, 1));
    eventually("the long request is in flight", || {
        (router.router.load(EndpointId(0)).inflight == 1, ())
    })
    .await;
    let mut held = Vec::new();
    for (i, seed) in [2usize, 3].into_iter().enumerate() {
        held.push(send(words(10, seed)));
        let want = (i + 1) as f64;
        eventually(&format!("request {seed} is held"), || {
            let held = held_now(&router);
            (held == want, held)
        })
        .await;
    }
    let full = send(words(10, 4)).await.unwrap();
    let mut decisions = vec![match long.await.unwrap() {
        200 => Decision::Routed,
        status => Decision::Shed(status),
    }];
    for h in held {
        decisions.push(match h.await.unwrap() {
            200 => Decision::HeldThenRouted,
            status => Decision::Shed(status),
        });
    }
    decisions.push(Decision::Shed(full));
    decisions
}

/// The same sequence through the simulator's core policy, with the same configuration.
fn simulated() -> Vec<Decision> {
    let yaml = format!(
        "models: [{{name: {MODEL}}}]\n{FLOW}\nendpoints:\n  - {{name: e0, url: 'http://127.0.0.1:1'}}\n"
    );
    let config = RouterConfig::from_yaml(&yaml).unwrap();
    let fleet = FleetConfig {
        engines: 1,
        ..FleetConfig::default()
    };
    let mut policy =
        CorePolicy::new(config.scheduler.profile(), config.fleet_config(), &fleet).unwrap();
    let keys = Arc::new(Vec::new());
    let request = |id| SimRequest {
        id,
        tokens: &[],
        keys: keys.clone(),
        prompt_tokens: if id == 0 { 600 } else { 10 },
        session: id,
    };
    let status = |r: &Routing| match r {
        Routing::Reject(why) => why[5..8].parse::<u16>().unwrap(),
        other => panic!("not a refusal: {other:?}"),
    };
    let mut now = 0.0;
    let mut step = || {
        now += 0.01;
        now
    };
    // The long request goes at once; the two after it are held, the fourth finds the queue
    // full.
    let long = policy.route(&request(0), step());
    assert!(matches!(long, Routing::Endpoint(0)), "{long:?}");
    policy.dispatched(0, 0, step());
    let b = policy.route(&request(1), step());
    let c = policy.route(&request(2), step());
    let d = policy.route(&request(3), step());
    let mut decisions = vec![Decision::Routed];
    let mut pending = Vec::new();
    for (id, r) in [(1, b), (2, c)] {
        match r {
            Routing::Wait => pending.push(id),
            Routing::Endpoint(_) => decisions.push(Decision::Routed),
            other => decisions.push(Decision::Shed(status(&other))),
        }
    }
    let full = match d {
        Routing::Wait | Routing::Endpoint(_) => panic!("the queue had room: {d:?}"),
        other => Decision::Shed(status(&other)),
    };
    // The engine frees up one request at a time: each held one is released in turn.
    policy.first_token(0, step());
    policy.finished(0, None, step());
    for id in pending {
        let mut routed = policy.route(&request(id), step());
        for _ in 0..10 {
            if !matches!(routed, Routing::Wait) {
                break;
            }
            routed = policy.route(&request(id), step());
        }
        assert!(matches!(routed, Routing::Endpoint(0)), "{routed:?}");
        decisions.push(Decision::HeldThenRouted);
        policy.dispatched(id, 0, step());
        policy.first_token(id, step());
        policy.finished(id, None, step());
    }
    decisions.push(full);
    decisions
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_live_router_and_the_simulator_hold_and_shed_the_same_requests() {
    let expected = vec![
        Decision::Routed,
        Decision::HeldThenRouted,
        Decision::HeldThenRouted,
        Decision::Shed(429),
    ];
    assert_eq!(simulated(), expected, "the simulator");
    assert_eq!(live().await, expected, "the live router");
}
