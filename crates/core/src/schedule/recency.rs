//! Which of a prompt's cached blocks the queue ahead evicts, by when each was last used.
//!
//! vLLM evicts the cached blocks used longest ago first (a request's blocks go to the free
//! queue when it ends, its last block first, and eviction takes the head of that queue), and
//! never a block a running request references. So whether a cached block of the prompt
//! survives until the request is admitted depends on how many **distinct** blocks were used
//! after it: those, the blocks the requests queued ahead will store, and the blocks running
//! requests pin beyond their prompts must all fit in the cache beside it.
//!
//! The fleet splits a prompt's cached prefix into parts by last use (see
//! `fleet::recent_use`): a leading part the router's in-flight requests pin (never lost), then
//! parts each last used by a request that ended, newest first, each with the distinct blocks
//! that are newer than it. A part loses its last blocks by as much as those newer blocks and
//! the part itself exceed the cache. What lies beyond the parts (last used before anything the
//! fleet keeps) is taken as equally likely to go as any cached block (`cost::survival`).

use serde::Serialize;

/// Parts kept per candidate: a prompt's cached prefix is rarely split more (a system prompt, a
/// tenant's context, a conversation's turns); what lies past the last part kept is priced as
/// blocks of unknown age.
pub const MAX_PARTS: usize = 8;

/// One stretch of a prompt's cached prefix, all last used by the same request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RecencyPart {
    /// First block of the stretch.
    pub from: u32,
    /// Block after the stretch's last.
    pub to: u32,
    /// Blocks the cache must keep that are newer than the stretch: distinct blocks used after
    /// it (the queue ahead's included) and blocks running requests pin beyond their prompts.
    pub newer: u32,
}

/// A prompt's cached prefix on one endpoint, split by last use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecencyParts {
    /// Leading blocks the router's in-flight requests pin there: the newest, never evicted
    /// before the request is admitted.
    pub pinned: u32,
    /// The parts after `pinned`, newest first, contiguous.
    parts: [RecencyPart; MAX_PARTS],
    len: u8,
}

impl RecencyParts {
    /// Parts of a prefix whose first `pinned` blocks are pinned.
    pub fn new(pinned: u32) -> Self {
        Self {
            pinned,
            ..Self::default()
        }
    }

    /// Appends the next part (it must start where the last one ended); `false` when
    /// [`MAX_PARTS`] are kept already.
    pub fn push(&mut self, part: RecencyPart) -> bool {
        debug_assert_eq!(part.from, self.known(), "parts are contiguous");
        let Some(slot) = self.parts.get_mut(usize::from(self.len)) else {
            return false;
        };
        *slot = part;
        self.len += 1;
        true
    }

    /// The parts, newest first.
    pub fn parts(&self) -> &[RecencyPart] {
        &self.parts[..usize::from(self.len)]
    }

    /// Blocks whose last use is known: the pinned ones and the parts'.
    pub fn known(&self) -> u32 {
        self.parts().last().map_or(self.pinned, |p| p.to)
    }

    /// Blocks of the first `held` (cached on the GPU) expected to be evicted before the request
    /// is admitted, in a cache of `capacity` blocks where a block of unknown age survives with
    /// probability `survival`.
    pub fn lost(&self, held: u32, capacity: f64, survival: f64) -> f64 {
        let mut lost = 0.0;
        for part in self.parts() {
            if part.from >= held {
                break;
            }
            // The stretch's blocks within the prefix; its last ones go first.
            let len = f64::from(part.to.min(held) - part.from);
            lost += (f64::from(part.newer) + len - capacity).clamp(0.0, len);
        }
        let unknown = held.saturating_sub(self.known());
        lost + f64::from(unknown) * (1.0 - survival.clamp(0.0, 1.0))
    }
}

impl Serialize for RecencyParts {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut out = serializer.serialize_struct("RecencyParts", 2)?;
        out.serialize_field("pinned", &self.pinned)?;
        out.serialize_field("parts", self.parts())?;
        out.end()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(from: u32, to: u32, newer: u32) -> RecencyPart {
        RecencyPart { from, to, newer }
    }

    #[test]
    fn a_part_loses_its_last_blocks_past_the_capacity() {
        let mut parts = RecencyParts::new(10);
        assert!(parts.push(part(10, 50, 70)));
        // 70 newer blocks + 40 of the part = 110 in a cache of 100: its last 10 go.
        assert_eq!(parts.lost(50, 100.0, 1.0), 10.0);
        // A prefix held only to block 30: 70 + 20 fits.
        assert_eq!(parts.lost(30, 100.0, 1.0), 0.0);
        // A part whose newer blocks fill the cache is lost whole; the pinned blocks never.
        let mut parts = RecencyParts::new(10);
        parts.push(part(10, 50, 120));
        assert_eq!(parts.lost(50, 100.0, 1.0), 40.0);
    }

    #[test]
    fn blocks_past_the_known_parts_go_at_the_uniform_share() {
        let mut parts = RecencyParts::new(0);
        parts.push(part(0, 20, 0));
        // 30 blocks of unknown age, half of which survive.
        assert_eq!(parts.lost(50, 100.0, 0.5), 15.0);
        // With nothing known but the pinned prefix.
        assert_eq!(RecencyParts::new(20).lost(50, 100.0, 0.5), 15.0);
    }

    #[test]
    fn no_more_parts_than_kept() {
        let mut parts = RecencyParts::new(0);
        for i in 0..MAX_PARTS as u32 {
            assert!(parts.push(part(i, i + 1, 0)));
        }
        assert!(!parts.push(part(8, 9, 0)));
        assert_eq!(parts.known(), 8);
    }
}
