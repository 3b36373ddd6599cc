//! File descriptors: every client connection, and the engine connection each of its requests
//! opens, takes one, and the process may hold only `RLIMIT_NOFILE`'s soft limit. Past it every
//! `accept` fails, on the admin listener too, so at start the API listener's connection limit
//! is cut to what the limit leaves once the admin listener, the engines' probes and event
//! streams, and what is open already are reserved for.

use tracing::warn;

use crate::RouterError;

/// Connections the admin listener keeps room for (metrics scrapes, health checks).
pub const ADMIN_CONNECTIONS: usize = 64;
/// Descriptors each engine takes besides proxied requests: health and scrape connections,
/// the KV-event and replay sockets, tokenization.
const PER_ENGINE: usize = 6;
/// Engines reserved for at least (discovery adds some while running).
const MIN_ENGINES: usize = 16;
/// Slack for everything else (log files, DNS, the tokenizer's files).
const SLACK: usize = 32;

/// The process's soft limit on open files, from `/proc/self/limits` (`None` where that file
/// does not exist, or says "unlimited").
pub fn open_file_limit() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/limits").ok()?;
    parse_limits(&text)
}

fn parse_limits(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("Max open files"))?;
    line["Max open files".len()..]
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// Descriptors open now (`None` where `/proc/self/fd` cannot be read).
fn open_now() -> Option<usize> {
    Some(std::fs::read_dir("/proc/self/fd").ok()?.count())
}

/// The connection limits of the two listeners.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Client connections of the API listener.
    pub api: usize,
    /// Client connections of the admin listener.
    pub admin: usize,
}

/// The listeners' connection limits under the process's open-file limit: `configured` for
/// each (at most [`ADMIN_CONNECTIONS`] for the admin listener), the API's cut (with a
/// warning) so that each of its connections can also open an engine connection while the
/// reserve stays free. An error when the limit leaves no room for API connections at all.
pub fn connection_limits(
    configured: usize,
    endpoints: usize,
) -> Result<ConnectionLimits, RouterError> {
    let admin = configured.min(ADMIN_CONNECTIONS);
    let Some(soft) = open_file_limit() else {
        return Ok(ConnectionLimits {
            api: configured,
            admin,
        });
    };
    let reserve =
        open_now().unwrap_or(SLACK) + SLACK + admin + endpoints.max(MIN_ENGINES) * PER_ENGINE;
    fit(configured, admin, soft, reserve)
}

fn fit(
    configured: usize,
    admin: usize,
    soft: u64,
    reserve: usize,
) -> Result<ConnectionLimits, RouterError> {
    let soft = usize::try_from(soft).unwrap_or(usize::MAX);
    // Each API connection may hold an engine connection as well.
    let room = soft.saturating_sub(reserve) / 2;
    if room == 0 {
        return Err(RouterError::Config(format!(
            "limits.max_connections: the open-file limit ({soft}) leaves no descriptor for client connections after {reserve} reserved (admin listener, engines, files open); raise it (ulimit -n, LimitNOFILE=)"
        )));
    }
    if room < configured {
        warn!(
            open_file_limit = soft,
            configured,
            allowed = room,
            "limits.max_connections is above what the open-file limit allows (two descriptors per connection, {reserve} reserved for the admin listener and engines): the API listener accepts {room} connections; raise the limit (ulimit -n, LimitNOFILE=) to allow more"
        );
    }
    Ok(ConnectionLimits {
        api: configured.min(room),
        admin,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_soft_limit_is_read_from_proc_limits() {
        let text = "Limit                     Soft Limit           Hard Limit           Units\nMax processes             127563               127563               processes\nMax open files            256                  524288               files\n";
        assert_eq!(parse_limits(text), Some(256));
        let unlimited =
            "Max open files            unlimited            unlimited            files\n";
        assert_eq!(parse_limits(unlimited), None);
        if std::path::Path::new("/proc/self/limits").exists() {
            assert!(open_file_limit().is_some_and(|n| n > 0));
        }
    }

    #[test]
    fn the_api_listener_gets_what_the_reserve_leaves() {
        let fit = |configured, soft, reserve| fit(configured, 64, soft, reserve);
        assert_eq!(fit(4096, 1 << 20, 300).unwrap().api, 4096);
        assert_eq!(fit(4096, 256, 156).unwrap().api, 50);
        assert!(fit(4096, 256, 300).is_err());
    }
}
