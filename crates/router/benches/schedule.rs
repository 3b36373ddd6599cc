//! The router's per-request CPU work, sampled one call at a time so that tail percentiles can
//! be reported (criterion reports medians only).
//!
//! Fixture: 16 endpoints, a request of 8,192 tokens (512 blocks of 16). Endpoint *i* holds the
//! first (*i* + 1)/16 of the request in the KV index, so every endpoint matches a different
//! prefix and the last one holds all of it; the index also holds about 1M unshared entries so
//! that its block table is production-sized. The router is a real `Router` built from YAML with
//! 16 endpoints (no server, no background tasks: nothing else touches it while it is timed).
//!
//! Timed, each call on its own with `Instant` (setup outside the timed region):
//!
//! - `schedule()` over 16 candidates whose `cache.precise` is `Some(PrefixMatch)`;
//! - `KvIndex::lookup` of the request's 512 keys;
//! - `Router::route` end to end (index lookup under its lock, history and predicted overlay,
//!   trust, load, scheduling, metrics), with an empty and with a filled routing history, and
//!   with the CPU caches evicted before each call; and the routing-history lookup alone;
//! - `Router::prepare` for a request given as token ids (router keys only) and for an 8k-token
//!   chat request (tokenization cache hit and miss);
//! - the built-in tokenizer (chat template + encode) and `router_keys` alone;
//! - parsing the JSON bodies (`parse_chat`, `parse_completion`).
//!
//! Run with `cargo bench -p kvroute-router --bench schedule` (about 30 s).

// Measures real processes and sockets: wall-clock time, not the router's (tokio) clock.
#![allow(clippy::disallowed_methods)]

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_core::event::{BlockStored, EngineHash, KvEvent};
use kvroute_core::fleet::RequestFeatures;
use kvroute_core::index::{EndpointId, PrefixMatch};
use kvroute_core::keys::{RouterKey, router_keys, router_keys_from};
use kvroute_core::schedule::{
    CacheView, Candidate, EndpointLoad, Profile, RequestInfo, Role, schedule,
};
use kvroute_router::config::RouterConfig;
use kvroute_router::testing::{Router, prepare_request};
use kvroute_testkit::random::tokens;
use kvroute_vllm::openai::{GenerationRequest, Input, parse_chat, parse_completion};
use kvroute_vllm::tokenizer::{BuiltinTokenizer, Chat, ChatMessage};

/// Tokens per block.
const BLOCK_SIZE: usize = 16;
/// Endpoints in the fleet.
const ENDPOINTS: usize = 16;
/// Prompt length of the request.
const PROMPT_TOKENS: usize = 8_192;
/// Unshared (block, endpoint) entries besides the request's.
const BACKGROUND: usize = 1_000_000;
/// Blocks per background chain.
const CHAIN_BLOCKS: usize = 256;
/// Blocks per `BlockStored` event.
const EVENT_BLOCKS: usize = 16;
/// Bytes written to evict the caches before a "cold" sample (several times the L3).
const FLUSH_BYTES: usize = 96 << 20;

/// The engine hash an endpoint publishes for a block (any value unique per block will do).
fn engine_hash(key: RouterKey) -> EngineHash {
    EngineHash(key.0.rotate_left(23) ^ 0x6a09_e667_f3bc_c909)
}

/// `BlockStored` events storing the chain `keys`/`toks` (whose first block's parent is
/// `parent`), `EVENT_BLOCKS` blocks per event.
fn stores(keys: &[RouterKey], toks: &[u32], parent: Option<EngineHash>) -> Vec<KvEvent> {
    keys.chunks(EVENT_BLOCKS)
        .enumerate()
        .map(|(c, chunk)| {
            let at = c * EVENT_BLOCKS;
            let parent = if at == 0 {
                parent
            } else {
                Some(engine_hash(keys[at - 1]))
            };
            KvEvent::BlockStored(BlockStored {
                block_hashes: chunk.iter().map(|k| engine_hash(*k)).collect(),
                parent_block_hash: parent,
                token_ids: toks[at * BLOCK_SIZE..(at + chunk.len()) * BLOCK_SIZE].to_vec(),
                block_size: BLOCK_SIZE as u32,
                medium: Some("GPU".into()),
                ..Default::default()
            })
        })
        .collect()
}

/// Blocks endpoint `i` holds of the request.
fn held_blocks(i: usize, blocks: usize) -> usize {
    (i + 1) * blocks / ENDPOINTS
}

/// A router with 16 endpoints (events configured, so their index is trusted) whose index holds
/// the request's prefixes and the background entries. Returns it with the request's tokens
/// and keys.
fn router_fixture() -> (Router, Vec<u32>, Vec<RouterKey>) {
    let mut yaml = String::from(
        "listen: 127.0.0.1:0\nadmin: {listen: 127.0.0.1:0}\nmodels: [{name: sim-llama-3.1-8b}]\n\
         cache: {history_ttl_s: 86400, predicted_ttl_s: 86400}\nendpoints:\n",
    );
    for i in 0..ENDPOINTS {
        yaml.push_str(&format!(
            "  - {{url: 'http://127.0.0.1:{}', events: 'tcp://127.0.0.1:{}'}}\n",
            20_000 + i,
            21_000 + i
        ));
    }
    let config = RouterConfig::from_yaml(&yaml).expect("valid configuration");
    let router = Router::new(config).expect("router");
    let index = router
        .fleet()
        .index_of(EndpointId(0))
        .cloned()
        .expect("an index");
    let prompt = tokens(1, PROMPT_TOKENS);
    let keys = router_keys(&prompt, BLOCK_SIZE, None).expect("block size");
    let blocks = keys.len();
    for i in 0..ENDPOINTS {
        let held = held_blocks(i, blocks);
        let events = stores(&keys[..held], &prompt[..held * BLOCK_SIZE], None);
        index.apply(EndpointId(i as u32), &events);
    }
    // Background: unshared chains, each continuing a short private root block so that they
    // never collide with the request.
    let per_endpoint = BACKGROUND / ENDPOINTS;
    for i in 0..ENDPOINTS {
        let mut stored = 0;
        let mut chain = 0u64;
        while stored < per_endpoint {
            let len = CHAIN_BLOCKS.min(per_endpoint - stored);
            let seed = (1 << 40) + ((i as u64) << 24) + chain;
            let toks = tokens(seed, len * BLOCK_SIZE);
            let chain_keys =
                router_keys_from(RouterKey(seed), &toks, BLOCK_SIZE, None).expect("block size");
            for event in stores(&chain_keys, &toks, None) {
                index.apply(EndpointId(i as u32), std::slice::from_ref(&event));
            }
            stored += len;
            chain += 1;
        }
    }
    (router, prompt, keys)
}

/// 16 candidates as the router builds them for the request: healthy, each with a different
/// precise prefix and a little load.
fn candidates(blocks: usize) -> Vec<Candidate> {
    (0..ENDPOINTS)
        .map(|i| {
            let held = held_blocks(i, blocks) as u32;
            Candidate {
                endpoint: EndpointId(i as u32),
                healthy: true,
                ejected: false,
                circuit_open: false,
                serves_model: true,
                role: Role::Both,
                load: EndpointLoad {
                    waiting: Some((i % 3) as f64),
                    running: Some((8 + i % 5) as f64),
                    kv_usage: Some(0.3 + 0.02 * i as f64),
                    inflight: (i % 4) as u32,
                    inflight_prefills: (i % 2) as u32,
                    inflight_prefill_tokens: (i % 2 * 2_000) as u64,
                    ..EndpointLoad::default()
                },
                cache: CacheView {
                    index: Some(PrefixMatch {
                        endpoint: EndpointId(i as u32),
                        blocks: held,
                        gpu_blocks: held,
                        cpu_blocks: 0,
                        storage_blocks: 0,
                        shared_blocks: 0,
                    }),
                    ..CacheView::default()
                },
                prefill_tokens_per_s: 20_000.0,
                tier_rates: Default::default(),
                cache_fill: 0.9,
            }
        })
        .collect()
}

/// A chat of about `target` tokens under the built-in tokenizer: a system prompt and
/// alternating turns of pseudo-random words. `salt` changes the last message.
fn chat(target: usize, salt: u64) -> Vec<ChatMessage> {
    let words = tokens(7, 200_000);
    let mut next = words.iter();
    let mut word = || {
        let w = *next.next().expect("enough words");
        let len = 2 + (w % 9) as usize;
        (0..len)
            .map(|k| char::from(b'a' + ((w >> (k * 2)) % 26) as u8))
            .collect::<String>()
    };
    let tok = BuiltinTokenizer;
    let mut messages = vec![ChatMessage::new("system", String::new())];
    let mut turn = 0;
    loop {
        let total = tok.encode(&tok.apply_chat_template(&messages, true)).len();
        if total >= target {
            break;
        }
        let limit = if turn == 0 { 1_000 } else { 600 };
        if tok.encode(&messages[messages.len() - 1].content).len() >= limit {
            turn += 1;
            messages.push(ChatMessage::new(
                if turn % 2 == 1 { "user" } else { "assistant" },
                String::new(),
            ));
            continue;
        }
        // Grow in chunks of ten words.
        let last = messages.last_mut().expect("non-empty");
        let mut text = last.content.clone();
        for _ in 0..10 {
            if !text.is_empty() {
                text.push(' ');
            }
            text.push_str(&word());
        }
        last.set_text(text);
    }
    if let Some(last) = messages.last_mut() {
        last.set_text(format!("{} #{salt}", last.content));
    }
    messages
}

/// A parsed request for the router.
fn request(input: Input) -> GenerationRequest {
    GenerationRequest {
        model: Some("sim-llama-3.1-8b".into()),
        input,
        max_tokens: Some(1),
        stream: false,
        include_usage: false,
        stream_options_given: false,
        cache_salt: None,
    }
}

/// Percentiles of one measurement, microseconds.
struct Row {
    name: String,
    samples: usize,
    p50: f64,
    p90: f64,
    p99: f64,
    max: f64,
}

/// Runs `f` (which returns the time of its timed part) `warmup` times unrecorded, then until
/// `samples` samples or `budget` has passed, and returns the percentiles.
fn sample(
    name: &str,
    warmup: usize,
    samples: usize,
    budget: Duration,
    mut f: impl FnMut() -> Duration,
) -> Row {
    for _ in 0..warmup {
        black_box(f());
    }
    let started = Instant::now();
    let mut times: Vec<Duration> = Vec::with_capacity(samples);
    while times.len() < samples && (times.len() < 50 || started.elapsed() < budget) {
        times.push(f());
    }
    times.sort_unstable();
    let at = |p: usize| times[(times.len() - 1) * p / 100].as_secs_f64() * 1e6;
    let row = Row {
        name: name.to_owned(),
        samples: times.len(),
        p50: at(50),
        p90: at(90),
        p99: at(99),
        max: times[times.len() - 1].as_secs_f64() * 1e6,
    };
    eprintln!(
        "  {:<58} n={:>6}  p50 {:>9.2}  p90 {:>9.2}  p99 {:>9.2}  max {:>9.1} µs",
        row.name, row.samples, row.p50, row.p90, row.p99, row.max
    );
    row
}

/// Times one call of `f`.
fn timed<R>(f: impl FnOnce() -> R) -> Duration {
    let start = Instant::now();
    black_box(f());
    start.elapsed()
}

/// Writes over a buffer several times the size of the last-level cache.
fn flush(buffer: &mut [u8], round: u8) {
    for line in buffer.chunks_mut(64) {
        line[0] = line[0].wrapping_add(round);
    }
    black_box(buffer);
}

/// A cheap xorshift for the scheduler's random input.
fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

fn main() {
    let budget = Duration::from_secs(3);
    let mut rows = Vec::new();
    eprintln!("building the fixture ({ENDPOINTS} endpoints, {BACKGROUND} background entries)...");
    let built = Instant::now();
    let (router, prompt, keys) = router_fixture();
    let index = router
        .fleet()
        .index_of(EndpointId(0))
        .cloned()
        .expect("an index");
    let entries = index.read(|i| i.entry_count());
    eprintln!(
        "  {} blocks in the request, {entries} index entries, built in {:.1} s",
        keys.len(),
        built.elapsed().as_secs_f64()
    );
    let model = "sim-llama-3.1-8b";

    rows.push(sample(
        "Instant::now() pair (timer overhead)",
        1_000,
        100_000,
        budget,
        || timed(|| ()),
    ));

    // 3. Scheduling.
    let profile = Profile::default();
    let cands = candidates(keys.len());
    let info = RequestInfo {
        prompt_tokens: PROMPT_TOKENS,
        block_size: BLOCK_SIZE,
        session_endpoint: None,
        role: Role::Both,
        prefix_key: None,
        gpu_copies: Default::default(),
    };
    let mut rng = 0x1234_5678_9abc_def0u64;
    let mut rr = 0u64;
    rows.push(sample(
        "schedule(), 16 candidates",
        2_000,
        100_000,
        budget,
        || {
            let random = xorshift(&mut rng);
            rr += 1;
            timed(|| schedule(&profile, &info, black_box(&cands), random, rr))
        },
    ));
    let decision = schedule(&profile, &info, &cands, 1, 0);
    eprintln!(
        "  (schedule chose {:?}, reason {})",
        decision.chosen(),
        decision.reason.as_str()
    );

    rows.push(index.read(|index| {
        sample(
            "KvIndex::lookup, 512 keys × 16 endpoints",
            1_000,
            50_000,
            budget,
            || timed(|| index.lookup(black_box(&keys))),
        )
    }));
    let matches = index.lookup(&keys);
    assert_eq!(matches.matches.len(), ENDPOINTS, "every endpoint matches");

    let prepared_tokens = request(Input::Tokens(prompt.clone()));
    let prepared = futures::executor::block_on(prepare_request(&router, &prepared_tokens, 0, None))
        .expect("model is served");
    rows.push(sample(
        "Router::plan, index only (history empty)",
        1_000,
        30_000,
        budget,
        || timed(|| router.plan(&prepared.features())),
    ));
    let routed = router.plan(&prepared.features());
    eprintln!(
        "  (route chose {:?}, reason {})",
        routed.decision.chosen(),
        routed.decision.reason.as_str()
    );

    let mut buffer = vec![0u8; FLUSH_BYTES];
    let mut round = 0u8;
    rows.push(sample(
        "Router::plan, index only, caches evicted",
        5,
        300,
        budget,
        || {
            round = round.wrapping_add(1);
            flush(&mut buffer, round);
            timed(|| router.plan(&prepared.features()))
        },
    ));

    // Fill the routing history and predicted overlay as dispatches do: endpoint i was
    // recently sent the first (i + 1)/16 of the request.
    let now = router.now();
    for i in 0..ENDPOINTS {
        let held = Arc::new(keys[..held_blocks(i, keys.len())].to_vec());
        let features = RequestFeatures {
            keys: &held,
            ..prepared.features()
        };
        router
            .fleet()
            .dispatched(&[], &features, EndpointId(i as u32), now);
    }
    rows.push(sample(
        "Router::plan, index + history + overlay",
        1_000,
        30_000,
        budget,
        || timed(|| router.plan(&prepared.features())),
    ));
    rows.push(sample(
        "RoutingHistory::longest_prefixes (one of the two)",
        1_000,
        30_000,
        budget,
        || {
            timed(|| {
                router
                    .fleet()
                    .history()
                    .longest_prefixes(black_box(&keys), now)
            })
        },
    ));
    rows.push(sample(
        "Router::plan, index + history, caches evicted",
        5,
        300,
        budget,
        || {
            round = round.wrapping_add(1);
            flush(&mut buffer, round);
            timed(|| router.plan(&prepared.features()))
        },
    ));
    drop(buffer);

    // 4. Tokenization and keys.
    let tok = BuiltinTokenizer;
    let messages = chat(PROMPT_TOKENS, 0);
    let chat_tokens = tok.encode(&tok.apply_chat_template(&messages, true));
    let chat_chars: usize = messages.iter().map(|m| m.content.len()).sum();
    eprintln!(
        "  chat prompt: {} messages, {chat_chars} bytes of content, {} tokens",
        messages.len(),
        chat_tokens.len()
    );
    rows.push(sample(
        "tokenizer: apply_chat_template + encode (8k chat)",
        20,
        5_000,
        budget,
        || timed(|| tok.encode(&tok.apply_chat_template(black_box(&messages), true))),
    ));
    rows.push(sample(
        "tokenizer: apply_chat_template only",
        20,
        5_000,
        budget,
        || timed(|| tok.apply_chat_template(black_box(&messages), true)),
    ));
    rows.push(sample(
        "router_keys, 8,192 tokens (512 blocks)",
        20,
        10_000,
        budget,
        || timed(|| router_keys(black_box(&chat_tokens), BLOCK_SIZE, None)),
    ));
    rows.push(sample(
        "Router::prepare, 8,192 token ids",
        20,
        10_000,
        budget,
        || {
            timed(|| {
                futures::executor::block_on(prepare_request(
                    &router,
                    black_box(&prepared_tokens),
                    0,
                    None,
                ))
            })
        },
    ));
    let chat_request = request(Input::Chat(Box::new(Chat::new(messages.clone()))));
    rows.push(sample(
        "Router::prepare, 8k chat, token cache hit",
        20,
        5_000,
        budget,
        || {
            timed(|| {
                futures::executor::block_on(prepare_request(
                    &router,
                    black_box(&chat_request),
                    0,
                    None,
                ))
            })
        },
    ));
    let mut salt = 1u64;
    let base = messages;
    rows.push(sample(
        "Router::prepare, 8k chat, token cache miss",
        5,
        1_000,
        budget,
        || {
            let mut m = base.clone();
            if let Some(last) = m.last_mut() {
                last.set_text(format!("{} {salt}", last.content));
            }
            salt += 1;
            let r = request(Input::Chat(Box::new(Chat::new(m))));
            timed(|| futures::executor::block_on(prepare_request(&router, &r, 0, None)))
        },
    ));

    // Parsing the JSON body, which the router does before any of the above.
    let chat_body = serde_json::to_vec(&serde_json::json!({
        "model": model,
        "messages": base.iter().map(ChatMessage::to_api).collect::<Vec<_>>(),
        "max_tokens": 1,
    }))
    .expect("json");
    rows.push(sample(
        &format!("parse_chat, 8k chat body ({} KB)", chat_body.len() / 1024),
        20,
        5_000,
        budget,
        || timed(|| parse_chat(black_box(&chat_body))),
    ));
    let ids_body = serde_json::to_vec(&serde_json::json!({
        "model": model, "prompt": &prompt[..2_000], "max_tokens": 1,
    }))
    .expect("json");
    rows.push(sample(
        &format!(
            "parse_completion, 2,000 token ids ({} KB)",
            ids_body.len() / 1024
        ),
        20,
        10_000,
        budget,
        || timed(|| parse_completion(black_box(&ids_body))),
    ));

    println!();
    println!("| Operation | Samples | p50 (µs) | p90 (µs) | p99 (µs) | max (µs) |");
    println!("|---|---:|---:|---:|---:|---:|");
    for r in &rows {
        println!(
            "| {} | {} | {:.2} | {:.2} | {:.2} | {:.1} |",
            r.name, r.samples, r.p50, r.p90, r.p99, r.max
        );
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("\nload average after: {}", load.trim());
}
