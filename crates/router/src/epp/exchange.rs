//! One ext_proc stream, which is one HTTP exchange seen by the data plane: check the path
//! against `serve`'s allowlist, buffer the request body (charged to the router's byte budget,
//! due within the body timeout), ask the router for the same plan `kvroute serve` would make,
//! name the endpoint, then follow the response (status, body chunks, usage) into the same
//! accounting as the proxy: on this stream when the gateway sends the response here, or on the
//! observer stream that claims it ([`super::handoff`]).

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse, processing_response,
};
use kvroute_core::index::EndpointId;
use kvroute_vllm::openai::ApiError;
use parking_lot::Mutex;

use super::handoff::{self, Followed, Handoffs};
use super::protocol;
use crate::accounting::Outcome;
use crate::budget::BudgetHold;
use crate::pd::ClientBody;
use crate::pipeline::{self, Leg, Prepared};
use crate::proxy::{self, Api, Refused, Routed, healthy_rotation};
use crate::service::Router;

/// The state of one exchange.
pub struct Exchange {
    router: Arc<Router>,
    fallbacks: usize,
    started: Instant,
    path: String,
    headers: http::HeaderMap,
    subset: Option<Vec<String>>,
    body: Vec<u8>,
    /// The ext_proc messages the request body came in (one in `BUFFERED` mode, the only mode
    /// in which the picker can replace it).
    body_messages: u32,
    /// The data plane's request body mode, when it says (Envoy sends its protocol
    /// configuration with a stream's first message; older releases do not): the number itself
    /// when this build does not know it.
    request_body_mode: Option<Result<BodySendMode, i32>>,
    /// The request body to send upstream instead of the client's (a client's
    /// `kv_transfer_params` removed under P/D), with the routing answer.
    replaced_body: Option<Vec<u8>>,
    /// The request body's bytes, charged to the router's budget until it is routed.
    hold: Option<BudgetHold>,
    /// When the rest of the request body is due (while one is expected).
    body_due: Option<tokio::time::Instant>,
    /// Set once routed (or claimed, on an observer stream): the request's share of its
    /// endpoint's load.
    followed: Option<Followed>,
    /// The routed endpoint's name, for the response header.
    endpoint_name: Option<String>,
    /// Where routed requests wait for their observer stream.
    handoffs: Arc<Handoffs>,
    /// The token this stream's request is offered under, until the stream ends.
    offered: Option<u64>,
    /// The prefill endpoint (`host:port`) core chose for the routed request, named in
    /// `x-prefiller-host-port` (header mode for llm-d's P/D sidecar).
    prefiller: Option<String>,
    /// This is an observer stream (Envoy's `observability_mode`: nothing is answered).
    observer: bool,
    /// The response was followed to its end (or there is nothing to follow).
    ended: bool,
    /// The response headers came on this stream.
    response_seen: bool,
}

impl Drop for Exchange {
    fn drop(&mut self) {
        let Some(token) = self.offered.take() else {
            return;
        };
        // A response still to follow may yet be claimed by an observer stream a moment behind:
        // when the gateway runs observers, or when this stream ended before the response began
        // here (Envoy may close it as soon as its own phases are done). Otherwise the request
        // is over.
        let unfinished = self.followed.as_ref().is_some_and(|f| f.lock().is_some());
        let awaited = self.handoffs.observed() || !self.response_seen;
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) if unfinished && awaited => {
                let handoffs = self.handoffs.clone();
                runtime.spawn(async move {
                    tokio::time::sleep(handoff::CLAIM_GRACE).await;
                    handoffs.withdraw(token);
                });
            }
            _ => self.handoffs.withdraw(token),
        }
    }
}

impl Exchange {
    /// A new exchange; `fallbacks` bounds the endpoints named in the `envoy.lb` list; `hold`
    /// is charged with the request body as it arrives; routed requests are offered to their
    /// observer stream in `handoffs`.
    pub fn new(
        router: Arc<Router>,
        fallbacks: usize,
        hold: BudgetHold,
        handoffs: Arc<Handoffs>,
    ) -> Self {
        Self {
            router,
            fallbacks: fallbacks.max(1),
            started: Instant::now(),
            path: String::new(),
            headers: http::HeaderMap::new(),
            subset: None,
            body: Vec::new(),
            body_messages: 0,
            request_body_mode: None,
            replaced_body: None,
            hold: Some(hold),
            body_due: None,
            followed: None,
            endpoint_name: None,
            handoffs,
            offered: None,
            prefiller: None,
            observer: false,
            ended: false,
            response_seen: false,
        }
    }

    /// An observer stream that followed its response to the end (or found none to follow):
    /// ending the stream tells Envoy that no more messages are needed.
    pub fn observed_to_end(&self) -> bool {
        self.observer && self.ended
    }

    /// How long a request body may take to arrive (`limits.body_timeout_ms`).
    pub fn body_timeout(&self) -> Duration {
        Duration::from_millis(self.router.config().limits.body_timeout_ms)
    }

    /// When the rest of the request body is due, while one is expected.
    pub fn body_due(&self) -> Option<tokio::time::Instant> {
        self.body_due
    }

    /// The answer when the request body did not arrive in time: 408, counted as a client
    /// timeout of kind `body`.
    pub fn body_timed_out(&mut self) -> ProcessingResponse {
        self.router
            .metrics()
            .client_timeouts
            .get_or_create(&crate::metrics::KindLabel { kind: "body" })
            .inc();
        let timeout = self.body_timeout();
        self.refuse(
            &ApiError::client_timeout(format!(
                "the request body did not arrive within {timeout:?}"
            ))
            .into(),
        )
    }

    /// The answer to a message the stream could not deliver: 413 when it was over the size
    /// limit, 400 when it could not be decoded; `None` for the data plane ending the stream.
    pub fn undecodable(&mut self, status: &tonic::Status) -> Option<ProcessingResponse> {
        // A transport error (Envoy resetting the stream once its exchange is over, which tonic
        // also reports as `Internal`) carries its cause; a message that could not be decoded
        // does not.
        if std::error::Error::source(status).is_some() {
            return None;
        }
        let error = match status.code() {
            tonic::Code::OutOfRange | tonic::Code::ResourceExhausted => ApiError::too_large(
                format!("the ext_proc message is too large: {}", status.message()),
            ),
            tonic::Code::Internal | tonic::Code::InvalidArgument => ApiError::bad_request(
                format!(
                    "the ext_proc message cannot be decoded: {}",
                    status.message()
                ),
                None,
            ),
            _ => return None,
        };
        tracing::warn!(%status, "an ext_proc message was refused");
        Some(self.refuse(&error.into()))
    }

    /// The answer to a stream over `limits.max_picker_streams`: 503.
    pub fn too_many_streams(&mut self) -> ProcessingResponse {
        self.refuse(
            &ApiError::unavailable("the picker serves as many streams as it may; retry shortly")
                .into(),
        )
    }

    /// The answer to one message of the data plane (`None`: nothing to answer, as for every
    /// message of an observer stream).
    pub async fn handle(&mut self, message: ProcessingRequest) -> Option<ProcessingResponse> {
        if message.observability_mode {
            self.observe(message.request?);
            return None;
        }
        if let Some(config) = &message.protocol_config {
            let mode = config.request_body_mode;
            self.request_body_mode = Some(BodySendMode::try_from(mode).map_err(|_| mode));
        }
        let metadata = message.metadata_context;
        let request = message.request?;
        if self.offered.is_some()
            && matches!(
                request,
                Request::RequestHeaders(_) | Request::RequestBody(_)
            )
        {
            // One stream carries one request, already routed and accounted: another would be
            // accounted again, and the first left in flight for good.
            let error = ApiError::bad_request(
                "this ext_proc stream's request was already routed: one stream carries one request",
                None,
            );
            return Some(self.refuse(&error.into()));
        }
        Some(match request {
            Request::RequestHeaders(h) => {
                self.subset = protocol::subset_hint(metadata.as_ref());
                self.request_headers(&h)
            }
            Request::RequestBody(b) => self.request_body(b).await,
            Request::ResponseHeaders(h) => self.response_headers(&h),
            Request::ResponseBody(b) => {
                self.response_body(&b);
                protocol::continue_response_body()
            }
            Request::RequestTrailers(_) => self.request_trailers(),
            Request::ResponseTrailers(_) => {
                self.finish();
                trailers(false)
            }
        })
    }

    fn request_headers(&mut self, h: &HttpHeaders) -> ProcessingResponse {
        self.path = protocol::pseudo(h, ":path").unwrap_or_default();
        self.headers = protocol::header_map(h);
        if !forwarded(&self.path) {
            let path = self.path.clone();
            return self.refuse(&ApiError::not_found(format!("Invalid URL ({path})")).into());
        }
        if h.end_of_stream {
            // No body (`GET /v1/models` and the like): any healthy endpoint will do.
            return self.route_anywhere(false);
        }
        self.body_due = Some(tokio::time::Instant::now() + self.body_timeout());
        protocol::continue_request_headers()
    }

    async fn request_body(&mut self, b: HttpBody) -> ProcessingResponse {
        let limit = self.router.config().limits.max_body_bytes;
        if self.body.len() + b.body.len() > limit {
            return self.refuse(
                &ApiError::new(413, format!("request body larger than {limit} bytes")).into(),
            );
        }
        if !self.hold.as_ref().is_some_and(|h| h.charge(b.body.len())) {
            return self.refuse(
                &ApiError::unavailable(
                    "the router holds as many request bytes as it may; retry shortly",
                )
                .into(),
            );
        }
        self.body.extend_from_slice(&b.body);
        self.body_messages += 1;
        if !b.end_of_stream && !self.body_sent_once() {
            return protocol::continue_request_body();
        }
        self.body_due = None;
        let api = match self.path.split('?').next().unwrap_or_default() {
            "/v1/completions" => Api::Completions,
            "/v1/chat/completions" => Api::Chat,
            _ => {
                self.body = Vec::new();
                self.hold = None;
                return self.route_anywhere(true);
            }
        };
        let body = bytes::Bytes::from(std::mem::take(&mut self.body));
        let answer = match proxy::route(&self.router, api, &self.headers, &body).await {
            Ok(routed) => self.route_planned(routed),
            Err(refused) => self.refuse(&refused),
        };
        // Routed or refused, the body is no longer held.
        drop(body);
        self.hold = None;
        answer
    }

    /// Routes a planned generation request: the first endpoint of core's ranking the subset
    /// allows, recorded as dispatched there. Under P/D, a client's `kv_transfer_params` are
    /// removed from the body first, as `serve` removes them.
    fn route_planned(&mut self, routed: Routed) -> ProcessingResponse {
        let Routed { prepared, mut plan } = routed;
        if let Err(refused) = self.remove_client_params(&prepared) {
            return self.refuse(&refused.into());
        }
        if self.subset.is_some()
            && !plan.decision.ranking.is_empty()
            && self.allowed(&plan.decision.ranking).is_empty()
        {
            // The plan ranks only the best few: the subset may allow one further down.
            plan = self.router.plan_every(&prepared.features());
        }
        let (mut leg, prefill) = crate::pd::header_mode(&self.router, &prepared, plan);
        self.prefiller = prefill.map(|id| self.router.endpoint(id).authority.to_string());
        leg.ranking = self.allowed(&leg.ranking);
        self.dispatch(&leg, &prepared, true)
    }

    /// Under P/D, replaces a body that names `kv_transfer_params` with one without them (the
    /// check `serve` makes, [`crate::pd::without_client_params`]); a body the picker cannot
    /// replace whole (it came in several messages: a `request_body_mode` other than
    /// `BUFFERED`) is refused rather than passed on with them.
    fn remove_client_params(&mut self, prepared: &Prepared) -> Result<(), ApiError> {
        if !self.router.config().pd.orchestrates() {
            return Ok(());
        }
        let ClientBody::Stripped(body) = crate::pd::without_client_params(prepared)? else {
            return Ok(());
        };
        if !self.body_replaceable() {
            return Err(ApiError::bad_request(
                "the request names kv_transfer_params, which only the router may set under pd.mode, and its body was not buffered whole before its headers went upstream, so the picker cannot remove them (configure request_body_mode: BUFFERED)",
                Some("kv_transfer_params"),
            ));
        }
        let body = serde_json::to_vec(&body)
            .map_err(|e| ApiError::new(500, format!("re-encoding the request body: {e}")))?;
        // Sent, and counted, by `dispatch` (which may still refuse the request).
        self.replaced_body = Some(body);
        Ok(())
    }

    /// Whether the picker's answer to the request body can replace it whole (with its
    /// `content-length`): in `BUFFERED` mode, or a `BUFFERED_PARTIAL` body that came whole. In
    /// `STREAMED` modes the headers went upstream before the body, whatever its size. A data
    /// plane that does not say its mode is trusted for a body that came in one message; one that
    /// names a mode this build does not know is not (it may stream).
    fn body_replaceable(&self) -> bool {
        match self.request_body_mode {
            Some(Ok(BodySendMode::Buffered)) => true,
            Some(Ok(BodySendMode::BufferedPartial)) | None => self.body_messages == 1,
            Some(Ok(_) | Err(_)) => false,
        }
    }

    /// Whether the data plane sends the request body in one message, the one whose answer
    /// releases the request headers: `BUFFERED` and `BUFFERED_PARTIAL` do. Such a message may
    /// not say `end_of_stream` (Envoy sends a buffered body that way when trailers follow, and a
    /// partial one cut at its buffer limit), yet no other comes before the routing answer.
    fn body_sent_once(&self) -> bool {
        matches!(
            self.request_body_mode,
            Some(Ok(BodySendMode::Buffered | BodySendMode::BufferedPartial))
        )
    }

    /// Answers request trailers. Trailers that end a body still awaited mean its headers can
    /// no longer be routed (a trailers answer cannot name an endpoint): refused clearly, now,
    /// rather than cut at the body's deadline.
    fn request_trailers(&mut self) -> ProcessingResponse {
        if self.body_due.is_none() {
            return trailers(true);
        }
        let error = ApiError::bad_request(
            "the request body ended with trailers before the picker could route it (configure request_body_mode: BUFFERED)",
            None,
        );
        self.refuse(&error.into())
    }

    /// Routes a request that needs no cache to any healthy endpoint the subset allows.
    fn route_anywhere(&mut self, on_body: bool) -> ProcessingResponse {
        let leg = Leg::unplanned(self.allowed(&healthy_rotation(&self.router)));
        let prepared = Prepared::uncached(&self.router);
        self.dispatch(&leg, &prepared, on_body)
    }

    /// The endpoints of `ranking` the data plane's subset hint allows, in order.
    fn allowed(&self, ranking: &[EndpointId]) -> Vec<EndpointId> {
        ranking
            .iter()
            .copied()
            .filter(|&id| {
                self.subset.as_ref().is_none_or(|subset| {
                    let endpoint = self.router.endpoint(id);
                    subset.iter().any(|s| s == endpoint.authority.as_str())
                })
            })
            .collect()
    }

    /// Names the first endpoint of `leg` (and its fallbacks) to the gateway: **connect** and
    /// **respond** of the pipeline, as `serve` runs them once connected.
    fn dispatch(&mut self, leg: &Leg, prepared: &Prepared, on_body: bool) -> ProcessingResponse {
        let ranking = &leg.ranking;
        let Some(&first) = ranking.first() else {
            let why = if self.subset.is_some() {
                "no endpoint of the gateway's subset can serve this request; retry shortly"
            } else {
                "no healthy endpoint serves this model; retry shortly"
            };
            return self.refuse(&ApiError::new(503, why).into());
        };
        let authority = |id| self.router.endpoint(id).authority.to_string();
        let destination = authority(first);
        // Fallbacks after the first endpoint (`fallbacks` names at most that many in all).
        let fallbacks: Vec<String> = ranking
            .iter()
            .skip(1)
            .take(self.fallbacks - 1)
            .map(|&id| authority(id))
            .collect();
        // The data plane connects on its own: the dispatch is recorded when the EPP names the
        // endpoint, the closest it can see to "a connection was made".
        let dispatch = pipeline::connect(&self.router, leg, prepared, first);
        let context = pipeline::admit(&self.router, &self.headers, self.started);
        let mut accounting = pipeline::respond(&self.router, &context, leg, 0, dispatch);
        if self.prefiller.is_some() {
            // A decode leg reports the blocks it pulled as cached: not what its own cache
            // predicted, so not a lesson on its index.
            accounting.skip_cached_check();
        }
        let followed: Followed = Arc::new(Mutex::new(Some(accounting)));
        let (token, header) = self.handoffs.offer(&followed);
        self.offered = Some(token);
        self.followed = Some(followed);
        self.endpoint_name = Some(self.router.endpoint(first).name.clone());
        let prefiller = self.prefiller.take();
        let mut extra: Vec<(&str, &str)> = prefiller
            .as_deref()
            .map(|p| (protocol::PREFILLER, p))
            .into_iter()
            .collect();
        extra.push((protocol::EXCHANGE, &header));
        let mut answer = protocol::route(&destination, &fallbacks, &extra, on_body);
        if let Some(body) = self.replaced_body.take() {
            // Counted only now that the body without them goes on.
            crate::pd::client_params_removed(&self.router, &pipeline::request_id(&self.headers));
            protocol::replace_request_body(&mut answer, body);
        }
        answer
    }

    fn refuse(&mut self, refused: &Refused) -> ProcessingResponse {
        self.body_due = None;
        self.body = Vec::new();
        self.replaced_body = None;
        self.hold = None;
        // The Endpoint Picker Protocol answers every shed request 429, whatever the cause: the
        // status counted, and the code in the body, are the one the client gets.
        let (sent, dropped) = match refused.shed {
            Some(why) => (
                ApiError {
                    status: 429,
                    ..refused.error.clone()
                },
                Some(drop_reason(why)),
            ),
            None => (refused.error.clone(), None),
        };
        crate::reply::count(&self.router, &sent);
        protocol::immediate(sent.status, sent.to_json(), dropped)
    }

    /// One message of an observer stream: its request headers name the routed request to
    /// follow, the rest is the response, followed as on the routing stream.
    fn observe(&mut self, request: Request) {
        match request {
            Request::RequestHeaders(h) => {
                self.observer = true;
                let headers = protocol::header_map(&h);
                let token = protocol::header(&headers, protocol::EXCHANGE);
                self.followed = token.and_then(|t| self.handoffs.claim(t));
                if self.followed.is_none() {
                    // Nothing to follow: a request the picker did not route (or whose routing
                    // stream already ended, and with it its accounting).
                    tracing::warn!(
                        token,
                        "an observer stream names no request the picker routed; not followed"
                    );
                    self.ended = true;
                }
            }
            Request::ResponseHeaders(h) => {
                self.response_status(&h);
            }
            Request::ResponseBody(b) => self.response_body(&b),
            Request::ResponseTrailers(_) => self.finish(),
            Request::RequestBody(_) | Request::RequestTrailers(_) => {}
        }
    }

    fn response_headers(&mut self, h: &HttpHeaders) -> ProcessingResponse {
        self.response_seen = true;
        self.response_status(h);
        let name = self.endpoint_name.as_deref();
        let added: Vec<(&str, &str)> = name
            .map(|n| (proxy::ENDPOINT_HEADER, n))
            .into_iter()
            .collect();
        protocol::response_headers(&added)
    }

    /// The response's status, for the accounting; a response without a body ends here.
    fn response_status(&mut self, h: &HttpHeaders) {
        let status = protocol::pseudo(h, ":status")
            .and_then(|s| s.parse::<u16>().ok())
            .unwrap_or(0);
        let stream = protocol::header_map(h)
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        if let Some(followed) = &self.followed
            && let Some(accounting) = followed.lock().as_mut()
        {
            accounting.status = status;
            if stream {
                accounting.first_byte_is_first_token();
            }
        }
        if h.end_of_stream {
            self.finish();
        }
    }

    fn response_body(&mut self, b: &HttpBody) {
        if let Some(followed) = &self.followed
            && let Some(accounting) = followed.lock().as_mut()
        {
            accounting.observe(&b.body);
        }
        if b.end_of_stream {
            self.finish();
        }
    }

    /// The gateway passed the response on to its end: the fleet hears of it now, with the
    /// engine's reported cached tokens, as `completed` (or `engine_error` for a 5xx). A request
    /// whose streams all close before this point leaves its accounting to be dropped as
    /// `client_closed`.
    fn finish(&mut self) {
        self.ended = true;
        let Some(followed) = self.followed.take() else {
            return;
        };
        let taken = followed.lock().take();
        if let Some(mut accounting) = taken {
            let status = accounting.status;
            let outcome = if status >= 500 {
                Outcome::EngineError
            } else {
                Outcome::Completed
            };
            accounting.fail(status, outcome);
        }
    }
}

/// Whether `path` is one `kvroute serve` serves or forwards (or `/health`), already canonical:
/// the picker cannot rewrite the path the data plane sends upstream, so a path with dot
/// segments or hidden separators (`/v1/../sim/restart`) is refused rather than normalised.
fn forwarded(path: &str) -> bool {
    let Ok(uri) = path.parse::<http::Uri>() else {
        return false;
    };
    let canonical = crate::edge::path::normalize(&uri).is_some_and(|n| n == uri);
    // `/health` reaches an engine's own (through a gateway it is the data path's liveness).
    let allowed = matches!(
        uri.path(),
        "/v1/completions" | "/v1/chat/completions" | "/v1/models" | "/health"
    ) || crate::server::FORWARDED_PATHS.contains(&uri.path());
    canonical && allowed
}

/// llm-d's `x-llm-d-request-dropped-reason` for a shed request.
fn drop_reason(why: kvroute_core::fleet::Shed) -> &'static str {
    match why {
        kvroute_core::fleet::Shed::Timeout => "rejected-ttl-expired",
        _ => "rejected-saturated",
    }
}

fn trailers(request: bool) -> ProcessingResponse {
    use envoy_types::pb::envoy::service::ext_proc::v3::TrailersResponse;
    let t = TrailersResponse::default();
    ProcessingResponse {
        response: Some(if request {
            processing_response::Response::RequestTrailers(t)
        } else {
            processing_response::Response::ResponseTrailers(t)
        }),
        ..ProcessingResponse::default()
    }
}
