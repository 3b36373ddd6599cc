//! Fault injection for reliability tests: lost and late events, slow or unhealthy engines,
//! engines that fail some requests while passing their health checks, degraded or failing KV
//! transfers between prefill and decode engines.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::SimError;

/// Faults in force on one engine.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct Faults {
    /// Fraction of event batches lost in transit (still in the replay buffer).
    pub drop_event_fraction: f64,
    /// Extra delay before each event batch is published.
    #[serde(rename = "event_delay_ms", with = "millis")]
    pub event_delay: Duration,
    /// Step time multiplier (2.0: twice as slow).
    pub slow_factor: f64,
    /// When false, `/health` answers 503 and requests are refused.
    pub healthy: bool,
    /// Fraction of generation requests answered `error_status` at once (before any body
    /// byte), while `/health` still passes.
    pub error_fraction: f64,
    /// The status of those answers (a 5xx).
    pub error_status: u16,
    /// P/D: this consumer's KV pulls run this many times slower than the link model says
    /// (a degraded link: RDMA silently fallen back to TCP, a congested switch).
    pub link_slowdown: f64,
    /// P/D: fraction of this consumer's KV pulls that fail after the transfer time (the
    /// `kv_load_failure_policy` then applies).
    pub kv_transfer_failure_fraction: f64,
    /// Extra delay before `/metrics` answers: a busy engine's API server, starved of CPU by
    /// its own forward passes, answers a scrape late.
    #[serde(rename = "metrics_delay_ms", with = "millis")]
    pub metrics_delay: Duration,
}

impl Default for Faults {
    fn default() -> Self {
        Self {
            drop_event_fraction: 0.0,
            event_delay: Duration::ZERO,
            slow_factor: 1.0,
            healthy: true,
            error_fraction: 0.0,
            error_status: 503,
            link_slowdown: 1.0,
            kv_transfer_failure_fraction: 0.0,
            metrics_delay: Duration::ZERO,
        }
    }
}

/// The slowest and fastest a fault may make an engine's steps: beyond these a step's wall time
/// is no longer a duration (or the engine would outrun its own clock).
pub const SLOW_FACTOR_RANGE: std::ops::RangeInclusive<f64> = 0.01..=10_000.0;

impl Faults {
    /// Checks the settings; an error names the first one out of range.
    pub fn validate(&self) -> Result<(), SimError> {
        self.out_of_range()
            .map_err(|why| SimError::Config(format!("faults: {why}")))
    }

    /// The first setting out of range, said.
    fn out_of_range(&self) -> Result<(), String> {
        let fraction = |name: &str, v: f64| {
            (0.0..=1.0)
                .contains(&v)
                .then_some(())
                .ok_or_else(|| format!("{name} must be within 0–1, not {v}"))
        };
        fraction("drop_event_fraction", self.drop_event_fraction)?;
        fraction("error_fraction", self.error_fraction)?;
        fraction(
            "kv_transfer_failure_fraction",
            self.kv_transfer_failure_fraction,
        )?;
        for (name, v) in [
            ("slow_factor", self.slow_factor),
            ("link_slowdown", self.link_slowdown),
        ] {
            if !SLOW_FACTOR_RANGE.contains(&v) {
                return Err(format!(
                    "{name} must be within {}–{}, not {v}",
                    SLOW_FACTOR_RANGE.start(),
                    SLOW_FACTOR_RANGE.end()
                ));
            }
        }
        if !(400..=599).contains(&self.error_status) {
            return Err(format!(
                "error_status must be an HTTP error (400–599), not {}",
                self.error_status
            ));
        }
        Ok(())
    }
}

mod millis {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_millis() as u64)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        Ok(Duration::from_millis(u64::deserialize(d)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_out_of_range_are_refused() {
        assert!(Faults::default().validate().is_ok());
        let bad = [
            Faults {
                slow_factor: f64::INFINITY,
                ..Faults::default()
            },
            Faults {
                slow_factor: f64::NAN,
                ..Faults::default()
            },
            Faults {
                slow_factor: 0.0,
                ..Faults::default()
            },
            Faults {
                link_slowdown: 1e300,
                ..Faults::default()
            },
            Faults {
                drop_event_fraction: 7.0,
                ..Faults::default()
            },
            Faults {
                error_fraction: -3.0,
                ..Faults::default()
            },
            Faults {
                kv_transfer_failure_fraction: f64::NAN,
                ..Faults::default()
            },
            Faults {
                error_status: 200,
                ..Faults::default()
            },
        ];
        for faults in bad {
            assert!(faults.validate().is_err(), "{faults:?}");
        }
    }
}
