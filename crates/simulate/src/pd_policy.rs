//! P/D on top of a scheduling profile: the decode endpoint is the profile's best
//! decode-capable pick; then either always disaggregate onto the best prefill-capable endpoint
//! (`pd-always`, what Dynamo and vLLM's proxy do), or price aggregated against every prefill
//! candidate with the fleet's own P/D call (`pd-cost`: [`Fleet::plan_disagg`], the call
//! `kvroute serve` makes), the fleet learning each pair's bandwidth from the transfers the
//! engines report.

use kvroute_core::fleet::{DisaggConfig, Fleet, Plan};
use kvroute_core::index::EndpointId;
use kvroute_core::schedule::Role;
use kvroute_core::schedule::disagg::{DisaggChoice, DisaggExplain, LinkLearning, LinkPrior};
use kvroute_vllm::nixl::KvRole;

use crate::config::FleetConfig;
use crate::policy::Routing;

/// How a P/D policy decides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PdMode {
    /// Every request with a prefill endpoint available is disaggregated.
    Always,
    /// Per request, the cheaper in predicted seconds.
    Cost,
}

/// The P/D part of a policy: its mode and the fleet's block size (the state is the fleet's).
pub struct PdRouting {
    mode: PdMode,
    block_size: usize,
}

/// The scheduler's role for a KV role.
pub fn role(kv: KvRole) -> Role {
    match kv {
        KvRole::Producer => Role::Prefill,
        KvRole::Consumer => Role::Decode,
        KvRole::Both => Role::Both,
    }
}

/// The fleet's P/D pricing for a simulated fleet (`None` when it has no P/D roles).
pub fn disagg_config(fleet: &FleetConfig) -> Option<DisaggConfig> {
    let pd = fleet.pd.as_ref()?;
    Some(DisaggConfig {
        link: LinkPrior {
            bandwidth_bytes_per_s: pd.link.bandwidth_bytes_per_s,
            latency_s: pd.link.latency_s,
        },
        learning: LinkLearning::default(),
        kv_bytes_per_token: pd.kv_bytes_per_token as f64,
        // The second leg: the producer's sampling step, and one more round trip.
        leg_overhead_s: fleet.engine.latency.step_overhead_s
            + fleet.request_latency_s
            + fleet.response_latency_s,
    })
}

impl PdRouting {
    /// `mode` on `fleet` (`None` when the fleet has no P/D roles); turns the core fleet's P/D
    /// pricing on.
    pub fn new(mode: PdMode, fleet: &FleetConfig, core: &mut Fleet) -> Option<Self> {
        core.enable_disagg(disagg_config(fleet)?);
        Some(Self {
            mode,
            block_size: fleet.engine.block_size,
        })
    }

    /// Where a request goes, given the profile's plan over every endpoint, with the P/D
    /// choice's arithmetic where it was priced (`pd-cost`).
    pub fn choose(
        &self,
        core: &mut Fleet,
        plan: &Plan,
        prompt_tokens: usize,
        now: f64,
    ) -> Option<(Routing, Option<DisaggExplain>)> {
        let decode = core.decode_pick(plan)?;
        let aggregated = Routing::Endpoint(decode.0 as usize);
        let disaggregated = |prefill: EndpointId| Routing::Disaggregated {
            prefill: prefill.0 as usize,
            decode: decode.0 as usize,
        };
        let (routing, explain) = match self.mode {
            PdMode::Always => (
                core.prefill_candidates(plan, decode)
                    .into_iter()
                    .find(|e| plan.decision.assessment(*e).is_some())
                    .map_or(aggregated, disaggregated),
                None,
            ),
            PdMode::Cost => {
                let explain =
                    core.plan_disagg(plan, decode, prompt_tokens, self.block_size, now)?;
                let routing = match explain.choice {
                    DisaggChoice::Aggregated => aggregated,
                    DisaggChoice::Disaggregated { prefill } => disaggregated(prefill),
                };
                (routing, Some(explain))
            }
        };
        // The prefill's work reaches the endpoint that computes it, whatever decided it.
        let computes = match routing {
            Routing::Disaggregated { prefill, .. } => EndpointId(prefill as u32),
            _ => decode,
        };
        core.prefill_sent(plan, computes, now);
        Some((routing, explain))
    }
}
