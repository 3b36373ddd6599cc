//! The ceiling a routing policy can reach: the prefix-cache hit rate of one engine whose cache
//! is as large as the whole fleet's, serving the same requests in the same order. Computed
//! offline with the simulator's engine model (vLLM's cache rules), for chat workloads rendered
//! with the built-in tokenizer and template, and completions workloads (traces) as sent.

use kvroute_sim::engine::{Engine, EngineConfig, EngineRequest};
use kvroute_vllm::tokenizer::{BuiltinTokenizer, ChatMessage};

use crate::workload::{Api, Workload};

/// The hit rate of a single engine with the whole fleet's cache serving the workload's
/// requests one after another, with the assistant replies a real run would produce.
pub fn pooled_hit_rate(workload: &Workload, config: &EngineConfig) -> f64 {
    let mut engine = Engine::new(config.clone()).expect("valid configuration");
    let tokenizer = BuiltinTokenizer;
    // Order requests as they would arrive: by session start, then turn.
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
                .map(|sys| ChatMessage {
                    role: "system".into(),
                    content: sys.clone(),
                })
                .collect()
        })
        .collect();
    let (mut prompt_total, mut cached_total) = (0u64, 0u64);
    for (i, (_, si, ti)) in order.into_iter().enumerate() {
        let turn = &workload.sessions[si].turns[ti];
        let prompt = match workload.api {
            // A completions prompt is sent as it is.
            Api::Completions => turn.content.completion_tokens(),
            Api::Chat => {
                histories[si].push(ChatMessage {
                    role: "user".into(),
                    content: turn.content.chat_text(),
                });
                tokenizer.encode(&tokenizer.apply_chat_template(&histories[si], true))
            }
        };
        let reply: Vec<u32> = tokenizer.encode(&" reply".repeat(turn.max_tokens as usize / 2));
        let _ = engine.add_request(EngineRequest {
            id: i as u64,
            prompt: prompt.clone(),
            output: reply.clone(),
            lora_name: None,
            cache_salt: None,
        });
        while engine.has_work() {
            for t in engine.step().tokens.into_iter().filter(|t| t.index == 0) {
                prompt_total += t.prompt_tokens as u64;
                cached_total += t.cached_tokens as u64;
            }
        }
        histories[si].push(ChatMessage {
            role: "assistant".into(),
            content: tokenizer.decode(&reply),
        });
    }
    if prompt_total == 0 {
        0.0
    } else {
        cached_total as f64 / prompt_total as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{MultiTurn, multi_turn};

    fn workload() -> Workload {
        multi_turn(&MultiTurn {
            users: 4,
            turns: 3,
            system_tokens: 200,
            user_tokens: 50,
            output_tokens: 16,
            think_s: 1.0,
            rate_per_s: 4.0,
            seed: 5,
        })
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
}
