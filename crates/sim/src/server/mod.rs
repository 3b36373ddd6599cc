//! The simulated vLLM server: for each engine, an HTTP server (OpenAI API, `/metrics`, ...), a
//! task that runs the engine model in scaled real time, and a KV-event publisher (ZMQ PUB and
//! replay ROUTER) speaking a chosen vLLM release's wire format.

mod actor;
pub mod faults;
mod http;
pub mod lease;
pub mod metrics;
pub mod pd;
pub mod text;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use axum::serve::ListenerExt;
use kvroute_vllm::codec::{EventLayout, offloading_connector_hashes};
use kvroute_vllm::publisher::{Publisher, PublisherConfig, ReplayFraming};
use parking_lot::Mutex;
use serde::Serialize;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tracing::{info, warn};

use crate::SimError;
use crate::engine::{Engine, EngineConfig};
use actor::{Command, EngineShared, Outgoing};
use faults::Faults;
use kvroute_vllm::nixl::{KvRole, NixlRelease};

use crate::connector_events::{ConnectorEvents, OffloadEvents};
use lease::LeaseTable;
use pd::fabric::FabricHandle;
use pd::{PdConfig, PdEngine};

/// Settings of a simulated fleet (one or more engines in this process).
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Served model name.
    pub model: String,
    /// LoRA adapters served besides the base model.
    pub lora_modules: Vec<String>,
    /// Host to bind.
    pub host: String,
    /// HTTP port of engine 0; engine i uses port + i (0: any free port).
    pub port: u16,
    /// KV-event PUB port of engine 0; engine i uses + i (0: any free port).
    pub events_port: u16,
    /// Replay ROUTER port of engine 0; engine i uses + i (`None`: no replay; 0: any free port).
    pub replay_port: Option<u16>,
    /// Number of engines.
    pub engines: usize,
    /// Each engine's model.
    pub engine: EngineConfig,
    /// Simulated seconds per wall second (10: ten times faster than real time).
    pub time_scale: f64,
    /// vLLM release whose KV-event layout and replay framing to speak.
    pub vllm_version: String,
    /// KV-event topic (vLLM's default is empty).
    pub topic: String,
    /// Batches kept for replay (vLLM's `buffer_steps`).
    pub replay_buffer_steps: usize,
    /// Faults every engine starts with.
    pub faults: Faults,
    /// A HuggingFace `tokenizer.json` (and optional `.jinja` chat template) instead of the
    /// built-in tokenizer.
    pub tokenizer: Option<(std::path::PathBuf, Option<std::path::PathBuf>)>,
    /// Prefill/decode disaggregation: the engines' KV roles, link and lease (`None`: no KV
    /// connector; `kv_transfer_params` is ignored).
    pub pd: Option<PdConfig>,
    /// Which offloading connector's tier events to publish (see
    /// [`crate::connector_events`]).
    pub offload_events: OffloadEvents,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            model: "sim-llama-3.1-8b".into(),
            lora_modules: Vec::new(),
            host: "127.0.0.1".into(),
            port: 8001,
            events_port: 5557,
            replay_port: Some(6557),
            engines: 1,
            engine: EngineConfig::default(),
            time_scale: 1.0,
            vllm_version: "0.33.0".into(),
            topic: String::new(),
            replay_buffer_steps: 10_000,
            faults: Faults::default(),
            tokenizer: None,
            pd: None,
            offload_events: OffloadEvents::default(),
        }
    }
}

/// An engine's offloading connector, as `config` chooses it: what it remembers is bounded by
/// the blocks the engine can hold on every tier.
fn connector(config: &SimConfig) -> ConnectorEvents {
    let e = &config.engine;
    let capacity = e.num_gpu_blocks
        + e.num_cpu_blocks
        + e.num_ssd_blocks
        + e.shared_fs.as_ref().map_or(0, |fs| fs.capacity_blocks);
    ConnectorEvents::new(
        config.offload_events,
        e.block_size,
        capacity,
        &config.vllm_version,
    )
}

/// Where a running engine can be reached.
#[derive(Clone, Debug, Serialize)]
pub struct EngineEndpoint {
    /// Index in the fleet.
    pub index: usize,
    /// HTTP base URL, e.g. `http://127.0.0.1:8001`.
    pub url: String,
    /// KV-event PUB address.
    pub events: String,
    /// Replay ROUTER address.
    pub replay: Option<String>,
    /// Its KV role (`None`: no KV connector).
    pub kv_role: Option<KvRole>,
    /// A producer's side channel, `host:port` (the `remote_host`/`remote_port` it returns).
    pub side_channel: Option<String>,
}

/// A running fleet; dropping it stops every engine.
pub struct SimFleet {
    /// The engines' addresses.
    pub endpoints: Vec<EngineEndpoint>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for SimFleet {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

fn offset(base: u16, i: usize) -> Result<u16, SimError> {
    if base == 0 {
        return Ok(0);
    }
    u16::try_from(usize::from(base) + i)
        .map_err(|_| SimError::Config(format!("port {base} + {i} is out of range")))
}

/// Starts every engine of the fleet on the current tokio runtime.
pub async fn start(config: SimConfig) -> Result<SimFleet, SimError> {
    if config.engines == 0 {
        return Err(SimError::Config("engines must be at least 1".into()));
    }
    if !(1e-3..=1e3).contains(&config.time_scale) {
        return Err(SimError::Config(format!(
            "time_scale must be within 0.001–1000, not {}",
            config.time_scale
        )));
    }
    config.faults.validate()?;
    let mut served = vec![config.model.as_str()];
    for name in config.lora_modules.iter().map(String::as_str) {
        if served.contains(&name) {
            return Err(SimError::Config(format!(
                "the model name {name:?} is served twice (base model and LoRA adapters must differ)"
            )));
        }
        served.push(name);
    }
    if served.iter().any(|name| name.trim().is_empty()) {
        return Err(SimError::Config(
            "a served model or LoRA adapter name is empty".into(),
        ));
    }
    Engine::new(config.engine.clone())?; // validates the engine settings once
    let mut layout = EventLayout::for_vllm_version(&config.vllm_version)
        .map_err(|e| SimError::Config(e.to_string()))?;
    if config.offload_events != OffloadEvents::Lmcache {
        // vLLM's OffloadingConnector: raw-bytes hashes before 0.24.
        layout.offload_hashes = offloading_connector_hashes(&config.vllm_version)
            .map_err(|e| SimError::Config(e.to_string()))?;
    }
    let framing = ReplayFraming::for_vllm_version(&config.vllm_version)
        .map_err(|e| SimError::Config(e.to_string()))?;
    let tokenizer = match &config.tokenizer {
        None => http::SimTokenizer::Builtin,
        Some((path, template)) => http::SimTokenizer::Hf(Arc::new(
            kvroute_vllm::tokenizer::HfTokenizer::load(path, template.as_deref())
                .map_err(|e| SimError::Config(e.to_string()))?,
        )),
    };
    let mut fleet = SimFleet {
        endpoints: Vec::new(),
        tasks: Vec::new(),
    };
    let release = NixlRelease::for_vllm_version(&config.vllm_version)
        .map_err(|e| SimError::Config(e.to_string()))?;
    let fabric = match &config.pd {
        Some(pd) => {
            pd.validate(config.engines)?;
            let (handle, task) = FabricHandle::spawn(pd.link, config.time_scale);
            fleet.tasks.push(task);
            Some(handle)
        }
        None => None,
    };
    // One shared filesystem for the whole fleet, on one clock (engine seconds since start).
    let shared_fs = config
        .engine
        .shared_fs
        .clone()
        .map(crate::engine::shared_fs::SharedFs::handle);
    let epoch = tokio::time::Instant::now();
    for i in 0..config.engines {
        let publisher = Publisher::bind(PublisherConfig {
            address: format!("tcp://{}:{}", config.host, offset(config.events_port, i)?),
            connect: false,
            replay_address: match config.replay_port {
                Some(port) => Some(format!("tcp://{}:{}", config.host, offset(port, i)?)),
                None => None,
            },
            topic: config.topic.clone(),
            layout,
            replay_framing: framing,
            buffer_steps: config.replay_buffer_steps,
        })
        .await
        .map_err(|e| SimError::Io(format!("engine {i}: {e}")))?;
        let events = publisher.address().to_owned();
        let replay = publisher.replay_address().map(str::to_owned);

        let listener =
            tokio::net::TcpListener::bind((config.host.as_str(), offset(config.port, i)?))
                .await
                .map_err(|e| SimError::Io(format!("engine {i}: binding HTTP port: {e}")))?;
        let addr: SocketAddr = listener
            .local_addr()
            .map_err(|e| SimError::Io(e.to_string()))?;

        let lease = config.pd.as_ref().map_or(std::time::Duration::MAX, |pd| {
            pd::wall_lease(pd, release, config.time_scale)
        });
        let shared = Arc::new(EngineShared {
            observed: Mutex::new(metrics::Observed::started_now()),
            faults: Mutex::new(config.faults.clone()),
            leases: Mutex::new(LeaseTable::new(lease)),
        });
        let (commands_tx, commands_rx) = mpsc::unbounded_channel::<Command>();
        let (events_tx, events_rx) = mpsc::unbounded_channel::<Outgoing>();
        fleet.tasks.push(tokio::spawn(actor::run_engine(
            config.engine.clone(),
            actor::FleetMount {
                shared_fs: shared_fs.clone(),
                epoch,
                connector: connector(&config),
            },
            config.time_scale,
            commands_rx,
            events_tx,
            shared.clone(),
        )));
        fleet
            .tasks
            .push(tokio::spawn(publish_events(publisher, events_rx, i)));
        let pd_engine = match (&config.pd, &fabric) {
            (Some(pd), Some(fabric)) => Some(
                start_pd(
                    pd,
                    release,
                    &config,
                    i,
                    addr,
                    fabric.clone(),
                    &shared,
                    &commands_tx,
                    &mut fleet.tasks,
                )
                .await?,
            ),
            _ => None,
        };
        let app = http::router(Arc::new(http::EngineHttp {
            model: config.model.clone(),
            lora_modules: config.lora_modules.clone(),
            index: i,
            config: config.engine.clone(),
            commands: commands_tx,
            shared,
            next_id: AtomicU64::new(1),
            tokenizer: tokenizer.clone(),
            pd: pd_engine.clone(),
        }));
        fleet.tasks.push(tokio::spawn(async move {
            if let Err(e) = axum::serve(
                listener.tap_io(|tcp| {
                    // Streamed tokens must not wait for the client's delayed ACK (Nagle).
                    let _ = tcp.set_nodelay(true);
                }),
                app,
            )
            .await
            {
                warn!(engine = i, error = %e, "HTTP server stopped");
            }
        }));
        info!(engine = i, http = %addr, events = %events, replay = replay.as_deref().unwrap_or("-"), "simulated vLLM engine up");
        fleet.endpoints.push(EngineEndpoint {
            index: i,
            url: format!("http://{addr}"),
            events,
            replay,
            kv_role: pd_engine.as_ref().map(|p| p.role),
            side_channel: pd_engine
                .as_ref()
                .filter(|p| p.role.produces())
                .map(|p| format!("{}:{}", p.side_channel.0, p.side_channel.1)),
        });
    }
    Ok(fleet)
}

/// Sets up engine `index`'s P/D part: its side channel (a producer's), its lease reaper and
/// its identity.
#[allow(clippy::too_many_arguments)]
async fn start_pd(
    pd: &PdConfig,
    release: NixlRelease,
    config: &SimConfig,
    index: usize,
    http: SocketAddr,
    fabric: FabricHandle,
    shared: &Arc<EngineShared>,
    commands: &mpsc::UnboundedSender<Command>,
    tasks: &mut Vec<JoinHandle<()>>,
) -> Result<Arc<PdEngine>, SimError> {
    let role = pd.roles[index];
    let engine_id = format!("{:032x}", rand::random::<u128>());
    let mut side_port = 0;
    if role.produces() {
        let listener = tokio::net::TcpListener::bind((
            config.host.as_str(),
            offset(pd.side_channel_port, index)?,
        ))
        .await
        .map_err(|e| SimError::Io(format!("engine {index}: binding the side channel: {e}")))?;
        side_port = listener
            .local_addr()
            .map_err(|e| SimError::Io(e.to_string()))?
            .port();
        tasks.push(tokio::spawn(pd::side_channel::serve(
            listener,
            Arc::new(pd::side_channel::Producer {
                engine_id: engine_id.clone(),
                shared: shared.clone(),
                commands: commands.clone(),
            }),
        )));
        tasks.push(tokio::spawn(pd::reap_leases(
            shared.clone(),
            commands.clone(),
        )));
    }
    Ok(Arc::new(PdEngine {
        role,
        release,
        engine_id,
        side_channel: (config.host.clone(), side_port),
        load_failure_policy: pd.load_failure_policy,
        kv_bytes_per_token: pd.kv_bytes_per_token,
        block_size: config.engine.block_size,
        nic: format!("engine-{index}@{http}"),
        fabric,
        metrics: Mutex::default(),
    }))
}

async fn publish_events(
    mut publisher: Publisher,
    mut rx: mpsc::UnboundedReceiver<Outgoing>,
    engine: usize,
) {
    while let Some(out) = rx.recv().await {
        if out.restart {
            publisher.restart();
        }
        if out.batch.events.is_empty() {
            continue;
        }
        tokio::time::sleep_until(out.not_before).await;
        if out.lost {
            publisher.publish_lost(&out.batch);
        } else if let Err(e) = publisher.publish(&out.batch).await {
            warn!(engine, error = %e, "cannot publish KV events");
        }
    }
}
