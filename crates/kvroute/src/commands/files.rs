//! Reading the text files a command is given (configurations, tables) with a bound: a wrong
//! path (`/dev/zero`, a trace instead of a configuration) is a clear error, not all of memory.

use std::io::Read;
use std::path::Path;

/// Reads `path` as UTF-8 text of at most `limit` bytes; `what` names the file expected, for the
/// error a larger one gets.
pub(crate) fn read_bounded(path: &Path, limit: u64, what: &str) -> anyhow::Result<String> {
    let mut text = String::new();
    std::fs::File::open(path)?
        .take(limit + 1)
        .read_to_string(&mut text)?;
    anyhow::ensure!(
        text.len() as u64 <= limit,
        "larger than {} KiB: not {what}",
        limit >> 10
    );
    Ok(text)
}
