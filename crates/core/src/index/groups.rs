//! Which of an endpoint's KV-cache groups the prefix index tracks.
//!
//! A hybrid model (vLLM 0.20+ with the hybrid KV-cache manager) publishes one stream of events
//! per KV-cache group (`group_idx`), and numbers its groups in the order their attention kinds
//! first appear among its layers: on a model whose first layer is a sliding-window one (gpt-oss,
//! Gemma 3) group 0 is the sliding-window group, and on a Mamba hybrid it may be the Mamba
//! group. Those groups free a prompt's early blocks while it runs, so their events lose the
//! start of every prefix, and an index of them predicts almost no hits. The group that holds
//! whole prefixes is a full-attention one, which BlockStored events name from 0.22
//! (`kv_cache_spec_kind`). So the index tracks the lowest-numbered group whose events said
//! full attention; until one has (releases before 0.22, plain models, a model without any),
//! group 0 stands in. BlockRemoved events carry no kind: they follow the group chosen. An event
//! that names no group (connectors that do not say: LMCache, offload events before 0.24) is
//! taken as the tracked group's, as before groups were told apart.
//!
//! Should a full-attention group other than 0 be learned after blocks of a group of another
//! kind were indexed (group 0 standing in), those blocks came from the wrong group: the
//! endpoint's entries are dropped and rebuilt from the chosen group's events (counted as a
//! clear). The choice is the engine's model's, so it is learned again whenever the endpoint's
//! cache is forgotten (a restart, a pod that left and whose id another takes), and it travels
//! with a peer's snapshot, so that a restored endpoint is not dropped by its first events.

/// Attention kinds whose group holds every block of a prefix for as long as it is cached.
const WHOLE_PREFIX_KINDS: [&str; 3] = ["full_attention", "mla_attention", "sink_full_attention"];

/// The tracked group of one endpoint, as learned from its events.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct PrefixGroup {
    /// The lowest-numbered group whose events said full attention (`None`: none yet; group 0
    /// stands in).
    full: Option<i64>,
    /// Blocks of a group known not to be full attention were indexed while group 0 stood in.
    indexed_other_kind: bool,
}

/// What to do with one event's blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum GroupVerdict {
    /// They belong to the tracked group: index them.
    Index,
    /// Another group's: count them as ignored.
    Ignore,
    /// They name a full-attention group learned now, after blocks of another kind were
    /// indexed: drop the endpoint's entries, then index them.
    ClearThenIndex,
}

impl PrefixGroup {
    /// The choice made by a peer's events (see [`Self::learned`]).
    pub(super) fn learned_from(full: i64) -> Self {
        Self {
            full: Some(full),
            indexed_other_kind: false,
        }
    }

    /// The full-attention group learned from the events, if any.
    pub(super) fn learned(&self) -> Option<i64> {
        self.full
    }

    /// The group tracked now.
    fn tracked(&self) -> i64 {
        self.full.unwrap_or(0)
    }

    /// A BlockStored event of `group` (`None`: not said; the tracked group's) whose layers are
    /// of `kind` (`None`: not said, before 0.22).
    pub(super) fn stored(&mut self, group: Option<i64>, kind: Option<&str>) -> GroupVerdict {
        let group = group.unwrap_or(self.tracked());
        let whole = kind.map(|k| WHOLE_PREFIX_KINDS.contains(&k));
        match (whole, self.full) {
            (Some(true), None) => {
                self.full = Some(group);
                if group != 0 && self.indexed_other_kind {
                    self.indexed_other_kind = false;
                    GroupVerdict::ClearThenIndex
                } else {
                    GroupVerdict::Index
                }
            }
            (Some(false), None) if group == 0 => {
                self.indexed_other_kind = true;
                GroupVerdict::Index
            }
            _ if group == self.tracked() => GroupVerdict::Index,
            _ => GroupVerdict::Ignore,
        }
    }

    /// A BlockRemoved event of `group` (which says no kind; `None`: not said): whether it names
    /// the tracked group.
    pub(super) fn removed(&self, group: Option<i64>) -> bool {
        group.is_none_or(|g| g == self.tracked())
    }
}

#[cfg(test)]
mod tests {
    use super::GroupVerdict::{ClearThenIndex, Ignore, Index};
    use super::*;

    #[test]
    fn a_plain_model_and_releases_before_kinds_track_group_0() {
        let mut g = PrefixGroup::default();
        assert_eq!(g.stored(None, None), Index);
        assert_eq!(g.stored(Some(0), None), Index);
        assert_eq!(g.stored(Some(1), None), Ignore);
        assert!(g.removed(None) && g.removed(Some(0)) && !g.removed(Some(1)));
        assert_eq!(g.stored(Some(0), Some("full_attention")), Index);
    }

    #[test]
    fn a_hybrid_whose_group_0_slides_tracks_its_full_attention_group() {
        let mut g = PrefixGroup::default();
        // The full-attention group's events come first: group 0 is never indexed.
        assert_eq!(g.stored(Some(1), Some("full_attention")), Index);
        assert_eq!(g.stored(Some(0), Some("sliding_window")), Ignore);
        assert!(g.removed(Some(1)) && !g.removed(Some(0)));
        // Group 0's come first: indexed while it stands in, dropped once group 1 says it is
        // full attention.
        let mut g = PrefixGroup::default();
        assert_eq!(g.stored(Some(0), Some("sliding_window")), Index);
        assert_eq!(g.stored(Some(1), Some("full_attention")), ClearThenIndex);
        assert_eq!(g.stored(Some(0), Some("sliding_window")), Ignore);
        assert_eq!(g.stored(Some(1), Some("full_attention")), Index);
        // A second full-attention group changes nothing.
        assert_eq!(g.stored(Some(2), Some("full_attention")), Ignore);
    }

    #[test]
    fn events_that_name_no_group_follow_the_tracked_one() {
        let mut g = PrefixGroup::default();
        assert_eq!(g.stored(Some(1), Some("full_attention")), Index);
        // An offload connector's events that say no group (LMCache, releases before 0.24).
        assert_eq!(g.stored(None, None), Index);
        assert!(g.removed(None));
        assert!(!g.removed(Some(0)));
        // A choice carried from a peer is the one followed.
        let mut restored = PrefixGroup::learned_from(1);
        assert_eq!(restored.learned(), Some(1));
        assert_eq!(restored.stored(Some(0), Some("sliding_window")), Ignore);
        assert_eq!(restored.stored(Some(1), Some("full_attention")), Index);
    }

    #[test]
    fn a_model_without_full_attention_keeps_group_0() {
        let mut g = PrefixGroup::default();
        assert_eq!(g.stored(Some(0), Some("sliding_window")), Index);
        assert_eq!(g.stored(Some(1), Some("mamba")), Ignore);
        assert!(g.removed(Some(0)));
    }

    #[test]
    fn mla_and_sink_attention_hold_whole_prefixes() {
        for kind in ["mla_attention", "sink_full_attention"] {
            let mut g = PrefixGroup::default();
            assert_eq!(g.stored(Some(0), Some("mamba")), Index);
            assert_eq!(g.stored(Some(1), Some(kind)), ClearThenIndex, "{kind}");
        }
    }
}
