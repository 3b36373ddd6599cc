//! `kvroute epp`: the endpoint picker for Gateway API Inference Extension gateways (Envoy
//! ext_proc), making `kvroute serve`'s decisions.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use kvroute_router::epp::{EppOptions, start};

use super::serve::{load_config, until_interrupted};

/// Arguments of `kvroute epp`.
#[derive(Args)]
pub struct EppArgs {
    /// The YAML configuration, as for `kvroute serve` (`listen` is not used).
    #[arg(short, long)]
    config: PathBuf,
    /// The ext_proc gRPC listen address (also serves gRPC health).
    #[arg(long, default_value = "0.0.0.0:9002")]
    grpc_listen: SocketAddr,
    /// Endpoints named in the `envoy.lb` fallback list, the first choice included.
    #[arg(long, default_value_t = 3)]
    fallbacks: usize,
    /// Report ready after this many seconds even if a KV-event subscriber never connected.
    #[arg(long, default_value_t = 10.0, value_parser = super::numbers::seconds)]
    ready_after_s: f64,
}

/// Runs the endpoint picker until interrupted.
pub fn run(args: EppArgs) -> anyhow::Result<ExitCode> {
    let config = load_config(&args.config)?;
    let options = EppOptions {
        listen: args.grpc_listen,
        fallbacks: args.fallbacks,
        ready_after: Duration::from_secs_f64(args.ready_after_s),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let running = start(config, options)
            .await
            .context("starting the endpoint picker")?;
        println!(
            "kvroute epp serving ext_proc on {} (admin: http://{}; {} endpoints)",
            running.addr,
            running.admin_addr,
            running.endpoint_count()
        );
        until_interrupted(running.wait()).await;
        Ok(ExitCode::SUCCESS)
    })
}
