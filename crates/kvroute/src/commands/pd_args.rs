//! The flags that make a simulated fleet disaggregated (prefill/decode roles and the KV link
//! between engines), shared by `kvroute sim` and `kvroute simulate`.

use clap::Args;
use kvroute_sim::link::LinkSpec;
use kvroute_simulate::config::MAX_ENGINES;
use kvroute_vllm::nixl::KvRole;

/// P/D roles and the KV link.
#[derive(Args)]
pub struct PdFleetArgs {
    /// P/D: the KV role of the --engines engines (vLLM's kv_producer, kv_consumer, kv_both).
    /// Without it, --prefill-engines or --decode-engines, engines have no KV connector and
    /// ignore kv_transfer_params, as vLLM without --kv-transfer-config.
    #[arg(long, value_parser = parse_role)]
    kv_role: Option<KvRole>,
    /// P/D: kv_producer engines, first in the fleet.
    #[arg(long, default_value_t = 0)]
    prefill_engines: usize,
    /// P/D: kv_consumer engines, after the producers.
    #[arg(long, default_value_t = 0)]
    decode_engines: usize,
    /// P/D: the KV link between engines: tcp (UCX over TCP, 0.55 GB/s), roce-100 (12.1 GB/s),
    /// ib-400 (49.5 GB/s), or `custom:<GB/s>[:<latency ms>]`.
    #[arg(long, default_value = "tcp", value_parser = parse_link)]
    kv_link: LinkSpec,
}

impl PdFleetArgs {
    /// The fleet's engine count, and, when these flags make it disaggregated, every engine's
    /// role in fleet order: the producers, the consumers, then the `engines` engines of
    /// --kv-role (kv_both by default; `default_engines` of them when not given, none beside
    /// producers or consumers). Refuses a fleet over [`MAX_ENGINES`] before building it.
    pub fn roles(
        &self,
        engines: Option<usize>,
        default_engines: usize,
    ) -> anyhow::Result<(usize, Option<Vec<KvRole>>)> {
        let split = self.prefill_engines.saturating_add(self.decode_engines);
        let others = engines.unwrap_or(if split > 0 { 0 } else { default_engines });
        let total = split.saturating_add(others);
        anyhow::ensure!(
            total <= MAX_ENGINES,
            "engines must be within 1–{MAX_ENGINES}, not {total} (--engines, --prefill-engines and --decode-engines together)"
        );
        let roles = (split > 0 || self.kv_role.is_some()).then(|| {
            std::iter::repeat_n(KvRole::Producer, self.prefill_engines)
                .chain(std::iter::repeat_n(KvRole::Consumer, self.decode_engines))
                .chain(std::iter::repeat_n(
                    self.kv_role.unwrap_or(KvRole::Both),
                    others,
                ))
                .collect()
        });
        Ok((total, roles))
    }

    /// The KV link between engines.
    pub fn link(&self) -> LinkSpec {
        self.kv_link
    }
}

fn parse_role(text: &str) -> Result<KvRole, String> {
    text.parse()
        .map_err(|e: kvroute_vllm::VllmError| e.to_string())
}

fn parse_link(text: &str) -> Result<LinkSpec, String> {
    LinkSpec::parse(text).map_err(|e| e.to_string())
}
