//! Turning a run's [`RequestRecord`]s into its [`Summary`].
//!
//! Latencies go through HDR histograms at microsecond resolution with three significant digits,
//! so a reported percentile is within 0.1% (and never more than 1 µs below) of the exact sample
//! value; means are exact. The rules for each field:
//!
//! - `requests` counts every record, `errors` those with `error.is_some()`.
//! - `requests_per_s` and `output_tokens_per_s` count only requests without an error, over
//!   `duration_s` (both are 0 when `duration_s` is not a positive number).
//! - `ttft`, `e2e` and `itl` skip failed requests, a missing TTFT, and any value that is not a
//!   finite number; negative values count as 0.
//! - `hit_rate` is the sum of `cached_tokens` over the sum of `prompt_tokens`, over the records
//!   that reported `cached_tokens` (0 when none did, or their prompts sum to 0).
//! - `engine_hit_rate` and `tier_tokens` are left `None`: whoever can read the engines'
//!   counters fills them in; `ttft_prediction_error` too, by whoever knows the router's
//!   predictions ([`prediction_error`]).
//! - `endpoints` has one entry per endpoint, sorted by name, counting every record it received
//!   (failed ones included). Records without an endpoint are grouped under
//!   [`UNKNOWN_ENDPOINT`] (`"-"`).
//! - `load_imbalance` is the busiest endpoint's requests over the mean requests per endpoint,
//!   over the named endpoints (the `"-"` group is left out unless it is the only one); 1.0 with
//!   a single endpoint or none. The records name only the endpoints that received something:
//!   a caller that knows the fleet adds the idle ones with [`count_idle_endpoints`], else an
//!   endpoint that got nothing does not count (a run that sent everything to one of four
//!   endpoints would read 1.0).

use std::collections::{BTreeMap, HashSet};

use hdrhistogram::Histogram;

use crate::result::{EndpointShare, Percentiles, PredictionError, RequestRecord, Summary};

/// The endpoint name under which records that carry no endpoint are grouped.
pub const UNKNOWN_ENDPOINT: &str = "-";

/// Significant digits of the latency histograms.
const SIGNIFICANT_DIGITS: u8 = 3;

/// Microseconds per second: the histograms' unit.
const MICROS_PER_S: f64 = 1_000_000.0;

/// Computes every field of a run's [`Summary`] (except `engine_hit_rate` and `tier_tokens`,
/// left `None`) from its records and its wall time in seconds. See the [module docs](self) for
/// the exact rules.
#[must_use]
pub fn summarize(records: &[RequestRecord], duration_s: f64) -> Summary {
    let mut ttft = LatencyRecorder::new();
    let mut e2e = LatencyRecorder::new();
    let mut itl = LatencyRecorder::new();

    let mut errors = 0u64;
    let mut completed = 0u64;
    let mut output_tokens = 0u64;
    let mut reported_prompt = 0u64;
    let mut reported_cached = 0u64;
    let mut shares: BTreeMap<&str, EndpointShare> = BTreeMap::new();

    for record in records {
        let name = record.endpoint.as_deref().unwrap_or(UNKNOWN_ENDPOINT);
        let share = shares.entry(name).or_insert_with(|| EndpointShare {
            endpoint: name.to_owned(),
            ..EndpointShare::default()
        });
        share.requests += 1;
        share.prompt_tokens = share.prompt_tokens.saturating_add(record.prompt_tokens);
        share.cached_tokens = share
            .cached_tokens
            .saturating_add(record.cached_tokens.unwrap_or(0));

        if let Some(cached) = record.cached_tokens {
            reported_cached = reported_cached.saturating_add(cached);
            reported_prompt = reported_prompt.saturating_add(record.prompt_tokens);
        }

        if record.error.is_some() {
            errors += 1;
            continue;
        }
        completed += 1;
        output_tokens = output_tokens.saturating_add(record.completion_tokens);
        if let Some(t) = record.ttft_s {
            ttft.record(t);
        }
        e2e.record(record.e2e_s);
        for &gap in &record.itl_s {
            itl.record(gap);
        }
    }

    let per_s = |n: u64| {
        if duration_s.is_finite() && duration_s > 0.0 {
            n as f64 / duration_s
        } else {
            0.0
        }
    };
    let hit_rate = if reported_prompt == 0 {
        0.0
    } else {
        reported_cached as f64 / reported_prompt as f64
    };
    let endpoints: Vec<EndpointShare> = shares.into_values().collect();
    let load_imbalance = load_imbalance(&endpoints);

    Summary {
        requests: records.len() as u64,
        errors,
        duration_s,
        requests_per_s: per_s(completed),
        output_tokens_per_s: per_s(output_tokens),
        ttft: ttft.percentiles(),
        e2e: e2e.percentiles(),
        itl: itl.percentiles(),
        hit_rate,
        engine_hit_rate: None,
        endpoints,
        load_imbalance,
        tier_tokens: None,
        ttft_prediction_error: None,
    }
}

/// Adds to `summary` the endpoints of `serving` that received no request, with zero counts, and
/// recomputes `load_imbalance` over them all: a run that sent every request to one of four
/// endpoints is 4.0, not the 1.0 its records alone say. `serving`: every endpoint that could
/// have been sent a request (a P/D fleet's prefill-only endpoints are not: their work is the
/// decode endpoints' requests). Endpoints are kept sorted by name.
pub fn count_idle_endpoints<S: AsRef<str>>(
    summary: &mut Summary,
    serving: impl IntoIterator<Item = S>,
) {
    let seen: HashSet<String> = summary
        .endpoints
        .iter()
        .map(|e| e.endpoint.clone())
        .collect();
    for name in serving {
        let name = name.as_ref();
        if !seen.contains(name) {
            summary.endpoints.push(EndpointShare {
                endpoint: name.to_owned(),
                ..EndpointShare::default()
            });
        }
    }
    summary
        .endpoints
        .sort_by(|a, b| a.endpoint.cmp(&b.endpoint));
    summary.load_imbalance = load_imbalance(&summary.endpoints);
}

/// The busiest endpoint's requests over the mean, over the named endpoints (or over the
/// [`UNKNOWN_ENDPOINT`] group when it is all there is); 1.0 for one endpoint or none.
fn load_imbalance(endpoints: &[EndpointShare]) -> f64 {
    let named: Vec<u64> = endpoints
        .iter()
        .filter(|e| e.endpoint != UNKNOWN_ENDPOINT)
        .map(|e| e.requests)
        .collect();
    let counts = if named.is_empty() {
        endpoints.iter().map(|e| e.requests).collect()
    } else {
        named
    };
    if counts.len() <= 1 {
        return 1.0;
    }
    let max = counts.iter().copied().max().unwrap_or(0) as f64;
    let mean = counts.iter().sum::<u64>() as f64 / counts.len() as f64;
    if mean > 0.0 { max / mean } else { 1.0 }
}

/// The summary of `errors` (measured less predicted seconds; values that are not finite
/// numbers are left out), `None` when none is left.
#[must_use]
pub fn prediction_error(errors: &[f64]) -> Option<PredictionError> {
    let mut sorted: Vec<f64> = errors.iter().copied().filter(|e| e.is_finite()).collect();
    if sorted.is_empty() {
        return None;
    }
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    let at = |q: f64| sorted[((q * n as f64).ceil() as usize).clamp(1, n) - 1];
    Some(PredictionError {
        count: n as u64,
        mean_s: sorted.iter().sum::<f64>() / n as f64,
        mean_abs_s: sorted.iter().map(|e| e.abs()).sum::<f64>() / n as f64,
        p10_s: at(0.10),
        p50_s: at(0.50),
        p90_s: at(0.90),
    })
}

/// One latency measure: an HDR histogram in microseconds plus an exact sum for the mean.
struct LatencyRecorder {
    histogram: Histogram<u64>,
    sum_s: f64,
}

impl LatencyRecorder {
    fn new() -> Self {
        Self {
            // Auto-resizing, so no sample is ever clamped; only fails for sigfig > 5.
            histogram: Histogram::new(SIGNIFICANT_DIGITS).expect("3 significant digits is valid"),
            sum_s: 0.0,
        }
    }

    /// Records a sample in seconds; skips non-finite values and counts negative ones as 0.
    fn record(&mut self, seconds: f64) {
        if !seconds.is_finite() {
            return;
        }
        let seconds = seconds.max(0.0);
        // `as` saturates, so absurdly large values land at u64::MAX.
        let micros = (seconds * MICROS_PER_S).round() as u64;
        if self.histogram.record(micros).is_err() {
            // Only a value too large to auto-resize for; keep the sample, clamped.
            self.histogram.saturating_record(micros);
        }
        self.sum_s += seconds;
    }

    fn percentiles(&self) -> Percentiles {
        let count = self.histogram.len();
        if count == 0 {
            return Percentiles::default();
        }
        let at = |q: f64| self.histogram.value_at_quantile(q) as f64 / MICROS_PER_S;
        Percentiles {
            p50: at(0.50),
            p90: at(0.90),
            p99: at(0.99),
            mean: self.sum_s / count as f64,
            count,
        }
    }
}

#[cfg(test)]
mod tests;
