//! Consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam, 2018), the
//! `prefix-hash` policy's picker.
//!
//! Every endpoint owns [`VIRTUAL_NODES`] points on a ring of `u64` hashes. A prompt's prefix
//! hash lands on the ring; its home is the first endpoint met clockwise. An endpoint is skipped
//! while taking the request would put it above `(1 + ε)` × the mean load (counting the new
//! request), so a hot prefix overflows to the next endpoints on the ring instead of melting its
//! home. Adding or removing an endpoint moves only the prefixes homed on it.

use super::Assessment;

/// Points each endpoint owns on the ring: enough that each owns about its share of it.
pub const VIRTUAL_NODES: u32 = 64;

/// Keeps the nodes' hashes apart from the keys' (both go through [`mix`]).
const NODE_SALT: u64 = 0xa076_1d64_78bd_642f;

/// A 64-bit mix of `x` (splitmix64's finalizer).
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Indices of `competing` in ring order from `key`, each endpoint once, with those within the
/// load bound first (the first is the choice; the rest, in ring order, are the fallbacks).
pub fn rank(assessments: &[Assessment], competing: &[usize], key: u64, epsilon: f64) -> Vec<usize> {
    let point = mix(key);
    // (distance clockwise from the key's point, candidate index), over every virtual node.
    let mut nodes: Vec<(u64, usize)> = competing
        .iter()
        .flat_map(|&i| {
            let id = u64::from(assessments[i].endpoint.0);
            (0..VIRTUAL_NODES).map(move |v| {
                // Salted, so that no prompt key lands exactly on a node.
                let at = mix(((id << 32) | u64::from(v)) ^ NODE_SALT);
                (at.wrapping_sub(point), i)
            })
        })
        .collect();
    nodes.sort_unstable();
    let mut walk: Vec<usize> = Vec::with_capacity(competing.len());
    for (_, i) in nodes {
        if !walk.contains(&i) {
            walk.push(i);
        }
    }
    let total: f64 = competing.iter().map(|&i| assessments[i].requests).sum();
    let bound = (1.0 + epsilon.max(0.0)) * (total + 1.0) / competing.len().max(1) as f64;
    let (within, over): (Vec<usize>, Vec<usize>) = walk
        .into_iter()
        .partition(|&i| assessments[i].requests + 1.0 <= bound.ceil());
    within.into_iter().chain(over).collect()
}
