//! `kvroute epp`: the router as a Gateway API Inference Extension endpoint picker. A gateway
//! (Envoy, Istio, kgateway, ...) calls it over Envoy's ext_proc gRPC stream for every request;
//! it answers with the endpoint core picked (`x-gateway-destination-endpoint` and the `envoy.lb`
//! fallback list), and follows the response so that load and cache accounting work exactly as
//! in `kvroute serve`. The background tasks (KV events, health checks, scraping) and the admin
//! listener are `serve`'s own.
//!
//! The data plane must send the request headers and the **buffered** request body, and the
//! response headers; the picker answers the response headers with the endpoint's name. It
//! follows the response body either on the same stream (`response_body_mode: STREAMED`, each
//! chunk waited for) or, the default (`examples/envoy-epp.yaml`), on a second ext_proc filter's
//! stream in `observability_mode`, which Envoy does not wait for (`handoff`).

mod exchange;
mod handoff;
pub(crate) mod protocol;

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{ProcessingRequest, ProcessingResponse};
use futures::{Stream, StreamExt};
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status, Streaming};
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;
use tracing::{debug, info, warn};

use crate::RouterError;
use crate::budget::ByteBudget;
use crate::config::RouterConfig;
use crate::server::{ServerTasks, bind, request_budget};
use crate::service::Router;
use exchange::Exchange;
use handoff::Handoffs;

/// The gRPC service name of ext_proc, as health checks name it.
pub const EXT_PROC_SERVICE: &str = "envoy.service.ext_proc.v3.ExternalProcessor";

/// How `kvroute epp` runs, beside the router's configuration.
#[derive(Clone, Debug)]
pub struct EppOptions {
    /// The gRPC (ext_proc and health) listen address.
    pub listen: SocketAddr,
    /// Endpoints named in the `envoy.lb` fallback list, first choice included.
    pub fallbacks: usize,
    /// Ready after this long even if some KV-event subscriber never connected (a dead engine
    /// must not keep the whole picker unready).
    pub ready_after: Duration,
}

impl Default for EppOptions {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([0, 0, 0, 0], 9002)),
            fallbacks: 3,
            ready_after: Duration::from_secs(10),
        }
    }
}

/// The ext_proc service: one `Exchange` per stream, at most `limits.max_picker_streams`
/// routing streams and `limits.max_observer_streams` observer streams at once, their buffered
/// request bodies charged to the router's buffered-bytes budget.
pub struct Picker {
    router: Arc<Router>,
    fallbacks: usize,
    budget: ByteBudget,
    streams: Arc<Semaphore>,
    observers: Arc<Semaphore>,
    handoffs: Arc<Handoffs>,
}

type ResponseStream = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for Picker {
    type ProcessStream = ResponseStream;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(4);
        let exchange = Exchange::new(
            self.router.clone(),
            self.fallbacks,
            self.budget.hold(),
            self.handoffs.clone(),
        );
        // A stream holds a routing stream's place from its opening (one that sends nothing
        // holds it until the body timeout); its first message may show it is an observer,
        // which then moves to an observer's place.
        let permit = self.streams.clone().try_acquire_owned().ok();
        let observers = self.observers.clone();
        // The exchange lives in this task: when the data plane ends the stream (or goes away),
        // it is dropped and its accounting handed back to the fleet.
        let router = self.router.clone();
        tokio::spawn(serve_stream(
            router, exchange, inbound, tx, permit, observers,
        ));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

type Answers = mpsc::Sender<Result<ProcessingResponse, Status>>;

/// What a stream received next: a message, a transport error, or its end (`None`).
type Next = Option<Result<ProcessingRequest, Status>>;

/// A place among the streams served at once, shown in a gauge while held.
struct Place {
    _permit: OwnedSemaphorePermit,
    gauge: Gauge,
}

impl Place {
    fn new(permit: OwnedSemaphorePermit, gauge: &Gauge) -> Self {
        gauge.inc();
        Self {
            _permit: permit,
            gauge: gauge.clone(),
        }
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        self.gauge.dec();
    }
}

/// Serves one ext_proc stream. Its first message is due within the body timeout (a stream
/// that opens and sends nothing holds a place and budget). A routing stream beyond
/// `limits.max_picker_streams` is answered 503; an observer stream (its first message in
/// `observability_mode`) beyond `limits.max_observer_streams` is ended unanswered (nothing is
/// answered on an observer stream) and counted apart, not as a refused request: its request
/// is handed back when its routing stream ends, as with a gateway without observers.
async fn serve_stream(
    router: Arc<Router>,
    exchange: Exchange,
    mut inbound: Streaming<ProcessingRequest>,
    tx: Answers,
    permit: Option<OwnedSemaphorePermit>,
    observers: Arc<Semaphore>,
) {
    let metrics = router.metrics();
    let routing = permit.map(|p| Place::new(p, &metrics.picker_streams));
    let first = match tokio::time::timeout(exchange.body_timeout(), inbound.next()).await {
        Ok(Some(first)) => first,
        // The stream ended before its first message.
        Ok(None) => return,
        Err(_) => {
            debug!("an ext_proc stream sent nothing within the body timeout; ended");
            return;
        }
    };
    if first.as_ref().is_ok_and(|m| m.observability_mode) {
        drop(routing);
        let Ok(permit) = observers.try_acquire_owned() else {
            metrics.observer_streams_refused.inc();
            debug!("an observer stream past limits.max_observer_streams; ended unanswered");
            return;
        };
        let _place = Place::new(permit, &metrics.picker_observer_streams);
        return run_exchange(exchange, Some(first), inbound, tx).await;
    }
    match routing {
        Some(_place) => run_exchange(exchange, Some(first), inbound, tx).await,
        None => refuse_stream(exchange, first, tx).await,
    }
}

/// Drives one exchange: each message of the data plane answered in turn, `first` (already
/// received) first. While a request body is due, the next message must come by its deadline
/// (`limits.body_timeout_ms` from the request headers), or the request is answered 408. A
/// message the picker cannot decode (400), or one over its size limit (413), is answered as
/// well, so that a fail-open data plane never lets such a request through unrouted.
async fn run_exchange(
    mut exchange: Exchange,
    first: Next,
    mut inbound: Streaming<ProcessingRequest>,
    tx: Answers,
) {
    let mut received = Some(first);
    loop {
        let next = match (received.take(), exchange.body_due()) {
            (Some(next), _) => next,
            (None, Some(due)) => match tokio::time::timeout_at(due, inbound.next()).await {
                Ok(next) => next,
                Err(_) => {
                    let _ = tx.send(Ok(exchange.body_timed_out())).await;
                    return;
                }
            },
            (None, None) => inbound.next().await,
        };
        let message = match next {
            Some(Ok(message)) => message,
            Some(Err(status)) => {
                match exchange.undecodable(&status) {
                    Some(answer) => {
                        let _ = tx.send(Ok(answer)).await;
                    }
                    // Envoy resets the stream once its HTTP exchange is over: routine.
                    None => debug!(%status, "ext_proc stream ended by the data plane"),
                }
                return;
            }
            None => return,
        };
        // A request held by flow control waits inside `handle`: when the data plane ends the
        // stream meanwhile (its client went away), the request leaves the queue with it, as
        // `serve` drops a request whose client closed.
        let answer = tokio::select! {
            answer = exchange.handle(message) => answer,
            () = tx.closed() => return,
        };
        if let Some(answer) = answer
            && tx.send(Ok(answer)).await.is_err()
        {
            return;
        }
        if exchange.observed_to_end() {
            return;
        }
    }
}

/// A routing stream over `limits.max_picker_streams`: its first message is answered 503, and
/// it ends.
async fn refuse_stream(
    mut exchange: Exchange,
    first: Result<ProcessingRequest, Status>,
    tx: Answers,
) {
    if first.is_ok() {
        let _ = tx.send(Ok(exchange.too_many_streams())).await;
    }
}

/// A running endpoint picker; dropping it stops everything.
pub struct RunningEpp {
    /// The gRPC address (with the real port when port 0 was configured).
    pub addr: SocketAddr,
    /// The admin listener's address (`/metrics`, `/kvroute/v1/explain`, `/health`).
    pub admin_addr: SocketAddr,
    /// The router state behind it: the crate's own tests read it (feature `test-support`);
    /// for anyone else it is private.
    #[cfg(feature = "test-support")]
    pub router: Arc<Router>,
    #[cfg(not(feature = "test-support"))]
    router: Arc<Router>,
    tasks: ServerTasks,
}

impl RunningEpp {
    /// How many endpoints the picker knows now (configured or discovered).
    pub fn endpoint_count(&self) -> usize {
        self.router.endpoints().len()
    }

    /// Waits until the gRPC server stops (it runs until dropped).
    pub async fn wait(mut self) {
        if let Some(server) = self.tasks.listener() {
            let _ = server.await;
        }
    }
}

/// Binds the gRPC and admin listeners and starts every task on the current tokio runtime.
pub async fn start(config: RouterConfig, options: EppOptions) -> Result<RunningEpp, RouterError> {
    let router = Arc::new(Router::new(config)?);
    let (listener, addr) = bind(options.listen).await?;
    let connections = crate::descriptors::connection_limits(
        router.config().limits.max_connections,
        router.endpoints().len(),
    )?;
    let (mut tasks, admin_addr) = ServerTasks::start(&router, connections.admin).await?;
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status("liveness", ServingStatus::Serving)
        .await;
    for service in ["", "readiness", EXT_PROC_SERVICE] {
        reporter
            .set_service_status(service, ServingStatus::NotServing)
            .await;
    }
    tasks.push(tokio::spawn(readiness(
        router.clone(),
        reporter,
        options.ready_after,
    )));
    // Envoy's buffered mode sends a whole request body in one message: allow the router's own
    // body limit (and the message around it), not tonic's default 4 MiB, so that the body
    // limit, not the transport, decides.
    let max_message = router
        .config()
        .limits
        .max_body_bytes
        .saturating_add(64 << 10);
    let picker = Picker {
        router: router.clone(),
        fallbacks: options.fallbacks,
        budget: request_budget(&router),
        streams: Arc::new(Semaphore::new(router.config().limits.max_picker_streams)),
        observers: Arc::new(Semaphore::new(router.config().limits.max_observer_streams)),
        handoffs: Arc::default(),
    };
    info!(%addr, %admin_addr, endpoints = router.endpoints().len(), "kvroute endpoint picker serving ext_proc");
    let server = tonic::transport::Server::builder()
        // A gateway that vanished without closing its connection (a crashed Envoy, a dropped
        // network path) is found by HTTP/2 pings, and its streams end and give back what they
        // held (stream permits, budget, in-flight load).
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        .add_service(health)
        .add_service(ExternalProcessorServer::new(picker).max_decoding_message_size(max_message))
        // Small messages both ways, each waited for: without TCP_NODELAY, Nagle's algorithm
        // holds an answer back until the previous segment is acknowledged (up to the peer's
        // delayed-ACK timeout, 40 ms on Linux).
        .serve_with_incoming(TcpIncoming::from(listener).with_nodelay(Some(true)));
    tasks.push(tokio::spawn(async move {
        if let Err(e) = server.await {
            warn!(error = %e, "the ext_proc server stopped");
        }
    }));
    Ok(RunningEpp {
        addr,
        admin_addr,
        router,
        tasks,
    })
}

/// Marks the picker ready once a replica's warm-up is over and every KV-event subscriber has
/// connected at least once (or after `ready_after`, whichever comes first): before, its
/// picture of the caches is empty.
async fn readiness(router: Arc<Router>, reporter: HealthReporter, ready_after: Duration) {
    let deadline = tokio::time::Instant::now() + ready_after;
    loop {
        let connected = !router.replica().warming()
            && router.endpoints().iter().all(|e| {
                e.subscriber
                    .lock()
                    .as_ref()
                    .is_none_or(|s| s.stats().iter().all(|(_, st)| st.connects > 0))
            });
        if connected || tokio::time::Instant::now() >= deadline {
            if !connected {
                warn!("some KV-event subscribers never connected; ready anyway");
            }
            for service in ["", "readiness", EXT_PROC_SERVICE] {
                reporter
                    .set_service_status(service, ServingStatus::Serving)
                    .await;
            }
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
