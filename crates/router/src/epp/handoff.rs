//! The response path without a wait. Envoy waits for the picker's answer to every message of an
//! ext_proc stream; on the response path that wait would delay the first token and every chunk
//! after it. So the default gateway configuration (`examples/envoy-epp.yaml`) follows the
//! response with a second ext_proc filter in `observability_mode`, whose messages Envoy sends
//! without waiting. The two streams meet here: the routing stream leaves the request's
//! accounting under a token it names in a request header ([`super::protocol::EXCHANGE`]), and
//! the observer stream, which sees that header, claims it. An entry lives from the routing
//! answer until it is claimed, or until its routing stream ends. Then it waits [`CLAIM_GRACE`]
//! for an observer that may be a moment behind, if one could still come: when this gateway runs
//! the observer filter (some observer stream has claimed a request before), or when the routing
//! stream ended before its response began. A gateway without the observer filter thus gets its
//! load back when the routing stream ends, as before. There are never more entries than streams
//! opened in the last few seconds. Unclaimed, the accounting is handed back as unfinished
//! (`client_closed`), as when a gateway sends the picker no response at all.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

use crate::accounting::Accounting;

/// How long after its routing stream ended a request's accounting may still be claimed. The
/// observer's request headers leave Envoy as the request goes upstream, before the routing
/// stream can end, so this only covers a picker too busy to read them at once.
pub const CLAIM_GRACE: Duration = Duration::from_secs(2);

/// A routed request's accounting, shared by the stream that routed it and the observer stream
/// that claimed it; whichever sees the end of the response takes it out (and so hands the load
/// back), and dropping the last share of one never taken hands it back as unfinished.
pub type Followed = Arc<Mutex<Option<Accounting>>>;

/// The accounting of routed requests not yet claimed by an observer stream, by token.
#[derive(Default)]
pub struct Handoffs {
    waiting: Mutex<HashMap<u64, Followed>>,
    /// An observer stream has claimed a request: the gateway runs the observer filter.
    observed: AtomicBool,
}

impl Handoffs {
    /// Leaves `followed` to be claimed; the token, as the header names it.
    pub fn offer(&self, followed: &Followed) -> (u64, String) {
        let mut waiting = self.waiting.lock();
        // Random rather than counted: a token cannot be guessed from another request's.
        let token = loop {
            let token = rand::random::<u64>();
            if !waiting.contains_key(&token) {
                break token;
            }
        };
        waiting.insert(token, followed.clone());
        (token, format!("{token:016x}"))
    }

    /// The accounting left under `token` (as the header names it), once.
    pub fn claim(&self, token: &str) -> Option<Followed> {
        let token = u64::from_str_radix(token.trim(), 16).ok()?;
        let claimed = self.waiting.lock().remove(&token)?;
        self.observed.store(true, Ordering::Relaxed);
        Some(claimed)
    }

    /// Whether an observer stream ever claimed a request (the gateway runs the observer filter).
    pub fn observed(&self) -> bool {
        self.observed.load(Ordering::Relaxed)
    }

    /// The routing stream ended: what it left unclaimed is no longer offered.
    pub fn withdraw(&self, token: u64) {
        let removed = self.waiting.lock().remove(&token);
        drop(removed);
    }

    /// Entries waiting to be claimed.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.waiting.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_offer_is_claimed_once_by_its_token_and_withdrawn_with_its_stream() {
        let handoffs = Handoffs::default();
        let followed: Followed = Arc::new(Mutex::new(None));
        let (token, header) = handoffs.offer(&followed);
        assert!(!handoffs.observed());
        assert_eq!(header.len(), 16);
        assert!(handoffs.claim("not hex").is_none());
        assert!(handoffs.claim(&format!("{:016x}", token ^ 1)).is_none());
        let claimed = handoffs.claim(&header).expect("claimed by its token");
        assert!(Arc::ptr_eq(&claimed, &followed));
        assert!(
            handoffs.observed(),
            "a claim shows the gateway runs observers"
        );
        assert!(handoffs.claim(&header).is_none(), "claimed once");

        let (token, header) = handoffs.offer(&followed);
        handoffs.withdraw(token);
        assert!(handoffs.claim(&header).is_none());
        assert_eq!(handoffs.len(), 0);
    }
}
