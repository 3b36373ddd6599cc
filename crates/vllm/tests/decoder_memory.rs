//! What decoding a hostile KV-event payload may take from the heap: the decoder reserves room
//! for an array before reading its elements, and a payload can declare arrays of 2³² − 1
//! elements nested as deep as the decoder allows. The whole heap is measured (dhat's testing
//! mode), so this file holds one test.

#[global_allocator]
static HEAP: dhat::Alloc = dhat::Alloc;

/// A batch `[0, [["BlockStored", [1], nil, [], 16, nil, nil, nil, EXTRA]]]` whose `extra_keys`
/// opens `levels` nested arrays each declaring 2³² − 1 elements, padded with nils to `len`
/// bytes: well-formed msgpack up to where the arrays run out of elements.
fn nested_huge_arrays(levels: usize, len: usize) -> Vec<u8> {
    let mut payload = vec![0x92, 0x00, 0x91, 0x99, 0xab];
    payload.extend_from_slice(b"BlockStored");
    payload.extend_from_slice(&[0x91, 0x01, 0xc0, 0x90, 0x10, 0xc0, 0xc0, 0xc0]);
    for _ in 0..levels {
        payload.push(0xdd); // array 32
        payload.extend_from_slice(&u32::MAX.to_be_bytes());
    }
    payload.resize(len, 0xc0);
    payload
}

#[test]
fn a_payload_declaring_huge_nested_arrays_takes_about_its_own_size() {
    let _profiler = dhat::Profiler::builder().testing().build();
    const PAYLOAD: usize = 1 << 20;
    let payload = nested_huge_arrays(29, PAYLOAD);
    let decoded = kvroute_vllm::codec::decode_batch(&payload);
    let peak = dhat::HeapStats::get().max_bytes;
    assert!(decoded.is_err(), "the arrays never get their elements");
    // The payload itself, the decoder's bounded reservations and the error message: each
    // level reserved the rest of the payload again before, 919 MiB here.
    assert!(
        peak < 4 * PAYLOAD,
        "decoding a {PAYLOAD}-byte payload took {peak} bytes of heap at its peak"
    );
}
