//! Prefill/decode disaggregation in the simulated server: engine roles, the NixlConnector's
//! `kv_transfer_params` in the chosen release's shape, a producer's held blocks and their
//! lease, the side channel a consumer pulls through, and the link model's transfer time.
//!
//! Without a [`PdConfig`] an engine has no KV connector, and ignores `kv_transfer_params` as
//! vLLM does without `--kv-transfer-config`.

pub mod fabric;
pub(super) mod legs;
pub mod metrics;
pub mod side_channel;

use std::sync::Arc;
use std::time::Duration;

use kvroute_vllm::nixl::{KvLoadFailurePolicy, KvRole, NixlRelease};
use parking_lot::Mutex;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::actor::{Command, EngineShared};
use crate::SimError;
use crate::link::LinkSpec;
use fabric::FabricHandle;
use metrics::NixlMetrics;

/// P/D settings of a fleet.
#[derive(Clone, Debug)]
pub struct PdConfig {
    /// Each engine's `kv_role`, by index (as many as engines).
    pub roles: Vec<KvRole>,
    /// How long a producer holds unpulled blocks, engine seconds (`None`: the release's
    /// default, `VLLM_NIXL_ABORT_REQUEST_TIMEOUT` or 0.33's `kv_lease_duration`).
    pub lease: Option<Duration>,
    /// What a consumer does when a pull fails (`kv_load_failure_policy`).
    pub load_failure_policy: KvLoadFailurePolicy,
    /// Every link's speed.
    pub link: LinkSpec,
    /// KV-cache bytes per token (the model's shape).
    pub kv_bytes_per_token: u64,
    /// Side-channel port of engine 0; engine i uses + i (0: any free port). vLLM's
    /// `VLLM_NIXL_SIDE_CHANNEL_PORT` defaults to 5600.
    pub side_channel_port: u16,
}

impl PdConfig {
    /// `roles` with the defaults: the release's lease, `fail`, Llama-3.1-8B over `tcp`, side
    /// channels from port 5600.
    pub fn new(roles: Vec<KvRole>) -> Self {
        Self {
            roles,
            lease: None,
            load_failure_policy: KvLoadFailurePolicy::Fail,
            link: LinkSpec::parse("tcp").expect("a preset"),
            kv_bytes_per_token: crate::engine::latency::LLAMA_8B_KV_BYTES_PER_TOKEN as u64,
            side_channel_port: 5600,
        }
    }

    /// The role of every engine: `producers` kv_producer engines, then `consumers`
    /// kv_consumer engines, then `both` kv_both engines.
    pub fn roles(producers: usize, consumers: usize, both: usize) -> Vec<KvRole> {
        std::iter::repeat_n(KvRole::Producer, producers)
            .chain(std::iter::repeat_n(KvRole::Consumer, consumers))
            .chain(std::iter::repeat_n(KvRole::Both, both))
            .collect()
    }

    pub(super) fn validate(&self, engines: usize) -> Result<(), SimError> {
        if self.roles.len() != engines {
            return Err(SimError::Config(format!(
                "{} kv roles for {engines} engines",
                self.roles.len()
            )));
        }
        if self.kv_bytes_per_token == 0 {
            return Err(SimError::Config(
                "KV bytes per token must be positive".into(),
            ));
        }
        if self.lease.is_some_and(|l| l.is_zero()) {
            return Err(SimError::Config("the KV lease must be positive".into()));
        }
        Ok(())
    }
}

/// One engine's P/D state, shared by its HTTP handlers.
pub struct PdEngine {
    /// Its role.
    pub role: KvRole,
    /// The release whose protocol it speaks.
    pub release: NixlRelease,
    /// Its engine id (`remote_engine_id`).
    pub engine_id: String,
    /// Its side channel, as a producer names it (`remote_host`, `remote_port`).
    pub side_channel: (String, u16),
    /// What a failed pull does.
    pub load_failure_policy: KvLoadFailurePolicy,
    /// KV bytes per token.
    pub kv_bytes_per_token: u64,
    /// Tokens per block.
    pub block_size: usize,
    /// Name of its NIC on the fabric.
    pub nic: String,
    /// The fleet's links.
    pub fabric: FabricHandle,
    /// Transfer metrics.
    pub metrics: Mutex<NixlMetrics>,
}

/// The wall-time lease of `config` for `release` at `time_scale`.
pub(super) fn wall_lease(config: &PdConfig, release: NixlRelease, time_scale: f64) -> Duration {
    let engine = config.lease.unwrap_or(release.default_lease().duration);
    Duration::from_secs_f64(engine.as_secs_f64() / time_scale)
}

/// Releases a producer's holds as their leases expire, until the engine task stops.
pub(super) async fn reap_leases(
    shared: Arc<EngineShared>,
    commands: mpsc::UnboundedSender<Command>,
) {
    loop {
        let (next, period) = {
            let leases = shared.leases.lock();
            let period =
                (leases.duration() / 8).clamp(Duration::from_millis(10), Duration::from_secs(1));
            (leases.next_deadline(), period)
        };
        let now = Instant::now();
        let wake = next.map_or(now + period, |d| d.min(now + period));
        tokio::time::sleep_until(wake).await;
        let expired = shared.leases.lock().expire(Instant::now());
        for id in expired {
            tracing::info!(
                request = id,
                "a held KV transfer expired unpulled: blocks freed"
            );
            if commands.send(Command::Release(id)).is_err() {
                return;
            }
        }
        if commands.is_closed() {
            return;
        }
    }
}
