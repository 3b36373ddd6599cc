//! A producer's holds on finished prefill legs' blocks: named by the request id the consumer
//! will present, bounded by a deadline (the release's abort timeout or heartbeat lease), and
//! dropped together when the engine restarts.

use std::collections::HashMap;
use std::time::Duration;

use tokio::time::Instant;

use crate::engine::{HeldBlocks, RequestId};

/// Why a pull was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseRefusal {
    /// No hold under that name: never made, already pulled, expired, or the producer restarted.
    Unknown(String),
    /// A block id the hold does not contain.
    ForeignBlock(u64),
}

impl std::fmt::Display for LeaseRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LeaseRefusal::Unknown(name) => write!(
                f,
                "no blocks are held for request {name:?} (never prefilled here, already pulled, expired, or the producer restarted)"
            ),
            LeaseRefusal::ForeignBlock(id) => {
                write!(f, "block {id} is not held for this request")
            }
        }
    }
}

#[derive(Debug)]
struct Lease {
    name: String,
    held: HeldBlocks,
    deadline: Instant,
}

/// The holds of one producer engine.
#[derive(Debug)]
pub struct LeaseTable {
    /// How long a hold lasts without a pull (wall time: already divided by the time scale).
    duration: Duration,
    by_name: HashMap<String, RequestId>,
    leases: HashMap<RequestId, Lease>,
    /// Changes each time the engine restarts (`remote_registration_generation`).
    generation: u64,
    /// Holds that expired unpulled, since start.
    expired_total: u64,
}

impl LeaseTable {
    /// An empty table whose holds last `duration` of wall time.
    pub fn new(duration: Duration) -> Self {
        Self {
            duration,
            by_name: HashMap::new(),
            leases: HashMap::new(),
            generation: 0,
            expired_total: 0,
        }
    }

    /// How long a hold lasts without a pull.
    pub fn duration(&self) -> Duration {
        self.duration
    }

    /// The engine's registration generation.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// When a hold made or renewed at `now` expires (a lease too long for the clock never
    /// does).
    fn deadline(&self, now: Instant) -> Instant {
        now.checked_add(self.duration)
            .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 86_400))
    }

    /// Holds in force.
    pub fn len(&self) -> usize {
        self.leases.len()
    }

    /// Whether no hold is in force.
    pub fn is_empty(&self) -> bool {
        self.leases.is_empty()
    }

    /// Whether request `id`'s blocks are held for a consumer.
    pub fn holds(&self, id: RequestId) -> bool {
        self.leases.contains_key(&id)
    }

    /// Holds that expired unpulled, since start.
    pub fn expired_total(&self) -> u64 {
        self.expired_total
    }

    /// Holds `held` for request `id` under `name` until `now` + the lease duration.
    pub fn hold(&mut self, id: RequestId, name: String, held: HeldBlocks, now: Instant) {
        if self.by_name.insert(name.clone(), id).is_some() {
            // A reused request name: the newer hold wins the name; the older one still expires.
            tracing::warn!(name, "a prefill leg reused the request id of a held one");
        }
        self.leases.insert(
            id,
            Lease {
                name,
                held,
                deadline: self.deadline(now),
            },
        );
    }

    /// A consumer starts pulling `block_ids` of the hold `name`: their hashes, in order; the
    /// hold is renewed for the transfer (a heartbeat).
    pub fn begin_pull(
        &mut self,
        name: &str,
        block_ids: &[u64],
        now: Instant,
    ) -> Result<Vec<u64>, LeaseRefusal> {
        let renewed = self.deadline(now);
        let lease = self
            .by_name
            .get(name)
            .and_then(|id| self.leases.get_mut(id))
            .ok_or_else(|| LeaseRefusal::Unknown(name.to_owned()))?;
        // A pull names at most the blocks held (checked before any lookup: the lock is held).
        if let Some(&extra) = block_ids.get(lease.held.block_ids.len()) {
            return Err(LeaseRefusal::ForeignBlock(extra));
        }
        let position: HashMap<u64, usize> = lease
            .held
            .block_ids
            .iter()
            .enumerate()
            .map(|(i, &h)| (u64::from(h), i))
            .collect();
        let hashes = block_ids
            .iter()
            .map(|&b| {
                position
                    .get(&b)
                    .map(|&i| lease.held.hashes[i])
                    .ok_or(LeaseRefusal::ForeignBlock(b))
            })
            .collect::<Result<Vec<u64>, _>>()?;
        lease.deadline = lease.deadline.max(renewed);
        Ok(hashes)
    }

    /// The consumer is done with hold `name`: removed; its request, to release in the engine.
    pub fn finish_pull(&mut self, name: &str) -> Result<RequestId, LeaseRefusal> {
        let id = self
            .by_name
            .remove(name)
            .ok_or_else(|| LeaseRefusal::Unknown(name.to_owned()))?;
        self.leases.remove(&id);
        Ok(id)
    }

    /// Removes the holds past their deadline; their requests, to release in the engine.
    pub fn expire(&mut self, now: Instant) -> Vec<RequestId> {
        let expired: Vec<RequestId> = self
            .leases
            .iter()
            .filter(|(_, l)| l.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in &expired {
            if let Some(lease) = self.leases.remove(id)
                && self.by_name.get(&lease.name) == Some(id)
            {
                self.by_name.remove(&lease.name);
            }
        }
        self.expired_total += expired.len() as u64;
        expired
    }

    /// The earliest deadline, if any hold is in force.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.leases.values().map(|l| l.deadline).min()
    }

    /// The engine restarted: every hold is gone, and the generation changes.
    pub fn clear(&mut self) {
        self.by_name.clear();
        self.leases.clear();
        self.generation += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held() -> HeldBlocks {
        HeldBlocks {
            block_ids: vec![7, 8, 9],
            hashes: vec![70, 80, 90],
        }
    }

    #[test]
    fn a_pull_reads_named_blocks_renews_and_releases() {
        let t0 = Instant::now();
        let mut table = LeaseTable::new(Duration::from_secs(30));
        table.hold(1, "cmpl-a".into(), held(), t0);
        assert_eq!(
            table.begin_pull("cmpl-a", &[8, 9], t0).unwrap(),
            vec![80, 90]
        );
        assert_eq!(
            table.begin_pull("cmpl-a", &[3], t0),
            Err(LeaseRefusal::ForeignBlock(3))
        );
        // More ids than the hold has are refused before any lookup.
        assert_eq!(
            table.begin_pull("cmpl-a", &[7, 8, 9, 7], t0),
            Err(LeaseRefusal::ForeignBlock(7))
        );
        assert!(matches!(
            table.begin_pull("cmpl-b", &[], t0),
            Err(LeaseRefusal::Unknown(_))
        ));
        // Renewed at 20 s: still held at 40 s.
        table
            .begin_pull("cmpl-a", &[], t0 + Duration::from_secs(20))
            .unwrap();
        assert!(table.expire(t0 + Duration::from_secs(40)).is_empty());
        assert_eq!(table.finish_pull("cmpl-a"), Ok(1));
        assert!(table.is_empty());
        assert!(table.finish_pull("cmpl-a").is_err(), "released once");
    }

    #[test]
    fn unpulled_holds_expire_and_a_restart_drops_all() {
        let t0 = Instant::now();
        let mut table = LeaseTable::new(Duration::from_secs(30));
        table.hold(1, "a".into(), held(), t0);
        table.hold(2, "b".into(), held(), t0 + Duration::from_secs(10));
        assert_eq!(table.next_deadline(), Some(t0 + Duration::from_secs(30)));
        assert_eq!(table.expire(t0 + Duration::from_secs(30)), vec![1]);
        assert_eq!(table.expired_total(), 1);
        assert!(table.begin_pull("a", &[], t0).is_err());
        table.clear();
        assert_eq!(table.generation(), 1);
        assert!(table.begin_pull("b", &[], t0).is_err());
    }
}
