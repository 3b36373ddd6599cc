//! Seeded, reproducible workloads: multi-turn chat, shared-prefix tenants, tenants with
//! conversations (skewed popularity, lengths from a distribution), trace replay.
//!
//! A workload is a list of sessions; a session is a sequence of turns sent one after another
//! (each waits for the previous answer plus a think time). Chat sessions resend their whole
//! history every turn, as chat clients do, which is what makes prefix caching matter.

use kvroute_vllm::tokenizer::BuiltinTokenizer;
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

impl Content {
    /// The text of the chat message a turn sends, as `kvroute bench` sends it (token ids, a
    /// completions prompt's form, as their list).
    pub fn chat_text(&self) -> String {
        match self {
            Content::Text(t) => t.clone(),
            Content::Tokens(t) => format!("{t:?}"),
        }
    }

    /// The prompt of a completions request sending this, as the built-in tokenizer (the
    /// simulator's) sees it.
    pub fn completion_tokens(&self) -> Vec<u32> {
        match self {
            Content::Text(t) => BuiltinTokenizer.encode(t),
            Content::Tokens(t) => t.clone(),
        }
    }
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

/// How popular tenants are.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum TenantSkew {
    /// Every tenant equally.
    Uniform,
    /// Tenant `k` (from 0) in proportion to `1 / (k + 1)^s`.
    Zipf {
        /// The exponent (1.0: the classic Zipf law).
        s: f64,
    },
}

impl std::str::FromStr for TenantSkew {
    type Err = String;

    /// `uniform`, `zipf` (exponent 1) or `zipf:S`.
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text.split_once(':') {
            None if text == "uniform" => Ok(TenantSkew::Uniform),
            None if text == "zipf" => Ok(TenantSkew::Zipf { s: 1.0 }),
            Some(("zipf", s)) => match s.parse::<f64>() {
                Ok(s) if s.is_finite() && s >= 0.0 => Ok(TenantSkew::Zipf { s }),
                _ => Err(format!("zipf exponent {s:?} is not a non-negative number")),
            },
            _ => Err(format!(
                "unknown tenant skew {text:?}: expected uniform, zipf or zipf:S"
            )),
        }
    }
}

impl TenantSkew {
    /// Each tenant's share of the traffic, summing to 1.
    pub fn shares(&self, tenants: usize) -> Vec<f64> {
        let weights: Vec<f64> = (0..tenants)
            .map(|k| match self {
                TenantSkew::Uniform => 1.0,
                TenantSkew::Zipf { s } => 1.0 / ((k + 1) as f64).powf(*s),
            })
            .collect();
        let total: f64 = weights.iter().sum();
        weights.into_iter().map(|w| w / total.max(1e-300)).collect()
    }
}

/// A length around `mean` tokens: log-normal with coefficient of variation `cv` (0: exactly
/// `mean`), at least 1.
pub fn sample_length(rng: &mut StdRng, mean: usize, cv: f64) -> usize {
    if cv <= 0.0 || mean == 0 {
        return mean.max(1);
    }
    let sigma2 = (1.0 + cv * cv).ln();
    let mu = (mean as f64).ln() - sigma2 / 2.0;
    // Box–Muller.
    let u1: f64 = rng.random_range(f64::EPSILON..1.0);
    let u2: f64 = rng.random();
    let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
    ((mu + sigma2.sqrt() * z).exp().round() as usize).max(1)
}

/// Settings of the tenants workload.
#[derive(Clone, Debug, Serialize)]
pub struct Tenants {
    /// Tenants, each with its own long context (a document, a codebase, a long system prompt).
    pub tenants: usize,
    /// Mean tokens of a tenant's context.
    pub context_tokens: usize,
    /// Conversations, all tenants together; each picks its tenant by `skew`.
    pub conversations: usize,
    /// Turns per conversation (1: one question per conversation).
    pub turns: usize,
    /// Mean tokens of each question.
    pub question_tokens: usize,
    /// Coefficient of variation of context and question lengths (log-normal; 0: fixed).
    pub length_cv: f64,
    /// Tokens generated per answer.
    pub output_tokens: u32,
    /// Seconds between an answer and the next question of a conversation.
    pub think_s: f64,
    /// New conversations per second.
    pub rate_per_s: f64,
    /// Tenant popularity.
    pub skew: TenantSkew,
    /// Random seed.
    pub seed: u64,
}

/// Tenants × conversations: each tenant has a long context; conversations start at Poisson
/// times, pick a tenant by popularity, and ask `turns` questions under its context, resending
/// the history each turn.
pub fn tenants(p: &Tenants) -> Workload {
    let mut rng = StdRng::seed_from_u64(p.seed);
    let tenants = p.tenants.max(1);
    let contexts: Vec<String> = (0..tenants)
        .map(|_| {
            let len = sample_length(&mut rng, p.context_tokens, p.length_cv);
            words(&mut rng, len)
        })
        .collect();
    let mut cumulative = 0.0;
    let cdf: Vec<f64> = p
        .skew
        .shares(tenants)
        .into_iter()
        .map(|share| {
            cumulative += share;
            cumulative
        })
        .collect();
    let starts = poisson_starts(&mut rng, p.conversations, p.rate_per_s);
    let sessions = starts
        .into_iter()
        .enumerate()
        .map(|(i, start_s)| {
            let u: f64 = rng.random_range(0.0..cumulative);
            let tenant = cdf.iter().position(|&c| u < c).unwrap_or(tenants - 1);
            Session {
                id: i as u64,
                start_s,
                system: Some(contexts[tenant].clone()),
                turns: (0..p.turns.max(1))
                    .map(|t| {
                        let think_s = if t == 0 {
                            0.0
                        } else {
                            p.think_s * rng.random_range(0.5..1.5)
                        };
                        let len = sample_length(&mut rng, p.question_tokens, p.length_cv);
                        Turn {
                            think_s,
                            content: Content::Text(words(&mut rng, len)),
                            max_tokens: p.output_tokens,
                        }
                    })
                    .collect(),
            }
        })
        .collect();
    Workload {
        description: serde_json::json!({"workload": "tenants", "params": p}),
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

    fn tenant_params(skew: TenantSkew, length_cv: f64) -> Tenants {
        Tenants {
            tenants: 8,
            context_tokens: 300,
            conversations: 400,
            turns: 2,
            question_tokens: 40,
            length_cv,
            output_tokens: 4,
            think_s: 1.0,
            rate_per_s: 10.0,
            skew,
            seed: 5,
        }
    }

    #[test]
    fn zipf_tenants_are_skewed_and_uniform_ones_are_not() {
        let count = |w: &Workload| {
            let mut by: std::collections::HashMap<_, usize> = Default::default();
            for s in &w.sessions {
                *by.entry(s.system.clone()).or_default() += 1;
            }
            let mut counts: Vec<usize> = by.into_values().collect();
            counts.sort_unstable();
            counts
        };
        let uniform = count(&tenants(&tenant_params(TenantSkew::Uniform, 0.0)));
        let zipf = count(&tenants(&tenant_params(TenantSkew::Zipf { s: 1.2 }, 0.0)));
        assert_eq!(uniform.len(), 8);
        assert!(uniform[7] < 2 * uniform[0], "{uniform:?}");
        assert!(zipf[zipf.len() - 1] > 4 * zipf[0], "{zipf:?}");
        assert_eq!("zipf:1.2".parse(), Ok(TenantSkew::Zipf { s: 1.2 }));
        assert!("zipf:x".parse::<TenantSkew>().is_err());
    }

    #[test]
    fn lengths_follow_the_distribution_asked_for() {
        let mut rng = StdRng::seed_from_u64(1);
        let fixed: Vec<usize> = (0..100)
            .map(|_| sample_length(&mut rng, 200, 0.0))
            .collect();
        assert!(fixed.iter().all(|&l| l == 200));
        let spread: Vec<f64> = (0..4000)
            .map(|_| sample_length(&mut rng, 200, 0.5) as f64)
            .collect();
        let mean = spread.iter().sum::<f64>() / spread.len() as f64;
        let sd =
            (spread.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / spread.len() as f64).sqrt();
        assert!((mean - 200.0).abs() < 10.0, "mean {mean}");
        assert!((sd / mean - 0.5).abs() < 0.08, "cv {}", sd / mean);
        let w = tenants(&tenant_params(TenantSkew::Uniform, 0.5));
        assert_eq!(w.requests(), 800);
        assert_eq!(w, tenants(&tenant_params(TenantSkew::Uniform, 0.5)));
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
