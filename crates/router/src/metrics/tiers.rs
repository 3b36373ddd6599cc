//! The router's metrics about cache tiers below the GPU: predicted against found cached tokens
//! by tier, what the engines say they loaded from each tier, the load rates the cost model
//! uses, the offloaded-tier events the index could not place, and the fleet-wide shared tier.
//!
//! Every series mirrors state the fleet keeps (counts since the endpoint joined), refreshed
//! when `/metrics` is rendered ([`TierMetrics::refresh`]): nothing to count on the request
//! path, and an endpoint that left drops out at the next refresh. With per-endpoint series off
//! the `endpoint` label is dropped: counts are summed, rates averaged over the endpoints.

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use tokio::time::Instant;

use kvroute_core::fleet::Fleet;
use kvroute_core::index::EndpointId;
use kvroute_core::tiers::LoadTier;
use parking_lot::Mutex;
use prometheus_client::encoding::{EncodeLabel, EncodeLabelSet, LabelSetEncoder};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tracing::warn;

use super::{Hooks, MetricGroup, MetricsConfig};

type Counts = Family<TierSeries, Gauge>;
type Rates = Family<TierSeries, Gauge<f64, AtomicU64>>;

/// A tier series' labels: the endpoint's (absent with per-endpoint series off), then the
/// tier's (absent for a series about the endpoint's whole tier picture).
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct TierSeries {
    endpoint: Option<String>,
    tier: Option<&'static str>,
}

impl EncodeLabelSet for TierSeries {
    fn encode(&self, encoder: &mut LabelSetEncoder) -> Result<(), std::fmt::Error> {
        if let Some(endpoint) = &self.endpoint {
            ("endpoint", endpoint.as_str()).encode(encoder.encode_label())?;
        }
        if let Some(tier) = self.tier {
            ("tier", tier).encode(encoder.encode_label())?;
        }
        Ok(())
    }
}

/// A shared mount's series: its name.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MountSeries {
    /// The mount's name (`endpoints[].offload.shared_mount`).
    mount: String,
}

/// How often, at most, one endpoint's uncertain tier predictions are warned about.
const WARN_EVERY: Duration = Duration::from_secs(60);

/// The tier series (registered under the router's `kvroute_` prefix).
pub struct TierMetrics {
    per_endpoint: bool,
    /// Tokens predicted cached on each tier below the GPU, over requests whose engine reported
    /// its cached tokens, by endpoint and tier.
    predicted_tokens: Counts,
    /// Of those, tokens the engines' reported `cached_tokens` confirmed, by endpoint and tier.
    found_tokens: Counts,
    /// Tokens the engines' own per-tier counters say they loaded, by endpoint and tier.
    engine_loaded_tokens: Counts,
    /// The load rate the cost model uses (learned, weighed against the configured one by its
    /// samples; configured until learned), tokens/s, by endpoint and tier.
    load_tokens_per_s: Rates,
    /// Samples the load rates were learned from (requests, and windows of the engines' load
    /// counters), by endpoint and tier.
    load_rate_samples: Counts,
    /// Offloaded-tier blocks the index could not place (orphans), by endpoint.
    orphan_blocks: Counts,
    /// Repeated offloaded-tier stores, reference-counted, by endpoint.
    repeat_blocks: Counts,
    /// 1 while an endpoint's tier picture is uncertain (recent orphans), by endpoint.
    uncertain: Counts,
    /// Requests dispatched on an uncertain tier prediction, by endpoint.
    uncertain_requests: Counts,
    /// Blocks on the fleet-wide shared tier, over every mount.
    shared_blocks: Gauge,
    /// Tokens of the shared-tier loads this router dispatched whose first token has not come,
    /// by mount (what the cost model charges a new shared load as queued ahead, at most).
    shared_unfinished_tokens: Family<MountSeries, Gauge>,
    /// When each endpoint's uncertain predictions were last warned about (the last minute's).
    warned: Mutex<HashMap<String, Instant>>,
}

impl TierMetrics {
    /// The tier series; with `config.per_endpoint`, an `endpoint` label.
    pub fn new(config: &MetricsConfig) -> Self {
        Self {
            per_endpoint: config.per_endpoint,
            predicted_tokens: Family::default(),
            found_tokens: Family::default(),
            engine_loaded_tokens: Family::default(),
            load_tokens_per_s: Family::default(),
            load_rate_samples: Family::default(),
            orphan_blocks: Family::default(),
            repeat_blocks: Family::default(),
            uncertain: Family::default(),
            uncertain_requests: Family::default(),
            shared_blocks: Gauge::default(),
            shared_unfinished_tokens: Family::default(),
            warned: Mutex::default(),
        }
    }

    /// Mirrors the fleet's tier state; `names`: each endpoint's name by id.
    pub fn refresh(&self, fleet: &Fleet, names: &dyn Fn(EndpointId) -> String) {
        for family in [
            &self.predicted_tokens,
            &self.found_tokens,
            &self.engine_loaded_tokens,
            &self.load_rate_samples,
            &self.orphan_blocks,
            &self.repeat_blocks,
            &self.uncertain,
            &self.uncertain_requests,
        ] {
            family.clear();
        }
        self.load_tokens_per_s.clear();
        let mut rates: HashMap<TierSeries, (f64, u32)> = HashMap::new();
        let configured = &fleet.profile().tiers;
        let mut shared_blocks = None;
        for e in fleet.endpoints().iter().filter(|e| e.present()) {
            let name = names(e.id);
            let rates_here = e.tier_rates();
            for tier in LoadTier::ALL {
                let t = tier as usize;
                let labels = self.labels(&name, Some(tier));
                for (family, value) in [
                    (&self.predicted_tokens, rates_here.predicted_tokens[t]),
                    (&self.found_tokens, rates_here.found_tokens[t]),
                    (
                        &self.engine_loaded_tokens,
                        rates_here.engine_loaded_tokens[t],
                    ),
                    (&self.load_rate_samples, u64::from(rates_here.samples[t])),
                ] {
                    family.get_or_create(&labels).inc_by(saturate(value));
                }
                let rate = rates.entry(labels).or_default();
                rate.0 += rates_here.rate(tier, configured);
                rate.1 += 1;
            }
            let labels = self.labels(&name, None);
            self.uncertain_requests
                .get_or_create(&labels)
                .inc_by(saturate(rates_here.uncertain_requests));
            let Some(index) = fleet.index_of(e.id) else {
                continue;
            };
            shared_blocks.get_or_insert_with(|| index.shared_tier_stats().blocks);
            if let Some(stats) = index.endpoint_stats(e.id) {
                self.orphan_blocks
                    .get_or_create(&labels)
                    .inc_by(saturate(stats.offload_orphans));
                self.repeat_blocks
                    .get_or_create(&labels)
                    .inc_by(saturate(stats.offload_repeats));
            }
            let uncertain = index.read_endpoint(e.id, |ix| ix.tier_uncertain(e.id));
            self.uncertain
                .get_or_create(&labels)
                .inc_by(i64::from(uncertain));
        }
        for (labels, (sum, n)) in rates {
            self.load_tokens_per_s
                .get_or_create(&labels)
                .set(sum / f64::from(n.max(1)));
        }
        self.shared_blocks.set(saturate(shared_blocks.unwrap_or(0)));
        for (mount, tokens) in fleet.shared_backlog().unfinished() {
            self.shared_unfinished_tokens
                .get_or_create(&MountSeries {
                    mount: mount.to_owned(),
                })
                .set(tokens.round() as i64);
        }
    }

    /// A request was dispatched to `endpoint` on an uncertain tier prediction: warned about,
    /// at most once a minute per endpoint (the count is in `tier_uncertain_requests`).
    pub fn warn_uncertain(&self, endpoint: &str, request_id: &str) {
        let now = Instant::now();
        let mut warned = self.warned.lock();
        if warned
            .get(endpoint)
            .is_some_and(|at| now.duration_since(*at) < WARN_EVERY)
        {
            return;
        }
        // Only the last minute's warnings are kept: endpoints that come and go leave none.
        warned.retain(|_, at| now.duration_since(*at) < WARN_EVERY);
        warned.insert(endpoint.to_owned(), now);
        drop(warned);
        warn!(
            endpoint,
            request_id,
            "routed on an uncertain tier prediction: the endpoint's offloaded-tier events were recently inconsistent (orphans), so its CPU/storage/shared blocks are an estimate"
        );
    }

    fn labels(&self, endpoint: &str, tier: Option<LoadTier>) -> TierSeries {
        TierSeries {
            endpoint: self.per_endpoint.then(|| endpoint.to_owned()),
            tier: tier.map(LoadTier::as_str),
        }
    }
}

/// Series mirrored from the fleet at each rendering ([`TierMetrics::refresh`]): a departed
/// endpoint drops out at the next one, so there is nothing to forget.
impl Hooks for TierMetrics {}

impl MetricGroup for TierMetrics {
    fn register(&self, registry: &mut Registry) {
        let counts: [(&str, &str, &Counts); 8] = [
            (
                "tier_predicted_cached_tokens",
                "Cached tokens predicted on each tier below the GPU (requests whose engine reported)",
                &self.predicted_tokens,
            ),
            (
                "tier_found_cached_tokens",
                "Of the predicted tier tokens, those the engine's reported cached_tokens confirmed",
                &self.found_tokens,
            ),
            (
                "tier_engine_loaded_tokens",
                "Tokens the engine's own per-tier metrics say it loaded from each tier",
                &self.engine_loaded_tokens,
            ),
            (
                "tier_load_rate_samples",
                "Samples each tier's load rate was learned from (requests, and windows of the engines' load counters)",
                &self.load_rate_samples,
            ),
            (
                "tier_orphan_blocks",
                "Offloaded-tier blocks whose events the index could not place (never guessed)",
                &self.orphan_blocks,
            ),
            (
                "tier_repeat_blocks",
                "Repeated offloaded-tier stores, reference-counted",
                &self.repeat_blocks,
            ),
            (
                "tier_uncertain",
                "1 while the endpoint's tier picture is uncertain (recent orphan events)",
                &self.uncertain,
            ),
            (
                "tier_uncertain_requests",
                "Requests dispatched on a tier prediction whose events were inconsistent",
                &self.uncertain_requests,
            ),
        ];
        for (name, help, family) in counts {
            registry.register(name, help, family.clone());
        }
        registry.register(
            "tier_load_tokens_per_second",
            "Load rate of each tier the cost model uses (learned, weighed against the configured one by its samples; configured until learned)",
            self.load_tokens_per_s.clone(),
        );
        registry.register(
            "shared_tier_blocks",
            "Blocks on the fleet-wide shared tier, over every mount",
            self.shared_blocks.clone(),
        );
        registry.register(
            "shared_tier_unfinished_tokens",
            "Tokens of shared-tier loads dispatched whose first token has not come, by mount",
            self.shared_unfinished_tokens.clone(),
        );
    }
}

/// A count as a gauge's value.
fn saturate(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use kvroute_core::event::{BlockRemoved, BlockStored, EngineHash, KvEvent};
    use kvroute_core::fleet::{EndpointSpec, FleetConfig};
    use kvroute_core::keys::router_keys;
    use kvroute_core::schedule::{Profile, Role};
    use prometheus_client::encoding::text::encode;

    use super::*;

    fn fleet() -> Fleet {
        let spec = |name: &str| EndpointSpec {
            name: name.into(),
            models: vec!["m".into()],
            role: Role::Both,
            has_events: true,
            block_size: 16,
            offload: Default::default(),
        };
        let mut fleet = Fleet::new(
            FleetConfig::default(),
            Profile::default(),
            vec![spec("a"), spec("b")],
        )
        .unwrap();
        // Endpoint a: 4 blocks stored, then offloaded to the CPU and dropped from the GPU;
        // one CPU event names a hash it never saw (an orphan).
        let tokens: Vec<u32> = (0..64).collect();
        let mut events = moved_off_the_gpu(&tokens, "CPU");
        events.push(KvEvent::BlockStored(BlockStored {
            block_hashes: vec![EngineHash(7)],
            medium: Some("CPU".into()),
            ..Default::default()
        }));
        fleet.apply_events(EndpointId(0), &events, 0.0);
        fleet
    }

    /// An engine's events for `tokens` (16-token blocks): stored on its GPU, written to
    /// `medium`, dropped from the GPU.
    fn moved_off_the_gpu(tokens: &[u32], medium: &str) -> Vec<KvEvent> {
        let hashes: Vec<EngineHash> = router_keys(tokens, 16, None)
            .unwrap()
            .iter()
            .map(|k| EngineHash(k.0 ^ 1))
            .collect();
        vec![
            KvEvent::BlockStored(BlockStored {
                block_hashes: hashes.clone(),
                token_ids: tokens.to_vec(),
                block_size: 16,
                ..Default::default()
            }),
            KvEvent::BlockStored(BlockStored {
                block_hashes: hashes.clone(),
                medium: Some(medium.into()),
                ..Default::default()
            }),
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: hashes,
                medium: Some("GPU".into()),
                group_idx: None,
            }),
        ]
    }

    fn render(per_endpoint: bool) -> String {
        let mut registry = Registry::with_prefix("kvroute");
        let m = TierMetrics::new(&MetricsConfig { per_endpoint });
        m.register(&mut registry);
        let names = ["a", "b"];
        m.refresh(&fleet(), &|id| names[id.0 as usize].to_owned());
        let mut out = String::new();
        encode(&mut out, &registry).unwrap();
        out
    }

    #[test]
    fn series_mirror_the_fleets_tier_state_per_endpoint() {
        let text = render(true);
        for line in [
            "kvroute_tier_orphan_blocks{endpoint=\"a\"} 1",
            "kvroute_tier_uncertain{endpoint=\"a\"} 1",
            "kvroute_tier_uncertain{endpoint=\"b\"} 0",
            "kvroute_tier_load_tokens_per_second{endpoint=\"a\",tier=\"cpu\"} 150000.0",
        ] {
            assert!(text.contains(line), "{line} missing:\n{text}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn uncertain_predictions_are_warned_about_once_a_minute_and_forgotten_after() {
        let m = TierMetrics::new(&MetricsConfig::default());
        m.warn_uncertain("a", "r1");
        m.warn_uncertain("a", "r2");
        assert_eq!(m.warned.lock().len(), 1);
        tokio::time::advance(WARN_EVERY).await;
        // An endpoint that left (a) holds nothing once its minute is over.
        m.warn_uncertain("b", "r3");
        assert_eq!(m.warned.lock().keys().collect::<Vec<_>>(), vec!["b"]);
    }

    #[test]
    fn the_shared_tiers_unfinished_loads_are_shown_by_mount() {
        use kvroute_core::fleet::RequestFeatures;
        use kvroute_core::index::{OffloadSpec, SharedMount};
        let spec = EndpointSpec {
            name: "a".into(),
            models: vec!["m".into()],
            role: Role::Both,
            has_events: true,
            block_size: 16,
            offload: OffloadSpec {
                block_size: None,
                shared: Some(SharedMount::new("lustre")),
            },
        };
        let mut fleet = Fleet::new(FleetConfig::default(), Profile::default(), vec![spec]).unwrap();
        // The engine wrote 4 blocks to the filesystem and dropped them from its GPU.
        let tokens: Vec<u32> = (0..64).collect();
        let events = moved_off_the_gpu(&tokens, "FS");
        fleet.apply_events(EndpointId(0), &events, 0.0);
        let mut prompt = tokens;
        prompt.extend(100..116);
        let keys = std::sync::Arc::new(router_keys(&prompt, 16, None).unwrap());
        let request = RequestFeatures {
            model: "m",
            keys: &keys,
            prompt_tokens: prompt.len(),
            block_size: 16,
            session: None,
            role: Role::Both,
        };
        let plan = fleet.plan(&request, 1, 0.0);
        let mut dispatch = fleet.dispatched(&plan.predicted_cached, &request, EndpointId(0), 0.0);
        let shown = |fleet: &Fleet| {
            let mut registry = Registry::with_prefix("kvroute");
            let m = TierMetrics::new(&MetricsConfig::default());
            m.register(&mut registry);
            m.refresh(fleet, &|_| "a".to_owned());
            let mut out = String::new();
            encode(&mut out, &registry).unwrap();
            out
        };
        let text = shown(&fleet);
        assert!(
            text.contains("kvroute_shared_tier_unfinished_tokens{mount=\"lustre\"} 64"),
            "{text}"
        );
        fleet.first_token(&mut dispatch, true, 0.1);
        let text = shown(&fleet);
        assert!(
            text.contains("kvroute_shared_tier_unfinished_tokens{mount=\"lustre\"} 0"),
            "{text}"
        );
    }

    #[test]
    fn without_per_endpoint_series_counts_sum_and_rates_average() {
        let text = render(false);
        assert!(!text.contains("endpoint=\""), "{text}");
        assert!(text.contains("kvroute_tier_uncertain 1\n"), "{text}");
        assert!(
            text.contains("kvroute_tier_load_tokens_per_second{tier=\"storage\"} 40000.0"),
            "{text}"
        );
    }
}
