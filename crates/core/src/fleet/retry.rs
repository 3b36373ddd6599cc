//! Retry eligibility: which failed attempts are tried again on the next endpoint of the plan,
//! and how many attempts a request gets. Only a failure before anything reached the client and
//! before the engine could have started work is retried (a refused connection, a 5xx before
//! any body byte); a timeout or a broken exchange is not, as the engine may still be working
//! on it. Each retry takes one from the fleet's budget ([`super::RetryPolicy`]).

use super::{Fleet, RetryPolicy};

/// How one attempt to send a request to an engine failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttemptFailure {
    /// No connection could be made.
    Connect,
    /// The engine answered 5xx before any body byte.
    ServerError,
    /// The engine did not answer in time.
    Timeout,
    /// The exchange broke after the request was sent.
    Transport,
}

impl AttemptFailure {
    /// Whether another endpoint may be tried after it.
    pub fn retryable(self) -> bool {
        matches!(self, AttemptFailure::Connect | AttemptFailure::ServerError)
    }

    /// The label used in metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            AttemptFailure::Connect => "connect",
            AttemptFailure::ServerError => "5xx",
            AttemptFailure::Timeout => "timeout",
            AttemptFailure::Transport => "transport",
        }
    }
}

/// Whether a failed attempt is retried on the next endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RetryVerdict {
    /// Try the next endpoint (one retry was taken from the budget).
    Retry,
    /// Retryable, but the fleet's retry budget is spent.
    BudgetSpent,
    /// This failure is never retried.
    NotRetryable,
    /// It was the request's last attempt.
    LastAttempt,
}

impl RetryPolicy {
    /// How many endpoints of a ranking of `ranking_len` a request may be tried on.
    pub fn attempts(&self, ranking_len: usize) -> usize {
        (self.max_attempts.max(1) as usize).min(ranking_len)
    }
}

impl Fleet {
    /// Decides at `now` whether attempt `attempt` (0-based) of `attempts`, which failed with
    /// `failure`, is retried on the next endpoint; a retry is taken from the budget.
    pub fn retry_verdict(
        &mut self,
        failure: AttemptFailure,
        attempt: usize,
        attempts: usize,
        now: f64,
    ) -> RetryVerdict {
        if !failure.retryable() {
            RetryVerdict::NotRetryable
        } else if attempt + 1 >= attempts {
            RetryVerdict::LastAttempt
        } else if self.try_retry(now) {
            RetryVerdict::Retry
        } else {
            RetryVerdict::BudgetSpent
        }
    }
}
