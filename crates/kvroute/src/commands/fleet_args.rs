//! The simulated fleet's flags that `kvroute simulate` and `kvroute tune` share: engines, their
//! model, and the timing around them.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use clap::Args;
use kvroute_simulate::FleetConfig;
use kvroute_simulate::config::PdFleet;

use super::engine_args::EngineArgs;
use super::numbers::parse_duration;
use super::pd_args::PdFleetArgs;

/// A simulated fleet; every default is the simulator's own ([`FleetConfig::default`]).
#[derive(Args)]
pub struct FleetArgs {
    /// Engines in the fleet (default 4, at most 100,000); beside
    /// --prefill-engines/--decode-engines, kv_both engines after them (default 0).
    #[arg(long)]
    engines: Option<usize>,
    #[command(flatten)]
    pd: PdFleetArgs,
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

impl FleetArgs {
    /// The fleet the flags describe; `seed` seeds the policies' random choices.
    pub fn fleet(&self, seed: u64) -> anyhow::Result<FleetConfig> {
        let (engines, roles) = self
            .pd
            .roles(self.engines, FleetConfig::default().engines)?;
        let pd = roles.map(|roles| PdFleet {
            roles,
            link: self.pd.link(),
            kv_bytes_per_token: self.engine.kv_bytes_per_token() as u64,
        });
        let fleet = FleetConfig {
            engines,
            engine: self.engine.engine_config()?,
            request_latency_s: self.request_latency.seconds(),
            response_latency_s: self.response_latency.seconds(),
            event_delay_s: self.event_delay.seconds(),
            scrape_interval_s: self.scrape_interval.seconds(),
            seed,
            pd,
            engine_slowdown: Vec::new(),
        };
        // Refused here, before any policy sizes itself by the fleet.
        fleet.validate()?;
        Ok(fleet)
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
