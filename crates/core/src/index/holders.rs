//! Which endpoints hold one block, on which tiers: a compact bit set keyed by endpoint slot.
//!
//! Most blocks live on the GPU of endpoints whose slot is below 64, so that case is one inline
//! word; CPU/storage tiers and slots from 64 up spill into a boxed extension. Lookups walk a
//! prompt's blocks and intersect these words, so one block costs a few word operations however
//! many endpoints hold it.

use crate::event::Tier;

/// Slots per bit-set word.
pub(crate) const WORD_BITS: usize = 64;

/// The endpoints holding one block, per tier.
#[derive(Clone, Debug, Default)]
pub(crate) struct Holders {
    /// GPU holders among slots 0..64.
    gpu_low: u64,
    /// Everything else; `None` for the common GPU-only, low-slot block.
    ext: Option<Box<HoldersExt>>,
}

#[derive(Clone, Debug, Default)]
struct HoldersExt {
    /// Per tier, words for every slot from 0 (the GPU tier's word 0 stays unused: it is
    /// `gpu_low`).
    tiers: [Vec<u64>; 3],
}

fn split(slot: u32) -> (usize, u64) {
    let slot = slot as usize;
    (slot / WORD_BITS, 1u64 << (slot % WORD_BITS))
}

impl Holders {
    fn word_of(&self, tier: Tier, word: usize) -> u64 {
        if tier == Tier::Gpu && word == 0 {
            return self.gpu_low;
        }
        self.ext
            .as_ref()
            .and_then(|ext| ext.tiers[tier as usize].get(word).copied())
            .unwrap_or(0)
    }

    /// Whether `slot` holds the block on `tier`.
    pub(crate) fn has(&self, slot: u32, tier: Tier) -> bool {
        let (word, bit) = split(slot);
        self.word_of(tier, word) & bit != 0
    }

    /// Whether `slot` holds the block on any tier.
    pub(crate) fn has_any(&self, slot: u32) -> bool {
        let (word, bit) = split(slot);
        self.any_word(word) & bit != 0
    }

    /// Marks `slot` as holding the block on `tier`; returns whether that was new.
    pub(crate) fn insert(&mut self, slot: u32, tier: Tier) -> bool {
        let (word, bit) = split(slot);
        let target = if tier == Tier::Gpu && word == 0 {
            &mut self.gpu_low
        } else {
            let ext = self.ext.get_or_insert_with(Default::default);
            let words = &mut ext.tiers[tier as usize];
            if words.len() <= word {
                words.resize(word + 1, 0);
            }
            &mut words[word]
        };
        let new = *target & bit == 0;
        *target |= bit;
        new
    }

    /// Clears `slot` on `tier`; returns whether it was set.
    pub(crate) fn remove(&mut self, slot: u32, tier: Tier) -> bool {
        let (word, bit) = split(slot);
        let target = if tier == Tier::Gpu && word == 0 {
            &mut self.gpu_low
        } else {
            match self
                .ext
                .as_mut()
                .and_then(|ext| ext.tiers[tier as usize].get_mut(word))
            {
                Some(w) => w,
                None => return false,
            }
        };
        let was = *target & bit != 0;
        *target &= !bit;
        if was {
            self.shrink();
        }
        was
    }

    /// Drops the extension once it holds nothing, returning the block to its compact form.
    fn shrink(&mut self) {
        if let Some(ext) = &self.ext
            && ext.tiers.iter().all(|t| t.iter().all(|&w| w == 0))
        {
            self.ext = None;
        }
    }

    /// True when no endpoint holds the block on any tier.
    pub(crate) fn is_empty(&self) -> bool {
        self.gpu_low == 0 && self.ext.is_none()
    }

    /// Slots (within word `word`) holding the block on any tier.
    #[inline]
    pub(crate) fn any_word(&self, word: usize) -> u64 {
        match &self.ext {
            None if word == 0 => self.gpu_low,
            None => 0,
            Some(_) => Tier::ALL
                .iter()
                .fold(0, |acc, &t| acc | self.word_of(t, word)),
        }
    }

    /// Slots (within word `word`) holding the block on the GPU.
    #[inline]
    pub(crate) fn gpu_word(&self, word: usize) -> u64 {
        match &self.ext {
            None if word == 0 => self.gpu_low,
            None => 0,
            Some(_) => self.word_of(Tier::Gpu, word),
        }
    }

    /// The fastest tier on which `slot` holds the block.
    pub(crate) fn best_tier(&self, slot: u32) -> Option<Tier> {
        Tier::ALL.into_iter().find(|&t| self.has(slot, t))
    }

    /// Whether the block is held only in the compact GPU word.
    #[cfg(test)]
    pub(crate) fn is_compact(&self) -> bool {
        self.ext.is_none()
    }

    /// Heap bytes owned beyond the inline struct (for memory accounting).
    pub(crate) fn heap_bytes(&self) -> usize {
        self.ext.as_ref().map_or(0, |ext| {
            std::mem::size_of::<HoldersExt>()
                + ext.tiers.iter().map(|t| t.capacity() * 8).sum::<usize>()
        })
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// Holders behaves like a set of (slot, tier) pairs.
        #[test]
        fn behaves_like_a_set(ops in proptest::collection::vec((any::<bool>(), 0u32..200, 0usize..3), 0..300)) {
            let mut holders = Holders::default();
            let mut model = std::collections::HashSet::new();
            for (insert, slot, tier) in ops {
                let tier = Tier::ALL[tier];
                if insert {
                    prop_assert_eq!(holders.insert(slot, tier), model.insert((slot, tier)));
                } else {
                    prop_assert_eq!(holders.remove(slot, tier), model.remove(&(slot, tier)));
                }
                prop_assert_eq!(holders.is_empty(), model.is_empty());
                for s in [slot, 0, 63, 64, 199] {
                    let want_any = Tier::ALL.iter().any(|t| model.contains(&(s, *t)));
                    prop_assert_eq!(holders.has_any(s), want_any);
                    let (w, bit) = split(s);
                    prop_assert_eq!(holders.any_word(w) & bit != 0, want_any);
                    prop_assert_eq!(holders.gpu_word(w) & bit != 0, model.contains(&(s, Tier::Gpu)));
                    prop_assert_eq!(holders.best_tier(s), Tier::ALL.into_iter().find(|t| model.contains(&(s, *t))));
                }
            }
            let only_low_gpu = model.iter().all(|(s, t)| *s < 64 && *t == Tier::Gpu);
            prop_assert_eq!(holders.is_compact(), only_low_gpu);
        }
    }
}
