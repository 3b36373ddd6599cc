//! Starting the router: the API and admin listeners, a KV-event subscriber per endpoint, and
//! the health checks, load scraping and housekeeping that run beside it.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router as Routes;
use axum::middleware;
use axum::routing::{get, post};
use tokio::task::JoinHandle;
use tracing::{info, warn};

use crate::RouterError;
use crate::budget::ByteBudget;
use crate::config::RouterConfig;
use crate::descriptors::connection_limits;
use crate::service::Router;
use crate::{admin, edge, proxy};

/// The OpenAI paths other than completions, chat and models that are forwarded to an engine,
/// all `POST` and stateless (any engine serving the model can answer). Every other path gets
/// an OpenAI-shaped 404: `/v1/load_lora_adapter` and the like are the operator's to call on
/// each engine, never a client's through the router.
pub const FORWARDED_PATHS: [&str; 5] = [
    "/v1/embeddings",
    "/v1/rerank",
    "/v1/score",
    "/v1/audio/transcriptions",
    "/v1/audio/translations",
];

/// A running router; dropping it stops everything.
pub struct RunningRouter {
    /// The address the OpenAI API listens on (with the real port when port 0 was configured).
    pub addr: SocketAddr,
    /// The address the admin listener (`/metrics`, `/kvroute/v1/explain`) listens on.
    pub admin_addr: SocketAddr,
    /// Its state: the crate's own tests read it (feature `test-support`); for anyone else it
    /// is private.
    #[cfg(feature = "test-support")]
    pub router: Arc<Router>,
    #[cfg(not(feature = "test-support"))]
    router: Arc<Router>,
    tasks: ServerTasks,
}

/// What a running front (the OpenAI API, the endpoint picker) owns besides its addresses: the
/// tasks it spawned, its own listener last, and the router state they serve. Dropping it aborts
/// the tasks and stops the endpoints' own (health checks, scrapes, event subscribers).
pub(crate) struct ServerTasks {
    router: Arc<Router>,
    tasks: Vec<JoinHandle<()>>,
}

impl ServerTasks {
    /// Starts what every front runs beside its own listener, on the current tokio runtime:
    /// the admin listener (at most `admin_connections` at once), the background tasks and
    /// discovery. Returns them with the admin listener's address.
    pub(crate) async fn start(
        router: &Arc<Router>,
        admin_connections: usize,
    ) -> Result<(Self, SocketAddr), RouterError> {
        let (admin_addr, admin) = spawn_admin(router, admin_connections).await?;
        let mut tasks = spawn_background(router);
        tasks.push(admin);
        tasks.extend(crate::discovery::spawn(router).await?);
        let owned = Self {
            router: router.clone(),
            tasks,
        };
        Ok((owned, admin_addr))
    }

    /// Adds a task; the last one added is the front's own listener.
    pub(crate) fn push(&mut self, task: JoinHandle<()>) {
        self.tasks.push(task);
    }

    /// The front's own listener (the last task added).
    pub(crate) fn listener(&mut self) -> Option<&mut JoinHandle<()>> {
        self.tasks.last_mut()
    }
}

impl Drop for ServerTasks {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
        self.router.stop_endpoints();
    }
}

impl RunningRouter {
    /// How many endpoints the router knows now (configured or discovered).
    pub fn endpoint_count(&self) -> usize {
        self.router.endpoints().len()
    }

    /// Waits until the HTTP server stops (it runs until the router is dropped or drained).
    pub async fn wait(mut self) {
        self.drained().await;
    }

    /// Resolves once the API listener has stopped: after a drain, when its last connection
    /// closed. Pending until then (and forever if it was never started).
    pub async fn drained(&mut self) {
        match self.tasks.listener() {
            Some(server) if !server.is_finished() => {
                let _ = server.await;
            }
            Some(_) => {}
            None => std::future::pending().await,
        }
    }

    /// Whether every endpoint's KV-event subscriber is connected (endpoints without events
    /// count as connected).
    pub fn subscribers_connected(&self) -> bool {
        self.router.endpoints().iter().all(|e| {
            e.config.events.is_none()
                || e.subscriber
                    .lock()
                    .as_ref()
                    .is_some_and(|s| s.stats().iter().all(|(_, f)| f.connected))
        })
    }

    /// Begins a graceful shutdown: the API listener stops accepting, open connections close
    /// once answered, `/health` answers 503. Idempotent.
    pub fn drain(&self) {
        info!("draining: no new connections; in-flight requests finish");
        self.router.shutdown().drain();
    }

    /// Ends every open stream now, with an SSE error event.
    pub fn close(&self) {
        self.router.shutdown().close();
    }

    /// Drains, waiting up to `timeout` for in-flight requests; then closes what is still open
    /// and waits (briefly) for it to end. True when everything finished within the timeout.
    pub async fn shutdown(&mut self, timeout: Duration) -> bool {
        self.drain();
        if tokio::time::timeout(timeout, self.drained()).await.is_ok() {
            return true;
        }
        self.finish_closing().await;
        false
    }

    /// Closes open streams and waits for their connections to end, a few seconds at most.
    pub async fn finish_closing(&mut self) {
        let open = self
            .router
            .metrics()
            .connections_open
            .get_or_create(&crate::metrics::listener("api"))
            .get();
        warn!(open, "drain timed out: ending the open streams");
        self.close();
        let _ = tokio::time::timeout(CLOSE_GRACE, self.drained()).await;
    }
}

/// How long closed streams get to deliver their error event.
const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// The OpenAI API routes; `/health` is the readiness check (503 while a replica warms up).
pub fn routes(router: Arc<Router>) -> Routes {
    let mut routes = Routes::new()
        .route("/v1/completions", post(proxy::completions))
        .route("/v1/chat/completions", post(proxy::chat_completions))
        .route("/v1/models", get(admin::models))
        .route("/health", get(crate::replica::ready));
    for path in FORWARDED_PATHS {
        routes = routes.route(path, post(proxy::passthrough));
    }
    routes
        .fallback(admin::not_found)
        .method_not_allowed_fallback(admin::method_not_allowed)
        .with_state(router)
}

/// The admin routes: metrics and explanations (behind `admin.token` when one is set), and
/// `/health`.
pub fn admin_routes(router: Arc<Router>) -> Routes {
    Routes::new()
        .route("/kvroute/v1/explain", post(admin::explain))
        .route("/metrics", get(admin::metrics))
        .route("/kvroute/v1/snapshot", get(crate::replica::snapshot))
        .route("/kvroute/v1/replica", get(crate::replica::status))
        .route(
            "/kvroute/v1/peer/dispatch",
            post(crate::replica::share::receive),
        )
        .route(
            "/kvroute/v1/peer/prefill_done",
            post(crate::replica::share::receive_prefill_done),
        )
        .route(
            "/kvroute/v1/peer/ended",
            post(crate::replica::share::receive_ended),
        )
        .route(
            "/kvroute/v1/peer/batch",
            post(crate::replica::receive_batch),
        )
        .route_layer(middleware::from_fn_with_state(
            router.clone(),
            admin::require_token,
        ))
        .route("/health", get(admin::health))
        .fallback(admin::not_found)
        .method_not_allowed_fallback(admin::method_not_allowed)
        .with_state(router)
}

pub(crate) async fn bind(
    addr: SocketAddr,
) -> Result<(tokio::net::TcpListener, SocketAddr), RouterError> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| RouterError::Io(format!("cannot listen on {addr}: {e}")))?;
    let bound = listener
        .local_addr()
        .map_err(|e| RouterError::Io(e.to_string()))?;
    Ok((listener, bound))
}

/// Starts what runs beside any front end (the HTTP proxy or the EPP): a KV-event subscriber,
/// health checks and load scraping per endpoint, housekeeping, and a replica's warm-up.
pub fn spawn_background(router: &Arc<Router>) -> Vec<JoinHandle<()>> {
    for e in router.endpoints() {
        crate::membership::spawn_endpoint_tasks(router, &e);
    }
    let mut tasks = vec![tokio::spawn(housekeeping(router.clone()))];
    crate::replica::share::check_peer_access(router);
    tasks.extend(crate::replica::warm::spawn(router));
    tasks
}

/// The buffered-bytes budget of the API listener (and the picker's streams):
/// `limits.max_buffered_bytes`, shown as `kvroute_buffered_bytes`.
pub fn request_budget(router: &Router) -> ByteBudget {
    ByteBudget::new(
        router.config().limits.max_buffered_bytes,
        router.metrics().buffered_bytes.clone(),
    )
}

/// Binds the admin listener (`/metrics`, `/kvroute/v1/explain`, `/health`) and serves it, with
/// its own buffered-bytes budget (`admin.max_buffered_bytes`), so that API clients cannot
/// spend what the admin listener needs, nor the other way round; at most `max_connections`
/// connections at once.
pub async fn spawn_admin(
    router: &Arc<Router>,
    max_connections: usize,
) -> Result<(SocketAddr, JoinHandle<()>), RouterError> {
    let (admin_listener, admin_addr) = bind(router.config().admin.listen).await?;
    let budget = ByteBudget::new(
        router.config().admin.max_buffered_bytes,
        router.metrics().admin_buffered_bytes.clone(),
    );
    let task = tokio::spawn(edge::serve(
        admin_listener,
        admin_routes(router.clone()),
        router.clone(),
        "admin",
        budget,
        max_connections,
        false,
    ));
    Ok((admin_addr, task))
}

/// Binds both listeners and starts every task on the current tokio runtime.
pub async fn start(config: RouterConfig) -> Result<RunningRouter, RouterError> {
    let router = Arc::new(Router::new(config)?);
    let (listener, addr) = bind(router.config().listen).await?;
    let budget = request_budget(&router);
    let connections = connection_limits(
        router.config().limits.max_connections,
        router.endpoints().len(),
    )?;
    let (mut tasks, admin_addr) = ServerTasks::start(&router, connections.admin).await?;
    info!(%addr, %admin_addr, endpoints = router.endpoints().len(), policy = ?router.config().scheduler.policy, "kvroute serving");
    // Last, so that `wait` waits on it.
    tasks.push(tokio::spawn(edge::serve(
        listener,
        routes(router.clone()),
        router.clone(),
        "api",
        budget,
        connections.api,
        true,
    )));
    Ok(RunningRouter {
        addr,
        admin_addr,
        router,
        tasks,
    })
}

/// Expires history and predictions, and logs changes of trust.
async fn housekeeping(router: Arc<Router>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        let now = router.now();
        let changes = {
            let mut fleet = router.fleet();
            fleet.housekeeping(now);
            fleet.trust_changes(now)
        };
        for (id, distrust) in changes {
            let name = router.endpoint(id).name.clone();
            match distrust {
                Some(why) => {
                    warn!(endpoint = %name, reason = ?why, "not trusting this endpoint's KV events: routing it by load only until it recovers");
                }
                None => warn!(endpoint = %name, "KV events trusted again"),
            }
        }
    }
}
