//! Tokenization that needs no files: a deterministic built-in tokenizer and chat template.
//!
//! The simulator and the router must turn the same text into the same tokens, every time and
//! in every process. The built-in tokenizer cuts text into words (each with its one leading
//! space) and runs of other whitespace, and those into pieces of at most three bytes; a piece's
//! id encodes its bytes, so decoding is exact and no vocabulary file is needed. It averages about three characters per
//! token, close enough to real tokenizers for cache and latency behaviour. Text that shares a
//! prefix (ending at a run boundary) shares its tokens, as chat histories need.

use serde::{Deserialize, Serialize};

#[cfg(feature = "hf-tokenizer")]
mod hf;
#[cfg(feature = "hf-tokenizer")]
pub use hf::HfTokenizer;

/// First id used for text pieces; lower ids are reserved for special tokens.
const PIECE_BASE: u32 = 256;

/// A chat message as the OpenAI API sends it (text content only).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, ...
    pub role: String,
    /// The message text.
    pub content: String,
}

/// The built-in tokenizer.
#[derive(Clone, Copy, Debug, Default)]
pub struct BuiltinTokenizer;

impl BuiltinTokenizer {
    /// Token ids of `text`.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        let bytes = text.as_bytes();
        let ws = |i: usize| bytes.get(i).is_some_and(u8::is_ascii_whitespace);
        // A single space before a word belongs to the word, as in GPT-style tokenizers.
        let word_start = |i: usize| bytes[i] == b' ' && i + 1 < bytes.len() && !ws(i + 1);
        let mut start = 0;
        while start < bytes.len() {
            let mut end = start + 1;
            if word_start(start) || !ws(start) {
                while end < bytes.len() && !ws(end) {
                    end += 1;
                }
            } else {
                while end < bytes.len() && ws(end) && !word_start(end) {
                    end += 1;
                }
            }
            for piece in bytes[start..end].chunks(3) {
                out.push(piece_id(piece));
            }
            start = end;
        }
        out
    }

    /// The text of `tokens`; ids that are not text pieces decode to nothing.
    pub fn decode(&self, tokens: &[u32]) -> String {
        let mut bytes = Vec::with_capacity(tokens.len() * 3);
        for &t in tokens {
            piece_bytes(t, &mut bytes);
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// The prompt text of a chat, in the ChatML layout many models use; with
    /// `add_generation_prompt` it ends where the assistant's reply starts.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> String {
        let mut text = String::new();
        for m in messages {
            text.push_str("<|im_start|>");
            text.push_str(&m.role);
            text.push('\n');
            text.push_str(&m.content);
            text.push_str("<|im_end|>\n");
        }
        if add_generation_prompt {
            text.push_str("<|im_start|>assistant\n");
        }
        text
    }
}

fn piece_id(piece: &[u8]) -> u32 {
    let mut v = (piece.len() as u32) << 24;
    for (i, b) in piece.iter().enumerate() {
        v |= u32::from(*b) << (16 - 8 * i);
    }
    PIECE_BASE + v
}

fn piece_bytes(token: u32, out: &mut Vec<u8>) {
    let Some(v) = token.checked_sub(PIECE_BASE) else {
        return;
    };
    let len = (v >> 24) as usize;
    if !(1..=3).contains(&len) || v >> 26 != 0 {
        return;
    }
    for i in 0..len {
        out.push((v >> (16 - 8 * i)) as u8);
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn roughly_three_characters_per_token() {
        let t = BuiltinTokenizer.encode("KV-cache aware routing keeps turn two on the same pod.");
        assert!((15..=25).contains(&t.len()), "{}", t.len());
    }

    #[test]
    fn chat_history_is_a_token_prefix_of_the_next_turn() {
        let tok = BuiltinTokenizer;
        let mut messages = vec![
            ChatMessage {
                role: "system".into(),
                content: "You are terse.".into(),
            },
            ChatMessage {
                role: "user".into(),
                content: "Hi there".into(),
            },
        ];
        let turn1 = tok.encode(&tok.apply_chat_template(&messages, true));
        messages.push(ChatMessage {
            role: "assistant".into(),
            content: "Hello.".into(),
        });
        messages.push(ChatMessage {
            role: "user".into(),
            content: "More?".into(),
        });
        let turn2 = tok.encode(&tok.apply_chat_template(&messages, true));
        assert_eq!(&turn2[..turn1.len()], &turn1[..]);
    }

    proptest! {
        #[test]
        fn decode_inverts_encode(text in "\\PC{0,200}") {
            let tok = BuiltinTokenizer;
            prop_assert_eq!(tok.decode(&tok.encode(&text)), text);
        }

        #[test]
        fn decode_never_panics(tokens in proptest::collection::vec(any::<u32>(), 0..64)) {
            let _ = BuiltinTokenizer.decode(&tokens);
        }
    }
}
