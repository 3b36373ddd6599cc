//! The router's picture of each endpoint: health, scraped and in-flight load, and whether its
//! KV index can be trusted right now.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvroute_core::event::EventBatch;
use kvroute_core::index::{EndpointId, SharedIndex};
use kvroute_core::schedule::{EndpointLoad, Role};
use kvroute_vllm::metrics::EngineLoadSample;
use kvroute_vllm::subscriber::{EventSink, SubscriberHandle};
use parking_lot::Mutex;
use serde::Serialize;
use tracing::warn;

use crate::config::{CacheConfig, EndpointConfig};

/// Health-check state.
#[derive(Debug, Clone, Serialize)]
pub struct Health {
    /// Passing.
    pub healthy: bool,
    /// Consecutive failures.
    pub failures: u32,
    /// Consecutive successes.
    pub successes: u32,
    /// Last failure, for the explain API.
    pub last_error: Option<String>,
}

/// Why an endpoint's index is not trusted now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Distrust {
    /// It has no events configured.
    NoEvents,
    /// Requests went there but no event arrived for too long.
    Silent,
    /// Events were lost for good recently.
    LostEvents,
    /// Predicted and reported cached tokens disagree.
    PredictionError,
}

#[derive(Debug, Default)]
struct Trust {
    last_event: Option<Instant>,
    /// First request dispatched since the last event (silence is measured from it).
    unanswered_since: Option<Instant>,
    last_unfilled_gap: Option<Instant>,
    /// Exponentially weighted mean of |predicted − reported| / prompt tokens.
    error_ewma: f64,
    samples: u32,
    warned: Option<Distrust>,
}

/// One endpoint, as the router tracks it.
pub struct Endpoint {
    /// Index id.
    pub id: EndpointId,
    /// Name for logs, metrics and the response header.
    pub name: String,
    /// Its configuration.
    pub config: EndpointConfig,
    /// `scheme://authority` of its HTTP API.
    pub authority: http::uri::Authority,
    /// Models (and adapters) it serves.
    pub models: Vec<String>,
    /// Health-check state.
    pub health: Mutex<Health>,
    /// Last scrape and when it happened.
    pub scraped: Mutex<Option<(EngineLoadSample, Instant)>>,
    /// Requests in flight through the router.
    pub inflight: AtomicU32,
    /// Of those, still waiting for a first byte.
    pub inflight_prefills: AtomicU32,
    /// Uncached prompt tokens of those.
    pub inflight_prefill_tokens: AtomicU64,
    /// Observed prefill speed, tokens/s (EWMA; 0 until observed).
    pub prefill_rate: Mutex<f64>,
    /// Placements made recently: requests sent here for a reason other than what it holds (new
    /// conversations, uncached prompts), a count decaying with a 60 s time constant, and when it
    /// was last updated. Spreading these evenly spreads sessions evenly.
    recent: Mutex<(f64, Instant)>,
    trust: Mutex<Trust>,
    /// The KV-event subscriber, when events are configured.
    pub subscriber: Mutex<Option<SubscriberHandle>>,
}

impl Endpoint {
    /// A new endpoint, healthy until checks say otherwise.
    pub fn new(id: EndpointId, config: EndpointConfig, models: Vec<String>) -> Self {
        let uri: http::Uri = config.url.parse().expect("validated");
        let authority = uri.authority().expect("validated").clone();
        let name = config.name.clone().unwrap_or_else(|| authority.to_string());
        Self {
            id,
            name,
            config,
            authority,
            models,
            health: Mutex::new(Health {
                healthy: true,
                failures: 0,
                successes: 0,
                last_error: None,
            }),
            scraped: Mutex::new(None),
            inflight: AtomicU32::new(0),
            inflight_prefills: AtomicU32::new(0),
            inflight_prefill_tokens: AtomicU64::new(0),
            prefill_rate: Mutex::new(0.0),
            recent: Mutex::new((0.0, Instant::now())),
            trust: Mutex::new(Trust::default()),
            subscriber: Mutex::new(None),
        }
    }

    /// Passing health checks.
    pub fn healthy(&self) -> bool {
        self.health.lock().healthy
    }

    /// The role.
    pub fn role(&self) -> Role {
        self.config.role
    }

    /// Load for scoring: the last scrape (if fresh enough) plus the router's own counters.
    pub fn load(&self, max_age: Duration) -> EndpointLoad {
        let scraped = self
            .scraped
            .lock()
            .clone()
            .filter(|(_, at)| at.elapsed() <= max_age);
        let sample = scraped.map(|(s, _)| s).unwrap_or_default();
        EndpointLoad {
            waiting: sample.waiting,
            running: sample.running,
            kv_usage: sample.kv_usage,
            inflight: self.inflight.load(Ordering::Relaxed),
            inflight_prefills: self.inflight_prefills.load(Ordering::Relaxed),
            inflight_prefill_tokens: self.inflight_prefill_tokens.load(Ordering::Relaxed),
            recent_requests: self.recent_requests(),
        }
    }

    /// Time constant of the recent-placements count, seconds.
    const RECENT_TAU_S: f64 = 60.0;

    /// Placements made recently (decayed to now).
    pub fn recent_requests(&self) -> f64 {
        let (count, at) = *self.recent.lock();
        count * (-at.elapsed().as_secs_f64() / Self::RECENT_TAU_S).exp()
    }

    /// Whether its index may be used now, or why not.
    pub fn index_trust(&self, cache: &CacheConfig) -> Result<(), Distrust> {
        if self.config.events.is_none() {
            return Err(Distrust::NoEvents);
        }
        let mut trust = self.trust.lock();
        let verdict = if trust
            .last_unfilled_gap
            .is_some_and(|t| t.elapsed().as_secs_f64() < cache.distrust_after_gap_s)
        {
            Err(Distrust::LostEvents)
        } else if trust
            .unanswered_since
            .is_some_and(|t| t.elapsed().as_secs_f64() > cache.silent_after_s)
        {
            Err(Distrust::Silent)
        } else if trust.samples >= 5 && trust.error_ewma > cache.max_prediction_error {
            Err(Distrust::PredictionError)
        } else {
            Ok(())
        };
        match (verdict, trust.warned) {
            (Err(why), None) => {
                warn!(endpoint = %self.name, reason = ?why, "not trusting this endpoint's KV events: routing it by load only until it recovers");
                trust.warned = Some(why);
            }
            (Ok(()), Some(_)) => {
                warn!(endpoint = %self.name, "KV events trusted again");
                trust.warned = None;
            }
            _ => {}
        }
        verdict
    }

    /// A request was sent (`placement`: for a reason other than its cache): silence is
    /// measured from the first unanswered one.
    pub fn note_dispatch(&self, placement: bool) {
        if placement {
            let mut recent = self.recent.lock();
            let decayed = recent.0 * (-recent.1.elapsed().as_secs_f64() / Self::RECENT_TAU_S).exp();
            *recent = (decayed + 1.0, Instant::now());
        }
        let mut trust = self.trust.lock();
        if trust.unanswered_since.is_none() {
            trust.unanswered_since = Some(Instant::now());
        }
    }

    /// An engine reported `reported` cached tokens where the router predicted `predicted`.
    pub fn note_prediction(&self, predicted: usize, reported: usize, prompt: usize) {
        let error = predicted.abs_diff(reported) as f64 / prompt.max(1) as f64;
        let mut trust = self.trust.lock();
        trust.error_ewma = if trust.samples == 0 {
            error
        } else {
            0.8 * trust.error_ewma + 0.2 * error
        };
        trust.samples = trust.samples.saturating_add(1);
    }

    /// Seconds since the last KV event.
    pub fn events_age(&self) -> Option<f64> {
        self.trust
            .lock()
            .last_event
            .map(|t| t.elapsed().as_secs_f64())
    }

    /// Observes a prefill: `tokens` uncached tokens took `seconds` to the first byte.
    pub fn note_prefill(&self, tokens: u64, seconds: f64) {
        if tokens < 256 || seconds <= 0.0 {
            return; // too small to say anything about the prefill rate
        }
        let rate = tokens as f64 / seconds;
        let mut r = self.prefill_rate.lock();
        *r = if *r == 0.0 {
            rate
        } else {
            0.9 * *r + 0.1 * rate
        };
    }
}

/// Feeds the index and tells each endpoint when events arrive or are lost.
pub struct TrackingSink {
    /// The shared index.
    pub index: Arc<SharedIndex>,
    /// Every endpoint, indexed by id.
    pub endpoints: Vec<Arc<Endpoint>>,
}

impl EventSink for TrackingSink {
    fn apply(&self, endpoint: EndpointId, _seq: u64, batch: &EventBatch) {
        self.index.apply(endpoint, &batch.events);
        if let Some(e) = self.endpoints.get(endpoint.0 as usize) {
            let mut trust = e.trust.lock();
            trust.last_event = Some(Instant::now());
            trust.unanswered_since = None;
        }
    }

    fn purge(&self, endpoint: EndpointId) {
        self.index.clear_endpoint(endpoint);
    }

    fn unfilled_gap(&self, endpoint: EndpointId, _from: u64, _to: u64) {
        if let Some(e) = self.endpoints.get(endpoint.0 as usize) {
            e.trust.lock().last_unfilled_gap = Some(Instant::now());
        }
    }
}
