//! Prefill/decode disaggregation in virtual time: the link between engines (kvroute-sim's
//! [`Fabric`], the model the live simulator runs) and the transfers in flight on it. The run
//! drives the legs: a prefill leg of one token on the prefill engine, whose blocks stay held;
//! then the pull of the blocks the decode engine lacks; then the request on the decode engine,
//! with the pulled blocks as a prefix hit.

use std::collections::HashMap;

use kvroute_sim::link::{Fabric, TransferId};

use crate::config::PdFleet;

/// A transfer in flight: the request, its bytes, when it started, and the decode engine's
/// prefix (blocks) before and after it.
#[derive(Clone, Copy, Debug)]
pub struct Pull {
    /// Run-wide request index.
    pub request: usize,
    /// Bytes moved.
    pub bytes: u64,
    /// Virtual time it started.
    pub started: f64,
    /// Blocks the decode engine held.
    pub from: usize,
    /// Blocks it holds after the pull.
    pub blocks: usize,
}

/// The fleet's links and the pulls on them.
pub struct Link {
    fabric: Fabric,
    pulls: HashMap<TransferId, Pull>,
    /// When a [`crate::queue::Event::Link`] is already scheduled.
    wake: Option<f64>,
    /// KV bytes per token.
    pub kv_bytes_per_token: u64,
}

impl Link {
    /// Idle links as `pd` describes them.
    pub fn new(pd: &PdFleet) -> Self {
        Self {
            fabric: Fabric::new(pd.link),
            pulls: HashMap::new(),
            wake: None,
            kv_bytes_per_token: pd.kv_bytes_per_token,
        }
    }

    /// Starts `pull` from engine `prefill` to engine `decode` at `now`.
    pub fn start(&mut self, now: f64, prefill: usize, decode: usize, pull: Pull) {
        let id = self.fabric.start(
            now,
            &format!("engine-{prefill}"),
            &format!("engine-{decode}"),
            pull.bytes,
            1.0,
        );
        self.pulls.insert(id, pull);
    }

    /// The pulls finished by `now`, in order.
    pub fn advance(&mut self, now: f64) -> Vec<Pull> {
        self.fabric
            .advance(now)
            .into_iter()
            .filter_map(|id| self.pulls.remove(&id))
            .collect()
    }

    /// The time of the next link event to schedule, if none is scheduled before it; handling
    /// an event at `now` clears the schedule first.
    pub fn next_wake(&mut self, handled: Option<f64>) -> Option<f64> {
        if handled.is_some() && handled == self.wake {
            self.wake = None;
        }
        let next = self.fabric.next_event()?;
        if self.wake.is_some_and(|w| w <= next) {
            return None;
        }
        self.wake = Some(next);
        Some(next)
    }
}
