//! The configuration's validation: what serde cannot check, each error naming the field at
//! fault.

use kvroute_core::schedule::Picker;

use super::replicas::{check_api_server, check_selector};
use super::{MAX_SECONDS, RouterConfig, invalid};
use crate::RouterError;

/// The most index shards accepted: one writer each, so more than a large machine's cores gain
/// nothing, and each is allocated up front.
const MAX_INDEX_SHARDS: usize = 1024;

/// The smallest `kv_events.max_message_bytes` accepted: below it, ordinary batches would be refused.
const MIN_KV_EVENT_MESSAGE_BYTES: usize = 64 << 10;

/// The largest `kv_events.max_message_bytes` accepted (each subscriber may queue four).
const MAX_KV_EVENT_MESSAGE_BYTES: usize = 1 << 30;

impl RouterConfig {
    /// Checks what serde cannot.
    pub fn validate(&self) -> Result<(), RouterError> {
        if self.models.is_empty() {
            return Err(invalid("models", "at least one model is required"));
        }
        self.validate_kubernetes()?;
        if self.endpoints.is_empty() && self.discovery.is_none() {
            return Err(invalid(
                "endpoints",
                "at least one endpoint is required (or discovery)",
            ));
        }
        let names = self.validate_models()?;
        for (i, e) in self.endpoints.iter().enumerate() {
            e.validate(&format!("endpoints[{i}]"), &names)?;
        }
        self.validate_endpoints_distinct()?;
        self.validate_scheduler()?;
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
        self.validate_outlier_and_retry()?;
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
    /// Checks the Kubernetes sections: the replicas' peer discovery and endpoint discovery.
    fn validate_kubernetes(&self) -> Result<(), RouterError> {
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
        Ok(())
    }

    /// Checks the served models and their adapters' names; returns the models' names.
    fn validate_models(&self) -> Result<Vec<&str>, RouterError> {
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
        Ok(names)
    }

    /// Checks the scheduler section.
    fn validate_scheduler(&self) -> Result<(), RouterError> {
        let s = &self.scheduler;
        if !(s.prefill_tokens_per_s.is_finite() && s.prefill_tokens_per_s > 0.0) {
            return Err(invalid(
                "scheduler.prefill_tokens_per_s",
                "must be positive",
            ));
        }
        if s.prefill_chunk_tokens == 0 {
            return Err(invalid(
                "scheduler.prefill_chunk_tokens",
                "must be at least 1",
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
        Ok(())
    }

    /// Checks passive outlier detection and retries.
    fn validate_outlier_and_retry(&self) -> Result<(), RouterError> {
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
        Ok(())
    }

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
