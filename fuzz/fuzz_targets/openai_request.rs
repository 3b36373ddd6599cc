//! Fuzz target: request bodies into the OpenAI completions and chat parsers; every error must be
//! a 400 with a message.
#![no_main]

use kvroute_vllm::openai::{parse_chat, parse_completion};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    for result in [parse_completion(data), parse_chat(data)] {
        if let Err(e) = result {
            assert_eq!(e.status, 400);
            assert!(!e.message.is_empty());
            let _ = e.to_json();
        }
    }
});
