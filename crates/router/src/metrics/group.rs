//! Declaring metrics once: [`metric_group!`] turns one table (field, type, constructor, name,
//! help) into a struct, its constructor, its registration and its forget/render hooks.
//!
//! A part of the router with metrics of its own (P/D legs, tiers, ...) declares them in its
//! own file with [`metric_group!`] and hooks the group into [`super::RouterMetrics`] with one
//! line of that table, `pd: PdMetrics = PdMetrics::new(config);` (a group's entry has no
//! name and help: its metrics carry their own). The group's metrics then appear on
//! `/metrics`, a departed endpoint's series are removed from them, and per-endpoint gauges are
//! aggregated before each rendering, like the router's own.

use prometheus_client::registry::{Metric, Registry};

/// What happens to an exported metric (or group) besides its registration.
pub trait Hooks {
    /// Removes the series of `endpoint` (it left the fleet). Metrics without an endpoint
    /// label have nothing to do.
    fn forget_endpoint(&self, _endpoint: &str) {}

    /// Called just before `/metrics` is rendered (per-endpoint gauges aggregate then).
    fn before_render(&self) {}
}

/// One metric (or family), registered under a name and a help text.
pub trait Exported: Hooks {
    /// Registers the metric in `registry` as `name`.
    fn register(&self, registry: &mut Registry, name: &'static str, help: &'static str);
}

/// A group of metrics declared with [`metric_group!`], each registered under its own name.
pub trait MetricGroup: Hooks {
    /// Registers every metric of the group in `registry`, in the table's order.
    fn register(&self, registry: &mut Registry);
}

impl<T: Metric + Clone> Hooks for T {}

impl<T: Metric + Clone> Exported for T {
    fn register(&self, registry: &mut Registry, name: &'static str, help: &'static str) {
        registry.register(name, help, self.clone());
    }
}

/// Registers one entry of a [`metric_group!`] table: a metric under its name and help, or a
/// nested group (no name).
#[doc(hidden)]
macro_rules! register_entry {
    ($entry:expr, $registry:expr, $name:literal, $help:literal) => {
        $crate::metrics::Exported::register($entry, $registry, $name, $help)
    };
    ($entry:expr, $registry:expr) => {
        $crate::metrics::MetricGroup::register($entry, $registry)
    };
}

/// Declares a group of metrics once: each entry is `field: Type = constructor, "name",
/// "help";` (a metric) or `field: Type = constructor;` (a nested [`MetricGroup`]), with doc
/// comments. The constructors may read the `MetricsConfig` under the name given in
/// parentheses. Generates the struct (public fields), `new(&MetricsConfig)`, and the
/// [`MetricGroup`] and [`Hooks`] impls; metrics register in the table's order.
///
/// ```ignore
/// metric_group! {
///     /// Metrics of prefill/decode disaggregation.
///     pub struct PdMetrics(config) {
///         /// Prefill legs run, by endpoint.
///         prefills: EndpointFamily<Counter> = EndpointFamily::new(config.per_endpoint),
///             "pd_prefills", "Prefill legs run";
///     }
/// }
/// ```
macro_rules! metric_group {
    (
        $(#[$meta:meta])*
        $vis:vis struct $group:ident($config:ident) {
            $(
                $(#[$field_meta:meta])*
                $field:ident: $ty:ty = $init:expr $(, $name:literal, $help:literal)?;
            )*
        }
    ) => {
        $(#[$meta])*
        $vis struct $group {
            $( $(#[$field_meta])* pub $field: $ty, )*
        }

        impl $group {
            /// Every metric of the group, per endpoint or aggregated as `config` says.
            pub fn new($config: &$crate::metrics::MetricsConfig) -> Self {
                let _ = $config;
                Self { $( $field: $init, )* }
            }
        }

        impl $crate::metrics::Hooks for $group {
            fn forget_endpoint(&self, endpoint: &str) {
                $( $crate::metrics::Hooks::forget_endpoint(&self.$field, endpoint); )*
            }

            fn before_render(&self) {
                $( $crate::metrics::Hooks::before_render(&self.$field); )*
            }
        }

        impl $crate::metrics::MetricGroup for $group {
            fn register(&self, registry: &mut ::prometheus_client::registry::Registry) {
                $( $crate::metrics::register_entry!(&self.$field, registry $(, $name, $help)?); )*
            }
        }
    };
}

pub(crate) use {metric_group, register_entry};
