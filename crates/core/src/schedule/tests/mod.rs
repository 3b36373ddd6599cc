//! Scheduling decisions over hand-built candidates: each test sets up a fleet's load and
//! caches and checks where `schedule` sends a request and why. The candidate and request
//! builders that several topics use are here; the tests are in the submodules, one topic each.

use super::*;
use crate::index::PrefixMatch;

mod balancing;
mod eviction;
mod filters;
mod load;
mod profiles;
mod pruning;
mod rent;

const RATE: f64 = 20_000.0;

fn candidate(id: u32) -> Candidate {
    Candidate {
        endpoint: EndpointId(id),
        healthy: true,
        ejected: false,
        circuit_open: false,
        serves_model: true,
        role: Role::Both,
        load: EndpointLoad::default(),
        cache: CacheView::default(),
        prefill_tokens_per_s: RATE,
        tier_rates: Default::default(),
        cache_fill: 0.0,
    }
}

fn fleet(n: u32) -> Vec<Candidate> {
    (0..n).map(candidate).collect()
}

fn request(prompt_tokens: usize) -> RequestInfo {
    RequestInfo {
        prompt_tokens,
        block_size: 16,
        session_endpoint: None,
        role: Role::Both,
        prefix_key: None,
        gpu_copies: Default::default(),
    }
}

fn gpu_match(id: u32, blocks: u32) -> Option<PrefixMatch> {
    Some(PrefixMatch {
        endpoint: EndpointId(id),
        blocks,
        gpu_blocks: blocks,
        cpu_blocks: 0,
        storage_blocks: 0,
        shared_blocks: 0,
    })
}

/// A match of `blocks` held only in CPU memory.
fn cpu_match(id: u32, blocks: u32) -> Option<PrefixMatch> {
    Some(PrefixMatch {
        cpu_blocks: blocks,
        gpu_blocks: 0,
        ..gpu_match(id, blocks)?
    })
}

/// In-flight prefill work on a candidate: `requests` requests of `tokens` uncached tokens in all.
fn busy(c: &mut Candidate, requests: u32, tokens: u64) {
    c.load.inflight = requests;
    c.load.inflight_prefills = requests;
    c.load.inflight_prefill_tokens = tokens;
}

fn chosen(profile: &Profile, req: &RequestInfo, cands: &[Candidate], random: u64) -> u32 {
    schedule(profile, req, cands, random, 0).chosen().unwrap().0
}
