//! Reading a vLLM engine's Prometheus `/metrics`: the load gauges the router scores with and
//! the cache configuration it can learn from.
//!
//! The text format is simple; this parser takes the sample lines it needs (`name{labels} value`)
//! and ignores everything else, so new metrics or comments never break it.

use serde::Serialize;

/// What kvroute reads from an engine's `/metrics`, summed over its `engine` label (one API
/// server can front several data-parallel engines).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct EngineLoadSample {
    /// `vllm:num_requests_waiting`.
    pub waiting: Option<f64>,
    /// `vllm:num_requests_running`.
    pub running: Option<f64>,
    /// `vllm:kv_cache_usage_perc` (or the pre-0.12 `vllm:gpu_cache_usage_perc`), 0–1, the
    /// largest across engines.
    pub kv_usage: Option<f64>,
    /// `block_size` label of `vllm:cache_config_info`.
    pub block_size: Option<usize>,
    /// `num_gpu_blocks` label of `vllm:cache_config_info`.
    pub num_gpu_blocks: Option<usize>,
    /// `vllm:prefix_cache_queries_total`.
    pub prefix_cache_queries: Option<f64>,
    /// `process_start_time_seconds` (Prometheus' process collector, which vLLM's server
    /// exports): changes when the engine process restarts.
    pub process_start_time: Option<f64>,
    /// `vllm:prefix_cache_hits_total`.
    pub prefix_cache_hits: Option<f64>,
    /// Prompt tokens loaded from each tier below the GPU (CPU, own storage, shared; counters):
    /// vLLM 0.33's `vllm:prompt_tokens_cached_by_source_total` (`source` `host` and `disk`;
    /// it names no shared tier) or the simulator's `kvroute_sim_tier_hit_tokens_total`
    /// (`tier` `cpu`, `ssd`, `shared_fs`). `None` where the engine reports no such tier.
    pub tier_loaded_tokens: [Option<f64>; 3],
    /// Seconds the loads from each tier took, summed over the loads (counters): vLLM's
    /// offloading connector's `vllm:kv_offload_total_time_total` for each `transfer_type`
    /// into the GPU (`CPU_to_GPU`; `DISK_to_GPU` or `STORAGE_to_GPU` for the engine's own
    /// storage; `SHARED_STORAGE_to_GPU`, `FS_to_GPU` or `SHARED_FS_to_GPU` for a shared
    /// filesystem, as llm-d's filesystem backend names it; case-insensitive). `None` where the
    /// engine reports no such load.
    pub tier_load_seconds: [Option<f64>; 3],
}

/// The tier (CPU 0, own storage 1, shared 2) whose loads into the GPU a `transfer_type` label
/// of vLLM's offloading metrics names (`<MEDIUM>_to_GPU`), if any.
fn load_tier_of(transfer_type: &str) -> Option<usize> {
    let lower = transfer_type.to_ascii_lowercase();
    let medium = lower.strip_suffix("_to_gpu")?;
    match medium {
        "cpu" => Some(0),
        "disk" | "storage" | "local_storage" | "ssd" => Some(1),
        "shared_storage" | "fs" | "shared_fs" => Some(2),
        _ => None,
    }
}

/// The tier (CPU 0, own storage 1, shared 2) a per-tier series' label names, if any.
fn tier_of(name: &str, labels: &[(&str, &str)]) -> Option<usize> {
    let (key, names): (&str, [&str; 3]) = match name {
        "vllm:prompt_tokens_cached_by_source_total" => ("source", ["host", "disk", ""]),
        "kvroute_sim_tier_hit_tokens_total" => ("tier", ["cpu", "ssd", "shared_fs"]),
        _ => return None,
    };
    let (_, value) = labels.iter().find(|(k, _)| *k == key)?;
    names.iter().position(|n| !n.is_empty() && n == value)
}

/// One sample: metric name, labels, value.
type Sample<'a> = (&'a str, Vec<(&'a str, &'a str)>, f64);

/// Parses one sample line.
fn parse_line(line: &str) -> Option<Sample<'_>> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let (name, labels, value) = match line.find('{') {
        // A label value may hold a `}` (quoted): the set ends at the first one outside quotes;
        // a set that never closes is not a sample.
        Some(open) => {
            let close = open + closing_brace(&line[open..])?;
            (
                &line[..open],
                parse_labels(&line[open + 1..close]),
                line[close + 1..].trim(),
            )
        }
        None => {
            let mut parts = line.splitn(2, char::is_whitespace);
            (parts.next()?, Vec::new(), parts.next()?.trim())
        }
    };
    let value: f64 = value.split_whitespace().next()?.parse().ok()?;
    Some((name, labels, value))
}

/// Where the label set starting `text` (at its `{`) closes: the first `}` outside a quoted
/// value (a quote escaped with a backslash does not end one); `None` if it never does.
fn closing_brace(text: &str) -> Option<usize> {
    let mut quoted = false;
    let mut escaped = false;
    for (i, b) in text.bytes().enumerate() {
        match b {
            _ if escaped => escaped = false,
            b'\\' if quoted => escaped = true,
            b'"' => quoted = !quoted,
            b'}' if !quoted => return Some(i),
            _ => {}
        }
    }
    None
}

fn parse_labels(text: &str) -> Vec<(&str, &str)> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(eq) = rest.find('=') {
        let key = rest[..eq].trim().trim_start_matches(',').trim();
        let after = &rest[eq + 1..];
        let Some(stripped) = after.strip_prefix('"') else {
            break;
        };
        // Find the closing quote, skipping escaped ones.
        let bytes = stripped.as_bytes();
        let mut i = 0;
        while i < bytes.len() && bytes[i] != b'"' {
            i += if bytes[i] == b'\\' { 2 } else { 1 };
        }
        if i > bytes.len() {
            break;
        }
        out.push((key, &stripped[..i.min(stripped.len())]));
        rest = stripped.get(i + 1..).unwrap_or("");
    }
    out
}

/// Extracts the load gauges from a `/metrics` body.
pub fn parse_engine_metrics(text: &str) -> EngineLoadSample {
    let mut s = EngineLoadSample::default();
    let add = |slot: &mut Option<f64>, v: f64| *slot = Some(slot.unwrap_or(0.0) + v);
    for (name, labels, value) in text.lines().filter_map(parse_line) {
        match name {
            "vllm:num_requests_waiting" => add(&mut s.waiting, value),
            "vllm:num_requests_running" => add(&mut s.running, value),
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => {
                s.kv_usage = Some(s.kv_usage.unwrap_or(0.0).max(value));
            }
            "vllm:prefix_cache_queries_total" => add(&mut s.prefix_cache_queries, value),
            "process_start_time_seconds" => s.process_start_time = Some(value),
            "vllm:prefix_cache_hits_total" => add(&mut s.prefix_cache_hits, value),
            "vllm:prompt_tokens_cached_by_source_total" | "kvroute_sim_tier_hit_tokens_total" => {
                if let Some(tier) = tier_of(name, &labels) {
                    add(&mut s.tier_loaded_tokens[tier], value);
                }
            }
            // prometheus_client names a counter `x` as `x_total`; documentation says `x`.
            "vllm:kv_offload_total_time_total" | "vllm:kv_offload_total_time" => {
                let transfer = labels.iter().find(|(k, _)| *k == "transfer_type");
                if let Some(tier) = transfer.and_then(|(_, v)| load_tier_of(v)) {
                    add(&mut s.tier_load_seconds[tier], value);
                }
            }
            "vllm:cache_config_info" => {
                for (k, v) in labels {
                    match k {
                        "block_size" => s.block_size = v.parse().ok(),
                        "num_gpu_blocks" => s.num_gpu_blocks = v.parse().ok(),
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn reads_the_offloading_connectors_load_times_by_tier() {
        let text = r#"vllm:kv_offload_total_time_total{engine="0",model_name="m",transfer_type="CPU_to_GPU"} 1.5
vllm:kv_offload_total_time_total{engine="1",model_name="m",transfer_type="CPU_to_GPU"} 0.5
vllm:kv_offload_total_time_total{engine="0",model_name="m",transfer_type="GPU_to_CPU"} 9.0
vllm:kv_offload_total_time_total{engine="0",model_name="m",transfer_type="SHARED_STORAGE_to_GPU"} 3.25
vllm:kv_offload_total_time{engine="0",model_name="m",transfer_type="disk_to_gpu"} 0.75
vllm:kv_offload_total_time_total{engine="0",model_name="m",transfer_type="OBJ_to_GPU"} 7.0
vllm:kv_offload_total_time_total{engine="0",model_name="m"} 11.0
vllm:kv_offload_total_bytes_total{engine="0",model_name="m",transfer_type="CPU_to_GPU"} 4096
"#;
        let s = parse_engine_metrics(text);
        // Loads into the GPU only (stores are not loads), summed over the engines; a medium
        // kvroute has no tier for, and a series without a direction, are left out.
        assert_eq!(s.tier_load_seconds, [Some(2.0), Some(0.75), Some(3.25)]);
        assert_eq!(parse_engine_metrics("").tier_load_seconds, [None; 3]);
    }

    #[test]
    fn reads_vllm_gauges_across_engines() {
        let text = r#"# HELP vllm:num_requests_waiting Number of requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
vllm:num_requests_running{engine="0",model_name="m"} 7
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 128.0
vllm:cache_config_info{block_size="32",cache_dtype="auto",engine="0",num_gpu_blocks="27000",prefix_caching_hash_algo="sha256"} 1.0
vllm:some_new_metric{a="b\"}"} 9
"#;
        let s = parse_engine_metrics(text);
        assert_eq!(s.waiting, Some(5.0));
        assert_eq!(s.running, Some(7.0));
        assert_eq!(s.kv_usage, Some(0.5));
        assert_eq!(s.prefix_cache_hits, Some(128.0));
        assert_eq!(s.block_size, Some(32));
        assert_eq!(s.num_gpu_blocks, Some(27000));
    }

    #[test]
    fn tier_loads_are_read_from_vllm_and_from_the_simulator() {
        let vllm = r#"vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="device"} 900.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="host"} 300.0
vllm:prompt_tokens_cached_by_source_total{engine="1",model_name="m",source="host"} 20.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="disk"} 64.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="m",source="external_unspecified"} 5.0
"#;
        let s = parse_engine_metrics(vllm);
        assert_eq!(s.tier_loaded_tokens, [Some(320.0), Some(64.0), None]);
        let sim = r#"kvroute_sim_tier_hit_tokens_total{engine="0",model_name="m",tier="cpu"} 16
kvroute_sim_tier_hit_tokens_total{engine="0",model_name="m",tier="ssd"} 0
kvroute_sim_tier_hit_tokens_total{engine="0",model_name="m",tier="shared_fs"} 48
"#;
        let s = parse_engine_metrics(sim);
        assert_eq!(s.tier_loaded_tokens, [Some(16.0), Some(0.0), Some(48.0)]);
        assert_eq!(
            parse_engine_metrics("vllm:num_requests_running 1\n").tier_loaded_tokens,
            [None; 3]
        );
    }

    #[test]
    fn old_metric_names_are_understood() {
        let s = parse_engine_metrics("vllm:gpu_cache_usage_perc{model_name=\"m\"} 0.75\n");
        assert_eq!(s.kv_usage, Some(0.75));
        assert_eq!(s.waiting, None, "absent stays absent");
    }

    #[test]
    fn an_unclosed_label_set_is_not_a_sample() {
        // Found by the `engine_metrics` fuzz target: a multi-byte character where the closing
        // brace should be panicked the parser (a broken engine could stop load scraping).
        assert_eq!(parse_line("a{é 1"), None);
        assert_eq!(parse_line("vllm:num_requests_waiting{x=\"1\" 3"), None);
        let s = parse_engine_metrics("a{é 1\nvllm:num_requests_waiting 2\n");
        assert_eq!(s.waiting, Some(2.0));
    }

    #[test]
    fn a_brace_or_quote_inside_a_label_value_is_part_of_it() {
        let s = parse_engine_metrics(
            "vllm:num_requests_waiting{model_name=\"a}b\"} 3\n\
             vllm:num_requests_running{model_name=\"say \\\"}\\\"\",x=\"1\"} 4\n",
        );
        assert_eq!(s.waiting, Some(3.0));
        assert_eq!(s.running, Some(4.0));
    }

    proptest! {
        #[test]
        fn arbitrary_text_never_panics(text in "\\PC{0,300}") {
            let _ = parse_engine_metrics(&text);
        }

        #[test]
        fn mangled_lines_never_panic(line in "[a-z:_é]{1,10}(\\{[a-zé]{0,4}(=\"[^\"]{0,6}\"?)?,?\\}?)? ?[0-9.eE+-]{0,8}") {
            let _ = parse_engine_metrics(&line);
        }
    }
}
