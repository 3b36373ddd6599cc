//! Peer messages in order: one bounded outbox per peer, drained by one task that sends its
//! messages one at a time, each answered (or given up on) before the next leaves.
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

use super::{PeerList, REPLICA_HEADER};
use crate::metrics::KindLabel;

/// Messages waiting for one peer; more are dropped (kind `outbox_full`).
pub(crate) const OUTBOX_CAPACITY: usize = 4_096;

/// How long a peer has to answer one message (kind `timeout` past it).
const SEND_TIMEOUT: Duration = Duration::from_secs(1);

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
}

impl Courier {
    fn drop_one(&self, kind: &'static str) {
        self.dropped.get_or_create(&KindLabel { kind }).inc();
    }

    /// Sends one message to `peer` and waits for its answer, at most [`SEND_TIMEOUT`].
    async fn send(&self, peer: &str, message: Message) {
        let mut request = http::Request::post(format!(
            "{}/kvroute/v1/peer/{}",
            peer.trim_end_matches('/'),
            message.path
        ))
        .header(header::CONTENT_TYPE, "application/json")
        .header(REPLICA_HEADER, &self.id);
        if let Some(token) = &self.token {
            request = request.header(header::AUTHORIZATION, format!("Bearer {token}"));
        }
        let Ok(request) = request.body(Full::new(message.body)) else {
            return self.drop_one("invalid");
        };
        match tokio::time::timeout(SEND_TIMEOUT, self.client.request(request)).await {
            Err(_) => self.drop_one("timeout"),
            Ok(Err(_)) => self.drop_one("unreachable"),
            Ok(Ok(answer)) => {
                let status = answer.status();
                let own = self
                    .peers
                    .came_back(&self.id, peer, status, answer.headers());
                if !own && !status.is_success() {
                    self.drop_one("refused");
                }
            }
        }
    }
}

/// Every peer's outbox, made at a peer's first message and dropped (its task then ends once it
/// has sent what it holds) when the peer leaves the list.
#[derive(Default)]
pub(crate) struct Outboxes {
    boxes: Mutex<HashMap<String, mpsc::Sender<Message>>>,
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
            match outbox.try_send(message) {
                Ok(()) => {}
                Err(TrySendError::Full(_)) => courier().drop_one("outbox_full"),
                Err(TrySendError::Closed(message)) => {
                    // Its task is gone (the runtime is shutting down): a fresh outbox.
                    *outbox = open(peer, courier());
                    if outbox.try_send(message).is_err() {
                        courier().drop_one("outbox_full");
                    }
                }
            }
        }
    }
}

/// An outbox for `peer` and the task that empties it, in order.
fn open(peer: &str, courier: Courier) -> mpsc::Sender<Message> {
    let (outbox, mut messages) = mpsc::channel(OUTBOX_CAPACITY);
    let peer = peer.to_owned();
    tokio::spawn(async move {
        while let Some(message) = messages.recv().await {
            courier.send(&peer, message).await;
        }
    });
    outbox
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
    }

    /// A peer that holds its answer to the first message until a second one arrives or 300 ms
    /// pass: a sender that does not wait for answers sends the second one meanwhile.
    async fn slow_peer() -> (String, Arc<Seen>) {
        let seen = Arc::new(Seen::default());
        let app = axum::Router::new()
            .route(
                "/kvroute/v1/peer/{path}",
                axum::routing::post(
                    |State(seen): State<Arc<Seen>>, Path(path): Path<String>, body: String| async move {
                        let first = {
                            let mut arrivals = seen.arrivals.lock();
                            let answered = seen.first_answered.load(Ordering::SeqCst);
                            arrivals.push((format!("{path} {body}"), answered));
                            arrivals.len() == 1
                        };
                        if first {
                            let _ = tokio::time::timeout(
                                Duration::from_millis(300),
                                seen.second_arrived.notified(),
                            )
                            .await;
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

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn each_peer_gets_its_messages_in_order_each_after_the_last_was_answered() {
        let (peer, seen) = slow_peer().await;
        let peers = vec![peer];
        let courier = courier();
        let outboxes = Outboxes::default();
        for (path, body) in [("dispatch", "1"), ("prefill_done", "1"), ("ended", "1")] {
            outboxes.post(&peers, path, &Bytes::from(body), || courier.clone());
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while seen.arrivals.lock().len() < 3 {
            assert!(tokio::time::Instant::now() < deadline, "messages lost");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let arrivals = seen.arrivals.lock().clone();
        assert_eq!(
            arrivals,
            vec![
                ("dispatch 1".to_owned(), false),
                ("prefill_done 1".to_owned(), true),
                ("ended 1".to_owned(), true),
            ],
            "in posting order, none sent before the first was answered"
        );
        assert_eq!(dropped(&courier, "timeout"), 0);
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
        // The task holds one message in flight, the outbox the rest it takes.
        let full = dropped(&courier, "outbox_full") as usize;
        assert!(
            (posted - OUTBOX_CAPACITY - 1..=posted - OUTBOX_CAPACITY).contains(&full),
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
            "{opened} connections for 2 timed-out messages"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_peer_that_leaves_the_list_loses_its_outbox() {
        let (peer, seen) = slow_peer().await;
        let courier = courier();
        let outboxes = Outboxes::default();
        outboxes.post(
            std::slice::from_ref(&peer),
            "dispatch",
            &Bytes::from_static(b"1"),
            || courier.clone(),
        );
        outboxes.post(&[], "dispatch", &Bytes::from_static(b"2"), || {
            courier.clone()
        });
        assert!(outboxes.boxes.lock().is_empty());
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while !seen.first_answered.load(Ordering::SeqCst) {
            assert!(tokio::time::Instant::now() < deadline, "first message lost");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let arrivals = seen.arrivals.lock().clone();
        assert_eq!(
            arrivals,
            vec![("dispatch 1".to_owned(), false)],
            "what was queued still leaves; nothing after the peer left"
        );
    }
}
