//! HuggingFace tokenizers: a model's `tokenizer.json` and its Jinja chat template, applied as
//! vLLM applies them (`add_generation_prompt`, special tokens added by the template for chat,
//! by the tokenizer for completions). No network: files only.
//!
//! The template is found where `transformers` saves it: a `chat_template.jinja` beside
//! `tokenizer.json` (transformers 5, and 4.x since 4.47), else the `chat_template` entry of
//! `tokenizer_config.json` (older models).

use std::path::{Path, PathBuf};

use minijinja::{Environment, Error as JinjaError, ErrorKind, Value as JinjaValue};
use serde_json::Value;

use super::ChatMessage;
use crate::VllmError;

/// A loaded HuggingFace tokenizer with its chat template.
pub struct HfTokenizer {
    tokenizer: tokenizers::Tokenizer,
    template: Option<Environment<'static>>,
    bos_token: String,
    eos_token: String,
}

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

/// The default template of `tokenizer_config.json`: a string, or the entry named "default" of
/// a list of `{name, template}`.
fn config_template(config: &Value) -> Option<String> {
    match &config["chat_template"] {
        Value::String(s) => Some(s.clone()),
        Value::Array(list) => list
            .iter()
            .find(|t| t["name"] == "default")
            .or_else(|| list.first())
            .and_then(|t| t["template"].as_str())
            .map(str::to_owned),
        _ => None,
    }
}

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
        let source = match chat_template {
            Some(path) => Some(std::fs::read_to_string(path).map_err(|e| load_error(path, e))?),
            None => match std::fs::read_to_string(&beside) {
                Ok(text) => Some(text),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => config_template(&config),
                Err(e) => return Err(load_error(&beside, e)),
            },
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
                env.add_template_owned("chat", source).map_err(|e| {
                    VllmError::Tokenizer(format!("chat template does not parse: {e}"))
                })?;
                Some(env)
            }
        };
        Ok(Self {
            tokenizer,
            template,
            bos_token: token_text(&config, "bos_token"),
            eos_token: token_text(&config, "eos_token"),
        })
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

    /// Renders the chat template.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, VllmError> {
        let env = self.template.as_ref().ok_or_else(|| {
            VllmError::Tokenizer("this tokenizer has no chat template: configure one".into())
        })?;
        let template = env
            .get_template("chat")
            .map_err(|e| VllmError::Tokenizer(e.to_string()))?;
        template
            .render(minijinja::context! {
                messages => JinjaValue::from(minijinja::value::Serde(messages)),
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token.clone(),
                eos_token => self.eos_token.clone(),
            })
            .map_err(|e| VllmError::Tokenizer(format!("chat template failed: {e}")))
    }

    /// Prompt tokens of a chat, as vLLM's chat endpoint computes them (the template adds the
    /// special tokens, the tokenizer does not).
    pub fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, VllmError> {
        self.encode(&self.apply_chat_template(messages, true)?, false)
    }
}

#[cfg(test)]
mod tests;
