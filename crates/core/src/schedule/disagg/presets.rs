//! The named links and model shapes P/D is priced with, shared by the simulator's link model
//! and the router's configuration, so that `--kv-link ib-400` and `pd: {link: ib-400}` mean the
//! same link.
//!
//! Bytes per token come from the model's shape (2 for K and V × layers × KV heads × head
//! dimension × 2 bytes in bf16): Llama-3.1-8B 128 KiB, Llama-3.1-70B 320 KiB. Bandwidths are
//! nixlbench measurements from llm-d's networking report (`pd-tiers-anchors.md` §2): 100G TCP
//! through UCX 0.55 GB/s, 100G RoCE 12.1 GB/s, 400G InfiniBand 49.5 GB/s. The per-transfer
//! latency (the notification round trip before data moves) is an assumption, not a
//! measurement: 1 ms over TCP, 50 µs over RDMA.

use super::LinkPrior;
use crate::CoreError;

/// KV-cache bytes per token of a model preset (`llama-3.1-8b`, `llama-3.1-70b`), or a number.
pub fn kv_bytes_per_token(preset: &str) -> Result<u64, CoreError> {
    match preset.trim().to_ascii_lowercase().as_str() {
        "llama-3.1-8b" | "8b" => Ok(2 * 32 * 8 * 128 * 2),
        "llama-3.1-70b" | "70b" => Ok(2 * 80 * 8 * 128 * 2),
        other => other
            .parse::<u64>()
            .ok()
            .filter(|b| *b > 0)
            .ok_or_else(|| {
                CoreError::InvalidPreset(format!(
                    "unknown KV shape {preset:?}: expected llama-3.1-8b, llama-3.1-70b or bytes per token"
                ))
            }),
    }
}

impl LinkPrior {
    /// A preset (`tcp`, `roce-100`, `ib-400`) or `custom:<GB/s>[:<latency ms>]`.
    pub fn parse(spec: &str) -> Result<Self, CoreError> {
        let bad = || {
            CoreError::InvalidPreset(format!(
                "unknown link {spec:?}: expected tcp, roce-100, ib-400 or custom:<GB/s>[:<latency ms>]"
            ))
        };
        let preset = |gbps: f64, latency_s: f64| LinkPrior {
            bandwidth_bytes_per_s: gbps * 1e9,
            latency_s,
        };
        match spec.trim() {
            "tcp" => Ok(preset(0.55, 1e-3)),
            "roce-100" => Ok(preset(12.1, 50e-6)),
            "ib-400" => Ok(preset(49.5, 50e-6)),
            custom => {
                let mut parts = custom.strip_prefix("custom:").ok_or_else(bad)?.split(':');
                let gbps: f64 = parts.next().and_then(|p| p.parse().ok()).ok_or_else(bad)?;
                let latency_ms: f64 = match parts.next() {
                    Some(p) => p.parse().map_err(|_| bad())?,
                    None => 0.0,
                };
                if !(gbps > 0.0 && gbps.is_finite() && latency_ms >= 0.0 && latency_ms.is_finite())
                    || parts.next().is_some()
                {
                    return Err(bad());
                }
                Ok(preset(gbps, latency_ms * 1e-3))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_parse_and_nonsense_is_refused() {
        assert_eq!(kv_bytes_per_token("llama-3.1-8b").unwrap(), 131_072);
        assert_eq!(kv_bytes_per_token("70b").unwrap(), 327_680);
        assert_eq!(kv_bytes_per_token("4096").unwrap(), 4096);
        assert!(kv_bytes_per_token("0").is_err());
        assert!(kv_bytes_per_token("llama").is_err());
        let ib = LinkPrior::parse("ib-400").unwrap();
        assert_eq!(ib.bandwidth_bytes_per_s, 49.5e9);
        let custom = LinkPrior::parse("custom:2:3").unwrap();
        assert_eq!(
            (custom.bandwidth_bytes_per_s, custom.latency_s),
            (2e9, 3e-3)
        );
        for bad in [
            "",
            "custom:",
            "custom:-1",
            "custom:1:x",
            "custom:1:2:3",
            "custom:inf",
            "eth",
        ] {
            assert!(LinkPrior::parse(bad).is_err(), "{bad}");
        }
    }
}
