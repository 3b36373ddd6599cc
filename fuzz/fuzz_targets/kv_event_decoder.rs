//! Fuzz target: KV-event batch payloads (msgpack, every vLLM wire layout) into the decoder.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Err(e) = kvroute_vllm::codec::decode_batch(data) {
        assert!(!e.to_string().is_empty());
    }
});
