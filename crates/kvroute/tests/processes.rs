//! The whole system as separate processes on loopback: `kvroute sim` engines, `kvroute serve`
//! in front, and the official OpenAI Python client as the application.

use std::process::{Command, Stdio};
use std::time::Duration;

use kvroute_testkit::{Killed, free_ports, run_openai_client, wait_http};

#[test]
fn the_openai_python_client_works_through_the_router() {
    let Some(python) = kvroute_testkit::python("the openai package") else {
        return;
    };
    let bin = env!("CARGO_BIN_EXE_kvroute");
    let http = free_ports(2);
    let events = free_ports(2);
    let replay = free_ports(2);
    let _sim = Killed(
        Command::new(bin)
            .args([
                "sim",
                "--engines",
                "2",
                "--num-gpu-blocks",
                "2048",
                "--time-scale",
                "10",
            ])
            .args([
                "--port",
                &http.to_string(),
                "--events-port",
                &events.to_string(),
                "--replay-port",
                &replay.to_string(),
            ])
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    for i in 0..2 {
        wait_http(&format!("http://127.0.0.1:{}", http + i));
    }
    let listen = free_ports(1);
    let dir = std::env::temp_dir().join(format!("kvroute-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("kvroute.yaml");
    let mut yaml = format!(
        "listen: 127.0.0.1:{listen}\nadmin: {{listen: 127.0.0.1:0}}\nmodels: [{{name: sim-llama-3.1-8b}}]\nendpoints:\n"
    );
    for i in 0..2 {
        yaml.push_str(&format!(
            "  - {{url: 'http://127.0.0.1:{}', events: 'tcp://127.0.0.1:{}', replay: 'tcp://127.0.0.1:{}'}}\n",
            http + i,
            events + i,
            replay + i
        ));
    }
    std::fs::write(&config, yaml).unwrap();
    let _router = Killed(
        Command::new(bin)
            .args(["serve", "-c", config.to_str().unwrap()])
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_http(&format!("http://127.0.0.1:{listen}"));
    std::thread::sleep(Duration::from_millis(300)); // subscribers connect

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
