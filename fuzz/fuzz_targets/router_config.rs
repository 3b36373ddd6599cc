//! Fuzz target: YAML into the router's configuration loader; every error must name a problem.
#![no_main]

use kvroute_router::config::RouterConfig;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Err(e) = RouterConfig::from_yaml(text) {
        assert!(!e.to_string().is_empty());
    }
});
