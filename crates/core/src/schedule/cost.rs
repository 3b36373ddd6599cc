//! The cost model: what an endpoint would spend on a request, in seconds.
//!
//! - **queue wait**: prefill tokens queued ahead of it at the endpoint's rate, plus a fixed wait
//!   per queued request (a request waiting for a batch slot also waits behind decodes);
//! - **prefill**: the prompt tokens it does not hold, at the endpoint's rate. An engine looks a
//!   request's prefix up only when it admits it, so what it holds now counts only as far as it
//!   survives the queue ahead: in a full cache the prefills queued ahead store their blocks
//!   first and evict cached ones, least recently used first, never those in-flight requests
//!   pin ([`super::recency`]: a part of the prefix survives while the distinct blocks used
//!   after it, the blocks running requests pin beyond their prompts and the part fit in the
//!   cache; where the fleet does not know when a block was last used, it is taken as equally
//!   likely as any to go, by the blocks the queue ahead stores beyond the free ones). At zero
//!   load everything held survives. On an endpoint that offloads to CPU memory an
//!   evicted block is loaded back from there instead (tier loading, and, as for a block found
//!   there, an eviction charge only where it makes a second GPU copy: see eviction);
//! - **tier loading**: blocks it holds on CPU, its storage or a shared filesystem it mounts,
//!   at each tier's load rate, learned per endpoint; a tier slower than recomputing gets no
//!   credit (see [`crate::tiers`]);
//! - **decode interference** (the stall it imposes on others): while it prefills, every running
//!   decode there waits (its next token comes after that step), and so do the requests that
//!   will queue behind it, in steady state as many as are queued there now (a queue that keeps
//!   its length has as many arrive behind a request as were ahead of it); charged as the
//!   seconds it occupies the engine's steps (its prefill, and its tier loads only where the
//!   connector loads in the step: [`crate::tiers::TierLoadMode`]) × (running decodes + queued
//!   requests) × a factor;
//! - **room blocking** (the wait it imposes on others): vLLM admits a request only once its
//!   blocks fit beside those its running requests reference, so where prompts are long against
//!   the cache, the requests that come while this one runs and do not fit beside it wait for
//!   its end. Charged as the rate at which such requests come there (the endpoint's recent
//!   requests' rate, times the share of them that would not fit beside this one: those that
//!   share its prefix need room only for the rest) × its residency (its prefill, its tier loads
//!   and the endpoint's learned decode time) squared / 2: those arriving over that time wait,
//!   on average, half of it. Zero wherever two requests fit in the cache together; where they
//!   do not, it sends a request to the endpoint whose traffic shares its prefix, rather than
//!   to one it would hold back (traced: a tenant's question sent to the engine of another
//!   tenant, whose context it held in CPU memory, made that tenant's next questions wait for
//!   it, docs/benchmarks.md);
//! - **eviction**: a vLLM cache is full in steady state, so the blocks this request stores
//!   there push out cached blocks (least recently used first) that other requests may have
//!   come back for. Charged as the blocks it stores beyond the endpoint's free blocks × their
//!   prefill seconds × the expected reuses of an evicted block there. That expectation is
//!   measured, per endpoint: recently, how many blocks its requests found cached for each block
//!   they stored (a block stored there is, on average, reused that many times before it is
//!   evicted), capped at 1 (an evicted block is prefilled again at most once before it is
//!   cached again), and taken as the fleet's while the endpoint has stored less than a cache's
//!   worth recently (nothing it stored had to be evicted yet). An endpoint whose cache turns
//!   over without reuse (a working set far above the cache) charges almost nothing; one whose
//!   blocks keep being reused charges their full re-prefill. A block it loads from a lower tier
//!   is stored on the GPU too, but where no endpoint holds it on its GPU, whichever serves the
//!   request must store it on one, so it is priced as a block found cached; where another
//!   endpoint that could serve the request holds it on its GPU ([`GpuCopies`], from the
//!   index), loading it here makes a second GPU copy, and it counts as stored. Before, priced
//!   as free: a document held on one engine's GPU and in another's CPU memory was served by
//!   both in turn, each reloading it and what it pushed out (the tier counter-case in
//!   docs/benchmarks.md).
//!
//! `total = prefix × (prefill + tier loading) + eviction × (re-prefill of evicted blocks) +
//! load × (queue wait + decode interference + room blocking) − session credit`. At zero load
//! and with room in the caches only the prefill terms remain, so the longest cached prefix is
//! always the cheapest; under load the queue wait grows until copying a hot prefix to another
//! endpoint pays for its prefill plus what the copy evicts there.

use serde::Serialize;

use super::{CacheSource, Candidate, EndpointLoad, IndexState, Profile, RequestInfo};
use crate::index::EndpointId;
use crate::tiers::{TierLoad, TierLoadMode, tier_load};

/// One candidate's cost, term by term, in seconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Cost {
    /// Waiting behind queued work: the larger of `queued_prefill_s` and `room_wait_s` less
    /// `room_prefilled_s`, plus `queued_requests_s`.
    pub queue_s: f64,
    /// Of `queue_s`: the prefill queued ahead, at the endpoint's prefill rate.
    pub queued_prefill_s: f64,
    /// Of `queue_s`: the wait for room in its cache, until enough of the running requests are
    /// expected to end for its blocks to fit.
    pub room_wait_s: f64,
    /// Of `room_wait_s`: the seconds of this request's own prefill that run during it. vLLM
    /// admits a prompt chunk by chunk as room is made, so the whole chunks that fit in the
    /// blocks free before the last end it waits for are prefilled while it waits, and only the
    /// rest after.
    pub room_prefilled_s: f64,
    /// Of `queue_s`: the requests queued ahead, each at the profile's `queue_wait_s`.
    pub queued_requests_s: f64,
    /// Computing the uncached part of the prompt, and what it holds that the queue ahead is
    /// expected to evict before the request is admitted.
    pub prefill_s: f64,
    /// Of the prompt tokens it holds, those the queue ahead is expected to evict before the
    /// request is admitted (counted in `prefill_s`).
    pub evicted_ahead_tokens: f64,
    /// Of the prompt tokens it would load from CPU memory, those the queue ahead's own offloads
    /// are expected to push out of that tier before the request is admitted (loaded from its
    /// storage where it offloads there too, else recomputed and counted in `prefill_s`).
    pub cpu_lost_ahead_tokens: f64,
    /// Loading the parts held on CPU, storage or a shared tier.
    pub tier_load_s: f64,
    /// `tier_load_s` tier by tier: tokens, rate, seconds, and whether each is credited.
    pub tiers: TierLoad,
    /// The seconds it occupies the engine's steps: its prefill, and its tier loads where they
    /// run in the step ([`crate::tiers::TierLoadMode::InStep`]).
    pub stalling_s: f64,
    /// The stall imposed on running decodes.
    pub decode_interference_s: f64,
    /// The wait imposed on requests that will come while it runs and will not fit in the
    /// cache beside it.
    pub room_blocking_s: f64,
    /// Cached blocks the placement evicts: the blocks it stores beyond the free ones, whether
    /// or not they would be reused (0 where the free blocks are unknown).
    pub evicted_blocks: f64,
    /// GPU blocks still free once the placement has stored its blocks (0 where it evicts;
    /// `None` where the free blocks are unknown): how long a new working set placed there
    /// lasts before it evicts anything (what balancing compares first where the profile reads a
    /// cache, see [`super::Picker`]).
    pub free_blocks_left: Option<f64>,
    /// Blocks `free_blocks_left` may overstate the room by: those the router's in-flight
    /// requests there hold or will hold beyond its free-block count
    /// ([`super::CacheView::unseen_blocks`]).
    pub unseen_blocks: f64,
    /// The expected re-prefill of the cached blocks the placement evicts.
    pub eviction_s: f64,
    /// Taken off for session affinity.
    pub session_credit_s: f64,
    /// The weighted total the picker compares.
    pub total_s: f64,
}

impl Cost {
    /// Predicted time to first token: queue wait, prefill and tier loading.
    pub fn predicted_ttft_s(&self) -> f64 {
        self.queue_s + self.prefill_s + self.tier_load_s
    }

    /// Prompt tokens the endpoint loads from tiers below its GPU memory at a charge (its CPU
    /// memory, storage, the shared filesystem, and GPU blocks the queue ahead pushes out to CPU
    /// memory); a tier credited as the GPU, as a tier-blind profile credits every tier, loads
    /// none.
    pub fn charged_tier_tokens(&self) -> usize {
        self.tiers.charged_tokens()
    }

    /// The weighted seconds due to what the endpoint does not hold, and what storing it there
    /// evicts.
    pub fn cache_part(&self, profile: &Profile) -> f64 {
        profile.weights.prefix * (self.prefill_s + self.tier_load_s)
            + profile.weights.eviction * self.eviction_s
    }

    /// The weighted seconds due to other work on the endpoint.
    pub fn load_part(&self, profile: &Profile) -> f64 {
        profile.weights.load * (self.queue_s + self.decode_interference_s + self.room_blocking_s)
    }
}

/// Prompt tokens a candidate holds, as the profile's cache source sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cached {
    /// On any tier.
    pub all: usize,
    /// On the GPU.
    pub gpu: usize,
    /// In CPU memory.
    pub cpu: usize,
    /// In the endpoint's own storage.
    pub storage: usize,
    /// Only on a shared tier it mounts.
    pub shared: usize,
}

/// Which picture of an endpoint's cache the cost counts, by [`counted_picture`].
enum Counted {
    /// Its index match, tier by tier.
    Index,
    /// So many blocks the router knows of (its history or its requests just sent), on the GPU.
    Router(u32),
}

/// The one rule for what the profile's cache `source` counts of an endpoint whose index (in
/// `state`) matches `index` blocks on any tier, whose routing history holds `history` and to
/// which `predicted` were just sent ([`countable_blocks`] and [`cached`] both read it).
fn counted_picture(
    source: CacheSource,
    state: IndexState,
    index: u32,
    history: u32,
    predicted: u32,
) -> Counted {
    match source {
        CacheSource::None => Counted::Router(0),
        CacheSource::Approximate => Counted::Router(history.max(predicted)),
        CacheSource::Precise => match state {
            IndexState::Trusted if index >= predicted => Counted::Index,
            // Blocks just sent there are (about to be) on its GPU.
            IndexState::Trusted => Counted::Router(predicted),
            IndexState::NoEvents => Counted::Router(history.max(predicted)),
            // A stale picture is not used; only what the router itself just sent there.
            IndexState::Distrusted => Counted::Router(predicted),
        },
    }
}

/// The leading blocks of a prompt the profile's cache `source` counts for an endpoint whose
/// index (in `state`) matches `index` blocks on any tier, whose routing history holds `history`
/// and to which `predicted` were just sent: what [`cached`] counts before capping at the prompt,
/// and so the most a lower bound of the endpoint's cost may assume it holds.
pub fn countable_blocks(
    source: CacheSource,
    state: IndexState,
    index: u32,
    history: u32,
    predicted: u32,
) -> u32 {
    match counted_picture(source, state, index, history, predicted) {
        Counted::Index => index,
        Counted::Router(blocks) => blocks,
    }
}

/// What the candidate holds of the request, by tier, capped at the prompt.
pub fn cached(profile: &Profile, request: &RequestInfo, c: &Candidate) -> Cached {
    let view = &c.cache;
    let counted = counted_picture(
        profile.cache,
        view.index_state,
        view.index.map_or(0, |m| m.blocks),
        view.history,
        view.predicted,
    );
    let (gpu, cpu, storage, shared) = match (counted, view.index) {
        (Counted::Index, Some(m)) => (
            m.gpu_blocks,
            m.cpu_blocks,
            m.storage_blocks,
            m.shared_blocks,
        ),
        (Counted::Index, None) => (0, 0, 0, 0),
        (Counted::Router(blocks), _) => (blocks, 0, 0, 0),
    };
    let bs = request.block_size;
    let prompt = request.prompt_tokens;
    let gpu = (gpu as usize * bs).min(prompt);
    let cpu = (cpu as usize * bs).min(prompt - gpu);
    let storage = (storage as usize * bs).min(prompt - gpu - cpu);
    let shared = (shared as usize * bs).min(prompt - gpu - cpu - storage);
    Cached {
        all: gpu + cpu + storage + shared,
        gpu,
        cpu,
        storage,
        shared,
    }
}

/// Seconds of prefill queued ahead of a request of `prompt_tokens` on an endpoint with `load`
/// that prefills `rate` tokens a second: the router's own in-flight prefill tokens, or the
/// scraped waiting queue at the mean in-flight prefill size (else the uncached size of
/// requests recently sent there, else this prompt's size), whichever is more.
pub fn queued_prefill_s(load: &EndpointLoad, prompt_tokens: usize, rate: f64) -> f64 {
    let mean_prefill = if load.inflight_prefills > 0 {
        load.inflight_prefill_tokens as f64 / f64::from(load.inflight_prefills)
    } else {
        load.recent_uncached_tokens.unwrap_or(prompt_tokens as f64)
    };
    let queued_tokens =
        (load.inflight_prefill_tokens as f64).max(load.waiting.unwrap_or(0.0) * mean_prefill);
    queued_tokens / rate.max(1.0)
}

/// The candidate's cost and what it holds.
pub fn assess(profile: &Profile, request: &RequestInfo, c: &Candidate) -> (Cost, Cached) {
    let held = cached(profile, request, c);
    let rate = c.prefill_tokens_per_s.max(1.0);
    let load = &c.load;
    // What it holds on the GPU may be evicted by the queue ahead before this request is
    // admitted (an engine looks its prefix up only then): those tokens are prefilled again,
    // or loaded back from CPU memory where the endpoint offloads (an evicted block is stored
    // there).
    let lost = lost_ahead_tokens(request, c, held.gpu);
    let (recomputed, reloaded) = if c.cache.offloads_to_cpu {
        (0.0, lost)
    } else {
        (lost, 0.0)
    };
    // CPU memory is a cache too: the queue ahead offloads what it computes there, and beyond
    // the tier's free blocks that pushes out, least recently used first, blocks this request
    // would load from it (found there, or stored there when the queue ahead evicted them from
    // the GPU). Those load from the endpoint's storage where its index holds storage blocks
    // (a connector with a tier below demotes what CPU memory drops), else are recomputed.
    let cpu_lost = cpu_lost_ahead_tokens(request, c, held.gpu, held.cpu, reloaded);
    let (recomputed, demoted) = if c.cache.offloads_to_storage {
        (recomputed, cpu_lost)
    } else {
        (recomputed + cpu_lost, 0.0)
    };
    let uncached = request.prompt_tokens.saturating_sub(held.all) as f64 + recomputed;
    let prefill_s = uncached / rate;
    let tiers = tier_load(
        &profile.tiers,
        &c.tier_rates,
        [
            (held.cpu as f64 + reloaded - cpu_lost) as usize,
            held.storage + demoted as usize,
            held.shared,
        ],
        rate,
    );
    let tier_load_s = tiers.seconds;
    let queued_prefill_s = queued_prefill_s(load, request.prompt_tokens, rate);
    // The prefills queued ahead, or the requests that must end before this one's blocks fit,
    // whichever is longer (the latter includes the former's prefills), less the part of its own
    // prefill that runs while it waits for them.
    let queued_requests_s = load.queue() * profile.queue_wait_s;
    let room_prefilled_s = prefill_s * load.room_prefilled_share.clamp(0.0, 1.0);
    let queue_s = queued_prefill_s.max(load.room_wait_s - room_prefilled_s) + queued_requests_s;
    // Who waits for this prefill: every running decode (its next token comes after the step
    // that computes it), and the requests that will queue behind it, as many, in steady state,
    // as are queued there now.
    // A load beside the batch delays only this request.
    let stalling_s = match profile.tiers.load_mode {
        TierLoadMode::Async => prefill_s,
        TierLoadMode::InStep => prefill_s + tier_load_s,
    };
    let decode_interference_s =
        stalling_s * (load.decoding() + load.queue()) * profile.weights.decode_interference;
    // Requests that come while it holds its blocks (from admission to its end) and do not fit
    // beside them wait until it ends: as many as arrive at that rate over that time, each
    // waiting half of it on average.
    let resident_s = prefill_s + tier_load_s + load.decode_s;
    let room_blocking_s = load.not_fitting_per_s * resident_s * resident_s / 2.0;
    // A block loaded from a lower tier takes GPU room again, as a computed one does. Where no
    // other endpoint holds it on its GPU, whichever serves the request must store it on a GPU,
    // so it is priced as a block found cached (its load); where another does, loading it here
    // makes a second GPU copy, and what that pushes out is charged. The loads follow what the
    // endpoint keeps on its GPU (its reloads of what the queue ahead evicts included); a tier
    // credited as the GPU loads nothing.
    let first_loaded = held.gpu as f64 - reloaded;
    let duplicated = (tiers.charged_tokens() as f64)
        .min((request.gpu_copies.elsewhere(c.endpoint) as f64 - first_loaded).max(0.0));
    let kept = held.all as f64 - recomputed - duplicated;
    let evicted_blocks = evicted_blocks(request, c, kept);
    let free_blocks_left = free_blocks_left(request, c, kept);
    let eviction_s = eviction_s(request, c, evicted_blocks, rate);
    let session_credit_s = if request.session_endpoint == Some(c.endpoint) {
        profile.session_affinity_s
    } else {
        0.0
    };
    let mut cost = Cost {
        queue_s,
        queued_prefill_s,
        room_wait_s: load.room_wait_s,
        room_prefilled_s,
        queued_requests_s,
        prefill_s,
        evicted_ahead_tokens: lost,
        cpu_lost_ahead_tokens: cpu_lost,
        tier_load_s,
        tiers,
        stalling_s,
        decode_interference_s,
        room_blocking_s,
        evicted_blocks,
        free_blocks_left,
        unseen_blocks: c.cache.unseen_blocks,
        eviction_s,
        session_credit_s,
        total_s: 0.0,
    };
    cost.total_s = cost.cache_part(profile) + cost.load_part(profile) - session_credit_s;
    (cost, held)
}

/// A lower bound of [`assess`]'s `total_s` for every candidate that is not the session's
/// endpoint, prefills at most `rate_at_most` tokens/s, has at least `busy` requests decoding and
/// queued ([`super::EndpointLoad::decoding`] + [`super::EndpointLoad::queue`]) and holds at most
/// `held_at_most` tokens of the request as [`cached`]'s `all` counts them. [`countable_blocks`]
/// × the block size bounds that count (it is `cached`'s before the cap at the prompt), and so
/// does the larger of its index match on every tier, routing history and prediction, under any
/// cache source and index state. `None` when a weight is negative or not finite, or the rate is
/// not a number (no bound is known then).
///
/// Proof, term by term, for such a candidate with prompt `P` tokens, `U` = `P −
/// min(held_at_most, P)` and `rate` = `prefill_tokens_per_s.max(1)` ≤ `rate_at_most.max(1)` =
/// `R`:
/// - `uncached` = `P − held.all + recomputed` ≥ `U` (`recomputed` ≥ 0: evicted GPU tokens and
///   CPU-tier tokens pushed out with no storage below, each a non-negative share), so
///   `prefill_s` ≥ `U / rate` ≥ `U / R`;
/// - `tier_load_s` ≥ 0 (each tier charges tokens over a rate of at least 1, or a 0–1 share of
///   their recompute);
/// - `queue_s` = `queued_tokens / rate + queue × queue_wait_s` ≥ 0 (`queued_tokens` is the
///   larger of an unsigned count and another value, `queue` of a count and the scraped queue,
///   `queue_wait_s` ≥ 0);
/// - `decode_interference_s` = `stalling_s × (decoding + queue) × w_di` ≥ `U / R × busy × w_di`
///   (`stalling_s` is `prefill_s`, plus `tier_load_s` ≥ 0 for in-step loads; both other factors
///   are non-negative: `decoding` and `queue` are each the larger of a count and a scraped
///   value);
/// - `room_blocking_s` ≥ 0 (a rate of at least 0 times a square over 2);
/// - `eviction_s` ≥ 0 (a non-negative count of blocks × block size / rate × a reuse clamped to
///   0–1), and `session_credit_s` = 0.
///
/// So `total_s` = `w_prefix × (prefill_s + tier_load_s) + w_eviction × eviction_s + w_load ×
/// (queue_s + decode_interference_s + room_blocking_s)` ≥ `U / R × (w_prefix + w_load × w_di ×
/// busy)` when every weight is ≥ 0. The bound is taken a relative 1e-9 lower, far more than the
/// rounding of either side (a few ulps of each term).
pub fn cost_floor(
    profile: &Profile,
    request: &RequestInfo,
    held_at_most: usize,
    busy: f64,
    rate_at_most: f64,
) -> Option<f64> {
    if rate_at_most.is_nan() {
        return None;
    }
    let uncached = request.prompt_tokens - held_at_most.min(request.prompt_tokens);
    let floor = uncached as f64 * floor_per_token_second(profile, busy)? / rate_at_most.max(1.0);
    Some(floor * (1.0 - 1e-9))
}

/// The factor of [`cost_floor`] that depends on the profile and the load only: `w_prefix +
/// w_load × w_di × busy` (the bound is `U / R` times it), not below zero; `None` when a weight
/// is negative or not finite.
pub fn floor_per_token_second(profile: &Profile, busy: f64) -> Option<f64> {
    let w = &profile.weights;
    let weights = [
        w.prefix,
        w.load,
        w.decode_interference,
        w.eviction,
        profile.queue_wait_s,
    ];
    if !weights.iter().all(|w| w.is_finite() && *w >= 0.0) {
        return None;
    }
    Some(w.prefix + w.load * w.decode_interference * busy.max(0.0))
}

/// The two longest prefixes of a prompt that endpoints hold on their GPUs, by the index (a
/// match's GPU blocks taken as its leading ones, as [`cached`] takes them), counted over the
/// endpoints that could serve the request (`Fleet::plan` builds it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct GpuCopies {
    /// The endpoint holding the longest, and its tokens.
    longest: Option<(EndpointId, usize)>,
    /// The next longest, held by another endpoint, in tokens.
    second: usize,
}

impl GpuCopies {
    /// Counts `endpoint` holding the prompt's first `tokens` tokens on its GPU (the longest
    /// count of an endpoint added twice).
    pub fn add(&mut self, endpoint: EndpointId, tokens: usize) {
        match self.longest {
            Some((holder, longest)) if holder == endpoint => {
                self.longest = Some((holder, longest.max(tokens)));
            }
            Some((_, longest)) if tokens <= longest => self.second = self.second.max(tokens),
            Some((_, longest)) => {
                self.second = longest;
                self.longest = Some((endpoint, tokens));
            }
            None => self.longest = Some((endpoint, tokens)),
        }
    }

    /// The longest prefix an endpoint other than `endpoint` holds on its GPU, in tokens.
    pub fn elsewhere(&self, endpoint: EndpointId) -> usize {
        match self.longest {
            Some((holder, _)) if holder == endpoint => self.second,
            Some((_, tokens)) => tokens,
            None => 0,
        }
    }
}

/// Cached blocks placing the request on `c` evicts: the blocks it stores beyond `c`'s free
/// blocks (0 where the free blocks are unknown, or where it all fits). `held`: the prompt tokens
/// it is expected to find cached and not store on the GPU again.
pub fn evicted_blocks(request: &RequestInfo, c: &Candidate, held: f64) -> f64 {
    let Some(free) = c.cache.free_blocks else {
        return 0.0;
    };
    (stored_blocks(request, held) - free.max(0.0)).max(0.0)
}

/// `c`'s GPU blocks still free once the request has stored its blocks there (0 where it
/// evicts; `None` where the free blocks are unknown). `held` as for [`evicted_blocks`].
pub fn free_blocks_left(request: &RequestInfo, c: &Candidate, held: f64) -> Option<f64> {
    let free = c.cache.free_blocks?;
    Some((free - stored_blocks(request, held)).max(0.0))
}

/// The full blocks of the prompt stored on the GPU, `held` prompt tokens being found there.
fn stored_blocks(request: &RequestInfo, held: f64) -> f64 {
    let bs = request.block_size.max(1);
    ((request.prompt_tokens / bs) as f64 - (held / bs as f64).floor()).max(0.0)
}

/// Expected seconds of re-prefill that placing the request on `c` makes others pay: each of
/// the `evicted` blocks ([`evicted_blocks`]) is reused with probability `c.cache.block_reuse`.
pub fn eviction_s(request: &RequestInfo, c: &Candidate, evicted: f64, rate: f64) -> f64 {
    let bs = request.block_size.max(1);
    evicted * bs as f64 / rate * c.cache.block_reuse.clamp(0.0, 1.0)
}

/// Of the `held_gpu` prompt tokens `c` holds on its GPU, those the queue ahead is expected to
/// evict before the request is admitted. By last use where the fleet knows it
/// ([`super::RecencyParts`]); else each cached block is taken as equally likely to go
/// ([`survival`]), except those of requests just sent there, which use them first.
pub fn lost_ahead_tokens(request: &RequestInfo, c: &Candidate, held_gpu: usize) -> f64 {
    match (c.cache.recency, c.cache.capacity_blocks) {
        (Some(recency), Some(capacity)) => {
            let bs = request.block_size.max(1);
            let blocks = u32::try_from(held_gpu.div_ceil(bs)).unwrap_or(u32::MAX);
            (recency.lost(blocks, capacity, survival(c)) * bs as f64).min(held_gpu as f64)
        }
        _ => {
            let in_use = (c.cache.predicted as usize * request.block_size).min(held_gpu);
            (held_gpu - in_use) as f64 * (1.0 - survival(c))
        }
    }
}

/// Share of the cached blocks on `c` expected to survive until a request queued there now is
/// admitted, 0–1. The prefills queued ahead store their blocks first; beyond the free blocks
/// each evicts a cached one, least recently used first. For blocks whose place in that order
/// is not known (no recency picture, or past its last part: [`lost_ahead_tokens`]) each cached
/// block is taken as equally likely to go: the share
/// evicted is the blocks the queue ahead stores beyond the free ones over the capacity
/// (`free_blocks` already counts the in-flight prefills' blocks against the capacity). 1 when
/// the capacity is unknown.
pub fn survival(c: &Candidate) -> f64 {
    match (c.cache.free_blocks, c.cache.capacity_blocks) {
        (Some(free), Some(capacity)) => survival_of(free, capacity),
        _ => 1.0,
    }
}

/// Of the prompt tokens `c` would load from CPU memory, those the queue ahead's offloads are
/// expected to push out of that tier before the request is admitted: of the `cpu` tokens found
/// there (the prompt's blocks after its `gpu` ones) and of the `reloaded` ones (GPU-held, which
/// the queue ahead evicts from the GPU to CPU memory). The CPU tier drops its least recently
/// used blocks as the GPU cache does: where the fleet knows the prefix's parts by last use
/// ([`super::RecencyParts`]), the tier loses what a cache of its capacity loses at those
/// positions (a reloaded block being among the GPU part's oldest, the part the tier loses
/// first); else each block is equally likely to go ([`cpu_survival`]).
pub fn cpu_lost_ahead_tokens(
    request: &RequestInfo,
    c: &Candidate,
    gpu: usize,
    cpu: usize,
    reloaded: f64,
) -> f64 {
    let at_risk = cpu as f64 + reloaded.max(0.0);
    if at_risk <= 0.0 {
        return 0.0;
    }
    let survival = cpu_survival(c);
    match (c.cache.cpu_recency, c.cache.cpu_capacity_blocks) {
        (Some(recency), Some(capacity)) => {
            let bs = request.block_size.max(1);
            let blocks = |tokens: usize| u32::try_from(tokens.div_ceil(bs)).unwrap_or(u32::MAX);
            let lost_tokens =
                |tokens: usize| recency.lost(blocks(tokens), capacity, survival) * bs as f64;
            let lost_in_gpu_part = lost_tokens(gpu);
            let found = (lost_tokens(gpu + cpu) - lost_in_gpu_part).clamp(0.0, cpu as f64);
            found + lost_in_gpu_part.min(reloaded.max(0.0))
        }
        _ => at_risk * (1.0 - survival),
    }
}

/// Share of the blocks `c` holds in CPU memory expected to survive until a request queued
/// there now is admitted, 0–1: as [`survival`] for its CPU tier, whose capacity the router
/// knows once the tier has evicted (its events say so). 1 while that capacity is unknown.
pub fn cpu_survival(c: &Candidate) -> f64 {
    match (c.cache.cpu_free_blocks, c.cache.cpu_capacity_blocks) {
        (Some(free), Some(capacity)) => survival_of(free, capacity),
        _ => 1.0,
    }
}

/// [`survival`] of an endpoint with `free` blocks (negative: the queue ahead stores that many
/// more than are free) out of `capacity`.
pub fn survival_of(free: f64, capacity: f64) -> f64 {
    if capacity > 0.0 {
        1.0 - ((-free).max(0.0) / capacity).min(1.0)
    } else {
        1.0
    }
}
