//! The endpoint picker's ext_proc stream, driven by a tonic client playing the data plane, in
//! front of simulated engines: routing, fallbacks, subset hints, refusals, response-path
//! accounting and gRPC health.

// Measures real processes and sockets: wall-clock time, not the router's (tokio) clock.
#![allow(clippy::disallowed_methods)]

mod common;

use common::config_builder::{ConfigBuilder, endpoint};
use common::engine;
use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{
    HeaderMap, HeaderValue, HeaderValueOption, Metadata,
};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    HeaderMutation, HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse,
    ProtocolConfiguration,
};
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
use kvroute_core::index::EndpointId;
use kvroute_core::schedule::Role;
use kvroute_router::config::{PdMode, RouterConfig};
use kvroute_router::epp::{EppOptions, RunningEpp, start};
use kvroute_router::testing::{
    DESTINATION, EXCHANGE, LB_NAMESPACE, PREFILLER, SUBSET_KEY, SUBSET_NAMESPACE,
};
use kvroute_sim::server::SimFleet;
use kvroute_testkit::eventually;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

const MODEL: &str = "sim-llama-3.1-8b";

async fn picker(engines: &[&SimFleet]) -> RunningEpp {
    picker_with(engines, |_| {}).await
}

/// A picker in front of `engines` (unnamed, KV events), with the configuration `change`d.
async fn picker_with(engines: &[&SimFleet], change: impl FnOnce(&mut RouterConfig)) -> RunningEpp {
    let both: Vec<(&SimFleet, Role)> = engines.iter().map(|e| (*e, Role::Both)).collect();
    picker_with_roles(&both, change).await
}

/// In header mode the decode engine pulls what it lacks and reports the whole prompt cached:
/// its endpoint is expected to, and keeps its index trusted (it was charged the prefill and
/// distrusted after five such answers).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_mode_decode_answers_keep_their_endpoints_index_trusted() {
    let (prefill, decode) = (engine().await, engine().await);
    let roles = [(&prefill, Role::Prefill), (&decode, Role::Decode)];
    let epp = picker_with_roles(&roles, |c| {
        c.pd.mode = PdMode::Always;
        c.pd.link = "ib-400".into();
    })
    .await;
    let decode_id = EndpointId(1);
    for i in 0..8u32 {
        let mut stream = Stream::open(&epp).await;
        stream.send(completion_headers(), None).await;
        let tokens: Vec<u32> = (0..512).map(|t| 1_000 + i * 1_000 + t).collect();
        let request = serde_json::json!({"model": MODEL, "prompt": tokens, "max_tokens": 2});
        let set = match stream.send(body(&request.to_string()), None).await {
            Response::RequestBody(answer) => by_name(
                answer
                    .response
                    .unwrap()
                    .header_mutation
                    .unwrap()
                    .set_headers,
            ),
            other => panic!("not routed: {other:?}"),
        };
        assert!(set.contains_key(PREFILLER), "disaggregated: {set:?}");
        assert_eq!(id_of(&epp, &set[DESTINATION]), decode_id);
        // The decode engine's answer: every prompt token pulled, reported as cached.
        let status = Request::ResponseHeaders(headers(&[(":status", "200")], false));
        stream.send(status, None).await;
        let usage =
            r#"{"usage": {"prompt_tokens": 512, "prompt_tokens_details": {"cached_tokens": 512}}}"#;
        stream.send(response_body(usage, true), None).await;
    }
    let now = epp.router.now();
    let trust = epp.router.fleet().trust(decode_id, now);
    assert!(
        trust.is_ok(),
        "the decode endpoint is distrusted: {trust:?}"
    );
}

/// A picker in front of `engines` (unnamed, KV events), each with its role, with the
/// configuration `change`d.
async fn picker_with_roles(
    engines: &[(&SimFleet, Role)],
    change: impl FnOnce(&mut RouterConfig),
) -> RunningEpp {
    let mut builder = ConfigBuilder::new(MODEL).health(100, 500).with(change);
    for (fleet, role) in engines {
        let engine = &fleet.endpoints[0];
        let mut endpoint = endpoint(None, &engine.url);
        endpoint.events = Some(engine.events.clone());
        endpoint.role = *role;
        builder = builder.endpoint(endpoint);
    }
    let config = builder.build();
    let options = EppOptions {
        listen: "127.0.0.1:0".parse().unwrap(),
        ..EppOptions::default()
    };
    start(config, options).await.unwrap()
}

/// One ext_proc stream: send each message, collect each answer.
struct Stream {
    tx: mpsc::Sender<ProcessingRequest>,
    rx: tonic::Streaming<ProcessingResponse>,
}

impl Stream {
    async fn open(epp: &RunningEpp) -> Self {
        let mut client = ExternalProcessorClient::connect(format!("http://{}", epp.addr))
            .await
            .unwrap();
        let (tx, rx) = mpsc::channel(4);
        let rx = client
            .process(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        Self { tx, rx }
    }

    async fn send(&mut self, request: Request, metadata: Option<Metadata>) -> Response {
        self.send_full(request, metadata).await.response.unwrap()
    }

    async fn send_full(
        &mut self,
        request: Request,
        metadata: Option<Metadata>,
    ) -> ProcessingResponse {
        self.send_message(ProcessingRequest {
            request: Some(request),
            metadata_context: metadata,
            ..ProcessingRequest::default()
        })
        .await
    }

    /// Sends a whole message (protocol configuration and all) and returns its answer.
    async fn send_message(&mut self, message: ProcessingRequest) -> ProcessingResponse {
        self.tx.send(message).await.unwrap();
        self.rx.message().await.unwrap().unwrap()
    }

    /// Sends a message as an observer (`observability_mode`): no answer is due.
    async fn tell(&mut self, request: Request) {
        self.tx
            .send(ProcessingRequest {
                request: Some(request),
                observability_mode: true,
                ..ProcessingRequest::default()
            })
            .await
            .unwrap();
    }

    /// As an observer, claims the routed request whose routing answer carried `token`.
    async fn claim(&mut self, token: &str) {
        let claim = headers(&[(":path", "/v1/completions"), (EXCHANGE, token)], false);
        self.tell(Request::RequestHeaders(claim)).await;
    }

    /// As an observer, sees a 200 response whose body is one event, to its end.
    async fn see_response_end(&mut self) {
        self.tell(Request::ResponseHeaders(headers(
            &[(":status", "200")],
            false,
        )))
        .await;
        self.tell(response_body("data: {}\n\n", true)).await;
    }

    /// Waits (up to [`kvroute_testkit::patience`]) for the picker to end the stream, and checks
    /// that it answered nothing before; `what` says which end was due.
    async fn ends_unanswered(&mut self, what: &str) {
        let ended = tokio::time::timeout(kvroute_testkit::patience(), self.rx.message())
            .await
            .unwrap_or_else(|_| panic!("{what}: the stream did not end"));
        assert!(
            matches!(ended, Ok(None)),
            "{what}: nothing is answered: {ended:?}"
        );
    }
}

fn headers(pairs: &[(&str, &str)], end_of_stream: bool) -> HttpHeaders {
    HttpHeaders {
        headers: Some(HeaderMap {
            headers: pairs
                .iter()
                .map(|(k, v)| HeaderValue {
                    key: (*k).to_owned(),
                    raw_value: v.as_bytes().to_vec(),
                    ..HeaderValue::default()
                })
                .collect(),
        }),
        end_of_stream,
        ..HttpHeaders::default()
    }
}

fn body(text: &str) -> Request {
    Request::RequestBody(HttpBody {
        body: text.as_bytes().to_vec(),
        end_of_stream: true,
        ..HttpBody::default()
    })
}

fn subset(endpoints: &[&str]) -> Metadata {
    let list = endpoints.join(",");
    Metadata {
        filter_metadata: [(
            SUBSET_NAMESPACE.to_owned(),
            Struct {
                fields: [(
                    SUBSET_KEY.to_owned(),
                    Value {
                        kind: Some(Kind::StringValue(list)),
                    },
                )]
                .into(),
            },
        )]
        .into(),
        ..Metadata::default()
    }
}

/// Sends a completion request: the destination header and the `envoy.lb` fallback list, or
/// the immediate response's status.
async fn route(stream: &mut Stream, hint: Option<Metadata>) -> Result<(String, String), u32> {
    let h = headers(&[(":path", "/v1/completions"), (":method", "POST")], false);
    assert!(matches!(
        stream.send(Request::RequestHeaders(h), hint).await,
        Response::RequestHeaders(_)
    ));
    let prompt = "The quick brown fox jumps over the lazy dog. ".repeat(20);
    let request = format!(r#"{{"model": "{MODEL}", "prompt": "{prompt}", "max_tokens": 2}}"#);
    let full = stream.send_full(body(&request), None).await;
    let message = match full.response.unwrap() {
        Response::RequestBody(b) => b.response.unwrap(),
        Response::ImmediateResponse(i) => return Err(i.status.unwrap().code as u32),
        other => panic!("unexpected answer {other:?}"),
    };
    let set = message.header_mutation.unwrap().set_headers;
    let header = set
        .iter()
        .find_map(|h| h.header.as_ref().filter(|h| h.key == DESTINATION))
        .map(|h| String::from_utf8(h.raw_value.clone()).unwrap())
        .unwrap();
    let lb = &full.dynamic_metadata.unwrap().fields[LB_NAMESPACE];
    let Some(Kind::StructValue(lb)) = &lb.kind else {
        panic!("no envoy.lb struct");
    };
    let Some(Kind::StringValue(list)) = &lb.fields[DESTINATION].kind else {
        panic!("no fallback list");
    };
    Ok((header, list.clone()))
}

fn id_of(epp: &RunningEpp, authority: &str) -> EndpointId {
    let endpoints = epp.router.endpoints();
    endpoints
        .iter()
        .find(|e| e.authority.as_str() == authority)
        .unwrap()
        .id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_picker_routes_follows_the_response_and_honours_subsets() {
    let (a, b) = (engine().await, engine().await);
    let epp = picker(&[&a, &b]).await;
    let authority = |f: &SimFleet| f.endpoints[0].url.trim_start_matches("http://").to_owned();
    let (a_addr, b_addr) = (authority(&a), authority(&b));

    // Ready once the subscribers connected.
    let channel = Channel::from_shared(format!("http://{}", epp.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel);
    let mut ready = false;
    let deadline = std::time::Instant::now() + kvroute_testkit::patience();
    while std::time::Instant::now() < deadline {
        let status = health
            .check(HealthCheckRequest {
                service: "readiness".into(),
            })
            .await
            .unwrap()
            .into_inner()
            .status;
        if status == ServingStatus::Serving as i32 {
            ready = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(ready, "the picker never became ready");

    // Routed: the header names an engine, the response path hands the load back.
    let mut stream = Stream::open(&epp).await;
    let (chosen, fallbacks) = route(&mut stream, None).await.unwrap();
    assert!(chosen == a_addr || chosen == b_addr, "{chosen}");
    let other = if chosen == a_addr { &b_addr } else { &a_addr };
    assert_eq!(fallbacks, format!("{chosen},{other}"));
    let id = id_of(&epp, &chosen);
    assert_eq!(epp.router.load(id).inflight, 1);
    let answer = stream
        .send(
            Request::ResponseHeaders(headers(&[(":status", "200")], false)),
            None,
        )
        .await;
    let Response::ResponseHeaders(h) = answer else {
        panic!("{answer:?}");
    };
    let added = h.response.unwrap().header_mutation.unwrap().set_headers;
    assert_eq!(added[0].header.as_ref().unwrap().key, "x-kvroute-endpoint");
    let usage = r#"{"usage": {"prompt_tokens_details": {"cached_tokens": 0}}}"#;
    let answer = stream
        .send(
            Request::ResponseBody(HttpBody {
                body: usage.as_bytes().to_vec(),
                end_of_stream: true,
                ..HttpBody::default()
            }),
            None,
        )
        .await;
    assert!(matches!(answer, Response::ResponseBody(_)));
    assert_eq!(epp.router.load(id).inflight, 0);
    // The body went through to its end: completed, as in `serve`.
    let outcomes = |outcome: &str| {
        kvroute_testkit::sum_labelled(
            &epp.router.metrics().render(),
            "kvroute_requests_total",
            &format!("outcome=\"{outcome}\""),
        )
    };
    assert_eq!(outcomes("completed"), 1.0);
    assert_eq!(outcomes("client_closed"), 0.0);

    // A subset hint narrows the choice; an empty intersection is answered 503.
    for _ in 0..4 {
        let mut stream = Stream::open(&epp).await;
        let hint = subset(&[b_addr.as_str()]);
        let (chosen, fallbacks) = route(&mut stream, Some(hint)).await.unwrap();
        assert_eq!(
            (chosen.as_str(), fallbacks.as_str()),
            (b_addr.as_str(), b_addr.as_str())
        );
    }
    let mut stream = Stream::open(&epp).await;
    assert_eq!(
        route(&mut stream, Some(subset(&["10.9.9.9:8000"]))).await,
        Err(503)
    );
    // The stream going away mid-response hands its load back too.
    let mut stream = Stream::open(&epp).await;
    let (chosen, _) = route(&mut stream, None).await.unwrap();
    drop(stream);
    let id = id_of(&epp, &chosen);
    let router = epp.router.clone();
    eventually("load handed back", || {
        let inflight = router.load(id).inflight;
        (inflight == 0, inflight)
    })
    .await;
    // Every stream closed before its response ended (the four subset routes and this one)
    // counts as closed by the client.
    eventually("five streams closed early", || {
        let closed = outcomes("client_closed");
        (closed == 5.0, closed)
    })
    .await;
    assert_eq!(outcomes("completed"), 1.0);
}

/// A request-body chunk that is not the last.
fn partial_body(bytes: usize) -> Request {
    Request::RequestBody(HttpBody {
        body: vec![b' '; bytes],
        end_of_stream: false,
        ..HttpBody::default()
    })
}

fn completion_headers() -> Request {
    Request::RequestHeaders(headers(
        &[(":path", "/v1/completions"), (":method", "POST")],
        false,
    ))
}

/// The status of an immediate response, or a panic naming what came instead.
fn immediate_status(answer: &Response) -> i32 {
    match answer {
        Response::ImmediateResponse(i) => i.status.unwrap().code,
        other => panic!("not an immediate response: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pickers_buffered_bodies_are_bounded_in_bytes_time_and_streams() {
    let a = engine().await;
    let epp = picker_with(&[&a], |c| {
        c.limits.max_body_bytes = 2000;
        c.limits.max_buffered_bytes = 3000;
        c.limits.body_timeout_ms = 1000;
        c.limits.max_picker_streams = 3;
    })
    .await;
    let buffered =
        || kvroute_testkit::sample(&epp.router.metrics().render(), "kvroute_buffered_bytes");
    // A body that stops halfway holds what it sent.
    let mut holder = Stream::open(&epp).await;
    holder.send(completion_headers(), None).await;
    assert!(matches!(
        holder.send(partial_body(1900), None).await,
        Response::RequestBody(_)
    ));
    assert_eq!(buffered(), Some(1900.0));
    // Another one over the budget is answered 503 at once.
    let mut second = Stream::open(&epp).await;
    second.send(completion_headers(), None).await;
    assert_eq!(
        immediate_status(&second.send(partial_body(1500), None).await),
        503
    );
    // Three streams are open (the third idle); a fourth is refused.
    let mut third = Stream::open(&epp).await;
    third.send(completion_headers(), None).await;
    let mut fourth = Stream::open(&epp).await;
    assert_eq!(
        immediate_status(&fourth.send(completion_headers(), None).await),
        503
    );
    // The stalled body is cut at its deadline, and its bytes come back.
    let cut = tokio::time::timeout(kvroute_testkit::patience(), holder.rx.message())
        .await
        .expect("the stalled body is answered by its deadline")
        .unwrap()
        .unwrap();
    assert_eq!(immediate_status(&cut.response.unwrap()), 408);
    eventually("the budget is free", || {
        let held = buffered();
        (held == Some(0.0), held)
    })
    .await;
    drop((second, third, fourth));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_sends_nothing_gives_its_place_back_by_the_body_timeout() {
    let a = engine().await;
    let epp = picker_with(&[&a], |c| {
        c.limits.body_timeout_ms = 300;
        c.limits.max_picker_streams = 1;
    })
    .await;
    let streams =
        || kvroute_testkit::sample(&epp.router.metrics().render(), "kvroute_picker_streams");
    // Opened, and nothing sent: it holds the only place.
    let _silent = Stream::open(&epp).await;
    eventually("the silent stream is served", || {
        let open = streams();
        (open == Some(1.0), open)
    })
    .await;
    let mut refused = Stream::open(&epp).await;
    assert_eq!(
        immediate_status(&refused.send(completion_headers(), None).await),
        503
    );
    // By the body timeout it ends, and the next request is routed.
    eventually("the silent stream ended", || {
        let open = streams();
        (open == Some(0.0), open)
    })
    .await;
    let mut next = Stream::open(&epp).await;
    assert!(route(&mut next, None).await.is_ok());
}

/// A request held by flow control leaves the queue when its ext_proc stream ends (its client
/// went away): it is never dispatched later in a place a live request needed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_request_whose_stream_ends_leaves_the_queue() {
    let a = engine().await;
    let epp = picker_with(&[&a], |c| c.outlier.max_inflight = 1).await;
    // The endpoint's one slot is taken by a routed request whose response has not ended.
    let mut first = Stream::open(&epp).await;
    routed_headers(&mut first).await;
    // The next is held, its body sent and no answer yet.
    let mut held = Stream::open(&epp).await;
    held.send(completion_headers(), None).await;
    let request = format!(r#"{{"model": "{MODEL}", "prompt": "held", "max_tokens": 2}}"#);
    held.tx
        .send(ProcessingRequest {
            request: Some(body(&request)),
            ..ProcessingRequest::default()
        })
        .await
        .unwrap();
    let queued = || common::fleet_view::held_requests(&epp.router);
    eventually("the second request held", || (queued() == 1, queued())).await;
    // Its client goes away: the data plane ends the stream.
    drop(held);
    eventually("the held request left the queue", || {
        (queued() == 0, queued())
    })
    .await;
    assert_eq!(
        epp.router.load(EndpointId(0)).inflight,
        1,
        "only the first is in flight"
    );
}

/// The Endpoint Picker Protocol answers a shed request 429, whatever the cause (here its wait
/// ran out, which `serve` answers 503): the body's code and the rejection counted say the status
/// the client gets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shed_request_is_answered_and_counted_as_429() {
    let a = engine().await;
    let epp = picker_with(&[&a], |c| {
        c.outlier.max_inflight = 1;
        c.flow.max_wait_s = 0.2;
    })
    .await;
    // The endpoint's one slot is taken by a request whose response has not ended.
    let mut first = Stream::open(&epp).await;
    routed_headers(&mut first).await;
    let request = format!(r#"{{"model": "{MODEL}", "prompt": "wait", "max_tokens": 2}}"#);
    let mut shed = Stream::open(&epp).await;
    shed.send(completion_headers(), None).await;
    let Response::ImmediateResponse(answer) = shed.send(body(&request), None).await else {
        panic!("the second is not shed");
    };
    assert_eq!(answer.status.unwrap().code, 429);
    let sent: serde_json::Value = serde_json::from_slice(&answer.body).unwrap();
    assert_eq!(sent["error"]["code"], 429, "{sent}");
    let text = epp.router.metrics().render();
    assert_eq!(
        kvroute_testkit::sample(&text, "kvroute_rejected_total{status=\"429\"}"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        kvroute_testkit::sample(&text, "kvroute_rejected_total{status=\"503\"}"),
        None,
        "{text}"
    );
    drop(first);
}

/// One ext_proc stream carries one request: a second set of request headers on a stream whose
/// request was routed is refused, and the first request stays the only one in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_routes_one_request_only() {
    let a = engine().await;
    let epp = picker(&[&a]).await;
    let id = EndpointId(0);
    let mut stream = Stream::open(&epp).await;
    let models = || {
        Request::RequestHeaders(headers(
            &[(":path", "/v1/models"), (":method", "GET")],
            true,
        ))
    };
    let first = stream.send(models(), None).await;
    assert!(
        matches!(first, Response::RequestHeaders(_)),
        "the first is routed: {first:?}"
    );
    assert_eq!(epp.router.load(id).inflight, 1);
    for _ in 0..3 {
        let again = stream.send(models(), None).await;
        assert_eq!(immediate_status(&again), 400);
    }
    assert_eq!(
        epp.router.load(id).inflight,
        1,
        "the refused ones were never accounted"
    );
}

/// A request with trailers: Envoy sends its buffered body without `end_of_stream`, the trailers
/// after the picker's answer. In the buffered modes that body is routed as it comes; with no
/// mode said, trailers that end a body still awaited are refused at once, not at its deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_buffered_body_followed_by_trailers_is_routed() {
    let a = engine().await;
    let epp = picker_with(&[&a], |c| c.limits.body_timeout_ms = 60_000).await;
    let prompt = "Trailers follow this body. ".repeat(10);
    let request = format!(r#"{{"model": "{MODEL}", "prompt": "{prompt}", "max_tokens": 2}}"#);
    let before_trailers = || {
        Request::RequestBody(HttpBody {
            body: request.as_bytes().to_vec(),
            end_of_stream: false,
            ..HttpBody::default()
        })
    };
    let trailers = || Request::RequestTrailers(Default::default());
    for mode in [BodySendMode::Buffered, BodySendMode::BufferedPartial] {
        let mut stream = Stream::open(&epp).await;
        stream
            .send_message(ProcessingRequest {
                request: Some(completion_headers()),
                protocol_config: Some(ProtocolConfiguration {
                    request_body_mode: mode as i32,
                    ..ProtocolConfiguration::default()
                }),
                ..ProcessingRequest::default()
            })
            .await;
        let Response::RequestBody(answer) = stream.send(before_trailers(), None).await else {
            panic!("{mode:?}: the body was not routed");
        };
        let routed = by_name(
            answer
                .response
                .unwrap()
                .header_mutation
                .unwrap()
                .set_headers,
        );
        assert_eq!(
            routed.get(DESTINATION).map(String::as_str),
            Some(a.endpoints[0].url.trim_start_matches("http://")),
            "{mode:?}"
        );
        assert!(
            matches!(
                stream.send(trailers(), None).await,
                Response::RequestTrailers(_)
            ),
            "{mode:?}: the trailers pass"
        );
    }
    let mut stream = Stream::open(&epp).await;
    stream.send(completion_headers(), None).await;
    assert!(matches!(
        stream.send(before_trailers(), None).await,
        Response::RequestBody(_)
    ));
    let refused = tokio::time::timeout(
        std::time::Duration::from_secs(30),
        stream.send(trailers(), None),
    )
    .await
    .expect("trailers ending an awaited body are answered at once");
    assert_eq!(immediate_status(&refused), 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_picker_answers_oversized_undecodable_and_unlisted_requests() {
    let a = engine().await;
    let epp = picker_with(&[&a], |c| c.limits.max_body_bytes = 2000).await;
    // A path `serve` would not forward, or one not canonical, gets 404.
    for path in [
        "/v1/../sim/restart",
        "/sim/restart",
        "/v1/load_lora_adapter",
    ] {
        let mut stream = Stream::open(&epp).await;
        let h = headers(&[(":path", path), (":method", "POST")], false);
        let answer = stream.send(Request::RequestHeaders(h), None).await;
        assert_eq!(immediate_status(&answer), 404, "{path}");
    }
    // A message over the gRPC limit (the body limit and 64 KiB) gets 413.
    let mut stream = Stream::open(&epp).await;
    stream.send(completion_headers(), None).await;
    let answer = stream.send(partial_body(200_000), None).await;
    assert_eq!(immediate_status(&answer), 413);
    // Bytes that are no ext_proc message get 400: one gRPC frame of a truncated varint.
    let h2 = reqwest::Client::builder()
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let frame = [0u8, 0, 0, 0, 4, 0xff, 0xff, 0xff, 0xff];
    let resp = h2
        .post(format!(
            "http://{}/envoy.service.ext_proc.v3.ExternalProcessor/Process",
            epp.addr
        ))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(frame.to_vec())
        .send()
        .await
        .unwrap();
    let body = resp.bytes().await.unwrap();
    let text = String::from_utf8_lossy(&body);
    assert!(
        text.contains("BadRequestError") && text.contains("kvroute_epp"),
        "no 400 immediate response: {text:?}"
    );
}

/// The headers the picker's answer to a completion request sets, by name.
async fn routed_headers(stream: &mut Stream) -> std::collections::HashMap<String, String> {
    stream.send(completion_headers(), None).await;
    let prompt = "A picker follows every response it routes. ".repeat(20);
    by_name(route_body(stream, &prompt).await.set_headers)
}

/// Sends the body of a completion request for two tokens of `prompt` on `stream` (its headers
/// sent), and returns how the picker's answer changes the request's headers; panics when the
/// request is not routed.
async fn route_body(stream: &mut Stream, prompt: &str) -> HeaderMutation {
    let request = format!(r#"{{"model": "{MODEL}", "prompt": "{prompt}", "max_tokens": 2}}"#);
    match stream.send(body(&request), None).await {
        Response::RequestBody(answer) => answer.response.unwrap().header_mutation.unwrap(),
        other => panic!("not routed: {other:?}"),
    }
}

/// Headers set, by name.
fn by_name(set: Vec<HeaderValueOption>) -> std::collections::HashMap<String, String> {
    set.into_iter()
        .map(|h| h.header.unwrap())
        .map(|h| (h.key, String::from_utf8(h.raw_value).unwrap()))
        .collect()
}

fn response_body(text: &str, end_of_stream: bool) -> Request {
    Request::ResponseBody(HttpBody {
        body: text.as_bytes().to_vec(),
        end_of_stream,
        ..HttpBody::default()
    })
}

/// Follows one routed request as the default gateway configuration does, in Envoy's order:
/// the observer's request headers (naming the routing answer's token) leave Envoy with the
/// request, before the response reaches the routing stream; `close_routing_early` closes the
/// routing stream after its response headers, before the observer saw the end. The picker
/// answers nothing on the observer stream and ends it at the response's end; the endpoint it
/// routed to is returned.
async fn follow_one(epp: &RunningEpp, close_routing_early: bool) -> EndpointId {
    let mut routing = Stream::open(epp).await;
    let set = routed_headers(&mut routing).await;
    let id = id_of(epp, &set[DESTINATION]);
    let mut observer = Stream::open(epp).await;
    observer.claim(&set[EXCHANGE]).await;
    let status = || Request::ResponseHeaders(headers(&[(":status", "200")], false));
    let answer = routing.send(status(), None).await;
    assert!(matches!(answer, Response::ResponseHeaders(_)), "{answer:?}");
    let routing = if close_routing_early {
        drop(routing);
        None
    } else {
        Some(routing)
    };
    observer.tell(status()).await;
    observer.tell(response_body("data: {}\n\n", false)).await;
    assert_eq!(epp.router.load(id).inflight, 1, "in flight until the end");
    let usage = r#"data: {"usage": {"prompt_tokens_details": {"cached_tokens": 0}}}"#;
    observer.tell(response_body(usage, true)).await;
    observer
        .ends_unanswered("the picker ends the observer stream")
        .await;
    drop(routing);
    id
}

/// Observer streams have their own bound (`limits.max_observer_streams`): with every routing
/// place taken, an observer still follows its request; one past the observers' bound is ended
/// unanswered and counted apart, never answered or counted as a refused (503) request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observer_streams_have_their_own_bound_and_a_refused_one_is_no_rejection() {
    let a = engine().await;
    let epp = picker_with(&[&a], |c| {
        c.limits.max_picker_streams = 1;
        c.limits.max_observer_streams = 1;
    })
    .await;
    let metrics = || epp.router.metrics().render();
    // The only routing place is taken by a routed request.
    let mut routing = Stream::open(&epp).await;
    let token = routed_headers(&mut routing).await[EXCHANGE].clone();
    let id = {
        let endpoints = epp.router.endpoints();
        endpoints[0].id
    };

    // Its observer is served all the same.
    let mut observer = Stream::open(&epp).await;
    observer.claim(&token).await;
    eventually("the observer is served", || {
        let open = kvroute_testkit::sample(&metrics(), "kvroute_picker_observer_streams");
        (open == Some(1.0), open)
    })
    .await;

    // A second observer is past the bound: ended, unanswered, not a rejection.
    let mut extra = Stream::open(&epp).await;
    let stray = headers(&[(EXCHANGE, "00000000000000ff")], false);
    extra.tell(Request::RequestHeaders(stray)).await;
    extra
        .ends_unanswered("the picker ends an observer past its bound")
        .await;
    let text = metrics();
    assert_eq!(
        kvroute_testkit::sample(&text, "kvroute_observer_streams_refused_total"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        kvroute_testkit::sum_labelled(&text, "kvroute_rejected_total", "status="),
        0.0,
        "{text}"
    );

    // The served observer follows its request to the end.
    observer.see_response_end().await;
    observer
        .ends_unanswered("the observer follows its request to the end")
        .await;
    assert_eq!(epp.router.load(id).inflight, 0);
    drop(routing);
}

/// A client may send its own `x-kvroute-exchange` header, even another request's token. The
/// picker's answer overwrites it (Envoy's `OVERWRITE_IF_EXISTS_OR_ADD`: the observer and the
/// upstream see only the picker's token), with a fresh token, and routing the forged request
/// claims nothing: the request whose token it named is still followed to its end by its own
/// observer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_supplied_exchange_header_is_overwritten_and_claims_nothing() {
    let a = engine().await;
    let epp = picker(&[&a]).await;
    let mut first = Stream::open(&epp).await;
    let token = routed_headers(&mut first).await[EXCHANGE].clone();

    let mut forged = Stream::open(&epp).await;
    let request = headers(
        &[
            (":path", "/v1/completions"),
            (":method", "POST"),
            (EXCHANGE, token.as_str()),
        ],
        false,
    );
    forged.send(Request::RequestHeaders(request), None).await;
    let prompt = "A forged exchange token claims nothing. ".repeat(20);
    let set = route_body(&mut forged, &prompt).await.set_headers;
    let exchange = set
        .iter()
        .find(|h| h.header.as_ref().is_some_and(|h| h.key == EXCHANGE))
        .expect("the picker sets its own exchange header");
    assert_eq!(
        exchange.append_action,
        HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        "the client's header is replaced, not appended to"
    );
    let value = String::from_utf8(exchange.header.as_ref().unwrap().raw_value.clone()).unwrap();
    assert_ne!(value, token, "a fresh token, not the client's");

    // The first request's token still claims it: its observer follows it to the end.
    let mut observer = Stream::open(&epp).await;
    observer.claim(&token).await;
    observer.see_response_end().await;
    observer
        .ends_unanswered("the observer follows the first request to its end")
        .await;
    let completed = kvroute_testkit::sum_labelled(
        &epp.router.metrics().render(),
        "kvroute_requests_total",
        "outcome=\"completed\"",
    );
    assert_eq!(
        completed, 1.0,
        "the first request was claimed and completed"
    );
    drop((first, forged));
}

/// The default gateway configuration (`examples/envoy-epp.yaml`): the routing stream sees the
/// response headers only, and a second stream in `observability_mode`, which names the routing
/// answer's `x-kvroute-exchange` token, sees the response body without Envoy waiting for the
/// picker. The request's load stays on its endpoint until the body ends (also when the routing
/// stream closed before), then is handed back as completed, with the engine's cached tokens
/// compared with the prediction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_observer_stream_follows_the_response_without_answering() {
    let a = engine().await;
    let epp = picker(&[&a]).await;
    let metric = |name: &str, label: &str| {
        kvroute_testkit::sum_labelled(&epp.router.metrics().render(), name, label)
    };
    let completed = || metric("kvroute_requests_total", "outcome=\"completed\"");
    // Every outcome of the comparison (the second request, the first's prompt again, is
    // predicted cached where the fake response reports none).
    let compared = || metric("kvroute_prediction_outcomes_total", "outcome=");
    let id = follow_one(&epp, false).await;
    assert_eq!(epp.router.load(id).inflight, 0);
    assert_eq!((completed(), compared()), (1.0, 1.0));
    // The routing stream may close first: the observer still has the request.
    let id = follow_one(&epp, true).await;
    assert_eq!(epp.router.load(id).inflight, 0);
    assert_eq!(
        (completed(), compared()),
        (2.0, 2.0),
        "the engine's cached tokens were compared"
    );

    // An observer naming no routed request is ended at once, and changes nothing.
    let mut stray = Stream::open(&epp).await;
    let request = headers(&[(EXCHANGE, "00000000000000ff")], false);
    stray.tell(Request::RequestHeaders(request)).await;
    stray
        .ends_unanswered("the picker ends a stray observer stream")
        .await;

    // A routed request no observer claims is handed back as unfinished once its routing
    // stream is gone.
    let mut routing = Stream::open(&epp).await;
    let set = routed_headers(&mut routing).await;
    let id = id_of(&epp, &set[DESTINATION]);
    drop(routing);
    let router = epp.router.clone();
    eventually("an unclaimed request handed back", || {
        let inflight = router.load(id).inflight;
        (inflight == 0, inflight)
    })
    .await;
    let closed = metric("kvroute_requests_total", "outcome=\"client_closed\"");
    assert_eq!((closed, completed()), (1.0, 2.0));
}

/// The picker's answer to a completion request whose client named `prefiller` in
/// `x-prefiller-host-port`: the headers it sets, by name, and those it removes.
async fn answer_naming(
    epp: &RunningEpp,
    prefiller: &str,
) -> (std::collections::HashMap<String, String>, Vec<String>) {
    let mut stream = Stream::open(epp).await;
    let h = headers(
        &[
            (":path", "/v1/completions"),
            (":method", "POST"),
            (PREFILLER, prefiller),
        ],
        false,
    );
    // Removed from the headers already: a gateway that fails open past the picker (its body
    // answer never came) must not pass the client's value to the sidecar.
    let Response::RequestHeaders(answer) = stream.send(Request::RequestHeaders(h), None).await
    else {
        panic!("the headers are answered");
    };
    let removed = answer
        .response
        .unwrap()
        .header_mutation
        .unwrap()
        .remove_headers;
    assert!(removed.iter().any(|h| h == PREFILLER), "{removed:?}");
    let prompt = "A long document the sidecar would prefill elsewhere. ".repeat(40);
    let mutation = route_body(&mut stream, &prompt).await;
    (by_name(mutation.set_headers), mutation.remove_headers)
}

/// Header mode for llm-d's P/D sidecar: with `pd` on, the picker names core's prefill endpoint
/// in `x-prefiller-host-port` (an endpoint of the fleet, never what the client sent) and the
/// decode endpoint as the destination; with it off, a client's value is removed. Nothing ever
/// connects to the address the client named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_mode_names_only_the_fleets_prefill_endpoints() {
    let (prefill, decode) = (engine().await, engine().await);
    let authority = |f: &SimFleet| f.endpoints[0].url.trim_start_matches("http://").to_owned();
    let trap = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    trap.set_nonblocking(true).unwrap();
    let named = trap.local_addr().unwrap().to_string();
    let roles = [(&prefill, Role::Prefill), (&decode, Role::Decode)];

    let on = picker_with_roles(&roles, |c| {
        c.pd.mode = PdMode::Always;
        c.pd.link = "ib-400".into();
    })
    .await;
    let (set, removed) = answer_naming(&on, &named).await;
    assert_eq!(set[PREFILLER], authority(&prefill), "{set:?}");
    assert_eq!(set[DESTINATION], authority(&decode), "{set:?}");
    assert!(!removed.iter().any(|h| h == PREFILLER), "{removed:?}");
    let metrics = on.router.metrics().render();
    assert!(
        metrics
            .contains("kvroute_pd_decisions_total{decision=\"disaggregated\",reason=\"always\"} 1"),
        "{metrics}"
    );

    let off = picker_with_roles(&roles, |_| {}).await;
    let (set, removed) = answer_naming(&off, &named).await;
    assert!(!set.contains_key(PREFILLER), "{set:?}");
    assert!(removed.iter().any(|h| h == PREFILLER), "{removed:?}");

    assert!(
        matches!(trap.accept(), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock),
        "something connected to the address a client named"
    );
}

/// Under `pd.mode`, a client's `kv_transfer_params` are removed from the body the gateway sends
/// upstream (a body mutation, with the new body's `content-length`), as `serve` removes them;
/// a body that came in several messages (not `BUFFERED`) cannot be replaced whole and is
/// refused 400 rather than passed on with them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_pd_the_picker_removes_a_clients_kv_transfer_params_or_refuses_the_body() {
    use envoy_types::pb::envoy::service::ext_proc::v3::body_mutation::Mutation;

    let (prefill, decode) = (engine().await, engine().await);
    let roles = [(&prefill, Role::Prefill), (&decode, Role::Decode)];
    let epp = picker_with_roles(&roles, |c| c.pd.mode = PdMode::Orchestrate).await;
    let request = format!(
        r#"{{"model": "{MODEL}", "prompt": "hello there", "max_tokens": 2, "kv_transfer_params": {{"do_remote_prefill": true, "remote_host": "127.0.0.1", "remote_port": 9}}}}"#
    );

    let mut stream = Stream::open(&epp).await;
    stream.send(completion_headers(), None).await;
    let Response::RequestBody(answer) = stream.send(body(&request), None).await else {
        panic!("not routed");
    };
    let common = answer.response.unwrap();
    let Some(Mutation::Body(sent)) = common.body_mutation.and_then(|m| m.mutation) else {
        panic!("the body was not replaced");
    };
    let length = common
        .header_mutation
        .unwrap()
        .set_headers
        .into_iter()
        .filter_map(|h| h.header)
        .find(|h| h.key == "content-length")
        .map(|h| String::from_utf8(h.raw_value).unwrap());
    assert_eq!(length, Some(sent.len().to_string()));
    let sent: serde_json::Value = serde_json::from_slice(&sent).unwrap();
    assert!(sent.get("kv_transfer_params").is_none(), "{sent}");
    assert_eq!(
        (sent["prompt"].as_str(), sent["max_tokens"].as_u64()),
        (Some("hello there"), Some(2))
    );

    let mut stream = Stream::open(&epp).await;
    stream.send(completion_headers(), None).await;
    let (head, tail) = request.split_at(20);
    let chunk = |text: &str, end_of_stream| {
        Request::RequestBody(HttpBody {
            body: text.as_bytes().to_vec(),
            end_of_stream,
            ..HttpBody::default()
        })
    };
    stream.send(chunk(head, false), None).await;
    assert_eq!(
        immediate_status(&stream.send(chunk(tail, true), None).await),
        400
    );
    // A data plane that says it streams request bodies sent the headers upstream first: even a
    // body in one message cannot be replaced, so it is refused. So is one that names a mode this
    // build does not know (a newer Envoy's): it may have sent the headers on too.
    for mode in [BodySendMode::Streamed as i32, 99] {
        let mut stream = Stream::open(&epp).await;
        stream
            .send_message(ProcessingRequest {
                request: Some(completion_headers()),
                protocol_config: Some(ProtocolConfiguration {
                    request_body_mode: mode,
                    ..ProtocolConfiguration::default()
                }),
                ..ProcessingRequest::default()
            })
            .await;
        assert_eq!(
            immediate_status(&stream.send(body(&request), None).await),
            400,
            "request body mode {mode}"
        );
    }
    // A request the picker strips and then cannot place (its subset allows no endpoint) is
    // refused, not counted as sent on without them.
    let mut stream = Stream::open(&epp).await;
    stream
        .send(completion_headers(), Some(subset(&["10.9.9.9:8000"])))
        .await;
    assert_eq!(
        immediate_status(&stream.send(body(&request), None).await),
        503
    );
    // Only the stripped request counts as stripped; the refused ones are not removals.
    let metrics = epp.router.metrics().render();
    assert_eq!(
        kvroute_testkit::sample(&metrics, "kvroute_pd_client_params_removed_total"),
        Some(1.0),
        "{metrics}"
    );
}
