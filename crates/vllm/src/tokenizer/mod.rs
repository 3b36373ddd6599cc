//! Tokenization that needs no files: a deterministic built-in tokenizer and chat template.
//!
//! The simulator and the router must turn the same text into the same tokens, every time and
//! in every process. The built-in tokenizer cuts text into words (each with its one leading
//! space) and runs of other whitespace, and those into pieces of at most three bytes; a piece's
//! id encodes its bytes, so decoding is exact and no vocabulary file is needed. It averages about three characters per
//! token, close enough to real tokenizers for cache and latency behaviour. Text that shares a
//! prefix (ending at a run boundary) shares its tokens, as chat histories need.

mod chat;
#[cfg(feature = "hf-tokenizer")]
mod hf;
pub mod pyjson;

pub use chat::{Chat, ChatMessage, ContentFormat, template_kwargs, template_tool};
#[cfg(feature = "hf-tokenizer")]
pub use hf::HfTokenizer;

/// First id used for text pieces; lower ids are reserved for special tokens.
const PIECE_BASE: u32 = 256;

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

    /// The prompt text of `messages`, in the ChatML layout many models use; with
    /// `add_generation_prompt` it ends where the assistant's reply starts.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> String {
        self.render(messages, None, add_generation_prompt, false)
    }

    /// The prompt text of `chat` in the same layout: its tools first, one JSON schema per line
    /// in a `tools` turn; an assistant's tool calls after its text, each as
    /// `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; the last
    /// message left open when the chat continues it. Other template arguments change nothing.
    pub fn render_chat(&self, chat: &Chat) -> String {
        self.render(
            &chat.messages,
            chat.tools.as_deref(),
            chat.add_generation_prompt(),
            chat.continue_final_message(),
        )
    }

    fn render(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
        open_last: bool,
    ) -> String {
        let mut text = String::new();
        let layout = pyjson::Layout::default();
        if let Some(tools) = tools.filter(|t| !t.is_empty()) {
            text.push_str("<|im_start|>tools\n");
            for tool in tools {
                text.push_str(&pyjson::dumps(tool, &layout));
                text.push('\n');
            }
            text.push_str("<|im_end|>\n");
        }
        for (i, m) in messages.iter().enumerate() {
            text.push_str("<|im_start|>");
            text.push_str(&m.role);
            text.push('\n');
            text.push_str(&m.content);
            if m.role == "assistant" && m.tool_calls.is_some() {
                let view = m.template_value(ContentFormat::String);
                for call in view["tool_calls"].as_array().into_iter().flatten() {
                    let function = &call["function"];
                    let shown = serde_json::json!({
                        "name": function["name"],
                        "arguments": function["arguments"],
                    });
                    text.push_str("<tool_call>");
                    text.push_str(&pyjson::dumps(&shown, &layout));
                    text.push_str("</tool_call>");
                }
            }
            if !(open_last && i + 1 == messages.len()) {
                text.push_str("<|im_end|>\n");
            }
        }
        if add_generation_prompt && !open_last {
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
            ChatMessage::new("system", "You are terse."),
            ChatMessage::new("user", "Hi there"),
        ];
        let turn1 = tok.encode(&tok.apply_chat_template(&messages, true));
        messages.push(ChatMessage::new("assistant", "Hello."));
        messages.push(ChatMessage::new("user", "More?"));
        let turn2 = tok.encode(&tok.apply_chat_template(&messages, true));
        assert_eq!(&turn2[..turn1.len()], &turn1[..]);
    }

    /// An agent's tool-calling turns: the tools and each call rendered, and each turn's prompt a
    /// token prefix of the next one's up to where the generation prompt was.
    #[test]
    fn tool_calls_render_and_agent_turns_share_their_history() {
        let tok = BuiltinTokenizer;
        let tools = vec![
            serde_json::json!({"type": "function", "function": {"name": "f", "description": null, "parameters": {"type": "object"}}}),
        ];
        let call = serde_json::json!({"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"city\": \"Zürich\", \"days\": 2}"}});
        let mut chat = Chat {
            tools: Some(tools),
            ..Chat::new(vec![ChatMessage::new("user", "weather?")])
        };
        let first = tok.render_chat(&chat);
        assert_eq!(
            first,
            "<|im_start|>tools\n{\"type\": \"function\", \"function\": {\"name\": \"f\", \"description\": null, \"parameters\": {\"type\": \"object\"}}}\n<|im_end|>\n<|im_start|>user\nweather?<|im_end|>\n<|im_start|>assistant\n"
        );
        chat.messages.push(ChatMessage {
            tool_calls: Some(vec![call]),
            ..ChatMessage::new("assistant", "")
        });
        chat.messages.push(ChatMessage {
            tool_call_id: Some("c1".into()),
            ..ChatMessage::new("tool", "sunny")
        });
        let second = tok.render_chat(&chat);
        assert!(second.starts_with(&first), "{second}");
        assert!(
            second.contains("<|im_start|>assistant\n<tool_call>{\"name\": \"f\", \"arguments\": {\"city\": \"Zürich\", \"days\": 2}}</tool_call><|im_end|>\n<|im_start|>tool\nsunny<|im_end|>\n"),
            "{second}"
        );
        let (a, b) = (tok.encode(&first), tok.encode(&second));
        assert_eq!(&b[..a.len()], &a[..]);
        // Continued: the last message stays open, no generation prompt.
        chat.messages.push(ChatMessage::new("assistant", "It is"));
        chat.kwargs
            .insert("continue_final_message".into(), true.into());
        assert!(
            tok.render_chat(&chat)
                .ends_with("<|im_start|>assistant\nIt is")
        );
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
