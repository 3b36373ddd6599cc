//! Replicas telling each other where they sent each request (`replicas.share_dispatches`): a
//! `POST /kvroute/v1/peer/dispatch` to every peer's admin listener (through that peer's ordered
//! outbox, without waiting: [`crate::replica_state::Outboxes`]), which
//! records it with [`Fleet::peer_dispatched`](kvroute_core::fleet::Fleet::peer_dispatched):
//! predicted blocks, routing history, shared prefixes, session and placement, as if it had
//! sent the request itself. With `replicas.share_load`, the peer also counts the request in
//! the engine's load ([`Fleet::peer_prefill_started`]): its prefill until this replica posts
//! `POST /kvroute/v1/peer/prefill_done` at its first token (or its end without one), then its
//! decode until this replica posts `POST /kvroute/v1/peer/ended` at its end.
//!
//! [`Fleet::peer_prefill_started`]: kvroute_core::fleet::Fleet::peer_prefill_started

use std::hash::{Hash, Hasher};
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use kvroute_core::fleet::{Dispatch, RequestFeatures};
use kvroute_core::keys::RouterKey;
use kvroute_core::schedule::Role;
use kvroute_vllm::openai::ApiError;
use serde::{Deserialize, Serialize};
use tracing::warn;

use crate::edge::read_body_within;
use crate::endpoint::Endpoint;
use crate::replica_state::{Courier, REPLICA_HEADER, SINGLES_FOR};
use crate::reply::error_response;
use crate::service::Router;

/// The largest prefill-done or ended message read from a peer.
const REQUEST_MESSAGE_MAX_BYTES: usize = 4 << 10;

/// One dispatch, as sent to peers.
#[derive(Debug, Serialize, Deserialize)]
pub struct PeerDispatch {
    /// The endpoint's URL (replicas name endpoints alike by URL).
    pub endpoint: String,
    /// The model (or adapter) the request named.
    pub model: String,
    /// Tokens per block.
    pub block_size: usize,
    /// Prompt length.
    pub prompt_tokens: usize,
    /// The session the request named.
    pub session: Option<String>,
    /// Router keys of the prompt's full blocks.
    pub keys: Vec<RouterKey>,
    /// It counted as a placement at the endpoint.
    pub placement: bool,
    /// The sender's id for the request, when it shares its load: its prefill counts at the
    /// endpoint until a [`PeerRequestMessage`] names it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<u64>,
    /// Uncached prompt tokens the sender predicted there (with `request`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uncached_tokens: Option<u64>,
    /// The sender posts the request's end (with `request`): after its first token it counts as
    /// decoding at the endpoint until then. Absent from older builds, whose requests stop
    /// counting at their first token.
    #[serde(default)]
    pub shares_end: bool,
}

/// A message naming one shared request: on `/peer/prefill_done` its prefill is over (first
/// token, or its end without one), on `/peer/ended` the request is over.
#[derive(Debug, Serialize, Deserialize)]
pub struct PeerRequestMessage {
    /// The id its [`PeerDispatch`] gave.
    pub request: u64,
}

/// Says, at start, what peers can do to this replica unchecked. Peer messages go to the admin
/// listener, which needs `admin.token` only when it listens beyond loopback: without one, any
/// process that reaches it (another container of the pod, a host-network neighbour, a port
/// forward) can post dispatches, and with `replicas.share_load` add queued prefill to any
/// engine (each counted until `cache.predicted_ttl_s`), steering traffic away from it. This
/// is warned loudly and shown in `kvroute_replica_peer_messages_unauthenticated` (1), not
/// refused: a loopback admin listener is trusted for metrics and explanations alike, and
/// replicas on one host (`scripts/replicas.sh`) need no token. Also warned: peers found in Kubernetes reach this
/// replica at its pod IP, which a loopback admin listener never answers.
pub fn check_peer_access(router: &Router) {
    let config = router.config();
    let replicas = &config.replicas;
    let has_peers = !replicas.peers.is_empty() || replicas.kubernetes.is_some();
    let open = has_peers && replicas.share_dispatches && config.admin.token.is_none();
    router
        .metrics()
        .replica_peer_messages_unauthenticated
        .set(i64::from(open));
    if open {
        let shares = if replicas.share_load {
            "dispatches and in-flight load"
        } else {
            "dispatches"
        };
        warn!(admin = %config.admin.listen, shares, "replicas share {shares} without admin.token: any process that reaches the admin listener can post peer messages and inflate an engine's load or cached blocks here; set admin.token (the same on every replica)");
    }
    if replicas.kubernetes.is_some() && config.admin.listen.ip().is_loopback() {
        warn!(admin = %config.admin.listen, "replicas.kubernetes: peers reach this replica at its pod IP, but admin.listen is a loopback address: they cannot ask it for snapshots or send it dispatches (listen on 0.0.0.0 with admin.token)");
    }
}

/// Tells every peer about `dispatch` of the request of `features` (when dispatches are shared),
/// without waiting.
pub fn dispatched(router: &Router, features: &RequestFeatures<'_>, dispatch: &Dispatch) {
    let config = &router.config().replicas;
    if !config.share_dispatches || router.replica().peers().is_empty() {
        return;
    }
    let request = config.share_load.then(|| request_id(router, dispatch));
    let message = PeerDispatch {
        endpoint: router.endpoint(dispatch.endpoint).config.url.clone(),
        model: features.model.to_owned(),
        block_size: features.block_size,
        prompt_tokens: features.prompt_tokens,
        session: features.session.map(str::to_owned),
        keys: features.keys.to_vec(),
        placement: dispatch.placement,
        request,
        uncached_tokens: request.map(|_| dispatch.uncached_tokens),
        shares_end: request.is_some(),
    };
    post_to_peers(router, "dispatch", &message);
}

/// Tells every peer that the prefill of `dispatch` (one this replica shared) is over: call
/// once, at its first token or at its end without one.
pub fn prefill_done(router: &Router, dispatch: &Dispatch) {
    post_request_message(router, dispatch, "prefill_done");
}

/// Tells every peer that `dispatch` (one this replica shared) ended: call once, at its end,
/// after [`prefill_done`].
pub fn ended(router: &Router, dispatch: &Dispatch) {
    post_request_message(router, dispatch, "ended");
}

/// Posts a [`PeerRequestMessage`] naming `dispatch` to `/kvroute/v1/peer/<path>` on every peer,
/// when this replica shares its load.
fn post_request_message(router: &Router, dispatch: &Dispatch, path: &'static str) {
    let config = &router.config().replicas;
    if !config.share_dispatches || !config.share_load || router.replica().peers().is_empty() {
        return;
    }
    let message = PeerRequestMessage {
        request: request_id(router, dispatch),
    };
    post_to_peers(router, path, &message);
}

/// The id peers know `dispatch` by: a hash of this replica's random nonce and what makes the
/// dispatch unique here (its endpoint and instant), so that nothing has to be stored to name
/// it again at its first token.
fn request_id(router: &Router, dispatch: &Dispatch) -> u64 {
    let mut hasher = router.replica().request_hasher();
    dispatch.endpoint.0.hash(&mut hasher);
    dispatch.dispatched_at.to_bits().hash(&mut hasher);
    dispatch.prompt_tokens.hash(&mut hasher);
    dispatch.uncached_tokens.hash(&mut hasher);
    hasher.finish()
}

/// Posts `message` to `/kvroute/v1/peer/<path>` on every peer, without waiting: each peer's
/// messages leave in order through its outbox, and what does not fit or is not taken is
/// dropped and counted (a lost message only costs what sharing would have won).
fn post_to_peers(router: &Router, path: &'static str, message: &impl Serialize) {
    let Ok(body) = serde_json::to_vec(message) else {
        return;
    };
    let replica = router.replica();
    let courier = || Courier {
        client: router.client().clone(),
        token: router.config().admin.token.clone(),
        id: replica.id().to_owned(),
        peers: replica.peer_list(),
        dropped: router.metrics().replica_peer_messages_dropped.clone(),
        singles_for: SINGLES_FOR,
    };
    replica
        .outboxes()
        .post(&replica.peers(), path, &Bytes::from(body), courier);
}

/// Whether a peer request (`headers`) is this replica's own, sent to its own admin listener as
/// if to a peer: then it is dropped (recording it would count the request twice) and counted in
/// `kvroute_replica_self_messages_total`; the answer ([`own_message_refused`]) tells the sender
/// to leave that address out of its peers.
pub(crate) fn own_message(router: &Router, headers: &http::HeaderMap) -> bool {
    let sender = headers.get(REPLICA_HEADER).and_then(|v| v.to_str().ok());
    if !router.replica().sent_by_itself(sender) {
        return false;
    }
    router.metrics().replica_self_messages.inc();
    true
}

/// The answer to this replica's own peer request: 409, with its id in [`REPLICA_HEADER`].
pub(crate) fn own_message_refused(router: &Router) -> Response {
    let mut response = error_response(
        router,
        &ApiError::new(409, "a replica's own peer request: it is not its own peer"),
    );
    if let Ok(id) = http::HeaderValue::from_str(router.replica().id()) {
        response.headers_mut().insert(REPLICA_HEADER, id);
    }
    response
}

/// Reads a peer's message of type `T`: this replica's own is refused ([`own_message`]); the
/// body is read within `limit` bytes and must be `T`'s JSON (else 400 naming `what`). The
/// error is the answer to send.
pub(crate) async fn read_peer_message<T: serde::de::DeserializeOwned>(
    router: &Router,
    request: Request,
    limit: usize,
    what: &str,
) -> Result<T, Response> {
    if own_message(router, request.headers()) {
        return Err(own_message_refused(router));
    }
    let body = read_body_within(request.into_body(), limit)
        .await
        .map_err(|e| error_response(router, &e))?;
    serde_json::from_slice(&body).map_err(|e| {
        error_response(
            router,
            &ApiError::bad_request(format!("not {what}: {e}"), None),
        )
    })
}

/// `POST /kvroute/v1/peer/dispatch`: a peer replica's dispatch, recorded in this one's fleet.
pub async fn receive(State(router): State<Arc<Router>>, request: Request) -> Response {
    let limit = router.config().limits.max_body_bytes;
    let message: PeerDispatch = match read_peer_message(&router, request, limit, "a dispatch").await
    {
        Ok(m) => m,
        Err(answer) => return answer,
    };
    match PeerRecord::resolve(&router, message) {
        Ok(record) => {
            let mut fleet = router.fleet();
            let now = router.now();
            record.apply(&router, &mut fleet, now);
            StatusCode::NO_CONTENT.into_response()
        }
        Err(why) => error_response(&router, &ApiError::bad_request(why, None)),
    }
}

/// A peer's dispatch, checked and its endpoint's candidates looked up before the fleet's lock
/// is taken to record it.
pub(crate) struct PeerRecord {
    /// The endpoints here with the message's URL: the present one, and removed ones that still
    /// hold a slot (a pod removed and re-added keeps its URL in a new slot). Which one is
    /// present is only known under the fleet's lock; none present, it is ignored.
    candidates: Vec<Arc<Endpoint>>,
    message: PeerDispatch,
}

impl PeerRecord {
    /// `message` checked against this replica ([`check`]: refused, and warned, when it does not
    /// fit) and the endpoints with its URL looked up.
    pub(crate) fn resolve(router: &Router, message: PeerDispatch) -> Result<Self, String> {
        if let Err(why) = check(router, &message) {
            warn!(peer_endpoint = %message.endpoint, model = %message.model, %why, "refusing a peer's dispatch: the replicas are configured differently");
            return Err(why);
        }
        let candidates = router
            .endpoints()
            .into_iter()
            .filter(|e| e.config.url == message.endpoint)
            .collect();
        Ok(Self {
            candidates,
            message,
        })
    }

    /// Records it in `fleet` (the fleet's lock held, `now` read under it) against the present
    /// endpoint with its URL, if any: a removed one's slot would take it and core drop it.
    pub(crate) fn apply(self, router: &Router, fleet: &mut kvroute_core::fleet::Fleet, now: f64) {
        let Some(endpoint) = self
            .candidates
            .iter()
            .find(|e| router.is_current(fleet, e))
            .map(|e| e.id)
        else {
            return;
        };
        let message = self.message;
        let keys = Arc::new(message.keys);
        let features = RequestFeatures {
            model: &message.model,
            keys: &keys,
            prompt_tokens: message.prompt_tokens,
            block_size: message.block_size,
            session: message.session.as_deref(),
            role: Role::Both,
        };
        fleet.peer_dispatched(&features, endpoint, message.placement, now);
        if let (Some(request), Some(uncached)) = (message.request, message.uncached_tokens) {
            // Never more than the prompt: a peer's figure is bounded like anything it sends.
            let uncached = uncached.min(message.prompt_tokens as u64);
            fleet.peer_prefill_started(request, endpoint, uncached, message.shares_end, now);
        }
    }
}

/// `POST /kvroute/v1/peer/prefill_done`: a peer's shared request got its first token (or ended
/// without one); its prefill no longer counts in the engine's load here.
pub async fn receive_prefill_done(State(router): State<Arc<Router>>, request: Request) -> Response {
    receive_request_message(&router, request, "prefill-done", |fleet, id, now| {
        fleet.peer_prefill_done(id, now);
    })
    .await
}

/// `POST /kvroute/v1/peer/ended`: a peer's shared request ended; it no longer counts in the
/// engine's load here.
pub async fn receive_ended(State(router): State<Arc<Router>>, request: Request) -> Response {
    receive_request_message(&router, request, "ended", |fleet, id, now| {
        fleet.peer_request_ended(id, now);
    })
    .await
}

/// Reads a peer's message naming one of its requests (a few dozen bytes) and applies it.
async fn receive_request_message(
    router: &Router,
    request: Request,
    what: &str,
    apply: impl FnOnce(&mut kvroute_core::fleet::Fleet, u64, f64),
) -> Response {
    let what = format!("a {what} message");
    let message: PeerRequestMessage =
        match read_peer_message(router, request, REQUEST_MESSAGE_MAX_BYTES, &what).await {
            Ok(m) => m,
            Err(answer) => return answer,
        };
    let mut fleet = router.fleet();
    let now = router.now();
    apply(&mut fleet, message.request, now);
    StatusCode::NO_CONTENT.into_response()
}

/// Whether a peer's dispatch fits this replica: a model it serves, keyed with that model's
/// block size, no more blocks than it keys itself. Keys made otherwise would match nothing
/// here, or the wrong blocks.
fn check(router: &Router, message: &PeerDispatch) -> Result<(), String> {
    let Some((model, _)) = router.model(&message.model) else {
        return Err(format!(
            "this replica does not serve the model {:?}",
            message.model
        ));
    };
    if message.block_size != model.block_size {
        return Err(format!(
            "block size {} for {:?}, this replica keys it with {}",
            message.block_size, message.model, model.block_size
        ));
    }
    // No prompt this replica accepts has more tokens than its body limit has bytes.
    let longest = router.config().limits.max_body_bytes;
    if message.prompt_tokens > longest {
        return Err(format!(
            "a prompt of {} tokens, more than limits.max_body_bytes ({longest}) allows",
            message.prompt_tokens
        ));
    }
    let most = router.config().limits.max_routed_blocks;
    if message.keys.len() > most {
        return Err(format!(
            "{} block keys, more than limits.max_routed_blocks ({most})",
            message.keys.len()
        ));
    }
    Ok(())
}
