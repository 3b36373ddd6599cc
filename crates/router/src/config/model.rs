//! The `models:` section: one served model, and how its prompts become tokens (its tokenizer and
//! chat template settings).

use serde::{Deserialize, Serialize};

/// One served model.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The model name clients send.
    pub name: String,
    /// How prompts are tokenized: `builtin`, `remote`, `none`, or `{hf: tokenizer.json}`.
    #[serde(default)]
    pub tokenizer: TokenizerConfig,
    /// Tokens per KV block (vLLM's default 16; must match the engines).
    #[serde(default = "default_block_size")]
    pub block_size: usize,
    /// LoRA adapters served on top of this model (requests name them as the model).
    #[serde(default)]
    pub lora_adapters: Vec<String>,
}

fn default_block_size() -> usize {
    16
}

/// How a model's prompts become tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TokenizerKind {
    /// kvroute's built-in tokenizer (what `kvroute sim` uses).
    #[default]
    Builtin,
    /// The engine's own `/tokenize` endpoint: exact, one round-trip per request.
    Remote,
    /// No tokenizer: approximate routing by the router's own history only.
    None,
}

/// A model's tokenizer: a kind, or a HuggingFace `tokenizer.json` with its chat template.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum TokenizerConfig {
    /// `builtin`, `remote` or `none`.
    Kind(TokenizerKind),
    /// `{hf: path/to/tokenizer.json, chat_template: path/to/template.jinja, ...}`.
    Hf(HfTokenizerConfig),
}

impl<'de> Deserialize<'de> for TokenizerConfig {
    /// A name is a kind and a map a HuggingFace tokenizer, each with its own error: a
    /// misspelled kind or setting is refused by name, not read as another form or dropped.
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        match serde_json::Value::deserialize(deserializer)? {
            value @ serde_json::Value::Object(_) => HfTokenizerConfig::deserialize(value)
                .map(TokenizerConfig::Hf)
                .map_err(D::Error::custom),
            value => TokenizerKind::deserialize(value)
                .map(TokenizerConfig::Kind)
                .map_err(D::Error::custom),
        }
    }
}

/// A HuggingFace tokenizer and how the engines render chats with it. Without `chat_template`,
/// the `chat_template.jinja` beside the tokenizer, else the one in its `tokenizer_config.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HfTokenizerConfig {
    /// The model's `tokenizer.json`.
    pub hf: std::path::PathBuf,
    /// A `.jinja` chat template file.
    #[serde(default)]
    pub chat_template: Option<std::path::PathBuf>,
    /// The engines' `--default-chat-template-kwargs`: template arguments every chat gets
    /// unless the request sets them (`{enable_thinking: false}` for a Qwen3 fleet serving
    /// without thinking).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    /// The engines' `--chat-template-content-format`: `auto` (detected from the template, as
    /// vLLM does), `string` or `openai`.
    #[serde(default, skip_serializing_if = "ContentFormatConfig::is_auto")]
    pub chat_template_content_format: ContentFormatConfig,
    /// The engines' `--exclude-tools-when-tool-choice-none`: a chat whose `tool_choice` is
    /// `"none"` is rendered without its tools.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub exclude_tools_when_tool_choice_none: bool,
}

impl HfTokenizerConfig {
    /// `hf` with every other setting at vLLM's default.
    pub fn new(hf: impl Into<std::path::PathBuf>) -> Self {
        Self {
            hf: hf.into(),
            chat_template: None,
            chat_template_kwargs: None,
            chat_template_content_format: ContentFormatConfig::Auto,
            exclude_tools_when_tool_choice_none: false,
        }
    }
}

/// How a chat template takes a message's content: vLLM's `--chat-template-content-format`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ContentFormatConfig {
    /// Detected from the template, as vLLM detects it.
    #[default]
    Auto,
    /// One text.
    String,
    /// A list of parts.
    Openai,
}

impl ContentFormatConfig {
    /// Whether it is left to detection.
    pub fn is_auto(&self) -> bool {
        *self == ContentFormatConfig::Auto
    }

    /// The format it forces, if any.
    pub fn forced(self) -> Option<kvroute_vllm::tokenizer::ContentFormat> {
        use kvroute_vllm::tokenizer::ContentFormat;
        match self {
            ContentFormatConfig::Auto => None,
            ContentFormatConfig::String => Some(ContentFormat::String),
            ContentFormatConfig::Openai => Some(ContentFormat::OpenAi),
        }
    }
}

impl Default for TokenizerConfig {
    fn default() -> Self {
        TokenizerConfig::Kind(TokenizerKind::Builtin)
    }
}
