//! Synthetic but well-formed completions: deterministic English-looking words. Public so that
//! an offline simulation of the server (`kvroute simulate`) generates exactly the answers a
//! live simulated engine would.

const WORDS: [&str; 32] = [
    "the", "cache", "routing", "prefix", "model", "token", "request", "server", "block", "fast",
    "latency", "memory", "engine", "batch", "turn", "answer", "context", "simple", "and", "of",
    "to", "is", "a", "we", "can", "keep", "warm", "reuse", "first", "next", "pod", "data",
];

/// The seed of the completion the server generates for its `request_id`-th request (engine
/// request ids count from 1) with prompt `prompt`.
pub fn completion_seed(request_id: u64, prompt: &[u32]) -> u64 {
    prompt
        .iter()
        .fold(request_id.wrapping_mul(0x9e37_79b9_7f4a_7c15), |h, t| {
            h.rotate_left(5) ^ u64::from(*t)
        })
}

/// The token ids of a completion of exactly `max_tokens` tokens, deterministic in `seed`.
pub fn synthetic_completion(seed: u64, max_tokens: usize) -> Vec<u32> {
    let tokenizer = kvroute_vllm::tokenizer::BuiltinTokenizer;
    let mut state = seed | 1;
    let mut tokens = Vec::with_capacity(max_tokens + 4);
    let mut words = 0;
    while tokens.len() < max_tokens {
        // xorshift: cheap, deterministic, good enough for filler text.
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        words += 1;
        let word = WORDS[(state % WORDS.len() as u64) as usize];
        let stop = if words % 9 == 0 { "." } else { "" };
        // Words start with a space, so encoding them one by one equals encoding the whole text.
        tokens.extend(tokenizer.encode(&format!(" {word}{stop}")));
    }
    tokens.truncate(max_tokens);
    tokens
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_length_and_deterministic() {
        let a = synthetic_completion(7, 50);
        assert_eq!(a.len(), 50);
        let tok = kvroute_vllm::tokenizer::BuiltinTokenizer;
        let whole = synthetic_completion(7, 400);
        assert_eq!(
            tok.encode(&tok.decode(&whole)),
            whole,
            "the text re-tokenizes to the same ids"
        );
        assert_eq!(a, synthetic_completion(7, 50));
        assert_ne!(a, synthetic_completion(8, 50));
        let text = kvroute_vllm::tokenizer::BuiltinTokenizer.decode(&a);
        assert!(text.starts_with(' ') && text.len() > 50, "{text}");
    }
}
