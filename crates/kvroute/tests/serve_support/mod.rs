//! Starting `kvroute serve` as a process for the tests that run the whole system on loopback
//! (shared by every test binary that needs one; each uses what it needs).
#![allow(dead_code)]

use std::process::{Command, Stdio};

use kvroute_testkit::{Killed, free_ports, wait_http};

/// How to start a `kvroute serve` process: its endpoints and extra configuration, where its
/// log goes, and an optional open-file limit (`ulimit -n`).
pub struct Serve {
    endpoints: String,
    extra: String,
    stderr: Stdio,
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
            stderr: Stdio::inherit(),
            fd_limit: None,
        }
    }

    /// The process's log goes to `stderr`.
    pub fn stderr(mut self, stderr: Stdio) -> Self {
        self.stderr = stderr;
        self
    }

    /// The process runs under an open-file limit of `limit`.
    pub fn fd_limit(mut self, limit: u32) -> Self {
        self.fd_limit = Some(limit);
        self
    }

    /// Starts the process and waits until its API listener answers.
    pub fn start(self) -> Served {
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
        let process = Killed(
            command
                .stdout(Stdio::null())
                .stderr(self.stderr)
                .spawn()
                .unwrap(),
        );
        wait_http(&format!("http://127.0.0.1:{listen}"));
        Served {
            process,
            listen,
            admin,
            dir,
        }
    }
}
