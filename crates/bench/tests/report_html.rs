//! The HTML report in a real browser: two synthetic runs are written with
//! `report::write_files`, opened in headless Chromium, and the rendered DOM and a screenshot
//! are checked. Chromium comes from Debian (`scripts/test.sh` installs it); without it the test
//! is skipped, except in CI (`CI` set), where it fails.
//!
//! The files stay in `target/tmp/report_html/` (`report.html`, `report.json`, `report.png`)
//! for a look by eye.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvroute_bench::report;
use kvroute_bench::result::{EndpointShare, Percentiles, RequestRecord, RunResult, Summary};

/// How long one Chromium invocation may take.
const CHROMIUM_TIMEOUT: Duration = Duration::from_secs(90);

/// A deterministic pseudo-random stream in `[0, 1)` (an LCG; the test needs no quality).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn percentiles(mut v: Vec<f64>) -> Percentiles {
    if v.is_empty() {
        return Percentiles::default();
    }
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
    Percentiles {
        p50: at(0.5),
        p90: at(0.9),
        p99: at(0.99),
        mean: v.iter().sum::<f64>() / v.len() as f64,
        count: v.len() as u64,
    }
}

/// A run of 200 requests over endpoints e0..e3: TTFT around `ttft` seconds (log-normal-ish,
/// rising a little over the run), prefix-cache hit rate near `hit`, requests spread by
/// `weights` (in turn without), and `errors` failed requests.
fn synthetic(
    name: &str,
    seed: u64,
    ttft: f64,
    hit: f64,
    weights: Option<[f64; 4]>,
    errors: usize,
) -> RunResult {
    let mut rng = Lcg(seed);
    let total: f64 = weights.map_or(4.0, |w| w.iter().sum());
    let n = 200;
    let mut records = Vec::with_capacity(n);
    for i in 0..n {
        let start_s = i as f64 * 0.3 + rng.next() * 0.2;
        let pick = rng.next() * total;
        let mut acc = 0.0;
        let endpoint = match weights {
            None => i % 4,
            Some(weights) => (0..4)
                .find(|&e| {
                    acc += weights[e];
                    pick < acc
                })
                .unwrap_or(3),
        };
        if i % 67 == 13
            && records
                .iter()
                .filter(|r: &&RequestRecord| r.error.is_some())
                .count()
                < errors
        {
            records.push(RequestRecord {
                session: i as u64 / 4,
                turn: (i % 4) as u32,
                start_s,
                e2e_s: 0.05,
                endpoint: Some(format!("e{endpoint}")),
                error: Some("HTTP 503: upstream overloaded".into()),
                ..Default::default()
            });
            continue;
        }
        let noise = (rng.next() * 2.0 - 1.0) + (rng.next() * 2.0 - 1.0);
        let tail = if rng.next() < 0.05 { 3.0 } else { 1.0 };
        let t = ttft * (0.8 + 0.4 * i as f64 / n as f64) * (noise * 0.45).exp() * tail;
        let itl: Vec<f64> = (0..20).map(|_| 0.02 + rng.next() * 0.01).collect();
        let prompt = 2000 + (rng.next() * 2000.0) as u64;
        let cached = ((prompt as f64) * (hit + (rng.next() - 0.5) * 0.2).clamp(0.0, 1.0)) as u64;
        records.push(RequestRecord {
            session: i as u64 / 4,
            turn: (i % 4) as u32,
            start_s,
            ttft_s: Some(t),
            e2e_s: t + itl.iter().sum::<f64>(),
            itl_s: itl,
            prompt_tokens: prompt,
            completion_tokens: 21,
            cached_tokens: Some(cached),
            endpoint: Some(format!("e{endpoint}")),
            error: None,
        });
    }
    let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.error.is_none()).collect();
    let duration_s = records
        .iter()
        .map(|r| r.start_s + r.e2e_s)
        .fold(0.0, f64::max);
    let endpoints: Vec<EndpointShare> = (0..4)
        .map(|e| {
            let name = format!("e{e}");
            let mine: Vec<&&RequestRecord> = ok
                .iter()
                .filter(|r| r.endpoint.as_deref() == Some(&name))
                .collect();
            EndpointShare {
                endpoint: name,
                requests: mine.len() as u64,
                prompt_tokens: mine.iter().map(|r| r.prompt_tokens).sum(),
                cached_tokens: mine.iter().filter_map(|r| r.cached_tokens).sum(),
            }
        })
        .collect();
    let prompt: u64 = ok.iter().map(|r| r.prompt_tokens).sum();
    let cached: u64 = ok.iter().filter_map(|r| r.cached_tokens).sum();
    let busiest = endpoints.iter().map(|e| e.requests).max().unwrap_or(0) as f64;
    let summary = Summary {
        requests: n as u64,
        errors: (n - ok.len()) as u64,
        duration_s,
        requests_per_s: ok.len() as f64 / duration_s,
        output_tokens_per_s: ok.iter().map(|r| r.completion_tokens).sum::<u64>() as f64
            / duration_s,
        ttft: percentiles(ok.iter().filter_map(|r| r.ttft_s).collect()),
        e2e: percentiles(ok.iter().map(|r| r.e2e_s).collect()),
        itl: percentiles(ok.iter().flat_map(|r| r.itl_s.iter().copied()).collect()),
        hit_rate: cached as f64 / prompt as f64,
        engine_hit_rate: Some((cached as f64 / prompt as f64 * 0.97).min(1.0)),
        load_imbalance: busiest / (ok.len() as f64 / 4.0),
        endpoints,
        tier_tokens: None,
        ttft_prediction_error: None,
    };
    RunResult {
        name: name.to_string(),
        config: serde_json::json!({
            "workload": "multi-turn chat, 50 sessions x 4 turns",
            "policy": name,
            "target": "http://127.0.0.1:8000",
        }),
        summary,
        records,
    }
}

/// The Chromium binary: `KVROUTE_CHROMIUM`, else `chromium` from `PATH` or `/usr/bin`.
fn chromium() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("KVROUTE_CHROMIUM") {
        return Some(PathBuf::from(p));
    }
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("chromium"))
            .find(|p| p.is_file())
    });
    on_path.or_else(|| Some(PathBuf::from("/usr/bin/chromium")).filter(|p| p.is_file()))
}

/// Runs headless Chromium on `page` with `args`, in a fresh profile, and returns its stdout.
fn run_chromium(bin: &Path, work: &Path, tag: &str, args: &[String], page: &Path) -> String {
    let profile = work.join(format!("profile-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&profile);
    std::fs::create_dir_all(&profile).unwrap();
    let stdout_path = work.join(format!("{tag}.stdout"));
    let stderr_path = work.join(format!("{tag}.stderr"));
    let mut child = Command::new(bin)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-dev-shm-usage",
            "--hide-scrollbars",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(args)
        .arg(format!("file://{}", page.display()))
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&stdout_path).unwrap())
        .stderr(std::fs::File::create(&stderr_path).unwrap())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
    let deadline = Instant::now() + CHROMIUM_TIMEOUT;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "chromium ({tag}) took over {CHROMIUM_TIMEOUT:?}; stderr:\n{}",
                std::fs::read_to_string(&stderr_path).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let stdout = std::fs::read_to_string(&stdout_path).unwrap_or_default();
    let stderr = std::fs::read_to_string(&stderr_path).unwrap_or_default();
    assert!(
        status.success(),
        "chromium ({tag}) failed: {status}\n{stderr}"
    );
    let _ = std::fs::remove_dir_all(&profile);
    stdout
}

/// The `<figure>` with `id` in `dom`.
fn figure<'a>(dom: &'a str, id: &str) -> &'a str {
    let at = dom
        .find(&format!("id=\"{id}\""))
        .unwrap_or_else(|| panic!("no element with id {id} in the rendered page"));
    let start = dom[..at].rfind("<figure").expect("the id is on a <figure>");
    assert!(
        !dom[start..at].contains('>'),
        "id {id} is not on the <figure>"
    );
    let end = at + dom[at..].find("</figure>").expect("</figure>");
    &dom[start..end]
}

/// The element starting at `from` (a `<g`), up to its matching `</g>`.
fn group(s: &str, from: usize) -> &str {
    let mut depth = 0usize;
    let mut i = from;
    while i < s.len() {
        let rest = &s[i..];
        if rest.starts_with("<g ") || rest.starts_with("<g>") {
            depth += 1;
        } else if rest.starts_with("</g>") {
            depth -= 1;
            if depth == 0 {
                return &s[from..i + 4];
            }
        }
        i += rest.chars().next().map_or(1, char::len_utf8);
    }
    panic!("unclosed <g>");
}

/// The legend group of a figure.
fn legend(fig: &str) -> &str {
    let at = fig.find("class=\"legend\"").expect("a legend");
    let start = fig[..at].rfind("<g").unwrap();
    group(fig, start)
}

#[test]
fn report_renders_in_chromium() {
    let Some(bin) = chromium() else {
        if std::env::var_os("CI").is_some() {
            panic!(
                "chromium is not installed but CI is set: install it (apt-get install chromium; \
                 scripts/test.sh does) or set KVROUTE_CHROMIUM to a Chromium binary"
            );
        }
        eprintln!("notice: chromium not found; skipping the browser test of the HTML report");
        return;
    };
    let runs = vec![
        synthetic("round-robin", 1, 0.45, 0.12, None, 2),
        synthetic("precise", 2, 0.07, 0.81, Some([1.3, 1.0, 1.1, 0.8]), 0),
    ];
    let work = Path::new(env!("CARGO_TARGET_TMPDIR")).join("report_html");
    let (json, html) = report::write_files(&runs, &work, "report").unwrap();
    assert_eq!(report::load(&json).unwrap().len(), 2);
    let source = std::fs::read_to_string(&html).unwrap();
    for external in ["<script", "<link", "src=", "@import", "url("] {
        assert!(!source.contains(external), "the page refers to {external}");
    }

    let dom = run_chromium(&bin, &work, "dom", &["--dump-dom".to_string()], &html);
    assert!(
        dom.contains("<h1>kvroute bench: round-robin vs precise</h1>"),
        "{dom}"
    );
    let expected: [(&str, &str, usize); 4] = [
        ("ttft-cdf", "class=\"series\"", 2),
        ("hit-rate", "class=\"bar\"", 4),
        ("endpoint-load", "class=\"bar\"", 8),
        ("ttft-over-time", "<circle", 390),
    ];
    for (id, mark, at_least) in expected {
        let fig = figure(&dom, id);
        assert!(fig.contains("<figcaption>"), "{id}: no caption");
        let svg = &fig[fig.find("<svg").unwrap_or_else(|| panic!("{id}: no <svg>"))..];
        let drawn = ["<path", "<rect", "<circle"]
            .iter()
            .map(|t| svg.matches(t).count())
            .sum::<usize>();
        assert!(drawn >= at_least, "{id}: only {drawn} drawn elements");
        let marks = svg.matches(mark).count();
        assert!(
            marks >= at_least,
            "{id}: {marks} of {mark}, expected {at_least}"
        );
        let legend = legend(svg);
        for name in ["round-robin", "precise"] {
            assert!(
                legend.contains(name),
                "{id}: {name} missing from the legend"
            );
        }
        assert!(
            legend.contains("#4e79a7") && legend.contains("#f28e2b"),
            "{id}: runs do not have distinct colours"
        );
    }

    let png = work.join("report.png");
    let _ = std::fs::remove_file(&png);
    run_chromium(
        &bin,
        &work,
        "screenshot",
        &[
            format!("--screenshot={}", png.display()),
            "--window-size=1200,1800".to_string(),
        ],
        &html,
    );
    let bytes = std::fs::read(&png).expect("chromium wrote no screenshot");
    assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
    let width = u32::from_be_bytes(bytes[16..20].try_into().unwrap());
    let height = u32::from_be_bytes(bytes[20..24].try_into().unwrap());
    assert!(
        width >= 1000 && height >= 1500,
        "screenshot is {width}x{height}"
    );
    assert!(
        bytes.len() > 30_000,
        "screenshot is only {} bytes: blank?",
        bytes.len()
    );
    eprintln!("report: {}\nscreenshot: {}", html.display(), png.display());
}
