//! Metric families about endpoints: every series is keyed by [`ByEndpoint`], the endpoint's
//! name (unless per-endpoint series are off) followed by a typed label set. The families
//! remember which series each endpoint created, so that a departed endpoint's are removed.

use std::collections::{HashMap, HashSet};
use std::hash::Hash;
use std::ops::Deref;
use std::sync::atomic::AtomicI64;

use parking_lot::{MappedRwLockReadGuard, RwLock, RwLockReadGuard};
use prometheus_client::encoding::{EncodeLabel, EncodeLabelSet, LabelSetEncoder};
use prometheus_client::metrics::family::{Family, MetricConstructor};
use prometheus_client::metrics::gauge::{Atomic, Gauge};
use prometheus_client::registry::{Metric, Registry};

use super::group::{Exported, Hooks};
use super::labels::NoLabels;

/// The name of the label naming an endpoint.
const ENDPOINT: &str = "endpoint";

/// A series key: the `endpoint` label (absent with per-endpoint series off), then `L`'s labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct ByEndpoint<L> {
    endpoint: Option<String>,
    labels: L,
}

impl<L: EncodeLabelSet> EncodeLabelSet for ByEndpoint<L> {
    fn encode(&self, encoder: &mut LabelSetEncoder) -> Result<(), std::fmt::Error> {
        if let Some(name) = &self.endpoint {
            (ENDPOINT, name.as_str()).encode(encoder.encode_label())?;
        }
        self.labels.encode(encoder)
    }
}

/// A label set that can key an endpoint family.
pub trait EndpointLabels: Clone + Hash + Eq + EncodeLabelSet + Send + Sync + 'static {}

impl<L: Clone + Hash + Eq + EncodeLabelSet + Send + Sync + 'static> EndpointLabels for L {}

/// The series keys created for each endpoint, so that a departed endpoint's series can be
/// removed (a family cannot list its own).
struct SeriesByEndpoint<L>(RwLock<HashMap<String, HashSet<ByEndpoint<L>>>>);

impl<L> Default for SeriesByEndpoint<L> {
    fn default() -> Self {
        Self(RwLock::default())
    }
}

impl<L: EndpointLabels> SeriesByEndpoint<L> {
    /// Notes a new series' key under the endpoint it names.
    fn note(&self, key: &ByEndpoint<L>) {
        if let Some(name) = &key.endpoint {
            self.0
                .write()
                .entry(name.clone())
                .or_default()
                .insert(key.clone());
        }
    }

    /// The keys noted under `endpoint`, forgotten.
    fn take(&self, endpoint: &str) -> HashSet<ByEndpoint<L>> {
        self.0.write().remove(endpoint).unwrap_or_default()
    }
}

/// Counters or histograms by endpoint and `L`; with per-endpoint series off, the endpoint is
/// dropped on the way in, so each series counts over every endpoint.
pub struct EndpointFamily<M, L = NoLabels, C = fn() -> M> {
    family: Family<ByEndpoint<L>, M, C>,
    per_endpoint: bool,
    series: SeriesByEndpoint<L>,
}

impl<M: Default, L: EndpointLabels> EndpointFamily<M, L> {
    /// A family of default-constructed metrics (counters).
    pub fn new(per_endpoint: bool) -> Self {
        Self::with_constructor(M::default, per_endpoint)
    }
}

impl<M, L: EndpointLabels, C: MetricConstructor<M>> EndpointFamily<M, L, C> {
    /// A family whose metrics `constructor` makes (histograms with their buckets).
    pub fn with_constructor(constructor: C, per_endpoint: bool) -> Self {
        Self {
            family: Family::new_with_constructor(constructor),
            per_endpoint,
            series: SeriesByEndpoint::default(),
        }
    }

    /// The series of `endpoint` and `labels`, created if new.
    pub fn get_or_create(&self, endpoint: &str, labels: L) -> impl Deref<Target = M> + '_ {
        let key = ByEndpoint {
            endpoint: self.per_endpoint.then(|| endpoint.to_owned()),
            labels,
        };
        if self.per_endpoint && self.family.get(&key).is_none() {
            self.series.note(&key);
        }
        self.family.get_or_create(&key)
    }
}

impl<M, C: MetricConstructor<M>> EndpointFamily<M, NoLabels, C> {
    /// The series of `endpoint` (the family has no other label), created if new.
    pub fn of(&self, endpoint: &str) -> impl Deref<Target = M> + '_ {
        self.get_or_create(endpoint, NoLabels)
    }
}

impl<M, L, C> Exported for EndpointFamily<M, L, C>
where
    L: EndpointLabels,
    Family<ByEndpoint<L>, M, C>: Metric + Clone,
    C: MetricConstructor<M>,
{
    fn register(&self, registry: &mut Registry, name: &'static str, help: &'static str) {
        registry.register(name, help, self.family.clone());
    }
}

impl<M, L: EndpointLabels, C: MetricConstructor<M>> Hooks for EndpointFamily<M, L, C> {
    fn forget_endpoint(&self, endpoint: &str) {
        for key in self.series.take(endpoint) {
            self.family.remove(&key);
        }
    }
}

/// How a per-endpoint gauge is aggregated over the endpoints.
#[derive(Clone, Copy, Debug)]
pub enum Aggregate {
    /// The sum over the endpoints (healthy endpoints, blocks held, ...).
    Sum,
    /// The largest value (the age of the oldest KV events).
    Max,
}

/// Gauges by endpoint and `L`, set when `/metrics` is rendered. With per-endpoint series off,
/// the values set since the last rendering are kept aside and exported aggregated over the
/// endpoints (the set of endpoints is whatever was set, so an endpoint that left no longer
/// counts).
pub struct EndpointGauges<L = NoLabels, N = i64, A = AtomicI64> {
    family: Family<ByEndpoint<L>, Gauge<N, A>>,
    per_endpoint: bool,
    aggregate: Aggregate,
    /// Per-endpoint values awaiting aggregation (per-endpoint series off).
    pending: RwLock<HashMap<ByEndpoint<L>, Gauge<N, A>>>,
    series: SeriesByEndpoint<L>,
}

impl<L, N, A> EndpointGauges<L, N, A>
where
    L: EndpointLabels,
    N: Copy + Default + PartialOrd + std::ops::Add<Output = N>,
    A: Atomic<N> + Default,
{
    /// Gauges per endpoint, or aggregated by `aggregate` with per-endpoint series off.
    pub fn new(per_endpoint: bool, aggregate: Aggregate) -> Self {
        Self {
            family: Family::default(),
            per_endpoint,
            aggregate,
            pending: RwLock::default(),
            series: SeriesByEndpoint::default(),
        }
    }

    /// The gauge of `endpoint` and `labels`, created if new.
    pub fn get_or_create(
        &self,
        endpoint: &str,
        labels: L,
    ) -> MappedRwLockReadGuard<'_, Gauge<N, A>> {
        let key = ByEndpoint {
            endpoint: Some(endpoint.to_owned()),
            labels,
        };
        if self.per_endpoint {
            if self.family.get(&key).is_none() {
                self.series.note(&key);
            }
            return self.family.get_or_create(&key);
        }
        if let Ok(gauge) = RwLockReadGuard::try_map(self.pending.read(), |m| m.get(&key)) {
            return gauge;
        }
        self.pending.write().entry(key.clone()).or_default();
        RwLockReadGuard::map(self.pending.read(), |m| &m[&key])
    }

    /// Per-endpoint series off: exports the values set since the last call, aggregated over
    /// the endpoints.
    fn export(&self) {
        if self.per_endpoint {
            return;
        }
        let pending = std::mem::take(&mut *self.pending.write());
        if pending.is_empty() {
            // Nothing set since the last rendering (a concurrent scrape took it): the last
            // aggregates stand.
            return;
        }
        let mut totals: HashMap<ByEndpoint<L>, N> = HashMap::new();
        for (key, gauge) in pending {
            let value = gauge.get();
            let key = ByEndpoint {
                endpoint: None,
                labels: key.labels,
            };
            match totals.get_mut(&key) {
                Some(total) => {
                    *total = match self.aggregate {
                        Aggregate::Sum => *total + value,
                        Aggregate::Max if value > *total => value,
                        Aggregate::Max => *total,
                    }
                }
                None => {
                    totals.insert(key, value);
                }
            }
        }
        self.family.clear();
        for (key, total) in totals {
            self.family.get_or_create(&key).set(total);
        }
    }
}

impl<N, A> EndpointGauges<NoLabels, N, A>
where
    N: Copy + Default + PartialOrd + std::ops::Add<Output = N>,
    A: Atomic<N> + Default,
{
    /// The gauge of `endpoint` (the family has no other label), created if new.
    pub fn of(&self, endpoint: &str) -> MappedRwLockReadGuard<'_, Gauge<N, A>> {
        self.get_or_create(endpoint, NoLabels)
    }
}

impl<L, N, A> Exported for EndpointGauges<L, N, A>
where
    L: EndpointLabels,
    N: Copy + Default + PartialOrd + std::ops::Add<Output = N>,
    A: Atomic<N> + Default,
    Family<ByEndpoint<L>, Gauge<N, A>>: Metric + Clone,
{
    fn register(&self, registry: &mut Registry, name: &'static str, help: &'static str) {
        registry.register(name, help, self.family.clone());
    }
}

impl<L, N, A> Hooks for EndpointGauges<L, N, A>
where
    L: EndpointLabels,
    N: Copy + Default + PartialOrd + std::ops::Add<Output = N>,
    A: Atomic<N> + Default,
{
    /// Removes `endpoint`'s series (aggregates forget it at the next rendering by themselves).
    fn forget_endpoint(&self, endpoint: &str) {
        for key in self.series.take(endpoint) {
            self.family.remove(&key);
        }
    }

    fn before_render(&self) {
        self.export();
    }
}
