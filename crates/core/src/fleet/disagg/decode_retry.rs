//! What follows a P/D request's failed decode leg, when the retry budget lets the request go on
//! to the next endpoint of its ranking ([`Fleet::decode_leg_failed`]).

use crate::fleet::{AttemptFailure, Fleet, Plan};
use crate::index::EndpointId;

/// A P/D request's decode leg whose attempt failed, and where the request goes next.
#[derive(Clone, Copy, Debug)]
pub struct FailedDecodeLeg<'a> {
    /// The request's plan (its aggregated predictions and costs).
    pub plan: &'a Plan,
    /// The prefill endpoint that produced the blocks and holds them.
    pub producer: EndpointId,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// The ranking's next endpoint, which the request's next attempt goes to, if any.
    pub next: Option<EndpointId>,
    /// How the decode leg's attempt failed.
    pub failure: AttemptFailure,
    /// The producer's hold on the blocks (its lease) still lasts.
    pub lease_holds: bool,
}

/// How a P/D request goes on after its decode leg failed ([`Fleet::decode_leg_failed`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DecodeRetry {
    /// The next endpoint takes the decode leg as one: it pulls the blocks from the producer,
    /// with the decode leg's body and predictions unchanged.
    PullAgain,
    /// The next endpoint serves the request aggregated: the client's own body, the prompt
    /// computed there.
    Aggregated {
        /// Cached tokens predicted per endpoint, in id order: the plan's own, not the decode
        /// leg's (which credit each decoder with the whole prompt it would pull), so that the
        /// prompt the next endpoint computes counts in its queued prefill. On the producer, which
        /// the prefill leg left holding the prompt, the whole prompt.
        predicted_cached: Vec<usize>,
        /// The next endpoint is the producer itself.
        next_is_producer: bool,
    },
}

impl Fleet {
    /// Decides at `now` how the request whose decode leg `failed` goes on. The next endpoint
    /// pulls the blocks again only when the failed consumer surely pulled nothing (no
    /// connection was made), the producer's hold still lasts and the next endpoint is not the
    /// producer itself (in a kv_both fleet it may be: NIXL refuses a handshake with its own
    /// engine); with no next endpoint that leaves the decode leg as it is. Otherwise a second
    /// pull could read blocks the producer released or reused for another request, so the
    /// request is served aggregated, its prompt computed again, which is always right: on an
    /// endpoint other than the producer, the prefill's work is recorded as reaching it
    /// ([`Fleet::prefill_sent`]), as after a failed prefill leg.
    pub fn decode_leg_failed(&mut self, failed: FailedDecodeLeg<'_>, now: f64) -> DecodeRetry {
        let next_is_producer = failed.next == Some(failed.producer);
        let nothing_pulled = failed.failure == AttemptFailure::Connect;
        if nothing_pulled && !next_is_producer && failed.lease_holds {
            return DecodeRetry::PullAgain;
        }
        let mut predicted_cached = failed.plan.predicted_cached.clone();
        match failed.next {
            Some(producer) if next_is_producer => {
                if let Some(slot) = predicted_cached.get_mut(producer.0 as usize) {
                    *slot = failed.prompt_tokens;
                }
            }
            Some(next) => self.prefill_sent(failed.plan, next, now),
            None => {}
        }
        DecodeRetry::Aggregated {
            predicted_cached,
            next_is_producer,
        }
    }
}
