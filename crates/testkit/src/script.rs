//! A child process spoken to in JSON lines: the vLLM-shaped Python publishers of the tests and
//! benchmarks. Lines go to its standard input; each line of its standard output is one JSON
//! document, read within a deadline, so a child that goes silent, exits or prints something
//! else fails the caller with a message naming it instead of hanging it.

use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

/// A running child that prints one JSON document per line.
pub struct JsonLinesChild {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: Lines<BufReader<ChildStdout>>,
    /// What it is, for messages.
    name: String,
}

impl JsonLinesChild {
    /// Starts `command` with its standard input and output piped (its standard error is the
    /// caller's, so what it reports there shows); it is killed when this is dropped.
    pub fn spawn(mut command: Command, name: &str) -> Self {
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().expect("piped stdout")).lines();
        Self {
            child,
            stdin,
            stdout,
            name: name.to_owned(),
        }
    }

    /// The next JSON document it prints, within `deadline`. Panics naming it when it stays
    /// silent, exits (with its status) or prints a line that is not JSON.
    pub async fn next_json(&mut self, deadline: Duration) -> Value {
        let name = &self.name;
        let line = tokio::time::timeout(deadline, self.stdout.next_line())
            .await
            .unwrap_or_else(|_| panic!("{name} went silent for {deadline:?}"))
            .unwrap_or_else(|e| panic!("cannot read {name}'s output: {e}"));
        let Some(line) = line else {
            let status = self.child.wait().await;
            panic!("{name} exited early ({status:?}); see its standard error above");
        };
        serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("{name} printed no JSON ({e}): {line}"))
    }

    /// Writes `line` and a newline to its standard input.
    pub async fn send(&mut self, line: &str) {
        let name = &self.name;
        let stdin = self
            .stdin
            .as_mut()
            .unwrap_or_else(|| panic!("{name}'s standard input is closed"));
        stdin
            .write_all(format!("{line}\n").as_bytes())
            .await
            .unwrap_or_else(|e| panic!("cannot write to {name}: {e}"));
        stdin
            .flush()
            .await
            .unwrap_or_else(|e| panic!("cannot write to {name}: {e}"));
    }

    /// Closes its standard input and waits, within `deadline`, for it to exit.
    pub async fn finish(mut self, deadline: Duration) -> ExitStatus {
        drop(self.stdin.take());
        let name = &self.name;
        tokio::time::timeout(deadline, self.child.wait())
            .await
            .unwrap_or_else(|_| panic!("{name} did not exit within {deadline:?}"))
            .unwrap_or_else(|e| panic!("cannot wait for {name}: {e}"))
    }
}
