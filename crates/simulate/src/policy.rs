//! The seam between the simulation and routing: a [`RoutingPolicy`] sees what a router would
//! see (requests, dispatches, KV events, load scrapes, first tokens, completions), each with the
//! virtual time `now`, and answers one question: where does this request go, now.

use std::sync::Arc;

use kvroute_core::event::KvEvent;
use kvroute_core::keys::RouterKey;
use kvroute_core::load_counters::TierLoadCounters;

/// A request as the router sees it when it must choose an endpoint.
#[derive(Clone, Debug)]
pub struct SimRequest<'a> {
    /// Unique in the run; names the request in the later callbacks.
    pub id: u64,
    /// Prompt token ids (after the chat template, as the router's tokenizer produces them).
    pub tokens: &'a [u32],
    /// Router keys of the prompt's full blocks.
    pub keys: Arc<Vec<RouterKey>>,
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// The conversation (or trace row) the request belongs to.
    pub session: u64,
}

/// What an engine reported of a request that ended, as vLLM's `usage` says it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens it found cached (`prompt_tokens_details.cached_tokens`).
    pub cached_tokens: usize,
    /// Tokens it generated (`completion_tokens`).
    pub completion_tokens: usize,
}

/// A policy's answer for a request.
#[derive(Clone, Debug, PartialEq)]
pub enum Routing {
    /// Send it to this endpoint (an index into the fleet).
    Endpoint(usize),
    /// Prefill/decode disaggregation: a prefill leg on `prefill` (one token, blocks held), the
    /// missing blocks over the link, then the request on `decode`.
    Disaggregated {
        /// The prefill endpoint.
        prefill: usize,
        /// The decode endpoint.
        decode: usize,
    },
    /// Hold it (flow control): the simulation asks again, in arrival order, when capacity may
    /// have changed (a first token, a completion, a load scrape) and every 50 ms.
    Wait,
    /// Refuse it, with the error the client reads (e.g. `HTTP 503: ...`).
    Reject(String),
}

/// A routing policy driven in virtual time. Callbacks arrive in time order; `endpoint` is an
/// index into the fleet.
pub trait RoutingPolicy {
    /// Decides where a request goes now (asked again while the answer is [`Routing::Wait`]).
    fn route(&mut self, request: &SimRequest<'_>, now: f64) -> Routing;
    /// The request was sent to `endpoint` (the connection was made).
    fn dispatched(&mut self, request_id: u64, endpoint: usize, now: f64);
    /// KV events `endpoint` published, as they reach the router.
    fn kv_events(&mut self, endpoint: usize, events: &[KvEvent], now: f64);
    /// A scrape of `endpoint`'s load: requests waiting and running, KV-cache usage (0–1).
    fn load_sample(&mut self, endpoint: usize, waiting: f64, running: f64, kv_usage: f64, now: f64);
    /// A scrape of `endpoint`'s per-tier load counters (tokens loaded, seconds the loads took),
    /// as the router reads them from its `/metrics` (nothing by default).
    fn tier_loads(&mut self, endpoint: usize, counters: TierLoadCounters, now: f64) {
        let _ = (endpoint, counters, now);
    }
    /// The request's first token passed the router.
    fn first_token(&mut self, request_id: u64, now: f64);
    /// The request ended: `usage` is what the engine reported (`None` when it failed).
    fn finished(&mut self, request_id: u64, usage: Option<Usage>, now: f64);
    /// The prefill leg of a disaggregated request ended on its prefill endpoint, which found
    /// `cached_tokens` of the prompt in its cache.
    fn prefill_done(&mut self, request_id: u64, cached_tokens: usize, now: f64) {
        let _ = (request_id, cached_tokens, now);
    }
    /// Request `request_id`'s P/D transfer of `bytes` from `prefill` to `decode` took
    /// `seconds` (what the decode engine's `vllm:nixl_xfer_time_seconds` reports).
    fn transferred(
        &mut self,
        request_id: u64,
        link: (usize, usize),
        bytes: u64,
        seconds: f64,
        now: f64,
    ) {
        let _ = (request_id, link, bytes, seconds, now);
    }
    /// Each request's time to first token less what the policy predicted for it, seconds, for
    /// the requests it predicted (none by default).
    fn ttft_prediction_errors(&self) -> &[f64] {
        &[]
    }
}
