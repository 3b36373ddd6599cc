//! `kvroute serve`: the router.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

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

/// Exit status for an unusable configuration (sysexits' EX_CONFIG).
const EX_CONFIG: u8 = 78;

/// Reads and validates a router configuration file: `Err(code)` (after saying why) when it
/// is unusable.
pub fn load_config(path: &Path) -> anyhow::Result<Result<RouterConfig, ExitCode>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(RouterConfig::from_yaml(&text).map_err(|e| {
        eprintln!("kvroute: {}: {e}", path.display());
        ExitCode::from(EX_CONFIG)
    }))
}

/// Runs the router until interrupted.
pub fn run(args: ServeArgs) -> anyhow::Result<ExitCode> {
    let mut config = match load_config(&args.config)? {
        Ok(c) => c,
        Err(code) => return Ok(code),
    };
    if let Some(listen) = args.listen {
        config.listen = listen;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let running = start(config).await.context("starting the router")?;
        println!(
            "kvroute serving on http://{} (admin: http://{}; {} endpoints)",
            running.addr,
            running.admin_addr,
            running.router.endpoints().len()
        );
        until_interrupted(running.wait()).await;
        Ok(ExitCode::SUCCESS)
    })
}

/// Runs `serving` until it ends or the process is interrupted (Ctrl-C, SIGINT).
pub async fn until_interrupted(serving: impl std::future::Future<Output = ()>) {
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = serving => {}
    }
}
