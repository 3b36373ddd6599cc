//! What a simulation runs on: the fleet (engines and their model) and the timing of everything
//! around the engines (client and router latency, KV-event delivery, load scrapes).

use kvroute_sim::engine::EngineConfig;
use kvroute_sim::link::LinkSpec;
use kvroute_vllm::nixl::KvRole;
use serde::Serialize;

use crate::SimulateError;

/// A fleet and the timing around it.
#[derive(Clone, Debug, Serialize)]
pub struct FleetConfig {
    /// Engines in the fleet (endpoints `engine-0` … `engine-{n-1}`).
    pub engines: usize,
    /// Every engine's model: blocks, batching, tiers, latency.
    pub engine: EngineConfig,
    /// Seconds from the client sending a request to the engine receiving it (HTTP, the
    /// router's parsing, tokenization and scheduling).
    pub request_latency_s: f64,
    /// Seconds from the engine producing a token to the client reading it.
    pub response_latency_s: f64,
    /// Seconds from the end of an engine step to the router applying its KV events.
    pub event_delay_s: f64,
    /// Seconds between the router's scrapes of each engine's load.
    pub scrape_interval_s: f64,
    /// Seed of the policies' random choices (ties, random picks).
    pub seed: u64,
    /// Prefill/decode disaggregation: engine roles and the link between them (`None`: every
    /// engine serves whole requests only).
    pub pd: Option<PdFleet>,
    /// A mixed fleet: engine `i`'s every latency (steps, prefill, decode, loads) is its
    /// model's × `engine_slowdown[i]` (missing or empty: 1, a uniform fleet).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub engine_slowdown: Vec<f64>,
}

/// The P/D side of a fleet: what the live simulator's `--prefill-engines`, `--decode-engines`
/// and `--kv-link` describe.
#[derive(Clone, Debug, Serialize)]
pub struct PdFleet {
    /// Each engine's KV role, by index.
    pub roles: Vec<KvRole>,
    /// Every link's speed.
    pub link: LinkSpec,
    /// KV-cache bytes per token.
    pub kv_bytes_per_token: u64,
}

/// The largest fleet a simulation takes: every engine's state is held in memory, and 100,000
/// engines already take about 0.4 GB and half a minute for the default workload.
pub const MAX_ENGINES: usize = 100_000;

impl FleetConfig {
    /// A P/D fleet of Llama-3.1-8B engines (128 KiB of KV per token, 16,384-token context),
    /// one per entry of `roles`, each with `num_gpu_blocks` GPU blocks, every pair joined by
    /// `link`; the rest as [`FleetConfig::default`]. The shape the P/D tests and examples run.
    pub fn disaggregated(roles: &[KvRole], link: LinkSpec, num_gpu_blocks: usize) -> Self {
        Self {
            engines: roles.len(),
            engine: EngineConfig {
                num_gpu_blocks,
                max_model_len: 16_384,
                ..EngineConfig::default()
            },
            pd: Some(PdFleet {
                roles: roles.to_vec(),
                link,
                kv_bytes_per_token: 128 * 1024,
            }),
            ..Self::default()
        }
    }
}

impl Default for FleetConfig {
    fn default() -> Self {
        Self {
            engines: 4,
            engine: EngineConfig::default(),
            request_latency_s: 0.0005,
            response_latency_s: 0.0002,
            event_delay_s: 0.001,
            scrape_interval_s: 0.5,
            seed: 0,
            pd: None,
            engine_slowdown: Vec::new(),
        }
    }
}

impl FleetConfig {
    /// Engine `i`'s model: the fleet's, slowed down by its `engine_slowdown`.
    pub fn engine_config(&self, i: usize) -> EngineConfig {
        let mut engine = self.engine.clone();
        if let Some(&factor) = self.engine_slowdown.get(i) {
            engine.latency = engine.latency.scaled(factor);
        }
        engine
    }

    /// Checks the settings.
    pub fn validate(&self) -> Result<(), SimulateError> {
        if !(1..=MAX_ENGINES).contains(&self.engines) {
            return Err(SimulateError::Config(format!(
                "engines must be within 1–{MAX_ENGINES}, not {}",
                self.engines
            )));
        }
        if let Some(bad) = self
            .engine_slowdown
            .iter()
            .find(|f| !(f.is_finite() && **f > 0.0))
        {
            return Err(SimulateError::Config(format!(
                "engine_slowdown factors must be positive numbers, not {bad}"
            )));
        }
        let times = [
            ("request_latency_s", self.request_latency_s),
            ("response_latency_s", self.response_latency_s),
            ("event_delay_s", self.event_delay_s),
        ];
        for (name, value) in times {
            if !(value.is_finite() && value >= 0.0) {
                return Err(SimulateError::Config(format!(
                    "{name} must be a non-negative number, not {value}"
                )));
            }
        }
        if !(self.scrape_interval_s.is_finite() && self.scrape_interval_s > 0.0) {
            return Err(SimulateError::Config(format!(
                "scrape_interval_s must be positive, not {}",
                self.scrape_interval_s
            )));
        }
        kvroute_sim::engine::Engine::new(self.engine.clone())?;
        if let Some(pd) = &self.pd
            && pd.roles.len() != self.engines
        {
            return Err(SimulateError::Config(format!(
                "{} kv roles for {} engines",
                pd.roles.len(),
                self.engines
            )));
        }
        Ok(())
    }

    /// The name of endpoint `i`, as `kvroute demo` names its engines.
    pub fn endpoint_name(i: usize) -> String {
        format!("engine-{i}")
    }

    /// The names of the endpoints a request can be sent to: every engine but a P/D fleet's
    /// prefill-only ones (whose work is the decode endpoints' requests).
    pub fn serving_endpoints(&self) -> Vec<String> {
        (0..self.engines)
            .filter(|&i| {
                let role = self.pd.as_ref().and_then(|pd| pd.roles.get(i));
                role != Some(&KvRole::Producer)
            })
            .map(Self::endpoint_name)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_can_be_sent_to_every_engine_but_a_pd_fleets_prefill_only_ones() {
        let plain = FleetConfig {
            engines: 3,
            ..FleetConfig::default()
        };
        assert_eq!(
            plain.serving_endpoints(),
            ["engine-0", "engine-1", "engine-2"]
        );
        let roles = [KvRole::Producer, KvRole::Both, KvRole::Consumer];
        let pd = FleetConfig::disaggregated(&roles, LinkSpec::parse("ib-400").unwrap(), 100);
        assert_eq!(pd.serving_endpoints(), ["engine-1", "engine-2"]);
    }

    #[test]
    fn a_mixed_fleet_slows_only_the_engines_named_and_refuses_bad_factors() {
        let fleet = FleetConfig {
            engine_slowdown: vec![1.0, 2.0],
            ..FleetConfig::default()
        };
        fleet.validate().unwrap();
        let (fast, slow, unnamed) = (
            fleet.engine_config(0),
            fleet.engine_config(1),
            fleet.engine_config(3),
        );
        assert_eq!(fast.latency, fleet.engine.latency);
        assert_eq!(unnamed.latency, fleet.engine.latency);
        assert_eq!(
            slow.latency.prefill_per_token_s,
            2.0 * fleet.engine.latency.prefill_per_token_s
        );
        assert_eq!(
            slow.latency.step_overhead_s,
            2.0 * fleet.engine.latency.step_overhead_s
        );
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let fleet = FleetConfig {
                engine_slowdown: vec![bad],
                ..FleetConfig::default()
            };
            let err = fleet.validate().unwrap_err().to_string();
            assert!(err.contains("engine_slowdown"), "{err}");
        }
    }
}
