//! Simulator fleet load test: how many requests and streamed tokens per second a fleet of
//! simulated vLLM engines in one `kvroute sim` process sustains, and what it costs in CPU.
//!
//! The benchmark starts the release `kvroute sim` binary as a child process (8 engines on free
//! loopback ports) and drives an open-loop Poisson load of streaming `/v1/completions` requests,
//! round-robin over the engines. Prompts are 1–2k tokens: half continue one of 16 shared
//! 1,024-token prefixes, half are unique. After a warm-up it reads the child's CPU time
//! (`utime + stime` in `/proc/<pid>/stat`) at both ends of the measured window, and prints, per
//! rate: achieved requests/s, streamed tokens/s, errors, TTFT and end-to-end latency percentiles
//! as the client sees them, the simulator's cores and its CPU milliseconds per request. Each rate
//! gets a fresh simulator.
//!
//! The driver is a separate process, so its own CPU is not in the simulator's figures, but both
//! share the machine's cores; the driver's cores and the whole machine's busy cores are printed
//! too.
//!
//! Build the binary first, then run:
//!
//! ```text
//! cargo build --release -p kvroute
//! cargo bench -p kvroute-sim --bench fleet
//! ```
//!
//! Settings (environment variables): `KVROUTE_BENCH_RATES` (requests/s, comma-separated,
//! default `25,50,100`; `KVROUTE_BENCH_RATE` runs a single rate), `KVROUTE_BENCH_SECONDS`
//! (measured window, default 30), `KVROUTE_BENCH_WARMUP` (seconds, default 5),
//! `KVROUTE_BENCH_OUTPUT_TOKENS` (default 200), `KVROUTE_BENCH_ENGINES` (default 8),
//! `KVROUTE_BENCH_TIME_SCALE` (default 1), `KVROUTE_BENCH_BINARY` (path of `kvroute`).

use std::fmt::Write as _;
use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use futures::StreamExt;
use kvroute_testkit::settings::{setting, setting_at_least, setting_list};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Shared prompt prefixes (system prompts), and their length in tokens.
const SHARED_PREFIXES: usize = 16;
const SHARED_PREFIX_TOKENS: usize = 1024;
/// Token ids are drawn from this range (ids below 256 are special tokens).
const TOKEN_IDS: std::ops::Range<u32> = 256..60_000;
/// KV blocks per engine.
const GPU_BLOCKS: usize = 4096;
/// How long in-flight requests may take to finish after the window closes.
const DRAIN: Duration = Duration::from_secs(60);

struct Settings {
    rates: Vec<f64>,
    seconds: f64,
    warmup: f64,
    output_tokens: u32,
    engines: usize,
    time_scale: f64,
    binary: PathBuf,
}

impl Settings {
    fn from_env() -> Self {
        // Either spelling; the singular one wins when both are set.
        let rates_name = if std::env::var_os("KVROUTE_BENCH_RATE").is_some() {
            "KVROUTE_BENCH_RATE"
        } else {
            "KVROUTE_BENCH_RATES"
        };
        let rates = setting_list(
            rates_name,
            "25,50,100",
            "request rates per second, comma-separated, each above 0",
            |r| r.parse().ok().filter(|&r: &f64| r > 0.0),
        );
        let binary = std::env::var_os("KVROUTE_BENCH_BINARY").map_or_else(
            || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/release/kvroute"),
            PathBuf::from,
        );
        Self {
            rates,
            seconds: setting_at_least("KVROUTE_BENCH_SECONDS", 30.0, 0.1),
            warmup: setting_at_least("KVROUTE_BENCH_WARMUP", 5.0, 0.0),
            output_tokens: setting("KVROUTE_BENCH_OUTPUT_TOKENS", 200),
            engines: setting("KVROUTE_BENCH_ENGINES", 8),
            time_scale: setting_at_least("KVROUTE_BENCH_TIME_SCALE", 1.0, 0.001),
            binary,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// /proc readings

/// Clock ticks per second of `/proc/<pid>/stat` times.
fn clock_ticks() -> f64 {
    let out = Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .expect("running `getconf CLK_TCK`");
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .expect("`getconf CLK_TCK` prints a number")
}

/// CPU seconds (user + system) a process has used so far; `pid` `None` is this process.
fn cpu_seconds(pid: Option<u32>, ticks: f64) -> f64 {
    let path = match pid {
        Some(pid) => format!("/proc/{pid}/stat"),
        None => "/proc/self/stat".into(),
    };
    let stat = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {path}: {e}"));
    // Fields after the command name (which may contain spaces) start at field 3 (state).
    let rest = &stat[stat.rfind(')').expect("stat has a command name") + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields[11].parse().expect("utime");
    let stime: f64 = fields[12].parse().expect("stime");
    (utime + stime) / ticks
}

/// Busy and total CPU seconds of the whole machine (from `/proc/stat`).
fn machine_cpu(ticks: f64) -> (f64, f64) {
    let stat = std::fs::read_to_string("/proc/stat").expect("reading /proc/stat");
    let line = stat.lines().next().expect("/proc/stat has a cpu line");
    let v: Vec<f64> = line
        .split_whitespace()
        .skip(1)
        .map(|x| x.parse().unwrap_or(0.0))
        .collect();
    // user nice system idle iowait irq softirq steal (guest time is already in user).
    let total: f64 = v.iter().take(8).sum();
    let idle = v[3] + v.get(4).copied().unwrap_or(0.0);
    ((total - idle) / ticks, total / ticks)
}

/// Resident memory of a process, in MiB.
fn rss_mib(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        .map_or(f64::NAN, |kib| kib / 1024.0)
}

/// Context switches (voluntary + involuntary) of all threads of a process, and its threads.
fn context_switches(pid: u32) -> (u64, usize) {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return (0, 0);
    };
    let mut switches = 0;
    let mut threads = 0;
    for task in dir.flatten() {
        threads += 1;
        let status = std::fs::read_to_string(task.path().join("status")).unwrap_or_default();
        for line in status.lines() {
            if let Some(v) = line
                .strip_prefix("voluntary_ctxt_switches:")
                .or_else(|| line.strip_prefix("nonvoluntary_ctxt_switches:"))
            {
                switches += v.trim().parse::<u64>().unwrap_or(0);
            }
        }
    }
    (switches, threads)
}

// ---------------------------------------------------------------------------------------------
// The simulator process

struct Sim {
    child: Child,
    urls: Vec<String>,
    warnings: Arc<Mutex<Vec<String>>>,
}

impl Drop for Sim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Finds `n` consecutive free loopback ports, keeping them bound in `held`.
fn free_range(n: usize, held: &mut Vec<TcpListener>) -> u16 {
    'outer: for _ in 0..200 {
        let first = TcpListener::bind("127.0.0.1:0").expect("binding a loopback port");
        let base = first.local_addr().expect("local address").port();
        if usize::from(base) + n > 65_535 {
            continue;
        }
        let mut range = vec![first];
        for i in 1..n {
            match TcpListener::bind(("127.0.0.1", base + i as u16)) {
                Ok(l) => range.push(l),
                Err(_) => continue 'outer,
            }
        }
        held.extend(range);
        return base;
    }
    panic!("found no {n} consecutive free loopback ports");
}

fn spawn_sim(settings: &Settings) -> Sim {
    if !settings.binary.is_file() {
        eprintln!(
            "error: the kvroute binary is missing at {}\n\
             Build it first:  cargo build --release -p kvroute\n\
             (or point KVROUTE_BENCH_BINARY at a kvroute binary)",
            settings.binary.display()
        );
        std::process::exit(2);
    }
    for attempt in 1..=3 {
        let mut held = Vec::new();
        let n = settings.engines;
        let (port, events, replay) = (
            free_range(n, &mut held),
            free_range(n, &mut held),
            free_range(n, &mut held),
        );
        drop(held);
        let mut child = Command::new(&settings.binary)
            .args(["sim", "--engines", &n.to_string()])
            .args(["--port", &port.to_string()])
            .args(["--events-port", &events.to_string()])
            .args(["--replay-port", &replay.to_string()])
            .args(["--num-gpu-blocks", &GPU_BLOCKS.to_string()])
            .args(["--time-scale", &settings.time_scale.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", settings.binary.display()));

        // Stdout lists the engines ("  engine 0: http://...  events ...  replay ..."); keep
        // reading both pipes until the child exits so it never blocks on a full pipe.
        let (tx, rx) = mpsc::channel::<String>();
        let stdout = child.stdout.take().expect("piped stdout");
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let warnings = Arc::new(Mutex::new(Vec::new()));
        let stderr = child.stderr.take().expect("piped stderr");
        let sink = warnings.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if line.contains("WARN") || line.contains("ERROR") || line.contains("error") {
                    sink.lock().expect("warnings lock").push(line);
                }
            }
        });

        let deadline = Instant::now() + Duration::from_secs(20);
        let mut urls = Vec::new();
        while urls.len() < n {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) => {
                    let words: Vec<&str> = line.split_whitespace().collect();
                    if words.len() >= 3 && words[0] == "engine" && words[1].ends_with(':') {
                        urls.push(words[2].to_owned());
                    }
                }
                Err(_) => break,
            }
        }
        let sim = Sim {
            child,
            urls,
            warnings,
        };
        if sim.urls.len() == n {
            return sim;
        }
        let lines = sim.warnings.lock().expect("warnings lock").join("\n");
        eprintln!("attempt {attempt}: the simulator did not start:\n{lines}");
    }
    panic!("the simulator did not start (see above)");
}

// ---------------------------------------------------------------------------------------------
// Load

#[derive(Default)]
struct Counters {
    tokens: AtomicU64,
    completed: AtomicU64,
    errors: AtomicU64,
}

struct Outcome {
    scheduled: Instant,
    /// Seconds from the scheduled arrival to the first token.
    ttft: Option<f64>,
    /// Seconds from the scheduled arrival to `[DONE]` (or the failure).
    e2e: f64,
    error: Option<String>,
}

struct Prompts {
    shared: Vec<Vec<u32>>,
}

impl Prompts {
    fn new(seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let shared = (0..SHARED_PREFIXES)
            .map(|_| {
                (0..SHARED_PREFIX_TOKENS)
                    .map(|_| rng.random_range(TOKEN_IDS))
                    .collect()
            })
            .collect();
        Self { shared }
    }

    /// A request body: half the prompts continue a shared prefix with 128–896 unique tokens,
    /// half are 1,024–2,048 unique tokens.
    fn body(&self, rng: &mut StdRng, output_tokens: u32) -> String {
        let mut prompt: Vec<u32> = Vec::with_capacity(2048);
        let unique = if rng.random_bool(0.5) {
            prompt.extend_from_slice(&self.shared[rng.random_range(0..SHARED_PREFIXES)]);
            rng.random_range(128..=896)
        } else {
            rng.random_range(1024..=2048)
        };
        prompt.extend((0..unique).map(|_| rng.random_range(TOKEN_IDS)));
        let mut body = String::with_capacity(prompt.len() * 6 + 200);
        body.push_str(
            r#"{"model":"sim-llama-3.1-8b","stream":true,"stream_options":{"include_usage":true},"#,
        );
        let _ = write!(body, r#""max_tokens":{output_tokens},"prompt":["#);
        for (i, t) in prompt.iter().enumerate() {
            if i > 0 {
                body.push(',');
            }
            let _ = write!(body, "{t}");
        }
        body.push_str("]}");
        body
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Sends one streaming request and reads its SSE stream to `[DONE]`.
async fn one_request(
    client: reqwest::Client,
    url: String,
    body: String,
    scheduled: Instant,
    expect: u32,
    counters: Arc<Counters>,
) -> Outcome {
    let result = stream_one(&client, &url, body, scheduled, expect, &counters).await;
    let e2e = scheduled.elapsed().as_secs_f64();
    match result {
        Ok(ttft) => {
            counters.completed.fetch_add(1, Ordering::Relaxed);
            Outcome {
                scheduled,
                ttft: Some(ttft),
                e2e,
                error: None,
            }
        }
        Err(e) => {
            counters.errors.fetch_add(1, Ordering::Relaxed);
            Outcome {
                scheduled,
                ttft: None,
                e2e,
                error: Some(e),
            }
        }
    }
}

async fn stream_one(
    client: &reqwest::Client,
    url: &str,
    body: String,
    scheduled: Instant,
    expect: u32,
    counters: &Counters,
) -> Result<f64, String> {
    let response = client
        .post(url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .map_err(|e| format!("send: {e}"))?;
    let status = response.status();
    if !status.is_success() {
        let text = response.text().await.unwrap_or_default();
        return Err(format!("HTTP {status}: {text}"));
    }
    let mut stream = response.bytes_stream();
    let mut buf: Vec<u8> = Vec::with_capacity(4096);
    let mut ttft = None;
    let mut tokens = 0u32;
    let mut usage_tokens = None;
    let mut done = false;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| format!("reading the stream after {tokens} tokens: {e}"))?;
        buf.extend_from_slice(&chunk);
        let mut start = 0;
        while let Some(pos) = find(&buf[start..], b"\n\n") {
            let event = &buf[start..start + pos];
            start += pos + 2;
            if event.starts_with(b"data: [DONE]") {
                done = true;
            } else if event.starts_with(b"data: {\"error\"") {
                return Err(String::from_utf8_lossy(event).into_owned());
            } else if find(event, b"\"usage\":{").is_some() {
                let value: serde_json::Value =
                    serde_json::from_slice(&event[6..]).map_err(|e| format!("usage chunk: {e}"))?;
                usage_tokens = value["usage"]["completion_tokens"].as_u64();
            } else if event.starts_with(b"data: {") {
                if ttft.is_none() {
                    ttft = Some(scheduled.elapsed().as_secs_f64());
                }
                tokens += 1;
                counters.tokens.fetch_add(1, Ordering::Relaxed);
            } else if !event.is_empty() {
                return Err(format!(
                    "unexpected event {:?}",
                    String::from_utf8_lossy(event)
                ));
            }
        }
        buf.drain(..start);
    }
    if !done {
        return Err(format!(
            "the stream ended without [DONE] after {tokens} tokens"
        ));
    }
    if tokens != expect || usage_tokens != Some(u64::from(expect)) {
        return Err(format!(
            "{tokens} token chunks, usage {usage_tokens:?}, expected {expect}"
        ));
    }
    ttft.ok_or_else(|| "no tokens".into())
}

struct Snapshot {
    at: Instant,
    sim_cpu: f64,
    own_cpu: f64,
    machine: (f64, f64),
    switches: u64,
    tokens: u64,
    completed: u64,
}

fn snapshot(pid: u32, ticks: f64, counters: &Counters) -> Snapshot {
    Snapshot {
        at: Instant::now(),
        sim_cpu: cpu_seconds(Some(pid), ticks),
        own_cpu: cpu_seconds(None, ticks),
        machine: machine_cpu(ticks),
        switches: context_switches(pid).0,
        tokens: counters.tokens.load(Ordering::Relaxed),
        completed: counters.completed.load(Ordering::Relaxed),
    }
}

struct Row {
    rate: f64,
    requests_per_s: f64,
    tokens_per_s: f64,
    issued: usize,
    errors: usize,
    ttft_p50: f64,
    ttft_p99: f64,
    e2e_p50: f64,
    e2e_p99: f64,
    sim_cores: f64,
    sim_ms_per_request: f64,
    sim_us_per_token: f64,
    switches_per_s: f64,
    idle_cores: f64,
    driver_cores: f64,
    machine_cores: f64,
    rss_mib: f64,
    threads: usize,
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

async fn run_rate(settings: &Settings, rate: f64, ticks: f64) -> Row {
    let sim = spawn_sim(settings);
    let pid = sim.child.id();
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(256)
        .tcp_nodelay(true)
        .timeout(Duration::from_secs(120))
        .build()
        .expect("building the HTTP client");
    let completions: Vec<String> = sim
        .urls
        .iter()
        .map(|u| format!("{u}/v1/completions"))
        .collect();

    // Idle cost of the fleet, before any load.
    let idle_from = (Instant::now(), cpu_seconds(Some(pid), ticks));
    tokio::time::sleep(Duration::from_secs(2)).await;
    let idle_cores =
        (cpu_seconds(Some(pid), ticks) - idle_from.1) / idle_from.0.elapsed().as_secs_f64();

    let counters = Arc::new(Counters::default());
    let prompts = Arc::new(Prompts::new(7));
    let start = Instant::now();
    let window_start = start + Duration::from_secs_f64(settings.warmup);
    let window_end = window_start + Duration::from_secs_f64(settings.seconds);

    // Open loop: Poisson arrivals until the window closes, round-robin over the engines.
    let dispatcher = {
        let counters = counters.clone();
        let prompts = prompts.clone();
        let client = client.clone();
        let expect = settings.output_tokens;
        tokio::spawn(async move {
            let mut rng = StdRng::seed_from_u64(rate.to_bits());
            let mut handles = Vec::new();
            let mut next = start;
            let mut k = 0usize;
            loop {
                let u: f64 = rng.random();
                next += Duration::from_secs_f64(-(1.0 - u).ln() / rate);
                if next >= window_end {
                    break;
                }
                tokio::time::sleep_until(next.into()).await;
                let body = prompts.body(&mut rng, expect);
                let url = completions[k % completions.len()].clone();
                k += 1;
                handles.push(tokio::spawn(one_request(
                    client.clone(),
                    url,
                    body,
                    next,
                    expect,
                    counters.clone(),
                )));
            }
            handles
        })
    };

    tokio::time::sleep_until(window_start.into()).await;
    let a = snapshot(pid, ticks, &counters);
    tokio::time::sleep_until(window_end.into()).await;
    let b = snapshot(pid, ticks, &counters);
    let rss = rss_mib(pid);
    let threads = context_switches(pid).1;

    let handles = dispatcher.await.expect("dispatcher");
    let drain_until = tokio::time::Instant::now() + DRAIN;
    let mut outcomes = Vec::with_capacity(handles.len());
    let mut unfinished = 0;
    for handle in handles {
        match tokio::time::timeout_at(drain_until, handle).await {
            Ok(Ok(outcome)) => outcomes.push(outcome),
            _ => unfinished += 1,
        }
    }

    let in_window: Vec<&Outcome> = outcomes
        .iter()
        .filter(|o| o.scheduled >= window_start && o.scheduled < window_end)
        .collect();
    let mut errors: Vec<&str> = outcomes.iter().filter_map(|o| o.error.as_deref()).collect();
    let mut ttft: Vec<f64> = in_window.iter().filter_map(|o| o.ttft).collect();
    let mut e2e: Vec<f64> = in_window
        .iter()
        .filter(|o| o.error.is_none())
        .map(|o| o.e2e)
        .collect();
    ttft.sort_by(f64::total_cmp);
    e2e.sort_by(f64::total_cmp);
    let window_errors = in_window.iter().filter(|o| o.error.is_some()).count();
    if !errors.is_empty() || unfinished > 0 {
        errors.sort_unstable();
        errors.dedup();
        eprintln!(
            "  rate {rate}: {} failed requests ({unfinished} unfinished after the drain); first messages:",
            counters.errors.load(Ordering::Relaxed)
        );
        for e in errors.iter().take(5) {
            eprintln!("    {e}");
        }
    }
    let warnings = sim.warnings.lock().expect("warnings lock").clone();
    if !warnings.is_empty() {
        eprintln!(
            "  rate {rate}: the simulator logged {} warnings/errors; first:",
            warnings.len()
        );
        for w in warnings.iter().take(5) {
            eprintln!("    {w}");
        }
    }

    let wall = (b.at - a.at).as_secs_f64();
    let completed = (b.completed - a.completed) as f64;
    let tokens = (b.tokens - a.tokens) as f64;
    let sim_cpu = b.sim_cpu - a.sim_cpu;
    Row {
        rate,
        requests_per_s: completed / wall,
        tokens_per_s: tokens / wall,
        issued: in_window.len(),
        errors: window_errors + unfinished,
        ttft_p50: percentile(&ttft, 0.50) * 1e3,
        ttft_p99: percentile(&ttft, 0.99) * 1e3,
        e2e_p50: percentile(&e2e, 0.50) * 1e3,
        e2e_p99: percentile(&e2e, 0.99) * 1e3,
        sim_cores: sim_cpu / wall,
        sim_ms_per_request: sim_cpu * 1e3 / completed,
        sim_us_per_token: sim_cpu * 1e6 / tokens,
        switches_per_s: (b.switches - a.switches) as f64 / wall,
        idle_cores,
        driver_cores: (b.own_cpu - a.own_cpu) / wall,
        machine_cores: (b.machine.0 - a.machine.0) / (b.machine.1 - a.machine.1)
            * std::thread::available_parallelism().map_or(1.0, |n| n.get() as f64),
        rss_mib: rss,
        threads,
    }
}

fn main() {
    let settings = Settings::from_env();
    let ticks = clock_ticks();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "kvroute sim fleet: {} engines, {} GPU blocks each, time scale {}, {} output tokens, \
         {}s warm-up + {}s measured per rate, {cores} CPU cores, CLK_TCK {ticks}",
        settings.engines,
        GPU_BLOCKS,
        settings.time_scale,
        settings.output_tokens,
        settings.warmup,
        settings.seconds
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("building the driver's runtime");
    let mut rows = Vec::new();
    let loadavg = || std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("load average before: {}", loadavg().trim());
    for &rate in &settings.rates {
        println!("running {rate} requests/s ...");
        let row = runtime.block_on(run_rate(&settings, rate, ticks));
        println!(
            "  {:.1} req/s, {:.0} tokens/s, sim {:.3} cores ({:.2} ms/request), driver {:.3} cores",
            row.requests_per_s,
            row.tokens_per_s,
            row.sim_cores,
            row.sim_ms_per_request,
            row.driver_cores
        );
        rows.push(row);
    }

    println!("load average after: {}", loadavg().trim());
    println!();
    println!(
        "| Offered req/s | Achieved req/s | Streamed tokens/s | Requests (errors) | TTFT p50 / p99 (ms) | E2E p50 / p99 (ms) | Sim cores | Sim CPU ms/request | Sim CPU µs/token |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in &rows {
        println!(
            "| {:.0} | {:.1} | {:.0} | {} ({}) | {:.0} / {:.0} | {:.0} / {:.0} | {:.3} | {:.2} | {:.1} |",
            r.rate,
            r.requests_per_s,
            r.tokens_per_s,
            r.issued,
            r.errors,
            r.ttft_p50,
            r.ttft_p99,
            r.e2e_p50,
            r.e2e_p99,
            r.sim_cores,
            r.sim_ms_per_request,
            r.sim_us_per_token
        );
    }
    println!();
    println!(
        "| Offered req/s | Sim idle cores | Sim context switches/s (/proc) | Sim threads | Sim RSS (MiB) | Driver cores | Machine busy cores |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|");
    for r in &rows {
        println!(
            "| {:.0} | {:.3} | {:.0} | {} | {:.0} | {:.3} | {:.2} |",
            r.rate,
            r.idle_cores,
            r.switches_per_s,
            r.threads,
            r.rss_mib,
            r.driver_cores,
            r.machine_cores
        );
    }
}
