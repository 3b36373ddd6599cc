//! What a replica notes beside its KV index so that it can hand the index to a starting peer:
//! where each endpoint's event stream stands (the sequence number of the last batch applied).
//! The blocks themselves come from the index ([`KvIndex::endpoint_blocks`]); a snapshot pairs
//! the two, read under the endpoint's ingest lock that its event batches are applied under, so
//! they agree.
//!
//! (It used to keep every block's parent hash and tokens too, 150–250 B per entry, to export
//! the index as events: the index's own read and restore replaced that.)
//!
//! [`KvIndex::endpoint_blocks`]: kvroute_core::index::KvIndex::endpoint_blocks

use std::collections::HashMap;

use kvroute_core::index::EndpointId;

/// Every endpoint's position in its event stream.
#[derive(Debug, Default)]
pub struct Journal {
    applied: HashMap<EndpointId, u64>,
}

impl Journal {
    /// Notes that `endpoint`'s batch `seq` was applied (call under the endpoint's ingest lock,
    /// right after the index applied it).
    pub fn apply(&mut self, endpoint: EndpointId, seq: u64) {
        self.applied.insert(endpoint, seq);
    }

    /// Forgets an endpoint (its engine restarted, or it left: its sequence starts again).
    pub fn clear(&mut self, endpoint: EndpointId) {
        self.applied.remove(&endpoint);
    }

    /// The last batch applied for `endpoint` (`None`: none since start or its engine's restart).
    pub fn seq(&self, endpoint: EndpointId) -> Option<u64> {
        self.applied.get(&endpoint).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_position_is_the_last_batch_until_the_endpoint_is_forgotten() {
        let mut journal = Journal::default();
        let e = EndpointId(3);
        assert_eq!(journal.seq(e), None);
        journal.apply(e, 7);
        journal.apply(e, 8);
        assert_eq!(journal.seq(e), Some(8));
        journal.clear(e);
        assert_eq!(
            journal.seq(e),
            None,
            "a restarted engine's sequence starts again"
        );
    }
}
