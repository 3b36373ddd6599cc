use super::*;

pub(super) fn engine(gpu_blocks: usize) -> Engine {
    Engine::new(EngineConfig {
        block_size: 4,
        num_gpu_blocks: gpu_blocks,
        max_num_batched_tokens: 64,
        ..EngineConfig::default()
    })
    .unwrap()
}

/// [`engine`] loading offloaded blocks in the admitting step (LMCache's way).
fn in_step_engine(gpu_blocks: usize) -> Engine {
    Engine::new(EngineConfig {
        tier_loads: TierLoads::InStep,
        ..engine(gpu_blocks).config
    })
    .unwrap()
}

pub(super) fn request(id: RequestId, prompt: Vec<u32>, outputs: usize) -> EngineRequest {
    EngineRequest {
        id,
        prompt,
        output: (0..outputs as u32).map(|t| 90_000 + t).collect(),
        lora_name: None,
        cache_salt: None,
    }
}

/// Steps until idle; returns every token output and the total simulated time.
pub(super) fn run(engine: &mut Engine) -> (Vec<TokenOutput>, f64, Vec<KvEvent>) {
    let (mut tokens, mut time, mut events) = (Vec::new(), 0.0, Vec::new());
    let mut guard = 0;
    while engine.has_work() {
        let out = engine.step();
        tokens.extend(out.tokens);
        events.extend(out.events);
        time += out.duration_s;
        guard += 1;
        assert!(guard < 10_000, "engine does not make progress");
    }
    (tokens, time, events)
}

#[test]
fn a_shared_prefix_is_reported_cached_and_prefills_faster() {
    let mut e = engine(64);
    let prompt: Vec<u32> = (0..40).collect();
    e.add_request(request(1, prompt.clone(), 3)).unwrap();
    let (first, t1, _) = run(&mut e);
    assert_eq!(first.len(), 3);
    assert_eq!(first[0].cached_tokens, 0);
    let mut second_prompt = prompt.clone();
    second_prompt.extend([500, 501, 502]);
    e.add_request(request(2, second_prompt, 3)).unwrap();
    let (second, t2, _) = run(&mut e);
    // 40 shared tokens = 10 full blocks of 4.
    assert_eq!(second[0].cached_tokens, 40);
    assert!(t2 < t1, "cached prefill must be faster: {t2} vs {t1}");
    let m = e.metrics();
    assert_eq!(m.prefix_cache_queries, 83);
    assert_eq!(m.prefix_cache_hits, 40);
}

#[test]
fn the_last_prompt_token_is_always_computed() {
    let mut e = engine(64);
    let prompt: Vec<u32> = (0..16).collect();
    e.add_request(request(1, prompt.clone(), 1)).unwrap();
    run(&mut e);
    e.add_request(request(2, prompt, 1)).unwrap();
    let (out, _, _) = run(&mut e);
    // 4 full blocks cached, but vLLM recomputes the last token, so only 3 blocks are hits.
    assert_eq!(out[0].cached_tokens, 12);
}

#[test]
fn salt_and_lora_isolate_caches() {
    let mut e = engine(64);
    let prompt: Vec<u32> = (0..40).collect();
    e.add_request(request(1, prompt.clone(), 1)).unwrap();
    run(&mut e);
    let mut salted = request(2, prompt.clone(), 1);
    salted.cache_salt = Some("tenant-b".into());
    e.add_request(salted).unwrap();
    let (out, _, _) = run(&mut e);
    assert_eq!(out[0].cached_tokens, 0);
    let mut lora = request(3, prompt, 1);
    lora.lora_name = Some("sql".into());
    e.add_request(lora).unwrap();
    let (out, _, _) = run(&mut e);
    assert_eq!(out[0].cached_tokens, 0);
}

#[test]
fn events_describe_exactly_what_is_cached() {
    // A small pool forces evictions; replaying the events into a set of hashes must give
    // exactly the engine's cached blocks.
    let mut e = engine(12);
    let mut held = std::collections::HashSet::new();
    for i in 0..30u32 {
        let prompt: Vec<u32> = (0..(8 + i % 20)).map(|t| t + 1000 * (i % 4)).collect();
        e.add_request(request(u64::from(i), prompt, 2)).unwrap();
        let (_, _, events) = run(&mut e);
        for ev in events {
            match ev {
                KvEvent::BlockStored(s) => {
                    for h in s.block_hashes {
                        assert!(held.insert(h), "stored twice without removal: {h:?}");
                    }
                }
                KvEvent::BlockRemoved(r) => {
                    for h in r.block_hashes {
                        assert!(held.remove(&h), "removed a block never stored: {h:?}");
                    }
                }
                KvEvent::AllBlocksCleared => held.clear(),
            }
        }
        assert_eq!(held.len(), e.metrics().cached_blocks);
    }
}

#[test]
fn chunked_prefill_respects_the_token_budget_and_batches_decode() {
    let mut e = engine(256);
    e.add_request(request(1, (0..150).collect(), 2)).unwrap();
    e.add_request(request(2, (1000..1010).collect(), 2))
        .unwrap();
    let first = e.step();
    assert_eq!(
        first.work.prefill_tokens, 64,
        "budget of 64 tokens per step"
    );
    let (rest, _, _) = run(&mut e);
    assert_eq!(rest.len() + first.tokens.len(), 4);
}

#[test]
fn too_long_or_empty_requests_are_refused() {
    let mut e = engine(4);
    assert!(matches!(
        e.add_request(request(1, (0..20).collect(), 1)),
        Err(SimError::TooLong { .. })
    ));
    assert!(matches!(
        e.add_request(request(2, vec![], 1)),
        Err(SimError::EmptyPrompt)
    ));
    assert!(matches!(
        e.add_request(request(3, vec![1], 0)),
        Err(SimError::NoOutput)
    ));
}

/// As vLLM caches a request's blocks when it schedules them: requests sharing a prompt that
/// arrive together hit each other's blocks in the very step that computes them.
#[test]
fn requests_scheduled_in_one_step_hit_each_others_blocks() {
    let mut e = engine(64);
    let prompt: Vec<u32> = (0..40).collect();
    e.add_request(request(1, prompt.clone(), 2)).unwrap();
    e.add_request(request(2, prompt, 2)).unwrap();
    let first = e.step();
    // One step prefills both: the second computes only the last block of its prompt.
    assert_eq!(first.work.prefill_tokens, 40 + 4);
    let (rest, _, _) = run(&mut e);
    let cached = |id| {
        first
            .tokens
            .iter()
            .chain(&rest)
            .find(|t| t.id == id)
            .map(|t| t.cached_tokens)
    };
    assert_eq!((cached(1), cached(2)), (Some(0), Some(36)));
    assert_eq!(e.metrics().prefix_cache_hits, 36);
}

/// A request waiting at the head of the queue for room leaves the free blocks' order as it was
/// (vLLM checks for room before it takes any hit block): its cached prefix ages, and is
/// evicted, as it would be if the request were not waiting.
#[test]
fn a_request_waiting_for_room_does_not_keep_its_prefix_fresh() {
    let x: Vec<u32> = (0..20).collect();
    let prefix_after_decodes = |with_waiting: bool| {
        let mut e = engine(20);
        e.add_request(request(1, x.clone(), 1)).unwrap();
        run(&mut e);
        e.add_request(request(2, (1_000..1_020).collect(), 1))
            .unwrap();
        run(&mut e);
        e.add_request(request(3, (2_000..2_024).collect(), 40))
            .unwrap();
        e.step();
        if with_waiting {
            let mut y = x.clone();
            y.extend(3_000..3_040);
            e.add_request(request(4, y, 1)).unwrap();
        }
        for _ in 0..30 {
            e.step();
        }
        if with_waiting {
            assert_eq!(e.metrics().num_requests_waiting, 1, "it still waits");
        }
        e.prefix_tiers(&x, None, None).gpu
    };
    let (alone, beside_waiting) = (prefix_after_decodes(false), prefix_after_decodes(true));
    assert!(
        alone < 4,
        "the decodes evict part of the prefix: {alone} blocks left"
    );
    assert_eq!(beside_waiting, alone);
}

#[test]
fn preemption_under_block_pressure_still_completes_every_request() {
    let mut e = engine(10);
    for i in 0..6 {
        e.add_request(request(
            i,
            (0..12).map(|t| t + 100 * i as u32).collect(),
            10,
        ))
        .unwrap();
    }
    let (tokens, _, _) = run(&mut e);
    assert_eq!(tokens.len(), 60);
    assert!(e.metrics().num_preemptions > 0);
    // Each prompt is looked up once in vLLM's counters: a resumed request's lookup is not.
    assert_eq!(e.metrics().prefix_cache_queries, 6 * 12);
    for i in 0..6 {
        let mine: Vec<usize> = tokens
            .iter()
            .filter(|t| t.id == i)
            .map(|t| t.index)
            .collect();
        assert_eq!(
            mine,
            (0..10).collect::<Vec<_>>(),
            "request {i} tokens in order, once each"
        );
    }
}

/// As vLLM's scheduler: a step that preempts a running request admits no waiting one, not even
/// a request whose tier load has ended, so the blocks it freed go to the requests still running
/// (with none left running, vLLM's next pass admits at once, and so does the step).
#[test]
fn a_step_that_preempts_admits_nothing_new() {
    let mut config = EngineConfig {
        block_size: 4,
        num_gpu_blocks: 18,
        num_cpu_blocks: 64,
        max_num_batched_tokens: 64,
        ..EngineConfig::default()
    };
    config.latency.cpu_load_per_block_s = 0.002;
    let mut e = Engine::new(config).unwrap();
    let running = |e: &Engine| -> Vec<RequestId> { e.running.iter().map(|s| s.id()).collect() };
    let (mut preempting_steps, mut now, mut id) = (0, 0.0, 0);
    for round in 0..40u32 {
        // Eight prompts drawn from eight, so that earlier ones come back from the CPU tier.
        for k in 0..8 {
            let base = 1_000 * ((round * 3 + k * 5) % 8);
            e.add_request(request(id, (base..base + 14).collect(), 12))
                .unwrap();
            id += 1;
        }
        while e.has_work() {
            let (before, preemptions) = (running(&e), e.metrics().num_preemptions);
            let step = e.step_at(now);
            now += step.duration_s;
            let preempted = (e.metrics().num_preemptions - preemptions) as usize;
            let survivors = before.len().saturating_sub(preempted);
            if preempted > 0 && survivors > 0 {
                preempting_steps += 1;
                let after = running(&e);
                assert!(
                    after.iter().all(|id| before.contains(id)) && after.len() <= survivors,
                    "a preempting step admitted a request: {before:?} -> {after:?}"
                );
            }
        }
    }
    assert!(
        preempting_steps > 0,
        "the load preempts beside running requests"
    );
}

#[test]
fn cpu_tier_hits_count_as_cached_and_cost_a_transfer() {
    let mut e = Engine::new(EngineConfig {
        block_size: 4,
        num_gpu_blocks: 8,
        num_cpu_blocks: 32,
        tier_loads: TierLoads::InStep,
        max_num_batched_tokens: 64,
        ..EngineConfig::default()
    })
    .unwrap();
    let a: Vec<u32> = (0..24).collect();
    e.add_request(request(1, a.clone(), 1)).unwrap();
    run(&mut e);
    // Another long prompt pushes a's blocks out of the GPU into the CPU tier.
    e.add_request(request(2, (500..524).collect(), 1)).unwrap();
    run(&mut e);
    assert!(e.metrics().cpu_blocks > 0);
    e.add_request(request(3, a, 1)).unwrap();
    let step = e.step();
    assert!(step.work.cpu_blocks_loaded > 0);
    let (out, _, _) = run(&mut e);
    let first = step.tokens.first().or(out.first()).unwrap();
    assert_eq!(
        first.cached_tokens, 20,
        "5 of 6 blocks (last token recomputed)"
    );
}

/// An engine of 8 GPU blocks over a 2-block CPU tier and a 32-block SSD tier, loading in the
/// admitting step.
fn ssd_engine() -> Engine {
    Engine::new(EngineConfig {
        block_size: 4,
        num_gpu_blocks: 8,
        num_cpu_blocks: 2,
        num_ssd_blocks: 32,
        tier_loads: TierLoads::InStep,
        max_num_batched_tokens: 64,
        ..EngineConfig::default()
    })
    .unwrap()
}

/// An SSD-tier engine that served prompt `a` and then two long prompts, which pushed `a`'s
/// blocks out of the GPU, through the CPU tier, onto the SSD.
fn a_prefix_demoted_to_the_ssd() -> (Engine, Vec<u32>) {
    let mut e = ssd_engine();
    let a: Vec<u32> = (0..24).collect();
    e.add_request(request(1, a.clone(), 1)).unwrap();
    run(&mut e);
    for (id, start) in [(2, 500), (3, 1000)] {
        e.add_request(request(id, (start..start + 24).collect(), 1))
            .unwrap();
        run(&mut e);
    }
    (e, a)
}

#[test]
fn a_prefix_demoted_to_the_ssd_loads_from_it_counted_in_the_step_and_per_tier() {
    let (mut e, a) = a_prefix_demoted_to_the_ssd();
    let m = e.metrics();
    assert_eq!(m.cpu_blocks, 2, "the CPU tier is full, not over");
    assert!(m.ssd_blocks >= 5, "{m:?}");
    let before = e.metrics();
    e.add_request(request(4, a, 1)).unwrap();
    let step = e.step();
    assert_eq!(step.work.ssd_blocks_loaded, 5, "{:?}", step.work);
    assert_eq!(
        step.work.prefill_tokens, 4,
        "only the last block is computed"
    );
    let latency = &e.config().latency;
    let without_load = latency.step_seconds(&StepWork {
        ssd_blocks_loaded: 0,
        ..step.work
    });
    let load = step.duration_s - without_load;
    let expected = latency.ssd_load_latency_s + 5.0 * latency.ssd_load_per_block_s;
    assert!((load - expected).abs() < 1e-12, "{load} vs {expected}");
    let after = e.metrics();
    assert_eq!(after.ssd_hit_tokens - before.ssd_hit_tokens, 20);
    assert_eq!(after.cpu_hit_tokens, before.cpu_hit_tokens);
    assert_eq!(
        after.ssd_bytes_loaded - before.ssd_bytes_loaded,
        20 * e.config().kv_bytes_per_token as u64
    );
    // vLLM's counters keep their meaning: GPU hits are GPU hits, offloaded ones are external.
    assert_eq!(after.prefix_cache_hits, before.prefix_cache_hits);
    assert_eq!(
        after.external_prefix_cache_hits - before.external_prefix_cache_hits,
        20
    );
    let (out, _, _) = run(&mut e);
    let first = step.tokens.first().or(out.first()).unwrap();
    assert_eq!(first.cached_tokens, 20);
}

#[test]
fn a_block_loaded_from_the_ssd_is_promoted_back_to_the_gpu() {
    let (mut e, a) = a_prefix_demoted_to_the_ssd();
    e.add_request(request(4, a.clone(), 1)).unwrap();
    run(&mut e);
    assert_eq!(e.cached_prefix_blocks(&a, None, None), 5, "back on the GPU");
    e.add_request(request(5, a, 1)).unwrap();
    let step = e.step();
    assert_eq!(
        (step.work.cpu_blocks_loaded, step.work.ssd_blocks_loaded),
        (0, 0),
        "a GPU hit loads nothing"
    );
}

#[test]
fn a_block_one_engine_writes_to_the_shared_fs_is_loaded_by_another_at_shared_bandwidth() {
    use shared_fs::{SharedFs, SharedFsConfig};
    let fs = SharedFs::handle(SharedFsConfig {
        capacity_blocks: 64,
        bandwidth_bytes_per_s: 1e9,
        latency_s: 1e-3,
    });
    let mut writer = engine(8);
    let mut readers = [in_step_engine(8), in_step_engine(8)];
    writer.mount_shared_fs(fs.clone());
    for reader in &mut readers {
        reader.mount_shared_fs(fs.clone());
    }
    let a: Vec<u32> = (0..24).collect();
    writer.add_request(request(1, a.clone(), 1)).unwrap();
    run(&mut writer);
    // Two more prompts evict every block of `a` from the writer's GPU.
    let mut events = Vec::new();
    for (id, start) in [(2, 500), (3, 1000)] {
        writer
            .add_request(request(id, (start..start + 24).collect(), 1))
            .unwrap();
        events.extend(run(&mut writer).2);
    }
    assert!(
        events
            .iter()
            .any(|e| matches!(e, KvEvent::BlockStored(s) if s.medium.as_deref() == Some("FS"))),
        "the writer publishes its FS stores"
    );
    assert!(writer.metrics().shared_fs_blocks >= 5);
    // Both readers, which never saw the prompt, load its prefix from the shared tier at once:
    // the second waits for the first's bytes.
    let bytes = (5 * 4 * readers[0].config().kv_bytes_per_token) as f64;
    let mut loads = Vec::new();
    for (i, reader) in readers.iter_mut().enumerate() {
        reader
            .add_request(request(10 + i as u64, a.clone(), 1))
            .unwrap();
        let step = reader.step_at(100.0);
        assert_eq!(step.work.prefill_tokens, 4, "only the last block computed");
        loads.push(step.work.shared_fs_load_s);
        assert_eq!(reader.metrics().shared_fs_hit_tokens, 20);
        assert_eq!(reader.metrics().external_prefix_cache_hits, 20);
        assert_eq!(reader.metrics().prefix_cache_hits, 0);
    }
    let alone = 1e-3 + bytes / 1e9;
    assert!((loads[0] - alone).abs() < 1e-9, "{loads:?}");
    assert!((loads[1] - (alone + bytes / 1e9)).abs() < 1e-9, "{loads:?}");
}

#[test]
fn an_engine_mounting_another_filesystem_does_not_see_these_blocks() {
    use shared_fs::{SharedFs, SharedFsConfig};
    let fs = SharedFs::handle(SharedFsConfig {
        capacity_blocks: 64,
        ..SharedFsConfig::default()
    });
    let mut writer = engine(8);
    writer.mount_shared_fs(fs);
    let a: Vec<u32> = (0..24).collect();
    writer.add_request(request(1, a.clone(), 1)).unwrap();
    run(&mut writer);
    for (id, start) in [(2, 500), (3, 1000)] {
        writer
            .add_request(request(id, (start..start + 24).collect(), 1))
            .unwrap();
        run(&mut writer);
    }
    // Another fleet's filesystem, of the same shape: what the writer stored is not there.
    let mut other = engine(8);
    other.mount_shared_fs(SharedFs::handle(SharedFsConfig {
        capacity_blocks: 64,
        ..SharedFsConfig::default()
    }));
    other.add_request(request(3, a, 1)).unwrap();
    let step = other.step();
    assert_eq!(step.work.prefill_tokens, 24);
    assert_eq!(step.work.shared_fs_load_s, 0.0);
}

#[test]
fn a_negative_non_finite_or_past_an_hour_latency_is_a_configuration_error() {
    for bad in [-1e-3, 1e300, f64::NAN, f64::INFINITY] {
        for field in [0, 1] {
            let mut config = EngineConfig::default();
            let latency = &mut config.latency;
            *[
                &mut latency.ssd_load_per_block_s,
                &mut latency.step_overhead_s,
            ][field] = bad;
            assert!(
                matches!(Engine::new(config), Err(SimError::Config(_))),
                "{bad}"
            );
        }
    }
    let mut config = engine(8).config;
    config.latency.prefill_per_token_s = MAX_LATENCY_S;
    assert!(Engine::new(config).is_ok(), "an hour is allowed");
}

#[test]
fn a_pooled_engine_holds_every_engines_tiers() {
    let one = EngineConfig {
        num_gpu_blocks: 10,
        num_cpu_blocks: 20,
        num_ssd_blocks: 30,
        ..EngineConfig::default()
    };
    let pooled = one.pooled(4);
    assert_eq!(
        (
            pooled.num_gpu_blocks,
            pooled.num_cpu_blocks,
            pooled.num_ssd_blocks
        ),
        (40, 80, 120)
    );
    assert_eq!(pooled.block_size, one.block_size);
}
