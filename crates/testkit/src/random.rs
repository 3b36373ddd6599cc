//! Deterministic pseudo-random data for tests and benchmarks: SplitMix64, a small fixed
//! generator (the same numbers on every machine and every version of any random-number crate),
//! and token ids drawn from it.

/// SplitMix64 (Steele, Lea and Flood): each call adds the golden-ratio increment to the state
/// and mixes it.
#[derive(Clone, Debug)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// Vocabulary of [`tokens`]: token ids are below this (a large modern tokenizer's size).
pub const VOCAB: u32 = 150_000;

/// `count` token ids below [`VOCAB`] from `seed`; nearby seeds give unrelated sequences.
pub fn tokens(seed: u64, count: usize) -> Vec<u32> {
    let mut rng = SplitMix64(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x2545_f491_4f6c_dd1d);
    (0..count)
        .map(|_| (rng.next_u64() % u64::from(VOCAB)) as u32)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_generator_is_splitmix64_and_tokens_are_fixed_per_seed() {
        // SplitMix64's reference output for state 0 (the first value of its published tests).
        assert_eq!(SplitMix64(0).next_u64(), 0xe220_a839_7b1d_cdaf);
        let a = tokens(7, 1000);
        assert_eq!(a, tokens(7, 1000));
        assert_ne!(a, tokens(8, 1000));
        assert!(a.iter().all(|&t| t < VOCAB));
    }
}
