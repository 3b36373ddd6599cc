//! Whether to disaggregate a request, and with which prefill endpoint: the choice priced in
//! predicted seconds, per request, never by a fixed threshold.
//!
//! Given the decode endpoint the scheduler picked (D) and the prefill-capable candidates (Pᵢ),
//! each already assessed by the cost model ([`super::cost`]), the options are:
//!
//! - **aggregated** on D: D's queue wait + its prefill of what it does not hold + tier loading
//!   + the stall that prefill imposes on D's running decodes (decode interference);
//! - **P/D with Pᵢ**: Pᵢ's queue wait + its prefill of what *it* does not hold + its tier
//!   loading + the stall on Pᵢ's own decodes (zero on a dedicated producer; the prefill's
//!   seconds in it at D's rate, so that the two options' stalls differ by the decodes each
//!   endpoint has, not by the noise in their learned rates) + the transfer of
//!   the blocks D lacks at the (Pᵢ, D) pair's learned bandwidth, behind the bytes already
//!   queued on the busier of the two NICs (a shared link's backlog is a queue like an
//!   engine's; counted in full, as if first come first served) + the decode leg's wait in D's
//!   queue when the blocks arrive (D drains its queue meanwhile and receives new work at the
//!   rate the caller measured: with none it is D's queue less the time passed, with work
//!   arriving as fast as it drains it is D's queue as it is now) + the second leg's fixed cost
//!   (the prefill engine's sampling step and one more round trip).
//!
//! The cheapest wins; a tie keeps the request aggregated (one leg, nothing held). A pair under
//! quarantine ([`links`]) is listed with its arithmetic but cannot win. [`DisaggExplain`] carries
//! every option's terms, for `/kvroute/v1/explain`.
//!
//! Why this holds beyond one workload: each term is seconds derived from the engines' observed
//! rates and the link's observed speed, so the same comparison says "aggregate" for a short or
//! mostly cached prompt (nothing to gain, a transfer to pay), "disaggregate" for a long uncached
//! prompt on a fast link when D is busy decoding (the interference it avoids) or queued, and
//! "aggregate" again for the same prompt over a slow link (the transfer costs more than it
//! saves).

pub mod links;
pub mod presets;
#[cfg(test)]
mod tests;

use serde::Serialize;

use super::Cost;
use crate::index::EndpointId;
pub use links::{LinkBook, LinkEstimate, LinkHealth, LinkLearning, LinkPrior};
pub use presets::kv_bytes_per_token;

/// One endpoint's side of the choice: its cost for the whole request, as the cost model
/// assessed it, and what it holds of the prompt.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SideCost {
    /// The endpoint.
    pub endpoint: EndpointId,
    /// Its cost for the request (queue, prefill of what it lacks, tiers, interference).
    pub cost: Cost,
    /// Prompt tokens it holds (any tier).
    pub cached_tokens: usize,
    /// KV bytes already queued on its NIC: transfers to or from it that the caller sent and
    /// that have not finished. A new transfer waits behind them (links are shared).
    pub link_backlog_bytes: f64,
    /// Seconds of queued work that reach it per second of time, as the caller measured its
    /// recent dispatches (0: nothing new arrives, its queue drains; 1: work arrives as fast
    /// as it drains, its queue stays). A decode leg that arrives later waits behind what its
    /// queue holds then.
    pub queue_inflow: f64,
}

/// The request, as the P/D choice sees it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct PdRequest {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// KV-cache bytes per token of the model.
    pub kv_bytes_per_token: f64,
    /// The fixed cost of a second leg, seconds: the prefill engine's step that samples the
    /// token the proxy discards, and one more request round trip (the engines' step overhead
    /// is the measured floor of it).
    pub leg_overhead_s: f64,
}

/// The aggregated option's arithmetic.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct AggregatedOption {
    /// The decode endpoint, serving the whole request.
    pub endpoint: EndpointId,
    /// Its queue wait.
    pub queue_s: f64,
    /// Its prefill of what it does not hold.
    pub prefill_s: f64,
    /// Its tier loading.
    pub tier_load_s: f64,
    /// The stall its prefill imposes on its running decodes.
    pub decode_interference_s: f64,
    /// The sum.
    pub total_s: f64,
}

/// One P/D option's arithmetic.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PdOption {
    /// The prefill endpoint.
    pub prefill: EndpointId,
    /// The decode endpoint.
    pub decode: EndpointId,
    /// The prefill endpoint's queue wait.
    pub prefill_queue_s: f64,
    /// Its prefill of what it does not hold.
    pub prefill_s: f64,
    /// Its tier loading.
    pub prefill_tier_load_s: f64,
    /// The stall the prefill imposes on the prefill endpoint's own decodes: the decodes it
    /// stalls there, for as long as the prefill takes at the decode endpoint's rate
    /// ([`decide`]).
    pub prefill_interference_s: f64,
    /// Prompt tokens the decode endpoint lacks, whose KV moves.
    pub transfer_tokens: usize,
    /// Their bytes.
    pub transfer_bytes: f64,
    /// Bytes queued ahead on the busier of the two NICs.
    pub link_backlog_bytes: f64,
    /// The pair's bandwidth used, bytes per second.
    pub bandwidth_bytes_per_s: f64,
    /// Where that bandwidth comes from.
    pub link: LinkHealth,
    /// Predicted transfer seconds (latency included).
    pub transfer_s: f64,
    /// The decode leg's wait in the decode endpoint's queue when the blocks arrive: its queue
    /// now, less what it drains meanwhile, plus what reaches it meanwhile.
    pub decode_queue_s: f64,
    /// The second leg's fixed cost.
    pub leg_overhead_s: f64,
    /// The sum.
    pub total_s: f64,
    /// Whether it may be chosen (false while the pair is quarantined).
    pub eligible: bool,
}

/// What was chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "mode")]
pub enum DisaggChoice {
    /// One leg on the decode endpoint.
    Aggregated,
    /// A prefill leg on `prefill`, then the decode leg.
    Disaggregated {
        /// The prefill endpoint.
        prefill: EndpointId,
    },
}

/// The choice and the arithmetic of every option.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DisaggExplain {
    /// What was chosen.
    pub choice: DisaggChoice,
    /// Predicted seconds of the chosen option.
    pub chosen_s: f64,
    /// Aggregated on the decode endpoint.
    pub aggregated: AggregatedOption,
    /// P/D with each prefill candidate, cheapest first.
    pub disaggregated: Vec<PdOption>,
}

/// Prices aggregated against P/D with each prefill candidate, at `now` (the links' clock).
/// Candidates equal to the decode endpoint are skipped (that is the aggregated option).
pub fn decide(
    shape: PdRequest,
    decode: &SideCost,
    prefills: &[SideCost],
    links: &LinkBook,
    now: f64,
) -> DisaggExplain {
    let d = &decode.cost;
    let aggregated = AggregatedOption {
        endpoint: decode.endpoint,
        queue_s: d.queue_s,
        prefill_s: d.prefill_s,
        tier_load_s: d.tier_load_s,
        decode_interference_s: d.decode_interference_s,
        total_s: d.queue_s + d.prefill_s + d.tier_load_s + d.decode_interference_s,
    };
    let block = shape.block_size.max(1);
    // The full prompt blocks the decode endpoint does not hold move (a partial last block is
    // computed there, as vLLM's consumer does).
    let pulled_blocks = (shape.prompt_tokens / block).saturating_sub(decode.cached_tokens / block);
    let transfer_tokens = pulled_blocks * block;
    let transfer_bytes = transfer_tokens as f64 * shape.kv_bytes_per_token;
    let mut options: Vec<PdOption> = prefills
        .iter()
        .filter(|p| p.endpoint != decode.endpoint)
        .map(|p| {
            // One look at the pair: its health, bandwidth and the transfer's time agree.
            let link = links.estimate(p.endpoint, decode.endpoint, now);
            let backlog = p.link_backlog_bytes.max(decode.link_backlog_bytes).max(0.0);
            let transfer_s = if transfer_bytes > 0.0 {
                link.transfer_s(transfer_bytes + backlog)
            } else {
                0.0
            };
            let c = &p.cost;
            // The decode leg joins D's queue when the blocks have arrived. Meanwhile D drains
            // one second of work per second and receives `queue_inflow` seconds per second:
            // what is left ahead of the leg then is its wait.
            let ready_s = c.queue_s + c.prefill_s + c.tier_load_s + transfer_s;
            let decode_wait_s = decode_wait_at(d.queue_s, decode.queue_inflow, ready_s);
            let stall_s = stall_at_decode_rate(shape.prompt_tokens, decode, p);
            let total_s = ready_s + decode_wait_s + stall_s + shape.leg_overhead_s;
            PdOption {
                prefill: p.endpoint,
                decode: decode.endpoint,
                prefill_queue_s: c.queue_s,
                prefill_s: c.prefill_s,
                prefill_tier_load_s: c.tier_load_s,
                prefill_interference_s: stall_s,
                transfer_tokens,
                transfer_bytes,
                link_backlog_bytes: backlog,
                bandwidth_bytes_per_s: link.bandwidth_bytes_per_s,
                link: link.health,
                transfer_s,
                decode_queue_s: decode_wait_s,
                leg_overhead_s: shape.leg_overhead_s,
                total_s,
                eligible: !matches!(link.health, LinkHealth::Quarantined { .. }),
            }
        })
        .collect();
    options.sort_by(|a, b| {
        b.eligible
            .cmp(&a.eligible)
            .then(a.total_s.total_cmp(&b.total_s))
            .then(a.prefill.cmp(&b.prefill))
    });
    let (choice, chosen_s) = match options.first() {
        Some(best) if best.eligible && best.total_s < aggregated.total_s => (
            DisaggChoice::Disaggregated {
                prefill: best.prefill,
            },
            best.total_s,
        ),
        _ => (DisaggChoice::Aggregated, aggregated.total_s),
    };
    DisaggExplain {
        choice,
        chosen_s,
        aggregated,
        disaggregated: options,
    }
}

/// The stall a prefill on `prefill` imposes on its decodes, priced at `decode`'s prefill rate:
/// the decodes it stalls there (its interference per second of prefill) times the seconds
/// `decode` would take for the tokens `prefill` lacks, plus `prefill`'s own tier loading where
/// it runs in the step (its `stalling_s` beyond its prefill).
///
/// Why one rate: disaggregating moves one prefill, and its stall, from D's decodes to P's.
/// Whether that saves anything depends on how many decodes each has, not on which engine's
/// learned rate is a few percent higher: a learned rate averages prefills run beside different
/// batches, and between engines of one model its differences are mostly that. Multiplied by the
/// decodes stalled, such a difference outweighed the transfer and the second leg and sent
/// prompts to P/D that came out slower than aggregated, with no stall saved (measured:
/// `docs/benchmarks-log.md`, "P/D: one prefill, one rate"). The TTFT terms keep each engine's own
/// rate. Falls back to P's own figure when D has nothing to prefill (no rate of D is implied).
pub fn stall_at_decode_rate(prompt_tokens: usize, decode: &SideCost, prefill: &SideCost) -> f64 {
    let (d, p) = (&decode.cost, &prefill.cost);
    let uncached = |cached: usize| prompt_tokens.saturating_sub(cached) as f64;
    let own_duration_s = p.stalling_s;
    let d_uncached = uncached(decode.cached_tokens);
    if own_duration_s <= 0.0 || d.prefill_s <= 0.0 || d_uncached <= 0.0 {
        return p.decode_interference_s;
    }
    let stalled_per_s = p.decode_interference_s / own_duration_s;
    let in_step_load_s = p.stalling_s - p.prefill_s;
    let duration_at_d_s =
        d.prefill_s * uncached(prefill.cached_tokens) / d_uncached + in_step_load_s;
    stalled_per_s * duration_at_d_s
}

/// The seconds of work ahead of a leg that joins a queue of `queue_s` after `after_s`, while
/// the queue drains one second per second and receives `inflow` seconds per second.
fn decode_wait_at(queue_s: f64, inflow: f64, after_s: f64) -> f64 {
    let inflow = if inflow.is_finite() {
        inflow.max(0.0)
    } else {
        0.0
    };
    (queue_s + (inflow - 1.0) * after_s).max(0.0)
}
