//! Running a child process with a deadline: a test that drives a binary must fail with the
//! child's output when the binary hangs, not hang the suite.

use std::io::{Read, Write};
use std::process::{Child, Command, Output, Stdio};
use std::thread::JoinHandle;
use std::time::Duration;

use wait_timeout::ChildExt;

/// How long a test's client script (the OpenAI Python client, a vLLM-shaped publisher) may run:
/// the longest sends a few dozen requests to a simulated fleet; one that hangs is killed and
/// fails its test with what it printed.
pub const CLIENT_DEADLINE: Duration = Duration::from_secs(120);

/// How long a one-line helper command (a Python import, `--version`) may run.
pub const QUICK_DEADLINE: Duration = Duration::from_secs(30);

/// Runs `command` with `stdin` written to its standard input, and returns its output once it
/// exits. Past `limit` the child is killed and the test panics, showing what it printed.
pub fn output_within(command: &mut Command, stdin: &str, limit: Duration) -> Output {
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{command:?} does not start: {e}"));
    // Both pipes are drained on their own threads, so a child that fills one cannot block.
    let stdout = drain(child.stdout.take());
    let stderr = drain(child.stderr.take());
    // Fed on its own thread too: a child that never reads a large input must not block the
    // deadline. A child that exits without reading it closes the pipe: not this helper's error.
    let feeder = child.stdin.take().map(|mut input| {
        let bytes = stdin.as_bytes().to_vec();
        std::thread::spawn(move || {
            let _ = input.write_all(&bytes);
        })
    });
    let status = wait_or_kill(&mut child, limit);
    if let Some(feeder) = feeder {
        // The child exited or was killed, so its end of the pipe is closed and the write ends.
        let _ = feeder.join();
    }
    let output = Output {
        status: status.unwrap_or_else(|| child.wait().expect("a killed child is reaped")),
        stdout: stdout.join().expect("stdout reader"),
        stderr: stderr.join().expect("stderr reader"),
    };
    if status.is_none() {
        panic!(
            "{command:?} ran past {limit:?} and was killed\n--- stdout\n{}\n--- stderr\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    output
}

/// Runs a test's client script (`command`, with nothing on its standard input) within
/// [`CLIENT_DEADLINE`], checks that it succeeded (failing the test with what it printed if
/// not), and returns its standard output.
pub fn client_output(command: &mut Command) -> String {
    let output = output_within(command, "", CLIENT_DEADLINE);
    assert!(
        output.status.success(),
        "{command:?} failed\n--- stdout\n{}\n--- stderr\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Waits up to `limit` for `child`; kills it and returns `None` past that.
fn wait_or_kill(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    match child.wait_timeout(limit) {
        Ok(Some(status)) => Some(status),
        Ok(None) => {
            let _ = child.kill();
            None
        }
        Err(e) => panic!("waiting for a child failed: {e}"),
    }
}

/// Reads a pipe to its end on a thread.
fn drain<R: Read + Send + 'static>(pipe: Option<R>) -> JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut bytes = Vec::new();
        if let Some(mut pipe) = pipe {
            let _ = pipe.read_to_end(&mut bytes);
        }
        bytes
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_that_finishes_returns_its_output() {
        let out = output_within(&mut Command::new("cat"), "echoed", Duration::from_secs(30));
        assert!(out.status.success());
        assert_eq!(out.stdout, b"echoed");
    }

    #[test]
    #[should_panic(expected = "was killed")]
    fn a_child_past_its_deadline_is_killed_and_fails_the_test() {
        output_within(
            Command::new("sleep").arg("30"),
            "",
            Duration::from_millis(200),
        );
    }
}
