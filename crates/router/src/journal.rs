//! What a replica keeps beside its KV index so that it can hand the index to a starting peer
//! as engine events: for every block an endpoint's events stored, its parent's hash, its
//! tokens and extra keys (which the index does not keep: it keeps only the router key made
//! from them), the tiers holding it, and the last batch sequence applied.
//!
//! The index stays the source of truth: an export replays the journal's blocks that the index
//! still holds, with their ancestors, then removes whatever the index no longer holds, so the
//! peer that applies it ends with the same index (capacity eviction and forgetting included).
//!
//! Costs the block's tokens once more per (block, endpoint): kept only by replicas that have
//! peers. A `KvIndex` accessor listing an endpoint's (engine hash, router key, tiers) and a
//! matching restore would make it unnecessary (see docs/operations.md).

use std::collections::HashMap;

use kvroute_core::event::{BlockRemoved, BlockStored, EngineHash, KvEvent, Tier};
use kvroute_core::index::{EndpointId, KvIndex};
use kvroute_core::keys::{BlockExtraKeys, ExtraKey};

/// One stored block.
#[derive(Clone, Debug)]
struct Block {
    parent: Option<EngineHash>,
    tokens: Box<[u32]>,
    extra: BlockExtraKeys,
    /// Bit `t` set: held on tier `t` (`Tier as u8`).
    tiers: u8,
    /// Store order, so that exports list older blocks first.
    stamp: u64,
}

/// One endpoint's blocks and position in its event stream.
#[derive(Debug, Default)]
struct EndpointJournal {
    seq: Option<u64>,
    blocks: HashMap<EngineHash, Block>,
    /// Blocks removed from every tier but kept, as the parent of a block stored after them
    /// may still be held: a peer needs its tokens to place the child.
    removed: usize,
    clock: u64,
}

/// Every endpoint's journal.
#[derive(Debug, Default)]
pub struct Journal {
    endpoints: HashMap<EndpointId, EndpointJournal>,
}

/// The medium string vLLM uses for a tier.
fn medium(tier: Tier) -> &'static str {
    match tier {
        Tier::Gpu => "GPU",
        Tier::Cpu => "CPU",
        Tier::Storage => "STORAGE",
    }
}

fn bit(tier: Tier) -> u8 {
    1 << (tier as u8)
}

/// An endpoint's journal, exported: the last sequence applied and the events that rebuild its
/// index.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Export {
    /// The last batch sequence applied (`None`: none since start or the engine's restart).
    pub seq: Option<u64>,
    /// Stores (parents first), then removals of what the index no longer holds.
    pub events: Vec<KvEvent>,
}

impl Journal {
    /// Applies one batch of `endpoint`'s events, numbered `seq` (call with the index's lock
    /// order: right after the index applied the same batch).
    pub fn apply(&mut self, endpoint: EndpointId, seq: Option<u64>, events: &[KvEvent]) {
        let journal = self.endpoints.entry(endpoint).or_default();
        for event in events {
            match event {
                KvEvent::BlockStored(stored) => journal.stored(stored),
                KvEvent::BlockRemoved(removed) => journal.removed(removed),
                KvEvent::AllBlocksCleared => {
                    journal.blocks.clear();
                    journal.removed = 0;
                }
            }
        }
        if seq.is_some() {
            journal.seq = seq;
        }
    }

    /// Forgets an endpoint (its engine restarted: its sequence starts again).
    pub fn clear(&mut self, endpoint: EndpointId) {
        self.endpoints.remove(&endpoint);
    }

    /// Events that rebuild `index`'s picture of `endpoint` on an empty index, and the sequence
    /// they reflect. Drops the journal's blocks that neither the index nor any held block needs.
    pub fn export(&mut self, endpoint: EndpointId, index: &KvIndex) -> Export {
        let Some(journal) = self.endpoints.get_mut(&endpoint) else {
            return Export::default();
        };
        let held = |hash: &EngineHash| index.resolve(endpoint, *hash);
        let mut order: Vec<(u64, EngineHash)> = journal
            .blocks
            .iter()
            .filter(|(h, _)| held(h).is_some())
            .map(|(h, b)| (b.stamp, *h))
            .collect();
        order.sort_unstable();
        // Parents first: each held block after its ancestors (held or not).
        let mut emitted: HashMap<EngineHash, ()> = HashMap::with_capacity(order.len());
        let mut sequence: Vec<EngineHash> = Vec::with_capacity(order.len());
        for (_, hash) in &order {
            let mut chain = vec![*hash];
            let mut at = journal.blocks[hash].parent;
            while let Some(parent) = at.filter(|p| !emitted.contains_key(p)) {
                let Some(block) = journal.blocks.get(&parent) else {
                    break;
                };
                chain.push(parent);
                at = block.parent;
            }
            for h in chain.into_iter().rev() {
                if emitted.insert(h, ()).is_none() {
                    sequence.push(h);
                }
            }
        }
        journal.blocks.retain(|h, _| emitted.contains_key(h));
        journal.removed = journal.blocks.values().filter(|b| b.tiers == 0).count();
        let mut events = Vec::with_capacity(sequence.len());
        let mut removals = Vec::new();
        for hash in &sequence {
            let block = &journal.blocks[hash];
            // A removed block kept as a held block's ancestor is stored, then removed again.
            let tiers: Vec<Tier> = match block.tiers {
                0 => vec![Tier::Gpu],
                t => Tier::ALL
                    .into_iter()
                    .filter(|tier| t & bit(*tier) != 0)
                    .collect(),
            };
            let (first, rest) = tiers.split_first().expect("one tier at least");
            events.push(KvEvent::BlockStored(BlockStored {
                block_hashes: vec![*hash],
                parent_block_hash: block.parent,
                token_ids: block.tokens.to_vec(),
                block_size: block.tokens.len() as u32,
                medium: Some(medium(*first).into()),
                extra_keys: Some(vec![block.extra.clone()]),
                ..BlockStored::default()
            }));
            for tier in rest {
                events.push(KvEvent::BlockStored(BlockStored {
                    block_hashes: vec![*hash],
                    medium: Some(medium(*tier).into()),
                    ..BlockStored::default()
                }));
            }
            let key = held(hash);
            for tier in tiers {
                if key.is_none_or(|k| !index.holds(endpoint, k, tier)) {
                    removals.push(KvEvent::BlockRemoved(BlockRemoved {
                        block_hashes: vec![*hash],
                        medium: Some(medium(tier).into()),
                        group_idx: None,
                    }));
                }
            }
        }
        events.extend(removals);
        Export {
            seq: journal.seq,
            events,
        }
    }
}

impl EndpointJournal {
    fn stored(&mut self, event: &BlockStored) {
        if event.group_idx.is_some_and(|g| g != 0) {
            return;
        }
        let tier = bit(Tier::from_medium(event.medium.as_deref()));
        if event.token_ids.is_empty() {
            for hash in &event.block_hashes {
                if let Some(block) = self.blocks.get_mut(hash) {
                    self.removed -= usize::from(block.tiers == 0);
                    block.tiers |= tier;
                }
            }
            return;
        }
        let n = event.block_hashes.len();
        let size = event.block_size as usize;
        if size == 0 || event.token_ids.len() != n * size {
            return;
        }
        if event.extra_keys.as_ref().is_some_and(|e| e.len() != n) {
            return;
        }
        let mut parent = event.parent_block_hash;
        for (i, (hash, tokens)) in event
            .block_hashes
            .iter()
            .zip(event.token_ids.chunks_exact(size))
            .enumerate()
        {
            // As the index reads them: per-block extra keys, else the LoRA name on every block.
            let extra = match (&event.extra_keys, &event.lora_name) {
                (Some(per_block), _) => per_block[i].clone(),
                (None, Some(lora)) => Some(vec![ExtraKey::Str(lora.clone())]),
                (None, None) => None,
            };
            self.clock += 1;
            if self.blocks.get(hash).is_some_and(|b| b.tiers == 0) {
                self.removed -= 1;
            }
            let block = self.blocks.entry(*hash).or_insert_with(|| Block {
                parent,
                tokens: Box::default(),
                extra: None,
                tiers: 0,
                stamp: 0,
            });
            block.parent = parent;
            block.tokens = tokens.into();
            block.extra = extra;
            block.tiers |= tier;
            block.stamp = self.clock;
            parent = Some(*hash);
        }
    }

    fn removed(&mut self, event: &BlockRemoved) {
        if event.group_idx.is_some_and(|g| g != 0) {
            return;
        }
        let tier = bit(Tier::from_medium(event.medium.as_deref()));
        for hash in &event.block_hashes {
            if let Some(block) = self.blocks.get_mut(hash)
                && block.tiers != 0
            {
                block.tiers &= !tier;
                self.removed += usize::from(block.tiers == 0);
            }
        }
        if self.removed > 1024 && self.removed * 2 > self.blocks.len() {
            self.prune();
        }
    }

    /// Drops the removed blocks that no held block descends from.
    fn prune(&mut self) {
        let mut needed: HashMap<EngineHash, ()> = HashMap::new();
        for block in self.blocks.values().filter(|b| b.tiers != 0) {
            let mut at = block.parent;
            while let Some(parent) = at {
                match self.blocks.get(&parent) {
                    Some(p) if p.tiers == 0 && needed.insert(parent, ()).is_none() => {
                        at = p.parent;
                    }
                    _ => break,
                }
            }
        }
        self.blocks
            .retain(|h, b| b.tiers != 0 || needed.contains_key(h));
        self.removed = needed.len();
    }
}

#[cfg(test)]
mod tests;
