//! The shared tier's backlog: the loads this router has sent to each shared filesystem and
//! that are not done yet.
//!
//! A shared filesystem (llm-d's filesystem offload, vLLM's `FS`/`OBJ` media) serves every
//! endpoint that mounts it from one aggregate bandwidth: a load queues behind the bytes the
//! other engines are already reading. Pricing a shared-tier hit at its own size alone (as a
//! private CPU or SSD tier is priced) sends every request whose prefix only the filesystem
//! holds to it at once, and each waits for all the others. So, like the P/D link's backlog
//! (bytes of unfinished transfers on a NIC), the fleet keeps, per mount, the shared-tier loads
//! it dispatched, and the cost model charges a new shared load the tokens still ahead of it at
//! the tier's rate (see [`crate::tiers::tier_load`]). What is still ahead:
//! - the filesystem reads loads first come, first served at its rate, and a load dispatched
//!   at `t` reads from `t` at the latest: the backlog drains at the rate (a "busy until" time,
//!   as the engine model's filesystem keeps it), so a load that sits in an engine's queue does
//!   not count as contention for longer than reading it takes;
//! - and never more than the tokens of the loads whose first token has not come yet (a load
//!   is done by then).
//!
//! The first alone over-charged a loaded fleet, whose requests spend seconds in the engines'
//! queues, not at the filesystem (measured: docs/benchmarks.md, shared filesystem).
//!
//! What the router cannot see (other routers' replicas, other tenants of the filesystem) shows
//! up in the learned shared-tier rate instead. Pure: no clock, no I/O.

/// One dispatched request's shared-tier load: which mount, and how many tokens.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SharedLoad {
    mount: usize,
    tokens: f64,
    /// Tokens already queued on the mount when it was dispatched.
    ahead: f64,
}

impl SharedLoad {
    /// Tokens queued ahead of this load on its mount when it was dispatched: contention, not
    /// the tier's speed (a rate lesson takes them out, see [`crate::tiers::TierRates`]).
    pub fn ahead_tokens(&self) -> f64 {
        self.ahead
    }
}

/// One mount's backlog.
#[derive(Clone, Debug)]
struct Mount {
    name: String,
    /// Tokens of dispatched loads whose first token has not come.
    unfinished: f64,
    /// When the loads dispatched so far are read, first come first served at `rate`.
    busy_until: f64,
    /// Tokens per second the last load was dispatched at (its endpoint's shared-tier rate).
    rate: f64,
}

impl Mount {
    fn queued(&self, now: f64) -> f64 {
        let draining = (self.busy_until - now).max(0.0) * self.rate;
        draining.min(self.unfinished)
    }
}

/// Shared-tier loads in flight, per mount (by name; mounts are few: one per shared filesystem
/// an operator configured).
#[derive(Clone, Debug, Default)]
pub struct SharedBacklog {
    mounts: Vec<Mount>,
}

impl SharedBacklog {
    /// Tokens still ahead of a load on `mount` at `now` (0 for a mount with none, or `None`:
    /// an endpoint that mounts nothing).
    pub fn tokens(&self, mount: Option<&str>, now: f64) -> f64 {
        mount
            .and_then(|name| self.mounts.iter().find(|m| m.name == name))
            .map_or(0.0, |m| m.queued(now))
    }

    /// A request that will load `tokens` from `mount` at `rate` tokens per second was
    /// dispatched at `now`: they queue there until read or until [`SharedBacklog::finished`].
    /// `None` when it loads nothing from a shared tier.
    pub fn dispatched(
        &mut self,
        mount: Option<&str>,
        tokens: usize,
        rate: f64,
        now: f64,
    ) -> Option<SharedLoad> {
        let name = mount.filter(|_| tokens > 0 && rate > 0.0 && rate.is_finite())?;
        let slot = match self.mounts.iter().position(|m| m.name == name) {
            Some(slot) => slot,
            None => {
                self.mounts.push(Mount {
                    name: name.to_owned(),
                    unfinished: 0.0,
                    busy_until: now,
                    rate,
                });
                self.mounts.len() - 1
            }
        };
        let mount = &mut self.mounts[slot];
        let load = SharedLoad {
            mount: slot,
            tokens: tokens as f64,
            ahead: mount.queued(now),
        };
        mount.busy_until = mount.busy_until.max(now) + load.tokens / rate;
        mount.rate = rate;
        mount.unfinished += load.tokens;
        Some(load)
    }

    /// Per mount: the tokens of dispatched shared-tier loads whose first token has not come.
    pub fn unfinished(&self) -> impl Iterator<Item = (&str, f64)> {
        self.mounts.iter().map(|m| (m.name.as_str(), m.unfinished))
    }

    /// `load` is done (its request's first token came, or the request ended without one).
    pub fn finished(&mut self, load: SharedLoad) {
        if let Some(mount) = self.mounts.get_mut(load.mount) {
            mount.unfinished = (mount.unfinished - load.tokens).max(0.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loads_queue_on_their_mount_until_they_finish() {
        let mut backlog = SharedBacklog::default();
        let rate = 1_000.0;
        assert_eq!(
            backlog.dispatched(Some("fs"), 0, rate, 0.0),
            None,
            "nothing to load"
        );
        assert_eq!(backlog.dispatched(None, 100, rate, 0.0), None, "no mount");
        let first = backlog.dispatched(Some("fs"), 1000, rate, 0.0).unwrap();
        let second = backlog.dispatched(Some("fs"), 500, rate, 0.0).unwrap();
        let other = backlog.dispatched(Some("obj"), 200, rate, 0.0).unwrap();
        assert_eq!(backlog.tokens(Some("fs"), 0.0), 1500.0);
        assert_eq!(backlog.tokens(Some("obj"), 0.0), 200.0);
        assert_eq!(backlog.tokens(None, 0.0), 0.0);
        assert_eq!((first.ahead_tokens(), second.ahead_tokens()), (0.0, 1000.0));
        assert_eq!(
            other.ahead_tokens(),
            0.0,
            "another mount's loads are not ahead"
        );
        backlog.finished(first);
        assert_eq!(backlog.tokens(Some("fs"), 0.0), 500.0);
        backlog.finished(second);
        backlog.finished(second);
        assert_eq!(backlog.tokens(Some("fs"), 0.0), 0.0, "never below zero");
    }

    #[test]
    fn the_backlog_drains_at_the_filesystems_rate_though_first_tokens_are_late() {
        let mut backlog = SharedBacklog::default();
        // Two loads of 1,000 tokens at 1,000 tokens/s: read by 2 s, whatever the engines'
        // queues do with their requests meanwhile.
        let first = backlog.dispatched(Some("fs"), 1000, 1_000.0, 0.0).unwrap();
        backlog.dispatched(Some("fs"), 1000, 1_000.0, 0.0).unwrap();
        assert_eq!(backlog.tokens(Some("fs"), 0.5), 1500.0);
        assert_eq!(backlog.tokens(Some("fs"), 2.0), 0.0);
        assert_eq!(backlog.tokens(Some("fs"), 30.0), 0.0);
        // A load dispatched after an idle spell does not wait for the old ones.
        let late = backlog.dispatched(Some("fs"), 400, 1_000.0, 30.0).unwrap();
        assert_eq!(late.ahead_tokens(), 0.0);
        assert!((backlog.tokens(Some("fs"), 30.0) - 400.0).abs() < 1e-9);
        // What has not finished caps it: once every first token came, nothing is ahead,
        // however slow the filesystem was thought to be.
        backlog.finished(first);
        backlog.finished(late);
        assert!(
            (backlog.tokens(Some("fs"), 30.1) - 300.0).abs() < 1e-9,
            "1,000 unfinished"
        );
        let slow = backlog.dispatched(Some("fs"), 1000, 10.0, 30.1).unwrap();
        backlog.finished(slow);
        assert!(backlog.tokens(Some("fs"), 30.2) <= 1000.0 + 1e-9);
    }
}
