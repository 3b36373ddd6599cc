//! Following a proxied response to its end and telling the fleet: prefill done at the first
//! body byte, the request finished at the end or when the client goes away, with the engine's
//! reported `cached_tokens` to compare with the prediction and `completion_tokens` to learn
//! how much of the cache a request holds by its end. The response body itself is passed
//! on by [`AccountedBody`] ([`stream`]).

mod stream;
mod strip_usage;
mod unread;

pub use stream::{AccountedBody, Cut, CutAware};
pub use strip_usage::StripUsage;

use std::sync::Arc;
use tokio::time::Instant;

use kvroute_core::fleet::Dispatch;
use kvroute_vllm::openai::usage_count_in_tail;
use tracing::info;

use crate::endpoint::Endpoint;
use crate::metrics::{OutcomeLabel, RequestLabels};
use crate::service::Router;

/// Bytes of the response tail kept to find the usage object.
const TAIL: usize = 4096;

/// How a routed request ended, as the `outcome` label and log field say.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The response was passed to the client to its end.
    Completed,
    /// The client went away before the end (before the response headers, or mid-stream).
    ClientClosed,
    /// The engine failed: a 5xx, a refused or broken connection, an invalid response.
    EngineError,
    /// The engine did not answer in time.
    Timeout,
    /// The router stopped waiting at a leg's own deadline and served the request otherwise (a
    /// P/D prefill leg past `pd.prefill_deadline_s`: the request falls back to aggregated).
    Deadline,
}

impl Outcome {
    /// The label used in logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Completed => "completed",
            Outcome::ClientClosed => "client_closed",
            Outcome::EngineError => "engine_error",
            Outcome::Timeout => "timeout",
            Outcome::Deadline => "deadline",
        }
    }
}

/// One request's share of an endpoint's load, handed back to the fleet exactly once.
pub struct Accounting {
    router: Arc<Router>,
    endpoint: Arc<Endpoint>,
    dispatch: Option<Dispatch>,
    reason: &'static str,
    request_id: String,
    started: Instant,
    /// Upstream status (0 until response headers arrived).
    pub status: u16,
    /// How it ended, when known before the drop; else read from the status and `ended`.
    outcome: Option<Outcome>,
    /// The response body was passed on to its end.
    ended: bool,
    /// Compare the engine's reported `cached_tokens` with the prediction (not on a P/D decode
    /// leg, whose report counts the blocks it pulled, or the prefill's hits).
    check_cached: bool,
    /// Count the engine's reported `completion_tokens` as output (not on a P/D prefill leg,
    /// whose one token the client never receives: the decode leg generates it again).
    counts_output: bool,
    /// The first body byte is the first token (a stream, or a one-token P/D prefill leg):
    /// only then is its time checked against the plan's prediction. A whole answer's first
    /// byte comes after its last token.
    first_byte_is_first_token: bool,
    tail: Vec<u8>,
}

impl Accounting {
    /// Takes over a dispatched request's accounting.
    pub fn new(
        router: Arc<Router>,
        dispatch: Dispatch,
        reason: &'static str,
        request_id: String,
        started: Instant,
    ) -> Self {
        let endpoint = router.endpoint(dispatch.endpoint).clone();
        if dispatch.tier_uncertain {
            router
                .metrics()
                .tiers
                .warn_uncertain(&endpoint.name, &request_id);
        }
        Self {
            router,
            endpoint,
            dispatch: Some(dispatch),
            reason,
            request_id,
            started,
            status: 0,
            outcome: None,
            ended: false,
            check_cached: true,
            counts_output: true,
            first_byte_is_first_token: false,
            tail: Vec::new(),
        }
    }

    /// The request failed with `status` (answered to the client by the router) for `outcome`.
    pub fn fail(&mut self, status: u16, outcome: Outcome) {
        self.status = status;
        self.outcome = Some(outcome);
    }

    /// The response was read to its end by the router itself (a P/D prefill leg).
    pub fn completed(&mut self) {
        self.ended = true;
    }

    /// The engine's one token is not output the client receives (a P/D prefill leg): not
    /// counted in `kvroute_generated_tokens_total` (the endpoint still learns from it how long
    /// its requests hold their blocks).
    pub fn skip_output_count(&mut self) {
        self.counts_output = false;
    }

    /// The response's first body byte is its first token (a stream, or a one-token leg): its
    /// time is checked against the plan's prediction (`kvroute_ttft_prediction_error_seconds`).
    pub fn first_byte_is_first_token(&mut self) {
        self.first_byte_is_first_token = true;
    }

    /// The engine's reported `cached_tokens` says nothing of this endpoint's cache (a P/D
    /// decode leg): not compared with the prediction.
    pub fn skip_cached_check(&mut self) {
        self.check_cached = false;
    }

    /// How the request ended, as far as known now.
    fn outcome(&self) -> Outcome {
        self.outcome.unwrap_or(if self.status >= 500 {
            Outcome::EngineError
        } else if self.ended {
            Outcome::Completed
        } else {
            Outcome::ClientClosed
        })
    }

    fn first_byte(&mut self) {
        let Some(dispatch) = self.dispatch.as_mut() else {
            return;
        };
        if dispatch.prefill_done() {
            return;
        }
        let now = self.router.now();
        let check = self
            .router
            .fleet()
            .first_token(dispatch, self.status == 200, now);
        crate::replica::share::prefill_done(&self.router, dispatch);
        let name = &self.endpoint.name;
        let elapsed = self.started.elapsed().as_secs_f64();
        self.router.with_endpoint_series(&[name], || {
            let m = self.router.metrics();
            m.first_byte_seconds.of(name).observe(elapsed);
            if let Some(check) = check.filter(|_| self.first_byte_is_first_token) {
                m.ttft_prediction_error_seconds
                    .of(name)
                    .observe(check.error_s());
            }
        });
        self.router.capacity_changed();
    }

    /// Sees a chunk of the response body: the first one marks the prefill done; the tail is
    /// kept to read the engine's reported `cached_tokens` at the end.
    pub fn observe(&mut self, data: &[u8]) {
        self.first_byte();
        self.tail
            .extend_from_slice(&data[data.len().saturating_sub(TAIL)..]);
        if self.tail.len() > 2 * TAIL {
            self.tail.drain(..self.tail.len() - TAIL);
        }
    }

    /// The last `"cached_tokens": N` in the response, if any.
    fn reported_cached(&self) -> Option<usize> {
        usage_count_in_tail(&self.tail, "cached_tokens")
    }
}

impl Drop for Accounting {
    fn drop(&mut self) {
        let Some(mut dispatch) = self.dispatch.take() else {
            return;
        };
        // Released on completion and on client disconnect alike.
        let reported = self.reported_cached().filter(|_| self.check_cached);
        let generated = usage_count_in_tail(&self.tail, "completion_tokens");
        if let Some(generated) = generated {
            // How much of the cache its requests hold by their end (`Fleet::finished`).
            dispatch.output_reported(generated);
        }
        let outcome = self.outcome();
        let predicted = dispatch.predicted_cached;
        let prompt_tokens = dispatch.prompt_tokens;
        let now = self.router.now();
        if !dispatch.prefill_done() {
            crate::replica::share::prefill_done(&self.router, &dispatch);
        }
        crate::replica::share::ended(&self.router, &dispatch);
        self.router.fleet().finished(dispatch, reported, now);
        self.router.capacity_changed();
        let name = &self.endpoint.name;
        let elapsed = self.started.elapsed().as_secs_f64();
        // The endpoint may have left while the request was in flight: its series stay gone.
        self.router.with_endpoint_series(&[name], || {
            let m = self.router.metrics();
            m.request_seconds.of(name).observe(elapsed);
            let class = format!("{}xx", self.status / 100);
            m.requests
                .get_or_create(
                    name,
                    RequestLabels {
                        reason: self.reason,
                        status: class,
                        outcome: outcome.as_str(),
                    },
                )
                .inc();
            if let Some(generated) = generated.filter(|_| self.counts_output) {
                m.generated_tokens.of(name).inc_by(generated as u64);
            }
            if let Some(reported) = reported {
                m.predicted_cached_tokens.of(name).inc_by(predicted as u64);
                m.reported_cached_tokens.of(name).inc_by(reported as u64);
                let outcome = match predicted.cmp(&reported) {
                    std::cmp::Ordering::Equal => "exact",
                    std::cmp::Ordering::Greater => "over",
                    std::cmp::Ordering::Less => "under",
                };
                m.prediction_outcomes
                    .get_or_create(name, OutcomeLabel { outcome })
                    .inc();
            }
        });
        info!(
            request_id = %self.request_id,
            endpoint = %name,
            reason = self.reason,
            status = self.status,
            prompt_tokens,
            predicted_cached = predicted,
            reported_cached = ?reported,
            seconds = elapsed,
            outcome = outcome.as_str(),
            completed = outcome == Outcome::Completed,
            "routed"
        );
    }
}
