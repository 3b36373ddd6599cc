//! The router's state and its one question to core: given a prepared request, what is the
//! plan. Every decision (which endpoint, what it is predicted to hold, whether to hold the
//! request) is made by `kvroute-core`'s [`Fleet`]; this file tokenizes, asks, and feeds the
//! fleet what it observes, with the router's clock.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kvroute_core::fleet::{
    AttemptFailure, Dispatch, EndpointSpec, Fleet, HeldTurn, HoldTicket, Plan, RequestFeatures,
    RetryVerdict, UpstreamOutcome,
};
use kvroute_core::index::{EndpointId, EndpointIndexStats};
use kvroute_core::schedule::EndpointLoad;
use parking_lot::MutexGuard;
use tokio::time::Instant;
use tracing::warn;

use crate::RouterError;
use crate::config::{EndpointConfig, ModelConfig, RouterConfig};
use crate::endpoint::Endpoint;
use crate::fleet_handle::FleetHandle;
use crate::metrics::{PresentNames, RouterMetrics};
use crate::offload::Offload;
use crate::registry::Registry;
use crate::shutdown::Shutdown;
use crate::tokenize::{ModelTokenizer, TokenCache};
use crate::upstream::Upstream;

/// Everything the router shares between requests and background tasks.
pub struct Router {
    config: RouterConfig,
    /// Every endpoint by id.
    registry: Registry,
    /// Core's fleet, the clock and the capacity notification.
    fleet: FleetHandle,
    tokens: TokenCache,
    tokenizers: std::collections::HashMap<String, ModelTokenizer>,
    client: Client<HttpConnector, Full<Bytes>>,
    upstream: Arc<Upstream>,
    metrics: RouterMetrics,
    /// The names of the present endpoints, which gate per-endpoint series.
    present_names: PresentNames,
    shutdown: Shutdown,
    replica: crate::replica_state::ReplicaState,
    offload: Offload,
}

/// What core needs to know of an endpoint: its models (and adapters), role, events and the
/// block size its KV events are read with.
fn spec_of(config: &RouterConfig, endpoint: &Endpoint) -> EndpointSpec {
    let e = &endpoint.config;
    let models: Vec<&ModelConfig> = config
        .models
        .iter()
        .filter(|m| e.models.is_empty() || e.models.contains(&m.name))
        .collect();
    let block_size = models.first().map_or(16, |m| m.block_size);
    if models.iter().any(|m| m.block_size != block_size) {
        warn!(endpoint = %e.url, block_size, "models of different block sizes on one endpoint: its KV events are read with the first model's");
    }
    EndpointSpec {
        name: endpoint.name.clone(),
        models: models
            .iter()
            .flat_map(|m| std::iter::once(&m.name).chain(&m.lora_adapters).cloned())
            .collect(),
        role: e.role,
        has_events: e.events.is_some(),
        block_size,
        offload: e.offload_spec(),
    }
}

impl Router {
    /// Builds the router's state (no tasks started).
    pub fn new(config: RouterConfig) -> Result<Self, RouterError> {
        config.validate()?;
        let mut specs = Vec::with_capacity(config.endpoints.len());
        let mut endpoints = Vec::with_capacity(config.endpoints.len());
        for (i, e) in config.endpoints.iter().enumerate() {
            let endpoint = Endpoint::new(EndpointId(i as u32), e.clone());
            specs.push(spec_of(&config, &endpoint));
            endpoints.push(Arc::new(endpoint));
        }
        let mut fleet = Fleet::new(config.fleet_config(), config.scheduler.profile(), specs)
            .map_err(|e| RouterError::Config(e.to_string()))?;
        if config.pd.orchestrates() {
            fleet.enable_disagg(config.pd.disagg_config()?);
        }
        // Core's randomness, seeded once per router (replicas must not draw in lockstep).
        fleet.reseed(rand::random());
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(Duration::from_millis(
            config.limits.connect_timeout_ms,
        )));
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(connector);
        let metrics = RouterMetrics::new(&config.metrics);
        let present_names = PresentNames::new(
            config.metrics.per_endpoint,
            endpoints.iter().map(|e| e.name.as_str()),
        );
        let tokenizers = config
            .models
            .iter()
            .map(|m| Ok((m.name.clone(), ModelTokenizer::load(&m.tokenizer)?)))
            .collect::<Result<_, RouterError>>()?;
        Ok(Self {
            tokenizers,
            fleet: FleetHandle::new(fleet),
            tokens: TokenCache::with_limits(&config.limits),
            registry: Registry::new(endpoints),
            client,
            upstream: Arc::new(Upstream::new(Duration::from_millis(
                config.limits.connect_timeout_ms,
            ))),
            offload: Offload::new(
                config.limits.offload_above_bytes,
                config.limits.offload_threads,
                config.limits.offload_queue,
                metrics.offload_requests.clone(),
            ),
            metrics,
            present_names,
            shutdown: Shutdown::default(),
            replica: crate::replica_state::ReplicaState::new(&config.replicas),
            config,
        })
    }

    /// The configuration in force.
    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    /// Every endpoint, in id order (removed ones included until their slot is reused: check
    /// the fleet's `present`).
    pub fn endpoints(&self) -> Vec<Arc<Endpoint>> {
        self.registry.all()
    }

    /// One endpoint (ids come from the fleet, which never names one the router lacks).
    pub fn endpoint(&self, id: EndpointId) -> Arc<Endpoint> {
        self.registry.get(id)
    }

    /// Registers an endpoint while running: the fleet plans with it from now on, under the
    /// id returned in it (its tasks are membership's to start).
    pub(crate) fn register(&self, config: EndpointConfig) -> Result<Arc<Endpoint>, RouterError> {
        let names: Vec<&str> = self.config.models.iter().map(|m| m.name.as_str()).collect();
        config.validate("endpoint", &names)?;
        let now = self.now();
        // Locks in the order used everywhere (fleet, then endpoints), both held until the
        // router knows the id the fleet may already plan with.
        let mut fleet = self.fleet.lock();
        let provisional = Endpoint::new(EndpointId(0), config.clone());
        // As configuration validation refuses them at start: a present endpoint that is the
        // same engine (host and port, or KV-event address) or has the same name, the gravest
        // clash named, with the endpoint it clashes with.
        if let Some((clash, other)) = self
            .registry
            .all()
            .iter()
            .filter(|e| self.is_current(&fleet, e))
            .filter_map(|e| {
                provisional
                    .clash_with(e)
                    .map(|clash| (clash, e.name.clone()))
            })
            .min_by_key(|(clash, _)| *clash)
        {
            let why = provisional
                .config
                .clash_reason(&provisional.authority, clash);
            return Err(RouterError::Config(format!(
                "endpoint {:?}: {why} (endpoint {other:?})",
                provisional.name
            )));
        }
        let id = fleet
            .add_endpoint(spec_of(&self.config, &provisional), now)
            .map_err(|e| RouterError::Config(e.to_string()))?;
        let endpoint = Arc::new(Endpoint::new(id, config));
        self.registry.put(endpoint.clone());
        self.present_names.joined(&endpoint.name);
        drop(fleet);
        Ok(endpoint)
    }

    /// Whether `endpoint` is the present endpoint in its slot: neither removed nor replaced by
    /// a newcomer that took its id. `fleet` is the fleet's lock, held: registration and
    /// removal change the fleet and the registry under it, so the answer holds while it is.
    pub(crate) fn is_current(&self, fleet: &Fleet, endpoint: &Endpoint) -> bool {
        fleet.endpoint(endpoint.id).is_some_and(|s| s.present())
            && self
                .registry
                .find(endpoint.id)
                .is_some_and(|e| std::ptr::eq(Arc::as_ptr(&e), endpoint))
    }

    /// Deregisters an endpoint while running: the fleet forgets it and never plans it again.
    /// Returns it when it was present (its tasks are membership's to stop).
    pub(crate) fn deregister(&self, id: EndpointId) -> Option<Arc<Endpoint>> {
        let endpoint = self.registry.find(id)?;
        // A batch of its events being applied finishes first; any later one finds it gone.
        let _ingest = endpoint.ingest.lock();
        let now = self.now();
        if !self.fleet().remove_endpoint(id, now) {
            return None;
        }
        self.forget_journal(id);
        Some(endpoint.clone())
    }

    /// Drops what the replica journal keeps for `id` (its blocks and event sequence), so that a
    /// peer's snapshot never carries a gone or restarted engine's state.
    fn forget_journal(&self, id: EndpointId) {
        if let Some(mut journal) = self.replica().journal() {
            journal.clear(id);
        }
    }

    /// Stops every endpoint's background tasks (the router is shutting down).
    pub fn stop_endpoints(&self) {
        self.registry.stop_all();
    }

    /// The fleet's decision state, locked (hold it briefly: every request plans through it).
    pub fn fleet(&self) -> MutexGuard<'_, Fleet> {
        self.fleet.lock()
    }

    /// Whether the router serves (liveness): some endpoint is healthy and it is not draining.
    pub fn live(&self) -> bool {
        !self.shutdown.draining() && self.fleet().endpoints().iter().any(|e| e.healthy())
    }

    /// Whether `id` passes its health checks.
    pub fn healthy(&self, id: EndpointId) -> bool {
        self.fleet().endpoint(id).is_some_and(|e| e.healthy())
    }

    /// Whether `id` passes its health checks and is not ejected by outlier detection.
    pub fn available(&self, id: EndpointId) -> bool {
        let now = self.now();
        self.fleet()
            .endpoint(id)
            .is_some_and(|e| e.healthy() && !e.ejected(now))
    }

    /// What the KV index holds for `id`.
    pub fn index_stats(&self, id: EndpointId) -> Option<EndpointIndexStats> {
        let index = self.fleet().index_of(id).cloned();
        index.and_then(|i| i.endpoint_stats(id))
    }

    /// `id`'s load as the scheduler sees it now (in-flight counts included).
    pub fn load(&self, id: EndpointId) -> EndpointLoad {
        let now = self.now();
        self.fleet().load(id, now).unwrap_or_default()
    }

    /// The router's phase: serving, draining or closing.
    pub fn shutdown(&self) -> &Shutdown {
        &self.shutdown
    }

    /// Its state as one of several replicas (warm-up, the journal peers' snapshots come from).
    pub fn replica(&self) -> &crate::replica_state::ReplicaState {
        &self.replica
    }

    /// The router's metrics.
    pub fn metrics(&self) -> &RouterMetrics {
        &self.metrics
    }

    /// Writes series keyed by the endpoint names `names` with `write`, unless one of them is
    /// borne by no present endpoint: a departed endpoint's series, removed when it left, must
    /// not come back when a request still in flight there ends (`write` must not call this).
    pub(crate) fn with_endpoint_series(&self, names: &[&str], write: impl FnOnce()) {
        self.present_names.while_present(names, write);
    }

    /// An endpoint bearing `name` left the fleet: the name's series are removed when no present
    /// endpoint bears it any more.
    pub(crate) fn endpoint_series_left(&self, name: &str) {
        self.present_names
            .left(name, || self.metrics.forget_endpoint(name));
    }

    /// The HTTP client for health checks, scrapes and other small requests.
    pub fn client(&self) -> &Client<HttpConnector, Full<Bytes>> {
        &self.client
    }

    /// Connections for proxied requests.
    pub fn upstream(&self) -> &Arc<Upstream> {
        &self.upstream
    }

    /// The bounded pool large requests are prepared on.
    pub fn offload(&self) -> &Offload {
        &self.offload
    }

    /// Tokenization results, cached.
    pub fn token_cache(&self) -> &TokenCache {
        &self.tokens
    }

    /// Seconds since start: the clock every fleet observation is stamped with.
    pub fn now(&self) -> f64 {
        self.fleet.now()
    }

    /// Forgets what `id` holds (restart, ejection), saying why in the log.
    pub fn forget_endpoint(&self, id: EndpointId, why: &str) {
        warn!(endpoint = %self.endpoint(id).name, why, "forgetting everything known of this endpoint's cache");
        // A batch of its events found current before this is applied first (it holds the
        // ingest lock from its check to its last block), so nothing from before lands after.
        let endpoint = self.registry.find(id);
        let _ingest = endpoint.as_ref().map(|e| e.ingest.lock());
        let now = self.now();
        self.fleet().forget_endpoint(id, now);
        self.forget_journal(id);
    }

    /// Wakes held requests: capacity may have freed up.
    pub fn capacity_changed(&self) {
        self.fleet.capacity_changed();
    }

    /// Resolves when capacity may have freed up (create before checking, then await).
    pub fn capacity_notified(&self) -> tokio::sync::futures::Notified<'_> {
        self.fleet.capacity_notified()
    }

    /// The model a request names (`None`: it names none, which a router serving one model
    /// resolves to that model, as vLLM serves a request without `model`), with the LoRA adapter
    /// it names, if any.
    pub fn requested_model(&self, name: Option<&str>) -> Option<(ModelConfig, Option<String>)> {
        match name {
            Some(name) => self.model(name),
            None => match self.config.models.as_slice() {
                [only] => Some((only.clone(), None)),
                _ => None,
            },
        }
    }

    /// The model (and adapter) named `name`, if served.
    pub fn model(&self, name: &str) -> Option<(ModelConfig, Option<String>)> {
        self.config.models.iter().find_map(|m| {
            if m.name == name {
                Some((m.clone(), None))
            } else if m.lora_adapters.iter().any(|a| a == name) {
                Some((m.clone(), Some(name.to_owned())))
            } else {
                None
            }
        })
    }

    /// The tokenizer of model `name` (the built-in one when none is configured).
    pub(crate) fn tokenizer(&self, name: &str) -> ModelTokenizer {
        self.tokenizers
            .get(name)
            .cloned()
            .unwrap_or(ModelTokenizer::Builtin)
    }

    /// Plans a prepared request (its `features`) with every endpoint ranked and broken down
    /// (the explain API; a gateway's subset that none of [`Router::plan`]'s ranking is in).
    pub fn plan_every(&self, features: &RequestFeatures<'_>) -> Plan {
        self.fleet.plan_every(features)
    }

    /// Plans a prepared request (its `features`): every endpoint costed by core, the best
    /// ranked.
    pub fn plan(&self, features: &RequestFeatures<'_>) -> Plan {
        let started = Instant::now();
        let plan = self.fleet.plan(features);
        self.metrics
            .scheduling_seconds
            .observe(started.elapsed().as_secs_f64());
        plan
    }

    /// Tells the fleet how a request sent to `id` went; an ejection is logged and counted.
    pub fn upstream_result(&self, id: EndpointId, outcome: UpstreamOutcome) {
        let now = self.now();
        let ejection = self.fleet().upstream_result(id, outcome, now);
        if let Some(ejection) = ejection {
            let name = &self.endpoint(id).name;
            warn!(endpoint = %name, seconds = ejection.seconds, count = ejection.count, "ejecting an endpoint whose requests keep failing");
            self.with_endpoint_series(&[name], || {
                self.metrics.outlier_ejections.of(name).inc();
            });
        }
    }

    /// Whether attempt `attempt` (0-based) of `attempts`, which failed on `id` with `failure`,
    /// is retried on the next endpoint: core decides (eligibility, attempts left, the fleet's
    /// budget); a retry and a spent budget are counted.
    pub fn retry(
        &self,
        id: EndpointId,
        failure: AttemptFailure,
        attempt: usize,
        attempts: usize,
    ) -> bool {
        let now = self.now();
        let verdict = self.fleet().retry_verdict(failure, attempt, attempts, now);
        let counter = match verdict {
            RetryVerdict::Retry => &self.metrics.retries,
            RetryVerdict::BudgetSpent => &self.metrics.retry_budget_exhausted,
            RetryVerdict::NotRetryable | RetryVerdict::LastAttempt => return false,
        };
        let reason = crate::metrics::ReasonLabel {
            reason: failure.as_str(),
        };
        let name = &self.endpoint(id).name;
        self.with_endpoint_series(&[name], || {
            counter.get_or_create(name, reason).inc();
        });
        verdict == RetryVerdict::Retry
    }

    /// Polls a held request (see [`Fleet::poll_held`]); the planning it does is timed.
    pub fn poll_held(&self, features: &RequestFeatures<'_>, ticket: HoldTicket) -> HeldTurn {
        let started = Instant::now();
        let turn = self.fleet.poll_held(features, ticket);
        if !matches!(turn, HeldTurn::Queued) {
            self.metrics
                .scheduling_seconds
                .observe(started.elapsed().as_secs_f64());
        }
        turn
    }

    /// Records that a request (its `features`) went to `endpoint` with its plan's
    /// `predicted_cached`: call once the connection to the engine is made.
    pub fn dispatched(
        &self,
        predicted_cached: &[usize],
        features: &RequestFeatures<'_>,
        endpoint: EndpointId,
    ) -> Dispatch {
        self.fleet.dispatched(predicted_cached, features, endpoint)
    }
}
