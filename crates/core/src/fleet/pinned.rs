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
//! Per endpoint this keeps the router keys of each in-flight request, so that a block several
//! of them share (a tenant's context) counts once, and a new request whose prefix they pin
//! needs room only for the rest; when each is expected to end (its first token, or the
//! earliest its prefill can end, plus the endpoint's decode time); and that decode time (first
//! token to end, learned from the requests that ended there). A request needs room for its
//! blocks no in-flight request pins; the wait is until enough in-flight requests are expected
//! to have ended for their blocks to make that room, in order of their expected ends, each
//! releasing the blocks no request still running references. The requests queued there (sent,
//! no first token yet) are taken to be admitted as vLLM admits its waiting requests, first
//! come first served, each once its blocks fit beside those of the requests running then:
//! where the cache holds few at once, their ends follow one another.
//!
//! vLLM admits a prompt chunk by chunk (`max_num_batched_tokens` at a time), each chunk once its
//! blocks fit, and the head of its queue keeps every later request behind it until all its
//! chunks are in: a request waiting for room prefills the whole chunks that fit in the blocks
//! free before the last end it waits for during the wait, and only the rest after it (a prompt
//! no longer than a chunk waits whole). Counting its whole prefill after the wait read large
//! prompts behind a full cache a prefill late (traced on the Mooncake trace: 1.32 s predicted
//! against 0.95 s measured on average, and the error grew with the prompt).
//!
//! A request holds more than its prompt by its end: its output goes in blocks it allocates as
//! it decodes, and where the cache is tight that growth is what fails. vLLM admits a request
//! once its prompt fits, then preempts the newest running request (to recompute it later) when
//! a decode finds no free block, and a preempted request goes back to the head of the queue,
//! ahead of every later one. So each request is counted with the output the endpoint's
//! requests were last seen to generate (its average of the engines' reported
//! `completion_tokens`), both as pinned and as asked for: on a cache that holds two prompts
//! but not their outputs, two requests of different prefixes do not fit at once (traced: 12
//! engines holding one request each, two fifths of them busy, where counting prompts alone stacked a
//! second request on a busy engine and TTFT p99 was 0.44 s against round-robin's 0.04 s).
//!
//! Keys chain their parents, so what two requests share is a common prefix of their key
//! chains, and the in-flight chains form a tree. They are kept in lexicographic order: the
//! longest prefix a chain shares with any of them is the longer of what it shares with its two
//! neighbours in that order, found in `O(log n)` comparisons, each a halving search for the
//! first key two chains differ in (the chain property again). Pinning or unpinning a request
//! then costs a few searches, not a map operation per block (a 512-block prompt made 1,024),
//! and the pinned block count is kept as chains come and go: a new chain adds the blocks past
//! its longest shared prefix, a leaving one frees those no remaining chain shares.

use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;
use std::sync::{Arc, OnceLock};

use hashbrown::HashMap;

use crate::keys::RouterKey;

/// How long an in-flight request may go unheard of before it stops pinning blocks: its end was
/// lost (a generation longer than this is rare; one that runs on is only under-counted).
pub(super) const PIN_MAX_AGE_S: f64 = 1_800.0;

/// Weight of a new decode-time or output-length observation in the endpoint's average (as
/// for the index's prediction error: the last five carry two thirds).
const DECODE_SAMPLE_WEIGHT: f64 = 0.2;

/// One in-flight request's pinned blocks and timing.
#[derive(Clone, Debug)]
struct PinnedRequest {
    keys: Arc<Vec<RouterKey>>,
    /// The blocks its prompt's last tokens and its expected output go in (not in `keys`, which
    /// are full blocks): at least one.
    extra_blocks: usize,
    /// The earliest its prefill can end: when it was sent, plus the prefill queued ahead of it
    /// and its own at the endpoint's rate then.
    prefill_end: f64,
    /// Its own prefill's seconds at the endpoint's rate then (the last part of `prefill_end`).
    prefill_s: f64,
    /// When its first token came.
    first_token_at: Option<f64>,
}

/// A request that ended, as [`PinnedBlocks::unpin`] saw it.
pub(super) struct Unpinned {
    /// Its full blocks' keys.
    pub keys: Arc<Vec<RouterKey>>,
    /// First token to end, if it had a first token.
    pub decode_s: Option<f64>,
}

/// One endpoint's in-flight requests, as pinned blocks.
#[derive(Clone, Debug, Default)]
pub(super) struct PinnedBlocks {
    /// The in-flight requests' key chains, and the blocks they pin beyond the keys (each
    /// request's partial block and expected output).
    set: ChainSet,
    requests: HashMap<u64, PinnedRequest>,
    /// Seconds from first token to end, averaged over the requests that ended here.
    decode_s: Option<f64>,
    /// Tokens generated per request, averaged over the requests that ended here with the
    /// engine's count.
    output_tokens: Option<f64>,
    /// The order the in-flight requests are expected to end in, and the blocks freed as each
    /// ends: made when first asked after a change, so that costing every endpoint of a large
    /// fleet does not walk each one's in-flight blocks (see [`PinnedBlocks::room_wait_s`]).
    releases: OnceLock<Releases>,
    /// Counts every change of `chains`: what a cache of figures derived from them is keyed by
    /// ([`super::recent_use::RecentUse`]'s newer-block counts).
    generation: u64,
}

/// An endpoint's in-flight requests in the order they are expected to end, and what each end
/// frees.
#[derive(Clone, Debug, Default)]
struct Releases {
    /// What the queued requests' admissions were simulated with
    /// (`None`: not simulated, each taken at the earliest end of its prefill).
    admissions_for: Option<Admissions>,
    /// One step per request, in order.
    steps: Vec<Release>,
    /// Each step's request's keys, then those of the requests without a step (which hold
    /// theirs past every step).
    keys: Vec<Arc<Vec<RouterKey>>>,
}

/// What the queued requests' admissions are simulated with ([`PinnedBlocks::queued_prefill_ends`]).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Admissions {
    /// The endpoint's cache, in blocks.
    capacity: usize,
    /// Seconds from a request's first token to its end.
    decode_s: f64,
    /// Blocks an engine step prefills at most (at least 1).
    chunk_blocks: usize,
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

/// A prompt's prefix that in-flight requests pin, as it stands when a new request is admitted
/// ([`PinnedBlocks::pinned_at`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct PinnedAt {
    /// Leading keys a request still running then pins: they cannot be evicted.
    pub held: usize,
    /// Leading keys some in-flight request pins now (at least `held`).
    pub pinned: usize,
    /// Distinct blocks newer than the prompt's blocks past `held` once they are freed: those of
    /// the requests expected to end after the last one pinning them (keys and outputs).
    pub newer_than_freed: usize,
}

impl PinnedAt {
    /// A pinned prefix of `prefix` keys that every pin holds until the admission (no request
    /// pinning it ends first, or nothing says when one does).
    pub(super) fn every_pin_holds(prefix: usize) -> Self {
        Self {
            held: prefix,
            pinned: prefix,
            newer_than_freed: 0,
        }
    }
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
    /// Most prompt tokens the engine prefills in one step (vLLM's `max_num_batched_tokens`).
    pub chunk_tokens: usize,
    /// The plan's time.
    pub now: f64,
}

impl RoomAsked<'_> {
    /// Blocks an engine step prefills at most (at least 1).
    fn chunk_blocks(&self) -> usize {
        (self.chunk_tokens / self.block_size.max(1)).max(1)
    }
}

/// How long a new request waits for room in an endpoint's cache ([`PinnedBlocks::room_wait_s`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(super) struct RoomWaitTime {
    /// Seconds until the last end it waits for.
    pub wait_s: f64,
    /// The share of the blocks it needs that fit, in whole prefill chunks, in those free before
    /// that last end: vLLM admits a prompt chunk by chunk as room is made (each chunk once its
    /// blocks fit), so that share of its prefill runs during the wait and only the rest after.
    pub prefilled_share: f64,
}

/// The share of a request's `needed` blocks prefilled in whole chunks of `chunk_blocks` into
/// `free` blocks, in [0, 1]: vLLM admits a waiting request a chunk at a time, each chunk once
/// its blocks fit, so a prompt no longer than a chunk waits whole.
fn prefilled_share(free: i64, needed: i64, chunk_blocks: usize) -> f64 {
    if needed <= 0 {
        return 1.0;
    }
    let chunk = chunk_blocks.max(1) as i64;
    let in_chunks = free.clamp(0, needed) / chunk * chunk;
    in_chunks as f64 / needed as f64
}

/// When a request's prefill ends: its own `prefill_s` after the prefill queued ahead of it is
/// done (at `queued_until`), or after the room for it is made (at `room_until`) less the share
/// of it prefilled in the blocks free before (`prefilled_share`), whichever is later. The same
/// expression serves any origin of time (absolute, or seconds from now).
pub(super) fn prefill_done_at(
    queued_until: f64,
    room_until: f64,
    prefill_s: f64,
    prefilled_share: f64,
) -> f64 {
    (queued_until + prefill_s).max(room_until + prefill_s * (1.0 - prefilled_share))
}

impl PinnedBlocks {
    /// Request `id` was sent here with its full blocks' `keys`; its prefill can end at
    /// `prefill_end` at the earliest, the last `prefill_s` of it its own. Ids are given in the
    /// order requests are sent (the order the engine queues them in).
    pub(super) fn pin(
        &mut self,
        id: u64,
        keys: Arc<Vec<RouterKey>>,
        prompt_tokens: usize,
        block_size: usize,
        prefill_end: f64,
        prefill_s: f64,
    ) {
        self.releases = OnceLock::new();
        self.generation += 1;
        let extra_blocks = self
            .footprint_blocks(prompt_tokens, block_size)
            .saturating_sub(keys.len())
            .max(1);
        self.set.add(&keys, extra_blocks);
        if let Some(old) = self.requests.insert(
            id,
            PinnedRequest {
                keys,
                extra_blocks,
                prefill_end,
                prefill_s: prefill_s.max(0.0),
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

    /// Request `id` ended at `now` having generated `output_tokens` (the engine's count, if it
    /// said): its blocks are no longer pinned by it. Returns its keys and its decode time
    /// (first token to end), learned here with its output length, if it had a first token;
    /// `None` for an unknown request.
    pub(super) fn unpin(
        &mut self,
        id: u64,
        now: f64,
        output_tokens: Option<usize>,
    ) -> Option<Unpinned> {
        let r = self.requests.remove(&id)?;
        self.release(&r);
        let decode_s = r.first_token_at.map(|first| (now - first).max(0.0));
        if let Some(sample) = decode_s {
            self.decode_s = Some(averaged(self.decode_s, sample));
        }
        if let (Some(tokens), Some(_)) = (output_tokens, r.first_token_at) {
            self.output_tokens = Some(averaged(self.output_tokens, tokens as f64));
        }
        Some(Unpinned {
            keys: r.keys,
            decode_s,
        })
    }

    fn release(&mut self, r: &PinnedRequest) {
        self.releases = OnceLock::new();
        self.generation += 1;
        self.set.remove(&r.keys, r.extra_blocks);
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

    /// Seconds from first token to end, averaged over the requests that ended here.
    pub(super) fn decode_s(&self) -> Option<f64> {
        self.decode_s
    }

    /// Blocks a request of `prompt_tokens` holds by its end here: its prompt and the output
    /// this endpoint's requests generate on average (none until one has ended with a count).
    fn footprint_blocks(&self, prompt_tokens: usize, block_size: usize) -> usize {
        prompt_tokens
            .saturating_add(self.expected_output_tokens())
            .div_ceil(block_size.max(1))
    }

    fn expected_output_tokens(&self) -> usize {
        self.output_tokens.unwrap_or(0.0).round() as usize
    }

    /// Changes of the in-flight chains so far (a figure derived from them is current while
    /// this is unchanged).
    pub(super) fn generation(&self) -> u64 {
        self.generation
    }

    /// Blocks pinned now.
    pub(super) fn blocks(&self) -> usize {
        self.set.blocks()
    }

    /// The in-flight requests' key chains in [`chain_order`], each with its request count.
    pub(super) fn chains(&self) -> &[(Arc<Vec<RouterKey>>, u32)] {
        &self.set.chains
    }

    /// Distinct keys the in-flight requests hold.
    pub(super) fn distinct_keys(&self) -> usize {
        self.set.distinct_keys
    }

    /// Blocks the in-flight requests pin beyond their prompts' full blocks.
    pub(super) fn extra_blocks(&self) -> usize {
        self.set.extra_blocks
    }

    /// Leading keys of `keys` that some in-flight request pins (keys chain their parents, so a
    /// pinned key's whole prefix is pinned).
    pub(super) fn pinned_prefix(&self, keys: &[RouterKey]) -> usize {
        longest_shared(&self.set.chains, keys)
    }

    /// How much of the leading keys of `keys` that in-flight requests pin is still pinned when
    /// a request queued now is admitted at `admitted_at`. A request is expected to end a
    /// decode time after it was last heard of (this endpoint's, else `fallback_decode_s`);
    /// where neither is known, every pin is taken to hold.
    ///
    /// A prefix pinned only by requests that end first is freed when the last of them ends, and
    /// the requests admitted ahead of the new one may evict it before it is admitted (traced: a
    /// tenant's context pinned by a request ending 1 ms later was costed as certain to be
    /// found, behind two queued requests of another tenant that each filled the cache; it was
    /// found evicted, 558 ms against 225 predicted).
    pub(super) fn pinned_at(
        &self,
        keys: &[RouterKey],
        admitted_at: f64,
        fallback_decode_s: Option<f64>,
    ) -> PinnedAt {
        let pinned = self.pinned_prefix(keys);
        let every_pin_holds = PinnedAt::every_pin_holds(pinned);
        let Some(decode_s) = self.decode_s.or(fallback_decode_s) else {
            return every_pin_holds;
        };
        if pinned == 0 {
            return every_pin_holds;
        }
        let end = |r: &PinnedRequest| r.heard_at() + decode_s;
        let shares = |r: &PinnedRequest| common_prefix(&r.keys, &keys[..pinned]);
        let held = self
            .requests
            .values()
            .filter(|r| end(r) > admitted_at)
            .map(shares)
            .max()
            .unwrap_or(0);
        if held >= pinned {
            return every_pin_holds;
        }
        // Freed when the last request pinning more than what stays pinned ends: newer than it
        // then are the blocks of every request ending later (the queue ahead's among them).
        let freed_at = self
            .requests
            .values()
            .filter(|r| shares(r) > held)
            .map(end)
            .fold(f64::NEG_INFINITY, f64::max);
        let mut later: Vec<&PinnedRequest> = self
            .requests
            .values()
            .filter(|r| end(r) > freed_at)
            .collect();
        later.sort_by(|a, b| chain_order(&a.keys, &b.keys));
        let mut newer_than_freed = 0;
        let mut previous: &[RouterKey] = &[];
        for r in later {
            newer_than_freed += r.keys.len() - common_prefix(previous, &r.keys) + r.extra_blocks;
            previous = &r.keys;
        }
        PinnedAt {
            held,
            pinned,
            newer_than_freed,
        }
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
    pub(super) fn room_wait_s(&self, asked: &RoomAsked<'_>) -> RoomWaitTime {
        self.room_wait(asked, false)
    }

    /// [`Self::room_wait_s`] counting only the ends of the requests admitted already (those
    /// that had their first token): a lower bound on when a request queued now is admitted,
    /// the earliest end of its prefill is counted from. The ends of requests still queued are
    /// themselves estimates counted from such waits, and a chain of them runs away (each link
    /// adds the model's error: traced at 17–45 s too long, docs/benchmarks-log.md).
    pub(super) fn admitted_room_wait_s(&self, asked: &RoomAsked<'_>) -> RoomWaitTime {
        self.room_wait(asked, true)
    }

    fn room_wait(&self, asked: &RoomAsked<'_>, admitted_only: bool) -> RoomWaitTime {
        let none = RoomWaitTime::default();
        let pinned = self.blocks();
        if pinned == 0 || asked.capacity_blocks == 0 {
            return none;
        }
        let Some(decode_s) = self.decode_s.or(asked.fallback_decode_s) else {
            // No request has ended here yet: nothing says how long one runs.
            return none;
        };
        let blocks = self
            .footprint_blocks(asked.prompt_tokens, asked.block_size)
            .max(1);
        // Negative when more is pinned than the cache holds (an estimate's error).
        let room = asked.capacity_blocks as i64 - pinned as i64;
        if blocks as i64 <= room {
            // Fits even with nothing shared: no need to look the keys up.
            return none;
        }
        let shared = self.pinned_prefix(asked.keys);
        let needed = (blocks - shared.min(blocks)) as i64;
        if needed <= room {
            return none;
        }
        let uncached;
        let releases = if admitted_only {
            uncached = self.releases_of(true, None);
            &uncached
        } else {
            let wanted = Some(Admissions {
                capacity: asked.capacity_blocks,
                decode_s,
                chunk_blocks: asked.chunk_blocks(),
            });
            let cached = self
                .releases
                .get_or_init(|| self.releases_of(false, wanted));
            if cached.admissions_for == wanted {
                cached
            } else {
                // Asked with another cache size or decode time than the cached releases were
                // made for (a fleet prior that moved): made again, not cached.
                uncached = self.releases_of(false, wanted);
                &uncached
            }
        };
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
        let Some(last) = made_room(at) else {
            return none;
        };
        // The blocks free before the last end it waits for: vLLM admits a prompt chunk by
        // chunk as room is made, so the whole chunks they hold are prefilled during the wait.
        let last_at = at.min(steps.len() - 1);
        let free_before = room + last_at.checked_sub(1).map_or(0, |i| steps[i].freed);
        RoomWaitTime {
            wait_s: wait(last),
            prefilled_share: prefilled_share(free_before, needed, asked.chunk_blocks()),
        }
    }

    /// The in-flight requests in the order they are expected to end, with the blocks freed by
    /// each end (a block is freed once every request holding it has ended): a request's end
    /// frees its keys past the longest prefix it shares with a request ending after it, found
    /// by walking the order backwards with the later chains in order. `admitted_only`: steps
    /// for the admitted requests alone, the others taken to hold their blocks past every one
    /// of them (their keys follow the steps' in [`Releases::keys`]). `admissions`: what to
    /// simulate the queued requests' admissions with
    /// ([`Self::queued_prefill_ends`]); without them a queued request is heard of at the
    /// earliest end of its prefill.
    fn releases_of(&self, admitted_only: bool, admissions: Option<Admissions>) -> Releases {
        type Listed<'a> = Vec<(u64, &'a PinnedRequest)>;
        let (order, queued): (Listed<'_>, Listed<'_>) = self
            .requests
            .iter()
            .map(|(id, r)| (*id, r))
            .partition(|(_, r)| !admitted_only || r.first_token_at.is_some());
        let simulated = match admissions {
            Some(admissions) if !admitted_only => self.queued_prefill_ends(admissions),
            _ => HashMap::new(),
        };
        let heard_at = |id: u64, r: &PinnedRequest| {
            simulated.get(&id).copied().unwrap_or_else(|| r.heard_at())
        };
        let mut order: Vec<(f64, &PinnedRequest)> = order
            .into_iter()
            .map(|(id, r)| (heard_at(id, r), r))
            .collect();
        order.sort_by(|a, b| a.0.total_cmp(&b.0));
        let queued: Vec<&PinnedRequest> = queued.into_iter().map(|(_, r)| r).collect();
        let mut later: Vec<(Arc<Vec<RouterKey>>, u32)> = Vec::with_capacity(order.len());
        for r in &queued {
            if let Err(at) = find_chain(&later, &r.keys) {
                later.insert(at, (r.keys.clone(), 1));
            }
        }
        let mut own_freed = vec![0i64; order.len()];
        for (i, (_, r)) in order.iter().enumerate().rev() {
            let chain: &[RouterKey] = &r.keys;
            own_freed[i] = (r.extra_blocks + chain.len() - longest_shared(&later, chain)) as i64;
            if let Err(at) = find_chain(&later, chain) {
                later.insert(at, (r.keys.clone(), 1));
            }
        }
        let mut freed = 0i64;
        let mut releases = Releases {
            admissions_for: admissions.filter(|_| !admitted_only),
            ..Releases::default()
        };
        for ((heard_at, r), own) in order.into_iter().zip(own_freed) {
            freed += own;
            releases.steps.push(Release { heard_at, freed });
            releases.keys.push(r.keys.clone());
        }
        releases.keys.extend(queued.iter().map(|r| r.keys.clone()));
        releases
    }

    /// When each queued request (sent, no first token yet) is expected to finish its prefill,
    /// by id: vLLM admits its waiting requests first come first served, each once its blocks
    /// fit beside those of the requests running then, so a queued request is admitted no
    /// earlier than the one queued before it, and no earlier than the requests ahead of it
    /// have ended for its blocks to fit in the cache. The running requests end a decode time
    /// after their first token, each queued one a decode time after its simulated prefill, of
    /// which the whole chunks that fit before its last wait ends run during the wait. Without
    /// this a queue of requests that each fill the cache was taken to end all at once, a
    /// decode after the running request's end, and the wait behind it read several
    /// residencies short (traced: 0.76 s predicted, 6.26 s waited behind three such requests,
    /// docs/benchmarks-log.md).
    ///
    /// A request is never admitted before the earliest end of its prefill less its own
    /// prefill (the prefill queued ahead of it, or the wait for the admitted requests' ends,
    /// as counted when it was sent). One pass over the ends in order, each end looked at once:
    /// a request admitted later than another finds every request the other's admission saw
    /// end already ended.
    fn queued_prefill_ends(&self, admissions: Admissions) -> HashMap<u64, f64> {
        let Admissions {
            capacity, decode_s, ..
        } = admissions;
        let mut queued: Vec<(u64, &PinnedRequest)> = self
            .requests
            .iter()
            .filter(|(_, r)| r.first_token_at.is_none())
            .map(|(id, r)| (*id, r))
            .collect();
        if queued.is_empty() {
            return HashMap::new();
        }
        queued.sort_by_key(|(id, _)| *id);
        let mut present = ChainSet::default();
        let mut ends = Ends::default();
        for (id, r) in &self.requests {
            if let Some(first) = r.first_token_at {
                present.add(&r.keys, r.extra_blocks);
                ends.push(first + decode_s, *id);
            }
        }
        // The earliest end still to come ends at `at` or later: `at` moves to it, and the
        // request's blocks leave `present`.
        let end_first = |ends: &mut Ends, present: &mut ChainSet, at: &mut f64| {
            if let Some((end, id)) = ends.pop() {
                *at = at.max(end);
                if let Some(ended) = self.requests.get(&id) {
                    present.remove(&ended.keys, ended.extra_blocks);
                }
            }
        };
        let mut simulated = HashMap::with_capacity(queued.len());
        let mut admitted_at = f64::NEG_INFINITY;
        for (id, r) in queued {
            let start = admitted_at.max(r.prefill_end - r.prefill_s);
            let mut at = start;
            while ends.first().is_some_and(|end| end <= at) {
                end_first(&mut ends, &mut present, &mut at);
            }
            // The whole chunks that fit in the blocks free before the last end it waits for are
            // prefilled during the wait.
            let mut share = 0.0;
            loop {
                let with = present.blocks_with(&r.keys, r.extra_blocks);
                if with <= capacity || ends.is_empty() {
                    break;
                }
                let free = capacity as i64 - present.blocks() as i64;
                let own = (with - present.blocks()) as i64;
                share = prefilled_share(free, own, admissions.chunk_blocks);
                end_first(&mut ends, &mut present, &mut at);
            }
            admitted_at = at;
            let prefill_end = prefill_done_at(start, at, r.prefill_s, share);
            present.add(&r.keys, r.extra_blocks);
            ends.push(prefill_end + decode_s, id);
            simulated.insert(id, prefill_end);
        }
        simulated
    }
}

/// Requests by expected end, earliest first, for [`PinnedBlocks::queued_prefill_ends`]. An end
/// is kept as the bits of a non-negative number (they order as the numbers do); a negative,
/// NaN or negative-zero end counts as 0, the earliest (times on the fleet's clock are not
/// negative).
#[derive(Default)]
struct Ends(BinaryHeap<Reverse<(u64, u64)>>);

impl Ends {
    fn push(&mut self, end: f64, id: u64) {
        // `max` drops a NaN; `+ 0.0` turns a negative zero positive.
        self.0.push(Reverse(((end.max(0.0) + 0.0).to_bits(), id)));
    }

    fn pop(&mut self) -> Option<(f64, u64)> {
        self.0
            .pop()
            .map(|Reverse((end, id))| (f64::from_bits(end), id))
    }

    fn first(&self) -> Option<f64> {
        self.0.peek().map(|Reverse((end, _))| f64::from_bits(*end))
    }

    fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// Key chains, each with its count, and the distinct blocks they and their extra blocks hold:
/// what [`PinnedBlocks`] keeps of its requests, and what its simulation of their admissions
/// keeps of the requests present at each step.
#[derive(Clone, Debug, Default)]
struct ChainSet {
    /// The chains in [`chain_order`], each with the number of requests that have exactly it.
    chains: Vec<(Arc<Vec<RouterKey>>, u32)>,
    /// Distinct keys the chains hold.
    distinct_keys: usize,
    /// Blocks held beyond the keys.
    extra_blocks: usize,
}

impl ChainSet {
    /// Adds a request's chain and its extra blocks.
    fn add(&mut self, keys: &Arc<Vec<RouterKey>>, extra_blocks: usize) {
        self.distinct_keys += keys.len() - longest_shared(&self.chains, keys);
        match find_chain(&self.chains, keys) {
            Ok(at) => self.chains[at].1 += 1,
            Err(at) => self.chains.insert(at, (keys.clone(), 1)),
        }
        self.extra_blocks += extra_blocks;
    }

    /// Takes a request's chain and extra blocks out again.
    fn remove(&mut self, keys: &[RouterKey], extra_blocks: usize) {
        if let Ok(at) = find_chain(&self.chains, keys) {
            self.chains[at].1 -= 1;
            if self.chains[at].1 == 0 {
                self.chains.remove(at);
            }
            // Its keys no remaining chain shares are freed (none, when another has the same
            // chain). Never below zero, should two keys ever collide.
            let freed = keys.len() - longest_shared(&self.chains, keys);
            self.distinct_keys = self.distinct_keys.saturating_sub(freed);
        }
        self.extra_blocks = self.extra_blocks.saturating_sub(extra_blocks);
    }

    /// Blocks held.
    fn blocks(&self) -> usize {
        self.distinct_keys + self.extra_blocks
    }

    /// Blocks held once a request with `keys` and `extra_blocks` is added.
    fn blocks_with(&self, keys: &[RouterKey], extra_blocks: usize) -> usize {
        self.blocks() + keys.len() - longest_shared(&self.chains, keys) + extra_blocks
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

/// The lexicographic order of two key chains, found from the first key they differ in (keys
/// chain their parents: chains equal at one position are equal at every one before it).
fn chain_order(a: &[RouterKey], b: &[RouterKey]) -> Ordering {
    let same = common_prefix(a, b);
    a.get(same).cmp(&b.get(same))
}

/// Where `keys` is in `chains` (in [`chain_order`]): `Ok` with its place, or `Err` with the
/// place it would go.
pub(super) fn find_chain(
    chains: &[(Arc<Vec<RouterKey>>, u32)],
    keys: &[RouterKey],
) -> Result<usize, usize> {
    chains.binary_search_by(|(chain, _)| chain_order(chain, keys))
}

/// The longest prefix `keys` shares with any of `chains` (in [`chain_order`]): the longer of
/// what it shares with its neighbours in that order.
pub(super) fn longest_shared(chains: &[(Arc<Vec<RouterKey>>, u32)], keys: &[RouterKey]) -> usize {
    let at = match find_chain(chains, keys) {
        Ok(_) => return keys.len(),
        Err(at) => at,
    };
    let before = at.checked_sub(1).map(|i| &chains[i]);
    [before, chains.get(at)]
        .into_iter()
        .flatten()
        .map(|(chain, _)| common_prefix(chain, keys))
        .max()
        .unwrap_or(0)
}

/// Leading keys `a` and `b` share (keys chain their parents: equal at one position means
/// equal at every one before).
pub(super) fn common_prefix(a: &[RouterKey], b: &[RouterKey]) -> usize {
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
            // A chunk of one block: the blocks free before the room is made are prefilled
            // while the request waits, whatever their number.
            chunk_tokens: 16,
            now,
        }
    }

    /// An endpoint where one request ran and decoded for 0.4 s (from 0.1 to 0.5): the decode
    /// time it has learned. Request ids from 2 are free.
    fn decoding_for_0_4_s() -> PinnedBlocks {
        let mut pinned = PinnedBlocks::default();
        pinned.pin(1, keys(99, 10), 168, 16, 0.0, 0.0);
        pinned.first_token(1, 0.1);
        pinned.unpin(1, 0.5, None);
        pinned
    }

    /// Pins request `id` with `keys` at `at` and gives it its first token then.
    fn running(pinned: &mut PinnedBlocks, id: u64, keys: Arc<Vec<RouterKey>>, at: f64) {
        let tokens = keys.len() * 16 + 8;
        pinned.pin(id, keys, tokens, 16, at, 0.0);
        pinned.first_token(id, at);
    }

    #[test]
    fn a_request_that_fits_beside_the_pinned_blocks_waits_for_nothing() {
        let mut pinned = decoding_for_0_4_s();
        pinned.pin(2, keys(2, 100), 100 * 16 + 8, 16, 0.6, 0.0);
        let new = keys(3, 100);
        assert_eq!(pinned.room_wait_s(&asked(&new, 300, 0.6)).wait_s, 0.0);
    }

    #[test]
    fn a_request_that_does_not_fit_waits_for_the_first_end_that_makes_room() {
        let mut pinned = decoding_for_0_4_s();
        // Two running requests of 100 blocks each (+1): 202 of 250 pinned.
        running(&mut pinned, 2, keys(2, 100), 1.0);
        running(&mut pinned, 3, keys(3, 100), 1.2);
        let new = keys(4, 100);
        let wait = pinned.room_wait_s(&asked(&new, 250, 1.3)).wait_s;
        assert!((wait - 0.1).abs() < 1e-9, "request 2 ends at 1.4: {wait}");
        // A cache of 200 needs both to end.
        let wait = pinned.room_wait_s(&asked(&new, 200, 1.3)).wait_s;
        assert!((wait - 0.3).abs() < 1e-9, "request 3 ends at 1.6: {wait}");
    }

    #[test]
    fn only_whole_chunks_that_fit_before_the_room_is_made_are_prefilled_during_the_wait() {
        let mut pinned = decoding_for_0_4_s();
        // One running request of 100 blocks (+1) in a cache of 150: 49 blocks free until it
        // ends at 1.4. A new request of 101 blocks waits for that end.
        running(&mut pinned, 2, keys(2, 100), 1.0);
        let new = keys(4, 100);
        let with_chunk = |chunk_tokens| {
            let asked = RoomAsked {
                chunk_tokens,
                ..asked(&new, 150, 1.3)
            };
            pinned.room_wait_s(&asked)
        };
        // Chunks of 32 blocks: one fits in the 49, so 32 of its 101 blocks are prefilled while
        // it waits; a chunk of 2,048 tokens (128 blocks) holds the whole prompt, which vLLM
        // admits only once it fits whole: nothing is prefilled before the end.
        for (chunk_tokens, share) in [(16, 49.0 / 101.0), (512, 32.0 / 101.0), (2_048, 0.0)] {
            let wait = with_chunk(chunk_tokens);
            assert!((wait.wait_s - 0.1).abs() < 1e-9, "{wait:?}");
            assert!(
                (wait.prefilled_share - share).abs() < 1e-9,
                "{chunk_tokens}: {wait:?}"
            );
        }
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
        assert_eq!(
            pinned.room_wait_s(&asked(&same_tenant, 120, 1.2)).wait_s,
            0.0
        );
        // Another tenant's 105 blocks wait for the context itself to be freed: both end.
        let other = chain(2, 100, 5, 5);
        let wait = pinned.room_wait_s(&asked(&other, 120, 1.2)).wait_s;
        assert!((wait - 0.3).abs() < 1e-9, "request 3 ends at 1.5: {wait}");
        // In a cache of 117 the same tenant's question waits for one question to end, whose
        // context blocks it shares free nothing for it.
        let wait = pinned.room_wait_s(&asked(&same_tenant, 117, 1.2)).wait_s;
        assert!((wait - 0.2).abs() < 1e-9, "request 2 ends at 1.4: {wait}");
    }

    #[test]
    fn the_admitted_wait_counts_only_the_ends_of_requests_that_had_their_first_token() {
        let mut pinned = decoding_for_0_4_s();
        // Two running requests of 100 blocks each (+1) end at 1.4 and 1.6; a third is queued
        // (its prefill could end at 1.3 at the earliest, so it would end at 1.7).
        running(&mut pinned, 2, keys(2, 100), 1.0);
        running(&mut pinned, 3, keys(3, 100), 1.2);
        pinned.pin(5, keys(5, 100), 100 * 16 + 8, 16, 1.3, 0.0);
        let new = keys(4, 100);
        // A cache of 310 holds the three and needs one end for a fourth: the first, at 1.4.
        assert!((pinned.room_wait_s(&asked(&new, 310, 1.3)).wait_s - 0.1).abs() < 1e-9);
        assert!((pinned.admitted_room_wait_s(&asked(&new, 310, 1.3)).wait_s - 0.1).abs() < 1e-9);
        // A cache of 110 holds one request: the queued one is admitted once both running ones
        // have ended, at 1.6, and ends at 2.0; the new one waits for that. The admitted
        // requests' ends alone are not enough, so the admitted wait is the last of them, at 1.6.
        assert!((pinned.room_wait_s(&asked(&new, 110, 1.3)).wait_s - 0.7).abs() < 1e-9);
        assert!((pinned.admitted_room_wait_s(&asked(&new, 110, 1.3)).wait_s - 0.3).abs() < 1e-9);
    }

    #[test]
    fn queued_requests_are_admitted_first_come_first_served_each_once_it_fits() {
        // A cache of 150 holds one request of 100 blocks (+1) at a time. One runs until 1.4
        // (decodes take 0.4 s); three are queued behind it, each with 0.05 s of prefill.
        let mut pinned = decoding_for_0_4_s();
        running(&mut pinned, 2, keys(2, 100), 1.0);
        for id in 3..6 {
            pinned.pin(id, keys(id, 100), 100 * 16 + 8, 16, 1.05, 0.05);
        }
        let new = keys(9, 100);
        // Each queued request waits for the one before it to end. It is admitted chunk by
        // chunk as room is made: the 49 of its 101 blocks free before that end are prefilled
        // during the wait, the other 52 after it (0.05 s × 52/101). So each ends 0.4 + 0.05 ×
        // 52/101 s after the one before, from 1.4; the new request waits for the last, until
        // 1.4 + 3 × (0.4 + 0.05 × 52/101), and it too finds 49 of its 101 blocks free before.
        let wait = pinned.room_wait_s(&asked(&new, 150, 1.1));
        let expected = 1.4 + 3.0 * (0.4 + 0.05 * 52.0 / 101.0) - 1.1;
        assert!((wait.wait_s - expected).abs() < 1e-9, "{wait:?}");
        assert!(
            (wait.prefilled_share - 49.0 / 101.0).abs() < 1e-9,
            "{wait:?}"
        );
        // Where the cache holds all four at once, nothing waits: the new one fits beside them
        // only once the first has ended, at 1.4.
        let wait = pinned.room_wait_s(&asked(&new, 404, 1.1)).wait_s;
        assert!((wait - 0.3).abs() < 1e-9, "{wait}");
        // Requests that share a context are admitted together where their own blocks fit.
        let mut pinned = decoding_for_0_4_s();
        running(&mut pinned, 2, chain(1, 100, 2, 5), 1.0);
        for id in 3..6 {
            pinned.pin(id, chain(1, 100, id, 5), 105 * 16 + 8, 16, 1.05, 0.05);
        }
        // 100 context blocks and 4 × 6 of their own: 124 of 130. The queued ones are admitted
        // as early as they can be, at 1.0, and end at 1.45, so a request of another tenant
        // (106 blocks) waits for the context to go, at 1.45.
        let other = chain(2, 100, 9, 5);
        let wait = pinned.room_wait_s(&asked(&other, 130, 1.1)).wait_s;
        assert!((wait - 0.35).abs() < 1e-9, "{wait}");
    }

    #[test]
    fn what_an_endpoint_releases_follows_each_change_of_its_requests() {
        let mut pinned = decoding_for_0_4_s();
        running(&mut pinned, 2, keys(2, 100), 1.0);
        let new = keys(4, 100);
        // 101 of 150 pinned: the new request waits for request 2 (ends at 1.4).
        assert!((pinned.room_wait_s(&asked(&new, 150, 1.1)).wait_s - 0.3).abs() < 1e-9);
        // A second request pins 61 more and ends at 1.55: the new one now waits for both.
        running(&mut pinned, 3, keys(3, 60), 1.15);
        assert!((pinned.room_wait_s(&asked(&new, 150, 1.2)).wait_s - 0.35).abs() < 1e-9);
        // Request 2 ends after 0.3 s of decoding (learned: 0.8 × 0.4 + 0.2 × 0.3 = 0.38 s): the
        // new request waits for request 3 alone, until 1.15 + 0.38.
        pinned.unpin(2, 1.3, None);
        assert!((pinned.room_wait_s(&asked(&new, 150, 1.3)).wait_s - 0.23).abs() < 1e-9);
    }

    #[test]
    fn a_request_is_counted_with_the_output_requests_there_generate() {
        // Requests there end having generated 160 tokens: 10 more blocks each.
        let mut pinned = decoding_for_0_4_s();
        pinned.pin(2, keys(9, 10), 168, 16, 0.6, 0.0);
        pinned.first_token(2, 0.6);
        pinned.unpin(2, 1.0, Some(160));
        assert_eq!(pinned.output_tokens, Some(160.0));
        // A running request of 100 blocks, its partial block and its output: 111 pinned.
        running(&mut pinned, 3, keys(3, 100), 1.0);
        assert_eq!(pinned.blocks(), 111);
        // A new request of 100 blocks (and 8 tokens) fits beside its prompt in 220 blocks, but
        // not with both outputs: it waits for the running one (its decode learned: 0.4 s, then
        // 0.8 × 0.4 + 0.2 × 0.4).
        let new = keys(4, 100);
        let wait = pinned.room_wait_s(&asked(&new, 220, 1.1)).wait_s;
        assert!((wait - 0.3).abs() < 1e-9, "request 3 ends at 1.4: {wait}");
        assert_eq!(pinned.room_wait_s(&asked(&new, 222, 1.1)).wait_s, 0.0);
    }

    #[test]
    fn output_is_learned_only_from_requests_that_ran_with_a_count() {
        let mut pinned = PinnedBlocks::default();
        // No first token: it never decoded, whatever it says.
        pinned.pin(1, keys(1, 10), 168, 16, 0.0, 0.0);
        pinned.unpin(1, 0.5, Some(500));
        // No count (a stream without usage): nothing learned either.
        running(&mut pinned, 2, keys(2, 10), 0.5);
        pinned.unpin(2, 0.9, None);
        assert_eq!(pinned.output_tokens, None);
        // Until one is learned, a request counts its prompt alone.
        running(&mut pinned, 3, keys(3, 10), 1.0);
        assert_eq!(pinned.blocks(), 11);
        running(&mut pinned, 4, keys(4, 10), 1.0);
        pinned.unpin(4, 1.5, Some(100));
        running(&mut pinned, 5, keys(5, 10), 1.6);
        pinned.unpin(5, 2.0, Some(200));
        // 0.8 × 100 + 0.2 × 200 = 120 tokens: the prompt's last 8 tokens and 120 in 8 blocks.
        assert_eq!(pinned.output_tokens, Some(120.0));
        running(&mut pinned, 6, keys(6, 10), 2.0);
        assert_eq!(pinned.blocks(), 11 + 10 + 8);
    }

    #[test]
    fn ended_and_expired_requests_pin_nothing() {
        let mut pinned = PinnedBlocks::default();
        pinned.pin(1, chain(1, 50, 1, 5), 888, 16, 0.5, 0.0);
        pinned.pin(2, chain(1, 50, 2, 5), 888, 16, 0.6, 0.0);
        pinned.first_token(2, 0.7);
        assert_eq!(pinned.blocks(), 62);
        pinned.unpin(1, 1.0, None);
        assert_eq!(pinned.blocks(), 56);
        assert_eq!(pinned.decode_s, None, "request 1 had no first token");
        assert_eq!(pinned.expire(0.8), 1);
        assert_eq!(pinned.blocks(), 0);
        assert!(pinned.set.chains.is_empty());
        assert_eq!(pinned.set.distinct_keys, 0);
    }

    /// The pinned blocks, counted key by key: what each key's holders say.
    #[derive(Default)]
    struct Naive {
        requests: Vec<(u64, Arc<Vec<RouterKey>>, usize, f64)>,
    }

    impl Naive {
        fn holders(&self) -> std::collections::HashMap<RouterKey, u32> {
            let mut holders = std::collections::HashMap::new();
            for (_, keys, _, _) in &self.requests {
                for key in keys.iter() {
                    *holders.entry(*key).or_insert(0) += 1;
                }
            }
            holders
        }

        fn blocks(&self) -> usize {
            self.holders().len() + self.requests.iter().map(|r| r.2).sum::<usize>()
        }

        fn pinned_prefix(&self, keys: &[RouterKey]) -> usize {
            let holders = self.holders();
            keys.iter().take_while(|k| holders.contains_key(k)).count()
        }

        /// Blocks freed after each end, in the order of `heard_at` (ties: any order, so the
        /// test gives each request its own time).
        fn freed(&self) -> Vec<i64> {
            let mut order: Vec<_> = self.requests.iter().collect();
            order.sort_by(|a, b| a.3.total_cmp(&b.3));
            let mut holders = self.holders();
            let mut freed = 0i64;
            let mut steps = Vec::new();
            for (_, keys, extra, _) in order {
                freed += *extra as i64;
                for key in keys.iter() {
                    let n = holders.get_mut(key).unwrap();
                    *n -= 1;
                    if *n == 0 {
                        freed += 1;
                    }
                }
                steps.push(freed);
            }
            steps
        }
    }

    /// A real key chain (each key names its whole prefix): `shared` blocks of tenant `tenant`'s
    /// context, then `own` blocks of question `question`.
    fn real_chain(tenant: u64, shared: u64, question: u64, own: u64) -> Arc<Vec<RouterKey>> {
        let blocks = (0..shared)
            .map(|j| (tenant, j))
            .chain((0..own).map(|j| (100 + question, j)));
        let mut parent = 0u64;
        Arc::new(
            blocks
                .map(|(label, j)| {
                    // splitmix64 of (parent, block): distinct prefixes, distinct keys.
                    let mut z = parent
                        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
                        .wrapping_add(label << 32 | (j + 1));
                    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                    parent = z ^ (z >> 31);
                    RouterKey(parent)
                })
                .collect(),
        )
    }

    proptest::proptest! {
        /// Pinning and unpinning requests of a few tenants (each a shared context, questions
        /// under it, some with the same prompt) keeps the same pinned blocks, pinned prefixes
        /// and releases as counting every key's holders.
        #[test]
        fn chains_in_order_count_what_each_keys_holders_say(
            ops in proptest::collection::vec((0u8..3, 0u64..3, 0u64..12, 0u64..4, 0u64..6), 1..60),
        ) {
            let mut pinned = PinnedBlocks::default();
            let mut naive = Naive::default();
            let mut next_id = 0u64;
            for (i, (op, tenant, shared, question, own)) in ops.into_iter().enumerate() {
                let at = i as f64;
                match op {
                    // Pin a question under a tenant's context (a context cut short: its prefix).
                    0 | 1 => {
                        let keys = real_chain(tenant, shared, question, own);
                        let tokens = keys.len() * 16 + 8;
                        pinned.pin(next_id, keys.clone(), tokens, 16, at, 0.0);
                        naive.requests.push((next_id, keys, 1, at));
                        next_id += 1;
                    }
                    // Unpin the oldest.
                    _ => {
                        if !naive.requests.is_empty() {
                            let (id, ..) = naive.requests.remove(0);
                            pinned.unpin(id, at, None);
                        }
                    }
                }
                proptest::prop_assert_eq!(pinned.blocks(), naive.blocks());
                let probe = real_chain(tenant, shared + 2, question + 1, own);
                proptest::prop_assert_eq!(pinned.pinned_prefix(&probe), naive.pinned_prefix(&probe));
                let freed: Vec<i64> = pinned.releases_of(false, None).steps.iter().map(|r| r.freed).collect();
                proptest::prop_assert_eq!(freed, naive.freed());
            }
        }
    }
}
