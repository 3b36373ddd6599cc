//! The simulated fleet's flags that `kvroute simulate` and `kvroute tune` share: engines, their
//! model, and the timing around them.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use clap::Args;
use kvroute_sim::link::LinkSpec;
use kvroute_simulate::FleetConfig;
use kvroute_simulate::config::PdFleet;
use kvroute_vllm::nixl::KvRole;

use super::engine_args::EngineArgs;
use super::events::parse_duration;

/// A simulated fleet; every default is the simulator's own ([`FleetConfig::default`]).
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
    #[arg(long, default_value_t = Millis::of(FleetConfig::default().request_latency_s))]
    request_latency: Millis,
    /// Engine to client latency of a token.
    #[arg(long, default_value_t = Millis::of(FleetConfig::default().response_latency_s))]
    response_latency: Millis,
    /// Delay of KV events from the engine to the router.
    #[arg(long, default_value_t = Millis::of(FleetConfig::default().event_delay_s))]
    event_delay: Millis,
    /// How often the router scrapes each engine's load (its `scrape.interval_ms`).
    #[arg(long, default_value_t = Millis::of(FleetConfig::default().scrape_interval_s))]
    scrape_interval: Millis,
}

/// A duration flag (`500ms`, `2s`, `1m`), shown in `--help` in milliseconds.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Millis(Duration);

impl Millis {
    fn of(seconds: f64) -> Self {
        Self(Duration::from_secs_f64(seconds))
    }

    fn seconds(self) -> f64 {
        self.0.as_secs_f64()
    }
}

impl FromStr for Millis {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        parse_duration(text).map(Self)
    }
}

impl fmt::Display for Millis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}ms", self.0.as_nanos() as f64 / 1e6)
    }
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
        let both = self.engines.unwrap_or(if split > 0 {
            0
        } else {
            FleetConfig::default().engines
        });
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
            request_latency_s: self.request_latency.seconds(),
            response_latency_s: self.response_latency.seconds(),
            event_delay_s: self.event_delay.seconds(),
            scrape_interval_s: self.scrape_interval.seconds(),
            seed,
            pd,
            engine_slowdown: Vec::new(),
        })
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        fleet: FleetArgs,
    }

    #[test]
    fn the_flags_default_to_the_simulators_fleet_and_show_it_as_written() {
        let fleet = Cli::parse_from(["kvroute"]).fleet.fleet(0).unwrap();
        let defaults = FleetConfig::default();
        assert_eq!(
            (
                fleet.engines,
                fleet.request_latency_s,
                fleet.response_latency_s
            ),
            (
                defaults.engines,
                defaults.request_latency_s,
                defaults.response_latency_s
            )
        );
        assert_eq!(
            (fleet.event_delay_s, fleet.scrape_interval_s),
            (defaults.event_delay_s, defaults.scrape_interval_s)
        );
        assert_eq!(Millis::of(0.0005).to_string(), "0.5ms");
        assert_eq!("2s".parse::<Millis>().unwrap().to_string(), "2000ms");
        let set = Cli::parse_from(["kvroute", "--event-delay", "5ms"]).fleet;
        assert_eq!(set.fleet(0).unwrap().event_delay_s, 0.005);
    }
}
