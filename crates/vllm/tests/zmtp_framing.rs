//! Hostile byte streams through the ZMTP frame decoder (the stable-toolchain counterpart of
//! the `zmtp_decoder` cargo-fuzz target): whatever a peer sends, the decoder answers with items
//! or an error, never panics, and never holds memory for a frame or message over its limits
//! (measured after every read: a decoder that reserved a declared 2^62 bytes would abort the
//! test process instead).

use bytes::Bytes;
use kvroute_vllm::zmtp::wire::{FLAG_COMMAND, FLAG_LONG, FLAG_MORE, encode_message};
use kvroute_vllm::zmtp::{Decoder, Item, Limits, ZmtpError};
use proptest::collection::vec;
use proptest::prelude::*;

const LIMITS: Limits = Limits {
    max_message_bytes: 4096,
    max_command_bytes: 256,
};

/// The most the decoder may hold: one frame (header included) plus what a message's frames
/// cost to track, grown by at most doubling.
const HELD_BOUND: usize = 2 * (4096 + 9 + 4096);

/// Feeds `stream` to a fresh decoder in `chunk`-byte reads until it ends or errs; returns the
/// items, the error if any, and the most memory the decoder held meanwhile.
fn decode_all(stream: &[u8], chunk: usize) -> (Vec<Item>, Option<ZmtpError>, usize) {
    let mut decoder = Decoder::new(LIMITS);
    let mut items = Vec::new();
    let mut largest = 0;
    let mut error = None;
    'feed: for piece in stream.chunks(chunk.max(1)) {
        decoder.read_space().extend_from_slice(piece);
        largest = largest.max(decoder.held_bytes());
        loop {
            match decoder.decode() {
                Ok(Some(item)) => items.push(item),
                Ok(None) => break,
                Err(e) => {
                    error = Some(e);
                    break 'feed;
                }
            }
        }
        largest = largest.max(decoder.held_bytes());
        assert!(decoder.buffered() <= 4096 + 9 + chunk);
    }
    (items, error, largest)
}

fn long_header(flags: u8, declared: u64) -> Vec<u8> {
    let mut header = vec![flags | FLAG_LONG];
    header.extend_from_slice(&declared.to_be_bytes());
    header
}

/// Sizes a hostile peer declares: the probe's 2^62 and 8 GiB, the edges of the limit, and any.
fn hostile_size() -> impl Strategy<Value = u64> {
    prop_oneof![
        Just(1u64 << 62),
        Just(8u64 << 30),
        Just(u64::MAX),
        Just(4097u64),
        4097u64..,
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Any bytes, in any chunking: items or an error, within the allocation bound.
    #[test]
    fn arbitrary_streams_never_panic_or_overallocate(
        stream in vec(any::<u8>(), 0..2048),
        chunk in 1usize..64,
    ) {
        let (_, _, largest) = decode_all(&stream, chunk);
        prop_assert!(largest <= HELD_BOUND, "{largest}");
    }

    /// Valid messages, then a frame or command header declaring more than the limit: the
    /// messages come out, then a size error, and nothing near the declared size is allocated.
    #[test]
    fn hostile_headers_are_refused_before_allocating(
        frames in vec(vec(any::<u8>(), 0..300), 1..4),
        declared in hostile_size(),
        flags in prop_oneof![Just(0u8), Just(FLAG_MORE), Just(FLAG_COMMAND)],
        chunk in 1usize..64,
    ) {
        let frames: Vec<Bytes> = frames.into_iter().map(Bytes::from).collect();
        let mut stream = encode_message(&frames).to_vec();
        stream.extend(long_header(flags, declared));
        stream.extend(std::iter::repeat_n(0xAB, 1000));
        let (items, error, largest) = decode_all(&stream, chunk);
        prop_assert_eq!(items, vec![Item::Message(frames)]);
        let error = error.expect("the oversized header is refused");
        prop_assert!(error.is_too_large(), "{}", error);
        prop_assert!(largest <= HELD_BOUND, "{largest}");
    }

    /// A multipart message whose frames each fit but together do not.
    #[test]
    fn multipart_totals_over_the_limit_are_refused(
        sizes in vec(0usize..2048, 2..40),
        chunk in 1usize..512,
    ) {
        let frames: Vec<Bytes> = sizes.iter().map(|n| Bytes::from(vec![7u8; *n])).collect();
        let total: usize = sizes.iter().map(|n| n + 32).sum();
        let (items, error, largest) = decode_all(&encode_message(&frames), chunk);
        if total <= 4096 {
            prop_assert_eq!(items, vec![Item::Message(frames)]);
            prop_assert!(error.is_none());
        } else {
            prop_assert!(items.is_empty());
            prop_assert!(error.is_some_and(|e| e.is_too_large()));
        }
        prop_assert!(largest <= HELD_BOUND, "{largest}");
    }
}
