//! The client side of a simulated run, as `kvroute bench`'s driver behaves: each session's
//! turns in order, chat histories resent every turn with the assistant's answers, and prompts
//! tokenized exactly as the simulated server tokenizes what the driver sends (the built-in
//! tokenizer and its chat template).

use kvroute_bench::workload::{Api, Workload};
use kvroute_vllm::tokenizer::{BuiltinTokenizer, ChatMessage};

/// One session's progress.
#[derive(Debug, Default)]
struct SessionState {
    /// The chat so far (chat workloads).
    messages: Vec<ChatMessage>,
    /// The next turn to send.
    next_turn: usize,
}

/// Every session's progress through a workload.
pub struct Client<'a> {
    workload: &'a Workload,
    sessions: Vec<SessionState>,
}

/// A turn ready to send.
pub struct Prepared {
    /// Its index in the session.
    pub turn: usize,
    /// Prompt token ids, as the engine will see them.
    pub prompt: Vec<u32>,
    /// `max_tokens`.
    pub max_tokens: u32,
}

impl<'a> Client<'a> {
    /// No session started yet.
    pub fn new(workload: &'a Workload) -> Self {
        let sessions = workload
            .sessions
            .iter()
            .map(|s| SessionState {
                messages: s
                    .system
                    .iter()
                    .map(|system| message("system", system.clone()))
                    .collect(),
                next_turn: 0,
            })
            .collect();
        Self { workload, sessions }
    }

    /// Whether the workload uses the chat API (answers go into the history).
    pub fn is_chat(&self) -> bool {
        self.workload.api == Api::Chat
    }

    /// Seconds session `session` waits before sending its next turn, if it has one left.
    pub fn think_before_next(&self, session: usize) -> Option<f64> {
        let state = &self.sessions[session];
        self.workload.sessions[session]
            .turns
            .get(state.next_turn)
            .map(|t| t.think_s.max(0.0))
    }

    /// The turns of session `session` not sent yet.
    pub fn turns_left(&self, session: usize) -> std::ops::Range<usize> {
        self.sessions[session].next_turn..self.workload.sessions[session].turns.len()
    }

    /// Builds session `session`'s next turn (its user message joins the history).
    pub fn next_turn(&mut self, session: usize) -> Prepared {
        let state = &mut self.sessions[session];
        let turn = state.next_turn;
        state.next_turn += 1;
        let spec = &self.workload.sessions[session].turns[turn];
        let tokenizer = BuiltinTokenizer;
        let prompt = match self.workload.api {
            Api::Chat => {
                state
                    .messages
                    .push(message("user", spec.content.chat_text()));
                tokenizer.encode(&tokenizer.apply_chat_template(&state.messages, true))
            }
            Api::Completions => spec.content.completion_tokens(),
        };
        Prepared {
            turn,
            prompt,
            max_tokens: spec.max_tokens,
        }
    }

    /// The engine answered `answer` (chat: it joins the history as the driver does).
    pub fn answered(&mut self, session: usize, answer: &[u32]) {
        if self.is_chat() {
            let text = BuiltinTokenizer.decode(answer);
            self.sessions[session]
                .messages
                .push(message("assistant", text));
        }
    }
}

fn message(role: &str, content: String) -> ChatMessage {
    ChatMessage::new(role, content)
}
