//! A typed [`RouterConfig`] builder for tests: loopback listeners, one model, engines from
//! simulated fleets, and closures for the knobs a test turns, instead of YAML assembled with
//! `format!`.

use kvroute_core::schedule::Role;
use kvroute_router::config::{
    EndpointConfig, KubeDiscovery, ModelConfig, PdMode, ReplicasConfig, RouterConfig,
    TokenizerConfig,
};
use kvroute_sim::server::{EngineEndpoint, SimFleet};

/// Builds a [`RouterConfig`] for a test; [`ConfigBuilder::build`] validates it as
/// `RouterConfig::from_yaml` would.
pub struct ConfigBuilder {
    config: RouterConfig,
}

impl ConfigBuilder {
    /// Both listeners on ephemeral loopback ports, serving `model` (default tokenizer), no
    /// endpoints yet, every other field at its default.
    pub fn new(model: &str) -> Self {
        let mut config: RouterConfig = serde_yaml_ng::from_str(
            "listen: 127.0.0.1:0\nadmin: {listen: 127.0.0.1:0}\nmodels: []",
        )
        .expect("the base test configuration parses");
        config.models.push(model_named(model));
        Self { config }
    }

    /// Sets the first model's tokenizer.
    pub fn tokenizer(mut self, tokenizer: TokenizerConfig) -> Self {
        self.config.models[0].tokenizer = tokenizer;
        self
    }

    /// Adds a model served with the default tokenizer.
    pub fn model(mut self, name: &str) -> Self {
        self.config.models.push(model_named(name));
        self
    }

    /// Adds one endpoint per fleet (its first engine), named `e0`, `e1`, ... by position among
    /// all endpoints, with the engine's KV events and replay.
    pub fn engines(self, fleets: &[&SimFleet]) -> Self {
        self.engine_endpoints(fleets.iter().map(|fleet| &fleet.endpoints[0]))
    }

    /// Adds an endpoint per engine, named `e0`, `e1`, ... by position among all endpoints,
    /// with the engine's KV events and replay.
    pub fn engine_endpoints<'a>(
        mut self,
        engines: impl IntoIterator<Item = &'a EngineEndpoint>,
    ) -> Self {
        for engine in engines {
            let name = format!("e{}", self.config.endpoints.len());
            self = self.endpoint(engine_endpoint(Some(name), engine));
        }
        self
    }

    /// Adds an unnamed endpoint (named by its URL's host:port) for a fleet's first engine, with
    /// its KV events and replay.
    pub fn unnamed_engine(self, fleet: &SimFleet) -> Self {
        self.endpoint(engine_endpoint(None, &fleet.endpoints[0]))
    }

    /// Adds an unnamed endpoint per fleet (its first engine) with its KV events but no replay.
    pub fn unnamed_events_only(mut self, fleets: &[&SimFleet]) -> Self {
        for fleet in fleets {
            let engine = &fleet.endpoints[0];
            let mut endpoint = endpoint(None, &engine.url);
            endpoint.events = Some(engine.events.clone());
            self = self.endpoint(endpoint);
        }
        self
    }

    /// Adds an endpoint named `name` at `url`, without KV events.
    pub fn url(self, name: &str, url: &str) -> Self {
        self.endpoint(endpoint(Some(name.to_owned()), url))
    }

    /// Adds `endpoint` as given.
    pub fn endpoint(mut self, endpoint: EndpointConfig) -> Self {
        self.config.endpoints.push(endpoint);
        self
    }

    /// Health checks every `interval_ms`, each timing out after `timeout_ms`.
    pub fn health(mut self, interval_ms: u64, timeout_ms: u64) -> Self {
        self.config.health.interval_ms = interval_ms;
        self.config.health.timeout_ms = timeout_ms;
        self
    }

    /// Scrapes engines' `/metrics` every `interval_ms`.
    pub fn scrape(mut self, interval_ms: u64) -> Self {
        self.config.scrape.interval_ms = interval_ms;
        self
    }

    /// The API listener's address (default: an ephemeral loopback port).
    pub fn listen(mut self, addr: std::net::SocketAddr) -> Self {
        self.config.listen = addr;
        self
    }

    /// The admin listener on loopback port `port` (0: ephemeral, the default).
    pub fn admin_port(mut self, port: u16) -> Self {
        self.config.admin.listen = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        self
    }

    /// Runs as a replica with `replicas`.
    pub fn replicas(mut self, replicas: ReplicasConfig) -> Self {
        self.config.replicas = replicas;
        self
    }

    /// Discovers endpoints from the Kubernetes API at `api_server`: the pods of
    /// `inference_pool` in `namespace`, with KV events on `events_port`.
    pub fn discovery(
        mut self,
        api_server: &str,
        namespace: &str,
        inference_pool: &str,
        events_port: u16,
    ) -> Self {
        let mut discovery: KubeDiscovery =
            serde_yaml_ng::from_str("{}").expect("an empty discovery section parses");
        discovery.api_server = Some(api_server.to_owned());
        discovery.namespace = Some(namespace.to_owned());
        discovery.inference_pool = Some(inference_pool.to_owned());
        discovery.events_port = Some(events_port);
        self.config.discovery = Some(discovery);
        self
    }

    /// Changes anything else (scheduler, flow, limits, outlier, retry ...).
    pub fn with(mut self, change: impl FnOnce(&mut RouterConfig)) -> Self {
        change(&mut self.config);
        self
    }

    /// The configuration, validated (panics naming the fault: a test's set-up is wrong).
    pub fn build(self) -> RouterConfig {
        self.config
            .validate()
            .expect("the test configuration is valid");
        self.config
    }
}

/// Makes `config`'s endpoints a P/D fleet that disaggregates every request (`pd.mode:
/// always`): the first endpoint is the prefill one, every other a decoder. For
/// [`ConfigBuilder::with`], or a test's own change of the configuration.
pub fn pd_always(config: &mut RouterConfig) {
    for (i, endpoint) in config.endpoints.iter_mut().enumerate() {
        endpoint.role = if i == 0 { Role::Prefill } else { Role::Decode };
    }
    config.pd.mode = PdMode::Always;
}

/// A model named `name` with every other field at its default.
fn model_named(name: &str) -> ModelConfig {
    serde_yaml_ng::from_str(&format!("name: '{name}'")).expect("a model name parses")
}

/// An endpoint at `url` with every other field at its default.
pub fn endpoint(name: Option<String>, url: &str) -> EndpointConfig {
    let mut endpoint: EndpointConfig =
        serde_yaml_ng::from_str("url: ''").expect("an endpoint URL parses");
    endpoint.name = name;
    endpoint.url = url.to_owned();
    endpoint
}

/// An endpoint for a simulated engine, with its KV events and replay.
fn engine_endpoint(name: Option<String>, engine: &EngineEndpoint) -> EndpointConfig {
    let mut endpoint = endpoint(name, &engine.url);
    endpoint.events = Some(engine.events.clone());
    endpoint.replay = engine.replay.clone();
    endpoint
}
