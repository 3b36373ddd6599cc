//! Seeded, reproducible workloads: multi-turn chat, shared-prefix tenants, trace replay.
//!
//! A workload is a list of sessions; a session is a sequence of turns sent one after another
//! (each waits for the previous answer plus a think time). Chat sessions resend their whole
//! history every turn, as chat clients do, which is what makes prefix caching matter.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

/// What a turn sends.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub enum Content {
    /// Text (a chat message, or a completions prompt).
    Text(String),
    /// Token ids (a completions prompt).
    Tokens(Vec<u32>),
}

/// One request of a session.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Turn {
    /// Seconds to wait after the previous answer before sending.
    pub think_s: f64,
    /// The new user message (chat) or the whole prompt (completions).
    pub content: Content,
    /// Tokens to generate.
    pub max_tokens: u32,
}

/// A conversation, a tenant's question, or a trace row.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Session {
    /// Session id.
    pub id: u64,
    /// When it starts, seconds from the start of the run (open loop).
    pub start_s: f64,
    /// A system message sent first in every turn (chat).
    pub system: Option<String>,
    /// Its turns.
    pub turns: Vec<Turn>,
}

/// Which OpenAI API a workload uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Api {
    /// `/v1/chat/completions` with the history as messages.
    Chat,
    /// `/v1/completions` with one prompt per request.
    Completions,
}

/// A whole workload.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Workload {
    /// Its kind and parameters, for the record.
    pub description: serde_json::Value,
    /// The API it uses.
    pub api: Api,
    /// Its sessions.
    pub sessions: Vec<Session>,
}

impl Workload {
    /// Requests in the workload.
    pub fn requests(&self) -> usize {
        self.sessions.iter().map(|s| s.turns.len()).sum()
    }
}

/// Text of about `tokens` tokens: words drawn from a seeded generator (kvroute's built-in
/// tokenizer makes about 1.5 tokens of a word like these; real tokenizers similar).
pub fn words(rng: &mut StdRng, tokens: usize) -> String {
    const SYLLABLES: [&str; 16] = [
        "ka", "vo", "ru", "te", "mi", "pla", "zen", "dor", "qui", "sel", "bo", "nu", "fa", "ri",
        "lex", "tam",
    ];
    let count = (tokens * 2).div_ceil(3).max(1);
    let mut out = String::with_capacity(count * 6);
    for i in 0..count {
        if i > 0 {
            out.push(' ');
        }
        for _ in 0..rng.random_range(1..=3) {
            out.push_str(SYLLABLES[rng.random_range(0..SYLLABLES.len())]);
        }
    }
    out
}

/// Exponential inter-arrival gaps: Poisson arrivals at `rate_per_s`.
fn poisson_starts(rng: &mut StdRng, n: usize, rate_per_s: f64) -> Vec<f64> {
    let mut t = 0.0;
    (0..n)
        .map(|_| {
            let u: f64 = rng.random_range(f64::EPSILON..1.0);
            t += -u.ln() / rate_per_s.max(1e-9);
            t
        })
        .collect()
}

/// Settings of the multi-turn chat workload.
#[derive(Clone, Debug, Serialize)]
pub struct MultiTurn {
    /// Users (conversations).
    pub users: usize,
    /// Turns per conversation.
    pub turns: usize,
    /// Tokens of the system prompt all users share.
    pub system_tokens: usize,
    /// Tokens of each user message.
    pub user_tokens: usize,
    /// Tokens generated per turn.
    pub output_tokens: u32,
    /// Seconds between an answer and the next question.
    pub think_s: f64,
    /// New conversations per second.
    pub rate_per_s: f64,
    /// Random seed.
    pub seed: u64,
}

/// N users each holding a T-turn conversation under a shared system prompt.
pub fn multi_turn(p: &MultiTurn) -> Workload {
    let mut rng = StdRng::seed_from_u64(p.seed);
    let system = words(&mut rng, p.system_tokens);
    let starts = poisson_starts(&mut rng, p.users, p.rate_per_s);
    let sessions = starts
        .into_iter()
        .enumerate()
        .map(|(i, start_s)| Session {
            id: i as u64,
            start_s,
            system: Some(system.clone()),
            turns: (0..p.turns)
                .map(|t| Turn {
                    think_s: if t == 0 {
                        0.0
                    } else {
                        p.think_s * rng.random_range(0.5..1.5)
                    },
                    content: Content::Text(words(&mut rng, p.user_tokens)),
                    max_tokens: p.output_tokens,
                })
                .collect(),
        })
        .collect();
    Workload {
        description: serde_json::json!({"workload": "multi-turn", "params": p}),
        api: Api::Chat,
        sessions,
    }
}

/// Settings of the shared-prefix workload.
#[derive(Clone, Debug, Serialize)]
pub struct SharedPrefix {
    /// Groups, each with its own long shared context (a document, a codebase summary).
    pub groups: usize,
    /// Tokens of each group's context.
    pub context_tokens: usize,
    /// Questions per group.
    pub questions: usize,
    /// Tokens of each question.
    pub question_tokens: usize,
    /// Tokens generated per answer.
    pub output_tokens: u32,
    /// Questions per second, all groups together.
    pub rate_per_s: f64,
    /// Random seed.
    pub seed: u64,
}

/// G groups with a long shared context each and many short questions (llm-d's benchmark shape).
pub fn shared_prefix(p: &SharedPrefix) -> Workload {
    let mut rng = StdRng::seed_from_u64(p.seed);
    let contexts: Vec<String> = (0..p.groups)
        .map(|_| words(&mut rng, p.context_tokens))
        .collect();
    let n = p.groups * p.questions;
    let starts = poisson_starts(&mut rng, n, p.rate_per_s);
    let sessions = starts
        .into_iter()
        .enumerate()
        .map(|(i, start_s)| Session {
            id: i as u64,
            start_s,
            system: Some(contexts[rng.random_range(0..p.groups)].clone()),
            turns: vec![Turn {
                think_s: 0.0,
                content: Content::Text(words(&mut rng, p.question_tokens)),
                max_tokens: p.output_tokens,
            }],
        })
        .collect();
    Workload {
        description: serde_json::json!({"workload": "shared-prefix", "params": p}),
        api: Api::Chat,
        sessions,
    }
}

/// One single-turn completions session per prompt, at the given arrival times.
pub fn from_prompts(
    description: serde_json::Value,
    prompts: Vec<(f64, Vec<u32>, u32)>,
) -> Workload {
    Workload {
        description,
        api: Api::Completions,
        sessions: prompts
            .into_iter()
            .enumerate()
            .map(|(i, (start_s, tokens, max_tokens))| Session {
                id: i as u64,
                start_s,
                system: None,
                turns: vec![Turn {
                    think_s: 0.0,
                    content: Content::Tokens(tokens),
                    max_tokens: max_tokens.max(1),
                }],
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mt(seed: u64) -> MultiTurn {
        MultiTurn {
            users: 5,
            turns: 3,
            system_tokens: 300,
            user_tokens: 40,
            output_tokens: 16,
            think_s: 1.0,
            rate_per_s: 2.0,
            seed,
        }
    }

    #[test]
    fn workloads_are_deterministic_for_a_seed() {
        assert_eq!(multi_turn(&mt(7)), multi_turn(&mt(7)));
        assert_ne!(multi_turn(&mt(7)), multi_turn(&mt(8)));
        let sp = SharedPrefix {
            groups: 3,
            context_tokens: 500,
            questions: 4,
            question_tokens: 20,
            output_tokens: 8,
            rate_per_s: 5.0,
            seed: 1,
        };
        assert_eq!(shared_prefix(&sp), shared_prefix(&sp));
    }

    #[test]
    fn multi_turn_shares_the_system_prompt_and_arrives_in_order() {
        let w = multi_turn(&mt(1));
        assert_eq!(w.requests(), 15);
        let system = w.sessions[0].system.clone();
        assert!(w.sessions.iter().all(|s| s.system == system));
        assert!(w.sessions.windows(2).all(|p| p[0].start_s <= p[1].start_s));
        let tokens = kvroute_vllm::tokenizer::BuiltinTokenizer
            .encode(system.as_deref().unwrap())
            .len();
        assert!((200..=500).contains(&tokens), "about 300 tokens: {tokens}");
    }

    #[test]
    fn shared_prefix_groups_share_contexts() {
        let w = shared_prefix(&SharedPrefix {
            groups: 2,
            context_tokens: 200,
            questions: 10,
            question_tokens: 10,
            output_tokens: 4,
            rate_per_s: 10.0,
            seed: 3,
        });
        let distinct: std::collections::HashSet<_> =
            w.sessions.iter().map(|s| s.system.clone()).collect();
        assert_eq!(distinct.len(), 2);
        assert_eq!(w.requests(), 20);
    }
}
