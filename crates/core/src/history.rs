//! The router's own memory of where it sent which block chains, for routing without engine
//! events (approximate mode) and for the window before an engine's `BlockStored` arrives
//! (the predicted overlay).
//!
//! Entries expire after a TTL and the whole history holds at most `capacity` (block, endpoint)
//! records, the oldest dropped first, so it never grows without bound. Time is passed in.
//!
//! It answers exactly as a table of (block, endpoint) → expiry would (the naive model its tests
//! hold it to), but keeps each recorded chain as a few runs of blocks (see `tree`) and one
//! record per request, not one per block: recording, shortening, dropping and looking up a
//! prompt cost a few table operations per run it goes through (a system prompt, each earlier
//! turn), not several per block.

mod tree;

use std::collections::VecDeque;

use crate::index::EndpointId;
use crate::keys::RouterKey;
use tree::{ChainTree, NO_RUN};

/// One request's prompt sent to an endpoint: the blocks at depths `from..to` of the chain that
/// ends with run `run` (its blocks before `from` were already dropped for the capacity bound).
#[derive(Debug, Clone, Copy)]
struct Record {
    run: u32,
    endpoint: EndpointId,
    /// The expiry it set.
    expiry: f64,
    from: u32,
    to: u32,
}

/// Where blocks were recently sent.
#[derive(Debug)]
pub struct RoutingHistory {
    ttl_s: f64,
    capacity: usize,
    tree: ChainTree,
    /// Records in the order they were made, for the capacity bound and expiry.
    records: VecDeque<Record>,
    /// Blocks in `records` (each record's `to - from`).
    blocks: usize,
    /// Scratch: the runs along one chain.
    path: Vec<u32>,
}

impl RoutingHistory {
    /// A history whose entries live `ttl_s` seconds, holding at most `capacity` entries.
    pub fn new(ttl_s: f64, capacity: usize) -> Self {
        Self {
            ttl_s,
            capacity: capacity.max(1),
            tree: ChainTree::default(),
            records: VecDeque::new(),
            blocks: 0,
            path: Vec::new(),
        }
    }

    /// Records that `keys` were sent to `endpoint` at time `now` (seconds).
    pub fn record(&mut self, endpoint: EndpointId, keys: &[RouterKey], now: f64) {
        let expiry = now + self.ttl_s;
        self.path.clear();
        let (mut depth, mut parent) = (0, NO_RUN);
        while depth < keys.len() {
            let run = match self.tree.find(keys, depth) {
                Some((id, through)) if through < self.tree.run(id).keys().len() => {
                    // The prompt ends or leaves the run part way: only its part is held anew.
                    let Some(prefix) = self.tree.split(id, (depth + through) as u32) else {
                        break;
                    };
                    depth += through;
                    prefix
                }
                Some((id, through)) => {
                    depth += through;
                    id
                }
                None => {
                    let Some(id) = self.tree.add(parent, depth, &keys[depth..]) else {
                        break;
                    };
                    depth = keys.len();
                    id
                }
            };
            self.path.push(run);
            parent = run;
        }
        let Some(&last) = self.path.last() else {
            return;
        };
        for &id in &self.path {
            self.tree.run_mut(id).info.hold(endpoint, expiry);
        }
        self.tree.pin(last);
        self.records.push_back(Record {
            run: last,
            endpoint,
            expiry,
            from: 0,
            to: depth as u32,
        });
        self.blocks += depth;
        while self.blocks > self.capacity {
            self.drop_oldest(self.blocks - self.capacity);
        }
    }

    /// Drops up to `blocks` of the oldest record's blocks, from its first.
    fn drop_oldest(&mut self, blocks: usize) {
        let Some(oldest) = self.records.front_mut() else {
            return;
        };
        let dropped = blocks.min((oldest.to - oldest.from) as usize);
        let record = *oldest;
        let until = record.from + dropped as u32;
        oldest.from = until;
        self.blocks -= dropped;
        self.release(record, until);
        if until == record.to {
            self.records.pop_front();
            self.tree.unpin(record.run);
        }
    }

    /// Drops `record`'s holding of its blocks `record.from..until`, where it is still the
    /// latest word on them (a newer record keeps them held).
    fn release(&mut self, record: Record, until: u32) {
        let Record {
            endpoint,
            expiry,
            from,
            ..
        } = record;
        self.path.clear();
        let mut id = record.run;
        while id != NO_RUN && self.tree.run(id).end() > from {
            self.path.push(id);
            id = self.tree.run(id).info.parent;
        }
        // From the first block down; a split leaves `id` the later part.
        for &id in self.path.iter().rev() {
            let run = self.tree.run(id);
            if run.info.start >= until || !run.info.expiry_of(endpoint).is_some_and(|x| x <= expiry)
            {
                continue;
            }
            if run.info.start < from {
                // Its part before `from` stays held (on a collision, the whole run goes).
                let _ = self.tree.split(id, from);
            }
            let target = if self.tree.run(id).end() > until {
                self.tree.split(id, until).unwrap_or(id)
            } else {
                id
            };
            self.tree.run_mut(target).info.release(endpoint);
        }
    }

    /// Brings forward the expiry of `endpoint`'s entries for `keys` to `expiry` (never later
    /// than they were): a prediction that the engine's own events are about to confirm or
    /// refute should not outlive them.
    pub fn shorten(&mut self, endpoint: EndpointId, keys: &[RouterKey], expiry: f64) {
        let mut depth = 0;
        while let Some((id, through)) = self.tree.find(keys, depth) {
            let run = self.tree.run(id);
            let whole = through == run.keys().len();
            if run.info.expiry_of(endpoint).is_some_and(|x| x > expiry) {
                // Only the part of the run that `keys` goes through (on a collision, all of it).
                let target = if whole {
                    id
                } else {
                    self.tree.split(id, (depth + through) as u32).unwrap_or(id)
                };
                self.tree.run_mut(target).info.shorten(endpoint, expiry);
            }
            depth += through;
            if !whole || depth == keys.len() {
                break;
            }
        }
    }

    /// Drops expired entries (call now and then; lookups ignore expired entries anyway).
    pub fn expire(&mut self, now: f64) {
        while let Some(oldest) = self.records.front()
            && oldest.expiry <= now
        {
            self.drop_oldest(usize::MAX);
        }
    }

    /// Forgets everything sent to `endpoint` (it restarted or left).
    pub fn forget_endpoint(&mut self, endpoint: EndpointId) {
        let mut kept = VecDeque::with_capacity(self.records.len());
        // The runs its records end at (its own list: `path` still holds the last walk's runs).
        let mut ended_at = Vec::new();
        for record in self.records.drain(..) {
            if record.endpoint == endpoint {
                self.blocks -= (record.to - record.from) as usize;
                ended_at.push(record.run);
            } else {
                kept.push_back(record);
            }
        }
        self.records = kept;
        for id in ended_at {
            self.tree.unpin(id);
        }
        self.tree
            .for_each_then_prune(|run| run.info.release(endpoint));
    }

    /// Each endpoint's longest prefix of `keys` sent to it and not expired at `now`, in endpoint
    /// order.
    pub fn longest_prefixes(&self, keys: &[RouterKey], now: f64) -> Vec<(EndpointId, u32)> {
        let mut path = self.tree.path(keys);
        let Some((first, _, through)) = path.next() else {
            return Vec::new();
        };
        // In endpoint order (as holders are), so that each run's holders are matched in
        // O(holders × log active), not O(holders × active): a hot prefix (a shared system
        // prompt) may be held by hundreds of endpoints.
        let mut active: Vec<(EndpointId, u32)> = first
            .info
            .holders
            .iter()
            .filter(|(_, x)| *x > now)
            .map(|(e, _)| (*e, through as u32))
            .collect();
        for (run, start, through) in path {
            let mut any = false;
            // An endpoint appears once among a run's holders.
            for (h, x) in &run.info.holders {
                if *x <= now {
                    continue;
                }
                if let Ok(at) = active.binary_search_by_key(h, |(e, _)| *e)
                    && active[at].1 == start as u32
                {
                    active[at].1 += through as u32;
                    any = true;
                }
            }
            if !any {
                break;
            }
        }
        active
    }

    /// Records held, one per block sent to an endpoint (a re-sent block counts again until its
    /// older record is dropped); what the capacity bounds.
    pub fn len(&self) -> usize {
        self.blocks
    }

    /// Whether the history is empty.
    pub fn is_empty(&self) -> bool {
        self.blocks == 0
    }

    /// Runs of blocks the history keeps (for memory accounting: each costs about 100 bytes
    /// plus 8 per block).
    pub fn runs(&self) -> usize {
        self.tree.len()
    }
}

#[cfg(test)]
mod tests;
