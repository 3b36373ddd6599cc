//! Offloaded tiers: how an endpoint's CPU, storage and shared-filesystem events are indexed.
//!
//! vLLM's offloading connectors publish their events on the GPU's stream, in shapes that changed
//! by release (`shared/reference/vllm-wire.md` §6):
//! - **Placeholders** (no tokens): one hash per offloaded chunk, the chunk's *last* GPU block
//!   hash. A chunk is `offload block size / GPU block size` blocks; the connector publishes that
//!   size before 0.20 (`block_size`) and 0 since, so the endpoint's [`OffloadSpec`] gives it.
//!   A placeholder resolves through the endpoint's engine-hash → router-key map; the chunk's
//!   other blocks are found by walking parent links, kept (for endpoints whose chunks span
//!   several blocks only) from the GPU stores.
//! - **Self-describing** payloads (0.24+, opt-in) and **LMCache** carry tokens: they index like
//!   GPU stores, on their tier. LMCache's chunks span several blocks (its own `chunk_size`);
//!   each block of a chunk gets its own entry (the chunk's hash names the last, the others a
//!   hash derived from their router key) so that lookups and the capacity bound see them all.
//! - **Repeats are reference-counted** on offloaded tiers, as vLLM documents: a block stored
//!   twice on the CPU tier needs two removals. GPU stores stay idempotent (see the module doc
//!   of [`super`]).
//! - **Orphans are counted, never guessed**: a tier event naming a hash the endpoint's map does
//!   not hold, or a chunk whose earlier blocks it cannot resolve, is counted in
//!   [`EndpointIndexStats::offload_orphans`](super::EndpointIndexStats) and changes nothing.
//! - **A shared tier** (a filesystem or object store several endpoints mount) is fleet-wide:
//!   events of a medium the endpoint's [`SharedMount`] names go to [`super::fleet_tier`], and
//!   a block there is a hit on every endpoint mounting it.

use hashbrown::HashMap;
use parking_lot::RwLock;

use super::fleet_tier::{FleetTier, MountId};
use super::holders::WideHolders;
use super::runs::RunChain;
use super::split_table::SplitTable;
use super::{
    BlockEntry, EndpointState, HeldBlock, REFERENCED, add_holder, bump, drop_holder, drop_slot,
};
use crate::event::Tier;
use crate::keys::RouterKey;

/// How one endpoint offloads KV blocks below its GPU, as far as the index needs to know.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OffloadSpec {
    /// Tokens per offloaded block (the connector's `block_size`); a multiple of the index's
    /// block size. `None`: one GPU block per offloaded block (vLLM's default), or whatever the
    /// events say (releases before 0.20 publish it).
    pub block_size: Option<usize>,
    /// The fleet-wide shared tier the endpoint mounts, if any.
    pub shared: Option<SharedMount>,
}

/// A shared tier an endpoint mounts: its name (endpoints with the same name share it) and the
/// medium strings (compared ignoring case) whose events go to it rather than to the endpoint's
/// own storage tier.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedMount {
    /// The mount's name, the same on every endpoint that mounts it.
    pub name: String,
    /// Media written to this mount.
    pub media: Vec<String>,
}

impl SharedMount {
    /// Media that name shared storage by default: vLLM's filesystem and object-store tiers.
    pub const DEFAULT_MEDIA: [&'static str; 2] = ["FS", "OBJ"];

    /// A mount named `name` receiving the default media.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            media: Self::DEFAULT_MEDIA
                .iter()
                .map(|m| (*m).to_owned())
                .collect(),
        }
    }
}

/// Where an event's blocks live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Place {
    /// One of the endpoint's own tiers.
    Local(Tier),
    /// The fleet-wide shared tier, on this mount.
    Shared(MountId),
}

/// The most blocks one offloaded chunk may span (4,096: 64k tokens at 16 per block). Each
/// placeholder walks its chunk's parent links, so a hostile or misconfigured size is refused
/// rather than walked.
pub(super) const MAX_CHUNK_BLOCKS: usize = 4096;

/// Bit set in the hash standing in for a block of a multi-block chunk that the chunk's own hash
/// does not name (LMCache): derived from its router key, so the same block gets the same entry.
const CHUNK_MEMBER: u64 = 0x5a5a_0000_0000_0001;

/// The hash under which a chunk member without a hash of its own is held.
pub(super) fn member_hash(key: RouterKey) -> u64 {
    key.0.rotate_left(29) ^ CHUNK_MEMBER
}

/// One endpoint's offload bookkeeping; created on its first offloaded-tier event or when it is
/// configured.
#[derive(Debug, Default)]
pub(super) struct EndpointOffload {
    /// GPU blocks per offloaded chunk (1 until known).
    pub(super) chunk_blocks: usize,
    /// The connector publishes self-describing payloads (every block, with tokens): removals
    /// name every block rather than chunks.
    pub(super) described: bool,
    /// The shared mount and the media going to it.
    pub(super) mount: Option<(MountId, Vec<String>)>,
    /// Engine hash → parent engine hash, for walking a chunk back from its last block; kept
    /// only while chunks span several blocks, and dropped with the block's entry.
    pub(super) parents: HashMap<u64, u64>,
    /// (engine hash, tier) → stores beyond the first not yet matched by removals, for
    /// offloaded tiers. The first reference is the holder bit itself, so a block stored once
    /// (the common case) costs no entry here.
    pub(super) refs: HashMap<(u64, u8), u32>,
    /// Engine hash → router key of the blocks this endpoint wrote to the shared tier (removals
    /// name them after the GPU has forgotten them).
    pub(super) shared_written: HashMap<u64, RouterKey>,
    /// Offloaded blocks applied since the last orphan (`None`: no orphan yet).
    since_orphan: Option<u64>,
}

/// Offloaded blocks applied without an orphan after which the tiers count as certain again.
const UNCERTAIN_FOR_BLOCKS: u64 = 4096;

impl EndpointOffload {
    /// Where an event with `medium` puts its blocks.
    pub(super) fn place(this: Option<&Self>, medium: Option<&str>) -> Place {
        if let (Some(m), Some((mount, media))) = (medium, this.and_then(|o| o.mount.as_ref()))
            && media.iter().any(|s| s.eq_ignore_ascii_case(m))
        {
            return Place::Shared(*mount);
        }
        Place::Local(Tier::from_medium(medium))
    }

    /// Whether GPU stores must record parent links (chunks span several blocks).
    pub(super) fn wants_parents(&self) -> bool {
        self.chunk_blocks > 1
    }

    /// Forgets what is kept for `hash` once its entry is gone.
    pub(super) fn forget(&mut self, hash: u64) {
        if !self.shared_written.contains_key(&hash) {
            self.parents.remove(&hash);
        }
        for tier in [Tier::Cpu, Tier::Storage] {
            self.refs.remove(&(hash, tier as u8));
        }
    }

    /// Counts `n` orphans: the tier picture is uncertain for a while.
    pub(super) fn note_orphans(&mut self, n: u64) {
        if n > 0 {
            self.since_orphan = Some(0);
        }
    }

    /// Counts one offloaded block applied.
    fn note_applied(&mut self) {
        if let Some(n) = self.since_orphan.as_mut() {
            *n += 1;
        }
    }

    /// Whether the tier picture is uncertain: an orphan within the last
    /// `UNCERTAIN_FOR_BLOCKS` offloaded blocks.
    pub(super) fn uncertain(&self) -> bool {
        self.since_orphan.is_some_and(|n| n < UNCERTAIN_FOR_BLOCKS)
    }

    /// Forgets every block (the endpoint's cache was cleared), keeping its configuration.
    pub(super) fn clear(&mut self) {
        self.parents.clear();
        self.refs.clear();
        self.shared_written.clear();
    }

    /// One more reference to `hash` on `tier`, already held there (a repeat).
    pub(super) fn add_repeat(&mut self, hash: u64, tier: Tier) {
        *self.refs.entry((hash, tier as u8)).or_insert(0) += 1;
    }

    /// Takes back one repeated reference to `hash` on `tier`; false when only the first
    /// reference is left (the holder bit).
    pub(super) fn drop_repeat(&mut self, hash: u64, tier: Tier) -> bool {
        let Some(n) = self.refs.get_mut(&(hash, tier as u8)) else {
            return false;
        };
        *n -= 1;
        if *n == 0 {
            self.refs.remove(&(hash, tier as u8));
        }
        true
    }

    /// Heap bytes of the maps (approximate).
    pub(super) fn heap_bytes(&self) -> usize {
        self.parents.capacity() * 17
            + self.refs.capacity() * 21
            + self.shared_written.capacity() * 17
    }
}

/// The index's tables an event changes, borrowed apart from the endpoint's own state.
pub(super) struct Tables<'a> {
    pub(super) blocks: &'a mut SplitTable<BlockEntry>,
    pub(super) wide: &'a mut WideHolders,
    /// The shared tier, locked only for a shared-tier event (the shards share it).
    pub(super) fleet: &'a RwLock<FleetTier>,
    pub(super) entries: &'a mut usize,
}

/// The router key `hash` names for this endpoint: its own map, or, for the shared tier, the
/// blocks it wrote there.
#[inline]
pub(super) fn resolve(state: &EndpointState, hash: u64, place: Place) -> Option<RouterKey> {
    if let Some(held) = state.blocks.get(hash) {
        return Some(held.router_key());
    }
    let o = state.offload.as_deref()?;
    match place {
        Place::Shared(_) => o.shared_written.get(&hash).copied(),
        Place::Local(_) => None,
    }
}

/// The blocks of the chunk whose last block is `tail`, last first, as (engine hash, router
/// key); and how many of the chunk's `chunk` blocks could not be resolved.
pub(super) fn chunk_chain(
    state: &EndpointState,
    tail: u64,
    chunk: usize,
    place: Place,
) -> (Vec<(u64, RouterKey)>, u64) {
    let mut out = Vec::with_capacity(chunk.min(64));
    let mut hash = tail;
    for k in 0..chunk {
        let Some(key) = resolve(state, hash, place) else {
            return (out, (chunk - k) as u64);
        };
        out.push((hash, key));
        if k + 1 < chunk {
            match state.offload.as_deref().and_then(|o| o.parents.get(&hash)) {
                Some(&parent) => hash = parent,
                None => return (out, (chunk - k - 1) as u64),
            }
        }
    }
    (out, 0)
}

/// Stores one block, `hash` naming `key`, on `place` for this endpoint; `parent` is the engine
/// hash before it in its chain, if known; `runs` links the block into its chain's runs when it
/// is stored as part of a chain (an event with tokens).
#[inline]
pub(super) fn store_block(
    t: &mut Tables<'_>,
    state: &mut EndpointState,
    place: Place,
    hash: u64,
    key: RouterKey,
    parent: Option<u64>,
    runs: Option<&mut RunChain>,
) {
    let slot = state.slot;
    if let (Some(p), Some(o)) = (parent, state.offload.as_deref_mut())
        && o.wants_parents()
    {
        o.parents.insert(hash, p);
    }
    let tier = match place {
        Place::Shared(mount) => {
            let o = state.offload.get_or_insert_with(Box::default);
            o.note_applied();
            o.shared_written.insert(hash, key);
            let mut fleet = t.fleet.write();
            if fleet.holds(mount, key) {
                state.stats.offload_repeats += 1;
            }
            fleet.store(mount, key);
            state.stats.blocks_stored += 1;
            return;
        }
        Place::Local(tier) => tier,
    };
    let (held, new) = state.blocks.get_or_insert(HeldBlock {
        hash,
        tagged_key: key.0 | REFERENCED,
    });
    let old = held.router_key();
    held.tagged_key = key.0 | REFERENCED;
    if new {
        *t.entries += 1;
    } else if old != key {
        // The engine reused a hash for other content (it restarted with another seed without
        // our noticing, or a hash collided): forget the old block.
        drop_slot(t.blocks, t.wide, old, slot, &mut state.stats);
        if let Some(o) = state.offload.as_deref_mut() {
            o.forget(hash);
        }
    }
    let new_on_tier = add_holder(t.blocks, t.wide, key, slot, tier, runs);
    if new_on_tier {
        bump(&mut state.stats, tier, true);
    }
    if tier != Tier::Gpu {
        let o = state.offload.get_or_insert_with(Box::default);
        o.note_applied();
        if !new_on_tier {
            o.add_repeat(hash, tier);
            state.stats.offload_repeats += 1;
        }
    }
    state.stats.blocks_stored += 1;
}

/// Removes one reference to `hash` on `place` for this endpoint (`key`: what the endpoint's map
/// resolved it to, if the caller looked already); false when it held none.
#[inline]
pub(super) fn remove_block(
    t: &mut Tables<'_>,
    state: &mut EndpointState,
    place: Place,
    hash: u64,
    key: Option<RouterKey>,
) -> bool {
    let tier = match place {
        Place::Shared(mount) => {
            let Some(key) = resolve(state, hash, place) else {
                return false;
            };
            let (was, left) = t.fleet.write().remove(mount, key);
            if !was {
                return false;
            }
            if !left
                && let Some(o) = state.offload.as_deref_mut()
                && o.shared_written.remove(&hash).is_some()
                && state.blocks.get(hash).is_none()
            {
                o.parents.remove(&hash);
            }
            state.stats.blocks_removed += 1;
            return true;
        }
        Place::Local(tier) => tier,
    };
    let Some(key) = key.or_else(|| state.blocks.get(hash).map(|h| h.router_key())) else {
        return false;
    };
    if tier != Tier::Gpu
        && state
            .offload
            .as_deref_mut()
            .is_some_and(|o| o.drop_repeat(hash, tier))
    {
        state.stats.blocks_removed += 1;
        return true;
    }
    let (was, still_held) = drop_holder(t.blocks, t.wide, key, state.slot, tier);
    if !was {
        return false;
    }
    if tier == Tier::Cpu {
        let stats = &mut state.stats;
        stats.cpu_blocks_when_full = stats.cpu_blocks_when_full.max(stats.blocks_cpu);
    }
    bump(&mut state.stats, tier, false);
    state.stats.blocks_removed += 1;
    if !still_held {
        state.blocks.remove(hash);
        *t.entries -= 1;
        if let Some(o) = state.offload.as_deref_mut() {
            o.forget(hash);
        }
    }
    true
}
