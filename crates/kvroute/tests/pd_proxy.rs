//! Prefill/decode disaggregation across processes on loopback: a producer and a consumer
//! `kvroute sim`, each its own process (the pull crosses them through the producer's side
//! channel), driven by a Python proxy with the request sequence of vLLM's reference proxy and
//! the official OpenAI client, against an aggregated engine answering the same requests.

mod sim_support;

use std::process::Command;
use std::time::Duration;

use kvroute_testkit::process::client_output;
use kvroute_testkit::{http_get, patience, sample};
use serde_json::Value;
use sim_support::SimProcess;

const MODEL: &str = "sim-llama-3.1-8b";

/// One `kvroute sim` engine with `args`, waited for; its HTTP port.
fn sim(args: &[&str]) -> (SimProcess, u16) {
    let common = ["--num-gpu-blocks", "2048", "--time-scale", "10"];
    let sim = SimProcess::start(1, &[args, &common].concat());
    let http = sim.http;
    (sim, http)
}

fn metric(port: u16, name: &str) -> f64 {
    let text = http_get(([127, 0, 0, 1], port).into(), "/metrics");
    let series = format!("{name}{{engine=\"0\",model_name=\"{MODEL}\"}}");
    sample(&text, &series).unwrap_or_else(|| panic!("{series} missing:\n{text}"))
}

#[test]
fn the_reference_proxy_sequence_through_a_simulated_pd_pair_answers_like_aggregated() {
    let Some(python) = kvroute_testkit::python("the openai package") else {
        return;
    };
    let (_p, p_port) = sim(&["--prefill-engines", "1"]);
    let (_d, d_port) = sim(&["--decode-engines", "1"]);
    let (_a, a_port) = sim(&["--engines", "1"]);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/toy_pd_proxy.py");
    let url = |port: u16| format!("http://127.0.0.1:{port}");
    let printed = client_output(Command::new(&python).args([
        script,
        &url(p_port),
        &url(d_port),
        &url(a_port),
        MODEL,
    ]));
    let result: Value = serde_json::from_str(&printed).unwrap();
    let turns = result["turns"].as_array().unwrap();
    assert_eq!(turns.len(), 3);
    let mut full_prompts = 0;
    for (i, turn) in turns.iter().enumerate() {
        assert_eq!(turn["pd_text"], turn["agg_text"], "turn {i}: {turn:#}");
        assert_eq!(turn["prompt_tokens"], turn["agg_prompt_tokens"]);
        // 0.33 counts pulled tokens as cached on the consumer (local + connector hits): every
        // full block before the last prompt token.
        let prompt = turn["prompt_tokens"].as_u64().unwrap();
        assert_eq!(
            turn["pd_cached"].as_u64().unwrap(),
            (prompt - 1) / 16 * 16,
            "turn {i}"
        );
        full_prompts += (prompt - 1) / 16 * 16;
        let params = &turn["params"];
        assert_eq!(params["do_remote_prefill"], true, "{params}");
        assert_eq!(params["transfer_mode"], "pull");
        assert!(
            params["remote_registration_generation"].is_u64(),
            "{params}"
        );
        assert_eq!(params["remote_host"], "127.0.0.1");
    }
    assert_eq!(turns[0]["agg_cached"], 0);
    assert!(turns[2]["agg_cached"].as_u64().unwrap() > 0);
    // Each turn pulled only what the consumer lacked: its earlier turns were local.
    assert_eq!(metric(d_port, "vllm:nixl_xfer_time_seconds_count"), 3.0);
    let pulled = metric(d_port, "kvroute_sim_kv_pulled_tokens_total");
    let first = turns[0]["pd_cached"].as_u64().unwrap() as f64;
    assert!(
        pulled >= first && pulled < full_prompts as f64 * 0.6,
        "pulled {pulled} of {full_prompts}"
    );
    // The producer released every hold.
    let deadline = std::time::Instant::now() + patience();
    while metric(p_port, "kvroute_sim_kv_holds") != 0.0 {
        assert!(std::time::Instant::now() < deadline, "holds never released");
        std::thread::sleep(Duration::from_millis(20));
    }
}
