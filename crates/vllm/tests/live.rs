//! Live ingestion over real ZMQ sockets on loopback: the subscriber against the built-in
//! publisher, feeding a real index, checked against what the demo engine really caches.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvroute_core::index::{EndpointId, IndexConfig, KvIndex, SharedIndex};
use kvroute_core::keys::router_keys;
use kvroute_testkit::hostile::{ATTACKS, HostilePublisher, SilentPublisher, attack_subscriber};
use kvroute_testkit::{eventually, patience};
use kvroute_vllm::codec::EventLayout;
use kvroute_vllm::publisher::demo::{DemoConfig, DemoEngine};
use kvroute_vllm::publisher::{Publisher, PublisherConfig, ReplayFraming};
use kvroute_vllm::subscriber::{
    BoundSubscriber, EndpointSource, EventSink, FeedStats, SubscriberConfig, SubscriberHandle,
    Timing, TopicSource, spawn_bound, spawn_connected,
};
use kvroute_vllm::zmtp::Limits;
use kvroute_vllm::zmtp::connection::Heartbeat;

const E: EndpointId = EndpointId(7);

fn new_index() -> Arc<SharedIndex> {
    Arc::new(SharedIndex::new(
        KvIndex::new(IndexConfig::default()).unwrap(),
    ))
}

fn timing() -> Timing {
    Timing {
        connect_timeout: Duration::from_secs(2),
        min_backoff: Duration::from_millis(20),
        max_backoff: Duration::from_millis(200),
        replay_timeout: Duration::from_millis(1500),
        // Tail checks only where a test asks for them: the replays counted below are the
        // gaps' and the connections'.
        tail_check_after: Duration::from_secs(3600),
        ..Timing::default()
    }
}

async fn publisher(layout: EventLayout, framing: ReplayFraming, buffer_steps: usize) -> Publisher {
    Publisher::bind(PublisherConfig {
        address: "tcp://127.0.0.1:0".into(),
        connect: false,
        replay_address: Some("tcp://127.0.0.1:0".into()),
        topic: "kv@127.0.0.1:8000@demo".into(),
        layout,
        replay_framing: framing,
        buffer_steps,
    })
    .await
    .unwrap()
}

/// `publisher`'s feed as endpoint `E`'s source, its replay included.
fn source(publisher: &Publisher) -> EndpointSource {
    EndpointSource {
        endpoint: E,
        name: "engine-a".into(),
        publisher: publisher.address().to_owned(),
        replay: publisher.replay_address().map(str::to_owned),
        topic: "kv@127.0.0.1:8000@demo".into(),
    }
}

fn subscribe(publisher: &Publisher, index: &Arc<SharedIndex>) -> SubscriberHandle {
    spawn_connected(
        source(publisher),
        index.clone() as Arc<dyn EventSink>,
        timing(),
    )
}

/// Waits until the subscriber has connected to its publisher.
async fn until_connected(handle: &SubscriberHandle) {
    eventually("first connection", || {
        (stats(handle).connected, stats(handle))
    })
    .await;
}

/// Waits until the subscriber has taken in every batch up to `last_seq`.
async fn until_heard(handle: &SubscriberHandle, last_seq: u64) {
    eventually(&format!("batches up to {last_seq}"), || {
        (stats(handle).last_seq == Some(last_seq), stats(handle))
    })
    .await;
}

/// Publishes one step at a time until a batch reaches the subscriber, and returns how many
/// steps that took. ZMQ's slow joiner: batches published before the subscription reaches the
/// publisher are lost to the live stream (a gap at the start, filled from replay), so gaps
/// counted after this are the live stream's.
async fn publish_until_joined(
    p: &mut Publisher,
    engine: &mut DemoEngine,
    handle: &SubscriberHandle,
) -> usize {
    let mut published = 0;
    let deadline = Instant::now() + patience();
    while stats(handle).last_seq.is_none() {
        assert!(
            Instant::now() < deadline,
            "no batch arrived: {:?}",
            stats(handle)
        );
        p.publish(&engine.step(published as f64)).await.unwrap();
        published += 1;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    published
}

fn stats(handle: &SubscriberHandle) -> FeedStats {
    handle
        .stats()
        .into_iter()
        .next()
        .map(|(_, s)| s)
        .unwrap_or_default()
}

/// For every conversation, the index's prefix for the endpoint equals the blocks the engine
/// really caches (leading blocks, up to the first miss).
fn index_matches_engine(index: &SharedIndex, engine: &DemoEngine) -> (bool, Vec<(u32, u32)>) {
    let mut pairs = Vec::new();
    for tokens in engine.conversations() {
        let cached = engine
            .block_hashes(tokens)
            .iter()
            .take_while(|h| engine.is_cached(**h))
            .count() as u32;
        let keys = router_keys(tokens, 16, None).unwrap();
        pairs.push((cached, index.lookup(&keys).blocks(E)));
    }
    (pairs.iter().all(|(a, b)| a == b), pairs)
}

fn demo_engine(seed: u64) -> DemoEngine {
    DemoEngine::new(DemoConfig {
        capacity_blocks: 400,
        seed,
        ..DemoConfig::default()
    })
}

async fn publish_steps(p: &mut Publisher, engine: &mut DemoEngine, n: usize) {
    for i in 0..n {
        let batch = engine.step(i as f64);
        p.publish(&batch).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn index_follows_a_live_engine_with_eviction() {
    let mut p = publisher(EventLayout::LATEST, ReplayFraming::WithTopic, 10_000).await;
    let index = new_index();
    let handle = subscribe(&p, &index);
    until_connected(&handle).await;
    let mut engine = demo_engine(1);
    let published = publish_until_joined(&mut p, &mut engine, &handle).await;
    let joined = stats(&handle);
    for i in published..150 {
        let batch = engine.step(i as f64);
        p.publish(&batch).await.unwrap();
    }
    until_heard(&handle, published.max(150) as u64 - 1).await;
    eventually("index equals engine cache", || {
        index_matches_engine(&index, &engine)
    })
    .await;
    let s = stats(&handle);
    assert!(s.blocks_removed > 0, "the scenario must evict: {s:?}");
    assert_eq!(
        (
            s.gaps - joined.gaps,
            s.unfilled_gaps,
            s.decode_errors,
            s.restarts
        ),
        (0, 0, 0, 0),
        "{s:?}"
    );
    let index_stats = index.endpoint_stats(E).unwrap();
    assert_eq!(index_stats.blocks_gpu as usize, engine.cached_blocks());
    assert_eq!(index_stats.orphan_blocks, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_subscriber_learns_history_from_replay() {
    let mut p = publisher(EventLayout::LATEST, ReplayFraming::WithTopic, 10_000).await;
    let mut engine = demo_engine(2);
    publish_steps(&mut p, &mut engine, 60).await;
    let index = new_index();
    let handle = subscribe(&p, &index);
    until_heard(&handle, 59).await;
    eventually("index equals engine cache", || {
        index_matches_engine(&index, &engine)
    })
    .await;
    assert_eq!(stats(&handle).replayed_batches, 60);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forced_gap_is_filled_from_replay_in_the_legacy_framing() {
    let layout = EventLayout::for_vllm_version("0.23.0").unwrap();
    let mut p = publisher(layout, ReplayFraming::Legacy, 10_000).await;
    let index = new_index();
    let handle = subscribe(&p, &index);
    let mut engine = demo_engine(3);
    until_connected(&handle).await;
    publish_steps(&mut p, &mut engine, 10).await;
    until_heard(&handle, 9).await;
    // Batches published before the subscription reached the publisher (ZMQ's slow joiner) are
    // a gap too, filled from replay like any other: count only the forced gap below.
    let gaps_before = stats(&handle).gaps;
    for i in 0..5 {
        let batch = engine.step(100.0 + f64::from(i));
        p.publish_lost(&batch);
    }
    publish_steps(&mut p, &mut engine, 5).await;
    until_heard(&handle, 19).await;
    eventually("index equals engine cache", || {
        index_matches_engine(&index, &engine)
    })
    .await;
    let s = stats(&handle);
    assert_eq!(
        (s.gaps - gaps_before, s.unfilled_gaps, s.batches),
        (1, 0, 20),
        "{s:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_older_than_the_replay_buffer_is_reported() {
    let mut p = publisher(EventLayout::LATEST, ReplayFraming::WithTopic, 3).await;
    let index = new_index();
    let handle = subscribe(&p, &index);
    let mut engine = demo_engine(4);
    until_connected(&handle).await;
    let step = publish_until_joined(&mut p, &mut engine, &handle).await as f64;
    // Everything published so far is in (a start gap filled from replay).
    let published = p.next_seq();
    eventually("caught up", || {
        let s = stats(&handle);
        (s.last_seq.is_some_and(|seq| seq + 1 == published), s)
    })
    .await;
    let joined = stats(&handle);
    let seen = joined.last_seq.unwrap();
    for i in 0..6 {
        p.publish_lost(&engine.step(f64::from(i)));
    }
    p.publish(&engine.step(step)).await.unwrap();
    eventually("gap reported", || {
        let s = stats(&handle);
        (s.unfilled_gaps == joined.unfilled_gaps + 1, s)
    })
    .await;
    let s = stats(&handle);
    // The 6 lost and the one after them were asked for; the buffer (3 batches) held the last
    // three only.
    assert_eq!(s.lost_batches - joined.lost_batches, 4, "{s:?}");
    assert_eq!(s.last_seq, Some(seen + 7));
}

/// The last batches of a burst, dropped by the PUB socket (past its high-water mark) with
/// nothing published after them to reveal the gap, are fetched from replay once the stream goes
/// quiet: an engine that goes idle after a burst is not left with a picture missing its tail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_tail_is_fetched_once_the_stream_goes_quiet() {
    let mut p = publisher(EventLayout::LATEST, ReplayFraming::WithTopic, 10_000).await;
    let index = new_index();
    let handle = spawn_connected(
        source(&p),
        index.clone() as Arc<dyn EventSink>,
        Timing {
            tail_check_after: Duration::from_millis(100),
            ..timing()
        },
    );
    let mut engine = demo_engine(7);
    until_connected(&handle).await;
    publish_until_joined(&mut p, &mut engine, &handle).await;
    until_heard(&handle, p.next_seq() - 1).await;
    let before = stats(&handle);
    for i in 0..4 {
        p.publish_lost(&engine.step(200.0 + f64::from(i)));
    }
    eventually("the index holds the lost tail", || {
        index_matches_engine(&index, &engine)
    })
    .await;
    let s = stats(&handle);
    assert_eq!(s.last_seq, Some(p.next_seq() - 1), "{s:?}");
    assert_tail_fetched(&before, &s, 4);
}

/// Between `before` and `after`, `lost` batches came back by a tail check: replayed, not
/// reported as a gap or a loss.
fn assert_tail_fetched(before: &FeedStats, after: &FeedStats, lost: u64) {
    assert_eq!(
        (
            after.replayed_batches - before.replayed_batches,
            after.gaps - before.gaps,
            after.lost_batches - before.lost_batches,
        ),
        (lost, 0, 0),
        "fetched by a tail check, not reported as a gap or a loss: {after:?}"
    );
    assert!(after.tail_checks > before.tail_checks, "{after:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_replay_socket_costs_the_replay_not_the_live_feed() {
    let limit = 1 << 20;
    let mut p = publisher(EventLayout::LATEST, ReplayFraming::WithTopic, 100).await;
    let hostile = HostilePublisher::start_as("ROUTER", limit, Duration::ZERO);
    let index = new_index();
    let handle = spawn_connected(
        EndpointSource {
            replay: Some(hostile.address().to_owned()),
            ..source(&p)
        },
        index.clone() as Arc<dyn EventSink>,
        SubscriberConfig {
            timing: timing(),
            limits: Limits {
                max_message_bytes: limit,
                ..Limits::default()
            },
        },
    );
    // The replay on connecting meets a 2^62-byte frame header.
    eventually("the first replay refused", || {
        let s = stats(&handle);
        (s.connected && s.oversized_messages == 1, s)
    })
    .await;
    let mut engine = demo_engine(6);
    publish_steps(&mut p, &mut engine, 2).await;
    // A gap: its replay meets an 8 GiB frame header.
    for i in 0..3 {
        p.publish_lost(&engine.step(f64::from(i)));
    }
    publish_steps(&mut p, &mut engine, 1).await;
    eventually("the gap's replay refused and reported", || {
        let s = stats(&handle);
        (s.oversized_messages == 2 && s.unfilled_gaps >= 1, s)
    })
    .await;
    // The live feed goes on.
    publish_steps(&mut p, &mut engine, 5).await;
    eventually("live batches after the attacks", || {
        let s = stats(&handle);
        (s.last_seq == Some(10) && s.connected, s)
    })
    .await;
    let s = stats(&handle);
    assert_eq!(s.protocol_errors, s.oversized_messages, "{s:?}");
    assert_eq!(hostile.connections(), 2);
}

/// A ZMTP 3.1 peer that goes silent and ignores PINGs (a vanished host, a half-open
/// connection) is given up after the heartbeat timeout, and not counted as a protocol error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_ignores_heartbeats_is_dropped() {
    let silent = HostilePublisher::start(1 << 20, Duration::from_secs(2));
    let index = new_index();
    let handle = spawn_connected(
        EndpointSource {
            endpoint: E,
            name: "engine-a".into(),
            publisher: silent.address().to_owned(),
            replay: None,
            topic: String::new(),
        },
        index as Arc<dyn EventSink>,
        Timing {
            heartbeat: Heartbeat {
                interval: Duration::from_millis(50),
                timeout: Duration::from_millis(200),
            },
            ..timing()
        },
    );
    eventually("the silent peer given up", || {
        let s = stats(&handle);
        (s.disconnects >= 1, s)
    })
    .await;
    assert_eq!(stats(&handle).protocol_errors, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_restart_purges_and_relearns() {
    let mut p = publisher(EventLayout::LATEST, ReplayFraming::WithTopic, 10_000).await;
    let index = new_index();
    let handle = subscribe(&p, &index);
    let mut engine = demo_engine(5);
    until_connected(&handle).await;
    publish_steps(&mut p, &mut engine, 30).await;
    until_heard(&handle, 29).await;
    p.restart();
    let mut fresh = demo_engine(6);
    publish_steps(&mut p, &mut fresh, 5).await;
    eventually("restart seen", || {
        (
            stats(&handle).restarts == 1 && stats(&handle).last_seq == Some(4),
            stats(&handle),
        )
    })
    .await;
    eventually("index equals the new engine", || {
        index_matches_engine(&index, &fresh)
    })
    .await;
    let (_, old) = index_matches_engine(&index, &engine);
    let stale: Vec<_> = old.iter().filter(|(_, idx)| *idx > 0).collect();
    let fresh_prefixes: usize = fresh.conversations().len();
    assert!(
        stale.len() <= fresh_prefixes,
        "old engine's blocks must be gone: {stale:?}"
    );
    assert_eq!(
        index.endpoint_stats(E).unwrap().blocks_gpu as usize,
        fresh.cached_blocks()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_endpoint_does_not_stall_a_live_one() {
    let index = new_index();
    let dead = spawn_connected(
        EndpointSource {
            endpoint: EndpointId(99),
            name: "dead".into(),
            publisher: "tcp://127.0.0.1:9".into(),
            replay: Some("tcp://127.0.0.1:10".into()),
            topic: String::new(),
        },
        index.clone() as Arc<dyn EventSink>,
        timing(),
    );
    let mut p = publisher(EventLayout::LATEST, ReplayFraming::WithTopic, 100).await;
    let handle = subscribe(&p, &index);
    let mut engine = demo_engine(7);
    until_connected(&handle).await;
    publish_steps(&mut p, &mut engine, 20).await;
    eventually("index equals engine cache", || {
        index_matches_engine(&index, &engine)
    })
    .await;
    assert!(!stats(&dead).connected);
}

/// Publishes from every engine until `heard` streams are known to `bound`: a connecting PUB
/// loses what it sends before the subscription reaches it (ZMQ's slow joiner).
async fn publish_until_heard(
    bound: &BoundSubscriber,
    engines: &mut [(Publisher, DemoEngine)],
    heard: usize,
) {
    let mut step = 0.0;
    let deadline = Instant::now() + patience();
    while bound.handle.stats().len() < heard && Instant::now() < deadline {
        for (p, engine) in engines.iter_mut() {
            p.restart();
            engine.reset();
            let batch = engine.step(step);
            p.publish(&batch).await.unwrap();
        }
        step += 1.0;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Engines connect to a bound subscriber, so a hostile one does too: each attack costs its own
/// connection (counted among the unattributed, as it named no topic), and a real engine that
/// connects afterwards is heard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_publisher_costs_a_bound_subscriber_one_connection() {
    let limit = 1 << 20;
    let index = new_index();
    let resolver = Box::new(|topic: &str| {
        let endpoint = kvroute_vllm::subscriber::endpoint_from_topic(topic)?;
        Some(TopicSource {
            endpoint: EndpointId(1),
            name: endpoint.to_owned(),
            replay: None,
        })
    });
    let bound = spawn_bound(
        "tcp://127.0.0.1:0",
        resolver,
        index.clone() as Arc<dyn EventSink>,
        SubscriberConfig {
            timing: timing(),
            limits: Limits {
                max_message_bytes: limit,
                ..Limits::default()
            },
        },
    )
    .await
    .unwrap();
    let address = bound.address.clone();
    tokio::task::spawn_blocking(move || {
        for attack in ATTACKS {
            // The subscriber hangs up mid-attack: a reset is the expected end.
            let _ = attack_subscriber(&address, attack, limit);
        }
    })
    .await
    .unwrap();
    eventually("three attacks counted", || {
        let s = bound.handle.unattributed_stats();
        (s.oversized_messages == 3 && s.protocol_errors == 3, s)
    })
    .await;
    let p = Publisher::bind(PublisherConfig {
        address: bound.address.clone(),
        connect: true,
        replay_address: None,
        topic: "kv@10.0.0.1:8000@demo".into(),
        ..PublisherConfig::default()
    })
    .await
    .unwrap();
    publish_until_heard(&bound, &mut [(p, demo_engine(20))], 1).await;
    assert!(index.endpoint_stats(EndpointId(1)).is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bound_subscriber_demultiplexes_engines_by_topic() {
    let index = new_index();
    let resolver = Box::new(|topic: &str| {
        let endpoint = kvroute_vllm::subscriber::endpoint_from_topic(topic)?;
        let id = match endpoint {
            "10.0.0.1:8000" => 1,
            "10.0.0.2:8000" => 2,
            _ => return None,
        };
        Some(TopicSource {
            endpoint: EndpointId(id),
            name: endpoint.to_owned(),
            replay: None,
        })
    });
    let bound = spawn_bound(
        "tcp://127.0.0.1:0",
        resolver,
        index.clone() as Arc<dyn EventSink>,
        timing(),
    )
    .await
    .unwrap();
    let mut engines = Vec::new();
    for (i, host) in ["10.0.0.1", "10.0.0.2", "10.9.9.9"].iter().enumerate() {
        let p = Publisher::bind(PublisherConfig {
            address: bound.address.clone(),
            connect: true,
            replay_address: None,
            topic: format!("kv@{host}:8000@demo"),
            ..PublisherConfig::default()
        })
        .await
        .unwrap();
        engines.push((p, demo_engine(10 + i as u64)));
    }
    publish_until_heard(&bound, &mut engines, 2).await;
    let names: Vec<String> = bound.handle.stats().into_iter().map(|(n, _)| n).collect();
    assert_eq!(
        names,
        vec!["10.0.0.1:8000".to_string(), "10.0.0.2:8000".to_string()]
    );
    assert!(index.endpoint_stats(EndpointId(1)).is_some());
    assert!(index.endpoint_stats(EndpointId(2)).is_some());
}

/// A bound subscriber, which engines connect to, checks its quiet streams for a lost tail too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bound_subscriber_fetches_a_quiet_engines_lost_tail() {
    const TOPIC: &str = "kv@10.0.0.1:8000@demo";
    let index = new_index();
    // The engine's replay address, known once it has bound its socket.
    let replay: Arc<std::sync::Mutex<Option<String>>> = Arc::default();
    let resolver = {
        let replay = replay.clone();
        Box::new(move |topic: &str| {
            (topic == TOPIC).then(|| TopicSource {
                endpoint: E,
                name: "engine-a".into(),
                replay: replay.lock().unwrap().clone(),
            })
        })
    };
    let bound = spawn_bound(
        "tcp://127.0.0.1:0",
        resolver,
        index.clone() as Arc<dyn EventSink>,
        Timing {
            tail_check_after: Duration::from_millis(100),
            ..timing()
        },
    )
    .await
    .unwrap();
    let mut p = Publisher::bind(PublisherConfig {
        address: bound.address.clone(),
        connect: true,
        replay_address: Some("tcp://127.0.0.1:0".into()),
        topic: TOPIC.into(),
        ..PublisherConfig::default()
    })
    .await
    .unwrap();
    *replay.lock().unwrap() = p.replay_address().map(str::to_owned);
    let mut engine = demo_engine(12);
    let stream = || bound.handle.stats().into_iter().next().map(|(_, s)| s);
    // Until the connection is up, published batches are lost to the live stream (the first
    // one heard replays them).
    let deadline = Instant::now() + patience();
    while stream().is_none() {
        assert!(Instant::now() < deadline, "no batch arrived");
        p.publish(&engine.step(0.0)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let published = p.next_seq();
    eventually("every batch published so far", || {
        let s = stream().unwrap_or_default();
        (s.last_seq == Some(published - 1), s)
    })
    .await;
    let before = stream().unwrap_or_default();
    for i in 0..4 {
        p.publish_lost(&engine.step(200.0 + f64::from(i)));
    }
    eventually("the index holds the lost tail", || {
        index_matches_engine(&index, &engine)
    })
    .await;
    assert_tail_fetched(&before, &stream().unwrap_or_default(), 4);
    // The engine goes away: its stream says so (and is not checked while gone).
    drop(p);
    eventually("the departed engine shown disconnected", || {
        let s = stream().unwrap_or_default();
        (!s.connected && s.disconnects == 1, s)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_subscriber_lets_its_publisher_connection_go() {
    // A quiet engine: nothing ends the connection but the subscriber (its heartbeat gives up
    // only after 30 s of silence).
    let publisher = SilentPublisher::start();
    let handle = spawn_connected(
        EndpointSource {
            endpoint: E,
            name: "engine-a".into(),
            publisher: publisher.address().to_owned(),
            replay: None,
            topic: String::new(),
        },
        new_index() as Arc<dyn EventSink>,
        timing(),
    );
    eventually("the subscriber is connected", || {
        let connected = stats(&handle).connected;
        (connected, connected)
    })
    .await;
    let stopped = Instant::now();
    handle.stop();
    eventually("the publisher sees the stopped subscriber hang up", || {
        (publisher.hung_up() == 1, publisher.hung_up())
    })
    .await;
    // Long before the subscriber's heartbeat would have given up on the silent publisher.
    assert!(
        stopped.elapsed() < Duration::from_secs(10),
        "{:?}",
        stopped.elapsed()
    );
}
