//! Benchmarks of the KV-event decoder: blocks decoded per second for typical batches, in the
//! map layout of vLLM 0.24+ and the positional-array layout of 0.23 and earlier.
//!
//! Payloads are encoded once, outside the timed closures, by the crate's own encoder (which
//! matches vLLM's publisher byte for byte). Run with
//! `cargo bench -p kvroute-vllm --bench codec -- --warm-up-time 1 --measurement-time 3`.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvroute_core::event::{BlockRemoved, BlockStored, EngineHash, EventBatch, KvEvent};
use kvroute_testkit::random::SplitMix64;
use kvroute_vllm::codec::{EventLayout, decode_batch, encode_batch};

/// One batch holding one GPU `BlockStored` of `blocks` 16-token blocks continuing a chain
/// (full 64-bit hashes and token ids below 150k, as a real engine publishes).
fn stored_batch(blocks: usize) -> EventBatch {
    let mut rng = SplitMix64(blocks as u64);
    let event = KvEvent::BlockStored(BlockStored {
        block_hashes: (0..blocks).map(|_| EngineHash(rng.next_u64())).collect(),
        parent_block_hash: Some(EngineHash(rng.next_u64())),
        token_ids: (0..blocks * 16)
            .map(|_| (rng.next_u64() % 150_000) as u32)
            .collect(),
        block_size: 16,
        medium: Some("GPU".into()),
        ..Default::default()
    });
    batch(event)
}

/// One batch holding one GPU `BlockRemoved` of `blocks` hashes.
fn removed_batch(blocks: usize) -> EventBatch {
    let mut rng = SplitMix64(!(blocks as u64));
    batch(KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: (0..blocks).map(|_| EngineHash(rng.next_u64())).collect(),
        medium: Some("GPU".into()),
        group_idx: None,
    }))
}

fn batch(event: KvEvent) -> EventBatch {
    EventBatch {
        ts: 1_767_000_000.25,
        events: vec![event],
        data_parallel_rank: Some(0),
    }
}

fn decode(c: &mut Criterion) {
    let layouts = [
        ("v0.24_map", EventLayout::LATEST),
        (
            "v0.23_array",
            EventLayout::for_vllm_version("0.23.0").expect("known version"),
        ),
    ];
    let batches = [
        ("stored_8", 8, stored_batch(8)),
        ("stored_512", 512, stored_batch(512)),
        ("removed_32", 32, removed_batch(32)),
    ];
    let mut group = c.benchmark_group("decode");
    for (layout_name, layout) in &layouts {
        for (batch_name, blocks, batch) in &batches {
            let payload = encode_batch(batch, layout);
            let decoded = decode_batch(&payload).expect("round trip");
            assert_eq!(&decoded.batch, batch, "round trip");
            eprintln!(
                "{batch_name} {layout_name}: {} payload bytes",
                payload.len()
            );
            group.throughput(Throughput::Elements(*blocks as u64));
            group.bench_with_input(
                BenchmarkId::new(*batch_name, layout_name),
                &payload,
                |b, payload| b.iter(|| decode_batch(black_box(payload))),
            );
        }
    }
    group.finish();
}

criterion_group!(benches, decode);
criterion_main!(benches);
