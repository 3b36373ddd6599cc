//! `kvroute events decode`: hex payloads in, JSON events out.

use std::io::Write;
use std::process::ExitCode;

use kvroute_vllm::codec::decode_batch;

/// Decodes each stdin line; a bad line is reported on stderr and the rest still decoded.
pub fn run() -> anyhow::Result<ExitCode> {
    let stdin = std::io::stdin();
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let mut failures = 0usize;
    // A payload the router accepts by default (`kv_events.max_message_bytes`), in hex; an
    // ordinary one is well under a megabyte.
    let max_line = 2 * kvroute_vllm::zmtp::DEFAULT_MAX_MESSAGE_BYTES;
    for (n, line) in kvroute_bench::lines::bounded_lines(stdin.lock(), max_line).enumerate() {
        let line = line?;
        let text = line.trim();
        if text.is_empty() || text.starts_with('#') {
            continue;
        }
        let decoded =
            hex_decode(text).and_then(|bytes| decode_batch(&bytes).map_err(|e| e.to_string()));
        match decoded {
            Ok(decoded) => {
                for event in &decoded.batch.events {
                    serde_json::to_writer(&mut out, event)?;
                    writeln!(out)?;
                }
                for unknown in &decoded.unknown_events {
                    eprintln!("line {}: skipped event of unknown type {unknown:?}", n + 1);
                }
            }
            Err(e) => {
                failures += 1;
                eprintln!("line {}: {e}", n + 1);
            }
        }
    }
    out.flush()?;
    Ok(if failures == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

fn hex_decode(text: &str) -> Result<Vec<u8>, String> {
    let text = text.strip_prefix("0x").unwrap_or(text);
    hex::decode(text).map_err(|e| format!("not hex: {e}"))
}
