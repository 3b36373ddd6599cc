//! The router's cost over HTTP: added latency and requests per second of `kvroute serve` in
//! front of one `kvroute sim` engine, against the same engine called directly, in the same run.
//!
//! The bench starts the release `kvroute` binary twice, as separate processes on free loopback
//! ports: `kvroute sim` (one engine, `--time-scale 1000` so that the engine's simulated
//! latency is a few microseconds) and `kvroute serve` in front of it (KV events and replay
//! configured, default policy). It then drives both from this process with reqwest:
//!
//! 1. **Latency.** The same non-streaming `/v1/completions` request (a prompt of 2,000 token
//!    ids, so no tokenization, `max_tokens: 1`) is sent alternately to the engine and to the
//!    router, one at a time, each client on its own kept-alive connection. After a warm-up
//!    every request is a full prefix-cache hit on both paths. It reports p50/p90/p99 of both,
//!    their differences and the percentiles of the paired difference (routed minus the direct
//!    request sent next to it). The same is repeated with `stream: true` (a third as many
//!    pairs). It also counts the TCP connections the router opened to the engine (sockets in
//!    `TIME_WAIT` towards the engine's port) and the router's CPU time per request.
//! 2. **Throughput.** A closed loop of N concurrent clients sending small requests (64 token
//!    ids from a pool of 1,024 prompts, `max_tokens: 1`), for each concurrency first straight
//!    to the engine, then through the router. It reports requests/s, latency, and the CPU each
//!    process used (`utime + stime` from `/proc/<pid>/stat`), from which the router's CPU per
//!    request, and so the requests/s one router core sustains, follow.
//!
//! Everything (driver, router, engine) shares this machine's cores, so compare the two paths
//! within one run. A request that reaches an idle simulated engine waits for the engine's next
//! step, which sleeps until `now + step time / time scale` on tokio's 1 ms timer: most
//! one-at-a-time requests (both paths alike) take about 1 ms longer than their work, whatever
//! the time scale, and the latencies are bimodal (see p10). Build the binary first, then run:
//!
//! ```text
//! cargo build --release -p kvroute
//! cargo bench -p kvroute-router --bench proxy
//! ```
//!
//! Settings (environment variables): `KVROUTE_BENCH_PAIRS` (latency pairs, default 3000),
//! `KVROUTE_BENCH_CONCURRENCY` (comma-separated, default `16,64`), `KVROUTE_BENCH_SECONDS`
//! (measured window per throughput run, default 8), `KVROUTE_BENCH_TIME_SCALE` (default 1000),
//! `KVROUTE_BENCH_BINARY` (path of `kvroute`). `RUST_LOG` is passed on to both processes (the
//! router logs one line per request at the default `info`).

// Measures real processes and sockets: wall-clock time, not the router's (tokio) clock.
#![allow(clippy::disallowed_methods)]

use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use kvroute_testkit::random::tokens;
use kvroute_testkit::settings::{setting, setting_at_least, setting_list};

/// The model the simulator serves.
const MODEL: &str = "sim-llama-3.1-8b";
/// Prompt length of the latency test.
const LATENCY_PROMPT_TOKENS: usize = 2_000;
/// Unmeasured pairs before the latency test (non-streaming, streaming).
const LATENCY_WARMUP_PAIRS: [usize; 2] = [200, 50];
/// Prompt length of the throughput test.
const SMALL_PROMPT_TOKENS: usize = 64;
/// Distinct prompts in the throughput test.
const SMALL_PROMPTS: usize = 1_024;
/// Unmeasured seconds before each throughput window.
const LOAD_WARMUP: Duration = Duration::from_millis(1_500);

struct Settings {
    pairs: usize,
    concurrency: Vec<usize>,
    seconds: f64,
    time_scale: f64,
    binary: PathBuf,
}

impl Settings {
    fn from_env() -> Self {
        let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let binary = std::env::var_os("KVROUTE_BENCH_BINARY")
            .map(PathBuf::from)
            .unwrap_or_else(|| workspace.join("target/release/kvroute"));
        let concurrency = setting_list(
            "KVROUTE_BENCH_CONCURRENCY",
            "16,64",
            "client counts, comma-separated, each at least 1",
            |c| c.parse().ok().filter(|&c: &usize| c > 0),
        );
        Self {
            pairs: setting("KVROUTE_BENCH_PAIRS", 3_000usize).max(10),
            concurrency,
            seconds: setting_at_least("KVROUTE_BENCH_SECONDS", 8.0, 1.0),
            time_scale: setting_at_least("KVROUTE_BENCH_TIME_SCALE", 1_000.0, 0.001),
            binary,
        }
    }
}

/// A child process, killed when dropped.
struct Proc {
    child: Child,
    name: &'static str,
    log: PathBuf,
}

impl Proc {
    fn spawn(name: &'static str, binary: &Path, args: &[String], dir: &Path) -> Proc {
        let log = dir.join(format!("{name}.log"));
        let out = std::fs::File::create(&log).expect("creating a log file");
        let err = out.try_clone().expect("cloning the log file");
        let child = Command::new(binary)
            .args(args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", binary.display()));
        Proc { child, name, log }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The last lines of its log, for error messages.
    fn log_tail(&self) -> String {
        let mut text = String::new();
        if let Ok(mut f) = std::fs::File::open(&self.log) {
            let _ = f.read_to_string(&mut text);
        }
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }

    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free loopback port")
        .port()
}

fn clock_ticks() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(100.0)
}

/// CPU seconds (user + system) a process has used, `pid` `None` for this one.
fn cpu_seconds(pid: Option<u32>, ticks: f64) -> f64 {
    let path = match pid {
        Some(p) => format!("/proc/{p}/stat"),
        None => "/proc/self/stat".into(),
    };
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let Some(after) = text.rfind(')').map(|i| &text[i + 1..]) else {
        return 0.0;
    };
    let fields: Vec<&str> = after.split_whitespace().collect();
    let get = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // Fields 14 and 15 of stat; `after` starts at field 3.
    (get(11) + get(12)) / ticks
}

/// (busy, total) jiffies of the whole machine.
fn machine_jiffies() -> (f64, f64) {
    let text = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let first = text.lines().next().unwrap_or_default();
    let v: Vec<f64> = first
        .split_whitespace()
        .skip(1)
        .filter_map(|f| f.parse().ok())
        .collect();
    let total: f64 = v.iter().sum();
    let idle = v.get(3).copied().unwrap_or(0.0) + v.get(4).copied().unwrap_or(0.0);
    (total - idle, total)
}

/// Sockets in `TIME_WAIT` towards `port` on loopback: connections closed by their client
/// (here: the router's connections to the engine).
fn time_wait_towards(port: u16) -> usize {
    let want = format!(":{port:04X}");
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .iter()
        .map(|path| {
            std::fs::read_to_string(path)
                .unwrap_or_default()
                .lines()
                .skip(1)
                .filter(|line| {
                    let f: Vec<&str> = line.split_whitespace().collect();
                    f.len() > 3 && f[2].ends_with(&want) && f[3] == "06"
                })
                .count()
        })
        .sum()
}

/// CPU seconds of the engine, the router and the driver, and the machine's jiffies.
#[derive(Clone, Copy)]
struct Cpu {
    sim: f64,
    router: f64,
    driver: f64,
    machine: (f64, f64),
    at: Instant,
}

impl Cpu {
    fn now(sim: u32, router: u32, ticks: f64) -> Cpu {
        Cpu {
            sim: cpu_seconds(Some(sim), ticks),
            router: cpu_seconds(Some(router), ticks),
            driver: cpu_seconds(None, ticks),
            machine: machine_jiffies(),
            at: Instant::now(),
        }
    }
}

/// CPU use over a window.
struct CpuUse {
    wall: f64,
    sim: f64,
    router: f64,
    driver: f64,
    machine_cores: f64,
}

fn cpu_use(a: Cpu, b: Cpu) -> CpuUse {
    let wall = (b.at - a.at).as_secs_f64();
    let cores = std::thread::available_parallelism().map_or(1.0, |n| n.get() as f64);
    CpuUse {
        wall,
        sim: b.sim - a.sim,
        router: b.router - a.router,
        driver: b.driver - a.driver,
        machine_cores: (b.machine.0 - a.machine.0) / (b.machine.1 - a.machine.1).max(1.0) * cores,
    }
}

fn body(prompt: &[u32], stream: bool) -> Bytes {
    let mut value = serde_json::json!({"model": MODEL, "prompt": prompt, "max_tokens": 1});
    if stream {
        value["stream"] = true.into();
    }
    Bytes::from(serde_json::to_vec(&value).expect("json"))
}

fn client(max_idle: usize) -> reqwest::Client {
    reqwest::Client::builder()
        .pool_max_idle_per_host(max_idle)
        .tcp_nodelay(true)
        .timeout(Duration::from_secs(30))
        .build()
        .expect("an HTTP client")
}

/// Sends one request and reads the whole response; returns its latency.
async fn send(client: &reqwest::Client, url: &str, body: &Bytes) -> Result<Duration, String> {
    let start = Instant::now();
    let response = client
        .post(url)
        .header("content-type", "application/json")
        .body(body.clone())
        .send()
        .await
        .map_err(|e| format!("{url}: {e}"))?;
    let status = response.status();
    let bytes = response.bytes().await.map_err(|e| format!("{url}: {e}"))?;
    let elapsed = start.elapsed();
    if !status.is_success() {
        return Err(format!(
            "{url}: {status}: {}",
            String::from_utf8_lossy(&bytes)
        ));
    }
    Ok(elapsed)
}

async fn wait_ready(url: &str, proc: &mut Proc) -> Result<(), String> {
    let c = client(1);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(status) = proc.exited() {
            return Err(format!(
                "{} exited ({status}) while starting; its log ends:\n{}",
                proc.name,
                proc.log_tail()
            ));
        }
        if let Ok(r) = c.get(url).send().await
            && r.status().is_success()
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!(
                "{} not ready at {url} after 30 s; its log ends:\n{}",
                proc.name,
                proc.log_tail()
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// The `p`-th percentile of sorted values.
fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * p / 100.0).round() as usize]
}

fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(f64::total_cmp);
    v
}

struct Latency {
    label: &'static str,
    direct: Vec<f64>,
    routed: Vec<f64>,
    paired: Vec<f64>,
    new_connections: usize,
    router_cpu_us: f64,
    sim_cpu_us: f64,
}

/// Alternates the same request between the engine and the router, one at a time.
#[allow(clippy::too_many_arguments)]
async fn latency(
    label: &'static str,
    direct_url: &str,
    router_url: &str,
    body: &Bytes,
    (warmup, pairs): (usize, usize),
    sim: u32,
    router: u32,
    sim_port: u16,
    ticks: f64,
) -> Result<Latency, String> {
    let direct = client(1);
    let routed = client(1);
    for _ in 0..warmup {
        send(&direct, direct_url, body).await?;
        send(&routed, router_url, body).await?;
    }
    let waits = time_wait_towards(sim_port);
    let before = Cpu::now(sim, router, ticks);
    let mut d = Vec::with_capacity(pairs);
    let mut r = Vec::with_capacity(pairs);
    let mut paired = Vec::with_capacity(pairs);
    for i in 0..pairs {
        let (a, b) = if i % 2 == 0 {
            let a = send(&direct, direct_url, body).await?;
            (a, send(&routed, router_url, body).await?)
        } else {
            let b = send(&routed, router_url, body).await?;
            (send(&direct, direct_url, body).await?, b)
        };
        d.push(micros(a));
        r.push(micros(b));
        paired.push(micros(b) - micros(a));
    }
    let after = Cpu::now(sim, router, ticks);
    let used = cpu_use(before, after);
    Ok(Latency {
        label,
        direct: sorted(d),
        routed: sorted(r),
        paired: sorted(paired),
        new_connections: time_wait_towards(sim_port).saturating_sub(waits),
        router_cpu_us: used.router / pairs as f64 * 1e6,
        sim_cpu_us: used.sim / (2 * pairs) as f64 * 1e6,
    })
}

struct Load {
    target: &'static str,
    concurrency: usize,
    done: usize,
    errors: usize,
    first_error: Option<String>,
    latencies: Vec<f64>,
    cpu: CpuUse,
}

/// A closed loop: `concurrency` clients each sending its next request as soon as the last one
/// is answered.
#[allow(clippy::too_many_arguments)]
async fn closed_loop(
    target: &'static str,
    url: &str,
    bodies: Arc<Vec<Bytes>>,
    concurrency: usize,
    seconds: f64,
    sim: u32,
    router: u32,
    ticks: f64,
) -> Load {
    let http = client(concurrency);
    let stop = Arc::new(AtomicBool::new(false));
    let measuring = Arc::new(AtomicBool::new(false));
    let next = Arc::new(AtomicUsize::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (http, url, bodies) = (http.clone(), url.to_owned(), bodies.clone());
        let (stop, measuring, next, errors) = (
            stop.clone(),
            measuring.clone(),
            next.clone(),
            errors.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut first_error = None;
            while !stop.load(Ordering::Relaxed) {
                let i = next.fetch_add(1, Ordering::Relaxed) % bodies.len();
                let result = send(&http, &url, &bodies[i]).await;
                if measuring.load(Ordering::Relaxed) {
                    match result {
                        Ok(t) => latencies.push(micros(t)),
                        Err(e) => {
                            errors.fetch_add(1, Ordering::Relaxed);
                            first_error.get_or_insert(e);
                        }
                    }
                }
            }
            (latencies, first_error)
        }));
    }
    tokio::time::sleep(LOAD_WARMUP).await;
    measuring.store(true, Ordering::Relaxed);
    let before = Cpu::now(sim, router, ticks);
    tokio::time::sleep(Duration::from_secs_f64(seconds)).await;
    measuring.store(false, Ordering::Relaxed);
    let after = Cpu::now(sim, router, ticks);
    stop.store(true, Ordering::Relaxed);
    let mut latencies = Vec::new();
    let mut first_error = None;
    for task in tasks {
        if let Ok((l, e)) = task.await {
            latencies.extend(l);
            if first_error.is_none() {
                first_error = e;
            }
        }
    }
    Load {
        target,
        concurrency,
        done: latencies.len(),
        errors: errors.load(Ordering::Relaxed) as usize,
        first_error,
        latencies: sorted(latencies),
        cpu: cpu_use(before, after),
    }
}

fn main() -> ExitCode {
    let settings = Settings::from_env();
    if !settings.binary.is_file() {
        eprintln!(
            "kvroute proxy bench: {} not found.\n\
             Build the release binary first:\n\n    cargo build --release -p kvroute\n\n\
             (or point KVROUTE_BENCH_BINARY at a kvroute binary).",
            settings.binary.display()
        );
        return ExitCode::from(2);
    }
    let ticks = clock_ticks();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let dir = std::env::temp_dir().join(format!("kvroute-proxy-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a directory for the logs");
    let (sim_port, events_port, replay_port, router_port) =
        (free_port(), free_port(), free_port(), free_port());
    println!(
        "kvroute proxy bench: binary {}, time scale {}, {cores} CPU cores, CLK_TCK {ticks}, \
         RUST_LOG={}, logs in {}",
        settings.binary.display(),
        settings.time_scale,
        std::env::var("RUST_LOG").unwrap_or_else(|_| "(unset: info)".into()),
        dir.display()
    );
    let mut sim = Proc::spawn(
        "sim",
        &settings.binary,
        &[
            "sim".into(),
            "--engines".into(),
            "1".into(),
            "--port".into(),
            sim_port.to_string(),
            "--events-port".into(),
            events_port.to_string(),
            "--replay-port".into(),
            replay_port.to_string(),
            "--time-scale".into(),
            settings.time_scale.to_string(),
            "--num-gpu-blocks".into(),
            "8192".into(),
        ],
        &dir,
    );
    let config = dir.join("kvroute.yaml");
    std::fs::write(
        &config,
        format!(
            "listen: 127.0.0.1:{router_port}\nadmin: {{listen: 127.0.0.1:0}}\nmodels: [{{name: {MODEL}}}]\n\
             endpoints: [{{url: 'http://127.0.0.1:{sim_port}', \
             events: 'tcp://127.0.0.1:{events_port}', replay: 'tcp://127.0.0.1:{replay_port}'}}]\n"
        ),
    )
    .expect("writing the router's configuration");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("the driver's runtime");
    if let Err(e) = runtime.block_on(wait_ready(
        &format!("http://127.0.0.1:{sim_port}/health"),
        &mut sim,
    )) {
        eprintln!("kvroute proxy bench: {e}");
        return ExitCode::FAILURE;
    }
    let mut router = Proc::spawn(
        "router",
        &settings.binary,
        &["serve".into(), "-c".into(), config.display().to_string()],
        &dir,
    );
    if let Err(e) = runtime.block_on(wait_ready(
        &format!("http://127.0.0.1:{router_port}/health"),
        &mut router,
    )) {
        eprintln!("kvroute proxy bench: {e}");
        return ExitCode::FAILURE;
    }
    // Let the KV-event subscription connect before the first request.
    std::thread::sleep(Duration::from_millis(500));
    let direct_url = format!("http://127.0.0.1:{sim_port}/v1/completions");
    let router_url = format!("http://127.0.0.1:{router_port}/v1/completions");
    let (sim_pid, router_pid) = (sim.pid(), router.pid());
    let loadavg = || std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("load average before: {}", loadavg().trim());

    let prompt = tokens(42, LATENCY_PROMPT_TOKENS);
    let mut latencies = Vec::new();
    for (label, stream, warmup, pairs) in [
        (
            "non-streaming",
            false,
            LATENCY_WARMUP_PAIRS[0],
            settings.pairs,
        ),
        (
            "streaming",
            true,
            LATENCY_WARMUP_PAIRS[1],
            settings.pairs / 3,
        ),
    ] {
        println!("latency, {label}: {pairs} pairs of {LATENCY_PROMPT_TOKENS}-token requests ...");
        match runtime.block_on(latency(
            label,
            &direct_url,
            &router_url,
            &body(&prompt, stream),
            (warmup, pairs),
            sim_pid,
            router_pid,
            sim_port,
            ticks,
        )) {
            Ok(l) => latencies.push(l),
            Err(e) => {
                eprintln!(
                    "kvroute proxy bench: {e}\nrouter log ends:\n{}",
                    router.log_tail()
                );
                return ExitCode::FAILURE;
            }
        }
    }

    let small: Arc<Vec<Bytes>> = Arc::new(
        (0..SMALL_PROMPTS)
            .map(|i| body(&tokens(1_000 + i as u64, SMALL_PROMPT_TOKENS), false))
            .collect(),
    );
    let mut loads = Vec::new();
    for &c in &settings.concurrency {
        for (target, url) in [("engine", &direct_url), ("router", &router_url)] {
            println!("throughput: {c} clients -> {target} ...");
            let load = runtime.block_on(closed_loop(
                target,
                url,
                small.clone(),
                c,
                settings.seconds,
                sim_pid,
                router_pid,
                ticks,
            ));
            if let Some(e) = &load.first_error {
                println!("  {} errors, first: {e}", load.errors);
            }
            loads.push(load);
        }
    }
    println!("load average after: {}", loadavg().trim());

    println!();
    println!(
        "Latency ({LATENCY_PROMPT_TOKENS}-token prompt as token ids, max_tokens 1, one request \
         at a time; microseconds)"
    );
    println!();
    println!(
        "| Mode | Pairs | Direct p10 / p50 / p90 / p99 | Routed p10 / p50 / p90 / p99 | Added (p50, \
         p90, p99 differences) | Paired difference p50 / p90 / p99 | Router CPU µs/request | \
         Engine CPU µs/request | New engine connections / routed request |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for l in &latencies {
        let (d, r, p) = (&l.direct, &l.routed, &l.paired);
        println!(
            "| {} | {} | {:.0} / {:.0} / {:.0} / {:.0} | {:.0} / {:.0} / {:.0} / {:.0} | {:.0}, \
             {:.0}, {:.0} | {:.0} / {:.0} / {:.0} | {:.0} | {:.0} | {:.2} |",
            l.label,
            d.len(),
            pct(d, 10.0),
            pct(d, 50.0),
            pct(d, 90.0),
            pct(d, 99.0),
            pct(r, 10.0),
            pct(r, 50.0),
            pct(r, 90.0),
            pct(r, 99.0),
            pct(r, 50.0) - pct(d, 50.0),
            pct(r, 90.0) - pct(d, 90.0),
            pct(r, 99.0) - pct(d, 99.0),
            pct(p, 50.0),
            pct(p, 90.0),
            pct(p, 99.0),
            l.router_cpu_us,
            l.sim_cpu_us,
            l.new_connections as f64 / d.len() as f64,
        );
    }
    println!();
    println!(
        "Throughput (closed loop, {SMALL_PROMPT_TOKENS}-token prompts as token ids, max_tokens 1, \
         {:.0} s per run; CPU in cores = CPU seconds / wall seconds)",
        settings.seconds
    );
    println!();
    println!(
        "| Clients | Target | Requests/s | Errors | Latency p50 / p99 (ms) | Engine cores | \
         Router cores | Driver cores | Machine busy cores | Engine CPU µs/req | Router CPU µs/req |"
    );
    println!("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for l in &loads {
        let c = &l.cpu;
        let n = l.done.max(1) as f64;
        println!(
            "| {} | {} | {:.0} | {} | {:.2} / {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {:.0} | {} |",
            l.concurrency,
            l.target,
            l.done as f64 / c.wall,
            l.errors,
            pct(&l.latencies, 50.0) / 1e3,
            pct(&l.latencies, 99.0) / 1e3,
            c.sim / c.wall,
            c.router / c.wall,
            c.driver / c.wall,
            c.machine_cores,
            c.sim / n * 1e6,
            if l.target == "router" {
                format!("{:.0}", c.router / n * 1e6)
            } else {
                "-".into()
            },
        );
    }
    let failed = loads.iter().any(|l| l.errors > 0);
    drop(router);
    drop(sim);
    if !failed {
        let _ = std::fs::remove_dir_all(&dir);
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
