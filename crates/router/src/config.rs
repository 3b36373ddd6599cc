//! The router's configuration: one YAML file, every field with a default, validated at start
//! with a message naming the field at fault.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use kvroute_core::fleet::{
    FleetConfig, FlowConfig, HealthPolicy, OutlierPolicy, RetryPolicy, TrustPolicy,
};
use kvroute_core::index::{OffloadSpec, SharedMount};
use kvroute_core::schedule::{
    BalanceTolerance, CostWeights, Filters, Picker, Profile, ProfileName, Role, Saturation,
    TierCosts,
};
use serde::{Deserialize, Serialize};

mod discovery;
mod pd;

pub use discovery::KubeDiscovery;
// Sections of the configuration declared next to the code they configure.
pub use crate::forwarding::{ForwardingConfig, Network};
pub use crate::metrics::MetricsConfig;
pub use pd::{PdConfig, PdMode};

use crate::RouterError;

/// The whole configuration (`kvroute serve -c kvroute.yaml`).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouterConfig {
    /// Address the OpenAI API (and `/health`) listens on.
    #[serde(default = "default_listen")]
    pub listen: SocketAddr,
    /// The admin listener: `/metrics`, `/kvroute/v1/explain` and `/health`.
    #[serde(default)]
    pub admin: AdminConfig,
    /// Served models.
    pub models: Vec<ModelConfig>,
    /// Engine endpoints known at start (may be empty with `discovery`).
    #[serde(default)]
    pub endpoints: Vec<EndpointConfig>,
    /// Endpoints discovered from Kubernetes while running (feature `kube`).
    #[serde(default)]
    pub discovery: Option<KubeDiscovery>,
    /// How endpoints are chosen.
    #[serde(default)]
    pub scheduler: SchedulerConfig,
    /// Request limits and timeouts.
    #[serde(default)]
    pub limits: Limits,
    /// Health checks.
    #[serde(default)]
    pub health: HealthConfig,
    /// Load scraping.
    #[serde(default)]
    pub scrape: ScrapeConfig,
    /// The router's own `/metrics`.
    #[serde(default)]
    pub metrics: crate::metrics::MetricsConfig,
    /// The KV block index and the router's own routing memory.
    #[serde(default)]
    pub cache: CacheConfig,
    /// Flow control: holding requests in the router while every endpoint is saturated.
    #[serde(default)]
    pub flow: FlowConfig,
    /// Passive outlier detection (failed requests eject an endpoint for a while) and the
    /// per-endpoint circuit breaker.
    #[serde(default)]
    pub outlier: OutlierPolicy,
    /// Retrying a request on the next endpoint, within a budget.
    #[serde(default)]
    pub retry: RetryPolicy,
    /// Graceful shutdown.
    #[serde(default)]
    pub shutdown: ShutdownConfig,
    /// Forwarded headers: which proxies in front of the router are trusted.
    #[serde(default)]
    pub forwarding: crate::forwarding::ForwardingConfig,
    /// Other router replicas serving the same fleet: where a starting replica copies its KV
    /// index from before it reports ready.
    #[serde(default)]
    pub replicas: ReplicasConfig,
    /// The KV-event subscribers' bounds.
    #[serde(default)]
    pub kv_events: KvEventsConfig,
    /// Router-orchestrated prefill/decode disaggregation (off by default).
    #[serde(default)]
    pub pd: PdConfig,
}

/// What one engine's KV-event connection (PUB or replay) may make the router buffer.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvEventsConfig {
    /// Largest KV-event message accepted, all its frames together; a publisher declaring a
    /// larger frame or message loses its connection (a protocol error, counted, reconnected
    /// with backoff) before anything is buffered for it. As libzmq's `ZMQ_MAXMSGSIZE`.
    pub max_message_bytes: usize,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        Self {
            max_message_bytes: kvroute_vllm::zmtp::DEFAULT_MAX_MESSAGE_BYTES,
        }
    }
}

impl KvEventsConfig {
    /// The subscribers' configuration: default timing, these bounds.
    pub fn subscriber_config(&self) -> kvroute_vllm::subscriber::SubscriberConfig {
        kvroute_vllm::subscriber::SubscriberConfig {
            limits: kvroute_vllm::zmtp::Limits {
                max_message_bytes: self.max_message_bytes,
                ..kvroute_vllm::zmtp::Limits::default()
            },
            ..Default::default()
        }
    }
}

/// Running several replicas active-active: each subscribes to every engine's events; a
/// starting one copies a running peer's index (and the event sequence it reflects) before its
/// readiness check (`/health` on the API listener) answers 200.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReplicasConfig {
    /// The other replicas' admin listeners (`http://host:port`), asked in turn for a snapshot
    /// of their index at start (and this replica answers theirs, read from its index).
    pub peers: Vec<String>,
    /// Most seconds to wait for a warm index at start (a snapshot applied and every endpoint's
    /// events caught up); after that the replica reports ready anyway, with the endpoints not
    /// caught up marked untrusted.
    pub warm_timeout_s: f64,
    /// With peers: tell them where each request went, and record theirs (predicted blocks,
    /// history, placements). Measured in docs/benchmarks.md, "Router replicas".
    pub share_dispatches: bool,
    /// With dispatches shared: also count each peer's request as queued prefill at its engine
    /// until the peer says its first token came (one more small message per request per peer).
    pub share_load: bool,
    /// Peers found in Kubernetes (feature `kube`), besides `peers`: the ready pods of the
    /// router's own Deployment, by label, each reached on its admin port.
    pub kubernetes: Option<PeerDiscovery>,
}

/// Replica peers found in Kubernetes: the ready pods a label selector picks (the router
/// Deployment's own pods), watched, each a peer at `http://<pod IP>:<admin_port>`; this
/// replica's own pod is left out.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerDiscovery {
    /// The API server's URL, unauthenticated (e.g. `kubectl proxy`'s); default: the in-cluster
    /// service account, else the kubeconfig.
    #[serde(default)]
    pub api_server: Option<String>,
    /// The namespace of the router's pods (default: the client's, usually the pod's own).
    #[serde(default)]
    pub namespace: Option<String>,
    /// The label selector of the router's pods (`matchLabels`), e.g. its Deployment's.
    pub selector: BTreeMap<String, String>,
    /// The admin listener's port on every router pod.
    pub admin_port: u16,
    /// This replica's own pod name, left out of its peers (default: `$POD_NAME`, else
    /// `$HOSTNAME`, which Kubernetes sets to the pod's name). Should it be unset or wrong, the
    /// replica still leaves itself out once its first peer message reaches its own admin
    /// listener (it carries the replica's id, `x-kvroute-replica`), and drops that message.
    #[serde(default)]
    pub self_pod: Option<String>,
}

/// An API server's URL, checked at start rather than retried forever at run time.
fn check_api_server(field: &str, url: Option<&str>) -> Result<(), RouterError> {
    if let Some(url) = url {
        let parsed: Result<axum::http::Uri, _> = url.parse();
        if !parsed.is_ok_and(|u| u.scheme().is_some() && u.host().is_some()) {
            return Err(invalid(field, format!("{url:?} is not an http(s) URL")));
        }
    }
    Ok(())
}

/// A label selector's labels: sent as `key=value` pairs joined by commas, so a key or value
/// holding one of those would select other pods, or fail the watch forever.
fn check_selector(
    field: &str,
    selector: &std::collections::BTreeMap<String, String>,
) -> Result<(), RouterError> {
    let malformed = |text: &str| text.contains([',', '=', ' ', '!']);
    if let Some((key, value)) = selector
        .iter()
        .find(|(k, v)| k.is_empty() || malformed(k) || malformed(v))
    {
        return Err(invalid(
            field,
            format!("{key:?}: {value:?} is not a label (no empty key; no ',', '=', '!' or spaces)"),
        ));
    }
    Ok(())
}

impl PeerDiscovery {
    /// What would otherwise fail only at run time, retried forever: the API server's URL, the
    /// selector's labels (`key=value` pairs joined by commas on the wire) and the port.
    fn validate(&self) -> Result<(), RouterError> {
        check_api_server("replicas.kubernetes.api_server", self.api_server.as_deref())?;
        check_selector("replicas.kubernetes.selector", &self.selector)?;
        if self.admin_port == 0 {
            return Err(invalid(
                "replicas.kubernetes.admin_port",
                "must be the router pods' admin port, not 0",
            ));
        }
        Ok(())
    }

    /// This replica's own pod name: configured, else from the environment.
    pub fn own_pod(&self) -> Option<String> {
        self.self_pod
            .clone()
            .or_else(|| std::env::var("POD_NAME").ok())
            .or_else(|| std::env::var("HOSTNAME").ok())
            .filter(|name| !name.is_empty())
    }
}

impl Default for ReplicasConfig {
    fn default() -> Self {
        Self {
            peers: Vec::new(),
            warm_timeout_s: 30.0,
            share_dispatches: true,
            share_load: true,
            kubernetes: None,
        }
    }
}

/// Graceful shutdown: on the first SIGTERM or SIGINT the router stops accepting connections and
/// fails readiness, and in-flight requests finish; at the timeout (or a second signal) open
/// streams end with an SSE error event.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ShutdownConfig {
    /// Seconds in-flight requests may take to finish.
    pub drain_timeout_s: f64,
}

impl Default for ShutdownConfig {
    fn default() -> Self {
        Self {
            drain_timeout_s: 30.0,
        }
    }
}

fn default_listen() -> SocketAddr {
    "127.0.0.1:8000".parse().expect("valid literal")
}

/// How a model's prompts become tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenizerKind {
    /// kvroute's built-in tokenizer (what `kvroute sim` uses).
    #[default]
    Builtin,
    /// The engine's own `/tokenize` endpoint: exact, one round-trip per request.
    Remote,
    /// No tokenizer: approximate routing by the router's own history only.
    None,
}

/// A model's tokenizer: a kind, or a HuggingFace `tokenizer.json` with its chat template.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum TokenizerConfig {
    /// `builtin`, `remote` or `none`.
    Kind(TokenizerKind),
    /// `{hf: path/to/tokenizer.json, chat_template: path/to/template.jinja, ...}`.
    Hf(HfTokenizerConfig),
}

impl<'de> Deserialize<'de> for TokenizerConfig {
    /// A name is a kind and a map a HuggingFace tokenizer, each with its own error: a
    /// misspelled kind or setting is refused by name, not read as another form or dropped.
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        match serde_json::Value::deserialize(deserializer)? {
            value @ serde_json::Value::Object(_) => HfTokenizerConfig::deserialize(value)
                .map(TokenizerConfig::Hf)
                .map_err(D::Error::custom),
            value => TokenizerKind::deserialize(value)
                .map(TokenizerConfig::Kind)
                .map_err(D::Error::custom),
        }
    }
}

/// A HuggingFace tokenizer and how the engines render chats with it. Without `chat_template`,
/// the `chat_template.jinja` beside the tokenizer, else the one in its `tokenizer_config.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HfTokenizerConfig {
    /// The model's `tokenizer.json`.
    pub hf: std::path::PathBuf,
    /// A `.jinja` chat template file.
    #[serde(default)]
    pub chat_template: Option<std::path::PathBuf>,
    /// The engines' `--default-chat-template-kwargs`: template arguments every chat gets
    /// unless the request sets them (`{enable_thinking: false}` for a Qwen3 fleet serving
    /// without thinking).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    /// The engines' `--chat-template-content-format`: `auto` (detected from the template, as
    /// vLLM does), `string` or `openai`.
    #[serde(default, skip_serializing_if = "ContentFormatConfig::is_auto")]
    pub chat_template_content_format: ContentFormatConfig,
    /// The engines' `--exclude-tools-when-tool-choice-none`: a chat whose `tool_choice` is
    /// `"none"` is rendered without its tools.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub exclude_tools_when_tool_choice_none: bool,
}

impl HfTokenizerConfig {
    /// `hf` with every other setting at vLLM's default.
    pub fn new(hf: impl Into<std::path::PathBuf>) -> Self {
        Self {
            hf: hf.into(),
            chat_template: None,
            chat_template_kwargs: None,
            chat_template_content_format: ContentFormatConfig::Auto,
            exclude_tools_when_tool_choice_none: false,
        }
    }
}

/// How a chat template takes a message's content: vLLM's `--chat-template-content-format`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ContentFormatConfig {
    /// Detected from the template, as vLLM detects it.
    #[default]
    Auto,
    /// One text.
    String,
    /// A list of parts.
    Openai,
}

impl ContentFormatConfig {
    /// Whether it is left to detection.
    pub fn is_auto(&self) -> bool {
        *self == ContentFormatConfig::Auto
    }

    /// The format it forces, if any.
    pub fn forced(self) -> Option<kvroute_vllm::tokenizer::ContentFormat> {
        use kvroute_vllm::tokenizer::ContentFormat;
        match self {
            ContentFormatConfig::Auto => None,
            ContentFormatConfig::String => Some(ContentFormat::String),
            ContentFormatConfig::Openai => Some(ContentFormat::OpenAi),
        }
    }
}

impl Default for TokenizerConfig {
    fn default() -> Self {
        TokenizerConfig::Kind(TokenizerKind::Builtin)
    }
}

/// One served model.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The model name clients send.
    pub name: String,
    /// How prompts are tokenized: `builtin`, `remote`, `none`, or `{hf: tokenizer.json}`.
    #[serde(default)]
    pub tokenizer: TokenizerConfig,
    /// Tokens per KV block (vLLM's default 16; must match the engines).
    #[serde(default = "default_block_size")]
    pub block_size: usize,
    /// LoRA adapters served on top of this model (requests name them as the model).
    #[serde(default)]
    pub lora_adapters: Vec<String>,
}

fn default_block_size() -> usize {
    16
}

/// One engine endpoint.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EndpointConfig {
    /// A name for logs and metrics (default: the URL's host:port).
    #[serde(default)]
    pub name: Option<String>,
    /// HTTP base URL, e.g. `http://10.0.0.5:8000`.
    pub url: String,
    /// KV-event PUB address (`tcp://10.0.0.5:5557`); without it the endpoint is routed by load
    /// and the router's own history only.
    #[serde(default)]
    pub events: Option<String>,
    /// KV-event replay ROUTER address.
    #[serde(default)]
    pub replay: Option<String>,
    /// KV-event topic (empty: accept all).
    #[serde(default)]
    pub topic: String,
    /// Role for prefill/decode disaggregation.
    #[serde(default)]
    pub role: Role,
    /// Models served (default: every configured model).
    #[serde(default)]
    pub models: Vec<String>,
    /// Free-form labels, shown in explanations.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// How its engine offloads KV blocks below the GPU (CPU, storage, a shared filesystem).
    #[serde(default)]
    pub offload: OffloadConfig,
}

/// Pod label naming the shared KV tier (filesystem) a pod mounts, read by Kubernetes
/// discovery: the same as `offload.shared_mount` in static configuration.
pub const SHARED_MOUNT_LABEL: &str = "kvroute.io/shared-kv-mount";

/// How an endpoint's engine offloads KV blocks below its GPU, as far as its events need it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OffloadConfig {
    /// Tokens per offloaded block: the `block_size` in the OffloadingConnector's
    /// `kv_connector_extra_config` (a multiple of the block size). vLLM 0.20+ publishes one
    /// hash per offloaded block and no size, so a larger one must be given here. Default: one
    /// GPU block.
    #[serde(default)]
    pub block_size: Option<usize>,
    /// Name of the shared filesystem tier the engine mounts; endpoints naming the same mount
    /// share its blocks. Default: the pod label `kvroute.io/shared-kv-mount`, else none.
    #[serde(default)]
    pub shared_mount: Option<String>,
    /// Medium strings of the events that go to the shared mount (compared ignoring case).
    /// Default: `FS` and `OBJ`.
    #[serde(default)]
    pub shared_media: Vec<String>,
}

/// Scheduling settings: a named policy, optionally adjusted.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SchedulerConfig {
    /// `precise` (default), `approximate`, `least-load`, `prefix-hash`, `round-robin` or
    /// `random`.
    #[serde(default = "default_policy")]
    pub policy: ProfileName,
    /// The cost model's weights (prefix against load), replacing the defaults.
    #[serde(default)]
    pub weights: Option<CostWeights>,
    /// Load rates of the slower cache tiers.
    #[serde(default)]
    pub tiers: Option<TierCosts>,
    /// When costs count as equal, so new sessions spread evenly.
    #[serde(default)]
    pub balance: Option<BalanceTolerance>,
    /// Hard limits.
    #[serde(default)]
    pub filters: Filters,
    /// When an endpoint counts as saturated (flow control).
    #[serde(default)]
    pub saturation: Option<Saturation>,
    /// Picker replacing the policy's.
    #[serde(default)]
    pub picker: Option<Picker>,
    /// Seconds each queued request adds to a new request's wait.
    #[serde(default)]
    pub queue_wait_s: Option<f64>,
    /// Seconds taken off the cost of a session's previous endpoint.
    #[serde(default)]
    pub session_affinity_s: Option<f64>,
    /// Prefill speed assumed for every endpoint until observed, tokens per second.
    #[serde(default = "default_prefill_rate")]
    pub prefill_tokens_per_s: f64,
    /// Header whose value names a session.
    #[serde(default = "default_session_header")]
    pub session_header: String,
    /// Header whose integer value is a request's priority in the flow-control queue (higher
    /// leaves first; default 0).
    #[serde(default = "default_priority_header")]
    pub priority_header: String,
}

fn default_policy() -> ProfileName {
    ProfileName::Precise
}

fn default_prefill_rate() -> f64 {
    20_000.0
}

fn default_session_header() -> String {
    "x-session-id".into()
}

fn default_priority_header() -> String {
    "x-kvroute-priority".into()
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            policy: default_policy(),
            weights: None,
            tiers: None,
            balance: None,
            filters: Filters::default(),
            saturation: None,
            picker: None,
            queue_wait_s: None,
            session_affinity_s: None,
            prefill_tokens_per_s: default_prefill_rate(),
            session_header: default_session_header(),
            priority_header: default_priority_header(),
        }
    }
}

impl SchedulerConfig {
    /// The effective scheduling profile.
    pub fn profile(&self) -> Profile {
        let mut profile = Profile::named(self.policy);
        if let Some(w) = &self.weights {
            profile.weights = w.clone();
        }
        if let Some(t) = &self.tiers {
            profile.tiers = t.clone();
        }
        if let Some(b) = &self.balance {
            profile.balance = b.clone();
        }
        if let Some(s) = &self.saturation {
            profile.saturation = s.clone();
        }
        if let Some(p) = &self.picker {
            profile.picker = p.clone();
        }
        if let Some(w) = self.queue_wait_s {
            profile.queue_wait_s = w;
        }
        if let Some(a) = self.session_affinity_s {
            profile.session_affinity_s = a;
        }
        profile.filters = self.filters.clone();
        profile
    }
}

/// Request limits and timeouts, at the router's HTTP edge and towards engines.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Largest request body accepted (413 above, from the `Content-Length` header alone when
    /// the client sends one).
    pub max_body_bytes: usize,
    /// Time to connect to an engine, milliseconds.
    pub connect_timeout_ms: u64,
    /// Time for an engine to send response headers, seconds (504 after), and then its first
    /// body byte (the stream is cut after, with an SSE error event).
    pub response_timeout_s: f64,
    /// Most time between two chunks of an engine's response once its first body byte came,
    /// seconds; a stream silent for longer is cut (an SSE error event to the client, counted in
    /// `kvroute_streams_cut_total{reason="stalled"}`).
    pub stream_idle_timeout_s: f64,
    /// Time a client has to send a request's headers once it sent their first byte,
    /// milliseconds; the connection is closed after.
    pub header_timeout_ms: u64,
    /// Time a client has to send a whole request body once its headers arrived, milliseconds
    /// (408 after).
    pub body_timeout_ms: u64,
    /// Time a connection may sit idle between requests (no request in progress, no byte
    /// received), milliseconds; it is closed after.
    pub idle_timeout_ms: u64,
    /// Time a client may take none of the bytes the router is sending it (its socket's
    /// buffers full, as when it stopped reading a stream), milliseconds; the connection is
    /// closed after, which cancels its requests at their engines and releases their load. An
    /// HTTP/2 stream its client stopped reading among others that move is given up alone after
    /// as long without being asked for more (its socket keeps taking the others' bytes).
    pub write_timeout_ms: u64,
    /// Most client connections open at once on each listener (API and admin); further
    /// connections are closed at once and counted in `kvroute_connections_refused_total`.
    pub max_connections: usize,
    /// Most request-body bytes held by the router at once, across all requests of the API
    /// listener and the picker (a body is charged as its bytes arrive, never for a declared
    /// length, and held until the engine's response headers arrive); a request that would
    /// exceed it gets 503.
    pub max_buffered_bytes: usize,
    /// Most bytes of prompt tokens the tokenization cache keeps.
    pub token_cache_bytes: usize,
    /// Request bodies of at least this many bytes are parsed, tokenized and planned on a
    /// bounded pool of blocking threads rather than on the async workers, so that a huge
    /// prompt does not delay small requests.
    pub offload_above_bytes: usize,
    /// Threads of that pool working at once.
    pub offload_threads: usize,
    /// Large requests waiting for that pool at most; a request past it gets 503.
    pub offload_queue: usize,
    /// Most blocks of a prompt that are keyed, planned and recorded: a longer prompt is routed
    /// by its first blocks (its cost still counts every token), so that one huge prompt holds
    /// the fleet's lock, which every request plans under, for a bounded time.
    pub max_routed_blocks: usize,
    /// Most ext_proc streams `kvroute epp` serves at once (each is one HTTP exchange of the
    /// data plane); a stream past it is answered 503.
    pub max_picker_streams: usize,
    /// Most observer streams (Envoy's `observability_mode` filter following responses)
    /// `kvroute epp` serves at once, apart from `max_picker_streams`; one past it is ended
    /// unanswered and its request handed back when its routing stream ends.
    pub max_observer_streams: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_body_bytes: 32 << 20,
            connect_timeout_ms: 2_000,
            response_timeout_s: 300.0,
            stream_idle_timeout_s: 60.0,
            header_timeout_ms: 10_000,
            body_timeout_ms: 60_000,
            idle_timeout_ms: 60_000,
            write_timeout_ms: 60_000,
            max_connections: 4_096,
            max_buffered_bytes: 256 << 20,
            token_cache_bytes: 256 << 20,
            max_picker_streams: 4_096,
            max_observer_streams: 4_096,
            max_routed_blocks: 16_384,
            offload_above_bytes: 64 << 10,
            offload_threads: 2,
            offload_queue: 64,
        }
    }
}

/// The admin listener, apart from the OpenAI API so that metrics and routing explanations
/// (which reveal what other tenants' prompts left cached) are not exposed with it.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdminConfig {
    /// Address of `/metrics`, `/kvroute/v1/explain` and `/health`. A non-loopback address
    /// needs `token`.
    pub listen: SocketAddr,
    /// When set, admin requests (except `/health`) must carry `Authorization: Bearer <token>`.
    pub token: Option<String>,
    /// Most request-body bytes the admin listener holds at once (its own budget, apart from
    /// `limits.max_buffered_bytes`); a request that would exceed it gets 503.
    pub max_buffered_bytes: usize,
}

impl Default for AdminConfig {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8090".parse().expect("valid literal"),
            token: None,
            max_buffered_bytes: 64 << 20,
        }
    }
}

/// Active health checks (`GET /health`).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HealthConfig {
    /// Between checks, milliseconds.
    pub interval_ms: u64,
    /// Per check, milliseconds.
    pub timeout_ms: u64,
    /// Consecutive failures that eject an endpoint.
    pub unhealthy_after: u32,
    /// Consecutive successes that bring it back.
    pub healthy_after: u32,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            interval_ms: 1_000,
            timeout_ms: 1_000,
            unhealthy_after: 2,
            healthy_after: 2,
        }
    }
}

/// Load scraping (`GET /metrics`).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScrapeConfig {
    /// Between scrapes, milliseconds.
    pub interval_ms: u64,
    /// Longest wait for an engine's `/metrics` answer, headers and body together, milliseconds. A busy
    /// engine's API server answers late (a CPU-bound vLLM took over a second on a loaded
    /// machine), and a busy engine is the one whose load matters: a timeout shorter than that
    /// leaves the router with the idle picture it had before.
    pub timeout_ms: u64,
}

impl Default for ScrapeConfig {
    fn default() -> Self {
        Self {
            interval_ms: 500,
            timeout_ms: 2_000,
        }
    }
}

/// The KV block index, the routing history and when to stop trusting an endpoint's events.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CacheConfig {
    /// Most (block, endpoint) entries in the index.
    pub index_capacity: usize,
    /// Shards of the index, split by endpoint: up to this many endpoints' events are applied
    /// at once, and a lookup walks each shard holding the prompt.
    pub index_shards: usize,
    /// Seconds the router remembers where it sent a prefix (approximate mode).
    pub history_ttl_s: f64,
    /// Most (block, endpoint) entries in that history.
    pub history_capacity: usize,
    /// Seconds a just-sent prefix counts as cached before its events arrive.
    pub predicted_ttl_s: f64,
    /// Seconds without any event, while requests keep going there, after which an endpoint's
    /// index is not trusted.
    pub silent_after_s: f64,
    /// Seconds an endpoint's index stays untrusted after events were lost for good; and after
    /// its last judgement when its predictions erred, before it is read again on probation.
    pub distrust_after_gap_s: f64,
    /// Mean absolute prediction error (share of the prompt) above which an endpoint's index is
    /// not trusted.
    pub max_prediction_error: f64,
}

impl Default for CacheConfig {
    fn default() -> Self {
        // Core's defaults, so the two cannot drift apart.
        let fleet = FleetConfig::default();
        Self {
            index_capacity: fleet.index_capacity,
            // One writer unless configured: a second shard doubles ingest only where a core is
            // free, and every lookup pays for it (docs/benchmarks.md, fleet scale).
            index_shards: fleet.index_shards,
            history_ttl_s: fleet.history_ttl_s,
            history_capacity: fleet.history_capacity,
            predicted_ttl_s: fleet.predicted_ttl_s,
            silent_after_s: fleet.trust.silent_after_s,
            distrust_after_gap_s: fleet.trust.distrust_after_gap_s,
            max_prediction_error: fleet.trust.max_prediction_error,
        }
    }
}

impl RouterConfig {
    /// How long a removed endpoint's id waits before a newcomer takes it: a request planned on
    /// an endpoint is dispatched once connected (`limits.connect_timeout_ms`), a P/D decode leg
    /// once its prefill answered (`pd.prefill_deadline_s`, when P/D is on), and half a second
    /// covers the work between the plan and the connection.
    pub fn slot_reuse_after_s(&self) -> f64 {
        let pd = match self.pd.mode {
            crate::config::pd::PdMode::Off => 0.0,
            _ => self.pd.prefill_deadline_s,
        };
        self.limits.connect_timeout_ms as f64 / 1000.0 + pd + 0.5
    }

    /// The core fleet's bounds and thresholds, from the sections that set them.
    pub fn fleet_config(&self) -> FleetConfig {
        let c = &self.cache;
        FleetConfig {
            index_capacity: c.index_capacity,
            index_shards: c.index_shards,
            history_ttl_s: c.history_ttl_s,
            history_capacity: c.history_capacity,
            predicted_ttl_s: c.predicted_ttl_s,
            default_prefill_tokens_per_s: self.scheduler.prefill_tokens_per_s,
            load_sample_max_age_s: FleetConfig::load_sample_max_age_for(
                self.scrape.interval_ms as f64 / 1000.0,
                self.scrape.timeout_ms as f64 / 1000.0,
            ),
            trust: TrustPolicy {
                silent_after_s: c.silent_after_s,
                distrust_after_gap_s: c.distrust_after_gap_s,
                max_prediction_error: c.max_prediction_error,
                ..TrustPolicy::default()
            },
            health: HealthPolicy {
                unhealthy_after: self.health.unhealthy_after,
                healthy_after: self.health.healthy_after,
            },
            flow: self.flow.clone(),
            outlier: self.outlier.clone(),
            retry: self.retry.clone(),
            slot_reuse_after_s: self.slot_reuse_after_s(),
            ..FleetConfig::default()
        }
    }
}

/// Seconds no timeout setting may reach (about 31 years): a duration made from more could
/// overflow (and from 2⁶⁴ seconds on, panic), and no timeout means that much.
pub(crate) const MAX_SECONDS: f64 = 1e9;

/// The most index shards accepted: one writer each, so more than a large machine's cores gain
/// nothing, and each is allocated up front.
const MAX_INDEX_SHARDS: usize = 1024;

/// The smallest `kv_events.max_message_bytes` accepted: below it, ordinary batches would be refused.
const MIN_KV_EVENT_MESSAGE_BYTES: usize = 64 << 10;

/// The largest `kv_events.max_message_bytes` accepted (each subscriber may queue four).
const MAX_KV_EVENT_MESSAGE_BYTES: usize = 1 << 30;

/// Whether `addr` is `tcp://host:port` with a host and a port of 1–65535 (an address to
/// connect to: no wildcard host).
fn is_tcp_host_port(addr: &str) -> bool {
    addr.strip_prefix("tcp://")
        .and_then(|rest| rest.rsplit_once(':'))
        .is_some_and(|(host, port)| {
            !host.is_empty()
                && host != "*"
                && !host.contains(char::is_whitespace)
                && port.parse::<u16>().is_ok_and(|p| p > 0)
        })
}

fn invalid(field: &str, why: impl std::fmt::Display) -> RouterError {
    RouterError::Config(format!("{field}: {why}"))
}

/// How two endpoints collide, the gravest first: what configuration validation refuses at
/// start and a joining endpoint is refused for while the router runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum EndpointClash {
    /// One engine (the same host and port): its load and cache picture would split in two.
    Engine,
    /// One KV-event address: one engine's events would feed two endpoints.
    Events,
    /// One name: the two would share metrics and `x-kvroute-endpoint` answers.
    Name,
}

impl EndpointConfig {
    /// What the KV index must know of its offloaded tiers: the configured mount, else the one
    /// its pod label names.
    pub fn offload_spec(&self) -> OffloadSpec {
        let mount = self
            .offload
            .shared_mount
            .clone()
            .or_else(|| self.labels.get(SHARED_MOUNT_LABEL).cloned())
            .filter(|m| !m.is_empty());
        OffloadSpec {
            block_size: self.offload.block_size,
            shared: mount.map(|name| {
                let mut mount = SharedMount::new(name);
                if !self.offload.shared_media.is_empty() {
                    mount.media = self.offload.shared_media.clone();
                }
                mount
            }),
        }
    }

    /// The name the router knows it by in logs, metrics and `x-kvroute-endpoint`: its `name`,
    /// or else `authority`, its URL's `host:port` exactly as written (case and all).
    pub fn name_or_authority<'a>(&'a self, authority: &'a http::uri::Authority) -> &'a str {
        self.name.as_deref().unwrap_or(authority.as_str())
    }

    /// How this endpoint, whose URL has `authority`, collides with `other` (URL authority
    /// `other_authority`), the gravest way: the same engine (the same host and port, host case
    /// ignored: the router sends to the URL's authority alone), the same KV-event address, or
    /// the same name as the router gives them ([`Self::name_or_authority`]). `None` when the
    /// two can serve side by side.
    pub(crate) fn clash_with(
        &self,
        authority: &http::uri::Authority,
        other: &EndpointConfig,
        other_authority: &http::uri::Authority,
    ) -> Option<EndpointClash> {
        if authority
            .as_str()
            .eq_ignore_ascii_case(other_authority.as_str())
        {
            Some(EndpointClash::Engine)
        } else if self.events.is_some() && self.events == other.events {
            Some(EndpointClash::Events)
        } else if self.name_or_authority(authority) == other.name_or_authority(other_authority) {
            Some(EndpointClash::Name)
        } else {
            None
        }
    }

    /// Why this endpoint (URL authority `authority`) cannot join beside one it has `clash` with.
    pub(crate) fn clash_reason(
        &self,
        authority: &http::uri::Authority,
        clash: EndpointClash,
    ) -> String {
        match clash {
            EndpointClash::Engine => format!(
                "{:?} is another endpoint's host and port ({})",
                self.url,
                authority.as_str().to_ascii_lowercase()
            ),
            EndpointClash::Events => {
                format!("{:?} is another endpoint's events address", self.events)
            }
            EndpointClash::Name => format!(
                "{:?} is another endpoint's name",
                self.name_or_authority(authority)
            ),
        }
    }

    /// Checks one endpoint (`field` names it in errors) against the configured model `names`.
    pub fn validate(&self, field: &str, names: &[&str]) -> Result<(), RouterError> {
        let e = self;
        let field = |f: &str| format!("{field}.{f}");
        let url: http::Uri = e
            .url
            .parse()
            .map_err(|err| invalid(&field("url"), format!("{:?} is not a URL: {err}", e.url)))?;
        if url.scheme_str() != Some("http") || url.host().is_none_or(str::is_empty) {
            return Err(invalid(
                &field("url"),
                format!("{:?} must be http://host:port", e.url),
            ));
        }
        let authority = url.authority().map_or("", |a| a.as_str());
        if authority.contains('@') {
            // They would go to the engine in no header and into every error that names it.
            return Err(invalid(
                &field("url"),
                "must not carry credentials (user:password@): put the engine behind no password, or front it with a proxy that adds them",
            ));
        }
        // The port follows the host, and an IPv6 host (`[::1]`) has colons of its own.
        let after_host = authority
            .rsplit_once(']')
            .map_or(authority, |(_, rest)| rest);
        if after_host
            .rsplit_once(':')
            .is_some_and(|(_, port)| port.parse::<u16>().map_or(true, |p| p == 0))
        {
            return Err(invalid(
                &field("url"),
                format!("{:?}: the port must be within 1–65535", e.url),
            ));
        }
        if e.name.as_deref().is_some_and(|n| n.trim().is_empty()) {
            return Err(invalid(&field("name"), "must not be empty"));
        }
        for (f, addr) in [("events", &e.events), ("replay", &e.replay)] {
            if let Some(addr) = addr
                && !is_tcp_host_port(addr)
            {
                return Err(invalid(
                    &field(f),
                    format!("{addr:?} must be tcp://host:port (a port within 1–65535)"),
                ));
            }
        }
        if e.replay.is_some() && e.events.is_none() {
            return Err(invalid(&field("replay"), "needs events as well"));
        }
        for m in &e.models {
            if !names.contains(&m.as_str()) {
                return Err(invalid(
                    &field("models"),
                    format!("{m:?} is not a configured model"),
                ));
            }
        }
        Ok(())
    }
}

impl RouterConfig {
    /// Parses and validates YAML.
    pub fn from_yaml(text: &str) -> Result<Self, RouterError> {
        let config: RouterConfig =
            serde_yaml_ng::from_str(text).map_err(|e| RouterError::Config(e.to_string()))?;
        config.validate()?;
        Ok(config)
    }

    /// Checks what serde cannot.
    pub fn validate(&self) -> Result<(), RouterError> {
        if self.models.is_empty() {
            return Err(invalid("models", "at least one model is required"));
        }
        if let Some(k) = &self.replicas.kubernetes {
            k.validate()?;
            if !cfg!(feature = "kube") {
                return Err(invalid(
                    "replicas.kubernetes",
                    "this kvroute was built without the `kube` feature",
                ));
            }
            if k.selector.is_empty() {
                return Err(invalid(
                    "replicas.kubernetes.selector",
                    "name at least one label of the router's pods",
                ));
            }
        }
        if let Some(d) = &self.discovery {
            if !(d.pool_recheck_s >= 0.1 && d.pool_recheck_s < MAX_SECONDS) {
                return Err(invalid(
                    "discovery.pool_recheck_s",
                    "must be at least 0.1 seconds (each recheck reads the pool from the API server)",
                ));
            }
            check_api_server("discovery.api_server", d.api_server.as_deref())?;
            check_selector("discovery.selector", &d.selector)?;
            if d.inference_pool.is_some() && (!d.selector.is_empty() || !d.target_ports.is_empty())
            {
                return Err(invalid(
                    "discovery.inference_pool",
                    "names its own selector and target ports: give either a pool, or selector and target_ports",
                ));
            }
        }
        if self.endpoints.is_empty() && self.discovery.is_none() {
            return Err(invalid(
                "endpoints",
                "at least one endpoint is required (or discovery)",
            ));
        }
        for (i, m) in self.models.iter().enumerate() {
            if m.name.is_empty() {
                return Err(invalid(&format!("models[{i}].name"), "must not be empty"));
            }
            if m.block_size == 0 {
                return Err(invalid(
                    &format!("models[{i}].block_size"),
                    "must be at least 1",
                ));
            }
        }
        let names: Vec<&str> = self.models.iter().map(|m| m.name.as_str()).collect();
        if let Some(i) = (1..names.len()).find(|&i| names[..i].contains(&names[i])) {
            return Err(invalid(
                &format!("models[{i}].name"),
                format!("{:?} is configured twice", names[i]),
            ));
        }
        // A request names a model or an adapter: each name must mean one thing, or the first
        // model listing it would take another model's requests (its tokenizer, its keys).
        let mut served: Vec<&str> = names.clone();
        for (i, m) in self.models.iter().enumerate() {
            for (j, adapter) in m.lora_adapters.iter().enumerate() {
                let field = format!("models[{i}].lora_adapters[{j}]");
                if adapter.is_empty() {
                    return Err(invalid(&field, "must not be empty"));
                }
                if served.contains(&adapter.as_str()) {
                    return Err(invalid(
                        &field,
                        format!("{adapter:?} already names a model or another adapter"),
                    ));
                }
                served.push(adapter);
            }
        }
        for (i, e) in self.endpoints.iter().enumerate() {
            e.validate(&format!("endpoints[{i}]"), &names)?;
        }
        self.validate_endpoints_distinct()?;
        let s = &self.scheduler;
        if !(s.prefill_tokens_per_s.is_finite() && s.prefill_tokens_per_s > 0.0) {
            return Err(invalid(
                "scheduler.prefill_tokens_per_s",
                "must be positive",
            ));
        }
        let mut numbers: Vec<(&str, f64)> = vec![];
        if let Some(w) = &s.weights {
            numbers.extend([
                ("scheduler.weights.prefix", w.prefix),
                ("scheduler.weights.load", w.load),
                (
                    "scheduler.weights.decode_interference",
                    w.decode_interference,
                ),
                ("scheduler.weights.eviction", w.eviction),
            ]);
        }
        if let Some(t) = &s.tiers {
            numbers.extend([
                ("scheduler.tiers.cpu_tokens_per_s", t.cpu_tokens_per_s),
                (
                    "scheduler.tiers.storage_tokens_per_s",
                    t.storage_tokens_per_s,
                ),
                ("scheduler.tiers.shared_tokens_per_s", t.shared_tokens_per_s),
            ]);
            for (field, weight) in [
                ("scheduler.tiers.cpu_weight", t.cpu_weight),
                ("scheduler.tiers.storage_weight", t.storage_weight),
                ("scheduler.tiers.shared_weight", t.shared_weight),
            ] {
                if let Some(w) = weight
                    && !(0.0..=1.0).contains(&w)
                {
                    return Err(invalid(field, format!("{w} must be between 0 and 1")));
                }
            }
        }
        if let Some(b) = &s.balance {
            numbers.extend([
                ("scheduler.balance.relative", b.relative),
                ("scheduler.balance.absolute_s", b.absolute_s),
            ]);
        }
        numbers.extend(s.queue_wait_s.map(|v| ("scheduler.queue_wait_s", v)));
        numbers.extend(
            s.session_affinity_s
                .map(|v| ("scheduler.session_affinity_s", v)),
        );
        if let Some((field, _)) = numbers.iter().find(|(_, v)| !(v.is_finite() && *v >= 0.0)) {
            return Err(invalid(field, "must be finite and not negative"));
        }
        if let Some(Picker::PrefixHash { epsilon, .. }) = &s.picker
            && !(epsilon.is_finite() && *epsilon >= 0.0)
        {
            return Err(invalid(
                "scheduler.picker.epsilon",
                "must be finite and not negative",
            ));
        }
        if let Some(Picker::Softmax { temperature_s }) = &s.picker
            && (temperature_s.is_nan() || *temperature_s <= 0.0)
        {
            return Err(invalid(
                "scheduler.picker.temperature_s",
                "must be positive",
            ));
        }
        if let Some(v) = s.filters.max_waiting
            && !(v.is_finite() && v >= 0.0)
        {
            return Err(invalid(
                "scheduler.filters.max_waiting",
                "must be finite and not negative",
            ));
        }
        if let Some(v) = s.filters.max_kv_usage
            && !(0.0..=1.0).contains(&v)
        {
            return Err(invalid(
                "scheduler.filters.max_kv_usage",
                "must be within 0–1",
            ));
        }
        if let Some(sat) = &s.saturation {
            if !(sat.queue.is_finite() && sat.queue > 0.0) {
                return Err(invalid(
                    "scheduler.saturation.queue",
                    "must be positive (at 0 an idle engine counts as saturated and every request is held)",
                ));
            }
            if !(sat.kv_usage > 0.0 && sat.kv_usage <= 1.0) {
                return Err(invalid(
                    "scheduler.saturation.kv_usage",
                    "must be within 0–1 and above 0",
                ));
            }
        }
        if !(1..=MAX_INDEX_SHARDS).contains(&self.cache.index_shards) {
            return Err(invalid(
                "cache.index_shards",
                format!(
                    "must be within 1–{MAX_INDEX_SHARDS} (each is allocated up front; more shards than cores gain nothing)"
                ),
            ));
        }
        if !(self.flow.max_wait_s.is_finite() && self.flow.max_wait_s > 0.0) {
            return Err(invalid("flow.max_wait_s", "must be positive"));
        }
        self.validate_edge()?;
        self.pd.validate()?;
        if !(MIN_KV_EVENT_MESSAGE_BYTES..=MAX_KV_EVENT_MESSAGE_BYTES)
            .contains(&self.kv_events.max_message_bytes)
        {
            return Err(invalid(
                "kv_events.max_message_bytes",
                format!(
                    "must be between {MIN_KV_EVENT_MESSAGE_BYTES} (one KV-event batch) and {MAX_KV_EVENT_MESSAGE_BYTES}"
                ),
            ));
        }
        let o = &self.outlier;
        if o.consecutive_failures == 0 || o.max_inflight == 0 {
            return Err(invalid(
                "outlier",
                "consecutive_failures and max_inflight must be at least 1",
            ));
        }
        if !(o.base_ejection_s > 0.0 && o.max_ejection_s >= o.base_ejection_s) {
            return Err(invalid(
                "outlier",
                "base_ejection_s must be positive and at most max_ejection_s",
            ));
        }
        if !(0.0..=1.0).contains(&o.max_ejected_fraction) {
            return Err(invalid(
                "outlier.max_ejected_fraction",
                "must be within 0–1",
            ));
        }
        let r = &self.retry;
        if r.max_attempts == 0
            || !(r.window_s.is_finite() && r.window_s > 0.0)
            || !(r.budget_ratio.is_finite() && r.budget_ratio >= 0.0)
            || !(r.min_retries_per_s.is_finite() && r.min_retries_per_s >= 0.0)
        {
            return Err(invalid(
                "retry",
                "max_attempts must be at least 1, window_s positive, budget_ratio and min_retries_per_s not negative",
            ));
        }
        if !(self.shutdown.drain_timeout_s >= 0.0 && self.shutdown.drain_timeout_s < MAX_SECONDS) {
            return Err(invalid(
                "shutdown.drain_timeout_s",
                "must be a finite number of seconds, not negative",
            ));
        }
        for (i, peer) in self.replicas.peers.iter().enumerate() {
            let uri: Option<http::Uri> = peer.parse().ok();
            if !uri.is_some_and(|u| u.scheme_str() == Some("http") && u.host().is_some()) {
                return Err(invalid(
                    &format!("replicas.peers[{i}]"),
                    format!("{peer:?} must be http://host:port (a replica's admin listener)"),
                ));
            }
        }
        if !(self.replicas.warm_timeout_s > 0.0 && self.replicas.warm_timeout_s < MAX_SECONDS) {
            return Err(invalid("replicas.warm_timeout_s", "must be positive"));
        }
        if self.health.unhealthy_after == 0 || self.health.healthy_after == 0 {
            return Err(invalid(
                "health",
                "unhealthy_after and healthy_after must be at least 1",
            ));
        }
        Ok(())
    }
}

impl RouterConfig {
    /// Two endpoints that are one engine (the same host and port: the router sends to the
    /// URL's authority alone; or the same KV-event address) would split its load and its cache
    /// picture in two; two of one name, given or defaulted to the authority, would share its
    /// metrics and its `x-kvroute-endpoint` answers.
    fn validate_endpoints_distinct(&self) -> Result<(), RouterError> {
        let endpoints = &self.endpoints;
        // Endpoints are validated first: their URLs parse and have a host.
        let authorities: Vec<http::uri::Authority> = endpoints
            .iter()
            .map(|e| {
                let url: http::Uri = e.url.parse().expect("validated");
                url.authority().expect("validated").clone()
            })
            .collect();
        for (i, e) in endpoints.iter().enumerate() {
            let gravest = (0..i)
                .filter_map(|j| e.clash_with(&authorities[i], &endpoints[j], &authorities[j]))
                .min();
            if let Some(clash) = gravest {
                let why = e.clash_reason(&authorities[i], clash);
                return Err(invalid(&format!("endpoints[{i}]"), why));
            }
        }
        Ok(())
    }

    /// Checks the HTTP edge: limits and the admin listener.
    fn validate_edge(&self) -> Result<(), RouterError> {
        let l = &self.limits;
        for (field, value) in [
            ("limits.max_body_bytes", l.max_body_bytes as u64),
            ("limits.header_timeout_ms", l.header_timeout_ms),
            ("limits.body_timeout_ms", l.body_timeout_ms),
            ("limits.idle_timeout_ms", l.idle_timeout_ms),
            ("limits.write_timeout_ms", l.write_timeout_ms),
            ("limits.max_connections", l.max_connections as u64),
            ("limits.max_picker_streams", l.max_picker_streams as u64),
            ("limits.max_observer_streams", l.max_observer_streams as u64),
            ("limits.max_routed_blocks", l.max_routed_blocks as u64),
            ("limits.offload_threads", l.offload_threads as u64),
            ("limits.max_buffered_bytes", l.max_buffered_bytes as u64),
            ("scrape.timeout_ms", self.scrape.timeout_ms),
            // A zero deadline fails every connection and every probe at once.
            ("limits.connect_timeout_ms", l.connect_timeout_ms),
            ("health.timeout_ms", self.health.timeout_ms),
            (
                "admin.max_buffered_bytes",
                self.admin.max_buffered_bytes as u64,
            ),
        ] {
            if value == 0 {
                return Err(invalid(field, "must be positive"));
            }
        }
        for (field, value) in [
            ("limits.response_timeout_s", l.response_timeout_s),
            ("limits.stream_idle_timeout_s", l.stream_idle_timeout_s),
        ] {
            if !(value.is_finite() && value > 0.0 && value < MAX_SECONDS) {
                return Err(invalid(field, "must be a positive number of seconds"));
            }
        }
        if l.max_buffered_bytes < l.max_body_bytes {
            return Err(invalid(
                "limits.max_buffered_bytes",
                "must be at least limits.max_body_bytes",
            ));
        }
        for (field, value) in [
            ("limits.max_buffered_bytes", l.max_buffered_bytes),
            ("admin.max_buffered_bytes", self.admin.max_buffered_bytes),
        ] {
            if value > u32::MAX as usize {
                return Err(invalid(field, "must be below 4 GiB"));
            }
        }
        match &self.admin.token {
            Some(t) if t.is_empty() => Err(invalid("admin.token", "must not be empty")),
            None if !self.admin.listen.ip().is_loopback() => Err(invalid(
                "admin.listen",
                format!(
                    "{} is not a loopback address: set admin.token so that metrics and explanations need it",
                    self.admin.listen
                ),
            )),
            _ if self.admin.listen == self.listen && self.listen.port() != 0 => {
                Err(invalid("admin.listen", "must differ from listen"))
            }
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = "models: [{name: m}]\nendpoints: [{url: 'http://127.0.0.1:8001'}]\n";

    #[test]
    fn minimal_config_gets_every_default() {
        let c = RouterConfig::from_yaml(MINIMAL).unwrap();
        assert_eq!(c.listen.port(), 8000);
        assert_eq!(c.models[0].block_size, 16);
        assert_eq!(c.scheduler.policy, ProfileName::Precise);
        assert_eq!(c.scheduler.profile(), Profile::default());
        assert_eq!(c.health.unhealthy_after, 2);
        assert!(c.admin.listen.ip().is_loopback() && c.admin.token.is_none());
    }

    /// A HuggingFace tokenizer's engine flags read as written, and as vLLM's defaults when
    /// left out.
    #[test]
    fn an_hf_tokenizer_takes_the_engines_template_flags() {
        let yaml = "models:\n  - name: m\n    tokenizer: {hf: t.json, chat_template_content_format: openai, exclude_tools_when_tool_choice_none: true}\n  - name: n\n    tokenizer: {hf: t.json}\nendpoints: [{url: 'http://127.0.0.1:8001'}]\n";
        let c = RouterConfig::from_yaml(yaml).unwrap();
        let flags = |i: usize| match &c.models[i].tokenizer {
            TokenizerConfig::Hf(hf) => (
                hf.chat_template_content_format,
                hf.exclude_tools_when_tool_choice_none,
            ),
            other => panic!("{other:?}"),
        };
        assert_eq!(flags(0), (ContentFormatConfig::Openai, true));
        assert_eq!(flags(1), (ContentFormatConfig::Auto, false));
    }

    /// A misspelled tokenizer setting or kind is refused by name: an engine flag the router
    /// did not read would key every chat it changes as the engine never renders it.
    #[test]
    fn a_misspelled_tokenizer_setting_is_refused_by_name() {
        let config = |tokenizer: &str| {
            RouterConfig::from_yaml(&format!(
                "models:\n  - name: m\n    tokenizer: {tokenizer}\nendpoints: [{{url: 'http://127.0.0.1:8001'}}]\n"
            ))
        };
        let e = config("{hf: t.json, exclude_tools: true}")
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown field `exclude_tools`"), "{e}");
        let e = config("remot").unwrap_err().to_string();
        assert!(e.contains("unknown variant `remot`"), "{e}");
        assert_eq!(
            config("remote").unwrap().models[0].tokenizer,
            TokenizerConfig::Kind(TokenizerKind::Remote)
        );
    }

    #[test]
    fn an_endpoint_declares_its_shared_mount_in_config_or_by_pod_label() {
        let yaml = "models: [{name: m}]\nendpoints:\n  - {url: 'http://127.0.0.1:8001', offload: {block_size: 64, shared_mount: lustre, shared_media: [STORAGE]}}\n  - {url: 'http://127.0.0.1:8002', labels: {kvroute.io/shared-kv-mount: lustre}}\n  - {url: 'http://127.0.0.1:8003'}\n";
        let c = RouterConfig::from_yaml(yaml).unwrap();
        let specs: Vec<OffloadSpec> = c.endpoints.iter().map(|e| e.offload_spec()).collect();
        assert_eq!(specs[0].block_size, Some(64));
        let first = specs[0].shared.as_ref().unwrap();
        assert_eq!(
            (first.name.as_str(), first.media.clone()),
            ("lustre", vec!["STORAGE".to_owned()])
        );
        let second = specs[1].shared.as_ref().unwrap();
        assert_eq!(second, &SharedMount::new("lustre"));
        assert!(specs[2].shared.is_none());
        let bad = format!("{MINIMAL}scheduler: {{tiers: {{cpu_weight: 1.5}}}}\n");
        let err = RouterConfig::from_yaml(&bad).unwrap_err().to_string();
        assert!(err.contains("scheduler.tiers.cpu_weight"), "{err}");
    }

    #[test]
    fn the_tier_load_mode_follows_the_engines_connector() {
        use kvroute_core::tiers::TierLoadMode;
        let c = RouterConfig::from_yaml(MINIMAL).unwrap();
        assert_eq!(c.scheduler.profile().tiers.load_mode, TierLoadMode::Async);
        let lmcache = format!("{MINIMAL}scheduler: {{tiers: {{load_mode: in_step}}}}\n");
        let c = RouterConfig::from_yaml(&lmcache).unwrap();
        assert_eq!(c.scheduler.profile().tiers.load_mode, TierLoadMode::InStep);
        let bad = format!("{MINIMAL}scheduler: {{tiers: {{load_mode: sometimes}}}}\n");
        let err = RouterConfig::from_yaml(&bad).unwrap_err().to_string();
        assert!(err.contains("load_mode"), "{err}");
    }

    #[test]
    fn a_public_admin_listener_needs_a_token() {
        let yaml = format!("{MINIMAL}admin: {{listen: '0.0.0.0:9000', token: secret}}\n");
        let c = RouterConfig::from_yaml(&yaml).unwrap();
        assert_eq!(c.admin.token.as_deref(), Some("secret"));
    }

    #[test]
    fn the_annotated_example_parses() {
        let text = include_str!("../../../examples/kvroute.yaml");
        let c = RouterConfig::from_yaml(text).unwrap();
        assert!(c.endpoints.len() >= 2);
    }

    #[test]
    fn ipv6_hosts_are_urls_with_or_without_a_port() {
        let yaml =
            "models: [{name: m}]\nendpoints: [{url: 'http://[::1]'}, {url: 'http://[::1]:8001'}]";
        let c = RouterConfig::from_yaml(yaml).unwrap();
        assert_eq!(c.endpoints.len(), 2);
    }

    #[test]
    fn bad_configs_name_the_field() {
        let cases = [
            ("models: []\nendpoints: [{url: 'http://a:1'}]", "models"),
            (
                "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\noutlier: {max_inflight: 0}",
                "outlier",
            ),
            (
                "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\noutlier: {max_ejected_fraction: 2}",
                "outlier.max_ejected_fraction",
            ),
            (
                "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\nretry: {window_s: 0}",
                "retry",
            ),
            (
                "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\nreplicas: {kubernetes: {selector: {'app,x': r}, admin_port: 9000}}",
                "replicas.kubernetes.selector",
            ),
            (
                "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\nreplicas: {kubernetes: {selector: {app: r}, admin_port: 0}}",
                "replicas.kubernetes.admin_port",
            ),
            (
                "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\nreplicas: {kubernetes: {selector: {app: r}, admin_port: 9000, api_server: 'not a url'}}",
                "replicas.kubernetes.api_server",
            ),
            (
                "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\nshutdown: {drain_timeout_s: -1}",
                "shutdown.drain_timeout_s",
            ),
            (
                "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\nlimits: {connect_timeout_ms: 0}",
                "limits.connect_timeout_ms",
            ),
            (
                "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\nhealth: {timeout_ms: 0}",
                "health.timeout_ms",
            ),
            (
                "models: [{name: base, lora_adapters: [other]}, {name: other}]\nendpoints: [{url: 'http://a:1'}]",
                "models[0].lora_adapters[0]",
            ),
            (
                "models: [{name: a, lora_adapters: [sql]}, {name: b, lora_adapters: [sql]}]\nendpoints: [{url: 'http://a:1'}]",
                "models[1].lora_adapters[0]",
            ),
            (
                "models: [{name: m}]\ndiscovery: {selector: {'app,x': r}, target_ports: [8000]}",
                "discovery.selector",
            ),
            (
                "models: [{name: m}]\ndiscovery: {inference_pool: p, selector: {app: x}}",
                "discovery.inference_pool",
            ),
            (
                "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\nkv_events: {max_message_bytes: 1000}",
                "kv_events.max_message_bytes",
            ),
            (
                "models: [{name: m}]\nendpoints: [{url: 'ftp://a:1'}]",
                "endpoints[0].url",
            ),
            (
                "models: [{name: m}]\nendpoints: [{url: 'http://a:1', events: 'a:5557'}]",
                "endpoints[0].events",
            ),
            (
                "models: [{name: m}]\nendpoints: [{url: 'http://a:1', models: [x]}]",
                "endpoints[0].models",
            ),
            (
                "models: [{name: m}]\nendpoints: [{url: 'http://user:pw@a:1'}]",
                "must not carry credentials",
            ),
            (
                "models: [{name: m}]\nendpoints: [{url: 'http://a:99999'}]",
                "endpoints[0].url",
            ),
            (
                "models: [{name: m}]\nendpoints: [{url: 'http://a:1', events: 'tcp://'}]",
                "endpoints[0].events",
            ),
            (
                "models: [{name: m}]\nendpoints: [{url: 'http://a:1', events: 'tcp://a:1', replay: 'tcp://*:2'}]",
                "endpoints[0].replay",
            ),
            (
                "models: [{name: m}]\nendpoints: [{url: 'http://a:1', name: ' '}]",
                "endpoints[0].name",
            ),
            (
                "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}, {url: 'http://a:1/'}]",
                "endpoints[1]: \"http://a:1/\" is another endpoint's host and port (a:1)",
            ),
            (
                "models: [{name: m}]\nendpoints: [{url: 'http://A:1'}, {url: 'http://a:1/v1'}]",
                "is another endpoint's host and port",
            ),
            (
                "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}, {url: 'http://b:1', name: 'a:1'}]",
                "endpoints[1]: \"a:1\" is another endpoint's name",
            ),
            (
                "models: [{name: m}]\nendpoints: [{url: 'http://a:1', events: 'tcp://a:5'}, {url: 'http://b:1', events: 'tcp://a:5'}]",
                "another endpoint's events address",
            ),
            (
                "models: [{name: m}]\nendpoints: [{url: 'http://a:1', name: x}, {url: 'http://b:1', name: x}]",
                "another endpoint's name",
            ),
            (
                "models: [{name: m}, {name: m}]\nendpoints: [{url: 'http://a:1'}]",
                "models[1].name",
            ),
            (
                "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\nscheduler: {saturation: {queue: 0}}",
                "scheduler.saturation.queue",
            ),
            (
                "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\nscheduler: {saturation: {kv_usage: .nan}}",
                "scheduler.saturation.kv_usage",
            ),
            (
                "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\nscheduler: {filters: {max_waiting: -1}}",
                "scheduler.filters.max_waiting",
            ),
            (
                "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\nscheduler: {filters: {max_kv_usage: -0.5}}",
                "scheduler.filters.max_kv_usage",
            ),
            (
                "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\ncache: {index_shards: 100000000}",
                "cache.index_shards",
            ),
            (
                "models: [{name: m}]\nendpoints: [{url: 'http://a:1', urll: 3}]",
                "unknown field `urll`",
            ),
            (
                "models: [{name: m, block_size: 0}]\nendpoints: [{url: 'http://a:1'}]",
                "models[0].block_size",
            ),
            (
                "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\nscheduler: {policy: fastest}",
                "unknown variant `fastest`",
            ),
            (
                "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\nscheduler: {weights: {load: -1}}",
                "scheduler.weights.load",
            ),
            (
                "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\nlisten: nowhere",
                "listen",
            ),
            (
                "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\nadmin: {listen: '0.0.0.0:9000'}",
                "admin.listen",
            ),
            (
                "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\nreplicas: {peers: ['a:1']}",
                "replicas.peers[0]",
            ),
            (
                "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\nlimits: {header_timeout_ms: 0}",
                "limits.header_timeout_ms",
            ),
            (
                "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\nlimits: {max_buffered_bytes: 10}",
                "limits.max_buffered_bytes",
            ),
            (
                "models: [{name: m}]\ndiscovery: {inference_pool: p, pool_recheck_s: 0.000001}",
                "discovery.pool_recheck_s",
            ),
            (
                "models: [{name: m}]\nendpoints: [{url: 'http://a:1'}]\nshutdown: {drain_timeout_s: 1e20}",
                "shutdown.drain_timeout_s",
            ),
        ];
        for (yaml, want) in cases {
            let e = RouterConfig::from_yaml(yaml).unwrap_err().to_string();
            assert!(e.contains(want), "{yaml}\n=> {e}");
        }
    }

    #[test]
    fn names_are_checked_as_the_router_gives_them() {
        // An unnamed endpoint is known by its URL's host and port as written, case and all.
        let unnamed = "{url: 'http://Host-A:8000'}";
        let config =
            |other: &str| format!("models: [{{name: m}}]\nendpoints: [{unnamed}, {other}]");
        let running = RouterConfig::from_yaml(&config("{url: 'http://b:1'}")).unwrap();
        let given = crate::endpoint::Endpoint::new(
            kvroute_core::index::EndpointId(0),
            running.endpoints[0].clone(),
        );
        assert_eq!(given.name, "Host-A:8000");
        // Another endpoint named so would share its metrics and its answers.
        let clash = config("{url: 'http://b:1', name: 'Host-A:8000'}");
        let err = RouterConfig::from_yaml(&clash).unwrap_err().to_string();
        assert!(
            err.contains("endpoints[1]: \"Host-A:8000\" is another endpoint's name"),
            "{err}"
        );
        // Names are compared as written: one that differs in case is another name.
        let distinct = config("{url: 'http://b:1', name: 'host-a:8000'}");
        RouterConfig::from_yaml(&distinct).unwrap();
        // Host names are not: the same host in other case is the same engine.
        let same_engine = config("{url: 'http://host-a:8000'}");
        let err = RouterConfig::from_yaml(&same_engine)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("is another endpoint's host and port (host-a:8000)"),
            "{err}"
        );
    }
}
