//! What follows a failed decode leg ([`Fleet::decode_leg_failed`]): a pull on the next decoder
//! only when the failed one surely pulled nothing and the producer still holds the blocks for
//! another endpoint; otherwise the request is served aggregated, with its prompt's work counted
//! where it is computed.

use super::tests::{config, fleet, plan};
use super::*;
use crate::fleet::AttemptFailure;

const PROMPT: usize = 4096;
const PRODUCER: EndpointId = EndpointId(0);
const DECODER: EndpointId = EndpointId(1);
const NEXT_DECODER: EndpointId = EndpointId(2);

/// A P/D fleet (`e0` prefills, `e1` and `e2` decode) and the plan of a fresh prompt.
fn pd_fleet() -> (Fleet, Plan) {
    let mut f = fleet(&[Role::Prefill, Role::Decode, Role::Decode]);
    f.enable_disagg(config("tcp"));
    let p = plan(&mut f, PROMPT);
    (f, p)
}

/// The decode leg on `e1` failed with `failure`; the request goes on to `next`.
fn failed(
    plan: &Plan,
    next: Option<EndpointId>,
    failure: AttemptFailure,
    lease_holds: bool,
) -> FailedDecodeLeg<'_> {
    FailedDecodeLeg {
        plan,
        producer: PRODUCER,
        prompt_tokens: PROMPT,
        next,
        failure,
        lease_holds,
    }
}

/// The prefill work recently sent to `endpoint` (its queue inflow) at `now`.
fn inflow(f: &Fleet, endpoint: EndpointId, now: f64) -> f64 {
    f.disagg.as_ref().unwrap().inflow_rate(endpoint, now)
}

#[test]
fn a_refused_connection_while_the_producer_holds_the_blocks_pulls_again_on_the_next_decoder() {
    let (mut f, p) = pd_fleet();
    assert!(p.decision.assessment(NEXT_DECODER).is_some());
    let verdict = f.decode_leg_failed(
        failed(&p, Some(NEXT_DECODER), AttemptFailure::Connect, true),
        1.0,
    );
    assert_eq!(verdict, DecodeRetry::PullAgain);
    assert_eq!(
        inflow(&f, NEXT_DECODER, 1.0),
        0.0,
        "a pull computes no prompt there: no prefill work reaches the next decoder"
    );
}

#[test]
fn a_decode_leg_that_may_have_pulled_is_served_aggregated_with_its_prompt_counted_there() {
    for failure in [
        AttemptFailure::ServerError,
        AttemptFailure::Timeout,
        AttemptFailure::Transport,
    ] {
        let (mut f, p) = pd_fleet();
        let verdict = f.decode_leg_failed(failed(&p, Some(NEXT_DECODER), failure, true), 1.0);
        assert_eq!(
            verdict,
            DecodeRetry::Aggregated {
                predicted_cached: p.predicted_cached.clone(),
                next_is_producer: false,
            },
            "{failure:?}: the consumer may have pulled, the producer may have released the \
             blocks: the plan's own predictions, not the whole prompt a pull would bring"
        );
        assert!(p.predicted_cached[NEXT_DECODER.0 as usize] < PROMPT);
        assert!(
            inflow(&f, NEXT_DECODER, 1.0) > 0.0,
            "{failure:?}: the prompt computed on the next decoder counts as work reaching it"
        );
        assert_eq!(inflow(&f, PRODUCER, 1.0), 0.0);
    }
}

#[test]
fn a_retry_on_the_producer_itself_is_served_aggregated_with_the_whole_prompt_cached_there() {
    // A kv_both fleet: the producer decodes too, and cannot pull from its own engine.
    let mut f = fleet(&[Role::Both, Role::Both]);
    f.enable_disagg(config("tcp"));
    let p = plan(&mut f, PROMPT);
    assert!(p.decision.assessment(PRODUCER).is_some());
    let verdict = f.decode_leg_failed(
        failed(&p, Some(PRODUCER), AttemptFailure::Connect, true),
        1.0,
    );
    let mut expected = p.predicted_cached.clone();
    expected[PRODUCER.0 as usize] = PROMPT;
    assert_eq!(
        verdict,
        DecodeRetry::Aggregated {
            predicted_cached: expected,
            next_is_producer: true,
        },
        "the prefill leg left the prompt cached on the producer: predicted whole there"
    );
    assert_eq!(
        inflow(&f, PRODUCER, 1.0),
        0.0,
        "nearly nothing is left to compute there: no prefill work recorded again"
    );
}

#[test]
fn a_refused_connection_after_the_producers_hold_is_over_is_served_aggregated() {
    let (mut f, p) = pd_fleet();
    let verdict = f.decode_leg_failed(
        failed(&p, Some(NEXT_DECODER), AttemptFailure::Connect, false),
        1.0,
    );
    assert_eq!(
        verdict,
        DecodeRetry::Aggregated {
            predicted_cached: p.predicted_cached.clone(),
            next_is_producer: false,
        },
        "the producer may have released the blocks: no second pull"
    );
    assert!(inflow(&f, NEXT_DECODER, 1.0) > 0.0);
}

#[test]
fn with_no_next_endpoint_nothing_is_recorded_anywhere() {
    let (mut f, p) = pd_fleet();
    let verdict = f.decode_leg_failed(failed(&p, None, AttemptFailure::ServerError, true), 1.0);
    assert_eq!(
        verdict,
        DecodeRetry::Aggregated {
            predicted_cached: p.predicted_cached.clone(),
            next_is_producer: false,
        }
    );
    // A refused connection with the hold lasting keeps the decode leg as one: there is no
    // endpoint to serve it aggregated on.
    let verdict = f.decode_leg_failed(failed(&p, None, AttemptFailure::Connect, true), 1.0);
    assert_eq!(verdict, DecodeRetry::PullAgain);
    for endpoint in [PRODUCER, DECODER, NEXT_DECODER] {
        assert_eq!(
            inflow(&f, endpoint, 1.0),
            0.0,
            "no endpoint computes the prompt: {endpoint:?}"
        );
    }
}
