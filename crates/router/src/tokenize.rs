//! Turning a request into prompt tokens: the built-in tokenizer, the engine's `/tokenize`, or
//! none. Results are cached by prompt, so a retried or repeated prompt is tokenized once.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use kvroute_vllm::openai::Input;
use kvroute_vllm::tokenizer::BuiltinTokenizer;
use quick_cache::sync::{Cache, DefaultLifecycle};
use quick_cache::{DefaultHashBuilder, OptionsBuilder, Weighter};
use serde_json::{Value, json};
use tracing::warn;

use kvroute_vllm::tokenizer::HfTokenizer;

use crate::config::{HfTokenizerConfig, Limits, TokenizerConfig, TokenizerKind};
use crate::{ProbeError, RouterError};

/// A model's tokenizer, loaded.
#[derive(Clone)]
pub enum ModelTokenizer {
    /// kvroute's built-in tokenizer.
    Builtin,
    /// The engine's `/tokenize`.
    Remote,
    /// None: approximate routing only.
    None,
    /// A HuggingFace tokenizer and chat template.
    Hf(Arc<HfTokenizer>),
}

impl ModelTokenizer {
    /// Loads what `config` names (HF files are read now, so a bad path or a tokenizer without
    /// a chat template fails at start).
    pub fn load(config: &TokenizerConfig) -> Result<Self, RouterError> {
        Ok(match config {
            TokenizerConfig::Kind(TokenizerKind::Builtin) => Self::Builtin,
            TokenizerConfig::Kind(TokenizerKind::Remote) => Self::Remote,
            TokenizerConfig::Kind(TokenizerKind::None) => Self::None,
            TokenizerConfig::Hf(HfTokenizerConfig {
                hf,
                chat_template,
                chat_template_kwargs,
                chat_template_content_format,
                exclude_tools_when_tool_choice_none,
            }) => {
                let tokenizer = HfTokenizer::load(hf, chat_template.as_deref())
                    .map_err(|e| RouterError::Config(format!("models: {e}")))?
                    .with_default_kwargs(chat_template_kwargs.clone().unwrap_or_default())
                    .with_content_format(chat_template_content_format.forced())
                    .excluding_tools_when_tool_choice_none(*exclude_tools_when_tool_choice_none);
                // Chat requests could not be tokenized: refuse at start rather than route
                // every chat without cache information.
                if !tokenizer.has_chat_template() {
                    return Err(RouterError::Config(format!(
                        "models: {}: no chat template (no chat_template.jinja beside it, no \
                         chat_template in tokenizer_config.json): set chat_template: \
                         path/to/template.jinja",
                        hf.display()
                    )));
                }
                Self::Hf(Arc::new(tokenizer))
            }
        })
    }
}

/// Bytes an entry costs besides its tokens (key, `Arc`, `Vec` header, the cache's slot).
const ENTRY_OVERHEAD: u64 = 96;

/// Parts the cache is split in: few, so that one part holds a long prompt (a quarter of the
/// budget), enough that concurrent requests rarely wait on each other.
pub const SHARDS: usize = 4;

/// Largest answer accepted from an engine's `/tokenize`.
const MAX_TOKENIZE_RESPONSE_BYTES: usize = 64 << 20;

/// Weighs a cached prompt by the bytes its tokens take.
#[derive(Clone, Copy, Debug)]
struct TokenBytes;

impl Weighter<u64, Arc<Vec<u32>>> for TokenBytes {
    fn weight(&self, _key: &u64, tokens: &Arc<Vec<u32>>) -> u64 {
        tokens.len() as u64 * 4 + ENTRY_OVERHEAD
    }
}

/// Prompt tokens by hash of (model, input); bounded in bytes.
pub struct TokenCache {
    cache: Cache<u64, Arc<Vec<u32>>, TokenBytes>,
}

impl TokenCache {
    /// A cache expecting about `entries` prompts, holding at most
    /// `Limits::default().token_cache_bytes` bytes of tokens.
    pub fn new(entries: usize) -> Self {
        Self::with_budget(entries, Limits::default().token_cache_bytes)
    }

    /// A cache holding at most `limits.token_cache_bytes` bytes of tokens.
    pub fn with_limits(limits: &Limits) -> Self {
        Self::with_budget(4096, limits.token_cache_bytes)
    }

    /// A cache expecting about `entries` prompts and holding at most `bytes` bytes of tokens.
    /// The cache is split in [`SHARDS`] independent parts; a prompt larger than one part
    /// (`bytes / SHARDS`) is not cached.
    pub fn with_budget(entries: usize, bytes: usize) -> Self {
        let options = OptionsBuilder::new()
            .estimated_items_capacity(entries.max(1))
            .weight_capacity(bytes as u64)
            .shards(SHARDS)
            .build()
            .expect("capacities and shard count are valid");
        Self {
            cache: Cache::with_options(
                options,
                TokenBytes,
                DefaultHashBuilder::default(),
                DefaultLifecycle::default(),
            ),
        }
    }

    /// Bytes held now.
    pub fn weight(&self) -> u64 {
        self.cache.weight()
    }
}

fn input_hash(model: &str, input: &Input) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    model.hash(&mut h);
    match input {
        Input::Text(t) => (0u8, t).hash(&mut h),
        Input::Tokens(t) => (1u8, t).hash(&mut h),
        Input::Chat(chat) => {
            2u8.hash(&mut h);
            for msg in &chat.messages {
                (&msg.role, &msg.content).hash(&mut h);
                // Rarely there: written out only when they are, after a marker saying so.
                let extras = (
                    &msg.name,
                    &msg.tool_calls,
                    &msg.tool_call_id,
                    &msg.reasoning,
                );
                let has_extras = extras != (&None, &None, &None, &None);
                has_extras.hash(&mut h);
                if has_extras {
                    serde_json::to_string(&extras)
                        .unwrap_or_default()
                        .hash(&mut h);
                }
                // Parts, where the content came as a list (they say more than the text: media,
                // empty parts, fields of the parts).
                msg.parts.is_some().hash(&mut h);
                if let Some(parts) = &msg.parts {
                    serde_json::to_string(parts)
                        .unwrap_or_default()
                        .hash(&mut h);
                }
            }
            serde_json::to_string(&(&chat.tools, &chat.kwargs))
                .unwrap_or_default()
                .hash(&mut h);
            chat.tool_choice_none.hash(&mut h);
        }
    }
    h.finish()
}

/// Where remote tokenization goes.
pub struct Remote<'a> {
    /// HTTP client.
    pub client: &'a Client<HttpConnector, Full<Bytes>>,
    /// An engine's `scheme://authority`.
    pub base: String,
    /// Give up after this long.
    pub timeout: Duration,
}

/// The prompt's tokens, or `None` when the model has no tokenizer (or remote tokenization
/// failed: the request is then routed without cache information, never refused for it).
pub async fn tokenize(
    cache: &TokenCache,
    kind: &ModelTokenizer,
    model: &str,
    input: &Input,
    remote: Option<Remote<'_>>,
) -> Option<Arc<Vec<u32>>> {
    if let Input::Tokens(tokens) = input {
        return Some(Arc::new(tokens.clone()));
    }
    if matches!(kind, ModelTokenizer::None) {
        return None;
    }
    let key = input_hash(model, input);
    if let Some(hit) = cache.cache.get(&key) {
        return Some(hit);
    }
    let tokens = match kind {
        ModelTokenizer::Hf(hf) => {
            let encoded = match input {
                Input::Text(t) => hf.encode(t, true),
                Input::Chat(chat) => hf.encode_chat(chat),
                Input::Tokens(t) => Ok(t.clone()),
            };
            match encoded {
                Ok(tokens) => tokens,
                Err(e) => {
                    warn!(model, error = %e, "cannot tokenize this request: routing it without cache information");
                    return None;
                }
            }
        }
        ModelTokenizer::Builtin => {
            let tok = BuiltinTokenizer;
            match input {
                Input::Text(t) => tok.encode(t),
                Input::Chat(chat) => tok.encode(&tok.render_chat(chat)),
                Input::Tokens(t) => t.clone(),
            }
        }
        ModelTokenizer::Remote => {
            let Some(remote) = remote else {
                warn!(
                    model,
                    "no healthy endpoint to tokenize with: routing without cache information"
                );
                return None;
            };
            match remote_tokenize(remote, model, input).await {
                Ok(tokens) => tokens,
                Err(e) => {
                    warn!(model, error = %e, "remote tokenization failed: routing without cache information");
                    return None;
                }
            }
        }
        ModelTokenizer::None => return None,
    };
    let tokens = Arc::new(tokens);
    cache.cache.insert(key, tokens.clone());
    Some(tokens)
}

/// Why the engine's `/tokenize` could not tokenize a prompt.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    /// The request failed, timed out, or its answer could not be read.
    #[error("{url}: {source}")]
    Request {
        /// The `/tokenize` URL.
        url: String,
        /// What went wrong.
        source: ProbeError,
    },
    /// The engine answered with an error status.
    #[error("{url} answered {status}")]
    Status {
        /// The `/tokenize` URL.
        url: String,
        /// Its status.
        status: http::StatusCode,
    },
    /// The answer is not JSON.
    #[error("{url}: not JSON: {source}")]
    Json {
        /// The `/tokenize` URL.
        url: String,
        /// The parse error.
        source: serde_json::Error,
    },
    /// The answer has no list of token ids.
    #[error("{url}: no list of token ids in the answer")]
    NoTokens {
        /// The `/tokenize` URL.
        url: String,
    },
}

async fn remote_tokenize(
    remote: Remote<'_>,
    model: &str,
    input: &Input,
) -> Result<Vec<u32>, TokenizeError> {
    let body = match input {
        Input::Text(t) => json!({"model": model, "prompt": t}),
        // The messages and tools as read (a list content as sent), and the template's arguments
        // with the request's own fields among them (documents, reasoning effort), which vLLM's
        // chat `/tokenize` takes only as template arguments.
        Input::Chat(chat) => {
            let (messages, tools) = chat.api_messages_and_tools();
            json!({
                "model": model,
                "messages": messages,
                "tools": tools,
                "add_generation_prompt": chat.add_generation_prompt(),
                "continue_final_message": chat.continue_final_message(),
                "chat_template_kwargs": chat.kwargs,
            })
        }
        Input::Tokens(t) => return Ok(t.clone()),
    };
    let url = format!("{}/tokenize", remote.base);
    let failed = |source: ProbeError| TokenizeError::Request {
        url: url.clone(),
        source,
    };
    let request = http::Request::post(&url)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .map_err(|e| failed(e.into()))?;
    let response = tokio::time::timeout(remote.timeout, remote.client.request(request))
        .await
        .map_err(|_| failed(ProbeError::Timeout))?
        .map_err(|e| failed(e.into()))?;
    if !response.status().is_success() {
        let status = response.status();
        return Err(TokenizeError::Status { url, status });
    }
    let limited = Limited::new(response.into_body(), MAX_TOKENIZE_RESPONSE_BYTES);
    let bytes = tokio::time::timeout(remote.timeout, limited.collect())
        .await
        .map_err(|_| failed(ProbeError::BodyTimeout))?
        .map_err(|e| failed(ProbeError::Body(e)))?
        .to_bytes();
    let value: Value = match serde_json::from_slice(&bytes) {
        Ok(value) => value,
        Err(source) => return Err(TokenizeError::Json { url, source }),
    };
    value["tokens"]
        .as_array()
        .and_then(|tokens| {
            tokens
                .iter()
                .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                .collect::<Option<Vec<u32>>>()
        })
        .ok_or(TokenizeError::NoTokens { url })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_cache_is_bounded_by_the_bytes_of_its_tokens() {
        let cache = TokenCache::with_budget(16, 1 << 20);
        for i in 0..12 {
            // ~200 KB of tokens each (two per word): about 2.4 MB offered to a 1 MiB cache.
            let text = format!("p{i} {}", "word ".repeat(25_000));
            let tokens = tokenize(
                &cache,
                &ModelTokenizer::Builtin,
                "m",
                &Input::Text(text),
                None,
            )
            .await
            .unwrap();
            assert!(tokens.len() > 40_000);
            assert!(cache.weight() <= 1 << 20, "{} bytes held", cache.weight());
        }
        assert!(cache.weight() > 0);
    }

    /// The cache is keyed by everything the template renders: a chat whose tools, tool calls or
    /// template arguments differ is tokenized again, not given another chat's tokens.
    #[tokio::test]
    async fn chats_that_render_differently_are_cached_apart() {
        let cache = TokenCache::with_budget(16, 1 << 20);
        let chat = |body: serde_json::Value| {
            Input::Chat(Box::new(kvroute_vllm::openai::chat_input(&body).unwrap()))
        };
        let question = json!([{"role": "user", "content": "weather?"}]);
        let call = json!([
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{\"city\": \"Paris\"}"}}]},
        ]);
        let other_call = json!([
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{\"city\": \"Rome\"}"}}]},
        ]);
        let tool = json!([{"type": "function", "function": {"name": "f"}}]);
        let inputs = [
            chat(json!({"messages": question})),
            chat(json!({"messages": question, "tools": tool})),
            chat(json!({"messages": question, "add_generation_prompt": false})),
            chat(json!({"messages": call})),
            chat(json!({"messages": other_call})),
        ];
        let mut seen = Vec::new();
        for input in &inputs {
            let tokens = tokenize(&cache, &ModelTokenizer::Builtin, "m", input, None)
                .await
                .unwrap();
            assert!(
                !seen.contains(&tokens),
                "{input:?} got another chat's tokens"
            );
            seen.push(tokens);
        }
        // The same chat again is the same prompt.
        let again = tokenize(&cache, &ModelTokenizer::Builtin, "m", &inputs[1], None)
            .await
            .unwrap();
        assert_eq!(again, seen[1]);
    }

    /// A chat whose `tool_choice` is `none` renders without its tools on engines that exclude
    /// them (`exclude_tools_when_tool_choice_none`): it is keyed apart from the same chat with
    /// another choice, so neither is given the other's tokens.
    #[test]
    fn tool_choice_none_is_part_of_a_chats_key() {
        let chat = |choice: &str| {
            Input::Chat(Box::new(
                kvroute_vllm::openai::chat_input(&json!({
                    "messages": [{"role": "user", "content": "weather?"}],
                    "tools": [{"type": "function", "function": {"name": "f"}}],
                    "tool_choice": choice,
                }))
                .unwrap(),
            ))
        };
        assert_ne!(
            input_hash("m", &chat("none")),
            input_hash("m", &chat("auto"))
        );
        assert_eq!(
            input_hash("m", &chat("none")),
            input_hash("m", &chat("none"))
        );
    }
}
