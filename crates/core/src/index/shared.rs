//! A [`KvIndex`] shared between the request path (many readers) and event ingestion, split into
//! shards by endpoint so that several writers apply events at once.
//!
//! # Decisions
//! - **Shard by endpoint** (the idea of Dynamo's sharded indexer): endpoint `e` lives in shard
//!   `e mod n`. Each shard is a whole [`KvIndex`] of its endpoints behind its own reader-writer
//!   lock, so an endpoint's event stream has one writer, no event touches two shards, and no
//!   cross-shard ordering is needed. Writers on different shards never wait for each other.
//! - **A lookup holds one shard's read guard at a time**, never a global lock: it walks each
//!   shard under that shard's guard, appending to one answer (shards hold disjoint endpoints,
//!   so merging is concatenation; the answer is sorted once). A writer then stalls only its own
//!   shard's part of a lookup, and each part is whole batches of its endpoints' events. The
//!   price is the walk: a block held on endpoints of two shards is looked up in two block
//!   tables, so a cold walk costs up to `n` times the random reads (measured in
//!   `docs/benchmarks.md`). ([`SharedIndex::read`], for diagnostics, holds every shard's guard
//!   at once.)
//! - **Each endpoint's GPU block count is published** after every write to its shard (and for
//!   the endpoints the capacity bound evicted from), readable without any shard's lock: a plan
//!   reads its candidates' fill there, never waiting for a writer under the fleet's lock.
//! - **Lookups come first.** A lookup that finds its shard write-locked spins for about a
//!   batch's length (then yields) instead of sleeping, announced, and a writer lets announced
//!   lookups in before its next batch: the request path waits at most a batch, a batch a walk.
//!   This is the only scheduling this crate does with threads (no spawning, no clock: a
//!   bounded number of tries), kept here because it is part of what the shard lock means.
//! - **The capacity is split evenly between the shards**, and each keeps itself within its part
//!   (its clock hand sweeps the largest endpoint of that shard): the total never exceeds the
//!   configured capacity, and no shard waits for another to make room.
//! - **The shared tier is one for all shards**, behind its own lock: a block one endpoint wrote
//!   to a shared filesystem is a hit for every endpoint mounting it, whatever its shard. Locks
//!   are always taken shard first, then tier, so they cannot deadlock.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use parking_lot::{RwLock, RwLockReadGuard};

use super::fleet_tier::{FleetTier, SharedFleetTier};
use super::{
    EndpointId, EndpointIndexStats, IndexConfig, KvIndex, OffloadSpec, PrefixMatches,
    SharedTierStats,
};
use crate::CoreError;
use crate::event::{EngineHash, KvEvent, Tier};
use crate::keys::RouterKey;

/// A thread-safe index of one or more shards; clone the `Arc` it usually lives in.
#[derive(Debug)]
pub struct SharedIndex {
    shards: Box<[Shard]>,
    /// The shared tier every shard refers to.
    fleet: SharedFleetTier,
    /// Each endpoint's GPU, CPU and storage blocks and CPU capacity (by id) as of the last write to
    /// its shard, readable without the shard's lock: a plan that walked the index beforehand reads
    /// its candidates' fill here, so it never waits for a writer while holding the fleet's lock.
    /// (The lock is taken for writing only to grow the list for a new endpoint.)
    published: RwLock<Vec<[AtomicU64; 4]>>,
}

/// What an endpoint's index holds, in blocks, as its shard last published it (read without the
/// shard's lock, as separate loads: the counts may come from consecutive publications,
/// a batch apart).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HeldBlocks {
    /// On the GPU: with the cache's capacity, how full it is.
    pub gpu: u64,
    /// In CPU memory: more than none means the endpoint offloads there.
    pub cpu: u64,
    /// The CPU tier's capacity as its events show it (0: unknown; see
    /// [`KvIndex::cpu_capacity_blocks`]).
    pub cpu_capacity: u64,
    /// On its own storage: more than none means the endpoint offloads there too (where its
    /// connector demotes what the CPU tier drops, or wrote it through, the block is kept there).
    pub storage: u64,
}

impl HeldBlocks {
    fn read(counts: &[AtomicU64; 4]) -> Self {
        Self {
            gpu: counts[0].load(Ordering::Relaxed),
            cpu: counts[1].load(Ordering::Relaxed),
            cpu_capacity: counts[2].load(Ordering::Relaxed),
            storage: counts[3].load(Ordering::Relaxed),
        }
    }
}

impl SharedIndex {
    /// Wraps an index as a single shard (one writer at a time).
    pub fn new(index: KvIndex) -> Self {
        let published = Self {
            fleet: index.fleet.clone(),
            shards: Box::new([Shard::new(index)]),
            published: RwLock::default(),
        };
        let shard = published.shards[0].index.read();
        for endpoint in shard.endpoints() {
            published.publish(endpoint, &shard);
        }
        drop(shard);
        published
    }

    /// An empty index of `shards` shards (at least one) sharing `config.capacity` entries.
    pub fn sharded(config: IndexConfig, shards: usize) -> Result<Self, CoreError> {
        if shards == 0 {
            return Err(CoreError::InvalidIndexShards(shards));
        }
        let fleet = FleetTier::shared(config.capacity);
        let shards = (0..shards)
            .map(|s| {
                let part = config.capacity / shards + usize::from(s < config.capacity % shards);
                let config = IndexConfig {
                    capacity: part,
                    ..config.clone()
                };
                KvIndex::shard(config, fleet.clone(), s as u32).map(Shard::new)
            })
            .collect::<Result<_, _>>()?;
        Ok(Self {
            shards,
            fleet,
            published: RwLock::default(),
        })
    }

    /// Shards of the index.
    pub fn shard_count(&self) -> usize {
        self.shards.len()
    }

    /// The shard holding `endpoint`'s blocks.
    pub fn shard_of(&self, endpoint: EndpointId) -> usize {
        endpoint.0 as usize % self.shards.len()
    }

    fn shard(&self, endpoint: EndpointId) -> &RwLock<KvIndex> {
        &self.shards[self.shard_of(endpoint)].index
    }

    /// Applies one batch of an endpoint's events atomically with respect to lookups, holding
    /// only that endpoint's shard, after letting lookups that wait for it in.
    pub fn apply(&self, endpoint: EndpointId, events: &[KvEvent]) {
        self.shards[self.shard_of(endpoint)].let_readers_in();
        self.write_endpoint(endpoint, |index| index.apply(endpoint, events));
    }

    /// Runs `f` with write access to the shard holding `endpoint` (restoring a snapshot of it:
    /// [`KvIndex::restore`]), then publishes the GPU blocks of `endpoint` and of every endpoint
    /// the capacity bound evicted from meanwhile.
    pub fn write_endpoint<R>(&self, endpoint: EndpointId, f: impl FnOnce(&mut KvIndex) -> R) -> R {
        let mut shard = self.shard(endpoint).write();
        let result = f(&mut shard);
        self.publish(endpoint, &shard);
        let evicted: Vec<EndpointId> = shard.take_evicted_from().collect();
        for other in evicted {
            self.publish(other, &shard);
        }
        result
    }

    /// Drops everything `endpoint` holds.
    pub fn clear_endpoint(&self, endpoint: EndpointId) {
        self.write_endpoint(endpoint, |index| index.clear_endpoint(endpoint));
    }

    /// Forgets `endpoint`.
    pub fn remove_endpoint(&self, endpoint: EndpointId) {
        self.write_endpoint(endpoint, |index| index.remove_endpoint(endpoint));
    }

    /// Registers `endpoint`.
    pub fn add_endpoint(&self, endpoint: EndpointId) {
        self.write_endpoint(endpoint, |index| index.add_endpoint(endpoint));
    }

    /// Blocks `endpoint` holds on the GPU as of the last write to its shard (0 when unknown),
    /// without taking the shard's lock.
    pub fn gpu_blocks(&self, endpoint: EndpointId) -> u64 {
        self.held_blocks(endpoint).gpu
    }

    /// What `endpoint` holds on the GPU and in CPU memory as of the last write to its shard
    /// (0 when unknown), without taking the shard's lock.
    pub fn held_blocks(&self, endpoint: EndpointId) -> HeldBlocks {
        self.published
            .read()
            .get(endpoint.0 as usize)
            .map_or_else(HeldBlocks::default, HeldBlocks::read)
    }

    /// [`SharedIndex::held_blocks`] of each of `endpoints`, in their order, under one read of
    /// the published list (a plan that costs every endpoint).
    pub fn held_blocks_of(&self, endpoints: impl Iterator<Item = EndpointId>) -> Vec<HeldBlocks> {
        let counts = self.published.read();
        endpoints
            .map(|e| {
                counts
                    .get(e.0 as usize)
                    .map_or_else(HeldBlocks::default, HeldBlocks::read)
            })
            .collect()
    }

    /// Publishes what `endpoint` holds in `shard`, its shard (under the shard's write lock, so
    /// that publications of one endpoint happen in the order of its writes).
    fn publish(&self, endpoint: EndpointId, shard: &KvIndex) {
        let counted = [
            shard.gpu_blocks(endpoint),
            shard.cpu_blocks(endpoint),
            shard.cpu_capacity_blocks(endpoint),
            shard.storage_blocks(endpoint),
        ];
        let store = |counts: &[AtomicU64; 4]| {
            for (slot, value) in counts.iter().zip(counted) {
                slot.store(value, Ordering::Relaxed);
            }
        };
        let at = endpoint.0 as usize;
        if let Some(counts) = self.published.read().get(at) {
            store(counts);
            return;
        }
        let mut list = self.published.write();
        if list.len() <= at {
            list.resize_with(at + 1, Default::default);
        }
        store(&list[at]);
    }

    /// Declares how `endpoint` offloads (see [`KvIndex::set_offload`]).
    pub fn set_offload(&self, endpoint: EndpointId, spec: &OffloadSpec) -> Result<(), CoreError> {
        self.shard(endpoint).write().set_offload(endpoint, spec)
    }

    /// Counters of the fleet-wide shared tier.
    pub fn shared_tier_stats(&self) -> SharedTierStats {
        self.fleet.read().stats.clone()
    }

    /// Each endpoint's longest cached prefix of `keys`, one shard's read guard at a time.
    /// (Reading the shards a writer holds last was measured: it changed nothing.)
    pub fn lookup(&self, keys: &[RouterKey]) -> PrefixMatches {
        lookup_in(self.shards.iter().map(Shard::read_soon), keys)
    }

    /// Counters for one endpoint.
    pub fn endpoint_stats(&self, endpoint: EndpointId) -> Option<EndpointIndexStats> {
        self.shard(endpoint).read().endpoint_stats(endpoint)
    }

    /// Runs `f` with read access to the shard holding `endpoint` (everything the index knows
    /// about that endpoint).
    pub fn read_endpoint<R>(&self, endpoint: EndpointId, f: impl FnOnce(&KvIndex) -> R) -> R {
        f(&self.shard(endpoint).read())
    }

    /// Runs `f` with read access to the whole index: every shard's read guard, taken in shard
    /// order and held until `f` returns (diagnostics, tests; lookups use [`Self::lookup`]).
    pub fn read<R>(&self, f: impl FnOnce(&IndexRead<'_>) -> R) -> R {
        f(&IndexRead {
            index: self,
            shards: self.shards.iter().map(Shard::read_soon).collect(),
        })
    }
}

/// Read access to every shard of a [`SharedIndex`] at once, from [`SharedIndex::read`].
pub struct IndexRead<'a> {
    index: &'a SharedIndex,
    shards: Vec<RwLockReadGuard<'a, KvIndex>>,
}

impl IndexRead<'_> {
    fn shard(&self, endpoint: EndpointId) -> &KvIndex {
        &self.shards[self.index.shard_of(endpoint)]
    }

    /// Each endpoint's longest cached prefix of `keys`.
    pub fn lookup(&self, keys: &[RouterKey]) -> PrefixMatches {
        lookup_in(self.shards.iter().map(|s| &**s), keys)
    }

    /// Counters for one endpoint, if it is known.
    pub fn endpoint_stats(&self, endpoint: EndpointId) -> Option<EndpointIndexStats> {
        self.shard(endpoint).endpoint_stats(endpoint)
    }

    /// Every known endpoint, shard by shard.
    pub fn endpoints(&self) -> impl Iterator<Item = EndpointId> + '_ {
        self.shards.iter().flat_map(|s| s.endpoints())
    }

    /// Blocks held, counted in each shard (a block held in two shards counts twice).
    pub fn block_count(&self) -> usize {
        self.shards.iter().map(|s| s.block_count()).sum()
    }

    /// (block, endpoint) entries held: what the capacity bounds.
    pub fn entry_count(&self) -> usize {
        self.shards.iter().map(|s| s.entry_count()).sum()
    }

    /// Whether `endpoint` holds the block `key` on `tier`.
    pub fn holds(&self, endpoint: EndpointId, key: RouterKey, tier: Tier) -> bool {
        self.shard(endpoint).holds(endpoint, key, tier)
    }

    /// The router key an endpoint's engine hash resolves to, if the endpoint holds that block.
    pub fn resolve(&self, endpoint: EndpointId, hash: EngineHash) -> Option<RouterKey> {
        self.shard(endpoint).resolve(endpoint, hash)
    }

    /// Heap bytes of every shard and of the shared tier (see [`KvIndex::heap_bytes`]).
    pub fn heap_bytes(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.own_heap_bytes())
            .sum::<usize>()
            + self.index.fleet.read().heap_bytes()
    }
}

/// Tries for a shard's read guard this many times, spinning, before sleeping until it is free.
const READ_SPINS: u32 = 64;

/// Most tries a writer makes, yielding between them, to let announced readers in first.
const WRITER_DEFERS: u32 = 32;

/// One shard: its index behind its lock, and the lookups waiting for it.
#[derive(Debug)]
struct Shard {
    index: RwLock<KvIndex>,
    /// Lookups spinning for this shard's read guard now ([`Shard::read_soon`]).
    readers_waiting: AtomicU32,
}

impl Shard {
    fn new(index: KvIndex) -> Self {
        Self {
            index: RwLock::new(index),
            readers_waiting: AtomicU32::new(0),
        }
    }

    /// The read guard for a lookup. A writer holds a shard for one batch (microseconds), and a
    /// reader that sleeps behind it waits to be woken, which costs more than the batch: the
    /// reader spins for about a batch's length first (a few tens of microseconds at most, then
    /// it yields its core between tries), announced to the writers, who let it in before
    /// their next batch ([`Shard::let_readers_in`]); it sleeps only if a writer holds on
    /// longer (preempted).
    fn read_soon(&self) -> RwLockReadGuard<'_, KvIndex> {
        if let Some(guard) = self.index.try_read() {
            return guard;
        }
        self.readers_waiting.fetch_add(1, Ordering::AcqRel);
        let mut guard = None;
        for attempt in 0..READ_SPINS {
            if attempt < READ_SPINS / 2 {
                for _ in 0..64 {
                    std::hint::spin_loop();
                }
            } else {
                std::thread::yield_now();
            }
            guard = self.index.try_read();
            if guard.is_some() {
                break;
            }
        }
        self.readers_waiting.fetch_sub(1, Ordering::AcqRel);
        guard.unwrap_or_else(|| self.index.read())
    }

    /// Before a writer's batch: while lookups wait for this shard, yields to them (a bounded
    /// number of times), so that a writer applying batch after batch does not keep them out
    /// (a lookup is the request path; a batch can wait a walk's length).
    fn let_readers_in(&self) {
        for _ in 0..WRITER_DEFERS {
            if self.readers_waiting.load(Ordering::Acquire) == 0 {
                return;
            }
            std::thread::yield_now();
        }
    }
}

/// Each endpoint's longest cached prefix of `keys` in `shards` (disjoint endpoints), one shard
/// after the other into one answer, sorted once.
fn lookup_in(
    shards: impl ExactSizeIterator<Item = impl std::ops::Deref<Target = KvIndex>>,
    keys: &[RouterKey],
) -> PrefixMatches {
    let mut out = PrefixMatches::default();
    let count = shards.len();
    for (at, shard) in shards.enumerate() {
        shard.lookup_into(keys, count - at, &mut out);
    }
    out.sort();
    out
}
