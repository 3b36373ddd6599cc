//! Loading a Mooncake-format request trace for replay.
//!
//! A trace is JSON lines, one request per line:
//!
//! ```json
//! {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2]}
//! ```
//!
//! - `timestamp`: arrival time in milliseconds from the start of the trace;
//! - `input_length`: prompt tokens;
//! - `output_length`: generated tokens;
//! - `hash_ids`: one id per block of [`TraceOptions::block_tokens`] (512 in Mooncake's traces)
//!   prompt tokens; equal ids at equal positions mean identical prefix blocks, and the last block
//!   may be partial.
//!
//! Traces carry no text, so [`load_trace`] synthesises token ids: every hash id becomes a
//! deterministic block of `block_tokens` ids drawn from `[256, 256 + vocab)` by a generator
//! seeded with `(seed, hash_id)`, and a prompt is its blocks concatenated and cut to
//! `input_length`. Equal ids give equal tokens, so the trace's prefix sharing is kept exactly;
//! the ids avoid `0..=255`, which kvroute's built-in tokenizer reserves.
//!
//! Irregular rows are handled as follows:
//!
//! - **Too few hash ids** for `input_length`: the prompt is padded with blocks derived from the
//!   request's index in the result (its position, 0-based, among the loaded requests) and the
//!   block's position. They use a separate seed domain, so they never equal a trace block or a
//!   padding block of another request: the uncovered part of the prompt is unshared.
//! - **More hash ids** than `input_length` needs: the extra ones are ignored.
//! - **`input_length` 0**: the request is skipped (there is nothing to send; OpenAI-compatible
//!   servers reject an empty prompt). Skipped rows take no index and do not count toward
//!   [`TraceOptions::limit`].
//! - **`output_length` 0**: kept as 1, the least `max_tokens` a server accepts.
//! - **A timestamp earlier than the previous row's**: the request arrives at the previous row's
//!   time, so arrivals never go back and the file's order is kept (requests are not re-sorted,
//!   which would change which prefix reaches the cache first).
//!
//! Timestamps are not rebased: a trace starting at 5000 ms has its first request at
//! `5.0 / speed` seconds.

use std::io::BufRead;

use serde::Deserialize;

/// The first token id used for synthetic prompts: ids below it are reserved by kvroute's
/// built-in tokenizer.
pub const FIRST_TOKEN_ID: u32 = 256;

/// The longest prompt accepted, in tokens; longer rows are reported as malformed rather than
/// allocated.
pub const MAX_INPUT_TOKENS: u64 = 1 << 24;

/// The most prompt tokens a whole trace may ask for (1 GiB of token ids): the whole Mooncake
/// conversation trace asks for about half of it; a file over it is refused at the row that
/// crosses it rather than allocated.
pub const MAX_TRACE_TOKENS: u64 = 1 << 28;

/// The longest trace line read: a row at [`MAX_INPUT_TOKENS`] lists 32,768 block hashes, a few
/// hundred KiB.
const MAX_LINE_BYTES: usize = 16 << 20;

/// One request of a trace, ready to send.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceRequest {
    /// When to send it, seconds from the start of the replay (already divided by the speed).
    pub at_s: f64,
    /// The prompt's token ids, each in `[256, 256 + vocab)`.
    pub prompt: Vec<u32>,
    /// Tokens to generate (`max_tokens`), at least 1.
    pub output_tokens: u32,
}

/// How to turn a trace into requests.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceOptions {
    /// Replay speed: 1.0 is real time, 2.0 twice as fast (arrival times are divided by it).
    /// Must be finite and positive.
    pub speed: f64,
    /// Load at most this many requests (the first ones of the file).
    pub limit: Option<usize>,
    /// Tokens per hash id: the trace's block size (512 for Mooncake's traces). Must be positive.
    pub block_tokens: usize,
    /// Size of the token id range: ids are in `[256, 256 + vocab)`. Must be positive.
    pub vocab: u32,
    /// Seed of the synthetic tokens: the same seed gives the same prompts.
    pub seed: u64,
}

impl Default for TraceOptions {
    fn default() -> Self {
        Self {
            speed: 1.0,
            limit: None,
            block_tokens: 512,
            vocab: 32_000,
            seed: 0,
        }
    }
}

/// Why a trace could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The options are unusable (a non-positive speed, block size or vocabulary).
    #[error("invalid trace options: {0}")]
    Options(String),
    /// Reading the trace failed at the given line (1-based).
    #[error("trace line {line}: read failed: {source}")]
    Io {
        /// The line being read.
        line: usize,
        /// What went wrong.
        #[source]
        source: std::io::Error,
    },
    /// A line (1-based) is not a valid trace row: bad JSON, a missing field or a wrong type.
    #[error("trace line {line}: {source}")]
    Json {
        /// The offending line.
        line: usize,
        /// The parser's complaint, naming the field or position.
        #[source]
        source: serde_json::Error,
    },
    /// A line (1-based) parses but holds an impossible value (e.g. a negative timestamp).
    #[error("trace line {line}: {problem}")]
    Invalid {
        /// The offending line.
        line: usize,
        /// What is wrong with it.
        problem: String,
    },
}

/// One row of the trace, as written.
#[derive(Debug, Deserialize)]
struct Row {
    timestamp: f64,
    input_length: u64,
    output_length: u64,
    hash_ids: Vec<u64>,
}

/// Reads a Mooncake-format trace (see the [module docs](self)) into requests in file order.
/// Blank lines are ignored.
///
/// # Errors
///
/// [`TraceError::Options`] for unusable options, [`TraceError::Io`] when reading fails, and
/// [`TraceError::Json`] or [`TraceError::Invalid`] for a malformed line, naming it.
pub fn load_trace(
    reader: impl BufRead,
    options: &TraceOptions,
) -> Result<Vec<TraceRequest>, TraceError> {
    load_trace_within(reader, options, MAX_TRACE_TOKENS)
}

/// [`load_trace`], refusing a trace whose prompts pass `max_tokens` in all.
fn load_trace_within(
    reader: impl BufRead,
    options: &TraceOptions,
    max_tokens: u64,
) -> Result<Vec<TraceRequest>, TraceError> {
    validate(options)?;
    let limit = options.limit.unwrap_or(usize::MAX);
    let mut requests = Vec::new();
    let mut last_ms = 0.0f64;

    let mut total_tokens = 0u64;
    for (index, line) in crate::lines::bounded_lines(reader, MAX_LINE_BYTES).enumerate() {
        if requests.len() >= limit {
            break;
        }
        let number = index + 1;
        let line = line.map_err(|source| TraceError::Io {
            line: number,
            source,
        })?;
        if line.trim().is_empty() {
            continue;
        }
        let row: Row = serde_json::from_str(&line).map_err(|source| TraceError::Json {
            line: number,
            source,
        })?;
        let invalid = |problem: String| TraceError::Invalid {
            line: number,
            problem,
        };
        if row.timestamp < 0.0 {
            return Err(invalid(format!("negative timestamp {}", row.timestamp)));
        }
        if row.input_length > MAX_INPUT_TOKENS {
            return Err(invalid(format!(
                "input_length {} is over the limit of {MAX_INPUT_TOKENS}",
                row.input_length
            )));
        }
        let output_tokens = u32::try_from(row.output_length)
            .map_err(|_| invalid(format!("output_length {} is too large", row.output_length)))?
            .max(1);

        last_ms = last_ms.max(row.timestamp);
        if row.input_length == 0 {
            continue;
        }
        total_tokens += row.input_length;
        if total_tokens > max_tokens {
            return Err(invalid(format!(
                "the trace's prompts pass {max_tokens} tokens in all here: replay a part of it (a limit)"
            )));
        }
        let prompt = synthesize_prompt(
            &row.hash_ids,
            row.input_length as usize,
            requests.len() as u64,
            options,
        );
        requests.push(TraceRequest {
            at_s: last_ms / 1000.0 / options.speed,
            prompt,
            output_tokens,
        });
    }
    Ok(requests)
}

fn validate(options: &TraceOptions) -> Result<(), TraceError> {
    if !(options.speed.is_finite() && options.speed > 0.0) {
        return Err(TraceError::Options(format!(
            "speed must be a positive number, not {}",
            options.speed
        )));
    }
    if options.block_tokens == 0 {
        return Err(TraceError::Options("block_tokens must be positive".into()));
    }
    if options.vocab == 0 || options.vocab > u32::MAX - FIRST_TOKEN_ID {
        return Err(TraceError::Options(format!(
            "vocab must be in 1..={}, not {}",
            u32::MAX - FIRST_TOKEN_ID,
            options.vocab
        )));
    }
    Ok(())
}

/// Seed domains, so that trace blocks and padding blocks never share a generator.
const TRACE_DOMAIN: u64 = 0x7472_6163_6500_0000;
const PADDING_DOMAIN: u64 = 0x7061_6464_696e_6700;

/// The prompt of one row: its blocks concatenated and cut to `input_length`.
fn synthesize_prompt(
    hash_ids: &[u64],
    input_length: usize,
    request_index: u64,
    options: &TraceOptions,
) -> Vec<u32> {
    let mut prompt = Vec::with_capacity(input_length);
    let mut position = 0u64;
    while prompt.len() < input_length {
        let block_seed = match hash_ids.get(position as usize) {
            Some(&id) => seed_of(options.seed, TRACE_DOMAIN, id, 0),
            None => seed_of(options.seed, PADDING_DOMAIN, request_index, position),
        };
        let take = options.block_tokens.min(input_length - prompt.len());
        let mut rng = SplitMix64(block_seed);
        prompt.extend((0..take).map(|_| token(rng.next_u64(), options.vocab)));
        position += 1;
    }
    prompt
}

/// A generator seed for one block, mixing every input so that nearby keys give unrelated seeds.
fn seed_of(seed: u64, domain: u64, a: u64, b: u64) -> u64 {
    let mut h = mix(seed ^ domain);
    h = mix(h ^ a);
    mix(h ^ b.wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

/// Maps 64 random bits onto `[256, 256 + vocab)` (multiply-shift, unbiased enough for ids).
fn token(bits: u64, vocab: u32) -> u32 {
    let offset = ((bits >> 32) * u64::from(vocab)) >> 32;
    FIRST_TOKEN_ID + offset as u32
}

/// SplitMix64's finaliser: a bijective 64-bit mixer.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// SplitMix64: a small, fast, fixed generator, so that prompts stay the same across versions of
/// any random-number crate.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(self.0)
    }
}

#[cfg(test)]
mod tests;
