//! Filters and scorers: each scorer maps a candidate to [0, 1], higher is better.

use super::{Assessment, Candidate, Profile, Rejection, RequestInfo, Role, ScoreTerm};

fn rejection(profile: &Profile, request: &RequestInfo, c: &Candidate) -> Option<Rejection> {
    if !c.healthy {
        return Some(Rejection::Unhealthy);
    }
    if !c.serves_model {
        return Some(Rejection::WrongModel);
    }
    if request.role != Role::Both && c.role != Role::Both && c.role != request.role {
        return Some(Rejection::WrongRole);
    }
    if profile
        .filters
        .max_waiting
        .is_some_and(|max| c.load.queue() > max)
    {
        return Some(Rejection::QueueFull);
    }
    if profile
        .filters
        .max_kv_usage
        .is_some_and(|max| c.load.kv_usage.unwrap_or(0.0) > max)
    {
        return Some(Rejection::KvCacheFull);
    }
    None
}

/// Cached prompt tokens (tier-weighted credit, all, GPU) from the precise index and overlay.
fn precise_tokens(profile: &Profile, request: &RequestInfo, c: &Candidate) -> (f64, usize, usize) {
    let bs = request.block_size as f64;
    let predicted = c.cache.predicted;
    let (gpu, cpu, storage) = match c.cache.precise {
        Some(m) if m.blocks >= predicted => (m.gpu_blocks, m.cpu_blocks, m.storage_blocks),
        // Blocks just sent there are (about to be) on its GPU.
        _ => (predicted, 0, 0),
    };
    let t = &profile.tiers;
    let credit =
        (f64::from(gpu) * t.gpu + f64::from(cpu) * t.cpu + f64::from(storage) * t.storage) * bs;
    let all = (gpu + cpu + storage) as usize * request.block_size;
    (credit, all, gpu as usize * request.block_size)
}

/// Scores that depend on the candidate alone; relative ones are filled in afterwards.
pub(super) fn assess(profile: &Profile, request: &RequestInfo, c: &Candidate) -> Assessment {
    let w = &profile.weights;
    let prompt = request.prompt_tokens.max(1) as f64;
    let (precise_credit, precise_all, gpu_tokens) = precise_tokens(profile, request, c);
    let approx_tokens = c.cache.approximate as usize * request.block_size;
    let cached_tokens = if w.precise_prefix > 0.0 || w.approximate_prefix == 0.0 {
        precise_all
    } else {
        approx_tokens
    }
    .min(request.prompt_tokens);

    let queue_score = 1.0 - (c.load.queue() / profile.queue_norm.max(1e-9)).min(1.0);
    let kv_score = 1.0 - c.load.kv_usage.unwrap_or(0.0).clamp(0.0, 1.0);
    let uncached = request.prompt_tokens.saturating_sub(cached_tokens) as f64;
    let queued_tokens =
        (c.load.inflight_prefill_tokens as f64).max(c.load.waiting.unwrap_or(0.0) * prompt);
    let predicted_ttft_s = (queued_tokens + uncached) / c.prefill_tokens_per_s.max(1.0)
        + c.load.queue() * profile.queue_wait_s;

    let scores = vec![
        ScoreTerm {
            scorer: "precise_prefix",
            score: (precise_credit / prompt).min(1.0),
            weight: w.precise_prefix,
        },
        ScoreTerm {
            scorer: "approximate_prefix",
            score: (approx_tokens as f64 / prompt).min(1.0),
            weight: w.approximate_prefix,
        },
        ScoreTerm {
            scorer: "load",
            score: 0.5 * queue_score + 0.5 * kv_score,
            weight: w.load,
        },
        ScoreTerm {
            scorer: "cost",
            score: 0.0,
            weight: w.cost,
        },
        ScoreTerm {
            scorer: "balance",
            score: 0.0,
            weight: w.balance,
        },
        ScoreTerm {
            scorer: "session",
            score: if request.session_endpoint == Some(c.endpoint) {
                1.0
            } else {
                0.0
            },
            weight: w.session,
        },
    ];
    Assessment {
        endpoint: c.endpoint,
        rejected: rejection(profile, request, c),
        cached_tokens,
        gpu_tokens,
        predicted_ttft_s,
        scores,
        total: 0.0,
    }
}

/// Added to placement counts in the balance ratio, so that while counts are small a
/// difference of one or two does not outweigh a cache hit.
const BALANCE_SMOOTHING: f64 = 2.0;

/// Fills in the relative scores — cost (best predicted TTFT among competitors / own) and
/// balance ((fewest recent placements + s) / (own + s)) — and the totals.
pub(super) fn apply_relative(candidates: &[super::Candidate], assessments: &mut [Assessment]) {
    let fewest = candidates
        .iter()
        .zip(assessments.iter())
        .filter(|(_, a)| a.rejected.is_none())
        .map(|(c, _)| c.load.recent_requests.max(0.0))
        .fold(f64::INFINITY, f64::min);
    for (c, a) in candidates.iter().zip(assessments.iter_mut()) {
        let balance = if fewest.is_finite() {
            (fewest + BALANCE_SMOOTHING) / (c.load.recent_requests.max(0.0) + BALANCE_SMOOTHING)
        } else {
            1.0
        };
        if let Some(term) = a.scores.iter_mut().find(|t| t.scorer == "balance") {
            term.score = balance;
        }
    }
    let best = assessments
        .iter()
        .filter(|a| a.rejected.is_none())
        .map(|a| a.predicted_ttft_s)
        .fold(f64::INFINITY, f64::min);
    for a in assessments.iter_mut() {
        let cost = if a.predicted_ttft_s <= 0.0 || !best.is_finite() {
            1.0
        } else {
            (best / a.predicted_ttft_s).clamp(0.0, 1.0)
        };
        if let Some(term) = a.scores.iter_mut().find(|t| t.scorer == "cost") {
            term.score = cost;
        }
        a.total = a.scores.iter().map(|t| t.score * t.weight).sum();
    }
}

/// Why the winner beat the runner-up: the term whose weighted score differs most in its
/// favour. `cache` when what it holds decided (directly, or through a shorter predicted TTFT
/// because it holds more), `load` when its headroom or evenness did.
pub(super) fn reason(winner: &Assessment, runner_up: Option<&Assessment>) -> &'static str {
    let Some(other) = runner_up else {
        return "only_candidate";
    };
    winner
        .scores
        .iter()
        .zip(&other.scores)
        .map(|(w, o)| (w.scorer, (w.score - o.score) * w.weight))
        .filter(|(_, gain)| *gain > 1e-12)
        .max_by(|x, y| x.1.total_cmp(&y.1))
        .map_or("tie", |(scorer, _)| match scorer {
            "precise_prefix" | "approximate_prefix" => "cache",
            "cost" if winner.cached_tokens > other.cached_tokens => "cache",
            "cost" | "load" | "balance" => "load",
            "session" => "session",
            _ => "tie",
        })
}
