//! `kvroute serve`: the router.

use std::net::SocketAddr;
use std::path::PathBuf;
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

/// Runs the router until interrupted.
pub fn run(args: ServeArgs) -> anyhow::Result<ExitCode> {
    let text = std::fs::read_to_string(&args.config)
        .with_context(|| format!("reading {}", args.config.display()))?;
    let mut config = match RouterConfig::from_yaml(&text) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kvroute: {}: {e}", args.config.display());
            return Ok(ExitCode::from(EX_CONFIG));
        }
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
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = running.wait() => {}
        }
        Ok(ExitCode::SUCCESS)
    })
}
