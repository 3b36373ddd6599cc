//! The time to first token of an endpoint's uncontended requests that loaded nothing, as a
//! line over their uncached tokens ([`FirstTokenFit`]): what a request that loads from a tier
//! would have taken without its loads, so that the rest of its time is the tiers' load time.

use serde::Serialize;

/// Time to first token as a line over uncached prompt tokens, `fixed + per_token × tokens`,
/// fitted (least squares, exponentially weighted) to an endpoint's uncontended requests that
/// loaded nothing. The fixed part is what every request pays whatever its size (a step's fixed
/// cost, the decodes batched with it); a request that loads from a tier pays it too, so a
/// tier's load time is its time to first token less this line, not less its tokens at the
/// average prefill rate (which spreads the fixed part over typical prompt sizes and would
/// leave most of it to a request with few uncached tokens, pricing the tier far too slow).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct FirstTokenFit {
    weight: f64,
    sum_tokens: f64,
    sum_seconds: f64,
    sum_tokens_sq: f64,
    sum_tokens_seconds: f64,
    /// Samples taken so far (what places a sample for [`FirstTokenFit::correct`]).
    #[serde(skip)]
    samples: u64,
}

/// A sample [`FirstTokenFit::observe`] took, kept with its request until the engine says how
/// many tokens it computed ([`FirstTokenFit::correct`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FitSample {
    /// The fit's samples taken before it.
    index: u64,
    /// The uncached tokens it assumed, and the seconds to the first token.
    tokens: f64,
    seconds: f64,
}

/// Weight of a new sample in [`FirstTokenFit`] (an exponential forgetting factor of 0.95: the
/// fit follows the endpoint's load over the last few dozen samples).
const FIT_FORGET: f64 = 0.95;
/// Samples before the fit is used.
const FIT_MIN_WEIGHT: f64 = 4.0;

impl FirstTokenFit {
    /// One uncontended request with `tokens` uncached tokens and nothing loaded, first token
    /// after `seconds`. Returns the sample taken, for [`FirstTokenFit::correct`].
    pub fn observe(&mut self, tokens: f64, seconds: f64) -> Option<FitSample> {
        if !tokens.is_finite() || !seconds.is_finite() || tokens < 0.0 || seconds <= 0.0 {
            return None;
        }
        self.weight = self.weight * FIT_FORGET + 1.0;
        self.sum_tokens = self.sum_tokens * FIT_FORGET + tokens;
        self.sum_seconds = self.sum_seconds * FIT_FORGET + seconds;
        self.sum_tokens_sq = self.sum_tokens_sq * FIT_FORGET + tokens * tokens;
        self.sum_tokens_seconds = self.sum_tokens_seconds * FIT_FORGET + tokens * seconds;
        let index = self.samples;
        self.samples += 1;
        Some(FitSample {
            index,
            tokens,
            seconds,
        })
    }

    /// The request that gave `sample` computed `computed` tokens by the engine's count (the
    /// router predicted `sample`'s): the sample is replaced by the right one. Each sum holds
    /// every sample times the forgetting factor to the power of the samples since, so the
    /// replacement is exact whatever came between.
    pub fn correct(&mut self, sample: FitSample, computed: f64) {
        if !computed.is_finite() || computed < 0.0 || computed == sample.tokens {
            return;
        }
        let since = self.samples.saturating_sub(sample.index + 1);
        let kept = FIT_FORGET.powi(since.min(10_000) as i32);
        let (old, new) = (sample.tokens, computed);
        self.sum_tokens += kept * (new - old);
        self.sum_tokens_sq += kept * (new * new - old * old);
        self.sum_tokens_seconds += kept * sample.seconds * (new - old);
    }

    /// `(fixed seconds, seconds per token)`, once the samples span enough sizes to tell them
    /// apart (a spread of at least 10% of the mean size) and the line is physical (a positive
    /// slope, a fixed part not below 0).
    pub fn line(&self) -> Option<(f64, f64)> {
        if self.weight < FIT_MIN_WEIGHT {
            return None;
        }
        let mean_tokens = self.sum_tokens / self.weight;
        let mean_seconds = self.sum_seconds / self.weight;
        let variance = self.sum_tokens_sq / self.weight - mean_tokens * mean_tokens;
        if variance <= (0.1 * mean_tokens).powi(2) {
            return None;
        }
        let covariance = self.sum_tokens_seconds / self.weight - mean_tokens * mean_seconds;
        let per_token = covariance / variance;
        if !per_token.is_finite() || per_token <= 0.0 {
            return None;
        }
        let fixed = (mean_seconds - per_token * mean_tokens).max(0.0);
        Some((fixed, per_token))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_token_line_recovers_its_fixed_part_and_slope() {
        let mut fit = FirstTokenFit::default();
        for tokens in [300.0, 900.0, 1_500.0] {
            fit.observe(tokens, 0.03 + tokens * 32e-6);
        }
        assert_eq!(fit.line(), None, "too few samples");
        for i in 0..20 {
            let tokens = 200.0 + 100.0 * f64::from(i);
            fit.observe(tokens, 0.03 + tokens * 32e-6);
        }
        let (fixed, per_token) = fit.line().unwrap();
        assert!((fixed - 0.03).abs() < 1e-6, "{fixed}");
        assert!((per_token - 32e-6).abs() < 1e-9, "{per_token}");
        // One size only: the fixed part and the slope cannot be told apart.
        let mut same = FirstTokenFit::default();
        for _ in 0..20 {
            same.observe(500.0, 0.05);
        }
        assert_eq!(same.line(), None);
        same.observe(f64::NAN, 1.0);
        same.observe(10.0, -1.0);
        assert_eq!(same.line(), None, "bad samples are ignored");
    }

    #[test]
    fn a_line_sample_corrected_at_the_end_is_the_sample_taken_right() {
        // Thirty uncontended requests on the line 30 ms + 32 us/token; the sixth was predicted
        // to compute 1,500 tokens where the engine had 1,400 cached: it took 33.2 ms.
        let line = |tokens: f64| 0.03 + tokens * 32e-6;
        let (mut wrong, mut right) = (FirstTokenFit::default(), FirstTokenFit::default());
        let mut taken = None;
        for i in 0..30 {
            let tokens = 200.0 + 100.0 * f64::from(i);
            if i == 5 {
                taken = wrong.observe(1_500.0, line(100.0));
                right.observe(100.0, line(100.0));
            } else {
                wrong.observe(tokens, line(tokens));
                right.observe(tokens, line(tokens));
            }
        }
        let (fixed, per_token) = wrong.line().unwrap();
        assert!(
            (fixed - 0.03).abs() > 1e-4,
            "the wrong sample bends the line: {fixed}"
        );
        wrong.correct(taken.unwrap(), 100.0);
        let ((fixed, per_token_right), (f2, p2)) = (wrong.line().unwrap(), right.line().unwrap());
        assert!((fixed - f2).abs() < 1e-9, "{fixed} against {f2}");
        assert!(
            (per_token_right - p2).abs() < 1e-12,
            "{per_token_right} against {p2}"
        );
        assert!((fixed - 0.03).abs() < 1e-6 && (per_token_right - 32e-6).abs() < 1e-9);
        assert_ne!(per_token, per_token_right);
    }
}
