//! Probes: each endpoint's health checks (the fleet ejects and restores it) and load scrapes
//! (load samples, and the restart verdict from its `/metrics`).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use kvroute_core::fleet::{HealthChange, LoadSample, RestartSignals, RestartWatch};
use kvroute_core::load_counters::TierLoadCounters;
use kvroute_vllm::metrics::parse_engine_metrics;
use tracing::{info, warn};

use crate::ProbeError;
use crate::endpoint::{Endpoint, Probe, ProbeSchedule};
use crate::events::resubscribe;
use crate::metrics::KindLabel;
use crate::service::Router;

/// Largest body accepted from an engine's `/health` or `/metrics`.
const MAX_SCRAPE_BYTES: usize = 16 << 20;

/// Starts `e`'s health checks and load scraping; [`Endpoint::stop`] ends them.
pub(crate) fn spawn(router: &Arc<Router>, e: &Arc<Endpoint>) {
    let mut tasks = e.tasks.lock();
    tasks.push(tokio::spawn(health_loop(router.clone(), e.clone())));
    tasks.push(tokio::spawn(scrape_loop(router.clone(), e.clone())));
}

/// `GET url`, its status and body, within `timeout` for the whole answer (headers and body
/// together: a scrape's sample must not arrive later than its deadline says).
async fn get_text(
    router: &Router,
    url: String,
    timeout: Duration,
) -> Result<(u16, Bytes), ProbeError> {
    let deadline = tokio::time::Instant::now() + timeout;
    let request = http::Request::get(url).body(Full::new(Bytes::new()))?;
    let response = tokio::time::timeout_at(deadline, router.client().request(request))
        .await
        .map_err(|_| ProbeError::Timeout)??;
    let status = response.status().as_u16();
    let body = tokio::time::timeout_at(
        deadline,
        Limited::new(response.into_body(), MAX_SCRAPE_BYTES).collect(),
    )
    .await
    .map_err(|_| ProbeError::BodyTimeout)?
    .map_err(ProbeError::Body)?;
    Ok((status, body.to_bytes()))
}

/// Checks an endpoint's health; the fleet ejects it after consecutive failures (forgetting
/// its cache) and restores it after consecutive passes.
async fn health_loop(router: Arc<Router>, endpoint: Arc<Endpoint>) {
    let cfg = router.config().health.clone();
    let period = Duration::from_millis(cfg.interval_ms);
    let mut tick = ProbeSchedule::new(endpoint.id, Probe::Health, period);
    loop {
        tick.tick().await;
        let result = get_text(
            &router,
            format!("http://{}/health", endpoint.authority),
            Duration::from_millis(cfg.timeout_ms),
        )
        .await;
        let ok = matches!(result, Ok((200, _)));
        if !ok {
            *endpoint.last_health_error.lock() = Some(match result {
                Ok((status, _)) => format!("health check answered {status}"),
                Err(e) => e.to_string(),
            });
        }
        let now = router.now();
        let change = router.fleet().health_check(endpoint.id, ok, now);
        match change {
            Some(HealthChange::Ejected) => {
                warn!(endpoint = %endpoint.name, error = ?endpoint.last_health_error.lock(), "endpoint ejected after failed health checks; its cached blocks are forgotten");
            }
            Some(HealthChange::Restored) => {
                *endpoint.last_health_error.lock() = None;
                info!(endpoint = %endpoint.name, "endpoint healthy again; re-subscribing to its KV events from the start of its replay buffer");
                resubscribe(&router, &endpoint);
                router.capacity_changed();
            }
            None => {}
        }
    }
}

/// Scrapes an endpoint's load into the fleet; a new process start time or a counter that went
/// backwards means the engine restarted, so what it held is forgotten at once.
async fn scrape_loop(router: Arc<Router>, endpoint: Arc<Endpoint>) {
    let interval = Duration::from_millis(router.config().scrape.interval_ms);
    let mut tick = ProbeSchedule::new(endpoint.id, Probe::Scrape, interval);
    let mut warned_block_size = false;
    // What the last scrapes said, to tell a restart by.
    let mut restart_watch = RestartWatch::default();
    let block_size = router
        .fleet()
        .endpoint(endpoint.id)
        .map_or(0, |e| e.spec.block_size);
    let timeout = Duration::from_millis(router.config().scrape.timeout_ms);
    // Whether the last scrape failed, so that a failing engine is reported once, not per scrape.
    let mut failing = false;
    loop {
        tick.tick().await;
        // A sample says how the engine stood when it was asked, not when its answer came: a
        // slow answer is that much older against the load sample's maximum age, which is
        // derived so that an answer within `scrape.timeout_ms` is still young enough to use.
        let sent = router.now();
        // What the router had in flight there as it asked: a request of its own that ends
        // while the answer is on its way is not read as another client's.
        let since = router.fleet().load_mark(endpoint.id, sent);
        let scraped = match get_text(
            &router,
            format!("http://{}/metrics", endpoint.authority),
            timeout,
        )
        .await
        {
            Ok((200, body)) => Ok(body),
            Ok((status, _)) => Err(ProbeError::Status(status)),
            Err(e) => Err(e),
        };
        let body = match scraped {
            Ok(body) => {
                // Slow but in time: used, and shown.
                let took = (router.now() - sent).max(0.0);
                router.metrics().scrape_seconds.of(&endpoint.name).set(took);
                if std::mem::replace(&mut failing, false) {
                    info!(endpoint = %endpoint.name, "the engine's /metrics answer again");
                }
                body
            }
            Err(e) => {
                // The load picture of this endpoint ages; the fleet stops trusting it once it is
                // older than the load sample's maximum age, and plans from the router's own
                // in-flight count meanwhile.
                router
                    .metrics()
                    .scrape_failures
                    .get_or_create(&endpoint.name, KindLabel { kind: e.kind() })
                    .inc();
                if !std::mem::replace(&mut failing, true) {
                    warn!(endpoint = %endpoint.name, error = %e, timeout_ms = timeout.as_millis() as u64, "scraping the engine's /metrics failed: its load is not updated until a scrape succeeds (scrape.timeout_ms)");
                }
                continue;
            }
        };
        let sample = parse_engine_metrics(&String::from_utf8_lossy(&body));
        if let Some(engine_block_size) = sample.block_size
            && engine_block_size != block_size
            && !std::mem::replace(&mut warned_block_size, true)
        {
            warn!(endpoint = %endpoint.name, engine_block_size, configured = block_size, "the engine's block size differs from the configured one: its KV events will not match requests (set models[].block_size)");
        }
        let now = router.now();
        // Restarted since the last scrape (a new process start time, or a counter that went
        // backwards): unless its KV events already said so (and the fleet has relearned from
        // them since), forget what it held now, not at its next event batch.
        let signals = RestartSignals {
            process_start_time: sample.process_start_time,
            prefix_cache_queries: sample.prefix_cache_queries,
        };
        let restarted =
            router
                .fleet()
                .restart_unnoticed(endpoint.id, &mut restart_watch, signals, now);
        if restarted {
            router.forget_endpoint(endpoint.id, "its /metrics say the engine restarted");
            resubscribe(&router, &endpoint);
        }
        let load = LoadSample {
            waiting: sample.waiting,
            running: sample.running,
            kv_usage: sample.kv_usage,
            num_gpu_blocks: sample.num_gpu_blocks,
        };
        let mut fleet = router.fleet();
        fleet.observe_scraped_load(endpoint.id, load, since);
        if sample.tier_loaded_tokens.iter().any(Option::is_some) {
            // What it loaded from each tier, against what was predicted there, and how long
            // its loads took (the tiers' rates under any load).
            let counters = TierLoadCounters {
                tokens: sample.tier_loaded_tokens,
                seconds: sample.tier_load_seconds,
            };
            fleet.observe_engine_tier_loads(endpoint.id, counters, sent);
        }
        drop(fleet);
        router.capacity_changed();
    }
}
