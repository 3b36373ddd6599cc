//! HuggingFace tokenizers: a model's `tokenizer.json` and its Jinja chat template, applied as
//! vLLM applies them (`add_generation_prompt`, special tokens added by the template for chat,
//! by the tokenizer for completions). No network: files only.
//!
//! The template is rendered with what vLLM passes it (see [`super::chat`]): the messages, the
//! tools, the request's template arguments and the tokenizer's special tokens, with
//! transformers' `tojson` (Python's `json.dumps`, [`super::pyjson`]) and its handling of
//! `continue_final_message` and of a `developer` message the template does not know.
//!
//! The template is found where `transformers` saves it: a `chat_template.jinja` beside
//! `tokenizer.json` (transformers 5, and 4.x since 4.47), else the `chat_template` entry of
//! `tokenizer_config.json` (older models).

use std::path::{Path, PathBuf};

use minijinja::{Environment, Error as JinjaError, ErrorKind, Value as JinjaValue};
use serde_json::{Map, Value};

use super::{Chat, ContentFormat};
use crate::VllmError;

/// A loaded HuggingFace tokenizer with its chat template.
pub struct HfTokenizer {
    tokenizer: tokenizers::Tokenizer,
    template: Option<Templates>,
    /// transformers' `special_tokens_map`: every named special token the config sets, each a
    /// variable of the template.
    special_tokens: Map<String, Value>,
    /// The engine's `--default-chat-template-kwargs`: under each request's own.
    default_kwargs: Map<String, Value>,
    /// The engine's `--exclude-tools-when-tool-choice-none`: a chat whose `tool_choice` is
    /// `"none"` is rendered without its tools.
    exclude_tools_when_tool_choice_none: bool,
}

/// A tokenizer's compiled chat templates: its default one and, where the model has one, the
/// one transformers picks for a request with tools (`tool_use`).
struct Templates {
    env: Environment<'static>,
    default: Template,
    tool_use: Option<Template>,
}

/// One compiled template and what vLLM reads from its text.
struct Template {
    /// Its name in `env`.
    name: &'static str,
    /// Whether it names the `developer` role (vLLM turns developer messages into system ones
    /// for a template that does not).
    knows_developer: bool,
    /// How it takes a message's content, as vLLM detects it.
    content_format: ContentFormat,
}

impl Template {
    /// Compiles `source` into `env` as `name`.
    fn add(
        env: &mut Environment<'static>,
        name: &'static str,
        source: String,
    ) -> Result<Self, VllmError> {
        let knows_developer = source.contains("\"developer\"") || source.contains("'developer'");
        let content_format = content_format::detect(&source);
        env.add_template_owned(name, source).map_err(|e| {
            VllmError::Tokenizer(format!("chat template {name} does not parse: {e}"))
        })?;
        Ok(Self {
            name,
            knows_developer,
            content_format,
        })
    }
}

/// transformers' named special tokens, in its order.
const SPECIAL_TOKENS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// Template arguments that transformers' `apply_chat_template` takes for itself rather than
/// passing to the template.
const NOT_TEMPLATE_VARIABLES: [&str; 5] = [
    "chat_template",
    "tokenize",
    "continue_final_message",
    "return_dict",
    "messages",
];

/// The text transformers appends to a message it continues, to find where it ends.
const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

fn load_error(path: &Path, why: impl std::fmt::Display) -> VllmError {
    VllmError::Tokenizer(format!("{}: {why}", path.display()))
}

/// A special token in `tokenizer_config.json`: a string or `{"content": ...}`.
fn token_text(config: &Value, key: &str) -> String {
    match &config[key] {
        Value::String(s) => s.clone(),
        Value::Object(o) => o
            .get("content")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned(),
        _ => String::new(),
    }
}

/// The template named `name` of `tokenizer_config.json`: for `default`, a plain string too;
/// in a list of `{name, template}`, the entry of that name (for `default`, else the first).
fn config_template(config: &Value, name: &str) -> Option<String> {
    match &config["chat_template"] {
        Value::String(s) if name == "default" => Some(s.clone()),
        Value::Array(list) => list
            .iter()
            .find(|t| t["name"] == name)
            .or_else(|| list.first().filter(|_| name == "default"))
            .and_then(|t| t["template"].as_str())
            .map(str::to_owned),
        _ => None,
    }
}

/// The folder beside `tokenizer.json` where transformers 5 saves a model's named templates
/// (`tool_use.jinja`, ...).
const NAMED_TEMPLATES_DIR: &str = "additional_chat_templates";

/// The file `transformers` saves a tokenizer's chat template to, beside `tokenizer.json`.
const TEMPLATE_FILE: &str = "chat_template.jinja";

fn raise_exception(message: String) -> Result<String, JinjaError> {
    Err(JinjaError::new(ErrorKind::InvalidOperation, message))
}

/// transformers' `strftime_now`: the local time in Python's `strftime` format. Llama 3.x
/// templates write today's date into the system header, so the router must render the date the
/// engine renders (both in the same time zone).
fn strftime_now(format: &str) -> Result<String, JinjaError> {
    jiff::fmt::strtime::format(format, &jiff::Zoned::now()).map_err(|e| {
        JinjaError::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now({format:?}): {e}"),
        )
    })
}

impl HfTokenizer {
    /// Loads `tokenizer.json`; the chat template comes from `chat_template` (a `.jinja` file),
    /// else from `chat_template.jinja` beside the tokenizer, else from `tokenizer_config.json`
    /// beside it. A tokenizer without any template loads (completions need none); see
    /// [`HfTokenizer::has_chat_template`].
    pub fn load(tokenizer_json: &Path, chat_template: Option<&Path>) -> Result<Self, VllmError> {
        let tokenizer = tokenizers::Tokenizer::from_file(tokenizer_json)
            .map_err(|e| load_error(tokenizer_json, e))?;
        let config_path: PathBuf = tokenizer_json.with_file_name("tokenizer_config.json");
        let config: Value = match std::fs::read_to_string(&config_path) {
            Ok(text) => serde_json::from_str(&text).map_err(|e| load_error(&config_path, e))?,
            Err(_) => Value::Null,
        };
        let beside: PathBuf = tokenizer_json.with_file_name(TEMPLATE_FILE);
        let read_if_there = |path: &Path| match std::fs::read_to_string(path) {
            Ok(text) => Ok(Some(text)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(load_error(path, e)),
        };
        // An explicit template is used for every request, as vLLM's `--chat-template`; the
        // model's own may have a second one for requests with tools.
        let (source, tool_use) = match chat_template {
            Some(path) => (
                Some(std::fs::read_to_string(path).map_err(|e| load_error(path, e))?),
                None,
            ),
            None => {
                let named = tokenizer_json
                    .with_file_name(NAMED_TEMPLATES_DIR)
                    .join("tool_use.jinja");
                (
                    read_if_there(&beside)?.or_else(|| config_template(&config, "default")),
                    read_if_there(&named)?.or_else(|| config_template(&config, "tool_use")),
                )
            }
        };
        let template = match source {
            None => None,
            Some(source) => {
                // As transformers compiles a chat template (which vLLM renders through):
                // block tags swallow their newline and leading blanks, and `raise_exception`
                // and `strftime_now` are there.
                let mut env = Environment::new();
                let syntax = minijinja::syntax::SyntaxConfig::builder()
                    .trim_blocks(true)
                    .lstrip_blocks(true)
                    .build()
                    .map_err(|e| VllmError::Tokenizer(format!("chat template syntax: {e}")))?;
                env.set_syntax(syntax);
                env.set_unknown_method_callback(
                    minijinja_contrib::pycompat::unknown_method_callback,
                );
                env.add_function("raise_exception", raise_exception);
                env.add_function("strftime_now", strftime_now);
                python::install(&mut env);
                let default = Template::add(&mut env, "chat", source)?;
                let tool_use = match tool_use {
                    Some(source) => Some(Template::add(&mut env, "tool_use", source)?),
                    None => None,
                };
                Some(Templates {
                    env,
                    default,
                    tool_use,
                })
            }
        };
        let special_tokens = SPECIAL_TOKENS
            .iter()
            .map(|name| (name.to_string(), token_text(&config, name)))
            .filter(|(_, text)| !text.is_empty())
            .map(|(name, text)| (name, Value::String(text)))
            .collect();
        Ok(Self {
            tokenizer,
            template,
            special_tokens,
            default_kwargs: Map::new(),
            exclude_tools_when_tool_choice_none: false,
        })
    }

    /// The tokenizer giving its template the content format `format` (vLLM's
    /// `--chat-template-content-format`) instead of the detected one; `None` keeps the
    /// detected one.
    pub fn with_content_format(mut self, format: Option<ContentFormat>) -> Self {
        if let (Some(format), Some(templates)) = (format, self.template.as_mut()) {
            templates.default.content_format = format;
            if let Some(tool_use) = templates.tool_use.as_mut() {
                tool_use.content_format = format;
            }
        }
        self
    }

    /// The tokenizer rendering a chat whose `tool_choice` is `"none"` without its tools, as an
    /// engine started with `--exclude-tools-when-tool-choice-none` does (vLLM 0.32's
    /// `OnlineRenderer.render_chat`; its `/tokenize` renders the tools whatever the flag).
    pub fn excluding_tools_when_tool_choice_none(mut self, exclude: bool) -> Self {
        self.exclude_tools_when_tool_choice_none = exclude;
        self
    }

    /// The tools `chat` is rendered with.
    fn tools_of<'a>(&self, chat: &'a Chat) -> Option<&'a Vec<Value>> {
        chat.tools
            .as_ref()
            .filter(|_| !(self.exclude_tools_when_tool_choice_none && chat.tool_choice_none))
    }

    /// The content format the default template is given.
    pub fn content_format(&self) -> Option<ContentFormat> {
        self.template.as_ref().map(|t| t.default.content_format)
    }

    /// The tokenizer rendering as an engine started with `--default-chat-template-kwargs`
    /// `defaults` does: each chat's own template arguments override them.
    pub fn with_default_kwargs(mut self, defaults: Map<String, Value>) -> Self {
        self.default_kwargs = defaults;
        self
    }

    /// Whether a chat template was found: without one, only completions can be tokenized.
    pub fn has_chat_template(&self) -> bool {
        self.template.is_some()
    }

    /// Token ids of `text`; `add_special_tokens` as vLLM sets it (true for completions).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, VllmError> {
        self.tokenizer
            .encode(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| VllmError::Tokenizer(e.to_string()))
    }

    /// The text of `ids` (special tokens skipped).
    pub fn decode(&self, ids: &[u32]) -> Result<String, VllmError> {
        self.tokenizer
            .decode(ids, true)
            .map_err(|e| VllmError::Tokenizer(e.to_string()))
    }

    /// Renders the chat template for `chat`, as vLLM renders it through transformers.
    pub fn apply_chat_template(&self, chat: &Chat) -> Result<String, VllmError> {
        let templates = self.template.as_ref().ok_or_else(|| {
            VllmError::Tokenizer("this tokenizer has no chat template: configure one".into())
        })?;
        // transformers renders a request with tools (even an empty list) with the model's
        // `tool_use` template where it has one.
        let tools = self.tools_of(chat);
        let template = match (tools, &templates.tool_use) {
            (Some(_), Some(tool_use)) => tool_use,
            _ => &templates.default,
        };
        let compiled = templates
            .env
            .get_template(template.name)
            .map_err(|e| VllmError::Tokenizer(e.to_string()))?;
        let mut messages: Vec<Value> = chat
            .messages
            .iter()
            .map(|m| m.template_value(template.content_format))
            .collect();
        if !template.knows_developer && chat.messages.iter().any(|m| m.role == "developer") {
            messages = developer_as_system(messages);
        }
        let continued = chat.continue_final_message();
        if continued {
            // The tag goes after the text (the last text part, for a template that loops over
            // parts).
            let last = messages.last_mut().and_then(|m| m.get_mut("content"));
            let text = match last {
                Some(Value::Array(parts)) => parts
                    .iter_mut()
                    .rev()
                    .find_map(|p| p.get_mut("text"))
                    .and_then(|t| match t {
                        Value::String(text) => Some(text),
                        _ => None,
                    }),
                Some(Value::String(text)) => Some(text),
                _ => None,
            };
            match text {
                Some(text) => text.push_str(CONTINUE_TAG),
                None => {
                    return Err(VllmError::Tokenizer(
                        "continue_final_message is set but the final message has no content to continue".into(),
                    ));
                }
            }
        }
        // As transformers calls it: the special tokens, the request's arguments (over the
        // engine's defaults) over them, then the messages, tools, documents and generation
        // prompt.
        let mut context = self.special_tokens.clone();
        for (k, v) in self.default_kwargs.iter().chain(&chat.kwargs) {
            if !NOT_TEMPLATE_VARIABLES.contains(&k.as_str()) {
                context.insert(k.clone(), v.clone());
            }
        }
        context.insert("messages".into(), Value::Array(messages));
        context.insert(
            "tools".into(),
            tools.cloned().map_or(Value::Null, Value::Array),
        );
        let documents = chat.kwargs.get("documents").cloned().unwrap_or(Value::Null);
        context.insert("documents".into(), documents);
        context.insert(
            "add_generation_prompt".into(),
            Value::Bool(chat.add_generation_prompt()),
        );
        let rendered = compiled
            .render(JinjaValue::from(minijinja::value::Serde(&context)))
            .map_err(|e| VllmError::Tokenizer(format!("chat template failed: {e}")))?;
        if !continued {
            return Ok(rendered);
        }
        // Cut where the continued message ends: at the tag, or before the blanks the template
        // trimmed after it.
        let tag = CONTINUE_TAG.trim_end();
        let at = rendered.rfind(tag).ok_or_else(|| {
            VllmError::Tokenizer(
                "continue_final_message is set but the template drops the final message".into(),
            )
        })?;
        Ok(if rendered[at..].starts_with(CONTINUE_TAG) {
            rendered[..at].to_owned()
        } else {
            rendered[..at].trim_end().to_owned()
        })
    }

    /// Prompt tokens of a chat, as vLLM's chat endpoint computes them (the template adds the
    /// special tokens, the tokenizer does not).
    pub fn encode_chat(&self, chat: &Chat) -> Result<Vec<u32>, VllmError> {
        self.encode(&self.apply_chat_template(chat)?, false)
    }
}

/// A message content's text: itself, or its text parts joined by new lines.
fn text_of(content: &Value) -> String {
    match content {
        Value::String(text) => text.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p.as_str().or_else(|| p["text"].as_str()))
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

/// vLLM's treatment of developer messages for a template that does not know the role: each
/// becomes a system message (without its tools), and where a system message is then not the
/// first, all of them merge into one first message, their non-empty texts joined by a blank
/// line.
fn developer_as_system(messages: Vec<Value>) -> Vec<Value> {
    let mut system = Vec::new();
    let mut rest = Vec::new();
    let mut merge = false;
    for (i, mut m) in messages.into_iter().enumerate() {
        if m["role"] == "developer" {
            m["role"] = Value::String("system".into());
            if let Some(map) = m.as_object_mut() {
                map.remove("tools");
            }
        }
        if m["role"] == "system" {
            merge |= i > 0 || !system.is_empty();
            system.push(m);
        } else {
            rest.push(m);
        }
    }
    if !merge {
        // At most one system message, and first: the conversation as it was.
        return system.into_iter().chain(rest).collect();
    }
    let texts: Vec<String> = system
        .iter()
        .map(|m| text_of(&m["content"]))
        .filter(|t| !t.is_empty())
        .collect();
    let merged = serde_json::json!({"role": "system", "content": texts.join("\n\n")});
    std::iter::once(merged).chain(rest).collect()
}

mod content_format;
mod python;
#[cfg(test)]
mod tests;
