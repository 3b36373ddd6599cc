//! Tier loads beside the batch ([`TierLoads::Async`], vLLM's OffloadingConnector).

use super::tests::{request, run};
use super::*;
use kvroute_core::event::EngineHash;

/// Seconds to load one block from the CPU tier: large, so that a load spans many steps.
const LOAD_PER_BLOCK_S: f64 = 0.02;

/// 32 GPU blocks of 4 tokens over a 64-block CPU tier, loading asynchronously.
fn config() -> EngineConfig {
    let mut config = EngineConfig {
        block_size: 4,
        num_gpu_blocks: 32,
        num_cpu_blocks: 64,
        max_num_batched_tokens: 64,
        ..EngineConfig::default()
    };
    config.latency.cpu_load_per_block_s = LOAD_PER_BLOCK_S;
    config
}

/// An engine of [`config`] whose GPU evicted prompt `a` into its CPU tier.
fn a_prompt_on_cpu() -> (Engine, Vec<u32>) {
    a_prompt_on_cpu_of(config())
}

/// An engine of `config` whose GPU evicted prompt `a` (24 tokens) into its CPU tier: 5 blocks
/// to load.
fn a_prompt_on_cpu_of(config: EngineConfig) -> (Engine, Vec<u32>) {
    let mut e = Engine::new(config).unwrap();
    let a: Vec<u32> = (0..24).collect();
    e.add_request(request(1, a.clone(), 1)).unwrap();
    run(&mut e);
    push_out(&mut e, 2, 1_000, 6, 24);
    let tiers = e.prefix_tiers(&a, None, None);
    assert_eq!((tiers.gpu, tiers.cpu), (0, 5), "{tiers:?}");
    (e, a)
}

/// Runs `prompts` fresh prompts of `len` tokens one after another (ids from `first_id`, tokens
/// from `first_token` on): the GPU's older blocks move to the CPU tier.
fn push_out(e: &mut Engine, first_id: u64, first_token: u32, prompts: u32, len: u32) {
    for i in 0..prompts {
        let start = first_token + 1_000 * i;
        e.add_request(request(
            first_id + u64::from(i),
            (start..start + len).collect(),
            1,
        ))
        .unwrap();
        run(e);
    }
}

/// Steps until request `id` produces its first token; returns when that step ended, and the
/// longest step taken meanwhile.
fn until_first_token(e: &mut Engine, id: RequestId, mut now: f64) -> (f64, f64, TokenOutput) {
    let mut longest: f64 = 0.0;
    for _ in 0..10_000 {
        let step = e.step_at(now);
        now += step.duration_s;
        longest = longest.max(step.duration_s);
        if let Some(t) = step.tokens.into_iter().find(|t| t.id == id && t.index == 0) {
            return (now, longest, t);
        }
    }
    panic!("request {id} never produced a token");
}

#[test]
fn a_request_loading_from_cpu_waits_beside_the_batch_and_stalls_no_decode() {
    let (mut e, a) = a_prompt_on_cpu();
    // A decoding request: its steps must not wait for the load.
    e.add_request(request(20, (9_000..9_008).collect(), 40))
        .unwrap();
    let (mut now, _, _) = until_first_token(&mut e, 20, 10.0);
    e.add_request(request(21, a, 1)).unwrap();
    let admitted = now;
    let step = e.step_at(now);
    now += step.duration_s;
    assert_eq!(step.work.cpu_blocks_loaded, 0, "the load is not step work");
    assert_eq!(step.work.decode_seqs, 1);
    assert_eq!(
        e.metrics().num_requests_waiting,
        1,
        "parked, as vLLM counts it"
    );
    assert_eq!(e.metrics().cpu_hit_tokens, 20);
    let (first, longest, token) = until_first_token(&mut e, 21, now);
    let load = 5.0 * LOAD_PER_BLOCK_S;
    assert!(
        first >= admitted + load,
        "first token at {first}, before the load ended at {}",
        admitted + load
    );
    assert!(
        longest < load / 4.0,
        "a step waited for the load: {longest} s"
    );
    assert_eq!(
        token.cached_tokens, 20,
        "5 blocks loaded, the last recomputed"
    );
}

/// Blocks being loaded stay in their tier until the load ends, whatever the GPU evicts into it
/// meanwhile (vLLM's offloading manager holds a reference on each block it loads): a hit is
/// never counted on a block the tier has already dropped.
#[test]
fn blocks_being_loaded_are_not_evicted_from_their_tier() {
    // The tier holds a's blocks and the six prompts after them, and overflows by the next three.
    let (mut e, a) = a_prompt_on_cpu_of(EngineConfig {
        num_cpu_blocks: 44,
        ..config()
    });
    e.add_request(request(21, a.clone(), 1)).unwrap();
    // Fresh prompts push GPU blocks into the full CPU tier while request 21 loads.
    for i in 0..3 {
        let start = 50_000 + 1_000 * i;
        e.add_request(request(30 + u64::from(i), (start..start + 24).collect(), 1))
            .unwrap();
    }
    let mut now = 10.0;
    let mut removed = Vec::new();
    while e.loads.len() > 0 || now == 10.0 {
        let step = e.step_at(now);
        now += step.duration_s;
        removed.extend(step.events.into_iter().filter_map(|event| match event {
            KvEvent::BlockRemoved(r) if r.medium.as_deref() == Some("CPU") => Some(r.block_hashes),
            _ => None,
        }));
    }
    assert!(!removed.is_empty(), "the CPU tier overflowed meanwhile");
    let loaded: Vec<EngineHash> = e
        .probe(&a, None, None)
        .lookup_blocks()
        .iter()
        .map(|d| EngineHash(d.event_u64()))
        .collect();
    assert!(
        removed.iter().flatten().all(|h| !loaded.contains(h)),
        "a block was dropped from the CPU tier while it loaded"
    );
}

#[test]
fn a_request_that_would_load_blocks_still_loading_waits_for_them_and_finds_them_on_the_gpu() {
    let (mut e, a) = a_prompt_on_cpu();
    e.add_request(request(21, a.clone(), 1)).unwrap();
    // The second shares exactly the 5 blocks the first loads.
    let mut b = a[..20].to_vec();
    b.extend([7_000, 7_001, 7_002, 7_003]);
    e.add_request(request(22, b, 1)).unwrap();
    let step = e.step_at(10.0);
    assert_eq!(
        step.work.prefill_tokens, 0,
        "the first parks, the second is delayed"
    );
    assert_eq!(e.metrics().num_requests_waiting, 2);
    assert_eq!(
        e.metrics().cpu_hit_tokens,
        20,
        "the second loads nothing itself"
    );
    let load_end = 10.0 + 5.0 * LOAD_PER_BLOCK_S;
    let (first, _, token) = until_first_token(&mut e, 22, 10.0 + step.duration_s);
    assert!(first >= load_end, "{first} < {load_end}");
    assert_eq!(token.cached_tokens, 20);
    let m = e.metrics();
    assert_eq!(m.cpu_hit_tokens, 20, "the blocks were loaded once");
    assert_eq!(m.prefix_cache_hits, 20, "the second found them on the GPU");
}

#[test]
fn an_engine_with_only_a_load_under_way_polls_until_it_ends() {
    let (mut e, a) = a_prompt_on_cpu();
    e.add_request(request(21, a, 1)).unwrap();
    let load = 5.0 * LOAD_PER_BLOCK_S;
    let mut now = 10.0;
    let mut waits = 0;
    loop {
        let step = e.step_at(now);
        if step.work.prefill_tokens > 0 {
            assert_eq!(
                step.work.prefill_tokens, 4,
                "only the last block is computed"
            );
            assert_eq!(step.tokens.len(), 1);
            break;
        }
        assert!(step.tokens.is_empty());
        assert!(step.work.load_wait_s > 0.0 && step.work.load_wait_s <= tier_loads::LOAD_POLL_S);
        assert_eq!(step.duration_s, step.work.load_wait_s);
        now += step.duration_s;
        waits += 1;
        assert!(waits < 10_000, "never ends");
    }
    assert!((now - (10.0 + load)).abs() < 1e-9, "{now}");
}

#[test]
fn a_request_arriving_while_the_engine_waits_for_a_load_runs_at_once() {
    let (mut e, a) = a_prompt_on_cpu();
    e.add_request(request(21, a, 1)).unwrap();
    let step = e.step_at(10.0);
    e.add_request(request(22, (9_000..9_008).collect(), 1))
        .unwrap();
    let (first, _, _) = until_first_token(&mut e, 22, 10.0 + step.duration_s);
    assert!(
        first < 10.0 + 5.0 * LOAD_PER_BLOCK_S,
        "it waited for the load: {first}"
    );
}

#[test]
fn loaded_blocks_are_announced_and_found_on_the_gpu_only_once_they_arrive() {
    let (mut e, a) = a_prompt_on_cpu();
    e.add_request(request(21, a.clone(), 1)).unwrap();
    let gpu_stores = |events: &[KvEvent]| {
        events
            .iter()
            .filter(
                |ev| matches!(ev, KvEvent::BlockStored(s) if s.medium.as_deref() != Some("CPU")),
            )
            .count()
    };
    let step = e.step_at(10.0);
    assert_eq!(gpu_stores(&step.events), 0, "nothing arrived yet");
    assert_eq!(e.prefix_tiers(&a, None, None).gpu, 0);
    let load_end = 10.0 + 5.0 * LOAD_PER_BLOCK_S;
    let step = e.step_at(load_end);
    assert!(gpu_stores(&step.events) > 0, "{:?}", step.events);
    assert_eq!(e.prefix_tiers(&a, None, None).gpu, 5);
}

#[test]
fn two_loads_queue_on_the_host_link() {
    // Room on the CPU tier for both prompts and every prompt that pushed them off the GPU.
    let (mut e, a) = a_prompt_on_cpu_of(EngineConfig {
        num_cpu_blocks: 96,
        ..config()
    });
    // A second prompt of the same length, also pushed off the GPU (its copy stays on the CPU).
    let b: Vec<u32> = (50_000..50_024).collect();
    e.add_request(request(30, b.clone(), 1)).unwrap();
    run(&mut e);
    push_out(&mut e, 31, 60_000, 6, 24);
    assert_eq!(e.prefix_tiers(&b, None, None).cpu, 5);
    assert_eq!(e.prefix_tiers(&a, None, None).cpu, 5);
    e.add_request(request(40, a, 1)).unwrap();
    e.add_request(request(41, b, 1)).unwrap();
    let load = 5.0 * LOAD_PER_BLOCK_S;
    let (first_a, _, _) = until_first_token(&mut e, 40, 10.0);
    assert!(
        first_a >= 10.0 + load && first_a < 10.0 + 2.0 * load,
        "{first_a}"
    );
    let (first_b, _, _) = until_first_token(&mut e, 41, first_a);
    assert!(
        first_b >= 10.0 + 2.0 * load,
        "b's load waits for a's: {first_b}"
    );
}

#[test]
fn an_aborted_load_frees_its_blocks_and_leaves_them_on_cpu() {
    let (mut e, a) = a_prompt_on_cpu();
    let idle_usage = e.metrics().kv_cache_usage;
    e.add_request(request(21, a.clone(), 1)).unwrap();
    e.step_at(10.0);
    assert!(e.metrics().kv_cache_usage > idle_usage);
    assert!(e.abort(21));
    assert!(!e.has_work());
    assert_eq!(e.metrics().num_requests_waiting, 0);
    assert_eq!(e.metrics().kv_cache_usage, idle_usage);
    let tiers = e.prefix_tiers(&a, None, None);
    assert_eq!(
        (tiers.gpu, tiers.cpu),
        (0, 5),
        "blocks that never arrived are not hits"
    );
}

#[test]
fn a_loaded_request_joins_the_batch_only_where_there_is_a_place() {
    let (mut e, a) = a_prompt_on_cpu_of(EngineConfig {
        max_num_seqs: 1,
        ..config()
    });
    // `a` parks (it takes no place), then a long decode takes the only place.
    e.add_request(request(21, a, 1)).unwrap();
    e.add_request(request(22, (9_000..9_008).collect(), 60))
        .unwrap();
    let mut now = 10.0;
    let mut last_decode = 0.0;
    for _ in 0..10_000 {
        let step = e.step_at(now);
        now += step.duration_s;
        assert!(e.metrics().num_requests_running <= 1);
        if step
            .tokens
            .iter()
            .any(|t| t.id == 22 && t.finished.is_some())
        {
            last_decode = now;
        }
        if step.tokens.iter().any(|t| t.id == 21) {
            assert!(
                last_decode > 0.0 && now > last_decode,
                "the loaded request ran before the batch had a place"
            );
            assert!(now > 10.0 + 5.0 * LOAD_PER_BLOCK_S);
            return;
        }
    }
    panic!("the loaded request never ran");
}

#[test]
fn loaded_requests_holding_every_block_do_not_deadlock_a_small_cache() {
    // 19 usable GPU blocks; two 36-token prefixes (9 blocks each) evicted to CPU.
    let mut e = Engine::new(EngineConfig {
        num_gpu_blocks: 20,
        ..config()
    })
    .unwrap();
    let prefixes: Vec<Vec<u32>> = (0..2u32)
        .map(|p| (p * 100..p * 100 + 36).collect())
        .collect();
    for (i, prefix) in prefixes.iter().enumerate() {
        e.add_request(request(1 + i as u64, prefix.clone(), 1))
            .unwrap();
        run(&mut e);
    }
    push_out(&mut e, 10, 1_000, 4, 36);
    for prefix in &prefixes {
        assert_eq!(e.prefix_tiers(prefix, None, None).gpu, 0);
    }
    // Each loads its 9 blocks, then needs 7 more for its own 28 tokens: the two loads hold 18
    // of the 19 blocks, and nothing runs to free any.
    for (i, prefix) in prefixes.iter().enumerate() {
        let mut prompt = prefix.clone();
        prompt.extend(5_000 + 100 * i as u32..5_028 + 100 * i as u32);
        e.add_request(request(20 + i as u64, prompt, 1)).unwrap();
    }
    let (tokens, _, _) = run(&mut e);
    assert_eq!(tokens.len(), 2, "both answered");
    assert!(tokens.iter().all(|t| t.cached_tokens == 36), "{tokens:?}");
}
