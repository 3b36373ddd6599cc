//! The parts of the OpenAI API (as vLLM serves it) that kvroute reads: the request fields that
//! decide routing and generation, and OpenAI-shaped errors.
//!
//! Every request vLLM accepts parses: a batch of prompts (strings or token lists) is scored by
//! its first prompt; chat content parts other than text (images, audio, video) are skipped, so
//! the request is routed by its text (the body is forwarded as the client sent it); a string
//! holding a lone UTF-16 surrogate escape (`"\ud800"`, which Python's `json` accepts) is read
//! with U+FFFD in its place. What cannot be scored at all becomes an empty token list: the
//! request is routed by load alone, never refused for its shape.

mod error;
mod stream_usage;
mod surrogates;

pub use error::{ApiError, Fault};
pub use stream_usage::{
    ask_stream_usage, is_usage_only_event, passes_unexamined, request_stream_usage, sse_event_end,
};

use serde_json::Value;

use crate::tokenizer::{Chat, ChatMessage, template_kwargs, template_tool};

/// What a generation request asks for, parsed once.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerationRequest {
    /// The model (or LoRA adapter) name; `None` when the request names none, which vLLM serves
    /// with its own model.
    pub model: Option<String>,
    /// The prompt.
    pub input: Input,
    /// Most tokens to generate (`max_tokens`, or chat's `max_completion_tokens`).
    pub max_tokens: Option<u32>,
    /// Stream the answer as server-sent events.
    pub stream: bool,
    /// Send a final usage chunk when streaming (`stream_options.include_usage`).
    pub include_usage: bool,
    /// The body names `stream_options` (even as `null`): a router may add it
    /// ([`request_stream_usage`]) only when it does not.
    pub stream_options_given: bool,
    /// vLLM's `cache_salt`: isolates this request's prefix cache.
    pub cache_salt: Option<String>,
}

/// A request's prompt.
#[derive(Clone, Debug, PartialEq)]
pub enum Input {
    /// `/v1/completions` with a text prompt.
    Text(String),
    /// `/v1/completions` with token ids.
    Tokens(Vec<u32>),
    /// `/v1/chat/completions`: the messages, tools and template arguments.
    Chat(Box<Chat>),
}

fn field<'a>(body: &'a Value, name: &str) -> Option<&'a Value> {
    body.get(name).filter(|v| !v.is_null())
}

fn optional_bool(body: &Value, name: &str) -> Result<bool, ApiError> {
    match field(body, name) {
        None => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::bad_request(
            format!("{name} must be a boolean"),
            Some(name),
        )),
    }
}

/// A request body read as JSON once, for callers that need more of it than
/// [`GenerationRequest`] (a P/D proxy rewrites it per leg).
#[derive(Clone, Debug, PartialEq)]
pub struct RequestJson {
    /// The body.
    pub value: Value,
    /// Whether `value` is the client's text exactly: false when lone surrogate escapes were
    /// read as U+FFFD (written back, the body would not be what the client sent).
    pub exact: bool,
}

/// Reads a request body as JSON; lone surrogate escapes, which serde_json refuses, read as
/// U+FFFD (then it is not [`RequestJson::exact`]).
pub fn parse_request_json(body: &[u8]) -> Result<RequestJson, ApiError> {
    match serde_json::from_slice(body) {
        Ok(value) => Ok(RequestJson { value, exact: true }),
        Err(e) => surrogates::replace_lone_surrogates(body)
            .and_then(|fixed| serde_json::from_slice(&fixed).ok())
            .map(|value| RequestJson {
                value,
                exact: false,
            })
            .ok_or_else(|| {
                ApiError::bad_request(format!("request body is not valid JSON: {e}"), None)
            }),
    }
}

fn parse_common(value: &Value) -> Result<GenerationRequest, ApiError> {
    if !value.is_object() {
        return Err(ApiError::bad_request(
            "request body must be a JSON object",
            None,
        ));
    }
    // vLLM's `model` is optional: a request without one is served by the engine's model.
    let model = match field(value, "model") {
        None | Some(Value::Null) => None,
        Some(Value::String(m)) if !m.is_empty() => Some(m.clone()),
        Some(_) => {
            return Err(ApiError::bad_request(
                "model must be a non-empty string",
                Some("model"),
            ));
        }
    };
    let max_tokens =
        match field(value, "max_completion_tokens").or_else(|| field(value, "max_tokens")) {
            None => None,
            Some(v) => Some(
                v.as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .filter(|n| *n >= 1)
                    .ok_or_else(|| {
                        ApiError::bad_request(
                            "max_tokens must be a positive integer",
                            Some("max_tokens"),
                        )
                    })?,
            ),
        };
    let stream = optional_bool(value, "stream")?;
    let include_usage = match field(value, "stream_options") {
        None => false,
        Some(opts) => optional_bool(opts, "include_usage")?,
    };
    let stream_options_given = value.get("stream_options").is_some();
    let cache_salt = match field(value, "cache_salt") {
        None => None,
        Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
        Some(_) => {
            return Err(ApiError::bad_request(
                "cache_salt must be a non-empty string",
                Some("cache_salt"),
            ));
        }
    };
    let request = GenerationRequest {
        model,
        input: Input::Text(String::new()),
        max_tokens,
        stream,
        include_usage,
        stream_options_given,
        cache_salt,
    };
    Ok(request)
}

/// Parses a `/v1/completions` body: `prompt` as a string, token ids, or a batch of either (the
/// first prompt is scored).
pub fn parse_completion(body: &[u8]) -> Result<GenerationRequest, ApiError> {
    completion_from_json(&parse_request_json(body)?.value)
}

/// Reads a `/v1/completions` request from its body already parsed ([`parse_request_json`]), as
/// [`parse_completion`] does.
pub fn completion_from_json(value: &Value) -> Result<GenerationRequest, ApiError> {
    let mut request = parse_common(value)?;
    request.input = match field(value, "prompt") {
        Some(Value::String(s)) => Input::Text(s.clone()),
        Some(Value::Array(items)) if items.iter().all(Value::is_number) => {
            Input::Tokens(token_ids(items)?)
        }
        Some(Value::Array(items)) => match items.first() {
            Some(Value::String(first)) => Input::Text(first.clone()),
            Some(Value::Array(first)) if first.iter().all(Value::is_number) => {
                Input::Tokens(token_ids(first)?)
            }
            // Mixed or unusual batches: routed by load.
            _ => Input::Tokens(Vec::new()),
        },
        Some(_) => {
            return Err(ApiError::bad_request(
                "prompt must be a string, a list of token ids, or a list of either",
                Some("prompt"),
            ));
        }
        None => return Err(ApiError::bad_request("prompt is required", Some("prompt"))),
    };
    Ok(request)
}

fn token_ids(items: &[Value]) -> Result<Vec<u32>, ApiError> {
    items
        .iter()
        .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
        .collect::<Option<Vec<u32>>>()
        .ok_or_else(|| {
            ApiError::bad_request(
                "prompt token ids must be integers in [0, 2^32)",
                Some("prompt"),
            )
        })
}

/// Parses a `/v1/chat/completions` body: `content` as a string or a list of parts, of which the
/// text parts are read.
pub fn parse_chat(body: &[u8]) -> Result<GenerationRequest, ApiError> {
    chat_from_json(&parse_request_json(body)?.value)
}

/// Reads a `/v1/chat/completions` request from its body already parsed
/// ([`parse_request_json`]), as [`parse_chat`] does.
pub fn chat_from_json(value: &Value) -> Result<GenerationRequest, ApiError> {
    let mut request = parse_common(value)?;
    request.input = Input::Chat(Box::new(chat_input(value)?));
    Ok(request)
}

/// The prompt of a chat request body (`/v1/chat/completions`, or a chat `/tokenize`): its
/// messages, tools and template arguments, read as vLLM reads them ([`crate::tokenizer::Chat`]).
pub fn chat_input(value: &Value) -> Result<Chat, ApiError> {
    let Some(Value::Array(items)) = field(value, "messages") else {
        return Err(ApiError::bad_request(
            "messages must be a list",
            Some("messages"),
        ));
    };
    if items.is_empty() {
        return Err(ApiError::bad_request(
            "messages must not be empty",
            Some("messages"),
        ));
    }
    let messages = items
        .iter()
        .enumerate()
        .map(|(i, m)| {
            ChatMessage::from_api(m)
                .map_err(|e| ApiError::bad_request(format!("messages[{i}]: {e}"), Some("messages")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    // A tool vLLM would refuse (not a named function) makes the engine answer 400; the
    // request is still forwarded, and its prompt is scored without the tools.
    let tools = match field(value, "tools") {
        Some(Value::Array(tools)) => tools.iter().map(template_tool).collect::<Option<Vec<_>>>(),
        _ => None,
    };
    Ok(Chat {
        messages,
        tools,
        tool_choice_none: field(value, "tool_choice").and_then(Value::as_str) == Some("none"),
        kwargs: template_kwargs(value),
    })
}

/// The `cached_tokens` an answer's usage reports (`usage.prompt_tokens_details.cached_tokens`),
/// if it says.
pub fn usage_cached_tokens(answer: &Value) -> Option<u64> {
    answer
        .pointer("/usage/prompt_tokens_details/cached_tokens")
        .and_then(Value::as_u64)
}

/// The last `"field": N` in the tail of an answer's bytes, unparsed: the usage object's counts
/// (`cached_tokens`, `completion_tokens`), which vLLM writes last (in the body, or in a stream's
/// final chunk when `stream_options.include_usage` asks for it). A key inside generated text
/// never matches: its quotes are escaped there.
pub fn usage_count_in_tail(tail: &[u8], field: &str) -> Option<usize> {
    let text = String::from_utf8_lossy(tail);
    let key = format!("\"{field}\"");
    let at = text.rfind(&key)?;
    let rest = text[at + key.len()..]
        .trim_start()
        .strip_prefix(':')?
        .trim_start();
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// Whether a streamed answer's chunk is an error event (vLLM sends `data: {"error": {...}}`
/// when a request fails mid-stream, e.g. a failed KV pull under `kv_load_failure_policy:
/// fail`): an `"error"` key followed by a colon, never the word in generated text (a JSON
/// string value is never followed by a colon).
pub fn is_stream_error_event(chunk: &[u8]) -> bool {
    const KEY: &[u8] = b"\"error\"";
    chunk.windows(KEY.len()).enumerate().any(|(at, w)| {
        w == KEY
            && chunk[at + KEY.len()..]
                .iter()
                .find(|b| !b.is_ascii_whitespace())
                .is_some_and(|b| *b == b':')
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_event_is_told_from_generated_text() {
        assert!(is_stream_error_event(
            b"data: {\"error\":{\"message\":\"pull failed\"}}\n\n"
        ));
        assert!(is_stream_error_event(b"data: {\"error\" : {}}"));
        assert!(!is_stream_error_event(
            b"data: {\"choices\":[{\"text\":\"error\"}]}\n\n"
        ));
        assert!(!is_stream_error_event(
            b"data: {\"choices\":[{\"text\":\" an error\"}]}"
        ));
        assert!(!is_stream_error_event(b"\"error\""));
    }

    #[test]
    fn the_usage_counts_are_read_from_a_body_or_a_streams_last_chunk() {
        let body = br#"{"id":"chatcmpl-1","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"length"}],"usage":{"prompt_tokens":230,"total_tokens":246,"completion_tokens":16,"prompt_tokens_details":{"cached_tokens":224}}}"#;
        assert_eq!(usage_count_in_tail(body, "completion_tokens"), Some(16));
        assert_eq!(usage_count_in_tail(body, "cached_tokens"), Some(224));
        let stream = b"data: {\"choices\":[{\"delta\":{\"content\":\"ok\"}}],\"usage\":null}\n\n\
            data: {\"choices\":[],\"usage\":{\"prompt_tokens\":30,\"completion_tokens\": 7,\"total_tokens\":37}}\n\n\
            data: [DONE]\n\n";
        assert_eq!(usage_count_in_tail(stream, "completion_tokens"), Some(7));
        assert_eq!(usage_count_in_tail(stream, "cached_tokens"), None);
        // A stream without usage says nothing.
        assert_eq!(
            usage_count_in_tail(
                b"data: {\"choices\":[]}\n\ndata: [DONE]\n\n",
                "completion_tokens"
            ),
            None
        );
    }

    #[test]
    fn the_usage_cached_tokens_are_read_where_vllm_reports_them() {
        let answer = serde_json::json!({"usage": {"prompt_tokens_details": {"cached_tokens": 32}}});
        assert_eq!(usage_cached_tokens(&answer), Some(32));
        assert_eq!(usage_cached_tokens(&serde_json::json!({"usage": {}})), None);
    }

    #[test]
    fn stream_options_are_given_even_as_null() {
        let given = |body: &[u8]| parse_completion(body).unwrap().stream_options_given;
        assert!(!given(br#"{"prompt":"hi","stream":true}"#));
        assert!(given(
            br#"{"prompt":"hi","stream":true,"stream_options":null}"#
        ));
        assert!(given(
            br#"{"prompt":"hi","stream":true,"stream_options":{"include_usage":false}}"#
        ));
    }

    #[test]
    fn completion_prompts_in_every_form() {
        let r = parse_completion(br#"{"model":"m","prompt":"hi","max_tokens":5,"stream":true,"stream_options":{"include_usage":true},"cache_salt":"s"}"#).unwrap();
        assert_eq!(r.input, Input::Text("hi".into()));
        assert_eq!(
            (r.max_tokens, r.stream, r.include_usage),
            (Some(5), true, true)
        );
        assert_eq!(r.cache_salt.as_deref(), Some("s"));
        let r = parse_completion(br#"{"model":"m","prompt":[1,2,3]}"#).unwrap();
        assert_eq!(r.input, Input::Tokens(vec![1, 2, 3]));
        let r = parse_completion(br#"{"model":"m","prompt":["one"]}"#).unwrap();
        assert_eq!(r.input, Input::Text("one".into()));
    }

    #[test]
    fn chat_messages_with_string_or_parts() {
        let r = parse_chat(br#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}],"max_completion_tokens":3}"#).unwrap();
        let Input::Chat(chat) = &r.input else {
            panic!("{:?}", r.input)
        };
        assert_eq!(chat.messages[0].content, "a\nb");
        assert_eq!(r.max_tokens, Some(3));
    }

    #[test]
    fn tool_calling_chats_keep_what_the_template_renders() {
        let r = parse_chat(br#"{"model":"m","messages":[
            {"role":"system","content":"x-anthropic-billing-header: cch=1;\nYou code."},
            {"role":"user","content":[{"type":"input_text","text":"a"},{"type":"refusal","refusal":"b"},"c",{"type":"image_url","image_url":{"url":"u"}}]},
            {"role":"assistant","content":null,"reasoning_content":"think","tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{}"}}]},
            {"role":"tool","tool_call_id":"c1","name":"f","content":"42"}],
            "tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}],
            "tool_choice":"auto","chat_template_kwargs":{"enable_thinking":false}}"#).unwrap();
        let Input::Chat(chat) = r.input else {
            panic!("{:?}", r.input)
        };
        let m = &chat.messages;
        assert_eq!(m[0].content, "You code.");
        assert_eq!(m[1].content, "a\nb\nc");
        assert_eq!(
            (m[2].content.as_str(), m[2].reasoning.as_deref()),
            ("", Some("think"))
        );
        assert_eq!(m[2].tool_calls.as_ref().map(Vec::len), Some(1));
        assert_eq!(
            (m[3].tool_call_id.as_deref(), m[3].name.as_deref()),
            (Some("c1"), Some("f"))
        );
        assert_eq!(
            chat.tools.as_ref().unwrap()[0]["function"]["description"],
            Value::Null
        );
        assert_eq!(chat.kwargs["enable_thinking"], false);
        assert!(chat.add_generation_prompt());
        // A system prompt that is only the header is empty; a tool vLLM refuses leaves the
        // chat without tools (the engine answers the 400).
        let r = parse_chat(br#"{"messages":[{"role":"system","content":"x-anthropic-billing-header: cch=1;"},{"role":"user","content":"q"}],"tools":[{"type":"function"}]}"#).unwrap();
        let Input::Chat(chat) = r.input else {
            panic!("{:?}", r.input)
        };
        assert_eq!(chat.messages[0].content, "");
        assert_eq!(chat.tools, None);
    }

    #[test]
    fn requests_vllm_accepts_are_routed_not_refused() {
        let first = |body: &[u8]| parse_completion(body).unwrap().input;
        assert_eq!(
            first(br#"{"model":"m","prompt":["a","b"]}"#),
            Input::Text("a".into())
        );
        assert_eq!(
            first(br#"{"model":"m","prompt":[[1,2],[3]]}"#),
            Input::Tokens(vec![1, 2])
        );
        assert_eq!(
            first(br#"{"model":"m","prompt":[]}"#),
            Input::Tokens(vec![])
        );
        assert_eq!(
            first(br#"{"model":"m","prompt":"x\ud800y"}"#),
            Input::Text("x\u{fffd}y".into())
        );
        let r = parse_chat(br#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}},{"type":"text","text":"what is this"}]}]}"#).unwrap();
        let Input::Chat(chat) = &r.input else {
            panic!("{:?}", r.input)
        };
        assert_eq!(chat.messages[0].content, "what is this");
        let r = parse_chat(br#"{"model":"m","messages":[{"role":"user","content":"\udc00"}]}"#);
        assert!(r.is_ok(), "{r:?}");
        // `model` is optional in vLLM: the engine serves its own model.
        assert_eq!(parse_completion(br#"{"prompt":"x"}"#).unwrap().model, None);
        assert_eq!(
            parse_chat(br#"{"model":null,"messages":[{"role":"user","content":"x"}]}"#)
                .unwrap()
                .model,
            None
        );
    }

    #[test]
    fn bad_bodies_name_the_problem() {
        let cases: [(&[u8], &str); 9] = [
            (b"{", "not valid JSON"),
            (b"[]", "JSON object"),
            (br#"{"model":"","prompt":"x"}"#, "model must be"),
            (br#"{"model":"m"}"#, "prompt is required"),
            (br#"{"model":"m","prompt":[1,-2]}"#, "token ids"),
            (
                br#"{"model":"m","prompt":"x","max_tokens":0}"#,
                "max_tokens",
            ),
            (
                br#"{"model":"m","prompt":"x","stream":"yes"}"#,
                "stream must be a boolean",
            ),
            (br#"{"model":"m","prompt":{}}"#, "prompt must be"),
            (
                br#"{"model":"m","prompt":"x","cache_salt":7}"#,
                "cache_salt",
            ),
        ];
        for (body, want) in cases {
            let e = parse_completion(body).unwrap_err();
            assert_eq!(e.status, 400);
            assert!(
                e.message.contains(want),
                "{}: {}",
                String::from_utf8_lossy(body),
                e.message
            );
        }
        let e = parse_chat(br#"{"model":"m","messages":[{"content":"x"}]}"#).unwrap_err();
        assert!(e.message.contains("messages[0]: role"), "{}", e.message);
        let json: serde_json::Value = serde_json::from_str(&e.to_json()).unwrap();
        assert_eq!(json["error"]["code"], 400);
        assert_eq!(json["error"]["param"], "messages");
    }

    /// A chat's `tool_choice` is read as vLLM compares it: only the string `"none"` is none
    /// (what an engine that excludes tools then renders without them).
    #[test]
    fn only_the_string_none_is_tool_choice_none() {
        let chat = |choice: Option<Value>| {
            let mut body = serde_json::json!({"messages": [{"role": "user", "content": "q"}]});
            if let Some(choice) = choice {
                body["tool_choice"] = choice;
            }
            chat_input(&body).unwrap().tool_choice_none
        };
        assert!(chat(Some(serde_json::json!("none"))));
        for other in [
            Some(serde_json::json!("auto")),
            Some(serde_json::json!("required")),
            Some(serde_json::json!({"type": "function", "function": {"name": "none"}})),
            Some(Value::Null),
            None,
        ] {
            assert!(!chat(other.clone()), "{other:?}");
        }
    }
}
