//! Prefill/decode disaggregation in the simulated server, over real HTTP, the side channel and
//! ZMQ on loopback: the two legs as vLLM's reference proxy sends them, per release, the lease,
//! the link model, and the faults.

use std::sync::Arc;
use std::time::Duration;

use kvroute_core::index::{EndpointId, IndexConfig, KvIndex, SharedIndex};
use kvroute_core::keys::router_keys;
use kvroute_sim::engine::EngineConfig;
use kvroute_sim::link::LinkSpec;
use kvroute_sim::server::pd::PdConfig;
use kvroute_sim::server::{SimConfig, SimFleet, start};
use kvroute_testkit::sample;
use kvroute_vllm::nixl::{KvLoadFailurePolicy, KvRole, decode_leg_body, prefill_leg_body};
use kvroute_vllm::subscriber::{EndpointSource, EventSink, Timing, spawn_connected};
use serde_json::{Value, json};

const MODEL: &str = "sim-llama-3.1-8b";
/// 1000 tokens: 62 full blocks precede the last token (999 / 16), all of them pulled.
const PROMPT_LEN: u32 = 1000;
const PULLED_BLOCKS: u64 = 62;

/// A fleet builder: engine roles (`None`: no KV connector), release, lease, policy, link.
struct Fleet {
    roles: Vec<KvRole>,
    version: &'static str,
    lease: Option<Duration>,
    policy: KvLoadFailurePolicy,
    link: &'static str,
    gpu_blocks: usize,
}

impl Fleet {
    fn new(roles: &[KvRole]) -> Self {
        Self {
            roles: roles.to_vec(),
            version: "0.33.0",
            lease: None,
            policy: KvLoadFailurePolicy::Fail,
            link: "tcp",
            gpu_blocks: 2000,
        }
    }

    async fn start(self) -> SimFleet {
        let engines = self.roles.len();
        start(SimConfig {
            port: 0,
            events_port: 0,
            replay_port: Some(0),
            engines,
            engine: EngineConfig {
                num_gpu_blocks: self.gpu_blocks,
                max_model_len: 8192,
                ..EngineConfig::default()
            },
            time_scale: 4.0,
            vllm_version: self.version.into(),
            pd: Some(PdConfig {
                lease: self.lease,
                load_failure_policy: self.policy,
                link: LinkSpec::parse(self.link).unwrap(),
                side_channel_port: 0,
                ..PdConfig::new(self.roles)
            }),
            ..SimConfig::default()
        })
        .await
        .unwrap()
    }
}

fn prompt(seed: u32) -> Vec<u32> {
    (0..PROMPT_LEN).map(|t| seed * 10_000 + t).collect()
}

/// The client's request.
fn body(prompt: &[u32], stream: bool) -> Value {
    json!({"model": MODEL, "prompt": prompt, "max_tokens": 8, "stream": stream})
}

/// The prefill leg the reference proxy derives from a request.
fn prefill_leg(body: &Value) -> Value {
    prefill_leg_body(body)
}

/// The decode leg: the original request with the producer's params, unchanged.
fn decode_leg(body: &Value, params: &Value) -> Value {
    decode_leg_body(
        body,
        params.as_object().expect("params are an object"),
        None,
    )
}

async fn post(url: &str, request_id: &str, body: &Value) -> (u16, Value) {
    let resp = reqwest::Client::new()
        .post(format!("{url}/v1/completions"))
        .header("x-request-id", request_id)
        .json(body)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let text = resp.text().await.unwrap();
    (
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

/// The SSE events of a streamed request, as JSON (`[DONE]` left out).
async fn post_stream(url: &str, request_id: &str, body: &Value) -> (u16, Vec<Value>) {
    let (status, text) = post(url, request_id, body).await;
    let text = text.as_str().unwrap_or_default().to_owned();
    let events = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    (status, events)
}

async fn metrics(url: &str) -> String {
    reqwest::get(format!("{url}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

fn series(name: &str, engine: usize) -> String {
    format!("{name}{{engine=\"{engine}\",model_name=\"{MODEL}\"}}")
}

async fn metric(fleet: &SimFleet, engine: usize, name: &str) -> f64 {
    let text = metrics(&fleet.endpoints[engine].url).await;
    sample(&text, &series(name, engine)).unwrap_or_else(|| panic!("{name} missing:\n{text}"))
}

async fn eventually_metric(fleet: &SimFleet, engine: usize, name: &str, want: f64) {
    let url = fleet.endpoints[engine].url.clone();
    let series = series(name, engine);
    let deadline = std::time::Instant::now() + kvroute_testkit::patience();
    loop {
        let got = sample(&metrics(&url).await, &series);
        if got == Some(want) {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{series}: {got:?}, want {want}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn cached(response: &Value) -> u64 {
    response["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pd_request_answers_like_an_aggregated_one_and_the_consumer_publishes_the_pulled_blocks()
{
    // Engines: producer, consumer, and a kv_both engine serving the aggregated comparison.
    let fleet = Fleet::new(&[KvRole::Producer, KvRole::Consumer, KvRole::Both])
        .start()
        .await;
    let (p, d, a) = (
        &fleet.endpoints[0],
        &fleet.endpoints[1],
        &fleet.endpoints[2],
    );
    assert!(p.side_channel.is_some() && d.side_channel.is_none());
    let index = Arc::new(SharedIndex::new(
        KvIndex::new(IndexConfig::default()).unwrap(),
    ));
    let sub = spawn_connected(
        EndpointSource {
            endpoint: EndpointId(1),
            name: d.url.clone(),
            publisher: d.events.clone(),
            replay: d.replay.clone(),
            topic: String::new(),
        },
        index.clone() as Arc<dyn EventSink>,
        Timing::default(),
    );
    kvroute_testkit::eventually("subscription", || (sub.stats()[0].1.connected, ())).await;

    let tokens = prompt(1);
    let request = body(&tokens, false);
    let (status, prefill) = post(&p.url, "r1", &prefill_leg(&request)).await;
    assert_eq!(status, 200, "{prefill}");
    assert_eq!(prefill["usage"]["completion_tokens"], 1);
    let params = prefill["kv_transfer_params"].clone();
    assert_eq!(params["do_remote_prefill"], true);
    assert_eq!(params["do_remote_decode"], false);
    assert_eq!(
        params["remote_block_ids"].as_array().unwrap().len() as u64,
        PULLED_BLOCKS
    );
    assert_eq!(params["remote_request_id"], "cmpl-r1");
    assert_eq!(params["transfer_mode"], "pull");
    assert_eq!(params["remote_registration_generation"], 0);
    assert_eq!(
        format!(
            "{}:{}",
            params["remote_host"].as_str().unwrap(),
            params["remote_port"]
        ),
        *p.side_channel.as_ref().unwrap()
    );
    assert_eq!(metric(&fleet, 0, "kvroute_sim_kv_holds").await, 1.0);

    // As 0.33's proxy may: report the producer's own cache hits as the decode leg's.
    let mut forwarded = params.clone();
    forwarded["remote_prefill_cached_tokens"] = json!(cached(&prefill));
    let (status, decoded) = post(&d.url, "r1", &decode_leg(&request, &forwarded)).await;
    assert_eq!(status, 200, "{decoded}");
    let (status, aggregated) = post(&a.url, "r1", &request).await;
    assert_eq!(status, 200, "{aggregated}");
    assert_eq!(
        decoded["choices"][0]["text"],
        aggregated["choices"][0]["text"]
    );
    assert_eq!(decoded["usage"], aggregated["usage"]);
    assert!(
        decoded.get("kv_transfer_params").is_none(),
        "only a prefill leg returns params"
    );

    // The producer released its hold; the consumer counted one transfer of the missing blocks.
    eventually_metric(&fleet, 0, "kvroute_sim_kv_holds", 0.0).await;
    assert_eq!(
        metric(&fleet, 1, "vllm:nixl_xfer_time_seconds_count").await,
        1.0
    );
    let bytes = PULLED_BLOCKS * 16 * 128 * 1024;
    assert_eq!(
        metric(&fleet, 1, "vllm:nixl_bytes_transferred_sum").await,
        bytes as f64
    );
    assert_eq!(
        metric(&fleet, 1, "vllm:external_prefix_cache_hits_total").await,
        (PULLED_BLOCKS * 16) as f64
    );
    // The pulled blocks are in the consumer's cache, and its KV events said so.
    let keys = router_keys(&tokens[..tokens.len() - 1], 16, None).unwrap();
    kvroute_testkit::eventually("the consumer's BlockStored events", || {
        let blocks = index.lookup(&keys).blocks(EndpointId(1));
        (blocks as u64 == PULLED_BLOCKS, blocks)
    })
    .await;

    // The same prompt again: a full local hit on the consumer pulls nothing and still frees
    // the producer's hold.
    let (status, prefill) = post(&p.url, "r2", &prefill_leg(&request)).await;
    assert_eq!(status, 200);
    assert_eq!(
        cached(&prefill),
        PULLED_BLOCKS * 16,
        "the producer's own cache"
    );
    let (status, decoded) = post(
        &d.url,
        "r2",
        &decode_leg(&request, &prefill["kv_transfer_params"]),
    )
    .await;
    assert_eq!(status, 200, "{decoded}");
    assert_eq!(
        metric(&fleet, 1, "vllm:nixl_xfer_time_seconds_count").await,
        1.0
    );
    eventually_metric(&fleet, 0, "kvroute_sim_kv_holds", 0.0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_release_shapes_the_params_streaming_and_cached_tokens() {
    // 0.32: no registration generation, no params on a stream, cached_tokens = local + pulled.
    let fleet = Fleet {
        version: "0.32.0",
        ..Fleet::new(&[KvRole::Both, KvRole::Both])
    }
    .start()
    .await;
    let (p, d) = (&fleet.endpoints[0].url, &fleet.endpoints[1].url);
    let request = body(&prompt(2), false);
    let (_, prefill) = post(p, "s1", &prefill_leg(&request)).await;
    let params = &prefill["kv_transfer_params"];
    assert!(params.get("remote_request_id").is_some());
    assert!(params.get("remote_registration_generation").is_none());
    let (status, decoded) = post(d, "s1", &decode_leg(&request, params)).await;
    assert_eq!(status, 200, "{decoded}");
    assert_eq!(cached(&decoded), PULLED_BLOCKS * 16);
    let mut streamed = prefill_leg(&request);
    streamed["stream"] = json!(true);
    let (status, events) = post_stream(p, "s2", &streamed).await;
    assert_eq!(status, 200);
    assert!(events.iter().all(|e| e.get("kv_transfer_params").is_none()));

    // 0.33: the final chunk of a streamed prefill leg carries them.
    let fleet = Fleet::new(&[KvRole::Both]).start().await;
    let (status, events) = post_stream(&fleet.endpoints[0].url, "s3", &streamed).await;
    assert_eq!(status, 200);
    let last = events.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert_eq!(last["kv_transfer_params"]["do_remote_prefill"], true);

    // 0.12: no remote_request_id; the consumer finds the hold by the shared X-Request-Id.
    let fleet = Fleet {
        version: "0.12.0",
        ..Fleet::new(&[KvRole::Producer, KvRole::Consumer])
    }
    .start()
    .await;
    let (p, d) = (&fleet.endpoints[0].url, &fleet.endpoints[1].url);
    let (_, prefill) = post(p, "t1", &prefill_leg(&request)).await;
    let params = &prefill["kv_transfer_params"];
    assert!(params.get("remote_request_id").is_none());
    let (status, failed) = post(d, "other-id", &decode_leg(&request, params)).await;
    assert_eq!(status, 500, "another request id names no hold: {failed}");
    assert!(
        failed.to_string().contains("no blocks are held"),
        "{failed}"
    );
    let (status, decoded) = post(d, "t1", &decode_leg(&request, params)).await;
    assert_eq!(status, 200, "{decoded}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn roles_refuse_the_wrong_leg_and_an_engine_without_a_connector_ignores_the_params() {
    let fleet = Fleet::new(&[KvRole::Producer, KvRole::Consumer])
        .start()
        .await;
    let request = body(&prompt(3), false);
    let (status, err) = post(
        &fleet.endpoints[0].url,
        "x",
        &decode_leg(&request, &json!({"do_remote_prefill": true})),
    )
    .await;
    assert_eq!(status, 400, "{err}");
    assert!(err.to_string().contains("kv_producer"), "{err}");
    let (status, err) = post(&fleet.endpoints[1].url, "x", &prefill_leg(&request)).await;
    assert_eq!(status, 400, "{err}");
    let (status, err) = post(
        &fleet.endpoints[1].url,
        "x",
        &decode_leg(&request, &json!({"do_remote_prefill": true})),
    )
    .await;
    assert_eq!(status, 400, "params that name no producer: {err}");
    assert!(err.to_string().contains("remote_engine_id"), "{err}");

    let plain = start(SimConfig {
        port: 0,
        events_port: 0,
        replay_port: None,
        ..SimConfig::default()
    })
    .await
    .unwrap();
    let (status, answer) = post(&plain.endpoints[0].url, "y", &prefill_leg(&request)).await;
    assert_eq!(status, 200);
    assert!(answer.get("kv_transfer_params").is_none(), "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unpulled_hold_expires_and_frees_its_blocks() {
    let fleet = Fleet {
        lease: Some(Duration::from_secs(2)), // 0.5 s of wall time at time scale 4
        ..Fleet::new(&[KvRole::Producer, KvRole::Consumer])
    }
    .start()
    .await;
    let (p, d) = (&fleet.endpoints[0].url, &fleet.endpoints[1].url);
    let request = body(&prompt(4), false);
    let (_, prefill) = post(p, "e1", &prefill_leg(&request)).await;
    assert_eq!(metric(&fleet, 0, "kvroute_sim_kv_holds").await, 1.0);
    eventually_metric(&fleet, 0, "vllm:nixl_num_kv_expired_reqs_total", 1.0).await;
    assert_eq!(metric(&fleet, 0, "kvroute_sim_kv_holds").await, 0.0);
    // The freed blocks are evictable again: the usage gauge is back to 0.
    eventually_metric(&fleet, 0, "vllm:kv_cache_usage_perc", 0.0).await;
    let (status, err) = post(
        d,
        "e1",
        &decode_leg(&request, &prefill["kv_transfer_params"]),
    )
    .await;
    assert_eq!(status, 500, "{err}");
    assert_eq!(
        metric(&fleet, 1, "vllm:nixl_num_failed_transfers_total").await,
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_producer_fails_the_pull_unless_the_policy_recomputes() {
    for policy in [KvLoadFailurePolicy::Fail, KvLoadFailurePolicy::Recompute] {
        let fleet = Fleet {
            policy,
            ..Fleet::new(&[KvRole::Producer, KvRole::Consumer, KvRole::Both])
        }
        .start()
        .await;
        let (p, d) = (&fleet.endpoints[0].url, &fleet.endpoints[1].url);
        let request = body(&prompt(5), false);
        let (_, prefill) = post(p, "f1", &prefill_leg(&request)).await;
        let params = prefill["kv_transfer_params"].clone();
        let restarted = reqwest::Client::new()
            .post(format!("{p}/sim/restart"))
            .send()
            .await
            .unwrap();
        assert_eq!(restarted.status(), 200);
        eventually_metric(&fleet, 0, "kvroute_sim_kv_holds", 0.0).await;
        let (status, answer) = post(d, "f1", &decode_leg(&request, &params)).await;
        match policy {
            KvLoadFailurePolicy::Fail => {
                assert_eq!(status, 500, "{answer}");
                assert!(answer.to_string().contains("restarted"), "{answer}");
                // Streamed, the failure arrives inside a 200, as an error event.
                let (status, events) =
                    post_stream(d, "f1", &decode_leg(&body(&prompt(5), true), &params)).await;
                assert_eq!(status, 200);
                assert!(events[0].get("error").is_some(), "{events:?}");
            }
            KvLoadFailurePolicy::Recompute => {
                // A 200 whose prompt was recomputed: only cached_tokens and the failure
                // counter tell.
                assert_eq!(status, 200, "{answer}");
                assert_eq!(cached(&answer), 0);
                let (_, aggregated) = post(&fleet.endpoints[2].url, "f1", &request).await;
                assert_eq!(
                    answer["choices"][0]["text"],
                    aggregated["choices"][0]["text"]
                );
            }
        }
        let pulls = match policy {
            KvLoadFailurePolicy::Fail => 2.0, // the plain and the streamed request
            KvLoadFailurePolicy::Recompute => 1.0,
        };
        assert_eq!(
            metric(&fleet, 1, "vllm:nixl_num_failed_transfers_total").await,
            pulls
        );
        assert_eq!(
            metric(&fleet, 1, "vllm:nixl_xfer_time_seconds_count").await,
            0.0
        );
    }
}

/// Transfer seconds the consumer reported in total.
async fn xfer_seconds(fleet: &SimFleet) -> f64 {
    metric(fleet, 1, "vllm:nixl_xfer_time_seconds_sum").await
}

/// Runs the prefill legs of `prompts`, then their decode legs at once.
async fn pull_concurrently(fleet: &SimFleet, prompts: &[Vec<u32>], tag: &str) {
    let (p, d) = (&fleet.endpoints[0].url, &fleet.endpoints[1].url);
    let mut decodes = Vec::new();
    for (i, tokens) in prompts.iter().enumerate() {
        let id = format!("{tag}-{i}");
        let request = body(tokens, false);
        let (_, prefill) = post(p, &id, &prefill_leg(&request)).await;
        decodes.push((id, decode_leg(&request, &prefill["kv_transfer_params"])));
    }
    let answers = futures::future::join_all(decodes.iter().map(|(id, leg)| post(d, id, leg))).await;
    for (status, answer) in answers {
        assert_eq!(status, 200, "{answer}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfers_take_the_link_models_time_share_the_link_and_slow_down_when_degraded() {
    let fleet = Fleet::new(&[KvRole::Producer, KvRole::Consumer])
        .start()
        .await;
    let link = LinkSpec::parse("tcp").unwrap();
    let alone = link.transfer_seconds(PULLED_BLOCKS * 16 * 128 * 1024);
    pull_concurrently(&fleet, &[prompt(6)], "a").await;
    let one = xfer_seconds(&fleet).await;
    // Measured in scaled wall time: never shorter than the model, longer only by scheduling
    // delays (generous: the test machine may be starved).
    assert!(
        one >= alone * 0.99 && one < alone * 2.0 + 0.25,
        "{one} vs {alone}"
    );

    // Two pulls into one consumer share its NIC: each takes about twice as long.
    pull_concurrently(&fleet, &[prompt(7), prompt(8)], "b").await;
    let two = xfer_seconds(&fleet).await - one;
    assert!(
        two > 3.0 * alone,
        "two shared pulls took {two} s in total, alone {alone}"
    );

    // A degraded link (4x slower) shows in the transfer time.
    let set = reqwest::Client::new()
        .post(format!("{}/sim/faults", fleet.endpoints[1].url))
        .json(&json!({"link_slowdown": 4.0}))
        .send()
        .await
        .unwrap();
    assert_eq!(set.status(), 200);
    pull_concurrently(&fleet, &[prompt(9)], "c").await;
    let slow = xfer_seconds(&fleet).await - one - two;
    assert!(slow > 3.5 * alone, "{slow} vs {alone}");

    // An injected transfer failure under kv_load_failure_policy=fail is an error.
    let set = reqwest::Client::new()
        .post(format!("{}/sim/faults", fleet.endpoints[1].url))
        .json(&json!({"link_slowdown": 1.0, "kv_transfer_failure_fraction": 1.0}))
        .send()
        .await
        .unwrap();
    assert_eq!(set.status(), 200);
    let request = body(&prompt(10), false);
    let (_, prefill) = post(&fleet.endpoints[0].url, "g", &prefill_leg(&request)).await;
    let (status, err) = post(
        &fleet.endpoints[1].url,
        "g",
        &decode_leg(&request, &prefill["kv_transfer_params"]),
    )
    .await;
    assert_eq!(status, 500, "{err}");
    assert!(err.to_string().contains("injected"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_full_of_held_blocks_queues_new_prefills_until_a_pull_releases_some() {
    // 149 usable blocks: two held prompts (62 full blocks each) leave 25, and a third prompt
    // needs 63.
    let fleet = Fleet {
        gpu_blocks: 150,
        ..Fleet::new(&[KvRole::Producer, KvRole::Consumer])
    }
    .start()
    .await;
    let (p, d) = (
        fleet.endpoints[0].url.clone(),
        fleet.endpoints[1].url.clone(),
    );
    let first = body(&prompt(11), false);
    let (_, held) = post(&p, "h1", &prefill_leg(&first)).await;
    let (status, _) = post(&p, "h2", &prefill_leg(&body(&prompt(12), false))).await;
    assert_eq!(status, 200);
    let third = tokio::spawn({
        let p = p.clone();
        async move { post(&p, "h3", &prefill_leg(&body(&prompt(13), false))).await }
    });
    eventually_metric(&fleet, 0, "vllm:num_requests_waiting", 1.0).await;
    assert!(!third.is_finished());
    let (status, _) = post(&d, "h1", &decode_leg(&first, &held["kv_transfer_params"])).await;
    assert_eq!(status, 200);
    let (status, answer) = third.await.unwrap();
    assert_eq!(status, 200, "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_process_that_died_holding_blocks_fails_the_pull_clearly() {
    let producer = Fleet::new(&[KvRole::Producer]).start().await;
    let consumer = Fleet::new(&[KvRole::Consumer]).start().await;
    let request = body(&prompt(14), false);
    let (_, prefill) = post(&producer.endpoints[0].url, "k1", &prefill_leg(&request)).await;
    let side_channel = producer.endpoints[0].side_channel.clone().unwrap();
    drop(producer);
    // Its side channel is gone: the consumer cannot connect.
    kvroute_testkit::eventually("the producer's side channel to close", || {
        (std::net::TcpStream::connect(&side_channel).is_err(), ())
    })
    .await;
    let (status, err) = post(
        &consumer.endpoints[0].url,
        "k1",
        &decode_leg(&request, &prefill["kv_transfer_params"]),
    )
    .await;
    assert_eq!(status, 500, "{err}");
    assert!(err.to_string().contains("cannot reach"), "{err}");
    assert_eq!(
        metric(&consumer, 0, "vllm:nixl_num_failed_transfers_total").await,
        1.0
    );
}
