//! Fuzz target: a byte stream from a ZMTP peer into the frame decoder, with small limits. The
//! first byte sets the read size (1 to 256 bytes), the rest is the stream. Whatever arrives,
//! the decoder yields items or an error and never holds more than its limits allow; run with
//! `-malloc_limit_mb=64` so that any allocation of a declared size fails the run as well.
#![no_main]

use kvroute_vllm::zmtp::{Decoder, Limits};
use libfuzzer_sys::fuzz_target;

const LIMITS: Limits = Limits {
    max_message_bytes: 4096,
    max_command_bytes: 256,
};

/// One frame (header included) and the bookkeeping of a message's frames, grown by at most
/// doubling.
const HELD_BOUND: usize = 2 * (4096 + 9 + 4096);

fuzz_target!(|data: &[u8]| {
    let Some((&chunk, stream)) = data.split_first() else {
        return;
    };
    let mut decoder = Decoder::new(LIMITS);
    for piece in stream.chunks(usize::from(chunk) + 1) {
        decoder.read_space().extend_from_slice(piece);
        assert!(decoder.held_bytes() <= HELD_BOUND, "{}", decoder.held_bytes());
        loop {
            match decoder.decode() {
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(e) => {
                    assert!(!e.to_string().is_empty());
                    return;
                }
            }
        }
        assert!(decoder.held_bytes() <= HELD_BOUND, "{}", decoder.held_bytes());
    }
});
