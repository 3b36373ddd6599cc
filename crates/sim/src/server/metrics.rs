//! `/metrics` in vLLM's names, types and labels (Prometheus text format 0.0.4, as vLLM's
//! `prometheus_client` writes it), so scrapers written for vLLM read the simulator unchanged.

use std::fmt::Write;

use crate::engine::{EngineConfig, EngineMetrics};

/// vLLM's `time_to_first_token_seconds` buckets.
const TTFT_BUCKETS: [f64; 22] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];

/// What the server has observed of one engine.
#[derive(Debug, Default)]
pub struct Observed {
    /// Latest engine gauges and counters.
    pub metrics: EngineMetrics,
    /// When the engine (re)started, seconds since the Unix epoch: `process_start_time_seconds`.
    pub started_at: f64,
    ttft_buckets: [u64; TTFT_BUCKETS.len()],
    ttft_sum: f64,
    ttft_count: u64,
}

impl Observed {
    /// Nothing observed yet, the engine started now.
    pub fn started_now() -> Self {
        Self {
            started_at: super::actor::unix_now(),
            ..Self::default()
        }
    }

    /// Records one time to first token, in engine seconds.
    pub fn observe_ttft(&mut self, seconds: f64) {
        for (bucket, le) in self.ttft_buckets.iter_mut().zip(TTFT_BUCKETS) {
            if seconds <= le {
                *bucket += 1;
            }
        }
        self.ttft_sum += seconds;
        self.ttft_count += 1;
    }
}

/// Renders the exposition for one engine.
pub fn render(observed: &Observed, config: &EngineConfig, model: &str, engine: usize) -> String {
    let m = &observed.metrics;
    let labels = format!("engine=\"{engine}\",model_name=\"{}\"", escape(model));
    let mut out = String::new();
    let mut gauge = |name: &str, help: &str, value: f64| {
        let _ = writeln!(
            out,
            "# HELP vllm:{name} {help}\n# TYPE vllm:{name} gauge\nvllm:{name}{{{labels}}} {value}"
        );
    };
    gauge(
        "num_requests_running",
        "Number of requests in model execution batches.",
        m.num_requests_running as f64,
    );
    gauge(
        "num_requests_waiting",
        "Number of requests waiting to be processed.",
        m.num_requests_waiting as f64,
    );
    gauge(
        "kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        m.kv_cache_usage,
    );
    let mut counter = |name: &str, help: &str, value: u64| {
        let _ = writeln!(
            out,
            "# HELP vllm:{name}_total {help}\n# TYPE vllm:{name}_total counter\nvllm:{name}_total{{{labels}}} {value}"
        );
    };
    counter(
        "prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        m.prefix_cache_queries,
    );
    counter(
        "prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        m.prefix_cache_hits,
    );
    counter(
        "external_prefix_cache_hits",
        "External prefix cache hits from KV connector, in terms of number of cached tokens.",
        m.external_prefix_cache_hits,
    );
    counter(
        "num_preemptions",
        "Cumulative number of preemption from the engine.",
        m.num_preemptions,
    );
    counter(
        "prompt_tokens",
        "Number of prefill tokens processed.",
        m.prompt_tokens,
    );
    counter(
        "generation_tokens",
        "Number of generation tokens processed.",
        m.generation_tokens,
    );

    let _ = writeln!(
        out,
        "# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds."
    );
    let _ = writeln!(out, "# TYPE vllm:time_to_first_token_seconds histogram");
    for (count, le) in observed.ttft_buckets.iter().zip(TTFT_BUCKETS) {
        let _ = writeln!(
            out,
            "vllm:time_to_first_token_seconds_bucket{{{labels},le=\"{le:?}\"}} {count}"
        );
    }
    let _ = writeln!(
        out,
        "vllm:time_to_first_token_seconds_bucket{{{labels},le=\"+Inf\"}} {}",
        observed.ttft_count
    );
    let _ = writeln!(
        out,
        "vllm:time_to_first_token_seconds_count{{{labels}}} {}",
        observed.ttft_count
    );
    let _ = writeln!(
        out,
        "vllm:time_to_first_token_seconds_sum{{{labels}}} {}",
        observed.ttft_sum
    );

    let _ = writeln!(
        out,
        "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.\n# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds {}",
        observed.started_at
    );
    // The simulator's own gauge (vLLM has none like it): distinct blocks in the prefix cache,
    // which a router fed by the KV events holds exactly once they have all arrived.
    let _ = writeln!(
        out,
        "# HELP kvroute_sim_cached_blocks Distinct blocks in the GPU prefix cache (simulator only)."
    );
    let _ = writeln!(out, "# TYPE kvroute_sim_cached_blocks gauge");
    let _ = writeln!(
        out,
        "kvroute_sim_cached_blocks{{{labels}}} {}",
        observed.metrics.cached_blocks
    );
    // Per offload tier (vLLM reports all of them as one `external_prefix_cache_hits`).
    let tiers = [
        ("cpu", m.cpu_blocks, m.cpu_hit_tokens, m.cpu_bytes_loaded),
        ("ssd", m.ssd_blocks, m.ssd_hit_tokens, m.ssd_bytes_loaded),
        (
            "shared_fs",
            m.shared_fs_blocks,
            m.shared_fs_hit_tokens,
            m.shared_fs_bytes_loaded,
        ),
    ];
    let series = [
        (
            "tier_blocks",
            "gauge",
            "Blocks held by each offload tier (simulator only).",
        ),
        (
            "tier_hit_tokens_total",
            "counter",
            "Prompt tokens loaded from each offload tier (simulator only).",
        ),
        (
            "tier_loaded_bytes_total",
            "counter",
            "KV bytes loaded from each offload tier (simulator only).",
        ),
    ];
    for (i, (name, kind, help)) in series.into_iter().enumerate() {
        let _ = writeln!(
            out,
            "# HELP kvroute_sim_{name} {help}\n# TYPE kvroute_sim_{name} {kind}"
        );
        for (tier, blocks, hits, bytes) in tiers {
            let value = [blocks as u64, hits, bytes][i];
            let _ = writeln!(
                out,
                "kvroute_sim_{name}{{{labels},tier=\"{tier}\"}} {value}"
            );
        }
    }
    // vLLM's offloading connector's transfer counters, loads into the GPU by tier (as
    // `transfer_type` names them: the shared filesystem as llm-d's filesystem backend does),
    // exported, as vLLM exports them, only by an engine with a connector (a tier below the GPU).
    let offloads =
        config.num_cpu_blocks > 0 || config.num_ssd_blocks > 0 || config.shared_fs.is_some();
    let transfers = [
        (
            "CPU_to_GPU",
            [m.cpu_bytes_loaded as f64, m.tier_load_seconds[0]],
        ),
        (
            "DISK_to_GPU",
            [m.ssd_bytes_loaded as f64, m.tier_load_seconds[1]],
        ),
        (
            "SHARED_STORAGE_to_GPU",
            [m.shared_fs_bytes_loaded as f64, m.tier_load_seconds[2]],
        ),
    ];
    let counters = [
        (
            "kv_offload_total_bytes",
            "Number of bytes offloaded by KV connector",
        ),
        (
            "kv_offload_total_time",
            "Total time measured by all KV offloading operations",
        ),
    ];
    for (i, (name, help)) in counters.into_iter().enumerate().filter(|_| offloads) {
        let _ = writeln!(out, "# HELP vllm:{name} {help}\n# TYPE vllm:{name} counter");
        for (transfer, values) in transfers {
            let _ = writeln!(
                out,
                "vllm:{name}_total{{{labels},transfer_type=\"{transfer}\"}} {}",
                values[i]
            );
        }
    }
    let _ = writeln!(
        out,
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig"
    );
    let _ = writeln!(out, "# TYPE vllm:cache_config_info gauge");
    let _ = writeln!(
        out,
        "vllm:cache_config_info{{block_size=\"{}\",enable_prefix_caching=\"True\",engine=\"{engine}\",num_cpu_blocks=\"{}\",num_gpu_blocks=\"{}\",prefix_caching_hash_algo=\"sha256_cbor\"}} 1.0",
        config.block_size, config.num_cpu_blocks, config.num_gpu_blocks
    );
    out
}

/// Escapes a Prometheus label value.
pub fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_has_vllm_names_and_a_cumulative_histogram() {
        let mut observed = Observed::default();
        observed.metrics.num_requests_waiting = 3;
        observed.metrics.prefix_cache_hits = 64;
        observed.observe_ttft(0.03);
        observed.observe_ttft(0.3);
        let text = render(&observed, &EngineConfig::default(), "m\"x", 2);
        assert!(
            text.contains("vllm:num_requests_waiting{engine=\"2\",model_name=\"m\\\"x\"} 3\n"),
            "{text}"
        );
        assert!(
            text.contains("vllm:prefix_cache_hits_total{engine=\"2\",model_name=\"m\\\"x\"} 64\n")
        );
        assert!(text.contains("le=\"0.04\"} 1\n"));
        assert!(text.contains("le=\"0.5\"} 2\n"));
        assert!(text.contains("le=\"+Inf\"} 2\n"));
        assert!(text.contains("block_size=\"16\""));
    }

    #[test]
    fn each_offload_tier_has_its_own_series() {
        let mut observed = Observed::default();
        observed.metrics.ssd_blocks = 7;
        observed.metrics.shared_fs_hit_tokens = 32;
        observed.metrics.cpu_bytes_loaded = 4096;
        observed.metrics.tier_load_seconds[2] = 0.25;
        let tiered = EngineConfig {
            num_cpu_blocks: 64,
            ..EngineConfig::default()
        };
        let text = render(&observed, &tiered, "m", 0);
        let labels = "engine=\"0\",model_name=\"m\"";
        for line in [
            format!("kvroute_sim_tier_blocks{{{labels},tier=\"ssd\"}} 7\n"),
            format!("kvroute_sim_tier_hit_tokens_total{{{labels},tier=\"shared_fs\"}} 32\n"),
            format!("kvroute_sim_tier_loaded_bytes_total{{{labels},tier=\"cpu\"}} 4096\n"),
            format!(
                "vllm:kv_offload_total_bytes_total{{{labels},transfer_type=\"CPU_to_GPU\"}} 4096\n"
            ),
            format!(
                "vllm:kv_offload_total_time_total{{{labels},transfer_type=\"SHARED_STORAGE_to_GPU\"}} 0.25\n"
            ),
        ] {
            assert!(text.contains(&line), "{line} in {text}");
        }
        // An engine with no tier below the GPU has no offloading connector, and vLLM then
        // exports none of its metrics.
        let plain = render(&observed, &EngineConfig::default(), "m", 0);
        assert!(!plain.contains("vllm:kv_offload"), "{plain}");
    }
}
