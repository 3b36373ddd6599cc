//! The warm-up verdict of a starting replica: warm once every endpoint's events caught up, or,
//! past the warm-up timeout, ready anyway with the endpoints not caught up untrusted (routed by
//! load only until their events are trusted again).

use super::Fleet;
use crate::index::EndpointId;

/// Where a replica's warm-up stands at one check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WarmVerdict {
    /// Every endpoint's events caught up: ready.
    Warm,
    /// Some are behind and there is time left: keep waiting.
    Warming,
    /// The timeout passed first: ready, the endpoints behind are now distrusted.
    TimedOut,
}

impl Fleet {
    /// Decides the warm-up at `now`, `elapsed_s` after it began, with `behind` the present
    /// endpoints whose events have not caught up; on a timeout their events count as lost.
    pub fn warm_verdict(
        &mut self,
        behind: &[EndpointId],
        elapsed_s: f64,
        timeout_s: f64,
        now: f64,
    ) -> WarmVerdict {
        if behind.is_empty() {
            return WarmVerdict::Warm;
        }
        if elapsed_s < timeout_s {
            return WarmVerdict::Warming;
        }
        for &id in behind {
            self.events_lost(id, now);
        }
        WarmVerdict::TimedOut
    }
}
