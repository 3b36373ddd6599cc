//! Fuzz target: Prometheus text from an engine's `/metrics` into the load-sample parser.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let _ = kvroute_vllm::metrics::parse_engine_metrics(&text);
});
