//! The request pipeline: the phases every generation request passes, on its own context, for
//! both drivers (`kvroute serve`'s proxy and `kvroute epp`'s picker):
//!
//! 1. **admit**: the request's context from its headers (id, session, priority, arrival);
//! 2. **prepare**: parse once, tokenize, cut into block keys (on the blocking pool for a large
//!    body);
//! 3. **select**: core plans it and decides to route, hold (flow control, polled as capacity
//!    frees up) or refuse it; the result is the request's [`Leg`];
//! 4. **connect**: once a connection to the leg's endpoint exists (or, for the picker, once
//!    it names the endpoint), the dispatch is recorded in the fleet and shared with peers;
//! 5. **respond**: the response is accounted (first token, end, reported cached tokens);
//! 6. on a failed attempt, core says whether to **retry** down the leg's ranking.
//!
//! A request has one leg; a prefill/decode-disaggregated request (`pd`) has two
//! (prefill then decode), each with its own endpoint, dispatch and accounting, through the same
//! phases.
//! Every refusal becomes an OpenAI-shaped response in one place ([`crate::reply`]).

mod prepare;
mod select;

use std::sync::Arc;

use axum::http::HeaderMap;
use bytes::Bytes;
use kvroute_core::fleet::{AttemptFailure, Dispatch, Plan, Shed};
use kvroute_core::index::EndpointId;
use kvroute_core::schedule::PredictedTtfts;
use kvroute_vllm::openai::ApiError;
use tokio::time::Instant;

use crate::accounting::Accounting;
use crate::service::Router;

pub(crate) use prepare::unserved_model;
pub use prepare::{Api, Prepared, parse, prepare_request};

/// What a request carries through the phases, from admission on.
#[derive(Clone, Debug)]
pub(crate) struct RequestContext {
    /// The client's `x-request-id`, or one made up.
    pub(crate) request_id: String,
    /// When the router received it.
    pub(crate) started: Instant,
    /// The session its headers name, if any.
    pub(crate) session: Option<String>,
    /// Its flow-control priority (higher leaves the queue first).
    pub(crate) priority: i64,
}

/// The `reason` of a P/D decode leg.
pub(crate) const PD_DECODE: &str = "pd_decode";

/// One leg of a request: where it may go (in order), what core predicted there, and why.
/// A request has one leg that both prefills and decodes, or, disaggregated, a prefill leg then
/// a decode leg, each selected, connected and accounted on its own (its `reason` says which:
/// `pd_prefill`, `pd_decode`).
#[derive(Clone, Debug)]
pub(crate) struct Leg {
    /// Endpoints to try, best first (never empty once selected).
    pub(crate) ranking: Vec<EndpointId>,
    /// Core's predicted cached tokens per endpoint (empty for a request sent unplanned).
    pub(crate) predicted_cached: Vec<usize>,
    /// Core's predicted time to first token at each endpoint it assessed, where the leg's
    /// time to first token is the plan's to predict (empty for a request sent unplanned and
    /// for a P/D decode leg, whose wait is the P/D option's).
    pub(crate) predicted_ttft_s: PredictedTtfts,
    /// Why the first endpoint was chosen (retries say `retry`).
    pub(crate) reason: &'static str,
}

impl Leg {
    /// The one leg of a planned request.
    pub(crate) fn planned(plan: Plan) -> Self {
        Self {
            reason: plan.decision.reason.as_str(),
            predicted_ttft_s: PredictedTtfts::of(&plan.decision),
            ranking: plan.decision.ranking,
            predicted_cached: plan.predicted_cached,
        }
    }

    /// The one leg of a request that needs no cache, down `ranking`.
    pub(crate) fn unplanned(ranking: Vec<EndpointId>) -> Self {
        Self {
            ranking,
            predicted_cached: Vec::new(),
            predicted_ttft_s: PredictedTtfts::default(),
            reason: "passthrough",
        }
    }

    /// How many of its endpoints may be tried.
    pub(crate) fn attempts(&self, router: &Router) -> usize {
        router.config().retry.attempts(self.ranking.len())
    }
}

/// A request core has planned, ready to be sent to the first endpoint of its ranking.
pub struct Routed {
    /// The request, tokenized and keyed.
    pub prepared: Prepared,
    /// Core's plan for it (the ranking is never empty).
    pub plan: Plan,
}

/// Why a request was not routed.
pub struct Refused {
    /// The answer for the client.
    pub error: ApiError,
    /// Set when flow control shed the request.
    pub shed: Option<Shed>,
}

impl From<ApiError> for Refused {
    fn from(error: ApiError) -> Self {
        Self { error, shed: None }
    }
}

/// **admit**: the request's context from its headers.
pub(crate) fn admit(router: &Router, headers: &HeaderMap, started: Instant) -> RequestContext {
    RequestContext {
        request_id: request_id(headers),
        started,
        session: header(headers, &router.config().scheduler.session_header).map(str::to_owned),
        priority: header(headers, &router.config().scheduler.priority_header)
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0),
    }
}

/// A header's value, when it is text.
fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// The client's `x-request-id`, or a random one.
pub(crate) fn request_id(headers: &HeaderMap) -> String {
    header(headers, "x-request-id")
        .map(str::to_owned)
        .unwrap_or_else(|| format!("{:016x}", rand::random::<u64>()))
}

/// **prepare** and **select**: parses, tokenizes and plans a generation request, holding it
/// while every endpoint is saturated: the one decision path of `kvroute serve` and `kvroute
/// epp`.
pub async fn route(
    router: &Arc<Router>,
    api: Api,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<Routed, Refused> {
    let context = admit(router, headers, Instant::now());
    route_in(router, api, &context, body).await
}

/// **prepare** and **select** for an admitted request.
pub(crate) async fn route_in(
    router: &Arc<Router>,
    api: Api,
    context: &RequestContext,
    body: &Bytes,
) -> Result<Routed, Refused> {
    let (prepared, plan) = prepare::prepare_and_plan(router, api, body, context).await?;
    let plan = select::select(router, &prepared, plan, context, body.len()).await?;
    Ok(Routed { prepared, plan })
}

/// **connect**: records that `prepared` was connected to `id` (the picker: named it to the
/// gateway), with its leg's predictions there (cached tokens, time to first token; a retry
/// keeps the plan's): the fleet's dispatch, shared with peer replicas.
pub(crate) fn connect(router: &Router, leg: &Leg, prepared: &Prepared, id: EndpointId) -> Dispatch {
    let features = prepared.features();
    let mut dispatch = router.dispatched(&leg.predicted_cached, &features, id);
    dispatch.predicted_ttft_s = leg.predicted_ttft_s.at(id);
    crate::replica::share::dispatched(router, &features, &dispatch);
    dispatch
}

/// **respond**: the accounting of attempt `attempt` of `leg` from its dispatch to its end.
pub(crate) fn respond(
    router: &Arc<Router>,
    context: &RequestContext,
    leg: &Leg,
    attempt: usize,
    dispatch: Dispatch,
) -> Accounting {
    let reason = if attempt == 0 { leg.reason } else { "retry" };
    Accounting::new(
        router.clone(),
        dispatch,
        reason,
        context.request_id.clone(),
        context.started,
    )
}

/// **retry**: whether attempt `attempt` of `leg`, which failed on `id` with `failure`, goes on
/// to the next endpoint of its ranking (core decides; counted).
pub(crate) fn retry(
    router: &Router,
    leg: &Leg,
    id: EndpointId,
    failure: AttemptFailure,
    attempt: usize,
) -> bool {
    router.retry(id, failure, attempt, leg.attempts(router))
}

#[cfg(test)]
mod tests;
