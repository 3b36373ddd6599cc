//! The simulated fleet's flags that `kvroute simulate` and `kvroute tune` share: engines, their
//! model, and the timing around them.

use std::time::Duration;

use clap::Args;
use kvroute_sim::link::LinkSpec;
use kvroute_simulate::FleetConfig;
use kvroute_simulate::config::PdFleet;
use kvroute_vllm::nixl::KvRole;

use super::engine_args::EngineArgs;
use super::events::parse_duration;

/// A simulated fleet.
#[derive(Args)]
pub struct FleetArgs {
    /// Engines in the fleet (default 4); beside --prefill-engines/--decode-engines, kv_both
    /// engines after them (default 0).
    #[arg(long)]
    engines: Option<usize>,
    /// P/D: the KV role of the --engines engines (producer, consumer, both); makes a P/D
    /// fleet for the policies pd-always and pd-cost.
    #[arg(long, value_parser = parse_role)]
    kv_role: Option<KvRole>,
    /// P/D: kv_producer engines, first in the fleet (policies pd-always, pd-cost).
    #[arg(long, default_value_t = 0)]
    prefill_engines: usize,
    /// P/D: kv_consumer engines, after the producers.
    #[arg(long, default_value_t = 0)]
    decode_engines: usize,
    /// P/D: the KV link: tcp, roce-100, ib-400 or custom:<GB/s>[:<latency ms>].
    #[arg(long, default_value = "tcp", value_parser = parse_link)]
    kv_link: LinkSpec,
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

fn parse_role(text: &str) -> Result<KvRole, String> {
    text.parse()
        .map_err(|e: kvroute_vllm::VllmError| e.to_string())
}

fn parse_link(text: &str) -> Result<LinkSpec, String> {
    LinkSpec::parse(text).map_err(|e| e.to_string())
}

impl FleetArgs {
    /// The fleet the flags describe; `seed` seeds the policies' random choices.
    pub fn fleet(&self, seed: u64) -> anyhow::Result<FleetConfig> {
        let split = self.prefill_engines + self.decode_engines;
        let both = self.engines.unwrap_or(if split > 0 { 0 } else { 4 });
        let pd = (split > 0 || self.kv_role.is_some()).then(|| PdFleet {
            roles: std::iter::repeat_n(KvRole::Producer, self.prefill_engines)
                .chain(std::iter::repeat_n(KvRole::Consumer, self.decode_engines))
                .chain(std::iter::repeat_n(
                    self.kv_role.unwrap_or(KvRole::Both),
                    both,
                ))
                .collect(),
            link: self.kv_link,
            kv_bytes_per_token: self.engine.kv_bytes_per_token() as u64,
        });
        let engines = split + both;
        Ok(FleetConfig {
            engines,
            engine: self.engine.engine_config()?,
            request_latency_s: self.request_latency.as_secs_f64(),
            response_latency_s: self.response_latency.as_secs_f64(),
            event_delay_s: self.event_delay.as_secs_f64(),
            scrape_interval_s: self.scrape_interval.as_secs_f64(),
            seed,
            pd,
            engine_slowdown: Vec::new(),
        })
    }
}
