//! Graceful shutdown: the router's phase, which the edge, the health endpoint and every
//! proxied stream watch.
//!
//! On [`Shutdown::drain`] the API listener stops accepting connections, open connections close
//! once their request is answered, and `/health` answers 503 so load balancers stop sending.
//! On [`Shutdown::close`] (the drain timeout, or a second signal) every stream still open ends
//! with an OpenAI-shaped SSE error event, and the engine connection behind it is closed so the
//! engine cancels.

use std::future::Future;

use tokio::sync::watch;

/// Where the router is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Phase {
    /// Accepting and serving.
    Serving,
    /// No new connections; in-flight requests finish.
    Draining,
    /// Open streams are being ended.
    Closing,
}

/// The router's phase, shared.
#[derive(Debug)]
pub struct Shutdown {
    phase: watch::Sender<Phase>,
}

impl Default for Shutdown {
    fn default() -> Self {
        Self {
            phase: watch::channel(Phase::Serving).0,
        }
    }
}

impl Shutdown {
    /// The phase now.
    pub fn phase(&self) -> Phase {
        *self.phase.borrow()
    }

    /// Whether the router is draining or closing.
    pub fn draining(&self) -> bool {
        self.phase() >= Phase::Draining
    }

    /// Stops accepting connections and fails readiness; in-flight requests go on.
    pub fn drain(&self) {
        self.advance(Phase::Draining);
    }

    /// Ends every open stream now.
    pub fn close(&self) {
        self.advance(Phase::Closing);
    }

    fn advance(&self, to: Phase) {
        self.phase.send_if_modified(|phase| {
            let later = *phase < to;
            if later {
                *phase = to;
            }
            later
        });
    }

    /// Resolves once the router reaches `phase` (or is dropped).
    pub fn reached(&self, phase: Phase) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = self.phase.subscribe();
        async move {
            let _ = rx.wait_for(|now| *now >= phase).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn phases_only_advance() {
        let s = Shutdown::default();
        let closing = s.reached(Phase::Closing);
        s.close();
        s.drain();
        assert_eq!(s.phase(), Phase::Closing);
        closing.await;
        s.reached(Phase::Draining).await;
    }
}
