//! The blocks the router's own in-flight requests pin on an endpoint, and how long a new request
//! waits there for room in its cache.
//!
//! An engine admits a request only when the prompt's blocks fit beside the blocks its admitted
//! requests reference: vLLM reuses a block only once no request references it. Where prompts
//! are long against the cache (long shared contexts, long conversations), an engine runs few
//! requests at once, and a new one waits for running requests to finish their decodes, not
//! only for the prefills queued ahead, which is all the queue term in prefill tokens counts
//! (traced: a request predicted to wait 53 ms waited 0.7 s behind three decodes,
//! docs/benchmarks.md).
//!
//! Per endpoint this keeps the router keys of each in-flight request, reference-counted, so a
//! block several of them share (a tenant's context) counts once, and a new request whose prefix
//! they pin needs room only for the rest; when each is expected to end (its first token, or the
//! earliest its prefill can end, plus the endpoint's decode time); and that decode time (first
//! token to end, learned from the requests that ended there). A request needs room for its
//! blocks no in-flight request pins; the wait is until enough in-flight requests are expected
//! to have ended for their blocks to make that room, in order of their expected ends, each
//! releasing the blocks no request still running references.

use std::sync::{Arc, OnceLock};

use hashbrown::HashMap;

use crate::keys::RouterKey;

/// How long an in-flight request may go unheard of before it stops pinning blocks: its end was
/// lost (a generation longer than this is rare; one that runs on is only under-counted).
pub(super) const PIN_MAX_AGE_S: f64 = 1_800.0;

/// Weight of a new decode-time observation in the endpoint's average (as for the index's
/// prediction error: the last five carry two thirds).
const DECODE_SAMPLE_WEIGHT: f64 = 0.2;

/// One in-flight request's pinned blocks and timing.
#[derive(Clone, Debug)]
struct PinnedRequest {
    keys: Arc<Vec<RouterKey>>,
    /// The block its prompt's last tokens and its output go in (not in `keys`, which are full
    /// blocks).
    extra_blocks: usize,
    /// The earliest its prefill can end: when it was sent, plus the prefill queued ahead of it
    /// and its own at the endpoint's rate then.
    prefill_end: f64,
    /// When its first token came.
    first_token_at: Option<f64>,
}

/// One endpoint's in-flight requests, as pinned blocks.
#[derive(Clone, Debug, Default)]
pub(super) struct PinnedBlocks {
    /// In-flight requests holding each key.
    refs: HashMap<RouterKey, u32>,
    requests: HashMap<u64, PinnedRequest>,
    /// Blocks pinned beyond the keys (each request's partial block).
    extra_blocks: usize,
    /// Seconds from first token to end, averaged over the requests that ended here.
    decode_s: Option<f64>,
    /// The order the in-flight requests are expected to end in, and the blocks freed as each
    /// ends: made when first asked after a change, so that costing every endpoint of a large
    /// fleet does not walk each one's in-flight blocks (see [`PinnedBlocks::room_wait_s`]).
    releases: OnceLock<Releases>,
}

/// An endpoint's in-flight requests in the order they are expected to end, and what each end
/// frees.
#[derive(Clone, Debug, Default)]
struct Releases {
    /// One step per request, in order.
    steps: Vec<Release>,
    /// Each step's request's keys.
    keys: Vec<Arc<Vec<RouterKey>>>,
}

/// One step of an endpoint's expected releases.
#[derive(Clone, Copy, Debug)]
struct Release {
    /// When the request ending at this step was last heard of: its first token, else the
    /// earliest end of its prefill. It is expected to end a decode time later.
    heard_at: f64,
    /// Blocks freed by the end of this step, counted from the first: a block is freed once
    /// every request holding it has ended.
    freed: i64,
}

/// What a new request needs of an endpoint's cache.
pub(super) struct RoomAsked<'a> {
    /// Its full blocks' keys.
    pub keys: &'a [RouterKey],
    /// Its prompt length.
    pub prompt_tokens: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// The endpoint's cache, in blocks.
    pub capacity_blocks: usize,
    /// The decode time to expect where the endpoint has none of its own yet.
    pub fallback_decode_s: Option<f64>,
    /// The plan's time.
    pub now: f64,
}

impl PinnedBlocks {
    /// Request `id` was sent here at `now` with its full blocks' `keys`; its prefill can end at
    /// `prefill_end` at the earliest.
    pub(super) fn pin(
        &mut self,
        id: u64,
        keys: Arc<Vec<RouterKey>>,
        prompt_tokens: usize,
        block_size: usize,
        prefill_end: f64,
    ) {
        self.releases = OnceLock::new();
        for key in keys.iter() {
            *self.refs.entry(*key).or_insert(0) += 1;
        }
        let extra_blocks = prompt_tokens
            .div_ceil(block_size.max(1))
            .saturating_sub(keys.len())
            .max(1);
        self.extra_blocks += extra_blocks;
        if let Some(old) = self.requests.insert(
            id,
            PinnedRequest {
                keys,
                extra_blocks,
                prefill_end,
                first_token_at: None,
            },
        ) {
            self.release(&old);
        }
    }

    /// Request `id`'s first token came at `now`.
    pub(super) fn first_token(&mut self, id: u64, now: f64) {
        if let Some(r) = self.requests.get_mut(&id) {
            r.first_token_at.get_or_insert(now);
            self.releases = OnceLock::new();
        }
    }

    /// Request `id` ended at `now`: its blocks are no longer pinned by it. Returns its decode
    /// time (first token to end), learned here, if it had a first token.
    pub(super) fn unpin(&mut self, id: u64, now: f64) -> Option<f64> {
        let r = self.requests.remove(&id)?;
        self.release(&r);
        let sample = (now - r.first_token_at?).max(0.0);
        self.decode_s = Some(averaged(self.decode_s, sample));
        Some(sample)
    }

    fn release(&mut self, r: &PinnedRequest) {
        self.releases = OnceLock::new();
        for key in r.keys.iter() {
            if let Some(n) = self.refs.get_mut(key) {
                *n -= 1;
                if *n == 0 {
                    self.refs.remove(key);
                }
            }
        }
        self.extra_blocks -= r.extra_blocks;
    }

    /// Drops the requests last heard of (first token, else the earliest end of their prefill)
    /// before `before`: their ends were never reported (a caller that lost them), and they must
    /// not pin blocks for ever.
    pub(super) fn expire(&mut self, before: f64) -> usize {
        let stale: Vec<u64> = self
            .requests
            .iter()
            .filter(|(_, r)| r.heard_at() < before)
            .map(|(id, _)| *id)
            .collect();
        for id in &stale {
            if let Some(r) = self.requests.remove(id) {
                self.release(&r);
            }
        }
        stale.len()
    }

    /// Blocks pinned now.
    pub(super) fn blocks(&self) -> usize {
        self.refs.len() + self.extra_blocks
    }

    /// Leading keys of `keys` that some in-flight request pins (keys chain their parents, so a
    /// pinned key's whole prefix is pinned).
    fn pinned_prefix(&self, keys: &[RouterKey]) -> usize {
        keys.partition_point(|k| self.refs.contains_key(k))
    }

    /// Seconds a request (`asked`) waits here for room in the cache: 0 when its blocks that
    /// no in-flight request pins fit beside the pinned ones, else until enough in-flight
    /// requests are expected to have ended (the last one's end when even that is not enough).
    /// Each is expected to end a decode time after it was last heard of (its first token, else
    /// the earliest end of its prefill), and not before `now`.
    ///
    /// It reads the endpoint's releases, made once per change of its in-flight requests (not
    /// once per plan: costing every endpoint of a large fleet must not walk each one's
    /// in-flight blocks), halves over them, and allocates nothing.
    pub(super) fn room_wait_s(&self, asked: &RoomAsked<'_>) -> f64 {
        let pinned = self.blocks();
        if pinned == 0 || asked.capacity_blocks == 0 {
            return 0.0;
        }
        let Some(decode_s) = self.decode_s.or(asked.fallback_decode_s) else {
            // No request has ended here yet: nothing says how long one runs.
            return 0.0;
        };
        let bs = asked.block_size.max(1);
        let blocks = asked.prompt_tokens.div_ceil(bs).max(1);
        // Negative when more is pinned than the cache holds (an estimate's error).
        let room = asked.capacity_blocks as i64 - pinned as i64;
        if blocks as i64 <= room {
            // Fits even with nothing shared: no need to look the keys up.
            return 0.0;
        }
        let shared = self.pinned_prefix(asked.keys);
        let needed = (blocks - shared.min(blocks)) as i64;
        if needed <= room {
            return 0.0;
        }
        let releases = self.releases.get_or_init(|| self.releases());
        let steps = &releases.steps;
        let made_room = |at: usize| steps.get(at).or(steps.last());
        let wait = |r: &Release| (r.heard_at + decode_s - asked.now).max(0.0);
        // A freed block the request shares was never needed: it frees nothing for it, so what
        // ending frees for it lies between what is freed less all it shares and what is freed:
        // no step before the first that frees enough blocks can make room. Keys chain their
        // parents, so the shared blocks still pinned after a step are the longest prefix it
        // shares with a request ending later (most often one of them holds all it shares: the
        // first looked at).
        let first_possible = steps.partition_point(|r| room + r.freed < needed);
        let shared_keys = &asked.keys[..shared];
        let still_shared = |after: usize| {
            let mut longest = 0;
            for keys in &releases.keys[after..] {
                if longest == shared {
                    break;
                }
                longest = longest.max(common_prefix(keys, shared_keys));
            }
            longest
        };
        let at = (first_possible..steps.len())
            .find(|&at| room + steps[at].freed - (shared - still_shared(at + 1)) as i64 >= needed)
            .unwrap_or(steps.len());
        made_room(at).map_or(0.0, wait)
    }

    /// The in-flight requests in the order they are expected to end, with the blocks freed by
    /// each end (a block is freed once every request holding it has ended).
    fn releases(&self) -> Releases {
        let mut order: Vec<&PinnedRequest> = self.requests.values().collect();
        order.sort_by(|a, b| a.heard_at().total_cmp(&b.heard_at()));
        let mut ended: HashMap<RouterKey, u32> = HashMap::new();
        let mut freed = 0i64;
        let holders = |key: &RouterKey| self.refs.get(key).copied().unwrap_or(0);
        let mut releases = Releases::default();
        for r in order {
            freed += r.extra_blocks as i64;
            // Keys chain their parents, so the keys other requests also hold are a prefix;
            // the rest are its alone, freed by its end.
            let with_others = r.keys.partition_point(|k| holders(k) > 1);
            freed += (r.keys.len() - with_others) as i64;
            for key in &r.keys[..with_others] {
                let done = ended.entry(*key).or_insert(0);
                *done += 1;
                if *done >= holders(key) {
                    freed += 1;
                }
            }
            releases.steps.push(Release {
                heard_at: r.heard_at(),
                freed,
            });
            releases.keys.push(r.keys.clone());
        }
        releases
    }
}

impl PinnedRequest {
    /// When it was last heard of: its first token, else the earliest end of its prefill.
    fn heard_at(&self) -> f64 {
        self.first_token_at.unwrap_or(self.prefill_end)
    }
}

/// `average` with `sample` folded in (the sample itself when there is none yet).
pub(super) fn averaged(average: Option<f64>, sample: f64) -> f64 {
    match average {
        Some(a) => (1.0 - DECODE_SAMPLE_WEIGHT) * a + DECODE_SAMPLE_WEIGHT * sample,
        None => sample,
    }
}

/// Leading keys `a` and `b` share (keys chain their parents: equal at one position means
/// equal at every one before).
fn common_prefix(a: &[RouterKey], b: &[RouterKey]) -> usize {
    let (mut equal, mut differ) = (0, a.len().min(b.len()));
    while equal < differ {
        let mid = (equal + differ) / 2;
        if a[mid] == b[mid] {
            equal = mid + 1;
        } else {
            differ = mid;
        }
    }
    equal
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(prefix: u64, len: u64) -> Arc<Vec<RouterKey>> {
        Arc::new(
            (0..len)
                .map(|i| RouterKey(prefix * 1_000 + i + 1))
                .collect(),
        )
    }

    /// `shared` keys of tenant `tenant`, then `own` of the request's own.
    fn chain(tenant: u64, shared: u64, request: u64, own: u64) -> Arc<Vec<RouterKey>> {
        let mut k: Vec<RouterKey> = keys(tenant, shared).to_vec();
        k.extend(keys(1_000 + request, own).iter());
        Arc::new(k)
    }

    fn asked(keys: &[RouterKey], capacity: usize, now: f64) -> RoomAsked<'_> {
        RoomAsked {
            keys,
            prompt_tokens: keys.len() * 16 + 8,
            block_size: 16,
            capacity_blocks: capacity,
            fallback_decode_s: None,
            now,
        }
    }

    /// An endpoint where one request ran and decoded for 0.4 s (from 0.1 to 0.5): the decode
    /// time it has learned. Request ids from 2 are free.
    fn decoding_for_0_4_s() -> PinnedBlocks {
        let mut pinned = PinnedBlocks::default();
        pinned.pin(1, keys(99, 10), 168, 16, 0.0);
        pinned.first_token(1, 0.1);
        pinned.unpin(1, 0.5);
        pinned
    }

    /// Pins request `id` with `keys` at `at` and gives it its first token then.
    fn running(pinned: &mut PinnedBlocks, id: u64, keys: Arc<Vec<RouterKey>>, at: f64) {
        let tokens = keys.len() * 16 + 8;
        pinned.pin(id, keys, tokens, 16, at);
        pinned.first_token(id, at);
    }

    #[test]
    fn a_request_that_fits_beside_the_pinned_blocks_waits_for_nothing() {
        let mut pinned = decoding_for_0_4_s();
        pinned.pin(2, keys(2, 100), 100 * 16 + 8, 16, 0.6);
        let new = keys(3, 100);
        assert_eq!(pinned.room_wait_s(&asked(&new, 300, 0.6)), 0.0);
    }

    #[test]
    fn a_request_that_does_not_fit_waits_for_the_first_end_that_makes_room() {
        let mut pinned = decoding_for_0_4_s();
        // Two running requests of 100 blocks each (+1): 202 of 250 pinned.
        running(&mut pinned, 2, keys(2, 100), 1.0);
        running(&mut pinned, 3, keys(3, 100), 1.2);
        let new = keys(4, 100);
        let wait = pinned.room_wait_s(&asked(&new, 250, 1.3));
        assert!((wait - 0.1).abs() < 1e-9, "request 2 ends at 1.4: {wait}");
        // A cache of 200 needs both to end.
        let wait = pinned.room_wait_s(&asked(&new, 200, 1.3));
        assert!((wait - 0.3).abs() < 1e-9, "request 3 ends at 1.6: {wait}");
    }

    #[test]
    fn a_prefix_in_flight_requests_pin_needs_no_room_and_frees_none_by_ending() {
        let mut pinned = decoding_for_0_4_s();
        // Two questions under one tenant's 100-block context, running.
        running(&mut pinned, 2, chain(1, 100, 2, 5), 1.0);
        running(&mut pinned, 3, chain(1, 100, 3, 5), 1.1);
        assert_eq!(pinned.blocks(), 112, "the context counts once");
        // Another question of that tenant needs 6 blocks: it fits in 120.
        let same_tenant = chain(1, 100, 4, 5);
        assert_eq!(pinned.room_wait_s(&asked(&same_tenant, 120, 1.2)), 0.0);
        // Another tenant's 105 blocks wait for the context itself to be freed: both end.
        let other = chain(2, 100, 5, 5);
        let wait = pinned.room_wait_s(&asked(&other, 120, 1.2));
        assert!((wait - 0.3).abs() < 1e-9, "request 3 ends at 1.5: {wait}");
        // In a cache of 117 the same tenant's question waits for one question to end, whose
        // context blocks it shares free nothing for it.
        let wait = pinned.room_wait_s(&asked(&same_tenant, 117, 1.2));
        assert!((wait - 0.2).abs() < 1e-9, "request 2 ends at 1.4: {wait}");
    }

    #[test]
    fn what_an_endpoint_releases_follows_each_change_of_its_requests() {
        let mut pinned = decoding_for_0_4_s();
        running(&mut pinned, 2, keys(2, 100), 1.0);
        let new = keys(4, 100);
        // 101 of 150 pinned: the new request waits for request 2 (ends at 1.4).
        assert!((pinned.room_wait_s(&asked(&new, 150, 1.1)) - 0.3).abs() < 1e-9);
        // A second request pins 61 more and ends at 1.55: the new one now waits for both.
        running(&mut pinned, 3, keys(3, 60), 1.15);
        assert!((pinned.room_wait_s(&asked(&new, 150, 1.2)) - 0.35).abs() < 1e-9);
        // Request 2 ends after 0.3 s of decoding (learned: 0.8 × 0.4 + 0.2 × 0.3 = 0.38 s): the
        // new request waits for request 3 alone, until 1.15 + 0.38.
        pinned.unpin(2, 1.3);
        assert!((pinned.room_wait_s(&asked(&new, 150, 1.3)) - 0.23).abs() < 1e-9);
    }

    #[test]
    fn ended_and_expired_requests_pin_nothing() {
        let mut pinned = PinnedBlocks::default();
        pinned.pin(1, chain(1, 50, 1, 5), 888, 16, 0.5);
        pinned.pin(2, chain(1, 50, 2, 5), 888, 16, 0.6);
        pinned.first_token(2, 0.7);
        assert_eq!(pinned.blocks(), 62);
        pinned.unpin(1, 1.0);
        assert_eq!(pinned.blocks(), 56);
        assert_eq!(pinned.decode_s, None, "request 1 had no first token");
        assert_eq!(pinned.expire(0.8), 1);
        assert_eq!(pinned.blocks(), 0);
        assert!(pinned.refs.is_empty());
    }
}
