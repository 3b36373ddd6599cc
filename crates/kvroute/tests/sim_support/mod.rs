//! `kvroute sim` as a real process, for the binary's integration tests: its ports chosen, the
//! process started and waited for. Ports are chosen free but not held, so another test's
//! socket can take one before the simulator binds it; the simulator then exits, and it is
//! started again on fresh ports (a few times) instead of the test failing on a port race.

// Each test binary reads some of its fields.
#![allow(dead_code)]

use kvroute_testkit::{Killed, free_ports, healthy_or_exited};
use std::process::{Command, Stdio};

/// `kvroute sim` engines on consecutive ports (engine `i` on each base + `i`), healthy.
pub struct SimProcess {
    _process: Killed,
    /// The first engine's HTTP port.
    pub http: u16,
    /// The first engine's KV-event port.
    pub events: u16,
    /// The first engine's replay port.
    pub replay: u16,
}

impl SimProcess {
    /// The engines `args` start (`engines` of them: `--engines`, `--prefill-engines`, ... are
    /// the caller's), each answering `/health`.
    pub fn start(engines: u16, args: &[&str]) -> Self {
        for _ in 0..3 {
            let (http, events, replay, side) = (
                free_ports(engines),
                free_ports(engines),
                free_ports(engines),
                free_ports(engines),
            );
            let mut process = Killed(
                Command::new(env!("CARGO_BIN_EXE_kvroute"))
                    .arg("sim")
                    .args(args)
                    .args(["--port", &http.to_string()])
                    .args(["--events-port", &events.to_string()])
                    .args(["--replay-port", &replay.to_string()])
                    .args(["--side-channel-port", &side.to_string()])
                    .stdout(Stdio::null())
                    .spawn()
                    .unwrap(),
            );
            if (0..engines)
                .all(|i| healthy_or_exited(&mut process, &format!("http://127.0.0.1:{}", http + i)))
            {
                return Self {
                    _process: process,
                    http,
                    events,
                    replay,
                };
            }
            eprintln!("kvroute sim exited at start (a port taken meanwhile?); starting it again");
        }
        panic!("kvroute sim {args:?} did not start in three tries");
    }
}
