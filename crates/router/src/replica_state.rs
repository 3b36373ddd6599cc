//! A replica's own state, below everything that serves or warms it: its peers (static, or found
//! in Kubernetes), the journal it answers peers' snapshots from (each endpoint's event
//! position), the nonce of the ids it gives shared requests, and where its warm-up stands (the
//! warm-up itself is the `replica` module's).

use std::collections::HashSet;
use std::collections::hash_map::{DefaultHasher, RandomState};
use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::{Mutex, MutexGuard, RwLock};
use serde::Serialize;
use tokio::sync::Notify;
use tracing::warn;

use crate::config::ReplicasConfig;
use crate::journal::Journal;

mod outbox;

pub(crate) use outbox::{BATCH_BODY_LIMIT, Courier, MAX_BATCH_MESSAGES, Outboxes, SINGLES_FOR};

/// Where a replica's warm-up stands.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum WarmStatus {
    /// No peers configured: no warm-up, ready at once (as a single router).
    NotConfigured,
    /// Still warming up: readiness fails.
    Warming,
    /// Warm: the index was copied from `peer` (or, `None`, rebuilt from the engines' replay
    /// buffers) and every endpoint's events caught up.
    Warm {
        /// The peer whose snapshot was applied.
        peer: Option<String>,
        /// Seconds the warm-up took.
        seconds: f64,
    },
    /// The timeout passed first: ready, with `untrusted` endpoints routed by load only until
    /// their events are trusted again.
    TimedOut {
        /// The peer whose snapshot was applied, if one answered.
        peer: Option<String>,
        /// Endpoints whose events had not caught up.
        untrusted: Vec<String>,
    },
}

/// The request header naming the replica that sends a peer message (or asks for a snapshot):
/// a replica that receives its own id is among its own peers.
pub const REPLICA_HEADER: &str = "x-kvroute-replica";

/// The peers' admin listeners now: `replicas.peers`, and those found in Kubernetes, less the
/// addresses at which this replica reached itself. Shared with the tasks that send peer
/// messages, which learn from the answers which addresses are the replica's own.
#[derive(Default)]
pub struct PeerList {
    list: RwLock<Arc<Vec<String>>>,
    /// The authorities (`host:port`) of peer URLs at which this replica reached itself: left
    /// out of its peers from then on, whatever discovery finds. Only URLs this replica sent to
    /// itself get here (at most its peer list's), never an address a request names.
    own: Mutex<HashSet<String>>,
}

impl PeerList {
    /// The peers now.
    pub fn current(&self) -> Arc<Vec<String>> {
        self.list.read().clone()
    }

    /// Replaces the peers with `peers`, less the addresses known to be this replica's own.
    fn set(&self, mut peers: Vec<String>) {
        let own = self.own.lock();
        peers.retain(|p| !own.contains(&authority(p)));
        *self.list.write() = Arc::new(peers);
    }

    /// Whether a peer's answer (`status`, `headers`) says the request reached this replica
    /// itself (409 with this replica's `id`): then `peer`, the URL it was sent to, is left out of
    /// the peers from now on (warned once).
    pub(crate) fn came_back(
        &self,
        id: &str,
        peer: &str,
        status: http::StatusCode,
        headers: &http::HeaderMap,
    ) -> bool {
        let echoed = headers.get(REPLICA_HEADER).and_then(|v| v.to_str().ok());
        if status != http::StatusCode::CONFLICT || echoed != Some(id) {
            return false;
        }
        if self.forget_own(peer) {
            warn!(
                %peer,
                "this replica reached its own admin listener as a peer (its pod name or address among the peers): that address is no longer a peer"
            );
        }
        true
    }

    /// Leaves `peer` (a URL this replica sent a peer message to, and that answered with this
    /// replica's own id) out of the peers from now on. Returns whether it was not known yet.
    fn forget_own(&self, peer: &str) -> bool {
        let address = authority(peer);
        let mut own = self.own.lock();
        if !own.insert(address.clone()) {
            return false;
        }
        let mut list = self.list.write();
        let kept: Vec<String> = list
            .iter()
            .filter(|p| authority(p) != address)
            .cloned()
            .collect();
        *list = Arc::new(kept);
        true
    }
}

/// A replica's own state: the journal it answers peers' snapshots from, and its warm-up.
pub struct ReplicaState {
    journal: Option<Mutex<Journal>>,
    /// The peers' admin listeners now.
    peers: Arc<PeerList>,
    /// This replica's id (random per process), sent with every peer message in
    /// [`REPLICA_HEADER`].
    id: String,
    /// Whether the peers are known (at once for a static list; after the first list of the
    /// router's pods with `replicas.kubernetes`), and its signal.
    peers_known: AtomicBool,
    peers_listed: Notify,
    /// Seeds the ids peers know this replica's requests by (random per process).
    request_ids: RandomState,
    warming: AtomicBool,
    status: Mutex<WarmStatus>,
    /// One ordered, bounded outbox per peer for the messages this replica shares.
    outboxes: Outboxes,
}

impl ReplicaState {
    /// The state for `config`: a journal and a warm-up when it names peers.
    pub fn new(config: &ReplicasConfig) -> Self {
        let peers = !config.peers.is_empty() || config.kubernetes.is_some();
        Self {
            journal: peers.then(|| Mutex::new(Journal::default())),
            peers: Arc::new(PeerList {
                list: RwLock::new(Arc::new(config.peers.clone())),
                own: Mutex::default(),
            }),
            id: format!("{:016x}", RandomState::new().hash_one(0u8)),
            peers_known: AtomicBool::new(config.kubernetes.is_none()),
            peers_listed: Notify::new(),
            request_ids: RandomState::new(),
            warming: AtomicBool::new(peers),
            status: Mutex::new(if peers {
                WarmStatus::Warming
            } else {
                WarmStatus::NotConfigured
            }),
            outboxes: Outboxes::default(),
        }
    }

    /// Every peer's outbox: messages to peers leave through it, in order.
    pub(crate) fn outboxes(&self) -> &Outboxes {
        &self.outboxes
    }

    /// The journal, when this replica keeps one (it has peers).
    pub fn journal(&self) -> Option<MutexGuard<'_, Journal>> {
        self.journal.as_ref().map(Mutex::lock)
    }

    /// Whether this replica keeps a journal (it has peers, static or discovered), so it can
    /// answer their snapshots.
    pub fn keeps_journal(&self) -> bool {
        self.journal.is_some()
    }

    /// The peers' admin listeners now (the static list, and those found in Kubernetes).
    pub fn peers(&self) -> Arc<Vec<String>> {
        self.peers.current()
    }

    /// The peer list itself, for tasks that outlive a borrow of the router.
    pub(crate) fn peer_list(&self) -> Arc<PeerList> {
        self.peers.clone()
    }

    /// Replaces the peers found in Kubernetes (`found`, beside the static `configured` ones):
    /// from now on dispatches go to them, and a warm-up waiting for its first list goes on.
    pub(crate) fn set_peers(&self, configured: &[String], found: Vec<String>) {
        let mut peers = configured.to_vec();
        peers.extend(found.into_iter().filter(|p| !configured.contains(p)));
        self.peers.set(peers);
        self.peers_known.store(true, Ordering::Release);
        self.peers_listed.notify_waiters();
    }

    /// This replica's id, as [`REPLICA_HEADER`] carries it.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Whether a peer message carrying `sender` (its [`REPLICA_HEADER`]) was sent by this very
    /// replica to its own admin listener (a configured peer list naming every replica, or
    /// discovery that did not recognise this replica's own pod): it is dropped, and answered
    /// with the id so that the sending side, which knows the URL it used, forgets that peer
    /// ([`PeerList::forget_own`]). The request's own addresses (`Host`) are never trusted for
    /// that: any peer knows the id and could name a real peer's address in them.
    pub fn sent_by_itself(&self, sender: Option<&str>) -> bool {
        sender == Some(self.id.as_str())
    }

    /// Resolves once the peers are known (at once for a static list).
    pub async fn peers_known(&self) {
        loop {
            let listed = self.peers_listed.notified();
            if self.peers_known.load(Ordering::Acquire) {
                return;
            }
            listed.await;
        }
    }

    /// A hasher seeded with this replica's random nonce, for the ids of requests it shares with
    /// peers (unique across replicas without coordination).
    pub fn request_hasher(&self) -> DefaultHasher {
        self.request_ids.build_hasher()
    }

    /// Whether the warm-up is still running (readiness fails meanwhile).
    pub fn warming(&self) -> bool {
        self.warming.load(Ordering::Acquire)
    }

    /// How the warm-up went.
    pub fn status(&self) -> WarmStatus {
        self.status.lock().clone()
    }

    /// Ends the warm-up with `status`: ready from now on.
    pub(crate) fn finish(&self, status: WarmStatus) {
        *self.status.lock() = status;
        self.warming.store(false, Ordering::Release);
    }
}

/// The `host:port` of a peer URL (`http://host:port`), as a request to it names it in `Host`.
fn authority(url: &str) -> String {
    url.parse::<http::Uri>()
        .ok()
        .and_then(|u| u.authority().map(|a| a.as_str().to_owned()))
        .unwrap_or_else(|| url.to_owned())
}
