//! The whole system as separate processes on loopback: `kvroute sim` engines, `kvroute serve`
//! in front, and the official OpenAI Python client as the application.

use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod serve_support;

use kvroute_testkit::hostile::{ATTACKS, HostilePublisher};
use kvroute_testkit::{
    Killed, eventually_blocking, free_ports, http_get, patience, run_openai_client, sample,
    wait_http,
};
use serve_support::{Serve, Served};

/// `kvroute sim` engines on consecutive ports, waited for.
struct Sims {
    _process: Killed,
    http: u16,
    events: u16,
    replay: u16,
}

fn start_sims(n: u16) -> Sims {
    let (http, events, replay) = (free_ports(n), free_ports(n), free_ports(n));
    let process = Killed(
        Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args([
                "sim",
                "--engines",
                &n.to_string(),
                "--num-gpu-blocks",
                "2048",
            ])
            .args(["--time-scale", "10", "--port", &http.to_string()])
            .args(["--events-port", &events.to_string()])
            .args(["--replay-port", &replay.to_string()])
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    for i in 0..n {
        wait_http(&format!("http://127.0.0.1:{}", http + i));
    }
    Sims {
        _process: process,
        http,
        events,
        replay,
    }
}

/// `kvroute serve` in front of `sims`, with `extra` configuration, waited for: (the process,
/// its API port, its temporary directory).
fn serve(sims: &Sims, n: u16, extra: &str) -> (Killed, u16, std::path::PathBuf) {
    let served = Serve::new(&sim_endpoints(sims, n), extra).start();
    (served.process, served.listen, served.dir)
}

/// The `endpoints:` list items for the first `n` engines of `sims`.
fn sim_endpoints(sims: &Sims, n: u16) -> String {
    (0..n)
        .map(|i| {
            format!(
                "  - {{url: 'http://127.0.0.1:{}', events: 'tcp://127.0.0.1:{}', replay: 'tcp://127.0.0.1:{}'}}\n",
                sims.http + i,
                sims.events + i,
                sims.replay + i
            )
        })
        .collect()
}

#[test]
fn the_openai_python_client_works_through_the_router() {
    let Some(python) = kvroute_testkit::python("the openai package") else {
        return;
    };
    let sims = start_sims(2);
    let served = Serve::new(&sim_endpoints(&sims, 2), "").start();
    let (_router, listen, dir) = (served.process, served.listen, served.dir);
    let admin = std::net::SocketAddr::from(([127, 0, 0, 1], served.admin));
    // The sum of the router's `metric` series that carry `label`.
    let counted =
        |metric, label| kvroute_testkit::sum_labelled(&http_get(admin, "/metrics"), metric, label);
    eventually_blocking("both KV-event subscribers connected", || {
        let connected = counted("kvroute_kv_events{", "kind=\"connected\"");
        (connected == 2.0, connected)
    });

    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/openai_client.py");
    let output = run_openai_client(
        &python,
        script,
        &format!("http://127.0.0.1:{listen}/v1"),
        "sim-llama-3.1-8b",
    );
    let out: serde_json::Value = serde_json::from_str(&output).unwrap();

    assert_eq!(out["chat"]["completion_tokens"], 12);
    assert_eq!(out["chat"]["finish_reason"], "length");
    assert!(
        out["chat"]["endpoint"]
            .as_str()
            .unwrap()
            .starts_with("127.0.0.1:")
    );
    assert_eq!(out["chat_stream"]["chunks"], 8);
    let cached = out["chat_stream"]["cached_tokens"].as_u64().unwrap();
    let prompt = out["chat_stream"]["prompt_tokens"].as_u64().unwrap();
    assert!(
        cached * 10 > prompt * 7,
        "turn 2 reuses turn 1's cache: {cached}/{prompt}"
    );
    assert_eq!(out["completion"]["completion_tokens"], 5);
    assert_eq!(out["completion_stream"]["chunks"], 5);
    assert_eq!(out["completion_stream"]["usage_chunks"], 0);
    // The router read the engine's usage of every routed answer, the stream that did not ask
    // for it too: five predictions checked (the unknown model's request was never routed).
    eventually_blocking("every answer's usage read", || {
        let checked = counted("kvroute_prediction_outcomes_total{", "");
        (checked == 5.0, checked)
    });
    // And each stream's time to first token beside the plan's prediction (the two streams:
    // a whole answer's first byte comes after its last token, so it is no first token): on an
    // idle fleet of simulated engines the two agree to well within a second (seconds, not
    // milliseconds).
    let timed = counted("kvroute_ttft_prediction_error_seconds_count{", "");
    assert_eq!(timed, 2.0);
    let error_s = counted("kvroute_ttft_prediction_error_seconds_sum{", "");
    assert!(error_s.abs() < 2.0 * 0.5, "summed error {error_s} s");
    assert!(
        out["models"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m == "sim-llama-3.1-8b")
    );
    assert_eq!(out["error"]["status"], 404);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn sigterm_drains_then_ends_open_streams_with_an_error_event() {
    signal_drains_then_ends_open_streams("-TERM");
}

/// The router reloads nothing: a hangup (a closed terminal, a supervisor's reload) drains it
/// as SIGTERM does, rather than killing it with its open streams.
#[test]
fn sighup_drains_like_sigterm() {
    signal_drains_then_ends_open_streams("-HUP");
}

/// Sends `signal` (as `kill` names it) to a router streaming an answer: the stream ends with an
/// error event, the listener refuses new connections, and the process exits with success.
fn signal_drains_then_ends_open_streams(signal: &str) {
    use std::io::Read;
    let sims = start_sims(1);
    let (mut router, listen, dir) = serve(&sims, 1, "shutdown: {drain_timeout_s: 1}");
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", listen)).unwrap();
    let payload = serde_json::json!({"model": "sim-llama-3.1-8b", "prompt": "a long answer", "max_tokens": 8000, "ignore_eos": true, "stream": true}).to_string();
    write!(
        stream,
        "POST /v1/completions HTTP/1.1\r\nhost: kvroute\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{payload}",
        payload.len()
    )
    .unwrap();
    let mut received = Vec::new();
    while !String::from_utf8_lossy(&received).contains("data: ") {
        let mut buf = [0u8; 4096];
        let n = stream.read(&mut buf).unwrap();
        assert!(n > 0, "connection closed early");
        received.extend_from_slice(&buf[..n]);
    }
    let sent = Command::new("kill")
        .args([signal, &router.0.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    stream.read_to_end(&mut received).unwrap();
    let text = String::from_utf8_lossy(&received);
    let last = &text[text.rfind("data: ").unwrap()..];
    assert!(last.starts_with("data: {\"error\""), "{last}");
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", listen)).is_err(),
        "no new connections while draining"
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = router.0.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "kvroute serve did not exit");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status}");
    let _ = std::fs::remove_dir_all(dir);
}

/// The status code of a small completion through the router on `listen` (0: no answer).
fn complete(listen: u16) -> u16 {
    use std::io::Read;
    let Ok(mut socket) = std::net::TcpStream::connect(("127.0.0.1", listen)) else {
        return 0;
    };
    let _ = socket.set_read_timeout(Some(patience()));
    let payload = r#"{"model": "sim-llama-3.1-8b", "prompt": "hello there", "max_tokens": 4}"#;
    let sent = write!(
        socket,
        "POST /v1/completions HTTP/1.1\r\nhost: kvroute\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{payload}",
        payload.len()
    );
    let mut response = String::new();
    if sent.is_err() || socket.read_to_string(&mut response).is_err() {
        return 0;
    }
    response
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or(0)
}

#[test]
fn a_hostile_kv_event_publisher_costs_one_connection_not_the_router() {
    let sims = start_sims(1);
    let limit = 1 << 20;
    let hostile = HostilePublisher::start(limit, Duration::ZERO);
    let endpoint = format!(
        "  - {{name: e0, url: 'http://127.0.0.1:{}', events: '{}'}}\n",
        sims.http,
        hostile.address()
    );
    let log_path = std::env::temp_dir().join(format!("kvroute-hostile-{}.log", std::process::id()));
    let log = std::fs::File::create(&log_path).unwrap();
    let Served {
        process: mut router,
        listen,
        admin,
        dir,
    } = Serve::new(
        &endpoint,
        &format!("kv_events: {{max_message_bytes: {limit}}}"),
    )
    .log_to(log)
    .start();
    let admin = std::net::SocketAddr::from(([127, 0, 0, 1], admin));
    let read_log = || std::fs::read_to_string(&log_path).unwrap_or_default();

    // Every attack, and a reconnection after the last one; the router answers meanwhile.
    let deadline = Instant::now() + patience();
    let mut answered = 0;
    while hostile.connections() <= ATTACKS.len() {
        assert!(
            router.0.try_wait().unwrap().is_none(),
            "kvroute serve died after {} hostile connections: {}",
            hostile.connections(),
            read_log()
        );
        assert!(
            Instant::now() < deadline,
            "only {} hostile connections: {}",
            hostile.connections(),
            read_log()
        );
        assert_eq!(complete(listen), 200, "{}", read_log());
        answered += 1;
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(router.0.try_wait().unwrap().is_none(), "{}", read_log());
    assert_eq!(complete(listen), 200);

    let metrics = http_get(admin, "/metrics");
    let counted = |kind: &str| {
        sample(
            &metrics,
            &format!("kvroute_kv_events{{endpoint=\"e0\",kind=\"{kind}\"}}"),
        )
        .unwrap_or(0.0)
    };
    assert!(
        counted("oversized_messages") >= ATTACKS.len() as f64,
        "{metrics}"
    );
    assert!(counted("protocol_errors") >= counted("oversized_messages"));
    let logged = read_log()
        .lines()
        .filter(|l| l.contains("broke the protocol"))
        .count();
    assert!(
        (1..=5).contains(&logged),
        "{logged} warnings: {}",
        read_log()
    );
    let rss = kvroute_testkit::proc_memory(Some(router.0.id()), "VmHWM");
    eprintln!(
        "{} hostile connections, {answered} requests answered meanwhile, peak RSS {} MiB",
        hostile.connections(),
        rss >> 20
    );
    assert!(rss < 200 << 20, "peak RSS {} MiB", rss >> 20);
    let _ = std::fs::remove_file(&log_path);
    let _ = std::fs::remove_dir_all(dir);
}

/// Under a low open-file limit the API listener takes only the connections the limit leaves
/// room for (each with its engine connection), refusing the rest at once, so that the admin
/// listener keeps answering and accepts never fail.
#[test]
fn a_low_open_file_limit_leaves_the_admin_listener_answering() {
    let sims = start_sims(1);
    let served = Serve::new(&sim_endpoints(&sims, 1), "")
        .fd_limit(256)
        .start();
    let idle: Vec<std::net::TcpStream> = (0..300)
        .filter_map(|_| std::net::TcpStream::connect(("127.0.0.1", served.listen)).ok())
        .collect();
    assert!(idle.len() > 100, "only {} connected", idle.len());
    let admin: std::net::SocketAddr = ([127, 0, 0, 1], served.admin).into();
    let deadline = Instant::now() + Duration::from_secs(20);
    let metrics = loop {
        let text = kvroute_testkit::http_get(admin, "/metrics");
        let refused =
            kvroute_testkit::sample(&text, "kvroute_connections_refused_total{listener=\"api\"}");
        if refused.is_some_and(|r| r > 0.0) {
            break text;
        }
        assert!(
            Instant::now() < deadline,
            "the admin listener did not answer with refusals counted: {text:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(
        !metrics.contains("kvroute_accept_errors_total{"),
        "accepts failed: {metrics}"
    );
    drop(idle);
    let _ = std::fs::remove_dir_all(served.dir);
}
