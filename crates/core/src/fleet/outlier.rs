//! Passive outlier detection, the per-endpoint circuit breaker and the retry budget.
//!
//! Health checks ask an engine whether it is well every second or so; real requests say so
//! far more often. As Envoy does, consecutive failed requests to an endpoint (a 5xx before any
//! body byte, a refused connection, a timeout) eject it for a while, longer each time it is
//! ejected again (exponential, capped), and successes after its return forgive it. An ejected
//! endpoint is filtered like an unhealthy one, with its own reason. Ejection does not forget
//! the endpoint's cache: the engine kept it.
//!
//! Retries on another endpoint are bounded by a budget: at most a share of the requests of the
//! last window, with a floor so a quiet router can still retry, so that retries cannot
//! multiply the load of a struggling fleet.

use serde::{Deserialize, Serialize};

use super::decay::Decaying;

/// When requests' failures eject an endpoint, and how many requests one endpoint may hold.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OutlierPolicy {
    /// Whether failures eject endpoints at all.
    pub enabled: bool,
    /// Consecutive failed requests that eject an endpoint.
    pub consecutive_failures: u32,
    /// Seconds of the first ejection; each further one doubles it.
    pub base_ejection_s: f64,
    /// Longest ejection, seconds.
    pub max_ejection_s: f64,
    /// Most of the fleet's endpoints ejected at once (0–1; at least one may always be).
    pub max_ejected_fraction: f64,
    /// Circuit breaker: most requests in flight to one endpoint; beyond, it is skipped as if
    /// saturated.
    pub max_inflight: u32,
}

impl Default for OutlierPolicy {
    fn default() -> Self {
        Self {
            enabled: true,
            consecutive_failures: 5,
            base_ejection_s: 2.0,
            max_ejection_s: 60.0,
            max_ejected_fraction: 0.5,
            max_inflight: 4096,
        }
    }
}

/// How failed requests are retried on another endpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetryPolicy {
    /// Most attempts per request, the first included (1: never retry).
    pub max_attempts: u32,
    /// Retries allowed as a share of requests over the window.
    pub budget_ratio: f64,
    /// Retries per second always allowed, whatever the traffic.
    pub min_retries_per_s: f64,
    /// The window the budget is counted over, seconds (an exponential decay's time constant).
    pub window_s: f64,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 2,
            budget_ratio: 0.2,
            min_retries_per_s: 3.0,
            window_s: 10.0,
        }
    }
}

/// How one request to an endpoint went, as far as outlier detection cares.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum UpstreamOutcome {
    /// The engine answered without a server error.
    Success,
    /// A 5xx before any body byte, a refused connection or a timeout.
    Failure,
}

/// An ejection a failure caused.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Ejection {
    /// Seconds it lasts.
    pub seconds: f64,
    /// Its number for this endpoint since it was last forgiven (1 for the first).
    pub count: u32,
}

/// One endpoint's outlier state.
#[derive(Clone, Debug, Default)]
pub struct Outlier {
    consecutive_failures: u32,
    consecutive_successes: u32,
    ejections: u32,
    ejected_until: Option<f64>,
}

impl Outlier {
    /// Whether it is ejected at `now`.
    pub fn ejected(&self, now: f64) -> bool {
        self.ejected_until.is_some_and(|until| now < until)
    }

    /// When its ejection ends, if one is in force at `now`.
    pub fn ejected_until(&self, now: f64) -> Option<f64> {
        self.ejected_until.filter(|until| now < *until)
    }

    /// Applies one request's outcome; `may_eject`: the fleet's cap on ejected endpoints
    /// allows one more.
    pub(super) fn result(
        &mut self,
        outcome: UpstreamOutcome,
        policy: &OutlierPolicy,
        may_eject: bool,
        now: f64,
    ) -> Option<Ejection> {
        match outcome {
            UpstreamOutcome::Success => {
                self.consecutive_failures = 0;
                self.consecutive_successes = self.consecutive_successes.saturating_add(1);
                // As many successes in a row as failures eject: the endpoint is forgiven.
                if self.consecutive_successes >= policy.consecutive_failures.max(1) {
                    self.ejections = 0;
                }
                None
            }
            UpstreamOutcome::Failure => {
                self.consecutive_successes = 0;
                if !policy.enabled || self.ejected(now) {
                    return None;
                }
                self.consecutive_failures = self.consecutive_failures.saturating_add(1);
                if self.consecutive_failures < policy.consecutive_failures.max(1) || !may_eject {
                    return None;
                }
                let factor = 2f64.powi(self.ejections.min(30) as i32);
                let seconds = (policy.base_ejection_s * factor).min(policy.max_ejection_s);
                self.ejections = self.ejections.saturating_add(1);
                self.consecutive_failures = 0;
                self.ejected_until = Some(now + seconds);
                Some(Ejection {
                    seconds,
                    count: self.ejections,
                })
            }
        }
    }
}

/// The fleet-wide retry budget.
#[derive(Clone, Debug, Default)]
pub struct RetryBudget {
    requests: Decaying,
    retries: Decaying,
}

impl RetryBudget {
    /// Counts one request (an attempt that reached an engine or tried to).
    pub(super) fn request(&mut self, policy: &RetryPolicy, now: f64) {
        self.requests.add(now, policy.window_s);
    }

    /// Takes one retry from the budget, or says it is spent.
    pub(super) fn try_retry(&mut self, policy: &RetryPolicy, now: f64) -> bool {
        let tau = policy.window_s;
        let allowed =
            (policy.budget_ratio * self.requests.at(now, tau)).max(policy.min_retries_per_s * tau);
        if self.retries.at(now, tau) >= allowed {
            return false;
        }
        self.retries.add(now, tau);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> OutlierPolicy {
        OutlierPolicy {
            consecutive_failures: 3,
            base_ejection_s: 1.0,
            max_ejection_s: 4.0,
            ..OutlierPolicy::default()
        }
    }

    fn fail(o: &mut Outlier, n: u32, now: f64) -> Option<Ejection> {
        (0..n)
            .filter_map(|_| o.result(UpstreamOutcome::Failure, &policy(), true, now))
            .last()
    }

    #[test]
    fn consecutive_failures_eject_with_exponential_capped_backoff() {
        let mut o = Outlier::default();
        assert_eq!(fail(&mut o, 2, 0.0), None);
        assert!(!o.ejected(0.0));
        let e = fail(&mut o, 1, 0.0).unwrap();
        assert_eq!((e.seconds, e.count), (1.0, 1));
        assert!(o.ejected(0.5));
        assert!(!o.ejected(1.0));
        // Failures while ejected do not count.
        assert_eq!(fail(&mut o, 5, 0.5), None);
        assert_eq!(fail(&mut o, 3, 1.0).unwrap().seconds, 2.0);
        assert_eq!(fail(&mut o, 3, 3.0).unwrap().seconds, 4.0);
        assert_eq!(fail(&mut o, 3, 7.0).unwrap().seconds, 4.0, "capped");
        assert_eq!(o.ejected_until(8.0), Some(11.0));
    }

    #[test]
    fn a_success_resets_the_count_and_enough_of_them_forgive() {
        let mut o = Outlier::default();
        fail(&mut o, 2, 0.0);
        o.result(UpstreamOutcome::Success, &policy(), true, 0.0);
        assert_eq!(fail(&mut o, 2, 0.0), None, "the run was broken");
        assert_eq!(fail(&mut o, 1, 0.0).unwrap().count, 1);
        for _ in 0..3 {
            o.result(UpstreamOutcome::Success, &policy(), true, 2.0);
        }
        assert_eq!(fail(&mut o, 3, 2.0).unwrap().seconds, 1.0, "forgiven");
    }

    #[test]
    fn disabled_or_capped_never_ejects() {
        let mut o = Outlier::default();
        let off = OutlierPolicy {
            enabled: false,
            ..policy()
        };
        for _ in 0..10 {
            assert_eq!(o.result(UpstreamOutcome::Failure, &off, true, 0.0), None);
            assert_eq!(
                o.result(UpstreamOutcome::Failure, &policy(), false, 0.0),
                None
            );
        }
        assert!(!o.ejected(0.0));
    }

    #[test]
    fn the_retry_budget_is_a_share_of_requests_with_a_floor() {
        let p = RetryPolicy {
            budget_ratio: 0.2,
            min_retries_per_s: 0.1,
            window_s: 10.0,
            ..RetryPolicy::default()
        };
        let mut b = RetryBudget::default();
        // The floor: 0.1/s over 10 s is one retry.
        assert!(b.try_retry(&p, 0.0));
        assert!(!b.try_retry(&p, 0.0));
        let mut b = RetryBudget::default();
        for _ in 0..100 {
            b.request(&p, 0.0);
        }
        let granted = (0..100).filter(|_| b.try_retry(&p, 0.0)).count();
        assert_eq!(granted, 20);
        // The window decays: a minute later the budget is back to its floor, then refills.
        assert!(b.try_retry(&p, 60.0));
        assert!(!b.try_retry(&p, 60.0));
    }
}
