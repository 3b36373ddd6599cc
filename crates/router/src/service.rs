//! The router's state and its one decision: given a parsed request, which endpoint, and what
//! does it predict will be cached there.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kvroute_core::history::RoutingHistory;
use kvroute_core::index::{EndpointId, IndexConfig, KvIndex, SharedIndex};
use kvroute_core::keys::{RouterKey, request_extra_keys, router_keys};
use kvroute_core::schedule::{
    CacheView, Candidate, Decision, Profile, RequestInfo, Role, schedule,
};
use kvroute_vllm::openai::GenerationRequest;
use parking_lot::Mutex;
use quick_cache::sync::Cache;
use serde::Serialize;

use crate::RouterError;
use crate::config::{ModelConfig, RouterConfig};
use crate::fleet::{Distrust, Endpoint, TrackingSink};
use crate::metrics::RouterMetrics;
use crate::tokenize::{ModelTokenizer, Remote, TokenCache, tokenize};
use crate::upstream::Upstream;

/// Everything the router shares between requests and background tasks.
pub struct Router {
    /// The configuration in force.
    pub config: RouterConfig,
    /// The scheduling profile.
    pub profile: Profile,
    /// Endpoints, indexed by id.
    pub endpoints: Vec<Arc<Endpoint>>,
    /// The KV block index fed by engine events.
    pub index: Arc<SharedIndex>,
    /// Where the router sent which prefixes (approximate mode).
    pub history: Mutex<RoutingHistory>,
    /// Just-sent prefixes, until their events arrive.
    pub predicted: Mutex<RoutingHistory>,
    /// Session → last endpoint.
    pub sessions: Cache<String, EndpointId>,
    /// Tokenization results.
    pub tokens: TokenCache,
    /// Each model's tokenizer, by model name.
    pub tokenizers: std::collections::HashMap<String, ModelTokenizer>,
    /// HTTP client for health checks, scrapes and other small requests.
    pub client: Client<HttpConnector, Full<Bytes>>,
    /// Connections for proxied requests.
    pub upstream: Arc<Upstream>,
    /// The router's metrics.
    pub metrics: RouterMetrics,
    round_robin: AtomicU64,
    started: Instant,
}

/// A request made ready for scheduling.
pub struct Prepared {
    /// The model's configuration.
    pub model: ModelConfig,
    /// LoRA adapter named by the request, if any.
    pub lora: Option<String>,
    /// Prompt tokens, when a tokenizer is configured.
    pub tokens: Option<Arc<Vec<u32>>>,
    /// Router keys of the prompt's full blocks.
    pub keys: Arc<Vec<RouterKey>>,
    /// Prompt length used for scoring (tokens, or an estimate from the body size).
    pub prompt_tokens: usize,
}

/// Per-endpoint facts shown by the explain API besides the scheduler's own breakdown.
#[derive(Debug, Clone, Serialize)]
pub struct EndpointFacts {
    /// Endpoint name.
    pub name: String,
    /// Passing health checks.
    pub healthy: bool,
    /// `null` when its KV index is used, else why not.
    pub index_distrust: Option<Distrust>,
    /// Blocks matched by the index, by tier (before trust is applied).
    pub index_match: Option<kvroute_core::index::PrefixMatch>,
    /// Blocks matched by the router's history.
    pub history_blocks: u32,
    /// Blocks matched by the predicted overlay.
    pub predicted_blocks: u32,
}

/// A scheduling decision with the context it was made in.
pub struct Routed {
    /// The scheduler's decision.
    pub decision: Decision,
    /// Facts per endpoint, in id order.
    pub facts: Vec<EndpointFacts>,
    /// Cached tokens the router expects the chosen endpoint to report (vLLM recomputes the
    /// last prompt token, so at most the full blocks of all tokens but the last).
    pub predicted_cached: Vec<usize>,
}

impl Router {
    /// Builds the router's state (no tasks started).
    pub fn new(config: RouterConfig) -> Result<Self, RouterError> {
        config.validate()?;
        let all_models: Vec<String> = config
            .models
            .iter()
            .flat_map(|m| std::iter::once(m.name.clone()).chain(m.lora_adapters.iter().cloned()))
            .collect();
        let endpoints = config
            .endpoints
            .iter()
            .enumerate()
            .map(|(i, e)| {
                let models = if e.models.is_empty() {
                    all_models.clone()
                } else {
                    config
                        .models
                        .iter()
                        .filter(|m| e.models.contains(&m.name))
                        .flat_map(|m| {
                            std::iter::once(m.name.clone()).chain(m.lora_adapters.iter().cloned())
                        })
                        .collect()
                };
                Arc::new(Endpoint::new(EndpointId(i as u32), e.clone(), models))
            })
            .collect();
        let block_size = config.models[0].block_size;
        let index = KvIndex::new(IndexConfig {
            block_size,
            capacity: config.cache.index_capacity,
        })
        .map_err(|e| RouterError::Config(e.to_string()))?;
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(Duration::from_millis(
            config.limits.connect_timeout_ms,
        )));
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(30))
            .build(connector);
        let tokenizers = config
            .models
            .iter()
            .map(|m| Ok((m.name.clone(), ModelTokenizer::load(&m.tokenizer)?)))
            .collect::<Result<_, RouterError>>()?;
        Ok(Self {
            tokenizers,
            profile: config.scheduler.profile(),
            history: Mutex::new(RoutingHistory::new(
                config.cache.history_ttl_s,
                config.cache.history_capacity,
            )),
            predicted: Mutex::new(RoutingHistory::new(config.cache.predicted_ttl_s, 1 << 20)),
            sessions: Cache::new(100_000),
            tokens: TokenCache::new(4096),
            index: Arc::new(SharedIndex::new(index)),
            endpoints,
            client,
            upstream: Arc::new(Upstream::new(Duration::from_millis(
                config.limits.connect_timeout_ms,
            ))),
            metrics: RouterMetrics::default(),
            round_robin: AtomicU64::new(0),
            started: Instant::now(),
            config,
        })
    }

    /// The event sink the subscribers feed.
    pub fn sink(&self) -> Arc<TrackingSink> {
        Arc::new(TrackingSink {
            index: self.index.clone(),
            endpoints: self.endpoints.clone(),
        })
    }

    /// Seconds since start: the clock of the history structures.
    pub fn now(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    /// The model (and adapter) a request names, if served.
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

    /// Tokenizes and keys a parsed request.
    pub async fn prepare(&self, request: &GenerationRequest, body_len: usize) -> Option<Prepared> {
        let (model, lora) = self.model(&request.model)?;
        let started = Instant::now();
        let remote = self.endpoints.iter().find(|e| e.healthy()).map(|e| Remote {
            client: &self.client,
            base: format!("http://{}", e.authority),
            timeout: Duration::from_secs(2),
        });
        let kind = self
            .tokenizers
            .get(&model.name)
            .cloned()
            .unwrap_or(ModelTokenizer::Builtin);
        let tokens = tokenize(&self.tokens, &kind, &request.model, &request.input, remote).await;
        self.metrics
            .tokenization_seconds
            .observe(started.elapsed().as_secs_f64());
        let (keys, prompt_tokens) = match &tokens {
            Some(t) => {
                let blocks = t.len() / model.block_size;
                let extra =
                    request_extra_keys(blocks, lora.as_deref(), request.cache_salt.as_deref());
                let keys = router_keys(t, model.block_size, Some(&extra)).unwrap_or_default();
                (keys, t.len())
            }
            // No tokens: a rough size for load and cost scoring only.
            None => (Vec::new(), body_len / 4),
        };
        Some(Prepared {
            model,
            lora,
            tokens,
            keys: Arc::new(keys),
            prompt_tokens,
        })
    }

    /// Scores every endpoint for a prepared request.
    pub fn route(&self, prepared: &Prepared, model_name: &str, session: Option<&str>) -> Routed {
        self.route_inner(prepared, model_name, session, false)
    }

    /// Like [`Router::route`], with every fact gathered for the explain API.
    pub fn route_explained(
        &self,
        prepared: &Prepared,
        model_name: &str,
        session: Option<&str>,
    ) -> Routed {
        self.route_inner(prepared, model_name, session, true)
    }

    fn route_inner(
        &self,
        prepared: &Prepared,
        model_name: &str,
        session: Option<&str>,
        explain: bool,
    ) -> Routed {
        let started = Instant::now();
        let now = self.now();
        let bs = prepared.model.block_size;
        let index_matches = self.index.lookup(&prepared.keys);
        // The history only matters when its scorer counts (approximate policies) or someone
        // asks for the explanation; the walk is not free for long prompts.
        let history = if self.profile.weights.approximate_prefix > 0.0 || explain {
            self.history.lock().longest_prefixes(&prepared.keys, now)
        } else {
            Vec::new()
        };
        let predicted = self.predicted.lock().longest_prefixes(&prepared.keys, now);
        let lookup = |list: &[(EndpointId, u32)], id| {
            list.iter().find(|(e, _)| *e == id).map_or(0, |(_, n)| *n)
        };
        // vLLM always recomputes the last prompt token: at most this many blocks are reported.
        let reportable = prepared.prompt_tokens.saturating_sub(1) / bs;
        let scrape_max_age = Duration::from_millis(self.config.scrape.interval_ms * 4 + 1000);
        let session_endpoint = session.and_then(|s| self.sessions.get(s));
        let mut candidates = Vec::with_capacity(self.endpoints.len());
        let mut facts = Vec::with_capacity(self.endpoints.len());
        let mut predicted_cached = Vec::with_capacity(self.endpoints.len());
        for e in &self.endpoints {
            let index_match = index_matches.get(e.id).copied();
            let distrust = e.index_trust(&self.config.cache).err();
            let history_blocks = lookup(&history, e.id);
            let predicted_blocks = lookup(&predicted, e.id);
            let precise = match distrust {
                None => Some(index_match.unwrap_or(kvroute_core::index::PrefixMatch {
                    endpoint: e.id,
                    blocks: 0,
                    gpu_blocks: 0,
                    cpu_blocks: 0,
                    storage_blocks: 0,
                })),
                Some(_) => None,
            };
            let best_blocks = precise.map_or(0, |m| m.blocks).max(predicted_blocks) as usize;
            predicted_cached.push(best_blocks.min(reportable) * bs);
            let rate = match *e.prefill_rate.lock() {
                r if r > 0.0 => r,
                _ => self.config.scheduler.prefill_tokens_per_s,
            };
            candidates.push(Candidate {
                endpoint: e.id,
                healthy: e.healthy(),
                serves_model: e.models.iter().any(|m| m == model_name),
                role: e.role(),
                load: e.load(scrape_max_age),
                cache: CacheView {
                    precise,
                    approximate: history_blocks,
                    predicted: predicted_blocks,
                },
                prefill_tokens_per_s: rate,
            });
            facts.push(EndpointFacts {
                name: e.name.clone(),
                healthy: e.healthy(),
                index_distrust: distrust,
                index_match,
                history_blocks,
                predicted_blocks,
            });
        }
        let info = RequestInfo {
            prompt_tokens: prepared.prompt_tokens,
            block_size: bs,
            session_endpoint,
            role: Role::Both,
        };
        let decision = schedule(
            &self.profile,
            &info,
            &candidates,
            rand::random(),
            self.round_robin.fetch_add(1, Ordering::Relaxed),
        );
        self.metrics
            .scheduling_seconds
            .observe(started.elapsed().as_secs_f64());
        Routed {
            decision,
            facts,
            predicted_cached,
        }
    }

    /// Records that a request's blocks went to `endpoint` (history, overlay, session);
    /// `placement`: it went there for a reason other than what the endpoint holds.
    pub fn record_dispatch(
        &self,
        endpoint: EndpointId,
        keys: &[RouterKey],
        session: Option<&str>,
        placement: bool,
    ) {
        let now = self.now();
        self.history.lock().record(endpoint, keys, now);
        self.predicted.lock().record(endpoint, keys, now);
        if let Some(s) = session {
            self.sessions.insert(s.to_owned(), endpoint);
        }
        if let Some(e) = self.endpoints.get(endpoint.0 as usize) {
            e.note_dispatch(placement);
        }
    }
}
