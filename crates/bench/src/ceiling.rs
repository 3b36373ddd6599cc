//! The ceiling a routing policy can reach: the prefix-cache hit rate of one engine whose cache
//! is as large as the whole fleet's, serving the same requests in the same order. Computed
//! offline with the simulator's engine model (vLLM's cache rules), for chat workloads rendered
//! with the built-in tokenizer and template, and completions workloads (traces) as sent. The
//! same rendering gives the longest request, which every engine's cache must hold.

use kvroute_sim::engine::{Engine, EngineConfig, EngineRequest};
use kvroute_vllm::tokenizer::{BuiltinTokenizer, ChatMessage};

use crate::workload::{Api, Workload};

/// The hit rate of a single engine with the whole fleet's cache serving the workload's
/// requests one after another, with the assistant replies a real run would produce.
pub fn pooled_hit_rate(workload: &Workload, config: &EngineConfig) -> f64 {
    pooled_ceiling(workload, config).hit_rate
}

/// The pooled-cache ceiling of a workload, and what it left out.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Ceiling {
    /// Hit rate of the requests the pooled engine served (0 when it served none).
    pub hit_rate: f64,
    /// Requests the pooled engine refused (longer than its `max_model_len`, or its cache): a
    /// fleet whose engines serve them has a ceiling the figure does not count them in.
    pub refused: usize,
}

/// [`pooled_hit_rate`], with the requests the pooled engine refused counted: give it the
/// fleet's engine settings (`max_model_len` above all), so that it refuses what the fleet's
/// engines refuse and serves what they serve.
pub fn pooled_ceiling(workload: &Workload, config: &EngineConfig) -> Ceiling {
    let mut engine = Engine::new(config.clone()).expect("valid configuration");
    let (mut prompt_total, mut cached_total) = (0u64, 0u64);
    let mut id = 0u64;
    let mut refused = 0;
    for_each_request(workload, |prompt, reply, _| {
        let request = EngineRequest {
            id,
            prompt: prompt.to_vec(),
            output: reply.to_vec(),
            lora_name: None,
            cache_salt: None,
        };
        refused += usize::from(engine.add_request(request).is_err());
        id += 1;
        while engine.has_work() {
            for t in engine.step().tokens.into_iter().filter(|t| t.index == 0) {
                prompt_total += t.prompt_tokens as u64;
                cached_total += t.cached_tokens as u64;
            }
        }
    });
    Ceiling {
        hit_rate: if prompt_total == 0 {
            0.0
        } else {
            cached_total as f64 / prompt_total as f64
        },
        refused,
    }
}

/// The most tokens one of the workload's requests holds in an engine's cache: its prompt (its
/// conversation's history included) and its longest reply (`max_tokens`). An engine refuses a
/// request whose tokens need more blocks than its cache less the one block vLLM keeps back.
pub fn longest_request_tokens(workload: &Workload) -> usize {
    let mut longest = 0;
    for_each_request(workload, |prompt, reply, max_tokens| {
        longest = longest.max(prompt.len() + reply.len().max(max_tokens));
    });
    longest
}

/// Calls `f` with each of the workload's requests in arrival order (each turn at its session's
/// start plus the think times before it), as an engine receives it: its prompt (a chat
/// rendered with the built-in template, its history included; a completions prompt as it is
/// sent), a reply of exactly `max_tokens` tokens, as a real run produces (which then joins its
/// conversation's history), and its `max_tokens`.
fn for_each_request(workload: &Workload, mut f: impl FnMut(&[u32], &[u32], usize)) {
    let tokenizer = BuiltinTokenizer;
    let mut order: Vec<(f64, usize, usize)> = Vec::new();
    for (si, s) in workload.sessions.iter().enumerate() {
        let mut t = s.start_s;
        for (ti, turn) in s.turns.iter().enumerate() {
            t += turn.think_s + 0.3;
            order.push((t, si, ti));
        }
    }
    order.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut histories: Vec<Vec<ChatMessage>> = workload
        .sessions
        .iter()
        .map(|s| {
            s.system
                .iter()
                .map(|sys| ChatMessage::new("system", sys.clone()))
                .collect()
        })
        .collect();
    for (_, si, ti) in order {
        let turn = &workload.sessions[si].turns[ti];
        let prompt = match workload.api {
            Api::Completions => turn.content.completion_tokens(),
            Api::Chat => {
                histories[si].push(ChatMessage::new("user", turn.content.chat_text()));
                tokenizer.encode(&tokenizer.apply_chat_template(&histories[si], true))
            }
        };
        // Exactly `max_tokens` tokens, as the fleet's engines answer (a word is two tokens).
        let mut reply: Vec<u32> =
            tokenizer.encode(&" reply".repeat((turn.max_tokens as usize).div_ceil(2)));
        reply.truncate(turn.max_tokens as usize);
        f(&prompt, &reply, turn.max_tokens as usize);
        histories[si].push(ChatMessage::new("assistant", tokenizer.decode(&reply)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{MultiTurn, multi_turn};

    fn params() -> MultiTurn {
        MultiTurn {
            users: 4,
            turns: 3,
            system_tokens: 200,
            user_tokens: 50,
            output_tokens: 16,
            think_s: 1.0,
            rate_per_s: 4.0,
            seed: 5,
        }
    }

    fn workload() -> Workload {
        multi_turn(&params())
    }

    #[test]
    fn a_big_cache_reuses_histories_and_a_tiny_one_cannot() {
        let big = pooled_hit_rate(
            &workload(),
            &EngineConfig {
                num_gpu_blocks: 4096,
                ..EngineConfig::default()
            },
        );
        let tiny = pooled_hit_rate(
            &workload(),
            &EngineConfig {
                num_gpu_blocks: 40,
                ..EngineConfig::default()
            },
        );
        assert!(
            big > 0.5,
            "shared system prompt and histories are reused: {big}"
        );
        assert!(tiny < big, "{tiny} vs {big}");
    }

    /// A one-token answer is an answer: single-token requests (prefill benchmarks) are served
    /// and reuse their shared prefixes, as on the fleet.
    #[test]
    fn single_token_answers_are_served_and_reuse_prefixes() {
        let w = multi_turn(&MultiTurn {
            output_tokens: 1,
            ..params()
        });
        let ceiling = pooled_ceiling(
            &w,
            &EngineConfig {
                num_gpu_blocks: 4096,
                ..EngineConfig::default()
            },
        );
        assert_eq!(ceiling.refused, 0);
        assert!(ceiling.hit_rate > 0.5, "{ceiling:?}");
    }

    /// Requests of `workload` an engine of `blocks` blocks refuses as too long.
    fn refused(workload: &Workload, blocks: usize) -> usize {
        let engine = EngineConfig {
            num_gpu_blocks: blocks,
            ..EngineConfig::default()
        };
        pooled_ceiling(workload, &engine).refused
    }

    #[test]
    fn the_ceiling_counts_what_its_engine_refuses() {
        let w = workload();
        let longest = longest_request_tokens(&w);
        let ceiling = |max_model_len| {
            pooled_ceiling(
                &w,
                &EngineConfig {
                    num_gpu_blocks: 4096,
                    max_model_len,
                    ..EngineConfig::default()
                },
            )
        };
        assert_eq!(ceiling(longest).refused, 0);
        let short = ceiling(longest - 1);
        assert!(short.refused > 0, "{short:?}");
    }

    #[test]
    fn an_engine_holding_the_longest_request_refuses_none_and_a_smaller_one_refuses_it() {
        let w = workload();
        let longest = longest_request_tokens(&w);
        // The last turn holds the system prompt, its history, its question and its reply.
        assert!(longest > 200 + 2 * (50 + 16), "{longest}");
        // It needs its blocks and the one the engine keeps back; a block less refuses it.
        let blocks = longest.div_ceil(EngineConfig::default().block_size);
        assert_eq!(refused(&w, blocks + 1), 0);
        assert!(refused(&w, blocks) > 0);
    }
}
