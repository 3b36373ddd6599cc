//! The simulated fleet's flags that `kvroute simulate` and `kvroute tune` share: engines, their
//! model, and the timing around them.

use std::time::Duration;

use clap::Args;
use kvroute_simulate::FleetConfig;

use super::engine_args::EngineArgs;
use super::events::parse_duration;

/// A simulated fleet.
#[derive(Args)]
pub struct FleetArgs {
    /// Engines in the fleet.
    #[arg(long, default_value_t = 4)]
    engines: usize,
    #[command(flatten)]
    engine: EngineArgs,
    /// Client to engine latency of a request (HTTP and the router's own work).
    #[arg(long, default_value = "0.5ms", value_parser = parse_duration)]
    request_latency: Duration,
    /// Engine to client latency of a token.
    #[arg(long, default_value = "0.2ms", value_parser = parse_duration)]
    response_latency: Duration,
    /// Delay of KV events from the engine to the router.
    #[arg(long, default_value = "1ms", value_parser = parse_duration)]
    event_delay: Duration,
    /// How often the router scrapes each engine's load (its `scrape.interval_ms`).
    #[arg(long, default_value = "500ms", value_parser = parse_duration)]
    scrape_interval: Duration,
}

impl FleetArgs {
    /// The fleet the flags describe; `seed` seeds the policies' random choices.
    pub fn fleet(&self, seed: u64) -> anyhow::Result<FleetConfig> {
        Ok(FleetConfig {
            engines: self.engines,
            engine: self.engine.engine_config()?,
            request_latency_s: self.request_latency.as_secs_f64(),
            response_latency_s: self.response_latency.as_secs_f64(),
            event_delay_s: self.event_delay.as_secs_f64(),
            scrape_interval_s: self.scrape_interval.as_secs_f64(),
            seed,
        })
    }
}
