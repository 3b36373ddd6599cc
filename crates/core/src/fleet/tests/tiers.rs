//! Tiers below the GPU: prefixes held in CPU memory, storage or a shared filesystem, what
//! loading them costs, and the load rates learned from requests and engines' counters.

use super::*;
use crate::load_counters::TierLoadCounters;

#[test]
fn a_prefix_only_on_cpu_is_credited_when_loading_beats_recomputing() {
    let mut fleet = FleetBuilder::new(2).build();
    let shared = prompt(2048, 9);
    fleet.apply_events(EndpointId(0), &offloaded_only(&shared, "CPU"), 0.0);
    let mut tokens = shared.clone();
    tokens.extend(prompt(256, 10));
    let plan = fleet.plan(&Req::new(&tokens).features(), 1, 0.0);
    assert_eq!(plan.decision.chosen(), Some(EndpointId(0)));
    let on_cpu = plan.decision.assessment(EndpointId(0)).unwrap();
    let recompute = plan.decision.assessment(EndpointId(1)).unwrap();
    let cpu = on_cpu.cost.tiers.tiers[crate::tiers::LoadTier::Cpu as usize];
    assert_eq!(cpu.tokens, 2048);
    assert!(!cpu.slower_than_recompute);
    assert!(on_cpu.predicted_ttft_s < recompute.predicted_ttft_s);
    assert_eq!(plan.predicted_tiers[0], [2048, 0, 0]);
    assert!(!on_cpu.tier_uncertain);
}

/// CPU memory is a cache too: once its events showed the tier's capacity (it removed a block
/// while full), what the queue ahead offloads beyond the tier's free blocks is expected to push
/// out part of a prefix held there, and that part is charged as recomputed.
#[test]
fn a_full_cpu_tier_loses_to_the_queue_ahead_what_it_offloads_beyond_its_room() {
    let mut fleet = FleetBuilder::new(2).build();
    let doc = prompt(2048, 9);
    let old = prompt(BS, 3);
    fleet.apply_events(EndpointId(0), &offloaded_only(&old, "CPU"), 0.0);
    fleet.apply_events(EndpointId(0), &offloaded_only(&doc, "CPU"), 0.0);
    // A prefill of 64 new blocks queued ahead on endpoint 0.
    send_to(&mut fleet, &Req::new(&prompt(1024, 5)), EndpointId(0), 0.1);
    let mut question = doc.clone();
    question.extend(prompt(256, 10));
    let lost = |fleet: &mut Fleet| {
        let plan = fleet.plan(&Req::new(&question).features(), 1, 0.2);
        let a = plan.decision.assessment(EndpointId(0)).unwrap();
        (
            a.cost.cpu_lost_ahead_tokens,
            a.cost.tiers.tiers[crate::tiers::LoadTier::Cpu as usize].tokens,
        )
    };
    // Its CPU tier has not evicted yet: the whole document loads.
    assert_eq!(lost(&mut fleet), (0.0, 2048));
    // It drops the oldest block while holding 129: its capacity. The queue ahead offloads 64
    // blocks into 1 free one, so each held block goes with probability 63 / 129.
    let KvEvent::BlockStored(old_blocks) = stored(&old, BS) else {
        unreachable!()
    };
    let dropped = KvEvent::BlockRemoved(crate::event::BlockRemoved {
        block_hashes: old_blocks.block_hashes,
        medium: Some("CPU".into()),
        group_idx: None,
    });
    fleet.apply_events(EndpointId(0), &[dropped], 0.15);
    let (cpu_lost, cpu_tokens) = lost(&mut fleet);
    let expected: f64 = 2048.0 * 63.0 / 129.0;
    assert!(
        (cpu_lost - expected).abs() < 1e-6,
        "{cpu_lost} vs {expected}"
    );
    assert_eq!(cpu_tokens, (2048.0 - expected) as usize);
}

#[test]
fn a_tier_slower_than_recompute_gets_no_credit_and_explain_says_so() {
    let mut fleet = FleetBuilder::new(2).build();
    // A storage tier at 5k tokens/s against a 20k tokens/s prefill.
    fleet.profile.tiers.storage_tokens_per_s = 5_000.0;
    let shared = prompt(2048, 11);
    fleet.apply_events(EndpointId(0), &offloaded_only(&shared, "STORAGE"), 0.0);
    let plan = fleet.plan(&Req::new(&shared).features(), 1, 0.0);
    assert_eq!(
        plan.decision.chosen(),
        Some(EndpointId(1)),
        "recomputing wins"
    );
    let slow = plan.decision.assessment(EndpointId(0)).unwrap();
    let storage = slow.cost.tiers.tiers[crate::tiers::LoadTier::Storage as usize];
    assert!(storage.slower_than_recompute, "{storage:?}");
    assert!(storage.seconds > storage.recompute_s);
}

#[test]
fn a_shared_tier_prefix_is_a_hit_on_every_endpoint_that_mounts_it() {
    // Endpoints 0 and 1 declare the mount in their specs, as the router's config does.
    let mut builder = FleetBuilder::new(3);
    for e in [0, 1] {
        builder.specs[e].offload = lustre();
    }
    let mut fleet = builder.build();
    let doc = prompt(1024, 12);
    // Endpoint 0 wrote the blocks to the filesystem and then lost them from its GPU.
    fleet.apply_events(EndpointId(0), &offloaded_only(&doc, "FS"), 0.0);
    // Endpoint 0 is busy: the shared copy lets endpoint 1 serve it at load cost.
    for i in 0..3 {
        send(&mut fleet, &Req::new(&prompt(4096, 100 + i)), 0.0);
    }
    let plan = fleet.plan_every(&Req::new(&doc).features(), 1, 0.0);
    let m1 = plan.facts[1].index_match.unwrap();
    assert_eq!((m1.blocks, m1.shared_blocks), (64, 64));
    assert!(
        plan.facts[2].index_match.is_none(),
        "endpoint 2 mounts nothing"
    );
    // The whole prompt is there, but the engine recomputes its last block: never reported.
    assert_eq!(plan.predicted_tiers[1], [0, 0, 1024 - BS]);
    assert_ne!(plan.decision.chosen(), Some(EndpointId(2)));
}

#[test]
fn a_shared_load_waits_for_the_loads_already_sent_to_the_filesystem() {
    // Endpoints 0 and 1 mount the filesystem; endpoint 2 does not, and recomputes.
    let mut builder = FleetBuilder::new(3);
    for e in [0, 1] {
        builder.specs[e].offload = lustre();
    }
    let mut fleet = builder.build();
    let (first, second) = (prompt(2048, 21), prompt(2048, 22));
    for doc in [&first, &second] {
        fleet.apply_events(EndpointId(0), &offloaded_only(doc, "FS"), 0.0);
    }
    // Alone, a shared load (2,048 tokens at 25k tokens/s, 0.08 s) beats recomputing (at 20k
    // tokens/s, 0.1 s): the first goes to a mounted endpoint.
    let (plan, mut loading) = send(&mut fleet, &Req::new(&first), 0.0);
    assert_ne!(plan.decision.chosen(), Some(EndpointId(2)));
    // While it loads, the second would wait for its tokens on the filesystem (0.16 s in all):
    // the endpoint that recomputes is faster, though a mounted one is idle.
    let shared = crate::tiers::LoadTier::Shared as usize;
    let plan = fleet.plan_every(&Req::new(&second).features(), 1, 0.0);
    let idle_mounted = EndpointId(if loading.endpoint == EndpointId(0) {
        1
    } else {
        0
    });
    let queued = plan
        .decision
        .assessment(idle_mounted)
        .unwrap()
        .cost
        .tiers
        .tiers[shared];
    assert_eq!(queued.queued_tokens, (2048 - BS) as f64, "{queued:?}");
    assert!(queued.slower_than_recompute, "{queued:?}");
    assert_eq!(plan.decision.chosen(), Some(EndpointId(2)));
    // Once its first token came, the filesystem is free again.
    fleet.first_token(&mut loading, true, 0.05);
    let plan = fleet.plan_every(&Req::new(&second).features(), 1, 0.05);
    let free = plan
        .decision
        .assessment(idle_mounted)
        .unwrap()
        .cost
        .tiers
        .tiers[shared];
    assert_eq!(free.queued_tokens, 0.0);
    assert_ne!(plan.decision.chosen(), Some(EndpointId(2)));
}

#[test]
fn a_shared_tier_lesson_leaves_out_the_wait_for_loads_sent_ahead_of_it() {
    // The filesystem reads 40k tokens/s in all (the configured rate is 25k); every round,
    // endpoint 1's load is sent first and endpoint 0's waits for it.
    let mut builder = FleetBuilder::new(2);
    for e in [0, 1] {
        builder.specs[e].offload = lustre();
    }
    let mut fleet = builder.build();
    let (prefill_rate, fs_rate) = (10_000.0, 40_000.0);
    // Rounds 0.5 s apart: the engines announce nothing here, and 30 s of silence would
    // distrust their events.
    let mut now = 0.0;
    // Endpoint 0's own line: untiered requests alone, of several sizes.
    now = teach_prefill_line(&mut fleet, EndpointId(0), prefill_rate, 500, now, 0.5);
    let doc = prompt(4096, 15);
    fleet.apply_events(EndpointId(1), &offloaded_only(&doc, "FS"), now);
    for i in 0..40 {
        let request = |salt| {
            let mut tokens = doc.clone();
            tokens.extend(prompt(512, salt));
            Req::new(&tokens)
        };
        let (ahead, waiting) = (request(600 + 2 * i), request(601 + 2 * i));
        let plan = fleet.plan(&ahead.features(), 7, now);
        let mut first = fleet.dispatched(
            &plan.predicted_cached,
            &ahead.features(),
            EndpointId(1),
            now,
        );
        let plan = fleet.plan(&waiting.features(), 7, now);
        let mut second = fleet.dispatched(
            &plan.predicted_cached,
            &waiting.features(),
            EndpointId(0),
            now,
        );
        assert_eq!(second.tier_tokens, [0, 0, 4096]);
        let first_at = now + 4096.0 / fs_rate + 512.0 / prefill_rate;
        let second_at = now + 8192.0 / fs_rate + 512.0 / prefill_rate;
        fleet.first_token(&mut first, true, first_at);
        fleet.first_token(&mut second, true, second_at);
        for d in [first, second] {
            let cached = d.predicted_cached;
            fleet.finished(d, Some(cached), second_at);
        }
        now += 0.5;
    }
    let shared = crate::tiers::LoadTier::Shared;
    let rates = fleet.endpoint(EndpointId(0)).unwrap().tier_rates();
    let learned = rates.rate(shared, &fleet.profile.tiers);
    assert!(rates.samples[shared as usize] > 30, "{rates:?}");
    assert!(
        (learned - fs_rate).abs() / fs_rate < 0.05,
        "learned {learned:.0} tokens/s, the filesystem reads {fs_rate:.0}"
    );
}

fn lustre() -> crate::index::OffloadSpec {
    crate::index::OffloadSpec {
        block_size: None,
        shared: Some(crate::index::SharedMount::new("lustre")),
    }
}

#[test]
fn an_endpoint_joining_later_mounts_what_its_spec_says_even_in_a_reused_slot() {
    let mut builder = FleetBuilder::new(2);
    builder.specs[0].offload = lustre();
    let mut fleet = builder.build();
    let doc = prompt(1024, 12);
    fleet.apply_events(EndpointId(0), &offloaded_only(&doc, "FS"), 0.0);
    // A pod that mounts the filesystem joins: the shared copy is a hit there at once.
    let mut mounted = spec("joined", BS);
    mounted.offload = lustre();
    let joined = fleet.add_endpoint(mounted, 1.0).unwrap();
    let plan = fleet.plan_every(&Req::new(&doc).features(), 1, 1.0);
    let m = plan.facts[joined.0 as usize].index_match.unwrap();
    assert_eq!(m.shared_blocks, 64);
    // It leaves, and a pod without the mount takes its slot: no shared credit there.
    assert!(fleet.remove_endpoint(joined, 2.0));
    let t = 2.0 + FleetConfig::default().slot_reuse_after_s;
    let again = fleet.add_endpoint(spec("unmounted", BS), t).unwrap();
    assert_eq!(again, joined, "the slot is reused");
    let plan = fleet.plan_every(&Req::new(&doc).features(), 1, t);
    assert!(plan.facts[again.0 as usize].index_match.is_none());
}

#[test]
fn tier_load_rates_are_learned_from_requests_that_loaded() {
    let mut fleet = FleetBuilder::new(1).build();
    let (prefill_rate, cpu_rate) = (10_000.0, 60_000.0);
    let mut now = 0.0;
    // Learn the prefill rate first, from uncached prompts of several sizes (what a request
    // takes without loads).
    for i in 0..5 {
        let len = 1000 + 400 * i as usize;
        let (_, mut d) = send(&mut fleet, &Req::new(&prompt(len, 200 + i)), now);
        now += len as f64 / prefill_rate;
        fleet.first_token(&mut d, true, now);
        fleet.finished(d, Some(0), now);
    }
    let shared = prompt(4096, 13);
    fleet.apply_events(EndpointId(0), &offloaded_only(&shared, "CPU"), now);
    for i in 0..40 {
        let mut tokens = shared.clone();
        tokens.extend(prompt(512, 300 + i));
        let req = Req::new(&tokens);
        let (plan, mut d) = send(&mut fleet, &req, now);
        // The dispatch carries the plan's tier tokens: nobody has to copy them over.
        assert_eq!(plan.predicted_tiers[0], [4096, 0, 0]);
        assert_eq!(d.tier_tokens, [4096, 0, 0]);
        now += 512.0 / prefill_rate + 4096.0 / cpu_rate;
        fleet.first_token(&mut d, true, now);
        let cached = d.predicted_cached;
        fleet.finished(d, Some(cached), now);
        // The engine's own blocks for the new part are not announced here: the prefix stays
        // on the CPU tier only.
    }
    let e = fleet.endpoint(EndpointId(0)).unwrap();
    let learned = e
        .tier_rates()
        .rate(crate::tiers::LoadTier::Cpu, &fleet.profile.tiers);
    assert!(
        (learned - cpu_rate).abs() / cpu_rate < 0.05,
        "learned {learned:.0} tokens/s, true {cpu_rate:.0}"
    );
    assert_eq!(e.tier_rates().predicted_tokens, [40 * 4096, 0, 0]);
    assert_eq!(e.tier_rates().found_tokens, [40 * 4096, 0, 0]);
    // The loads are charged apart from the prefill, so the prefill rate leaves them out: read
    // with them, it would fall to 512 tokens in 0.12 s, about 4,300 tokens/s, and a prompt
    // computed anew would be priced at more than twice its time.
    let prefill = e.observed_prefill_rate().unwrap();
    assert!(
        (prefill - prefill_rate).abs() / prefill_rate < 0.1,
        "prefill rate {prefill:.0} tokens/s, true {prefill_rate:.0}"
    );
}

#[test]
fn a_request_that_shared_its_endpoint_teaches_no_tier_rate() {
    let mut fleet = FleetBuilder::new(1).build();
    let id = EndpointId(0);
    let shared = prompt(1024, 22);
    fleet.apply_events(id, &offloaded_only(&shared, "CPU"), 0.0);
    // A request decoding there already: the tiered one's first token waits on its steps.
    let busy = Req::new(&prompt(512, 23));
    let plan = fleet.plan(&busy.features(), 7, 0.0);
    let mut first = fleet.dispatched(&plan.predicted_cached, &busy.features(), id, 0.0);
    fleet.first_token(&mut first, true, 0.05);
    let mut tokens = shared.clone();
    tokens.extend(prompt(256, 24));
    let tiers = serve_on(&mut fleet, &Req::new(&tokens), id, 0.1, 0.2);
    assert_eq!(tiers, [1024, 0, 0]);
    let rates = fleet.endpoint(id).unwrap().tier_rates();
    assert_eq!(rates.samples, [0; 3], "not alone: no lesson");
    assert_eq!(rates.predicted_tokens, [1024, 0, 0], "still counted");
    fleet.finished(first, Some(0), 0.3);
}

/// Sends `req` to `endpoint` at `now`; its first token comes `ttft` later and the engine
/// reports its predicted cached tokens. Returns the dispatch's tier tokens.
fn serve_on(fleet: &mut Fleet, req: &Req, endpoint: EndpointId, now: f64, ttft: f64) -> TierTokens {
    let plan = fleet.plan(&req.features(), 7, now);
    let mut d = fleet.dispatched(&plan.predicted_cached, &req.features(), endpoint, now);
    fleet.first_token(&mut d, true, now + ttft);
    let (cached, tiers) = (d.predicted_cached, d.tier_tokens);
    fleet.finished(d, Some(cached), now + ttft);
    tiers
}

/// Serves five uncached prompts of several sizes (1,000 to 2,600 tokens, seeds from `seed`) on
/// `endpoint` at `prefill_rate`, `spacing` seconds apart from `now`: the endpoint's own prefill
/// line, which tier lessons need. The time after them.
fn teach_prefill_line(
    fleet: &mut Fleet,
    endpoint: EndpointId,
    prefill_rate: f64,
    seed: u32,
    mut now: f64,
    spacing: f64,
) -> f64 {
    for i in 0..5 {
        let len = 1000 + 400 * i as usize;
        let req = Req::new(&prompt(len, seed + i as u32));
        serve_on(fleet, &req, endpoint, now, len as f64 / prefill_rate);
        now += spacing;
    }
    now
}

#[test]
fn tier_lessons_wait_for_the_endpoints_own_line() {
    // Endpoint 0 has only served tiered requests: it cannot tell their loads from the rest of
    // their time (the fleet's prefill rate is an average, not its fixed part and slope), so
    // it learns nothing and the configured rate stands, until it has run untiered ones alone.
    let mut fleet = FleetBuilder::new(2).build();
    let (prefill_rate, cpu_rate) = (8_000.0, 60_000.0);
    let mut now = 0.0;
    now = teach_prefill_line(&mut fleet, EndpointId(1), prefill_rate, 400, now, 0.3);
    let shared = prompt(4096, 14);
    fleet.apply_events(EndpointId(0), &offloaded_only(&shared, "CPU"), now);
    let tiered = |fleet: &mut Fleet, now: &mut f64, salt: u32| {
        let mut tokens = shared.clone();
        tokens.extend(prompt(1024, salt));
        let ttft = 1024.0 / prefill_rate + 4096.0 / cpu_rate;
        let tiers = serve_on(fleet, &Req::new(&tokens), EndpointId(0), *now, ttft);
        assert_eq!(tiers, [4096, 0, 0]);
        // Well within the trust's patience for the suffix blocks nobody announces here.
        *now += 0.3;
    };
    for i in 0..10 {
        tiered(&mut fleet, &mut now, 500 + i);
    }
    let rates = *fleet.endpoint(EndpointId(0)).unwrap().tier_rates();
    assert_eq!(rates.samples, [0; 3], "no line of its own: no lesson");
    now = teach_prefill_line(&mut fleet, EndpointId(0), prefill_rate, 800, now, 0.3);
    for i in 0..30 {
        tiered(&mut fleet, &mut now, 900 + i);
    }
    let learned = fleet
        .endpoint(EndpointId(0))
        .unwrap()
        .tier_rates()
        .rate(crate::tiers::LoadTier::Cpu, &fleet.profile.tiers);
    assert!(
        (learned - cpu_rate).abs() / cpu_rate < 0.05,
        "learned {learned:.0} tokens/s, true {cpu_rate:.0}"
    );
}

#[test]
fn tier_lessons_leave_out_what_every_request_pays_whatever_it_loads() {
    // Every first token costs a fixed 30 ms (a step's fixed cost and the decodes batched with
    // it) plus 32 µs per uncached token; the CPU loads 200k tokens/s. A request that loads a
    // 512-token prefix and computes 256 new tokens must teach the CPU rate, not the 30 ms.
    let (fixed, per_token, cpu_rate) = (0.030, 32e-6, 200_000.0);
    let ttft = |uncached: usize, loaded: usize| {
        fixed + uncached as f64 * per_token + loaded as f64 / cpu_rate
    };
    let mut fleet = FleetBuilder::new(1).build();
    let id = EndpointId(0);
    let mut now = 0.0;
    for i in 0..10 {
        let len = 300 + 200 * i;
        serve_on(
            &mut fleet,
            &Req::new(&prompt(len, 600 + i as u32)),
            id,
            now,
            ttft(len, 0),
        );
        now += 0.3;
    }
    let shared = prompt(512, 21);
    fleet.apply_events(id, &offloaded_only(&shared, "CPU"), now);
    for i in 0..40 {
        let mut tokens = shared.clone();
        tokens.extend(prompt(256, 700 + i));
        let tiers = serve_on(&mut fleet, &Req::new(&tokens), id, now, ttft(256, 512));
        assert_eq!(tiers, [512, 0, 0]);
        now += 0.3;
    }
    let learned = fleet
        .endpoint(id)
        .unwrap()
        .tier_rates()
        .rate(crate::tiers::LoadTier::Cpu, &fleet.profile.tiers);
    assert!(
        (learned - cpu_rate).abs() / cpu_rate < 0.1,
        "learned {learned:.0} tokens/s, true {cpu_rate:.0}"
    );
}

#[test]
fn tier_tokens_never_exceed_what_the_engine_can_report() {
    let mut fleet = FleetBuilder::new(1).build();
    // The whole prompt, every block of it, survives on the CPU only.
    let doc = prompt(2048, 15);
    fleet.apply_events(EndpointId(0), &offloaded_only(&doc, "CPU"), 0.0);
    let req = Req::new(&doc);
    let plan = fleet.plan(&req.features(), 7, 0.0);
    assert_eq!(plan.predicted_cached[0], 2048 - BS);
    assert_eq!(plan.predicted_tiers[0], [2048 - BS, 0, 0]);
    let d = fleet.dispatched(&plan.predicted_cached, &req.features(), EndpointId(0), 0.0);
    assert_eq!(d.tier_tokens, [2048 - BS, 0, 0]);
    // The engine finds all it can: every predicted tier token counts as found.
    fleet.finished(d, Some(2048 - BS), 1.0);
    let rates = fleet.endpoint(EndpointId(0)).unwrap().tier_rates();
    assert_eq!(rates.found_tokens, rates.predicted_tokens);
}

#[test]
fn the_engines_tier_counters_are_counted_and_split_partial_finds() {
    let mut fleet = FleetBuilder::new(1).build();
    let id = EndpointId(0);
    fleet.observe_engine_tier_loads(id, tokens_only([Some(100.0), None, Some(0.0)]), 0.0);
    let cpu = prompt(1024, 16);
    fleet.apply_events(id, &offloaded_only(&cpu, "CPU"), 0.0);
    let mut tokens = cpu.clone();
    tokens.extend(prompt(512, 17));
    let req = Req::new(&tokens);
    let plan = fleet.plan(&req.features(), 7, 0.0);
    let d = fleet.dispatched(&plan.predicted_cached, &req.features(), id, 0.0);
    assert_eq!(d.tier_tokens, [1024, 0, 0]);
    fleet.finished(d, Some(1024), 1.0);
    // The engine's counters: it loaded all 1,024 from the CPU.
    fleet.observe_engine_tier_loads(id, tokens_only([Some(1124.0), None, Some(0.0)]), 1.0);
    let rates = *fleet.endpoint(id).unwrap().tier_rates();
    assert_eq!(rates.engine_loaded_tokens, [1024, 0, 0]);
    assert_eq!(rates.engine_found_fraction[0], Some(1.0));
    assert_eq!(rates.engine_found_fraction[1], None, "not reported");
    // A counter that goes backwards (a restart) adds nothing.
    fleet.observe_engine_tier_loads(id, tokens_only([Some(10.0), None, Some(0.0)]), 2.0);
    let rates = fleet.endpoint(id).unwrap().tier_rates();
    assert_eq!(rates.engine_loaded_tokens, [1024, 0, 0]);
}

/// An engine's per-tier counters of tokens loaded, without load times.
fn tokens_only(tokens: [Option<f64>; 3]) -> TierLoadCounters {
    TierLoadCounters {
        tokens,
        seconds: [None; 3],
    }
}

/// Tokens and load seconds loaded from the CPU tier and the shared one so far.
fn loaded(cpu: (f64, f64), shared: (f64, f64)) -> TierLoadCounters {
    TierLoadCounters {
        tokens: [Some(cpu.0), None, Some(shared.0)],
        seconds: [Some(cpu.1), None, Some(shared.1)],
    }
}

/// Under load no request runs alone, so none teaches a tier's rate by its time to first
/// token; the engine's own counters do: 100,000 CPU tokens in loads of 0.5 s in all, within a
/// five-second window, is 200,000 tokens per second, whatever else ran beside them.
#[test]
fn an_engines_load_counters_teach_its_cpu_tiers_rate_whatever_runs_beside() {
    let mut fleet = FleetBuilder::new(1).build();
    let id = EndpointId(0);
    let _busy: Vec<_> = (0..8)
        .map(|i| send(&mut fleet, &Req::new(&prompt(512, 100 + i)), 0.0).1)
        .collect();
    let cpu = crate::tiers::LoadTier::Cpu;
    let configured = fleet.profile.tiers.tokens_per_s(cpu);
    let rate = |fleet: &Fleet| fleet.endpoint(id).unwrap().tier_rates().learned[cpu as usize];
    fleet.observe_engine_tier_loads(id, loaded((0.0, 0.0), (0.0, 0.0)), 0.0);
    fleet.observe_engine_tier_loads(id, loaded((40_000.0, 0.2), (0.0, 0.0)), 2.0);
    assert_eq!(rate(&fleet), None, "a window of 2 s says nothing yet");
    let rates = *fleet.endpoint(id).unwrap().tier_rates();
    assert_eq!(rates.rate(cpu, &fleet.profile.tiers), configured);
    fleet.observe_engine_tier_loads(id, loaded((100_000.0, 0.5), (0.0, 0.0)), 5.0);
    let learned = rate(&fleet).unwrap();
    assert!((learned - 200_000.0).abs() < 1e-6, "{learned}");
    let rates = fleet.endpoint(id).unwrap().tier_rates();
    assert_eq!(rates.engine_loaded_tokens[cpu as usize], 100_000);
    // Loads that overlap for the whole next window: the link read 30,000 tokens a second.
    fleet.observe_engine_tier_loads(id, loaded((250_000.0, 10.5), (0.0, 0.0)), 10.0);
    let learned = rate(&fleet).unwrap();
    let expected = 1.0 / (0.8 / 200_000.0 + 0.2 / 30_000.0);
    assert!(
        (learned - expected).abs() < 1e-6,
        "{learned} against {expected}"
    );
}

/// A shared filesystem is one device for every endpoint that mounts it: its rate is what all
/// of them loaded over a window, and it becomes every mounting endpoint's, not the share one
/// endpoint's loads saw (the shared backlog already charges the queue ahead).
#[test]
fn a_shared_filesystems_rate_is_learned_from_all_its_endpoints_loads_together() {
    let mut builder = FleetBuilder::new(3);
    builder.specs[0].offload = lustre();
    builder.specs[1].offload = lustre();
    let mut fleet = builder.build();
    let shared = crate::tiers::LoadTier::Shared;
    for id in [EndpointId(0), EndpointId(1)] {
        fleet.observe_engine_tier_loads(id, loaded((0.0, 0.0), (0.0, 0.0)), 0.0);
    }
    // Each endpoint reads 30,000 tokens a second in loads that overlap (1.5 s of load time
    // per second): together the filesystem read 60,000 tokens a second.
    for second in 1..=6 {
        let t = f64::from(second);
        for id in [EndpointId(0), EndpointId(1)] {
            let counters = loaded((0.0, 0.0), (30_000.0 * t, 1.5 * t));
            fleet.observe_engine_tier_loads(id, counters, t);
        }
    }
    // The window is read at the first scrape that completes it, before the other endpoint's
    // last second is in: at least the two endpoints' loads together over all but that
    // second, never more than the filesystem's 60,000, and far above one endpoint's share.
    for id in [EndpointId(0), EndpointId(1)] {
        let learned = fleet.endpoint(id).unwrap().tier_rates().learned[shared as usize];
        let learned = learned.expect("learned from the window");
        assert!(
            (50_000.0..=60_000.0).contains(&learned),
            "{id:?}: {learned}"
        );
    }
    let unmounted = fleet.endpoint(EndpointId(2)).unwrap().tier_rates();
    assert_eq!(
        unmounted.learned[shared as usize], None,
        "it mounts nothing"
    );
}
