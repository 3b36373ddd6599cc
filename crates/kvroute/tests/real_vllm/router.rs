//! `kvroute serve` (the real binary) in front of real engines, and the plain HTTP the tests
//! speak to it and to the engines.

use std::process::{Command, Stdio};
use std::time::Duration;

use kvroute_testkit::{Killed, free_ports, wait_http};
use serde_json::Value;

use super::engines::{BLOCK_SIZE, Engine, MODEL};

/// A running `kvroute serve`.
pub struct Router {
    _process: Killed,
    /// The OpenAI API port.
    pub port: u16,
    /// The admin port (`/metrics`, `/kvroute/v1/explain`).
    pub admin: u16,
    dir: std::path::PathBuf,
}

impl Router {
    /// Starts `kvroute serve` over `engines` (with their events and replay) for the tiny model,
    /// its tokenizer given as YAML (`remote`, `{hf: ...}`), `extra` added to the configuration.
    pub fn start(engines: &[&Engine], tokenizer: &str, extra: &str) -> Router {
        let ports = free_ports(2);
        let (port, admin) = (ports, ports + 1);
        let dir =
            std::env::temp_dir().join(format!("kvroute-real-vllm-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut yaml = format!(
            "listen: 127.0.0.1:{port}\nadmin: {{listen: 127.0.0.1:{admin}}}\nmodels:\n  - {{name: {MODEL}, block_size: {BLOCK_SIZE}, tokenizer: {tokenizer}}}\n{extra}\nendpoints:\n"
        );
        yaml.push_str(&endpoints_yaml(engines));
        let config = dir.join("kvroute.yaml");
        std::fs::write(&config, yaml).unwrap();
        let process = Killed(
            Command::new(env!("CARGO_BIN_EXE_kvroute"))
                .args(["serve", "-c", config.to_str().unwrap()])
                .stdout(Stdio::null())
                .spawn()
                .unwrap(),
        );
        wait_http(&format!("http://127.0.0.1:{port}"));
        let router = Router {
            _process: process,
            port,
            admin,
            dir,
        };
        // Every engine healthy in the router's eyes (its first health check and scrape done).
        kvroute_testkit::eventually_blocking("the router to see every engine healthy", || {
            let text = router.metrics();
            let healthy =
                kvroute_testkit::sum_labelled(&text, "kvroute_endpoint_healthy{", "endpoint=");
            (healthy == engines.len() as f64, healthy)
        });
        router
    }

    /// `http://127.0.0.1:PORT` of the API.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// `http://127.0.0.1:PORT` of the admin listener.
    pub fn admin_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.admin)
    }

    /// The router's own `/metrics`.
    pub fn metrics(&self) -> String {
        kvroute_testkit::http_get(([127, 0, 0, 1], self.admin).into(), "/metrics")
    }

    /// A chat `body` sent through the router to its end (a stream whole, dechunked), answered
    /// 200.
    pub fn chat(&self, body: &Value) -> kvroute_testkit::HttpAnswer {
        let answer = kvroute_testkit::http_post_within(
            ([127, 0, 0, 1], self.port).into(),
            "/v1/chat/completions",
            &body.to_string(),
            Duration::from_secs(60),
        );
        assert_eq!(answer.status, 200, "{}", answer.body);
        answer
    }

    /// `/kvroute/v1/explain` for `body`.
    pub fn explain(&self, body: &Value) -> Value {
        let (status, answer) = post(self.admin, "/kvroute/v1/explain", body);
        assert_eq!(status, 200, "{answer}");
        answer
    }
}

impl Drop for Router {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The `endpoints:` list items for `engines`: each with its KV events and replay socket.
pub fn endpoints_yaml(engines: &[&Engine]) -> String {
    engines
        .iter()
        .map(|e| {
            format!(
                "  - {{url: '{}', events: 'tcp://127.0.0.1:{}', replay: 'tcp://127.0.0.1:{}'}}\n",
                e.url(),
                e.events,
                e.replay
            )
        })
        .collect()
}

/// The chosen endpoint of an explain answer and its predicted cached tokens.
pub fn prediction(explain: &Value) -> (String, u64) {
    let chosen = explain["chosen"].as_str().unwrap_or_default().to_owned();
    (chosen.clone(), predicted_for(explain, &chosen))
}

/// An explain answer's predicted cached tokens on `endpoint` (0 when not listed).
pub fn predicted_for(explain: &Value, endpoint: &str) -> u64 {
    explain["endpoints"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|e| e["endpoint"] == endpoint)
        .and_then(|e| e["predicted_cached_tokens"].as_u64())
        .unwrap_or(0)
}

/// `POST path` with a JSON body on 127.0.0.1:`port`: the status and the JSON answer (`Null`
/// when it is not JSON). A minute at most.
pub fn post(port: u16, path: &str, body: &Value) -> (u16, Value) {
    let answer = kvroute_testkit::http_post_within(
        ([127, 0, 0, 1], port).into(),
        path,
        &body.to_string(),
        Duration::from_secs(60),
    );
    (
        answer.status,
        serde_json::from_str(&answer.body).unwrap_or(Value::Null),
    )
}
