//! The built `kvroute` binary, run as an operator would run it.

use std::process::{Command, Output};
use std::time::Duration;

use kvroute_testkit::ScratchDir;
use kvroute_testkit::process::output_within;

/// Runs the built binary with `args` and `stdin`; a run past five minutes (the longest here is a
/// short demo) fails the test with what it printed instead of hanging the suite.
fn kvroute(args: &[&str], stdin: &str) -> Output {
    output_within(
        Command::new(env!("CARGO_BIN_EXE_kvroute")).args(args),
        stdin,
        Duration::from_secs(300),
    )
}

/// Checks that a run succeeded; if not, fails showing what it printed.
fn succeeded(out: &Output) {
    assert!(
        out.status.success(),
        "{}\n{}",
        stdout(out),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Checks that a run failed with a message that names each of `names`.
fn refused(out: &Output, names: &[&str]) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "succeeded: {}\n{err}", stdout(out));
    for name in names {
        assert!(err.contains(name), "{name:?} not named: {err}");
    }
}

/// The JSON file at `path`, read and parsed (a file a run should have written: failing the
/// test, naming it, when it cannot be read or is no such JSON).
fn read_json<T: serde::de::DeserializeOwned>(path: &std::path::Path) -> T {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// `p` as a command-line argument.
fn path(p: &std::path::Path) -> String {
    p.to_str().unwrap().to_owned()
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn hash_prints_vllm_hashes_for_the_fixture_cases() {
    let fixtures = include_str!("../../core/tests/data/vllm-block-hashes.jsonl");
    for line in fixtures.lines().filter(|l| !l.is_empty()) {
        let case: serde_json::Value = serde_json::from_str(line).unwrap();
        let mut args = vec![
            "hash".to_string(),
            "--seed".into(),
            case["seed"].as_str().unwrap().into(),
            "--block-size".into(),
            case["block_size"].to_string(),
        ];
        if !case["extra_keys"].is_null() {
            args.push("--extra".into());
            args.push(case["extra_keys"].to_string());
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = kvroute(&args, &case["token_ids"].to_string());
        succeeded(&out);
        let got: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
        assert_eq!(got["none_hash"], case["none_hash"]);
        let digests: Vec<&serde_json::Value> = got["blocks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| &b["vllm_digest"])
            .collect();
        let u64s: Vec<&serde_json::Value> = got["blocks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| &b["vllm_u64"])
            .collect();
        assert_eq!(
            digests,
            case["digests"]
                .as_array()
                .unwrap()
                .iter()
                .collect::<Vec<_>>()
        );
        assert_eq!(
            u64s,
            case["event_u64"]
                .as_array()
                .unwrap()
                .iter()
                .collect::<Vec<_>>()
        );
    }
}

/// vLLM 0.31+ hashes a LoRA request's blocks with `("lora", name, path)` and its salt with
/// `("cache_salt", salt)`. The digests below are vLLM 0.32.0's own: `hash_block_tokens` with
/// `sha256_cbor` after `init_none_hash` (seed `vllm-none-hash`), the tokens `(i * 7919 + 13) %
/// 32000` for i in 0..40, extra keys `(lora, salt)` on the first block and `(lora,)` on the
/// second.
#[test]
fn hash_prints_vllm_031_tagged_hashes_for_lora_and_salt() {
    let tokens: Vec<u32> = (0..40).map(|i| (i * 7919 + 13) % 32000).collect();
    let tokens = serde_json::to_string(&tokens).unwrap();
    let tagged = [
        "hash",
        "--tagged",
        "--lora",
        "my-lora",
        "--lora-path",
        "/adapters/my-lora",
        "--cache-salt",
        "salt-1",
    ];
    let out = kvroute(&tagged, &tokens);
    succeeded(&out);
    let got: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    let digests: Vec<&str> = got["blocks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["vllm_digest"].as_str().unwrap())
        .collect();
    assert_eq!(
        digests,
        [
            "5d0198caddd65b3a4d3fdcd84e8fe6df146df0b309e88d9562c1911e1e4ea08f",
            "80f8ed8f076e5a12f88b257477f0eb57207329e29f95040c736fc1c9e9913ac8",
        ]
    );
    // The router keys the request as it always does, with the name and salt bare (0.31+
    // events publish that form): `--tagged` changes the digests, not the router keys.
    let router_keys = |args: &[&str]| -> Vec<String> {
        let out = kvroute(args, &tokens);
        succeeded(&out);
        let got: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
        got["blocks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b["router_key"].as_str().unwrap().to_owned())
            .collect()
    };
    let bare = ["hash", "--lora", "my-lora", "--cache-salt", "salt-1"];
    assert_eq!(router_keys(&tagged), router_keys(&bare));
    assert_ne!(
        router_keys(&bare),
        router_keys(&["hash"]),
        "the extra keys count"
    );
    // Without the path there is no 0.31+ hash to give.
    let out = kvroute(&tagged[..4], &tokens);
    refused(&out, &["--lora-path"]);
}

#[test]
fn hash_rejects_bad_input_with_a_clear_message() {
    let out = kvroute(&["hash"], "[1, 2, -3]");
    refused(&out, &["JSON array of token ids"]);
    let out = kvroute(&["hash", "--block-size", "0"], "[1]");
    assert!(String::from_utf8_lossy(&out.stderr).contains("--block-size"));
}

#[test]
fn decode_prints_fixture_events_and_reports_bad_lines() {
    let fixture = include_str!("../../vllm/tests/data/vllm-0.32.0.jsonl");
    let mut input = String::new();
    let mut expected = Vec::new();
    for line in fixture.lines().filter(|l| !l.is_empty()) {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        input.push_str(v["payload_hex"].as_str().unwrap());
        input.push('\n');
        expected.extend(v["expect"].as_array().unwrap().clone());
    }
    input.push_str("not-hex\n");
    input.push_str("c1\n");
    let out = kvroute(&["events", "decode"], &input);
    assert_eq!(
        out.status.code(),
        Some(1),
        "bad lines make the exit status non-zero"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("line 6: not hex"), "{stderr}");
    assert!(
        stderr.contains("line 7: malformed KV-event batch"),
        "{stderr}"
    );
    let events: Vec<serde_json::Value> = stdout(&out)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(events.len(), expected.len());
    for (got, want) in events.iter().zip(&expected) {
        for (field, value) in want.as_object().unwrap() {
            assert_eq!(&got[field], value, "field {field}");
        }
    }
}

#[test]
fn demo_runs_and_the_index_matches_the_engines() {
    let out = kvroute(
        &["events", "demo", "--duration", "2s", "--engines", "2"],
        "",
    );
    let text = stdout(&out);
    succeeded(&out);
    assert!(
        text.contains("OK: the index matches every engine's cache"),
        "{text}"
    );
}

/// A small `kvroute demo` (2 engines, 4 conversations of 2 turns) with `extra` arguments,
/// writing to `out`: its standard output and the runs of its `demo.json`, once it succeeded.
fn short_demo(extra: &[&str], out: &std::path::Path) -> (String, Vec<serde_json::Value>) {
    let mut args = vec!["demo", "--out", out.to_str().unwrap()];
    // The short fleet and workload, unless `extra` sets the flag itself.
    for (flag, value) in [
        ("--engines", "2"),
        ("--users", "4"),
        ("--turns", "2"),
        ("--rate", "8"),
        ("--blocks-per-engine", "600"),
    ] {
        if !extra.contains(&flag) {
            args.extend([flag, value]);
        }
    }
    args.extend_from_slice(extra);
    let output = kvroute(&args, "");
    let text = stdout(&output);
    succeeded(&output);
    let runs = read_json(&out.join("demo.json"));
    (text, runs)
}

/// `kvroute demo --pd`: the same engines split into a prefill and a decode half, the router
/// running both legs; every request answered, and answered by the decode engine.
#[test]
fn a_pd_demo_serves_every_request_from_the_decode_half() {
    let out = ScratchDir::new("demo-pd-test");
    let (text, runs) = short_demo(&["--pd", "--policies", "pd-always,pd-cost"], out.path());
    assert!(
        text.contains("1 prefill + 1 decode engines over ib-400"),
        "{text}"
    );
    assert_eq!(runs.len(), 2);
    for run in &runs {
        assert_eq!(run["summary"]["requests"], 8, "{}", run["name"]);
        assert_eq!(run["summary"]["errors"], 0, "{}", run["name"]);
        // engine-0 is the kv_producer: it only ever runs prefill legs.
        assert_eq!(run["records"].as_array().unwrap().len(), 8);
        assert!(
            run["records"]
                .as_array()
                .unwrap()
                .iter()
                .all(|r| r["endpoint"] == "engine-1"),
            "{}",
            run["records"]
        );
    }
}

/// The offload demo's fleet and workload: 200 GPU blocks per engine and 8 conversations an
/// engine. A first turn holds about 63 blocks (38 of them the shared system prompt), a second
/// about 93: the first turns overflow the GPU (38 + 8 x 29 > 200), and two second turns fit on
/// it at once. On a GPU that fits one second turn (100 blocks) any two that meet wait for room;
/// on a loaded machine, whose slower requests meet more often, routing then trades a second
/// turn's CPU-tier hit for the idle engine's sooner start (measured: a hit rate equal to
/// gpu-only's in 2 of 6 runs beside six busy processes).
const OFFLOAD_DEMO: [&str; 5] = ["--offload", "--blocks-per-engine", "800", "--users", "16"];

/// `kvroute demo --offload`: with a working set that overflows the GPU, the engines with a CPU
/// tier answer every request, load prompt tokens from that tier, and find more of each prompt
/// cached than the same GPUs alone; tier-blind and tier-aware routing both profit.
#[test]
fn an_offload_demo_finds_more_cached_tokens_with_the_cpu_tier_than_gpu_only() {
    let out = ScratchDir::new("demo-offload-test");
    let (text, runs) = short_demo(&OFFLOAD_DEMO, out.path());
    assert!(
        text.contains("x 200 GPU blocks (+ 800 CPU-tier blocks)"),
        "{text}"
    );
    let names: Vec<_> = runs.iter().map(|r| r["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["gpu-only", "tier-blind", "tier-aware"]);
    for run in &runs {
        assert_eq!(run["summary"]["requests"], 32, "{}", run["name"]);
        assert_eq!(run["summary"]["errors"], 0, "{}", run["name"]);
    }
    let cpu_loaded =
        |run: &serde_json::Value| run["config"]["offload"]["tier_loaded_tokens"]["cpu"].as_f64();
    let hit_rate = |run: &serde_json::Value| run["summary"]["hit_rate"].as_f64().unwrap();
    assert_eq!(cpu_loaded(&runs[0]), Some(0.0), "gpu-only has no CPU tier");
    for tiered in &runs[1..] {
        assert!(
            cpu_loaded(tiered).unwrap() > 0.0,
            "{}: nothing loaded from the CPU tier",
            tiered["name"]
        );
        assert!(
            hit_rate(tiered) > hit_rate(&runs[0]),
            "{}: hit rate {} not above gpu-only's {}",
            tiered["name"],
            hit_rate(tiered),
            hit_rate(&runs[0])
        );
    }
}

/// The tier policies compare offload tiers: without `--offload` they are refused, clearly.
#[test]
fn the_tier_policies_need_the_offload_flag() {
    let output = kvroute(&["demo", "--policies", "tier-aware"], "");
    refused(&output, &["tier-aware", "--offload"]);
}

#[test]
fn a_short_demo_writes_a_well_formed_report() {
    let out = ScratchDir::new("demo-test");
    let (text, runs) = short_demo(&["--policies", "round-robin,precise"], out.path());
    assert!(
        text.contains("round-robin") && text.contains("precise") && text.contains("Ceiling"),
        "{text}"
    );
    assert_eq!(runs.len(), 2);
    for run in &runs {
        assert_eq!(run["summary"]["requests"], 8);
        assert_eq!(run["summary"]["errors"], 0);
        assert_eq!(run["records"].as_array().unwrap().len(), 8);
        assert!(
            run["records"]
                .as_array()
                .unwrap()
                .iter()
                .all(|r| r["endpoint"].is_string() && r["ttft_s"].is_number())
        );
    }
    // Turn 2 of each conversation reuses turn 1 under precise routing.
    let precise_hit = runs[1]["summary"]["hit_rate"].as_f64().unwrap();
    assert!(precise_hit > 0.3, "precise hit rate {precise_hit}");
    let html = std::fs::read_to_string(out.join("demo.html")).unwrap();
    for id in ["ttft-cdf", "hit-rate", "endpoint-load", "ttft-over-time"] {
        assert!(
            html.contains(&format!("id=\"{id}\"")),
            "figure {id} missing"
        );
    }
    // `bench compare` reads the JSON back.
    let compared = kvroute(
        &[
            "bench",
            "compare",
            out.join("demo.json").to_str().unwrap(),
            "--out",
            out.path().to_str().unwrap(),
        ],
        "",
    );
    succeeded(&compared);
    assert!(out.join("compare.html").exists());
}

#[test]
fn bench_refuses_bad_arguments_clearly() {
    let output = kvroute(&["bench", "--workload", "trace"], "");
    refused(&output, &["--trace"]);
    let output = kvroute(&["bench", "compare", "/nonexistent.json"], "");
    refused(&output, &["nonexistent.json"]);
    // A server that is not there: the run says why its requests failed.
    let dir = ScratchDir::new("bench-nowhere");
    let out = path(&dir.join("out"));
    let output = kvroute(
        &[
            "bench",
            "--url",
            "http://127.0.0.1:1/v1",
            "--users",
            "1",
            "--turns",
            "1",
            "--out",
            &out,
        ],
        "",
    );
    refused(&output, &["1 of 1 requests failed", "Connection refused"]);
    // Numbers that cannot be durations are refused when parsed, not a panic later.
    for (args, name) in [
        (&["bench", "--timeout-s", "NaN"][..], "--timeout-s"),
        (&["bench", "--timeout-s", "1e30"][..], "--timeout-s"),
        (
            &["simulate", "--request-latency", "100000000000000000000s"][..],
            "--request-latency",
        ),
        (&["simulate", "--think-s=-5"][..], "--think-s"),
        (&["simulate", "--think-s", "inf"][..], "--think-s"),
        (&["tune", "--policy", "round-robin"][..], "round-robin"),
        (
            &["simulate", "--matrix", "small", "--policy", "precise"][..],
            "--policy",
        ),
        (
            &["sim", "--model", "m", "--lora-modules", "m"][..],
            "served twice",
        ),
        // Each of these ran something other than asked, hung for years, or panicked.
        (
            &["simulate", "--trace", "/nonexistent.jsonl"][..],
            "--workload trace",
        ),
        (&["demo", "--rate", "0"][..], "--rate"),
        (
            &["demo", "--offload", "--policies", "tier-aware,pd-cost"][..],
            "pd-cost",
        ),
        (
            &[
                "events",
                "watch",
                "tcp://127.0.0.1:9",
                "--stats-every",
                "0s",
            ][..],
            "--stats-every",
        ),
        // A fleet too large to hold in memory is refused, not run out of memory.
        (
            &["simulate", "--engines", "100001"][..],
            "engines must be within",
        ),
        (
            &[
                "simulate",
                "--prefill-engines",
                "18446744073709551615",
                "--decode-engines",
                "1",
            ][..],
            "engines must be within",
        ),
        (
            &["sim", "--step-overhead-s", "1e300"][..],
            "latency must be within",
        ),
    ] {
        let output = kvroute(args, "");
        refused(&output, &[name]);
        assert_ne!(output.status.code(), Some(101), "a panic: {args:?}");
    }
    // The engine model's refusal is said once, not once per layer of the error.
    let output = kvroute(&["simulate", "--block-size", "100000000"], "");
    refused(&output, &["GPU blocks at least 2"]);
    let err = String::from_utf8_lossy(&output.stderr);
    assert_eq!(err.matches("GPU blocks at least 2").count(), 1, "{err}");
}

/// Runs `kvroute simulate` on a trace of `rows` (Mooncake JSONL) with `args` in `dir`; the
/// output directory and its runs.
fn simulate_trace(
    dir: &ScratchDir,
    rows: &str,
    args: &[&str],
) -> (std::path::PathBuf, Vec<serde_json::Value>) {
    let trace = dir.join("trace.jsonl");
    std::fs::write(&trace, rows).unwrap();
    let out = dir.join("out");
    let (trace, out_text) = (path(&trace), path(&out));
    let mut all = vec!["simulate", "--workload", "trace", "--trace", &trace];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--out", &out_text]);
    succeeded(&kvroute(&all, ""));
    let runs = read_json(&out.join("simulate.json"));
    (out, runs)
}

/// Three Mooncake rows: the second shares the first's two blocks, the third shares nothing.
const THREE_REQUESTS: &str = "{\"timestamp\": 0, \"input_length\": 900, \"output_length\": 4, \"hash_ids\": [1, 2]}\n\
     {\"timestamp\": 50, \"input_length\": 1000, \"output_length\": 4, \"hash_ids\": [1, 2]}\n\
     {\"timestamp\": 90, \"input_length\": 600, \"output_length\": 4, \"hash_ids\": [3, 4]}\n";

/// A trace whose next request comes decades later: the simulator skips the idle scrapes between
/// (one per 100 ms of simulated time would take hours) and serves both requests.
#[test]
fn simulate_skips_ahead_over_a_long_idle_gap() {
    let dir = ScratchDir::new("simulate-gap");
    let (_, runs) = simulate_trace(
        &dir,
        "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 4, \"hash_ids\": [1, 2]}\n\
         {\"timestamp\": 1000000000000, \"input_length\": 600, \"output_length\": 4, \"hash_ids\": [1, 2]}\n",
        &["--policy", "precise"],
    );
    let records = runs[0]["records"].as_array().unwrap();
    assert_eq!(records.len(), 2);
    assert!(records[1]["start_s"].as_f64().unwrap() >= 1e9);
    assert!(records.iter().all(|r| r["error"].is_null()), "{records:?}");
}

#[test]
fn simulate_replays_a_trace_into_results_bench_compare_reads() {
    let dir = ScratchDir::new("simulate-test");
    let (out, runs) = simulate_trace(
        &dir,
        THREE_REQUESTS,
        &[
            "--engines",
            "2",
            "--policy",
            "round-robin",
            "--policy",
            "precise",
        ],
    );
    let names: Vec<&str> = runs.iter().map(|r| r["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["round-robin", "precise"]);
    // Under precise, the second request finds the first one's blocks.
    assert!(runs[1]["records"][1]["cached_tokens"].as_u64().unwrap() >= 512);
    succeeded(&kvroute(
        &[
            "bench",
            "compare",
            &path(&out.join("simulate.json")),
            "--out",
            &path(&out),
        ],
        "",
    ));
    assert!(out.join("compare.html").exists());
}

/// `--log-decisions`: one line per request, naming where it went, as the results do, with
/// the ranking and every candidate's cost, as `explain` shows them.
#[test]
fn simulate_writes_every_decision_with_its_costs_when_asked() {
    let dir = ScratchDir::new("simulate-decisions");
    let (out, runs) = simulate_trace(
        &dir,
        THREE_REQUESTS,
        &["--engines", "2", "--policy", "precise", "--log-decisions"],
    );
    let text = std::fs::read_to_string(out.join("decisions-precise.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let records = runs[0]["records"].as_array().unwrap();
    assert_eq!(lines.len(), records.len(), "{text}");
    for line in &lines {
        let record = records
            .iter()
            .find(|r| r["session"] == line["session"])
            .unwrap();
        assert_eq!(line["endpoint"], record["endpoint"], "{line}");
        let decision = &line["decision"];
        let first = decision["ranking"][0].as_u64().unwrap();
        assert_eq!(line["endpoint"], format!("engine-{first}"));
        let assessments = decision["assessments"].as_array().unwrap();
        assert_eq!(assessments.len(), 2, "both engines compete: {line}");
        assert!(assessments.iter().all(|a| a["cost"]["total_s"].is_f64()));
    }
    // The second request's choice holds the first one's blocks, and the log says so.
    let second = &lines[1]["decision"];
    let chosen = second["ranking"][0].clone();
    let held = second["assessments"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["endpoint"] == chosen)
        .unwrap();
    assert!(held["cached_tokens"].as_u64().unwrap() >= 512, "{second}");
    // A P/D policy that prices its choice logs that arithmetic too, and the choice it logs is
    // where the request went.
    let pd = ScratchDir::new("simulate-pd-decisions");
    let (out, _) = simulate_trace(
        &pd,
        THREE_REQUESTS,
        &[
            "--engines",
            "2",
            "--kv-role",
            "both",
            "--kv-link",
            "ib-400",
            "--policy",
            "pd-cost",
            "--log-decisions",
        ],
    );
    let text = std::fs::read_to_string(out.join("decisions-pd-cost.jsonl")).unwrap();
    for line in text
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
    {
        let choice = &line["pd_choice"];
        assert!(choice["aggregated"]["total_s"].is_f64(), "{line}");
        assert_eq!(
            choice["aggregated"]["endpoint"], line["decision"]["ranking"][0],
            "{line}"
        );
        match line["prefill_endpoint"].as_str() {
            None => assert_eq!(choice["choice"]["mode"], "aggregated", "{line}"),
            Some(prefill) => assert_eq!(
                format!("engine-{}", choice["choice"]["prefill"]),
                prefill,
                "{line}"
            ),
        }
    }
    // Without the flag, no log.
    let plain = ScratchDir::new("simulate-no-decisions");
    let (out, _) = simulate_trace(
        &plain,
        "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 4, \"hash_ids\": [1]}\n",
        &["--policy", "precise"],
    );
    assert!(!out.join("decisions-precise.jsonl").exists());
}

/// Each policy's results say how far its requests' first tokens were from what it predicted
/// for them: on an idle fleet, every one within a few milliseconds (the prediction is the cost
/// model's, in seconds; a unit or sign slip would be off by orders of magnitude).
#[test]
fn simulate_reports_how_far_first_tokens_were_from_their_predictions() {
    let dir = ScratchDir::new("simulate-prediction-error");
    let args = [
        "--engines",
        "2",
        "--policy",
        "precise",
        "--policy",
        "round-robin",
    ];
    let (_, runs) = simulate_trace(&dir, THREE_REQUESTS, &args);
    assert_eq!(runs.len(), 2);
    for run in &runs {
        let error = &run["summary"]["ttft_prediction_error"];
        assert_eq!(error["count"], 3, "every request was predicted: {run}");
        let (p10, p90) = (
            error["p10_s"].as_f64().unwrap(),
            error["p90_s"].as_f64().unwrap(),
        );
        assert!(-0.03 < p10 && p10 <= p90 && p90 < 0.03, "{error}");
        assert!(error["mean_abs_s"].as_f64().unwrap() < 0.02, "{error}");
    }
}

#[test]
fn simulate_runs_the_small_matrix_and_a_tenants_workload_with_prefix_hash() {
    let dir = ScratchDir::new("matrix-test");
    let out = dir.join("out");
    let matrix = kvroute(&["simulate", "--matrix", "small", "--out", &path(&out)], "");
    succeeded(&matrix);
    let report: serde_json::Value = read_json(&out.join("matrix.json"));
    let cells = report["cells"].as_array().unwrap();
    assert_eq!(cells.len(), 2);
    // The verdicts are counted over both cells (both fit the pooled cache), printed and kept.
    let verdicts = &report["verdicts"];
    assert_eq!(verdicts["ttft_cells"], 2, "{verdicts}");
    assert_eq!(verdicts["hit_cells"], 2, "{verdicts}");
    let line = format!(
        "TTFT p50, p90 and p99 within 1.05x the best other policy's in {} of 2 cells",
        verdicts["ttft_met"]
    );
    assert!(stdout(&matrix).contains(&line), "{}", stdout(&matrix));
    let policies: Vec<&str> = cells[0]["policies"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["policy"].as_str().unwrap())
        .collect();
    assert_eq!(
        policies,
        ["round-robin", "least-load", "prefix-hash", "precise"]
    );
    let html = std::fs::read_to_string(out.join("matrix.html")).unwrap();
    assert!(
        html.contains("heat") || html.contains("background:rgb"),
        "a heat map"
    );
    let tenants = kvroute(
        &[
            "simulate",
            "--workload",
            "tenants",
            "--users",
            "6",
            "--conversations",
            "40",
            "--turns",
            "2",
            "--tenant-skew",
            "zipf:1.2",
            "--length-cv",
            "0.5",
            "--shared-tokens",
            "400",
            "--user-tokens",
            "40",
            "--output-tokens",
            "4",
            "--rate",
            "10",
            "--policy",
            "prefix-hash,precise",
            "--out",
            &path(&out),
        ],
        "",
    );
    succeeded(&tenants);
    let runs: Vec<serde_json::Value> = read_json(&out.join("simulate.json"));
    assert_eq!(runs.len(), 2);
    assert_eq!(runs[0]["summary"]["requests"].as_u64(), Some(80));
    let bad = kvroute(
        &[
            "simulate",
            "--workload",
            "tenants",
            "--tenant-skew",
            "pareto",
        ],
        "",
    );
    refused(&bad, &["tenant skew"]);
}

#[test]
fn tune_reports_a_held_out_gain_and_prints_a_configuration_serve_accepts() {
    let dir = ScratchDir::new("tune-test");
    let out = dir.join("out");
    let tuned = kvroute(
        &[
            "tune",
            "--engines",
            "2",
            "--num-gpu-blocks",
            "400",
            "--users",
            "10",
            "--turns",
            "3",
            "--shared-tokens",
            "200",
            "--user-tokens",
            "100",
            "--rate",
            "4",
            "--trials",
            "3",
            "--holdout",
            "0.3",
            "--out",
            out.to_str().unwrap(),
        ],
        "",
    );
    succeeded(&tuned);
    let stdout = String::from_utf8_lossy(&tuned.stdout);
    assert!(stdout.contains("3 trials"), "{stdout}");
    assert!(
        stdout.contains("Held out, workload (9 requests)"),
        "{stdout}"
    );
    // The snippet is a valid `scheduler` section for kvroute serve.
    let yaml = std::fs::read_to_string(out.join("tuned.yaml")).unwrap();
    let config =
        format!("models: [{{name: m}}]\nendpoints: [{{url: 'http://127.0.0.1:1'}}]\n{yaml}");
    let parsed = kvroute_router::config::RouterConfig::from_yaml(&config)
        .unwrap_or_else(|e| panic!("{e}\n{config}"));
    assert!(parsed.scheduler.weights.is_some());
    let runs: Vec<serde_json::Value> = read_json(&out.join("tune.json"));
    let names: Vec<&str> = runs.iter().map(|r| r["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["defaults", "tuned"]);
}

#[test]
fn report_draws_a_bar_table_as_svg_and_refuses_a_malformed_one() {
    let dir = ScratchDir::new("report");
    let table = dir.join("table.json");
    std::fs::write(
        &table,
        r#"{"title": "TTFT p90", "y_label": "ms", "groups": ["tcp", "ib-400"],
            "series": [{"name": "aggregated", "values": [411, 411]},
                       {"name": "always", "values": [81396, null]}]}"#,
    )
    .unwrap();
    let out = kvroute(&["report", "--bars", table.to_str().unwrap()], "");
    succeeded(&out);
    let svg = stdout(&out);
    assert!(
        svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""),
        "{svg}"
    );
    assert_eq!(svg.matches("</title></rect>").count(), 3, "{svg}");
    std::fs::write(
        &table,
        r#"{"title": "t", "y_label": "ms", "groups": ["a"], "series": [{"name": "s", "values": [1, 2]}]}"#,
    )
    .unwrap();
    let out = kvroute(&["report", "--bars", table.to_str().unwrap()], "");
    refused(&out, &["series \"s\" has 2 values for 1 groups"]);
}

/// `kvroute demo --offload` records, in each run's summary, the prompt tokens the engines found
/// on the GPU and loaded from each tier, and `bench compare` shows them side by side, also next
/// to a result file written before those figures existed (which still loads, showing `-`).
#[test]
fn bench_compare_shows_the_offload_demo_tokens_by_tier() {
    let out = ScratchDir::new("demo-offload-tiers-test");
    let (_, runs) = short_demo(&OFFLOAD_DEMO, out.path());
    let tokens = |run: &serde_json::Value, tier: &str| {
        run["summary"]["tier_tokens"][tier]
            .as_u64()
            .unwrap_or_else(|| panic!("{}: no {tier} tokens in its summary", run["name"]))
    };
    assert_eq!(tokens(&runs[0], "cpu"), 0, "gpu-only has no CPU tier");
    for run in &runs {
        assert!(
            tokens(run, "gpu") > 0,
            "{}: nothing found on GPU",
            run["name"]
        );
        // Checked against what the clients were told, request by request: every prompt token
        // a response reported as cached was found on an engine's GPU or loaded from its CPU
        // tier (the engines' counters count a preempted request's hits again, never fewer).
        let reported: u64 = run["records"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|r| r["cached_tokens"].as_u64())
            .sum();
        let found = tokens(run, "gpu") + tokens(run, "cpu");
        assert!(
            reported > 0 && reported <= found,
            "{}: clients were told {reported} cached tokens, the engines found or loaded {found}",
            run["name"]
        );
    }
    assert!(tokens(&runs[2], "cpu") > 0, "tier-aware loaded nothing");
    // The same runs as a file from before the tier figures: the summary without them.
    let mut old_runs = runs.clone();
    for run in &mut old_runs {
        run["name"] = format!("old-{}", run["name"].as_str().unwrap()).into();
        run["summary"]
            .as_object_mut()
            .unwrap()
            .remove("tier_tokens");
    }
    let old = out.join("old.json");
    std::fs::write(&old, serde_json::to_string(&old_runs).unwrap()).unwrap();
    let compared = kvroute(
        &[
            "bench",
            "compare",
            &path(&out.join("demo.json")),
            &path(&old),
            "--out",
            &path(&out.join("compare")),
        ],
        "",
    );
    succeeded(&compared);
    let text = stdout(&compared);
    let row = |label: &str| -> Vec<String> {
        let line = text
            .lines()
            .find(|l| l.starts_with(label))
            .unwrap_or_else(|| panic!("no row {label} in\n{text}"));
        line[label.len()..]
            .split_whitespace()
            .map(str::to_owned)
            .collect()
    };
    for (label, tier) in [
        ("tokens found on GPU", "gpu"),
        ("tokens loaded from CPU", "cpu"),
    ] {
        let mut expected: Vec<String> = runs.iter().map(|r| tokens(r, tier).to_string()).collect();
        expected.extend(["-"; 3].map(str::to_owned));
        assert_eq!(row(label), expected, "{label}\n{text}");
    }
}
