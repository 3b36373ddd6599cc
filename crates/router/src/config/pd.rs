//! The `pd:` section: router-orchestrated prefill/decode disaggregation, off by default.

use kvroute_core::fleet::DisaggConfig;
use kvroute_core::schedule::disagg::{LinkLearning, LinkPrior, kv_bytes_per_token};
use serde::{Deserialize, Serialize};

use super::invalid;
use crate::RouterError;

/// Whether the router splits requests into a prefill leg and a decode leg.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PdMode {
    /// Every request is one leg on one endpoint (endpoint roles only filter who serves it).
    #[default]
    Off,
    /// The router picks a decode endpoint, then core prices aggregated against P/D with each
    /// prefill-capable endpoint and the router runs both legs (vLLM's NixlConnector protocol).
    Orchestrate,
    /// As `orchestrate`, but every request with an eligible prefill endpoint is disaggregated
    /// onto the cheapest one (what vLLM's reference proxy and Dynamo do): a baseline to compare
    /// the cost decision with.
    Always,
}

/// Router-orchestrated P/D (`pd:`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PdConfig {
    /// `off` (default), `orchestrate` (decided by cost) or `always`.
    pub mode: PdMode,
    /// The KV link between prefill and decode engines before anything is learned: `tcp`
    /// (0.55 GB/s), `roce-100` (12.1 GB/s), `ib-400` (49.5 GB/s) or
    /// `custom:<GB/s>[:<latency ms>]`.
    pub link: String,
    /// KV-cache bytes per token of the model: `llama-3.1-8b`, `llama-3.1-70b` or a number.
    #[serde(deserialize_with = "text_or_number")]
    pub kv_bytes_per_token: String,
    /// Seconds the prefill leg may take, connection to answer; past it the request is served
    /// aggregated on the decode endpoint.
    pub prefill_deadline_s: f64,
    /// The fixed cost of a second leg, seconds (the prefill engine's step that samples the
    /// token the router discards, and one more round trip).
    pub leg_overhead_s: f64,
    /// How each (prefill, decode) pair's bandwidth is learned and when it is quarantined.
    pub learning: LinkLearning,
}

impl Default for PdConfig {
    fn default() -> Self {
        Self {
            mode: PdMode::Off,
            link: "tcp".into(),
            kv_bytes_per_token: "llama-3.1-8b".into(),
            prefill_deadline_s: 30.0,
            leg_overhead_s: 0.01,
            learning: LinkLearning::default(),
        }
    }
}

/// A preset name, or a number written without quotes.
fn text_or_number<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum TextOrNumber {
        Text(String),
        Number(u64),
    }
    Ok(match TextOrNumber::deserialize(d)? {
        TextOrNumber::Text(t) => t,
        TextOrNumber::Number(n) => n.to_string(),
    })
}

impl PdConfig {
    /// Whether the router orchestrates P/D (`orchestrate` or `always`).
    pub fn orchestrates(&self) -> bool {
        self.mode != PdMode::Off
    }

    /// Core's P/D pricing for this section, or which field is at fault.
    pub fn disagg_config(&self) -> Result<DisaggConfig, RouterError> {
        let link = LinkPrior::parse(&self.link).map_err(|e| invalid("pd.link", e))?;
        let bytes = kv_bytes_per_token(&self.kv_bytes_per_token)
            .map_err(|e| invalid("pd.kv_bytes_per_token", e))?;
        Ok(DisaggConfig {
            link,
            learning: self.learning,
            kv_bytes_per_token: bytes as f64,
            leg_overhead_s: self.leg_overhead_s,
        })
    }

    /// Checks every field.
    pub fn validate(&self) -> Result<(), RouterError> {
        self.disagg_config()?;
        if !(self.prefill_deadline_s > 0.0 && self.prefill_deadline_s < super::MAX_SECONDS) {
            return Err(invalid(
                "pd.prefill_deadline_s",
                "must be a positive number of seconds",
            ));
        }
        if !(self.leg_overhead_s.is_finite() && self.leg_overhead_s >= 0.0) {
            return Err(invalid(
                "pd.leg_overhead_s",
                "must be finite and not negative",
            ));
        }
        let l = &self.learning;
        if !(l.weight > 0.0 && l.weight <= 1.0) {
            return Err(invalid("pd.learning.weight", "must be in (0, 1]"));
        }
        if !(l.degraded_factor.is_finite() && l.degraded_factor >= 1.0) {
            return Err(invalid("pd.learning.degraded_factor", "must be at least 1"));
        }
        if !(l.noise_floor_s.is_finite() && l.noise_floor_s >= 0.0) {
            return Err(invalid(
                "pd.learning.noise_floor_s",
                "must be finite and not negative",
            ));
        }
        if l.quarantine_after == 0 {
            return Err(invalid(
                "pd.learning.quarantine_after",
                "must be at least 1",
            ));
        }
        if !(l.quarantine_s.is_finite()
            && l.quarantine_s > 0.0
            && l.max_quarantine_s.is_finite()
            && l.max_quarantine_s >= l.quarantine_s)
        {
            return Err(invalid(
                "pd.learning.quarantine_s",
                "must be positive and at most max_quarantine_s (finite)",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_by_default_and_every_bad_field_is_named() {
        let config = PdConfig::default();
        assert!(!config.orchestrates());
        config.validate().unwrap();
        let parsed: PdConfig =
            serde_yaml_ng::from_str("{mode: orchestrate, link: ib-400, kv_bytes_per_token: 70b}")
                .unwrap();
        assert!(parsed.orchestrates());
        assert_eq!(
            parsed.disagg_config().unwrap().kv_bytes_per_token,
            327_680.0
        );
        let number: PdConfig = serde_yaml_ng::from_str("{kv_bytes_per_token: 4096}").unwrap();
        assert_eq!(number.disagg_config().unwrap().kv_bytes_per_token, 4096.0);
        for (yaml, field) in [
            ("{link: ethernet}", "pd.link"),
            ("{kv_bytes_per_token: big}", "pd.kv_bytes_per_token"),
            ("{prefill_deadline_s: 0}", "pd.prefill_deadline_s"),
            ("{prefill_deadline_s: 1e20}", "pd.prefill_deadline_s"),
            ("{leg_overhead_s: -1}", "pd.leg_overhead_s"),
            ("{learning: {weight: 0}}", "pd.learning.weight"),
            (
                "{learning: {noise_floor_s: -0.1}}",
                "pd.learning.noise_floor_s",
            ),
            (
                "{learning: {quarantine_after: 0}}",
                "pd.learning.quarantine_after",
            ),
        ] {
            let config: PdConfig = serde_yaml_ng::from_str(yaml).unwrap();
            let error = config.validate().unwrap_err().to_string();
            assert!(error.contains(field), "{yaml}: {error}");
        }
        assert!(serde_yaml_ng::from_str::<PdConfig>("{mode: sometimes}").is_err());
    }
}
