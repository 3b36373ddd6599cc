//! `kvroute serve`: the router. The first SIGTERM, SIGINT or SIGHUP drains it (no new
//! connections, `/health` 503, in-flight requests finish within `shutdown.drain_timeout_s`); a
//! second one, or the timeout, ends the streams still open with an SSE error event. The router
//! does not reload its configuration, so SIGHUP (a closed terminal, or a supervisor's "reload")
//! drains like SIGTERM rather than killing it with its streams.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use kvroute_router::config::RouterConfig;
use kvroute_router::server::start;

/// Arguments of `kvroute serve`.
#[derive(Args)]
pub struct ServeArgs {
    /// The YAML configuration (see examples/kvroute.yaml).
    #[arg(short, long)]
    config: PathBuf,
    /// Listen here instead of the configured address.
    #[arg(long)]
    listen: Option<SocketAddr>,
}

/// The largest configuration read: a thousand endpoints take a few hundred KiB.
const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// Reads and validates a router configuration file (an unusable one exits with its own status:
/// see `crate::exit_code`).
pub fn load_config(path: &std::path::Path) -> anyhow::Result<RouterConfig> {
    let text = super::files::read_bounded(path, MAX_CONFIG_BYTES, "a router configuration")
        .with_context(|| format!("reading {}", path.display()))?;
    RouterConfig::from_yaml(&text).with_context(|| format!("{}", path.display()))
}

/// Runs `serving` until it ends or the process is interrupted (Ctrl-C, SIGINT, SIGTERM,
/// SIGHUP).
pub async fn until_interrupted(serving: impl std::future::Future<Output = ()>) {
    let Ok(mut signals) = Signals::new() else {
        serving.await;
        return;
    };
    tokio::select! {
        () = signals.next() => {}
        () = serving => {}
    }
}

/// Runs the router until interrupted.
pub fn run(args: ServeArgs) -> anyhow::Result<ExitCode> {
    let mut config = load_config(&args.config)?;
    if let Some(listen) = args.listen {
        config.listen = listen;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let drain_timeout = Duration::from_secs_f64(config.shutdown.drain_timeout_s);
        let mut running = start(config).await.context("starting the router")?;
        let mut signals = Signals::new()?;
        println!(
            "kvroute serving on http://{} (admin: http://{}; {} endpoints)",
            running.addr,
            running.admin_addr,
            running.endpoint_count()
        );
        tokio::select! {
            () = signals.next() => {}
            () = running.drained() => return Ok(ExitCode::SUCCESS),
        }
        running.drain();
        tokio::select! {
            () = running.drained() => return Ok(ExitCode::SUCCESS),
            () = tokio::time::sleep(drain_timeout) => {}
            () = signals.next() => {}
        }
        running.finish_closing().await;
        Ok(ExitCode::SUCCESS)
    })
}

/// SIGTERM, SIGINT and SIGHUP, as one stream.
struct Signals {
    #[cfg(unix)]
    terminate: tokio::signal::unix::Signal,
    #[cfg(unix)]
    hangup: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> anyhow::Result<Self> {
        Ok(Self {
            #[cfg(unix)]
            terminate: tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                .context("listening for SIGTERM")?,
            #[cfg(unix)]
            hangup: tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
                .context("listening for SIGHUP")?,
        })
    }

    /// Resolves at the next SIGTERM, SIGINT or SIGHUP.
    async fn next(&mut self) {
        #[cfg(unix)]
        tokio::select! {
            _ = self.terminate.recv() => {}
            _ = self.hangup.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        #[cfg(not(unix))]
        let _ = tokio::signal::ctrl_c().await;
    }
}
