//! The NixlConnector's transfer metrics, in vLLM's names: a consumer's transfer time and bytes
//! per pull (histograms), failed transfers; a producer's holds in force and expired unpulled.

use std::fmt::Write;

/// `vllm:nixl_xfer_time_seconds` buckets.
const TIME_BUCKETS: [f64; 14] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
/// `vllm:nixl_bytes_transferred` buckets (1 MiB to 16 GiB).
const BYTE_BUCKETS: [f64; 8] = [
    1_048_576.0,
    16_777_216.0,
    134_217_728.0,
    536_870_912.0,
    1_073_741_824.0,
    2_147_483_648.0,
    4_294_967_296.0,
    17_179_869_184.0,
];

#[derive(Debug, Default)]
struct Histogram {
    buckets: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn observe(&mut self, bounds: &[f64], value: f64) {
        self.buckets.resize(bounds.len(), 0);
        for (bucket, le) in self.buckets.iter_mut().zip(bounds) {
            if value <= *le {
                *bucket += 1;
            }
        }
        self.sum += value;
        self.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str, labels: &str, bounds: &[f64]) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (i, le) in bounds.iter().enumerate() {
            let count = self.buckets.get(i).copied().unwrap_or(0);
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{le:?}\"}} {count}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_count{{{labels}}} {}", self.count);
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", self.sum);
    }
}

/// What one engine observed of KV transfers.
#[derive(Debug, Default)]
pub struct NixlMetrics {
    xfer_time: Histogram,
    bytes: Histogram,
    failed_transfers: u64,
    pulled_tokens: u64,
}

impl NixlMetrics {
    /// A finished pull: engine seconds and bytes.
    pub fn transferred(&mut self, seconds: f64, bytes: u64, tokens: u64) {
        self.xfer_time.observe(&TIME_BUCKETS, seconds);
        self.bytes.observe(&BYTE_BUCKETS, bytes as f64);
        self.pulled_tokens += tokens;
    }

    /// A pull that failed.
    pub fn failed(&mut self) {
        self.failed_transfers += 1;
    }

    /// Pulls that failed, since start.
    pub fn failed_transfers(&self) -> u64 {
        self.failed_transfers
    }

    /// Appends the exposition; `held` and `expired` come from the engine's lease table.
    pub fn render(&self, out: &mut String, labels: &str, held: usize, expired: u64) {
        self.xfer_time.render(
            out,
            "vllm:nixl_xfer_time_seconds",
            "Histogram of transfer duration for NIXL KV Cache transfers.",
            labels,
            &TIME_BUCKETS,
        );
        self.bytes.render(
            out,
            "vllm:nixl_bytes_transferred",
            "Histogram of bytes transferred per NIXL KV Cache transfers.",
            labels,
            &BYTE_BUCKETS,
        );
        let mut counter = |name: &str, help: &str, value: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name}{{{labels}}} {value}"
            );
        };
        counter(
            "vllm:nixl_num_failed_transfers_total",
            "Number of failed NIXL KV Cache transfers.",
            self.failed_transfers,
        );
        counter(
            "vllm:nixl_num_kv_expired_reqs_total",
            "Number of requests whose held KV blocks expired before a consumer read them.",
            expired,
        );
        counter(
            "kvroute_sim_kv_pulled_tokens_total",
            "Prompt tokens a consumer pulled from producers (simulator only).",
            self.pulled_tokens,
        );
        let _ = writeln!(
            out,
            "# HELP kvroute_sim_kv_holds Finished prefill legs whose blocks are held for a consumer (simulator only).\n# TYPE kvroute_sim_kv_holds gauge\nkvroute_sim_kv_holds{{{labels}}} {held}"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_vllm_names_with_cumulative_buckets() {
        let mut m = NixlMetrics::default();
        m.transferred(0.02, 2 << 20, 16);
        m.transferred(3.0, 1 << 30, 8192);
        m.failed();
        let mut out = String::new();
        m.render(&mut out, "engine=\"0\"", 2, 1);
        assert!(
            out.contains("vllm:nixl_xfer_time_seconds_bucket{engine=\"0\",le=\"0.025\"} 1\n"),
            "{out}"
        );
        assert!(out.contains("vllm:nixl_xfer_time_seconds_count{engine=\"0\"} 2\n"));
        assert!(
            out.contains("vllm:nixl_bytes_transferred_sum{engine=\"0\"} 1075838976\n"),
            "{out}"
        );
        assert!(out.contains("vllm:nixl_num_failed_transfers_total{engine=\"0\"} 1\n"));
        assert!(out.contains("vllm:nixl_num_kv_expired_reqs_total{engine=\"0\"} 1\n"));
        assert!(out.contains("kvroute_sim_kv_holds{engine=\"0\"} 2\n"));
    }
}
