//! Starting `kvroute serve` as a process for the tests that run the whole system on loopback
//! (shared by every test binary that needs one; each uses what it needs). Its ports are chosen
//! free but not held; when another test's socket takes one first, the process exits at start
//! and is started again on fresh ports (a few times) instead of the test failing on the race.
#![allow(dead_code)]

use std::process::{Command, Stdio};

use kvroute_testkit::{Killed, free_ports, healthy_or_exited};

/// How to start a `kvroute serve` process: its endpoints and extra configuration, where its
/// log goes (the test's stderr unless a file is given), and an optional open-file limit
/// (`ulimit -n`).
pub struct Serve {
    endpoints: String,
    extra: String,
    log: Option<std::fs::File>,
    fd_limit: Option<u32>,
}

/// A started `kvroute serve` process and where it listens.
pub struct Served {
    /// The process (killed when dropped).
    pub process: Killed,
    /// Its API port.
    pub listen: u16,
    /// Its admin port.
    pub admin: u16,
    /// Its temporary directory (its configuration file).
    pub dir: std::path::PathBuf,
}

impl Serve {
    /// The `endpoints:` list items `endpoints`, with `extra` configuration; log to the test's
    /// stderr, the machine's open-file limit.
    pub fn new(endpoints: &str, extra: &str) -> Self {
        Self {
            endpoints: endpoints.to_owned(),
            extra: extra.to_owned(),
            log: None,
            fd_limit: None,
        }
    }

    /// The process's log (its stderr) goes to `log`.
    pub fn log_to(mut self, log: std::fs::File) -> Self {
        self.log = Some(log);
        self
    }

    /// The process runs under an open-file limit of `limit`.
    pub fn fd_limit(mut self, limit: u32) -> Self {
        self.fd_limit = Some(limit);
        self
    }

    /// Starts the process and waits until its API listener answers; on a lost port race, again
    /// on fresh ports (three tries).
    pub fn start(self) -> Served {
        for _ in 0..3 {
            if let Some(served) = self.try_start() {
                return served;
            }
            eprintln!("kvroute serve exited at start (a port taken meanwhile?); starting it again");
        }
        panic!("kvroute serve did not start in three tries");
    }

    /// One start on fresh ports: `None` when the process exited before answering.
    fn try_start(&self) -> Option<Served> {
        let (listen, admin) = (free_ports(1), free_ports(1));
        let dir =
            std::env::temp_dir().join(format!("kvroute-test-{}-{listen}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("kvroute.yaml");
        let yaml = format!(
            "listen: 127.0.0.1:{listen}\nadmin: {{listen: 127.0.0.1:{admin}}}\nmodels: [{{name: sim-llama-3.1-8b}}]\n{}\nendpoints:\n{}",
            self.extra, self.endpoints
        );
        std::fs::write(&config, yaml).unwrap();
        let binary = env!("CARGO_BIN_EXE_kvroute");
        let config = config.to_str().unwrap();
        let mut command = match self.fd_limit {
            Some(limit) => {
                let mut c = Command::new("sh");
                c.args([
                    "-c",
                    &format!("ulimit -n {limit} && exec \"$0\" serve -c \"$1\""),
                    binary,
                    config,
                ]);
                c
            }
            None => {
                let mut c = Command::new(binary);
                c.args(["serve", "-c", config]);
                c
            }
        };
        let stderr = match &self.log {
            Some(log) => Stdio::from(log.try_clone().expect("the log file opens again")),
            None => Stdio::inherit(),
        };
        let mut process = Killed(
            command
                .stdout(Stdio::null())
                .stderr(stderr)
                .spawn()
                .unwrap(),
        );
        if !healthy_or_exited(&mut process, &format!("http://127.0.0.1:{listen}")) {
            return None;
        }
        Some(Served {
            process,
            listen,
            admin,
            dir,
        })
    }
}
