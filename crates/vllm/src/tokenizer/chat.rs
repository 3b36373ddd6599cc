//! A chat as its template sees it: the messages, the tools and the template's arguments, in the
//! shapes vLLM hands them to transformers (vLLM 0.32's `parse_chat_messages`,
//! `_postprocess_messages`, `ChatCompletionToolsParam.model_dump()` and `build_chat_params`).
//!
//! Tool-calling traffic is most of an agent's prompt: a tools block of JSON schemas, then turns
//! whose assistant messages are tool calls and whose answers come back as `tool` messages. A
//! router that renders such a chat without them keys a prompt the engine never sees, and every
//! turn of an agent loses its cache picture. What vLLM does to each part before rendering:
//! - a message keeps `role` and its text `content` (text parts joined by new lines, null as
//!   empty); an assistant message keeps `tool_calls` (each call's `function.arguments` read from
//!   its JSON string into a map: empty, invalid or not a map gives `{}`; an empty list is
//!   dropped) and `reasoning` (also given as `reasoning_content`); a tool message keeps
//!   `tool_call_id`; a developer message gets `tools` (null); any message keeps a string `name`;
//! - a tool becomes `{"type": "function", "function": {"name", "description", "parameters",
//!   "strict"?, "defer_loading"?}, "defer_loading"?}`: description and parameters are null when
//!   absent, the two flags only when set, other keys dropped;
//! - the template's arguments are the request's `chat_template_kwargs`, overridden by the
//!   request's `add_generation_prompt`, `continue_final_message`, `documents` and
//!   `reasoning_effort` (with `enable_thinking` derived from the last when the kwargs do not set
//!   it); an argument whose value is null or `"auto"` is dropped.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// A chat message as the OpenAI API sends it, with the fields vLLM passes to a chat template.
/// Serialized, it is the API's shape again (tool-call arguments as the JSON strings they came
/// as), for an engine's `/tokenize`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool`, `developer`, ...
    pub role: String,
    /// The message text.
    #[serde(default, deserialize_with = "null_as_empty")]
    pub content: String,
    /// The participant's name, where given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// An assistant message's tool calls, as sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<Value>>,
    /// The call a tool message answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// An assistant message's reasoning, for templates that interleave it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
}

fn null_as_empty<'de, D: serde::Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    Ok(Option::<String>::deserialize(d)?.unwrap_or_default())
}

impl ChatMessage {
    /// A message of `role` with text `content` and nothing else.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            ..Self::default()
        }
    }

    /// The message as vLLM hands it to the template: `role`, `content`, then the fields its
    /// role keeps, tool-call arguments as maps.
    pub fn template_value(&self) -> Value {
        let mut m = Map::new();
        m.insert("role".into(), Value::String(self.role.clone()));
        m.insert("content".into(), Value::String(self.content.clone()));
        match self.role.as_str() {
            "assistant" => {
                if let Some(calls) = self.tool_calls.as_ref().filter(|c| !c.is_empty()) {
                    let calls = calls.iter().map(call_with_parsed_arguments).collect();
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
}

/// A tool call with its `function.arguments` read into a map, as vLLM's
/// `_postprocess_messages` does.
fn call_with_parsed_arguments(call: &Value) -> Value {
    let mut call = call.clone();
    if let Some(function) = call.get_mut("function").and_then(Value::as_object_mut) {
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
    }
    call
}

/// A chat request's prompt: what its template renders.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chat {
    /// The messages.
    pub messages: Vec<ChatMessage>,
    /// The tools, as the template sees them ([`template_tool`]); `None` when the request names
    /// none.
    pub tools: Option<Vec<Value>>,
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
            kwargs,
        }
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
    fn assistant_tool_calls_reach_the_template_with_their_arguments_read() {
        let m: ChatMessage = serde_json::from_value(json!({
            "role": "assistant", "content": null,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"b\": 1, \"a\": [2]}"}},
                {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "not json"}},
                {"id": "c3", "type": "function", "function": {"name": "h", "arguments": "[1]"}},
                {"id": "c4", "type": "function", "function": {"name": "i", "arguments": ""}},
            ],
        }))
        .unwrap();
        let v = m.template_value();
        assert_eq!(v["content"], "");
        let args: Vec<String> = v["tool_calls"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["function"]["arguments"].to_string())
            .collect();
        // Key order kept, as Python's json.loads keeps it.
        assert_eq!(args, [r#"{"b":1,"a":[2]}"#, "{}", "{}", "{}"]);
        // Serialized again, the message is what the client sent.
        let back = serde_json::to_value(&m).unwrap();
        assert_eq!(
            back["tool_calls"][0]["function"]["arguments"],
            "{\"b\": 1, \"a\": [2]}"
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
            m.template_value(),
            json!({"role": "tool", "content": "42", "tool_call_id": "c1", "name": "n"})
        );
        let m = ChatMessage {
            tool_call_id: Some("c1".into()),
            tool_calls: Some(vec![]),
            reasoning: Some("hm".into()),
            ..ChatMessage::new("assistant", "x")
        };
        assert_eq!(
            m.template_value(),
            json!({"role": "assistant", "content": "x", "reasoning": "hm", "reasoning_content": "hm"})
        );
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
