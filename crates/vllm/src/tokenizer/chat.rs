//! A chat as its template sees it: the messages, the tools and the template's arguments, in the
//! shapes vLLM hands them to transformers (vLLM 0.32's `parse_chat_messages`,
//! `_postprocess_messages`, `ChatCompletionToolsParam.model_dump()` and `build_chat_params`).
//!
//! Tool-calling traffic is most of an agent's prompt: a tools block of JSON schemas, then turns
//! whose assistant messages are tool calls and whose answers come back as `tool` messages. A
//! router that renders such a chat without them keys a prompt the engine never sees, and every
//! turn of an agent loses its cache picture. What vLLM does to each part before rendering:
//! - a message keeps `role` and its content: for a template that takes text, the text parts
//!   (`text`, `input_text`, `output_text`, `refusal`, `thinking`, bare strings) joined by new
//!   lines, empty ones and media dropped, null as empty; for a template that loops over parts
//!   ([`ContentFormat::OpenAi`]), the parts as `{"type": "text", "text"}` or `{"type": "image"}`
//!   (audio, video) with the fields vLLM does not know (a tool result of text parts only is
//!   still one text); Claude Code's billing-header line is dropped from system text parts;
//! - an assistant message keeps `tool_calls` (each rebuilt in the API's field order, `id`,
//!   `function` {`arguments`, `name`}, `type`, its `arguments` read from their JSON string into a
//!   map: empty, invalid or not a map gives `{}`; an empty list is dropped) and `reasoning`
//!   (also given as `reasoning_content`); a tool message keeps `tool_call_id`; a developer
//!   message gets `tools` (null); any message keeps a string `name`;
//! - a tool becomes `{"type": "function", "function": {"name", "description", "parameters",
//!   "strict"?, "defer_loading"?}, "defer_loading"?}`: description and parameters are null when
//!   absent, the two flags only when set, other keys dropped;
//! - the template's arguments are the request's `chat_template_kwargs`, overridden by the
//!   request's `add_generation_prompt`, `continue_final_message`, `documents` and
//!   `reasoning_effort` (with `enable_thinking` derived from the last when the kwargs do not set
//!   it); an argument whose value is null or `"auto"` is dropped.

use serde_json::{Map, Value};

/// How a template takes a message's content, as vLLM detects it from the template
/// (`--chat-template-content-format`): one text, or the list of parts it loops over.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ContentFormat {
    /// The text parts joined by new lines (empty ones dropped), media left out.
    #[default]
    String,
    /// vLLM's "openai" format: `[{"type": "text", "text": ...}, {"type": "image"}, ...]`, each
    /// part with the fields vLLM does not know kept (a gateway's `cache_control`).
    OpenAi,
}

/// A chat message as vLLM reads it from an OpenAI request, with the fields it passes to a chat
/// template.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, `developer`, ...
    pub role: String,
    /// The content for a template that takes text ([`ContentFormat::String`]). Change it with
    /// [`ChatMessage::set_text`], which keeps `parts` in step.
    pub content: String,
    /// The content for a template that loops over parts ([`ContentFormat::OpenAi`]), where it
    /// came as a list; `None` when it is one text part, `content` (a plain string: most
    /// messages, kept once).
    pub parts: Option<Vec<Value>>,
    /// The content as the client sent it, where it came as a list (for an engine's
    /// `/tokenize`: its media parts are read there, not here).
    pub raw_content: Option<Value>,
    /// The participant's name, where given.
    pub name: Option<String>,
    /// An assistant message's tool calls, as sent.
    pub tool_calls: Option<Vec<Value>>,
    /// The call a tool message answers.
    pub tool_call_id: Option<String>,
    /// An assistant message's reasoning, for templates that interleave it.
    pub reasoning: Option<String>,
}

/// The first line of a system prompt Claude Code sends through gateways that translate its
/// requests; vLLM 0.32 drops it from system text parts (its value changes on every request, so
/// the prompt would miss the cache from there on).
const CLAUDE_CODE_BILLING_HEADER: &str = "x-anthropic-billing-header";

/// Content-part fields vLLM 0.32 knows (`_KNOWN_CONTENT_PART_FIELDS`); any other field of a part
/// reaches a template that loops over parts.
const KNOWN_PART_FIELDS: [&str; 18] = [
    "audio_embeds",
    "audio_url",
    "closed",
    "data",
    "file",
    "image_embeds",
    "image_pil",
    "image_url",
    "input_audio",
    "name",
    "prompt_cache_breakpoint",
    "refusal",
    "text",
    "thinking",
    "type",
    "uuid",
    "video_embeds",
    "video_url",
];

/// A content part as vLLM parses it: its text, or the modality of a media part; `None` for
/// what vLLM skips (a text part without text) or refuses.
enum Part<'a> {
    Text(&'a str),
    Media(&'static str),
}

fn part_of(part: &Value) -> Option<Part<'_>> {
    if let Some(text) = part.as_str() {
        return Some(Part::Text(text));
    }
    let kind = part.get("type")?.as_str()?;
    let text_field = match kind {
        "text" | "input_text" | "output_text" => "text",
        "refusal" => "refusal",
        "thinking" => "thinking",
        "image_url" | "input_image" | "image_embeds" | "image_pil" => {
            return Some(Part::Media("image"));
        }
        "audio_url" | "input_audio" | "audio_embeds" => return Some(Part::Media("audio")),
        "video_url" | "video_embeds" => return Some(Part::Media("video")),
        _ => return None,
    };
    part.get(text_field)?.as_str().map(Part::Text)
}

/// A system text part without Claude Code's billing header line, as vLLM reads it: `None` when
/// nothing is left.
fn without_billing_header(text: &str) -> Option<&str> {
    match text.strip_prefix(CLAUDE_CODE_BILLING_HEADER) {
        Some(rest) => rest
            .split_once('\n')
            .map(|(_, after)| after)
            .filter(|after| !after.is_empty()),
        None => Some(text),
    }
}

/// The fields of `part` vLLM does not know, which it keeps on the part it passes.
fn extra_fields(part: &Value, into: &mut Map<String, Value>) {
    if let Some(map) = part.as_object() {
        for (k, v) in map {
            if !KNOWN_PART_FIELDS.contains(&k.as_str()) {
                into.insert(k.clone(), v.clone());
            }
        }
    }
}

impl ChatMessage {
    /// A message of `role` with text `content` and nothing else.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        let content = content.into();
        Self {
            role: role.into(),
            parts: None,
            content,
            ..Self::default()
        }
    }

    /// Replaces the message's content with the text `content` (both views).
    pub fn set_text(&mut self, content: impl Into<String>) {
        let content = content.into();
        self.parts = None;
        self.raw_content = None;
        self.content = content;
    }

    /// A message of an OpenAI chat request, read as vLLM 0.32 reads it (see the module doc).
    pub fn from_api(m: &Value) -> Result<Self, String> {
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or("role must be a string")?
            .to_owned();
        let system = role == "system";
        let raw_parts: &[Value] = match m.get("content") {
            None | Some(Value::Null) => &[],
            Some(Value::Array(parts)) => parts,
            // One text: `content` alone says it, unless the billing header took all of it (a
            // template looping over parts then gets none).
            Some(Value::String(text)) => {
                let kept = if system {
                    without_billing_header(text)
                } else {
                    Some(text.as_str())
                };
                return Ok(Self::with_fields(
                    m,
                    role,
                    kept.unwrap_or_default().to_owned(),
                    kept.is_none().then(Vec::new),
                ));
            }
            // Not a shape vLLM reads as text: nothing to score here.
            Some(_) => &[],
        };
        let mut texts: Vec<&str> = Vec::new();
        let mut parts = Vec::new();
        for raw in raw_parts {
            let part = match part_of(raw) {
                // Claude Code's billing header, from a system message's text parts.
                Some(Part::Text(text)) if system && (raw.is_string() || raw["type"] == "text") => {
                    match without_billing_header(text) {
                        Some(kept) => Part::Text(kept),
                        None => continue,
                    }
                }
                Some(part) => part,
                None => continue,
            };
            let mut wrapped = Map::new();
            match part {
                Part::Text(text) => {
                    // A template taking text drops an empty part; one looping over parts keeps it.
                    if !text.is_empty() {
                        texts.push(text);
                    }
                    wrapped.insert("type".into(), Value::from("text"));
                    wrapped.insert("text".into(), Value::from(text));
                }
                Part::Media(modality) => {
                    wrapped.insert("type".into(), Value::from(modality));
                }
            }
            extra_fields(raw, &mut wrapped);
            parts.push(Value::Object(wrapped));
        }
        Ok(Self::with_fields(m, role, texts.join("\n"), Some(parts)))
    }

    /// The message of `role` with its content read, and the other fields of the API message `m`.
    fn with_fields(m: &Value, role: String, content: String, parts: Option<Vec<Value>>) -> Self {
        let text = |name: &str| m.get(name).and_then(Value::as_str).map(str::to_owned);
        ChatMessage {
            content,
            raw_content: m.get("content").filter(|c| c.is_array()).cloned(),
            parts,
            name: text("name"),
            tool_calls: m.get("tool_calls").and_then(Value::as_array).cloned(),
            tool_call_id: text("tool_call_id"),
            reasoning: text("reasoning").or_else(|| text("reasoning_content")),
            role,
        }
    }

    /// The message as vLLM hands it to a template taking `format`: `role`, `content`, then the
    /// fields its role keeps, tool calls in vLLM's shape.
    pub fn template_value(&self, format: ContentFormat) -> Value {
        let mut m = Map::new();
        m.insert("role".into(), Value::String(self.role.clone()));
        let content = match format {
            ContentFormat::String => Value::String(self.content.clone()),
            ContentFormat::OpenAi => match &self.parts {
                None => Value::Array(vec![text_part(&self.content)]),
                // A tool result of text parts only is one text even here.
                Some(parts) if self.role == "tool" && parts.iter().all(|p| p["type"] == "text") => {
                    let texts: Vec<&str> =
                        parts.iter().filter_map(|p| p["text"].as_str()).collect();
                    Value::String(texts.join("\n"))
                }
                Some(parts) => Value::Array(parts.clone()),
            },
        };
        m.insert("content".into(), content);
        match self.role.as_str() {
            "assistant" => {
                if let Some(calls) = self.tool_calls.as_ref().filter(|c| !c.is_empty()) {
                    let calls = calls.iter().map(template_tool_call).collect();
                    m.insert("tool_calls".into(), Value::Array(calls));
                }
                if let Some(reasoning) = &self.reasoning {
                    m.insert("reasoning".into(), Value::String(reasoning.clone()));
                    m.insert("reasoning_content".into(), Value::String(reasoning.clone()));
                }
            }
            "tool" => {
                if let Some(id) = &self.tool_call_id {
                    m.insert("tool_call_id".into(), Value::String(id.clone()));
                }
            }
            // vLLM gives a developer message the message-level tools the API allows it; none
            // are read here.
            "developer" => {
                m.insert("tools".into(), Value::Null);
            }
            _ => {}
        }
        if let Some(name) = &self.name {
            m.insert("name".into(), Value::String(name.clone()));
        }
        Value::Object(m)
    }

    /// The message in the API's shape again, for an engine's `/tokenize`: the content as sent
    /// where it was a list, else its text; tool calls as sent.
    pub fn to_api(&self) -> Value {
        let mut m = Map::new();
        m.insert("role".into(), Value::String(self.role.clone()));
        let content = match &self.raw_content {
            Some(raw) => raw.clone(),
            None => Value::String(self.content.clone()),
        };
        m.insert("content".into(), content);
        let optional = [
            ("name", self.name.clone().map(Value::String)),
            ("tool_calls", self.tool_calls.clone().map(Value::Array)),
            ("tool_call_id", self.tool_call_id.clone().map(Value::String)),
            ("reasoning", self.reasoning.clone().map(Value::String)),
        ];
        for (key, value) in optional {
            if let Some(value) = value {
                m.insert(key.into(), value);
            }
        }
        Value::Object(m)
    }
}

/// A text content part.
fn text_part(text: &str) -> Value {
    let mut part = Map::new();
    part.insert("type".into(), Value::from("text"));
    part.insert("text".into(), Value::from(text));
    Value::Object(part)
}

/// Declared fields first, in `declared` order, then the others in the client's order: how
/// pydantic rebuilds a typed dict vLLM validates.
fn in_declared_order(map: &Map<String, Value>, declared: &[&str]) -> Map<String, Value> {
    let mut out = Map::new();
    for key in declared {
        if let Some(v) = map.get(*key) {
            out.insert((*key).to_owned(), v.clone());
        }
    }
    for (k, v) in map {
        if !declared.contains(&k.as_str()) {
            out.insert(k.clone(), v.clone());
        }
    }
    out
}

/// A tool call as vLLM hands it to the template: validated as the API's typed dict (`id`,
/// `function` {`arguments`, `name`}, `type`, then other fields), its `function.arguments` read
/// into a map as `_postprocess_messages` does (empty, invalid or not a map: `{}`).
fn template_tool_call(call: &Value) -> Value {
    let Some(map) = call.as_object() else {
        return call.clone();
    };
    let mut call = in_declared_order(map, &["id", "function", "type"]);
    if let Some(Value::Object(function)) = call.get("function") {
        let mut function = in_declared_order(function, &["arguments", "name"]);
        let parsed = match function.get("arguments") {
            Some(Value::Object(map)) => Value::Object(map.clone()),
            Some(Value::String(text)) if !text.is_empty() => {
                match serde_json::from_str::<Value>(text) {
                    Ok(Value::Object(map)) => Value::Object(map),
                    _ => Value::Object(Map::new()),
                }
            }
            _ => Value::Object(Map::new()),
        };
        function.insert("arguments".into(), parsed);
        call.insert("function".into(), Value::Object(function));
    }
    Value::Object(call)
}

/// A chat request's prompt: what its template renders.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chat {
    /// The messages.
    pub messages: Vec<ChatMessage>,
    /// The tools, as the template sees them ([`template_tool`]); `None` when the request names
    /// none.
    pub tools: Option<Vec<Value>>,
    /// The request's `tool_choice` is `"none"`: an engine started with
    /// `--exclude-tools-when-tool-choice-none` renders such a chat without its tools
    /// ([`super::HfTokenizer::excluding_tools_when_tool_choice_none`]).
    pub tool_choice_none: bool,
    /// The template's other arguments ([`template_kwargs`]), `add_generation_prompt` and
    /// `continue_final_message` among them.
    pub kwargs: Map<String, Value>,
}

impl Chat {
    /// A plain chat of `messages`: no tools, the generation prompt added (an API request's
    /// defaults).
    pub fn new(messages: Vec<ChatMessage>) -> Self {
        let mut kwargs = Map::new();
        kwargs.insert("add_generation_prompt".into(), Value::Bool(true));
        kwargs.insert("continue_final_message".into(), Value::Bool(false));
        Self {
            messages,
            tools: None,
            tool_choice_none: false,
            kwargs,
        }
    }

    /// The `messages` and `tools` of an engine's `/tokenize` for this chat: what the client
    /// sent, as far as the engine reads it ([`ChatMessage::to_api`]).
    pub fn api_messages_and_tools(&self) -> (Value, Option<Value>) {
        (
            Value::Array(self.messages.iter().map(ChatMessage::to_api).collect()),
            self.tools.clone().map(Value::Array),
        )
    }

    /// Whether the template ends the prompt where the assistant's answer starts.
    pub fn add_generation_prompt(&self) -> bool {
        self.kwargs.get("add_generation_prompt").is_some_and(truthy)
    }

    /// Whether the last message is left open for the model to continue.
    pub fn continue_final_message(&self) -> bool {
        self.kwargs
            .get("continue_final_message")
            .is_some_and(truthy)
    }
}

/// Python's truth of a JSON value.
fn truthy(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}

/// A request's tool as vLLM 0.32 passes it to the template; `None` when it is not a function
/// tool with a name (vLLM refuses the request).
pub fn template_tool(tool: &Value) -> Option<Value> {
    let function = tool.get("function")?.as_object()?;
    let name = function.get("name")?.as_str()?;
    if tool
        .get("type")
        .is_some_and(|t| t.as_str() != Some("function"))
    {
        return None;
    }
    let set = |v: Option<&Value>| v.filter(|v| !v.is_null()).cloned();
    let tool_defer = set(tool.get("defer_loading"));
    let mut f = Map::new();
    f.insert("name".into(), Value::String(name.to_owned()));
    for key in ["description", "parameters"] {
        f.insert(key.into(), set(function.get(key)).unwrap_or(Value::Null));
    }
    if let Some(strict) = set(function.get("strict")) {
        f.insert("strict".into(), strict);
    }
    // A tool's `defer_loading` is its function's too, unless the function sets its own.
    if let Some(defer) = set(function.get("defer_loading")).or_else(|| tool_defer.clone()) {
        f.insert("defer_loading".into(), defer);
    }
    let mut t = Map::new();
    t.insert("type".into(), Value::String("function".into()));
    t.insert("function".into(), Value::Object(f));
    if let Some(defer) = tool_defer {
        t.insert("defer_loading".into(), defer);
    }
    Some(Value::Object(t))
}

/// The template's arguments of a chat request `body` (see the module doc): its
/// `chat_template_kwargs`, then the request's own fields over them, values null or `"auto"`
/// dropped.
pub fn template_kwargs(body: &Value) -> Map<String, Value> {
    let user = body
        .get("chat_template_kwargs")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    let field = |name: &str| body.get(name).filter(|v| !v.is_null()).cloned();
    let mut own = Map::new();
    own.insert(
        "add_generation_prompt".into(),
        field("add_generation_prompt").unwrap_or(Value::Bool(true)),
    );
    own.insert(
        "continue_final_message".into(),
        field("continue_final_message").unwrap_or(Value::Bool(false)),
    );
    if let Some(documents) = field("documents") {
        own.insert("documents".into(), documents);
    }
    if let Some(effort) = field("reasoning_effort") {
        if !user.contains_key("enable_thinking") {
            own.insert(
                "enable_thinking".into(),
                Value::Bool(effort.as_str() != Some("none")),
            );
        }
        own.insert("reasoning_effort".into(), effort);
    }
    let mut kwargs = user;
    for (k, v) in own {
        kwargs.insert(k, v);
    }
    kwargs.retain(|_, v| !v.is_null() && v.as_str() != Some("auto"));
    kwargs
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn assistant_tool_calls_reach_the_template_in_vllms_shape() {
        let m = ChatMessage::from_api(&json!({
            "role": "assistant", "content": null,
            "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": "{\"b\": 1, \"a\": [2]}", "x": 0}, "id": "c1", "index": 3},
                {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}},
                {"id": "c3", "type": "function", "function": {"name": "h", "arguments": "[1]"}},
                {"id": "c4", "type": "function", "function": {"name": "i", "arguments": ""}},
            ],
        }))
        .unwrap();
        let v = m.template_value(ContentFormat::String);
        assert_eq!(v["content"], "");
        let calls = v["tool_calls"].as_array().unwrap();
        // Rebuilt in the API's field order, other fields after; the arguments' own key order
        // kept, as Python's json.loads keeps it.
        assert_eq!(
            serde_json::to_string(&calls[0]).unwrap(),
            r#"{"id":"c1","function":{"arguments":{"b":1,"a":[2]},"name":"f","x":0},"type":"function","index":3}"#
        );
        let args: Vec<String> = calls[1..]
            .iter()
            .map(|c| c["function"]["arguments"].to_string())
            .collect();
        assert_eq!(args, ["{}", "{}", "{}"]);
        // Sent to an engine's /tokenize, the message is what the client sent.
        assert_eq!(
            m.to_api()["tool_calls"][0]["function"]["arguments"],
            "{\"b\": 1, \"a\": [2]}"
        );
    }

    #[test]
    fn content_parts_read_as_vllm_reads_them_for_each_template_format() {
        let m = ChatMessage::from_api(&json!({"role": "user", "content": [
            {"type": "text", "text": "a"},
            {"type": "text", "text": ""},
            "b",
            {"type": "image_url", "image_url": {"url": "u"}, "uuid": "x"},
            {"type": "input_text", "text": "c", "cache_control": {"type": "ephemeral"}},
            {"type": "file", "file": {}},
        ]}))
        .unwrap();
        // A template taking text: empty parts and media dropped.
        assert_eq!(
            m.template_value(ContentFormat::String)["content"],
            "a\nb\nc"
        );
        // One looping over parts: every text part, media by modality, unknown fields kept.
        assert_eq!(
            m.template_value(ContentFormat::OpenAi)["content"],
            json!([
                {"type": "text", "text": "a"},
                {"type": "text", "text": ""},
                {"type": "text", "text": "b"},
                {"type": "image"},
                {"type": "text", "text": "c", "cache_control": {"type": "ephemeral"}},
            ])
        );
        // A tool result of text parts is one text in both.
        let tool = ChatMessage::from_api(&json!({"role": "tool", "tool_call_id": "c", "content": [
            {"type": "text", "text": "x"}, {"type": "text", "text": "y"},
        ]}))
        .unwrap();
        assert_eq!(
            tool.template_value(ContentFormat::OpenAi)["content"],
            "x\ny"
        );
        // Claude Code's billing header leaves system text parts, and only those.
        let system = ChatMessage::from_api(&json!({"role": "system", "content": [
            {"type": "text", "text": "x-anthropic-billing-header: cch=1;\nYou code."},
            {"type": "text", "text": "x-anthropic-billing-header: cch=1;"},
            {"type": "input_text", "text": "x-anthropic-billing-header: kept"},
        ]}))
        .unwrap();
        assert_eq!(
            system.content,
            "You code.\nx-anthropic-billing-header: kept"
        );
        // A plain string is one text part; one the header took whole is none.
        let plain = ChatMessage::from_api(&json!({"role": "user", "content": ""})).unwrap();
        assert_eq!(
            plain.template_value(ContentFormat::OpenAi)["content"],
            json!([{"type": "text", "text": ""}])
        );
        let header = ChatMessage::from_api(
            &json!({"role": "system", "content": "x-anthropic-billing-header: cch=1;"}),
        )
        .unwrap();
        assert_eq!(header.template_value(ContentFormat::String)["content"], "");
        assert_eq!(
            header.template_value(ContentFormat::OpenAi)["content"],
            json!([])
        );
    }

    #[test]
    fn each_role_keeps_only_the_fields_vllm_keeps() {
        let m = ChatMessage {
            tool_call_id: Some("c1".into()),
            tool_calls: Some(vec![]),
            name: Some("n".into()),
            ..ChatMessage::new("tool", "42")
        };
        assert_eq!(
            m.template_value(ContentFormat::String),
            json!({"role": "tool", "content": "42", "tool_call_id": "c1", "name": "n"})
        );
        let m = ChatMessage {
            tool_call_id: Some("c1".into()),
            tool_calls: Some(vec![]),
            reasoning: Some("hm".into()),
            ..ChatMessage::new("assistant", "x")
        };
        assert_eq!(
            m.template_value(ContentFormat::String),
            json!({"role": "assistant", "content": "x", "reasoning": "hm", "reasoning_content": "hm"})
        );
    }

    /// The words a request's JSON is made of: its keys and roles.
    const WORDS: [&str; 15] = [
        "role",
        "content",
        "tool_calls",
        "function",
        "arguments",
        "name",
        "type",
        "text",
        "tool_call_id",
        "reasoning",
        "image_url",
        "assistant",
        "tool",
        "system",
        "developer",
    ];

    /// Any JSON value, of a request's words.
    fn any_json() -> impl proptest::strategy::Strategy<Value = Value> {
        use proptest::prelude::*;
        let word = || proptest::sample::select(&WORDS[..]);
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<f64>().prop_map(Value::from),
            "[a-z_ ]{0,8}".prop_map(Value::from),
            word().prop_map(Value::from),
        ];
        leaf.prop_recursive(4, 32, 6, move |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                proptest::collection::vec((word(), inner), 0..6).prop_map(|kv| {
                    Value::Object(kv.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
                }),
            ]
        })
    }

    proptest::proptest! {
        /// Any JSON value as a message, a tool or template arguments: read and rendered
        /// without a panic (what vLLM refuses is routed without those parts, never a crash).
        #[test]
        fn any_request_shape_reads_and_renders_without_panicking(
            message in any_json(),
            tool in any_json(),
            kwargs in any_json(),
        ) {
            let _ = template_tool(&tool);
            let body = json!({"chat_template_kwargs": kwargs, "reasoning_effort": tool.clone()});
            let kwargs = template_kwargs(&body);
            if let Ok(m) = ChatMessage::from_api(&message) {
                let _ = m.template_value(ContentFormat::String);
                let _ = m.template_value(ContentFormat::OpenAi);
                let _ = m.to_api();
                let chat = Chat { kwargs, tools: Some(vec![tool]), ..Chat::new(vec![m]) };
                let _ = super::super::BuiltinTokenizer.render_chat(&chat);
            }
        }
    }

    #[test]
    fn tools_take_vllms_shape() {
        let t = template_tool(&json!({"type": "function", "function": {"name": "f", "extra": 1}}))
            .unwrap();
        assert_eq!(
            serde_json::to_string(&t).unwrap(),
            r#"{"type":"function","function":{"name":"f","description":null,"parameters":null}}"#
        );
        let t = template_tool(&json!({
            "defer_loading": true,
            "function": {"parameters": {"type": "object"}, "strict": true, "name": "g", "description": "d"},
        }))
        .unwrap();
        assert_eq!(
            serde_json::to_string(&t).unwrap(),
            r#"{"type":"function","function":{"name":"g","description":"d","parameters":{"type":"object"},"strict":true,"defer_loading":true},"defer_loading":true}"#
        );
        assert_eq!(template_tool(&json!({"function": {}})), None);
        assert_eq!(
            template_tool(&json!({"type": "web", "function": {"name": "f"}})),
            None
        );
    }

    #[test]
    fn request_fields_override_the_kwargs_and_unset_values_drop() {
        let kwargs = template_kwargs(&json!({
            "chat_template_kwargs": {"enable_thinking": false, "add_generation_prompt": false, "x": "auto", "y": null, "z": 1},
            "reasoning_effort": "low",
            "documents": null,
        }));
        assert_eq!(
            Value::Object(kwargs),
            json!({"enable_thinking": false, "add_generation_prompt": true, "z": 1, "continue_final_message": false, "reasoning_effort": "low"})
        );
        let kwargs =
            template_kwargs(&json!({"reasoning_effort": "none", "add_generation_prompt": false}));
        assert_eq!(kwargs["enable_thinking"], false);
        assert!(
            !Chat {
                kwargs,
                ..Chat::new(vec![])
            }
            .add_generation_prompt()
        );
    }
}
