//! Fuzz target: multipart ZMQ messages into the live-frame and replay-reply parsers. The input
//! is split into frames at each `0xff 0x00` pair, so the fuzzer controls the frame count and
//! each frame's length.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut frames = Vec::new();
    let mut start = 0;
    let mut i = 0;
    while i + 1 < data.len() {
        if data[i] == 0xff && data[i + 1] == 0x00 {
            frames.push(Bytes::copy_from_slice(&data[start..i]));
            start = i + 2;
            i += 2;
        } else {
            i += 1;
        }
    }
    frames.push(Bytes::copy_from_slice(&data[start.min(data.len())..]));
    if let Ok(msg) = kvroute_vllm::codec::parse_frames(&frames) {
        let _ = kvroute_vllm::codec::decode_batch(&msg.payload);
    }
    let _ = kvroute_vllm::subscriber::parse_replay_reply(&frames);
});
