//! Whether an endpoint's KV events may be trusted right now: never silently wrong.
//!
//! An index is distrusted while events were lost for good recently, while requests that should
//! have produced events got none for too long, or while the engine's reported cached tokens
//! drift from the router's predictions. Time is passed in.

use serde::{Deserialize, Serialize};

/// Why an endpoint's index is not trusted now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Distrust {
    /// It has no events configured.
    NoEvents,
    /// Requests that should have produced events went there but none arrived for too long.
    Silent,
    /// Events were lost for good recently.
    LostEvents,
    /// Predicted and reported cached tokens disagree.
    PredictionError,
}

/// The thresholds of distrust.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrustPolicy {
    /// Seconds without events, after a request that should have produced one, before an
    /// endpoint's index is distrusted.
    pub silent_after_s: f64,
    /// Seconds an index stays distrusted after events were lost for good; and after its last
    /// judgement when its predictions erred, before it is read again on probation.
    pub distrust_after_gap_s: f64,
    /// Mean |predicted − reported| cached tokens, as a share of the prompt, above which an
    /// index is distrusted.
    pub max_prediction_error: f64,
    /// Predictions compared before the error can distrust an index.
    pub min_samples: u32,
}

impl Default for TrustPolicy {
    fn default() -> Self {
        Self {
            silent_after_s: 30.0,
            distrust_after_gap_s: 60.0,
            max_prediction_error: 0.2,
            min_samples: 5,
        }
    }
}

/// One endpoint's trust state.
#[derive(Debug, Clone, Default)]
pub struct Trust {
    has_events: bool,
    last_event: Option<f64>,
    /// The first request sent since the last event that should have produced an event.
    unanswered_since: Option<f64>,
    last_unfilled_gap: Option<f64>,
    /// Exponentially weighted mean of |predicted − reported| / prompt tokens.
    error_ewma: f64,
    samples: u32,
    /// When the last prediction was judged.
    last_judged: Option<f64>,
}

impl Trust {
    /// The state of an endpoint with (or without) events configured.
    pub fn new(has_events: bool) -> Self {
        Self {
            has_events,
            ..Self::default()
        }
    }

    /// Whether its index may be used at `now`, or why not.
    pub fn verdict(&self, policy: &TrustPolicy, now: f64) -> Result<(), Distrust> {
        if !self.has_events {
            Err(Distrust::NoEvents)
        } else if self
            .last_unfilled_gap
            .is_some_and(|t| now - t < policy.distrust_after_gap_s)
        {
            Err(Distrust::LostEvents)
        } else if self
            .unanswered_since
            .is_some_and(|t| now - t > policy.silent_after_s)
        {
            Err(Distrust::Silent)
        } else if self.prediction_failed(policy, now) {
            Err(Distrust::PredictionError)
        } else {
            Ok(())
        }
    }

    /// A request went there; `expects_event`: it stores at least one new full block, so the
    /// engine will publish something.
    pub fn dispatched(&mut self, expects_event: bool, now: f64) {
        if expects_event && self.unanswered_since.is_none() {
            self.unanswered_since = Some(now);
        }
    }

    /// Events arrived.
    pub fn events(&mut self, now: f64) {
        self.last_event = Some(now);
        self.unanswered_since = None;
    }

    /// Events were lost for good.
    pub fn lost(&mut self, now: f64) {
        self.last_unfilled_gap = Some(now);
    }

    /// The engine restarted or the endpoint was forgotten: the prediction record starts over.
    pub fn reset(&mut self) {
        *self = Self::new(self.has_events);
    }

    /// Whether the index's predictions erred too much, lately. A distrusted index is not read, so
    /// it is judged no more: after `distrust_after_gap_s` without a judgement it is read again,
    /// on probation, and judged afresh.
    fn prediction_failed(&self, policy: &TrustPolicy, now: f64) -> bool {
        self.erred(policy)
            && self
                .last_judged
                .is_some_and(|t| now - t < policy.distrust_after_gap_s)
    }

    /// Whether its record says its predictions err too much (enough of them, and too far off).
    fn erred(&self, policy: &TrustPolicy) -> bool {
        self.samples >= policy.min_samples && self.error_ewma > policy.max_prediction_error
    }

    /// The engine reported `reported` cached tokens where the router, reading the index,
    /// predicted `predicted`; at `now`. An index back on probation starts a new record.
    pub fn prediction(
        &mut self,
        predicted: usize,
        reported: usize,
        prompt: usize,
        policy: &TrustPolicy,
        now: f64,
    ) {
        let on_probation = self.erred(policy) && !self.prediction_failed(policy, now);
        if on_probation {
            self.samples = 0;
        }
        self.last_judged = Some(now);
        let error = predicted.abs_diff(reported) as f64 / prompt.max(1) as f64;
        self.error_ewma = if self.samples == 0 {
            error
        } else {
            0.8 * self.error_ewma + 0.2 * error
        };
        self.samples = self.samples.saturating_add(1);
    }

    /// Seconds since the last event, if any.
    pub fn events_age(&self, now: f64) -> Option<f64> {
        self.last_event.map(|t| (now - t).max(0.0))
    }
}
