//! Router-orchestrated prefill/decode disaggregation, end to end on loopback: `kvroute sim`
//! producer and consumer engines (each its own process, the pull crossing them through the
//! producer's side channel), `kvroute serve` with `pd:` in front, and clients: the official
//! OpenAI Python client and plain HTTP.

mod pd_support;
mod serve_support;
mod sim_support;

use pd_support::ClientParamsTrap;
use std::net::SocketAddr;
use std::process::Command;

use kvroute_testkit::process::client_output;
use kvroute_testkit::{
    eventually_blocking, http_get, http_post_within, patience, sample, sum_labelled,
};
use serde_json::{Value, json};
use serve_support::{Serve, Served};
use sim_support::SimProcess;

const MODEL: &str = "sim-llama-3.1-8b";

/// One `kvroute sim` process serving one engine.
struct Engine {
    process: Option<SimProcess>,
    http: u16,
    events: u16,
    replay: u16,
}

impl Engine {
    /// An engine with `args` (its role, link, ...), `--time-scale` `scale`, waited for.
    fn start(args: &[&str], scale: &str) -> Self {
        let common = ["--num-gpu-blocks", "4096", "--time-scale", scale];
        let sim = SimProcess::start(1, &[args, &common].concat());
        Self {
            http: sim.http,
            events: sim.events,
            replay: sim.replay,
            process: Some(sim),
        }
    }

    /// A producer (`kv_producer`).
    fn producer(extra: &[&str]) -> Self {
        Self::start(&[&["--prefill-engines", "1"], extra].concat(), "10")
    }

    /// A consumer (`kv_consumer`) on `link`.
    fn consumer(link: &str, extra: &[&str]) -> Self {
        Self::start(
            &[&["--decode-engines", "1", "--kv-link", link], extra].concat(),
            "10",
        )
    }

    /// Its `endpoints:` item, named `name`, with `role`.
    fn endpoint(&self, name: &str, role: &str) -> String {
        format!(
            "  - {{name: {name}, role: {role}, url: 'http://127.0.0.1:{}', events: 'tcp://127.0.0.1:{}', replay: 'tcp://127.0.0.1:{}'}}\n",
            self.http, self.events, self.replay
        )
    }

    /// Sets its faults (`POST /sim/faults`).
    fn faults(&self, faults: Value) {
        let (status, body) = post(self.http, "/sim/faults", &faults);
        assert_eq!(status, 200, "{body}");
    }

    /// One of its metrics (engine 0 of its process).
    fn metric(&self, name: &str) -> f64 {
        let text = http_get(addr(self.http), "/metrics");
        let series = format!("{name}{{engine=\"0\",model_name=\"{MODEL}\"}}");
        sample(&text, &series).unwrap_or_else(|| panic!("{series} missing:\n{text}"))
    }

    /// The process dies.
    fn kill(&mut self) {
        self.process.take();
    }
}

fn addr(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// `POST path` with a JSON body on `port`: the status and the body (read to its end, within
/// the test's patience).
fn post(port: u16, path: &str, body: &Value) -> (u16, String) {
    let (status, _, body) = post_with_headers(port, path, body);
    (status, body)
}

/// `POST path` with a JSON body on `port`: the status, the head and the body (a chunked body
/// joined).
fn post_with_headers(port: u16, path: &str, body: &Value) -> (u16, String, String) {
    let answer = http_post_within(addr(port), path, &body.to_string(), patience() * 3);
    (answer.status, answer.head, answer.body)
}

/// `POST /v1/completions` with `body` through the router `served`: the status and the body.
fn completions(served: &Served, body: &Value) -> (u16, String) {
    post(served.listen, "/v1/completions", body)
}

/// A completion of `tokens` prompt token ids (distinct per `salt`), `max_tokens` long.
fn completion(tokens: u32, salt: u32, max_tokens: u32, stream: bool) -> Value {
    let prompt: Vec<u32> = (0..tokens)
        .map(|t| (t * 7 + salt * 131) % 30_000 + 10)
        .collect();
    json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": stream})
}

/// The router's own metrics.
fn router_metrics(served: &Served) -> String {
    http_get(addr(served.admin), "/metrics")
}

/// Requests the router `served` disaggregated.
fn disaggregated(served: &Served) -> f64 {
    counted(
        served,
        "kvroute_pd_decisions_total",
        "decision=\"disaggregated\"",
    )
}

/// The sum of a router metric's series that carry `label`.
fn counted(served: &Served, metric: &str, label: &str) -> f64 {
    sum_labelled(&router_metrics(served), metric, label)
}

/// A router in front of one producer (`prefill`) and one consumer (`decode`), with `pd`.
fn pair_router(producer: &Engine, consumer: &Engine, pd: &str) -> Served {
    router(
        &[
            producer.endpoint("prefill", "prefill"),
            consumer.endpoint("decode", "decode"),
        ],
        pd,
    )
}

/// `kvroute serve` in front of `endpoints` with `pd` as its `pd:` section, scraping often.
fn router(endpoints: &[String], pd: &str) -> Served {
    Serve::new(
        &endpoints.concat(),
        &format!("pd: {pd}\nscrape: {{interval_ms: 100}}"),
    )
    .start()
}

#[test]
fn an_orchestrated_request_answers_like_an_aggregated_run_streamed_or_not() {
    let Some(python) = kvroute_testkit::python("the openai package") else {
        return;
    };
    let producer = Engine::producer(&[]);
    let consumer = Engine::consumer("ib-400", &[]);
    let aggregated = Engine::start(&["--engines", "1"], "10");
    let served = pair_router(&producer, &consumer, "{mode: always, link: ib-400}");
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/python/pd_route_client.py"
    );
    // A client that hangs or fails fails the test with what it printed, not the suite.
    let printed = client_output(Command::new(&python).args([
        script,
        &format!("http://127.0.0.1:{}/v1", served.listen),
        &format!("http://127.0.0.1:{}/v1", aggregated.http),
        MODEL,
    ]));
    let result: Value = serde_json::from_str(&printed).unwrap();
    let turns = result["turns"].as_array().unwrap();
    assert_eq!(turns.len(), 3);
    for (i, turn) in turns.iter().enumerate() {
        let (pd, agg) = (&turn["pd"], &turn["agg"]);
        for key in [
            "text",
            "prompt_tokens",
            "cached_tokens",
            "completion_tokens",
        ] {
            assert_eq!(pd[key], agg[key], "turn {i}, {key}: {turn:#}");
        }
    }
    // The client's own stream and max_tokens were restored on the decode leg.
    assert_eq!(turns[1]["pd"]["completion_tokens"], 9);
    assert!(turns[1]["pd"]["chunks"].as_u64().unwrap() >= 2);
    // The answer came from the decode endpoint; later turns hit the prefill engine's cache, as
    // they hit the aggregated engine's.
    assert_eq!(turns[0]["pd"]["endpoint"], "decode");
    assert_eq!(turns[0]["agg"]["cached_tokens"], 0);
    assert!(turns[2]["agg"]["cached_tokens"].as_u64().unwrap() > 0);
    // Every turn was disaggregated: three prefill legs, three pulls, nothing held after.
    assert_eq!(disaggregated(&served), 3.0);
    assert_eq!(counted(&served, "kvroute_pd_fallbacks_total", ""), 0.0);
    assert_eq!(consumer.metric("vllm:nixl_xfer_time_seconds_count"), 3.0);
    eventually_blocking("the producer released every hold", || {
        let holds = producer.metric("kvroute_sim_kv_holds");
        (holds == 0.0, holds)
    });
    // Both legs were accounted, and the pair's bandwidth was learned from the streamed turn.
    let metrics = router_metrics(&served);
    for leg in ["pd_prefill", "pd_decode"] {
        let served_legs = sum_labelled(
            &metrics,
            "kvroute_requests_total",
            &format!("reason=\"{leg}\""),
        );
        assert_eq!(served_legs, 3.0, "{leg}:\n{metrics}");
    }
    assert!(
        metrics.contains(
            "kvroute_pd_link_bandwidth_bytes_per_second{prefill=\"prefill\",decode=\"decode\"}"
        ),
        "{metrics}"
    );
}

#[test]
fn both_legs_share_the_request_id_that_releases_before_0_13_find_the_blocks_by() {
    // Before 0.13 the consumer finds the producer's hold by the X-Request-Id both legs carry.
    let producer = Engine::producer(&["--vllm-version", "0.12.0"]);
    let consumer = Engine::consumer("ib-400", &["--vllm-version", "0.12.0"]);
    let served = pair_router(&producer, &consumer, "{mode: always, link: ib-400}");
    for (salt, stream) in [(1, false), (2, true)] {
        let (status, body) = completions(&served, &completion(512, salt, 4, stream));
        assert_eq!(status, 200, "{body}");
        assert!(!body.contains("\"error\":"), "{body}");
    }
    assert_eq!(consumer.metric("vllm:nixl_xfer_time_seconds_count"), 2.0);
    assert_eq!(consumer.metric("vllm:nixl_num_failed_transfers_total"), 0.0);
    assert_eq!(
        counted(&served, "kvroute_pd_transfer_failures_total", ""),
        0.0
    );
}

#[test]
fn a_dead_producer_or_a_late_prefill_falls_back_to_aggregated_on_the_decode_pick() {
    let mut producer = Engine::producer(&[]);
    let consumer = Engine::consumer("ib-400", &[]);
    let served = pair_router(
        &producer,
        &consumer,
        "{mode: always, link: ib-400, prefill_deadline_s: 0.3}",
    );
    // A prefill that takes longer than the deadline: served aggregated, in time.
    producer.faults(json!({"slow_factor": 10000.0}));
    let started = std::time::Instant::now();
    let (status, head, body) = post_with_headers(
        served.listen,
        "/v1/completions",
        &completion(512, 1, 4, false),
    );
    assert_eq!(status, 200, "{body}");
    assert!(head.contains("x-kvroute-endpoint: decode"), "{head}");
    assert!(started.elapsed() < patience(), "{:?}", started.elapsed());
    assert_eq!(
        counted(
            &served,
            "kvroute_pd_fallbacks_total",
            "reason=\"prefill_deadline\""
        ),
        1.0
    );
    // The late prefill leg is accounted as a missed deadline, not as a client that left.
    let metrics = router_metrics(&served);
    assert_eq!(
        sum_labelled(
            &metrics,
            "kvroute_requests_total",
            "reason=\"pd_prefill\",status=\"5xx\",outcome=\"deadline\""
        ),
        1.0,
        "{metrics}"
    );
    assert_eq!(
        sum_labelled(
            &metrics,
            "kvroute_requests_total",
            "outcome=\"client_closed\""
        ),
        0.0,
        "{metrics}"
    );
    // The producer dies: the prefill leg cannot connect (or the producer is no longer
    // healthy), and the decode endpoint serves the request whole.
    producer.kill();
    let (status, head, body) = post_with_headers(
        served.listen,
        "/v1/completions",
        &completion(512, 2, 4, true),
    );
    assert_eq!(status, 200, "{body}");
    assert!(head.contains("x-kvroute-endpoint: decode"), "{head}");
    assert!(body.contains("[DONE]"), "{body}");
    let fallbacks = counted(
        &served,
        "kvroute_pd_fallbacks_total",
        "reason=\"prefill_connect\"",
    ) + counted(
        &served,
        "kvroute_pd_fallbacks_total",
        "reason=\"no_prefill_endpoint\"",
    );
    assert_eq!(fallbacks, 1.0, "{}", router_metrics(&served));
    assert_eq!(consumer.metric("vllm:nixl_xfer_time_seconds_count"), 0.0);
}

#[test]
fn failed_pulls_are_served_aggregated_elsewhere_then_the_pairs_are_quarantined() {
    let producer = Engine::producer(&[]);
    let consumers = [
        Engine::consumer("ib-400", &[]),
        Engine::consumer("ib-400", &[]),
    ];
    for c in &consumers {
        c.faults(json!({"kv_transfer_failure_fraction": 1.0}));
    }
    let served = router(
        &[
            producer.endpoint("prefill", "prefill"),
            consumers[0].endpoint("decode-a", "decode"),
            consumers[1].endpoint("decode-b", "decode"),
        ],
        "{mode: always, link: ib-400}",
    );
    // Each request's decode leg fails its pull on one consumer and is served aggregated on the
    // other (a consumer that took the leg may have pulled, and the producer released the
    // blocks: a second pull could read another request's KV). Each is a strike on its pair,
    // and three quarantine a pair; a request whose decode pick's pair is quarantined is then
    // aggregated from the start.
    let quarantined = || {
        counted(
            &served,
            "kvroute_pd_fallbacks_total",
            "reason=\"quarantined\"",
        )
    };
    let mut requests = 0;
    while quarantined() == 0.0 && requests < 10 {
        let (status, body) = completions(&served, &completion(256, requests, 4, false));
        assert_eq!(status, 200, "request {requests}: {body}");
        requests += 1;
    }
    assert_eq!(quarantined(), 1.0, "{}", router_metrics(&served));
    // Every failed pull was a strike and an aggregated answer, and no pull was tried twice.
    let failures = counted(&served, "kvroute_pd_transfer_failures_total", "");
    assert!(
        (3.0..=6.0).contains(&failures),
        "{}",
        router_metrics(&served)
    );
    assert_eq!(
        counted(
            &served,
            "kvroute_pd_fallbacks_total",
            "reason=\"decode_failed\""
        ),
        failures
    );
    let pulled_failures: f64 = consumers
        .iter()
        .map(|c| c.metric("vllm:nixl_num_failed_transfers_total"))
        .sum();
    assert_eq!(pulled_failures, failures);
    assert_eq!(f64::from(requests), failures + 1.0);
    // The explain API shows the quarantine, for the decode pick whose pair it is (either).
    let bandwidths = counted(&served, "kvroute_pd_link_bandwidth_bytes_per_second", "");
    assert!(bandwidths < 2.0 * 49.5e9, "a pair's learned bandwidth is 0");
    let (_, explain) = post(
        served.admin,
        "/kvroute/v1/explain",
        &json!({"model": MODEL, "token_ids": (0..256).collect::<Vec<u32>>()}),
    );
    let explain: Value = serde_json::from_str(&explain).unwrap();
    let options = explain["pd"]["disaggregated"].as_array().unwrap();
    assert!(!options.is_empty());
    for option in options {
        if option["link"]["kind"] == "quarantined" {
            assert_eq!(option["eligible"], false, "{explain:#}");
        }
    }
}

#[test]
fn a_client_cannot_name_a_producer_for_the_engines_to_pull_from() {
    let producer = Engine::producer(&[]);
    let consumer = Engine::consumer("ib-400", &[]);
    let served = pair_router(&producer, &consumer, "{mode: orchestrate, link: tcp}");
    // A side channel outside the fleet, named by the client.
    let trap = ClientParamsTrap::new();
    let mut request = completion(64, 9, 4, false);
    request["kv_transfer_params"] = trap.params();
    let (status, body) = completions(&served, &request);
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        counted(&served, "kvroute_pd_client_params_removed_total", ""),
        1.0
    );
    // The same key spelled with a JSON escape is the same key to the engine's JSON parser.
    let escaped = request
        .to_string()
        .replace("\"kv_transfer_params\"", "\"kv_transfer\\u005fparams\"");
    let answer = http_post_within(
        addr(served.listen),
        "/v1/completions",
        &escaped,
        patience() * 3,
    );
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(
        counted(&served, "kvroute_pd_client_params_removed_total", ""),
        2.0
    );
    // A stream whose body the router re-encoded without the key keeps the router's ask for its
    // usage: counted by the router, not shown to the client, which did not ask.
    let generated = || counted(&served, "kvroute_generated_tokens_total", "");
    let before = generated();
    let mut streamed = completion(64, 10, 4, true);
    streamed["kv_transfer_params"] = trap.params();
    let (status, body) = completions(&served, &streamed);
    assert_eq!(status, 200, "{body}");
    assert!(!body.contains("\"usage\""), "{body}");
    assert_eq!(body.matches("\"text\"").count(), 4, "{body}");
    eventually_blocking("the stream's usage read", || {
        let counted = generated() - before;
        (counted == 4.0, counted)
    });
    assert_eq!(
        counted(&served, "kvroute_pd_client_params_removed_total", ""),
        3.0
    );
    assert_eq!(consumer.metric("vllm:nixl_xfer_time_seconds_count"), 0.0);
    trap.assert_untouched();
}

#[test]
fn a_failed_pull_hidden_in_a_streamed_200_is_a_strike_on_the_pair() {
    let producer = Engine::producer(&[]);
    let consumer = Engine::consumer("ib-400", &[]);
    consumer.faults(json!({"kv_transfer_failure_fraction": 1.0}));
    let served = pair_router(&producer, &consumer, "{mode: always, link: ib-400}");
    let (status, body) = completions(&served, &completion(256, 7, 4, true));
    // vLLM's `fail` policy on a stream: a 200 whose first event is the error.
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"error\""), "{body}");
    assert_eq!(
        counted(
            &served,
            "kvroute_pd_fallbacks_total",
            "reason=\"decode_failed_in_stream\""
        ),
        1.0
    );
    assert_eq!(
        counted(&served, "kvroute_pd_transfer_failures_total", ""),
        1.0
    );
}

/// A stream whose client names no `stream_options` is asked for its usage on the decode leg, and
/// the usage event is taken out again: the router counts what the decode engine generated, and
/// the client gets the stream it asked for. A client that asks gets its usage.
#[test]
fn a_disaggregated_stream_reports_its_usage_to_the_router_and_only_an_asking_client_sees_it() {
    let producer = Engine::producer(&[]);
    let consumer = Engine::consumer("ib-400", &[]);
    let served = pair_router(&producer, &consumer, "{mode: always, link: ib-400}");
    let generated = || {
        counted(
            &served,
            "kvroute_generated_tokens_total",
            "endpoint=\"decode\"",
        )
    };
    let (status, body) = completions(&served, &completion(256, 3, 5, true));
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("data: [DONE]"), "{body}");
    assert!(!body.contains("\"usage\""), "{body}");
    assert_eq!(
        body.matches("\"text\"").count(),
        5,
        "every token passed on: {body}"
    );
    eventually_blocking("the decode leg's usage read", || {
        let counted = generated();
        (counted == 5.0, counted)
    });
    let mut asking = completion(256, 4, 5, true);
    asking["stream_options"] = json!({"include_usage": true});
    let (status, body) = completions(&served, &asking);
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"usage\""), "{body}");
    eventually_blocking("the asking client's usage read", || {
        let counted = generated();
        (counted == 10.0, counted)
    });
    assert_eq!(disaggregated(&served), 2.0);
    // The prefill legs' one token each is no output: the decode legs generated every token.
    let prefill_legs = counted(
        &served,
        "kvroute_generated_tokens_total",
        "endpoint=\"prefill\"",
    );
    assert_eq!(prefill_legs, 0.0, "{}", router_metrics(&served));
}

#[test]
fn a_client_error_of_the_decode_leg_is_no_strike_on_the_pair() {
    let producer = Engine::producer(&[]);
    let consumer = Engine::consumer("ib-400", &[]);
    let served = pair_router(&producer, &consumer, "{mode: always, link: ib-400}");
    // The prefill leg asks for one token and passes; the decode leg's `max_tokens` is past the
    // model's length, which the decode engine refuses with a 400 error body.
    for salt in 0..4 {
        let (status, body) = completions(&served, &completion(256, salt, 40_000, true));
        assert_eq!(status, 400, "{body}");
    }
    assert_eq!(
        counted(&served, "kvroute_pd_transfer_failures_total", ""),
        0.0,
        "{}",
        router_metrics(&served)
    );
    // The pair still serves disaggregated requests.
    let (status, body) = completions(&served, &completion(256, 9, 4, true));
    assert_eq!(status, 200, "{body}");
    assert!(!body.contains("\"error\""), "{body}");
}

#[test]
fn a_degraded_link_is_quarantined_from_the_decode_legs_timings() {
    // A link whose healthy transfer of the prompt takes ~110 ms (2048 tokens × 128 KiB at
    // 2.5 GB/s). A transfer is a strike when it takes both 4× the configured time
    // (`degraded_factor`) and 0.25 s more than it (`pd.learning.noise_floor_s`): here ~430 ms,
    // well above a healthy transfer plus the scheduling noise the router's leg timings carry
    // (tens of milliseconds on a loaded machine) and well below a degraded one (10× slower,
    // ~1.1 s), whatever the load. Not roce-100 (~22 ms here): its threshold is the floor
    // (~270 ms), which keeps noise from striking its healthy transfers, but the 10× slowdown
    // injected below (~220 ms) stays under it too, so it would strike only when noise added
    // 50 ms more: a test of the machine's load, not of quarantine.
    let link = "custom:2.5";
    let producer = Engine::producer(&[]);
    let consumer = Engine::start(&["--decode-engines", "1", "--kv-link", link], "1");
    let served = pair_router(
        &producer,
        &consumer,
        &format!("{{mode: always, link: '{link}'}}"),
    );
    // A healthy link first: streamed requests teach the pair and strike nothing.
    for salt in 0..2 {
        let (status, body) = completions(&served, &completion(2048, salt, 2, true));
        assert_eq!(status, 200, "{body}");
    }
    assert_eq!(disaggregated(&served), 2.0);
    assert_eq!(
        counted(&served, "kvroute_pd_transfer_failures_total", ""),
        0.0
    );
    // RDMA silently fallen back to something 10 times slower. Requests until one is served
    // aggregated because the pair is quarantined (bounded: three strikes and one more are due).
    consumer.faults(json!({"link_slowdown": 10.0}));
    let quarantined = (10..20).any(|salt| {
        let (status, body) = completions(&served, &completion(2048, salt, 2, true));
        assert_eq!(status, 200, "{body}");
        counted(
            &served,
            "kvroute_pd_fallbacks_total",
            "reason=\"quarantined\"",
        ) > 0.0
    });
    assert!(
        quarantined,
        "no quarantine within 10 slow requests:\n{}",
        router_metrics(&served)
    );
    // Quarantined means served aggregated: the slow link carried exactly the three strikes
    // (the two healthy transfers struck nothing).
    assert_eq!(
        consumer.metric("vllm:nixl_xfer_time_seconds_count"),
        5.0,
        "{}",
        router_metrics(&served)
    );
    let bandwidth = sample(
        &router_metrics(&served),
        "kvroute_pd_link_bandwidth_bytes_per_second{prefill=\"prefill\",decode=\"decode\"}",
    );
    assert_eq!(bandwidth, Some(0.0));
}

#[test]
fn a_consumer_that_never_pulls_gets_a_clear_error_and_the_lease_frees_the_blocks() {
    let producer = Engine::producer(&["--kv-lease", "2s"]);
    let mut consumer = Engine::consumer("ib-400", &[]);
    // Health checks rarely, so that the router still believes in the dead consumer.
    let served = Serve::new(
        &[
            producer.endpoint("prefill", "prefill"),
            consumer.endpoint("decode", "decode"),
        ]
        .concat(),
        "pd: {mode: always, link: ib-400}\nhealth: {interval_ms: 600000}",
    )
    .start();
    consumer.kill();
    let started = std::time::Instant::now();
    let (status, body) = completions(&served, &completion(512, 3, 4, false));
    assert!(status >= 500, "{status}: {body}");
    let error: Value = serde_json::from_str(&body).unwrap();
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap()
            .contains("decode"),
        "{body}"
    );
    assert!(started.elapsed() < patience(), "{:?}", started.elapsed());
    // The prefill ran and its blocks were held for a pull that never came, until the lease.
    assert_eq!(
        counted(&served, "kvroute_requests_total", "reason=\"pd_prefill\""),
        1.0
    );
    eventually_blocking("the producer's lease expired", || {
        let expired = producer.metric("vllm:nixl_num_kv_expired_reqs_total");
        let holds = producer.metric("kvroute_sim_kv_holds");
        (expired == 1.0 && holds == 0.0, (expired, holds))
    });
}

/// The P/D choice `/kvroute/v1/explain` reports for `tokens` prompt tokens.
fn explained_choice(served: &Served, tokens: u32) -> (String, Value) {
    let (status, body) = post(
        served.admin,
        "/kvroute/v1/explain",
        &json!({"model": MODEL, "token_ids": (0..tokens).map(|t| t % 30_000 + 10).collect::<Vec<u32>>()}),
    );
    assert_eq!(status, 200, "{body}");
    let explain: Value = serde_json::from_str(&body).unwrap();
    let mode = explain["pd"]["choice"]["mode"].as_str().unwrap().to_owned();
    (mode, explain)
}

#[test]
fn the_cost_decides_by_prompt_length_and_link_speed_when_the_decoder_is_busy() {
    let producer = Engine::producer(&[]);
    let consumer = Engine::start(&["--decode-engines", "1"], "1");
    let endpoints = [
        producer.endpoint("prefill", "prefill"),
        consumer.endpoint("decode", "decode"),
    ];
    let fast = router(&endpoints, "{mode: orchestrate, link: ib-400}");
    let slow = router(&endpoints, "{mode: orchestrate, link: tcp}");
    // Idle: nothing to gain from a second leg, whatever the prompt or link.
    for served in [&fast, &slow] {
        for tokens in [32, 8192] {
            let (mode, explain) = explained_choice(served, tokens);
            assert_eq!(mode, "aggregated", "{explain:#}");
        }
    }
    // The decode engine is busy decoding for other users: an aggregated prefill would stall
    // them, a transfer would not.
    let busy: Vec<_> = (0..3)
        .map(|salt| {
            let port = consumer.http;
            std::thread::spawn(move || {
                post(
                    port,
                    "/v1/completions",
                    &completion(64, 100 + salt, 3000, true),
                )
            })
        })
        .collect();
    for served in [&fast, &slow] {
        eventually_blocking("the router sees the decoder's running requests", || {
            let (_, explain) = explained_choice(served, 32);
            let running = explain["endpoints"][1]["load"]["running"]
                .as_f64()
                .unwrap_or(0.0);
            (running >= 3.0, running)
        });
    }
    let (long_fast, explain) = explained_choice(&fast, 8192);
    assert_eq!(long_fast, "disaggregated", "{explain:#}");
    let option = &explain["pd"]["disaggregated"][0];
    assert_eq!(option["prefill"], "prefill");
    assert_eq!(option["decode"], "decode");
    assert!(option["transfer_s"].as_f64().unwrap() < 0.1, "{option:#}");
    // The same prompt over TCP: moving 1 GB costs more than the stall it avoids.
    let (long_slow, explain) = explained_choice(&slow, 8192);
    assert_eq!(long_slow, "aggregated", "{explain:#}");
    let option = &explain["pd"]["disaggregated"][0];
    assert!(option["transfer_s"].as_f64().unwrap() > 1.0, "{option:#}");
    // A short prompt: the second leg's fixed cost outweighs its tiny stall, on any link.
    for served in [&fast, &slow] {
        let (mode, explain) = explained_choice(served, 32);
        assert_eq!(mode, "aggregated", "{explain:#}");
    }
    drop(consumer);
    for b in busy {
        let _ = b.join();
    }
}
