//! The router against an engine behind a strict HTTP/1.1 parser (h11, which uvicorn runs on):
//! proxied requests must be origin-form and carry `Host`.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use common::config_builder::ConfigBuilder;
use kvroute_router::server::start as start_router;
use serde_json::{Value, json};

/// The h11 engine process; killed on drop.
struct StrictEngine {
    child: Child,
    port: u16,
}

impl Drop for StrictEngine {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn strict_engine(python: &str) -> StrictEngine {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/strict/engine.py");
    let mut child = Command::new(python)
        .arg(script)
        .stdout(Stdio::piped())
        .spawn()
        .expect("the test Python starts");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let port = line
        .trim()
        .parse()
        .unwrap_or_else(|_| panic!("no port from the h11 engine (is h11 installed?): {line:?}"));
    StrictEngine { child, port }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxied_requests_pass_a_strict_http11_parser() {
    let Some(python) = kvroute_testkit::python("h11") else {
        return;
    };
    let engine = strict_engine(&python);
    let config = ConfigBuilder::new("m")
        .url("strict", &format!("http://127.0.0.1:{}", engine.port))
        .build();
    let router = start_router(config).await.unwrap();
    let client = reqwest::Client::new();
    for _ in 0..3 {
        let resp = client
            .post(format!("http://{}/v1/completions", router.addr))
            .json(&json!({"model": "m", "prompt": "hello", "max_tokens": 1}))
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        let body = resp.text().await.unwrap();
        assert_eq!(status, 200, "{body}");
        let body: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(body["choices"][0]["text"], "ok");
    }
}
