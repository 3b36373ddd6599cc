//! Peer messages in order: one bounded outbox per peer, drained by one task that sends its
//! messages one request at a time, each answered (or given up on) before the next leaves; what
//! queued up meanwhile leaves as one batch (`POST /kvroute/v1/peer/batch`, in order), so that a
//! peer a network round trip away still takes thousands of messages a second. A peer of an
//! older build (no batch route: 404) gets them one by one, in order, and a batch again a
//! minute later (it may have been upgraded).
//!
//! A request's messages (dispatch, prefill done, ended) then reach each peer in the order they
//! were posted: an `ended` can no longer overtake its `prefill_done` (which the peer would count
//! as unknown) nor a fast failure's `ended` its dispatch (which the peer would then count until
//! it expires). A peer that accepts connections but never answers costs one connection and a
//! full outbox, not a task and a connection per message. What does not fit the outbox, and
//! what a peer does not take, is dropped and counted by kind in
//! `kvroute_replica_peer_messages_dropped_total`: a lost message only costs what sharing would
//! have won, and sharing is never allowed to back up into the request path.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::header;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use parking_lot::Mutex;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use tokio::sync::mpsc::{self, error::TrySendError};
use tokio::time::Instant;

use super::{PeerList, REPLICA_HEADER};
use crate::metrics::KindLabel;

/// Messages waiting for one peer; more are dropped (kind `outbox_full`).
pub(crate) const OUTBOX_CAPACITY: usize = 4_096;

/// Body bytes waiting for one peer; more are dropped (kind `outbox_full`). Dispatches of long
/// prompts are large (a 16k-block prompt's keys are about 350 KB): messages alone would not
/// bound the memory a slow peer holds here.
const OUTBOX_MAX_BYTES: usize = 16 << 20;

/// How long a peer has to answer one request (kind `timeout` past it).
const SEND_TIMEOUT: Duration = Duration::from_secs(1);

/// Most messages in one batch (a receiver refuses more).
pub(crate) const MAX_BATCH_MESSAGES: usize = 256;

/// Most bytes of the messages' bodies in one batch; a message larger than this alone leaves
/// on its own route.
const MAX_BATCH_BYTES: usize = 256 << 10;

/// Bytes a batch's framing adds per message (`{"path":"prefill_done","body":` ... `},`), with
/// room to spare.
const BATCH_FRAMING_PER_MESSAGE: usize = 64;

/// The largest batch body a sender makes, and so the most a receiver reads.
pub(crate) const BATCH_BODY_LIMIT: usize =
    MAX_BATCH_BYTES + MAX_BATCH_MESSAGES * BATCH_FRAMING_PER_MESSAGE + 64;

/// How long a peer that had no batch route (an older build) gets messages one by one before a
/// batch is tried again (it may have been upgraded since).
pub(crate) const SINGLES_FOR: Duration = Duration::from_secs(60);

/// One message for a peer: its path under `/kvroute/v1/peer/` and its JSON body.
struct Message {
    path: &'static str,
    body: Bytes,
}

/// What the task sending to a peer needs: cloned out of the router, which the task must not
/// keep alive.
#[derive(Clone)]
pub(crate) struct Courier {
    /// The HTTP client for small requests.
    pub client: Client<HttpConnector, Full<Bytes>>,
    /// `admin.token`, sent as a bearer token.
    pub token: Option<String>,
    /// This replica's id, sent in [`REPLICA_HEADER`].
    pub id: String,
    /// The peers now (an answer may say a peer is this replica itself).
    pub peers: Arc<PeerList>,
    /// `kvroute_replica_peer_messages_dropped_total`, by kind.
    pub dropped: Family<KindLabel, Counter>,
    /// How long a peer that answered a batch 404 gets messages one by one ([`SINGLES_FOR`]).
    pub singles_for: Duration,
}

/// How a request to a peer ended.
enum Sent {
    /// Taken (or the peer is this replica itself: nothing to send).
    Taken,
    /// The route is unknown there (404): a peer of an older build, for a batch.
    NoRoute,
    /// Not delivered, of this kind.
    Dropped(&'static str),
}

impl Courier {
    fn drop_messages(&self, kind: &'static str, count: usize) {
        self.dropped
            .get_or_create(&KindLabel { kind })
            .inc_by(count as u64);
    }

    fn drop_one(&self, kind: &'static str) {
        self.drop_messages(kind, 1);
    }

    /// Posts `body` to `/kvroute/v1/peer/<path>` on `peer` and waits for its answer, at most
    /// [`SEND_TIMEOUT`].
    async fn post(&self, peer: &str, path: &str, body: Bytes) -> Sent {
        let mut request = http::Request::post(format!(
            "{}/kvroute/v1/peer/{path}",
            peer.trim_end_matches('/'),
        ))
        .header(header::CONTENT_TYPE, "application/json")
        .header(REPLICA_HEADER, &self.id);
        if let Some(token) = &self.token {
            request = request.header(header::AUTHORIZATION, format!("Bearer {token}"));
        }
        let Ok(request) = request.body(Full::new(body)) else {
            return Sent::Dropped("invalid");
        };
        match tokio::time::timeout(SEND_TIMEOUT, self.client.request(request)).await {
            Err(_) => Sent::Dropped("timeout"),
            Ok(Err(_)) => Sent::Dropped("unreachable"),
            Ok(Ok(answer)) => {
                let status = answer.status();
                if self
                    .peers
                    .came_back(&self.id, peer, status, answer.headers())
                    || status.is_success()
                {
                    Sent::Taken
                } else if status == http::StatusCode::NOT_FOUND {
                    Sent::NoRoute
                } else {
                    Sent::Dropped("refused")
                }
            }
        }
    }

    /// Sends one message to `peer`.
    async fn send(&self, peer: &str, message: Message) {
        match self.post(peer, message.path, message.body).await {
            Sent::Taken => {}
            // A peer of an older build that lacks this message's route (`ended`): not an error
            // of the peer's, and counted apart so that `refused` keeps meaning one.
            Sent::NoRoute => self.drop_one("unsupported"),
            Sent::Dropped(kind) => self.drop_one(kind),
        }
    }

    /// Sends `messages` to `peer` in order: as one batch unless the peer had no batch route
    /// lately (`singles_until`, set for `singles_for` at a 404), else one by one.
    async fn send_all(
        &self,
        peer: &str,
        messages: Vec<Message>,
        singles_until: &mut Option<Instant>,
    ) {
        let batches = singles_until.is_none_or(|until| Instant::now() >= until);
        if messages.len() > 1 && batches {
            let count = messages.len();
            let body = batch_body(&messages);
            match self.post(peer, "batch", body).await {
                Sent::Taken => return,
                Sent::Dropped(kind) => return self.drop_messages(kind, count),
                Sent::NoRoute => *singles_until = Some(Instant::now() + self.singles_for),
            }
        }
        for message in messages {
            self.send(peer, message).await;
        }
    }
}

/// The body of `POST /kvroute/v1/peer/batch` for `messages` (each body is JSON already).
fn batch_body(messages: &[Message]) -> Bytes {
    let size = messages.iter().map(|m| m.body.len() + 32).sum::<usize>() + 16;
    let mut body = Vec::with_capacity(size);
    body.extend_from_slice(br#"{"messages":["#);
    for (i, message) in messages.iter().enumerate() {
        if i > 0 {
            body.push(b',');
        }
        body.extend_from_slice(br#"{"path":""#);
        body.extend_from_slice(message.path.as_bytes());
        body.extend_from_slice(br#"","body":"#);
        body.extend_from_slice(&message.body);
        body.push(b'}');
    }
    body.extend_from_slice(b"]}");
    Bytes::from(body)
}

/// Every peer's outbox, made at a peer's first message and dropped (its task then ends once it
/// has sent what it holds) when the peer leaves the list.
#[derive(Default)]
pub(crate) struct Outboxes {
    boxes: Mutex<HashMap<String, Outbox>>,
}

/// One peer's outbox: the queue its task empties, and the body bytes waiting in it.
struct Outbox {
    queue: mpsc::Sender<Message>,
    queued_bytes: Arc<AtomicUsize>,
}

impl Outbox {
    /// Queues `message` unless the outbox is full in messages or in bytes. Gives the message
    /// back when the outbox's task is gone.
    fn try_post(&self, message: Message) -> Result<(), Option<Message>> {
        let len = message.body.len();
        if self.queued_bytes.fetch_add(len, Ordering::Relaxed) + len > OUTBOX_MAX_BYTES {
            self.queued_bytes.fetch_sub(len, Ordering::Relaxed);
            return Err(None);
        }
        self.queue.try_send(message).map_err(|e| {
            self.queued_bytes.fetch_sub(len, Ordering::Relaxed);
            match e {
                TrySendError::Full(_) => None,
                TrySendError::Closed(message) => Some(message),
            }
        })
    }
}

impl Outboxes {
    /// Queues `body` for `/kvroute/v1/peer/<path>` on each of `peers`, without waiting; a full
    /// outbox drops it (counted). `courier` makes what a new outbox's task needs.
    pub(crate) fn post(
        &self,
        peers: &[String],
        path: &'static str,
        body: &Bytes,
        courier: impl Fn() -> Courier,
    ) {
        let mut boxes = self.boxes.lock();
        boxes.retain(|peer, _| peers.contains(peer));
        for peer in peers {
            let outbox = boxes
                .entry(peer.clone())
                .or_insert_with(|| open(peer, courier()));
            let message = Message {
                path,
                body: body.clone(),
            };
            match outbox.try_post(message) {
                Ok(()) => {}
                Err(None) => courier().drop_one("outbox_full"),
                Err(Some(message)) => {
                    // Its task is gone (its runtime ended): a fresh outbox, whose task is gone
                    // at once too where this runtime is shutting down (not a full outbox).
                    *outbox = open(peer, courier());
                    match outbox.try_post(message) {
                        Ok(()) => {}
                        Err(None) => courier().drop_one("outbox_full"),
                        Err(Some(_)) => courier().drop_one("shutdown"),
                    }
                }
            }
        }
    }
}

/// An outbox for `peer` and the task that empties it, in order: each request carries the
/// message that woke the task and whatever queued up behind it, up to a batch's bounds (a
/// message that would pass them leads the next request).
fn open(peer: &str, courier: Courier) -> Outbox {
    let (queue, mut messages) = mpsc::channel::<Message>(OUTBOX_CAPACITY);
    let queued_bytes = Arc::new(AtomicUsize::new(0));
    let peer = peer.to_owned();
    let queued = queued_bytes.clone();
    tokio::spawn(async move {
        let mut singles_until = None;
        let mut carried: Option<Message> = None;
        loop {
            let taken = |message: Message| {
                queued.fetch_sub(message.body.len(), Ordering::Relaxed);
                message
            };
            let first = match carried.take() {
                Some(message) => message,
                None => match messages.recv().await {
                    Some(message) => taken(message),
                    None => break,
                },
            };
            let mut bytes = first.body.len();
            let mut batch = vec![first];
            while batch.len() < MAX_BATCH_MESSAGES {
                let Ok(next) = messages.try_recv().map(taken) else {
                    break;
                };
                if bytes + next.body.len() > MAX_BATCH_BYTES {
                    carried = Some(next);
                    break;
                }
                bytes += next.body.len();
                batch.push(next);
            }
            courier.send_all(&peer, batch, &mut singles_until).await;
        }
    });
    Outbox {
        queue,
        queued_bytes,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use axum::extract::{Path, State};
    use hyper_util::rt::TokioExecutor;
    use tokio::net::TcpListener;
    use tokio::sync::Notify;

    use super::*;

    fn courier() -> Courier {
        Courier {
            client: Client::builder(TokioExecutor::new()).build_http(),
            token: None,
            id: "me".into(),
            peers: Arc::default(),
            dropped: Family::default(),
            singles_for: SINGLES_FOR,
        }
    }

    fn dropped(courier: &Courier, kind: &'static str) -> u64 {
        courier.dropped.get_or_create(&KindLabel { kind }).get()
    }

    /// What the peer saw: each message's path and body, in arrival order, and whether its
    /// answer to the first message had left when each arrived.
    #[derive(Default)]
    struct Seen {
        arrivals: Mutex<Vec<(String, bool)>>,
        first_answered: std::sync::atomic::AtomicBool,
        second_arrived: Notify,
        /// The test lets the first answer go.
        release: Notify,
    }

    /// A peer that holds its answer to the first message until a second one arrives or the test
    /// releases it: a sender that does not wait for answers sends the second one meanwhile.
    /// Without `batches` it is of an older build: no batch route (404, not recorded).
    async fn slow_peer(batches: bool) -> (String, Arc<Seen>) {
        let seen = Arc::new(Seen::default());
        let app =
            axum::Router::new()
                .route(
                    "/kvroute/v1/peer/{path}",
                    axum::routing::post(
                        move |State(seen): State<Arc<Seen>>,
                              Path(path): Path<String>,
                              body: String| async move {
                            if path == "batch" && !batches {
                                return http::StatusCode::NOT_FOUND;
                            }
                            let first = {
                                let mut arrivals = seen.arrivals.lock();
                                let answered = seen.first_answered.load(Ordering::SeqCst);
                                arrivals.push((format!("{path} {body}"), answered));
                                arrivals.len() == 1
                            };
                            if first {
                                let held = async {
                                    tokio::select! {
                                        () = seen.second_arrived.notified() => {}
                                        () = seen.release.notified() => {}
                                    }
                                };
                                let _ = tokio::time::timeout(Duration::from_secs(10), held).await;
                                seen.first_answered.store(true, Ordering::SeqCst);
                            } else {
                                seen.second_arrived.notify_one();
                            }
                            http::StatusCode::NO_CONTENT
                        },
                    ),
                )
                .with_state(seen.clone());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        (url, seen)
    }

    /// Waits until `seen` holds `count` arrivals.
    async fn arrivals(seen: &Seen, count: usize) -> Vec<(String, bool)> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while seen.arrivals.lock().len() < count {
            assert!(tokio::time::Instant::now() < deadline, "messages lost");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        seen.arrivals.lock().clone()
    }

    /// A slow peer (see [`slow_peer`]), the outboxes posting to it and their courier, once the
    /// peer holds its first message (`dispatch 1`) unanswered: what is posted next queues up.
    struct Holding {
        peers: Vec<String>,
        seen: Arc<Seen>,
        courier: Courier,
        outboxes: Outboxes,
    }

    impl Holding {
        /// Posts `body` to `/kvroute/v1/peer/<path>` on the peer.
        fn post(&self, path: &'static str, body: Bytes) {
            self.outboxes
                .post(&self.peers, path, &body, || self.courier.clone());
        }
    }

    async fn holding(batches: bool) -> Holding {
        let (peer, seen) = slow_peer(batches).await;
        let peers = vec![peer];
        let courier = courier();
        let outboxes = Outboxes::default();
        outboxes.post(&peers, "dispatch", &Bytes::from("1"), || courier.clone());
        arrivals(&seen, 1).await;
        Holding {
            peers,
            seen,
            courier,
            outboxes,
        }
    }

    /// Posts a dispatch, waits until the peer holds it, then posts its first token and end
    /// (which queue up behind it); returns what the peer saw.
    async fn a_request_to(batches: bool) -> (Vec<(String, bool)>, Courier) {
        let h = holding(batches).await;
        for path in ["prefill_done", "ended"] {
            h.post(path, Bytes::from("1"));
        }
        h.seen.release.notify_one();
        let count = if batches { 2 } else { 3 };
        (arrivals(&h.seen, count).await, h.courier)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn each_peer_gets_its_messages_in_order_each_after_the_last_was_answered() {
        let (arrivals, courier) = a_request_to(true).await;
        let batch =
            r#"batch {"messages":[{"path":"prefill_done","body":1},{"path":"ended","body":1}]}"#;
        assert_eq!(
            arrivals,
            vec![("dispatch 1".to_owned(), false), (batch.to_owned(), true)],
            "in posting order, what queued behind the first in one batch once it was answered"
        );
        assert_eq!(dropped(&courier, "timeout"), 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_peer_without_batches_gets_them_one_by_one_in_order() {
        let (arrivals, courier) = a_request_to(false).await;
        assert_eq!(
            arrivals,
            vec![
                ("dispatch 1".to_owned(), false),
                ("prefill_done 1".to_owned(), true),
                ("ended 1".to_owned(), true),
            ],
        );
        assert_eq!(
            dropped(&courier, "refused"),
            0,
            "the 404 to a batch loses nothing"
        );
    }

    /// A peer that answers a batch 404 (an older build) gets messages one by one for the
    /// courier's `singles_for`, even once it takes batches again, and a batch after that (it
    /// was upgraded meanwhile).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_peer_that_had_no_batch_route_gets_a_batch_again_after_a_while() {
        #[derive(Default)]
        struct Upgrading {
            takes_batches: std::sync::atomic::AtomicBool,
            arrivals: Mutex<Vec<String>>,
            release: Notify,
        }
        let peer = Arc::new(Upgrading::default());
        let app =
            axum::Router::new()
                .route(
                    "/kvroute/v1/peer/{path}",
                    axum::routing::post(
                        |State(peer): State<Arc<Upgrading>>,
                         Path(path): Path<String>,
                         body: String| async move {
                            if path == "batch" && !peer.takes_batches.load(Ordering::SeqCst) {
                                return http::StatusCode::NOT_FOUND;
                            }
                            peer.arrivals.lock().push(format!("{path} {body}"));
                            if body == "\"hold\"" {
                                let _ = tokio::time::timeout(
                                    Duration::from_secs(10),
                                    peer.release.notified(),
                                )
                                .await;
                            }
                            http::StatusCode::NO_CONTENT
                        },
                    ),
                )
                .with_state(peer.clone());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let peers = vec![format!("http://{}", listener.local_addr().unwrap())];
        tokio::spawn(async move { axum::serve(listener, app).await });
        let courier = Courier {
            singles_for: Duration::from_secs(3),
            ..courier()
        };
        let outboxes = Outboxes::default();
        let post = |body: &str| {
            outboxes.post(&peers, "ended", &Bytes::from(body.to_owned()), || {
                courier.clone()
            });
        };
        // Waits until `done` holds for what the peer took, then returns it.
        let arrived = async |done: &dyn Fn(&[String]) -> bool| {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            loop {
                let arrivals = peer.arrivals.lock().clone();
                if done(&arrivals) {
                    return arrivals;
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "messages lost: {arrivals:?}"
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        // A held message, then two queued behind it, which leave once it is answered: what the
        // peer took after the held one, until the second (`b`) arrived.
        let mut taken = 0;
        let mut two_after_a_held_one = async |a: &str, b: &str| {
            post("\"hold\"");
            arrived(&|arrivals| arrivals.len() > taken).await;
            post(a);
            post(b);
            peer.release.notify_one();
            let last = format!("{b}}}]}}");
            let arrivals = arrived(&|arrivals| {
                arrivals
                    .last()
                    .is_some_and(|m| m == &format!("ended {b}") || m.ends_with(&last))
            })
            .await;
            let after_held = arrivals[taken + 1..].to_vec();
            taken = arrivals.len();
            after_held
        };
        // The 404 comes between these two instants.
        let before_404 = tokio::time::Instant::now();
        let one_by_one = two_after_a_held_one("1", "2").await;
        let after_404 = tokio::time::Instant::now();
        assert_eq!(one_by_one, ["ended 1", "ended 2"], "the batch got 404");
        peer.takes_batches.store(true, Ordering::SeqCst);
        let still = two_after_a_held_one("3", "4").await;
        if before_404.elapsed() < courier.singles_for {
            assert_eq!(
                still,
                ["ended 3", "ended 4"],
                "within the while, one by one"
            );
        }
        tokio::time::sleep_until(after_404 + courier.singles_for).await;
        let batch = two_after_a_held_one("5", "6").await;
        assert_eq!(
            batch,
            [r#"batch {"messages":[{"path":"ended","body":5},{"path":"ended","body":6}]}"#],
            "after the while, a batch again"
        );
        assert_eq!(dropped(&courier, "refused"), 0, "the 404s lost nothing");
    }

    /// A message posted while the router's runtime shuts down has no task left to send it: it
    /// is counted as such, not as a full outbox (which would say a peer is too slow).
    #[test]
    fn a_message_posted_during_shutdown_is_counted_as_shutdown_not_outbox_full() {
        let courier = courier();
        let outboxes = Outboxes::default();
        // Nothing listens there; the message only has to be queued.
        let peers = vec!["http://127.0.0.1:9".to_owned()];
        let post = |body: &'static str| {
            outboxes.post(
                &peers,
                "ended",
                &Bytes::from_static(body.as_bytes()),
                || courier.clone(),
            );
        };
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let handle = runtime.handle().clone();
        runtime.block_on(async { post("1") });
        // The outbox's task ends with its runtime; a task spawned on it now ends at once.
        drop(runtime);
        let _entered = handle.enter();
        post("2");
        assert_eq!(dropped(&courier, "shutdown"), 1);
        assert_eq!(dropped(&courier, "outbox_full"), 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_message_an_older_peer_has_no_route_for_is_counted_unsupported_not_refused() {
        // A peer of a build before `/peer/ended`: 404 for it, 204 for the rest.
        let app = axum::Router::new().route(
            "/kvroute/v1/peer/{path}",
            axum::routing::post(|Path(path): Path<String>| async move {
                if path == "ended" {
                    http::StatusCode::NOT_FOUND
                } else {
                    http::StatusCode::NO_CONTENT
                }
            }),
        );
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let peers = vec![format!("http://{}", listener.local_addr().unwrap())];
        tokio::spawn(async move { axum::serve(listener, app).await });
        let courier = courier();
        let outboxes = Outboxes::default();
        outboxes.post(&peers, "ended", &Bytes::from("1"), || courier.clone());
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while dropped(&courier, "unsupported") == 0 {
            assert!(tokio::time::Instant::now() < deadline, "never counted");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(dropped(&courier, "refused"), 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_peer_that_never_answers_holds_one_connection_and_a_bounded_outbox() {
        // Accepts connections and reads nothing: every message waits out the timeout.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let peers = vec![format!("http://{}", listener.local_addr().unwrap())];
        let connections = Arc::new(AtomicUsize::new(0));
        let accepted = connections.clone();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((socket, _)) = listener.accept().await {
                accepted.fetch_add(1, Ordering::SeqCst);
                held.push(socket);
            }
        });
        let courier = courier();
        let outboxes = Outboxes::default();
        let posted = OUTBOX_CAPACITY + 500;
        for _ in 0..posted {
            outboxes.post(&peers, "dispatch", &Bytes::from_static(b"{}"), || {
                courier.clone()
            });
        }
        // The task holds one batch in flight, the outbox the rest it takes.
        let full = dropped(&courier, "outbox_full") as usize;
        let most_taken = OUTBOX_CAPACITY + MAX_BATCH_MESSAGES;
        assert!(
            (posted - most_taken..=posted - OUTBOX_CAPACITY).contains(&full),
            "{full} dropped of {posted}"
        );
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while dropped(&courier, "timeout") < 2 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "no timeouts counted"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let opened = connections.load(Ordering::SeqCst);
        assert!(
            (1..=3).contains(&opened),
            "{opened} connections for the first timed-out requests"
        );
    }

    /// A JSON body of `len` bytes (a string of `fill`).
    fn body_of(len: usize, fill: char) -> Bytes {
        Bytes::from(format!("\"{}\"", fill.to_string().repeat(len - 2)))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_batch_stays_within_its_bytes_and_what_would_pass_them_leads_the_next() {
        let h = holding(true).await;
        // Three of 100 KiB queue up behind the first: two fit a batch, the third does not.
        let fills = ['a', 'b', 'c'];
        for fill in fills {
            h.post("dispatch", body_of(100 << 10, fill));
        }
        h.seen.release.notify_one();
        let arrivals = arrivals(&h.seen, 3).await;
        let firsts: Vec<&str> = arrivals
            .iter()
            .map(|(text, _)| text.split(' ').next().unwrap())
            .collect();
        assert_eq!(firsts, ["dispatch", "batch", "dispatch"], "{firsts:?}");
        let (batch, single) = (&arrivals[1].0, &arrivals[2].0);
        assert!(batch.len() <= BATCH_BODY_LIMIT + "batch ".len());
        let order: Vec<char> = [batch, single]
            .iter()
            .flat_map(|text| {
                fills
                    .iter()
                    .filter(|f| text.contains(&f.to_string().repeat(64)))
            })
            .copied()
            .collect();
        assert_eq!(order, fills, "each message once, in posting order");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_outbox_of_large_messages_is_bounded_in_bytes() {
        // Accepts connections and reads nothing: what is queued stays queued.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let peers = vec![format!("http://{}", listener.local_addr().unwrap())];
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((socket, _)) = listener.accept().await {
                held.push(socket);
            }
        });
        let courier = courier();
        let outboxes = Outboxes::default();
        let (posted, size) = (200, 100 << 10);
        for _ in 0..posted {
            outboxes.post(&peers, "dispatch", &body_of(size, 'x'), || courier.clone());
        }
        // The outbox holds what fits its bytes; the task has taken at most a batch and the
        // message that would have passed it.
        let fits = OUTBOX_MAX_BYTES / size;
        let full = dropped(&courier, "outbox_full") as usize;
        assert!(
            (posted - fits - 3..=posted - fits).contains(&full),
            "{full} dropped of {posted}, {fits} fit"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_peer_that_leaves_the_list_loses_its_outbox_once_what_it_held_has_left() {
        let h = holding(true).await;
        // Queued behind the first (held unanswered), then the peer leaves the list.
        h.post("ended", Bytes::from_static(b"1"));
        h.outboxes
            .post(&[], "dispatch", &Bytes::from_static(b"2"), || {
                h.courier.clone()
            });
        assert!(h.outboxes.boxes.lock().is_empty(), "its outbox was dropped");
        h.seen.release.notify_one();
        assert_eq!(
            arrivals(&h.seen, 2).await,
            vec![
                ("dispatch 1".to_owned(), false),
                ("ended 1".to_owned(), true)
            ],
            "what it had queued still left, in order"
        );
    }
}
