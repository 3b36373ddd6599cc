use super::*;
use crate::tokenizer::ChatMessage;

/// A tiny word-level tokenizer and a ChatML template, written as HuggingFace would.
fn fixture(dir: &Path, with_template: bool) -> PathBuf {
    let vocab: Vec<&str> = vec![
        "<s>",
        "</s>",
        "<|im_start|>",
        "<|im_end|>",
        "system",
        "user",
        "assistant",
        "hello",
        "world",
        "be",
        "brief",
        "[UNK]",
    ];
    let vocab_json: serde_json::Map<String, Value> = vocab
        .iter()
        .enumerate()
        .map(|(i, w)| (w.to_string(), Value::from(i)))
        .collect();
    let added: Vec<Value> = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
        .iter()
        .map(|t| serde_json::json!({"id": vocab.iter().position(|w| w == t).unwrap(), "content": t, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}))
        .collect();
    let tokenizer = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}}},
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab_json, "unk_token": "[UNK]"}
    });
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, tokenizer.to_string()).unwrap();
    let mut config = serde_json::json!({"bos_token": {"content": "<s>"}, "eos_token": "</s>"});
    if with_template {
        config["chat_template"] = Value::from(
            "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content.strip() }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        );
    }
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    path
}

fn tempdir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvroute-hf-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The fixture tokenizer in `dir` with the template `source` given explicitly.
fn with_template(dir: &Path, source: &str) -> HfTokenizer {
    let template = dir.join("explicit-template.jinja");
    std::fs::write(&template, source).unwrap();
    HfTokenizer::load(&fixture(dir, false), Some(&template)).unwrap()
}

#[test]
fn chatml_template_renders_like_vllm_and_tokenizes_with_the_template_specials() {
    let dir = tempdir("chatml");
    let tok = HfTokenizer::load(&fixture(&dir, true), None).unwrap();
    let messages = vec![
        ChatMessage::new("system", "  be brief "),
        ChatMessage::new("user", "hello world"),
    ];
    let text = tok
        .apply_chat_template(&Chat::new(messages.clone()))
        .unwrap();
    assert_eq!(
        text,
        "<s><|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
    );
    // Chat: the template's <s> only (add_special_tokens=false), so no second BOS.
    let ids = tok.encode_chat(&Chat::new(messages.clone())).unwrap();
    assert_eq!(ids, vec![0, 2, 4, 9, 10, 3, 2, 5, 7, 8, 3, 2, 6]);
    // Completions: the tokenizer adds BOS itself.
    assert_eq!(tok.encode("hello world", true).unwrap(), vec![0, 7, 8]);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn missing_files_and_templates_are_clear_errors() {
    let dir = tempdir("errors");
    let e = HfTokenizer::load(&dir.join("nope.json"), None)
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("nope.json"), "{e}");
    let tok = HfTokenizer::load(&fixture(&dir, false), None).unwrap();
    assert!(!tok.has_chat_template());
    let e = tok
        .apply_chat_template(&Chat::new(vec![]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("no chat template"), "{e}");
    let bad = dir.join("bad.jinja");
    std::fs::write(&bad, "{% for %}").unwrap();
    let e = HfTokenizer::load(&fixture(&dir, false), Some(&bad))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("does not parse"), "{e}");
    let raising = dir.join("raise.jinja");
    std::fs::write(
        &raising,
        "{{ raise_exception('only user and assistant roles') }}",
    )
    .unwrap();
    let tok = HfTokenizer::load(&fixture(&dir, false), Some(&raising)).unwrap();
    let e = tok
        .apply_chat_template(&Chat::new(vec![]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("only user and assistant roles"), "{e}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn the_template_beside_the_tokenizer_is_found_as_transformers_5_saves_it() {
    // transformers 5 writes `chat_template.jinja` and leaves `chat_template` out of
    // `tokenizer_config.json`.
    let dir = tempdir("jinja-beside");
    let path = fixture(&dir, false);
    std::fs::write(
        dir.join("chat_template.jinja"),
        "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    )
    .unwrap();
    let tok = HfTokenizer::load(&path, None).unwrap();
    assert!(tok.has_chat_template());
    let messages = vec![ChatMessage::new("user", "hello")];
    assert_eq!(
        tok.encode_chat(&Chat::new(messages.clone())).unwrap(),
        vec![0, 2, 5, 7, 3, 2, 6]
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn the_jinja_file_wins_over_the_config_and_an_explicit_template_over_both() {
    let dir = tempdir("jinja-precedence");
    let path = fixture(&dir, true);
    std::fs::write(dir.join("chat_template.jinja"), "from the jinja file").unwrap();
    let tok = HfTokenizer::load(&path, None).unwrap();
    assert_eq!(
        tok.apply_chat_template(&Chat::new(vec![])).unwrap(),
        "from the jinja file"
    );
    // Given beside a config that has a template too (`with_template` would rewrite it).
    let explicit = dir.join("explicit.jinja");
    std::fs::write(&explicit, "explicit").unwrap();
    let tok = HfTokenizer::load(&path, Some(&explicit)).unwrap();
    assert_eq!(
        tok.apply_chat_template(&Chat::new(vec![])).unwrap(),
        "explicit"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// As transformers renders a template (vLLM's renderer): a block tag swallows the newline after
/// it and the blanks before it, and `strftime_now` gives the local date (Llama 3.x templates
/// write it into the system header).
#[test]
fn templates_render_with_transformers_whitespace_and_strftime_now() {
    let dir = tempdir("transformers-env");
    let tok = with_template(
        &dir,
        "{% for m in messages %}\n  {% if m.role == 'user' %}\n<|user|>\n{{ m.content }}</s>\n  {% endif %}\n{% endfor %}\nToday: {{ strftime_now('%Y') }}",
    );
    let messages = vec![ChatMessage::new("user", "hello")];
    let year = jiff::Zoned::now().year();
    assert_eq!(
        tok.apply_chat_template(&Chat::new(messages.clone()))
            .unwrap(),
        format!("<|user|>\nhello</s>\nToday: {year}")
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// The template's arguments as vLLM gives them: the engine's defaults under the request's own,
/// the special tokens under both; printed flags and unset values as Jinja2 prints Python's.
#[test]
fn template_arguments_layer_as_vllm_merges_them_and_print_as_python() {
    let dir = tempdir("kwargs");
    let mut defaults = Map::new();
    defaults.insert("enable_thinking".into(), Value::Bool(false));
    defaults.insert("style".into(), Value::from("terse"));
    defaults.insert("bos_token".into(), Value::from("<B>"));
    let tok = with_template(
        &dir,
        "{{ bos_token }}|{{ enable_thinking }}|{{ style }}|{{ unset_in_request }}|{{ tools }}|{{ documents }}",
    )
    .with_default_kwargs(defaults);
    let chat = |body: Value| Chat {
        kwargs: super::super::template_kwargs(&body),
        ..Chat::new(vec![ChatMessage::new("user", "hello")])
    };
    // Jinja2 prints Python's False and None; the engine's defaults apply, even over a special
    // token (transformers lets template arguments override them).
    assert_eq!(
        tok.apply_chat_template(&chat(serde_json::json!({})))
            .unwrap(),
        "<B>|False|terse||None|None"
    );
    // The request's own arguments win; a null or "auto" one leaves the default.
    assert_eq!(
        tok.apply_chat_template(&chat(serde_json::json!({
            "chat_template_kwargs": {"enable_thinking": true, "style": "auto", "unset_in_request": null}
        })))
        .unwrap(),
        "<B>|True|terse||None|None"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// Values printed, `| string`, `| format` and `is iterable` as Jinja2 gives them for Python
/// values (the expected text is what transformers' compiled template renders for the same
/// arguments): Qwen3-Coder's template prints each tool argument with `| string`, Llama 4's with
/// `"%s" | format`, Hermes's tests `tools is iterable` with no tools.
#[test]
fn values_print_as_python_prints_them() {
    let dir = tempdir("python-values");
    let tok = with_template(
        &dir,
        "{{ args.flag }}|{{ args.none }}|{{ args.f }}|{{ args.list }}|{{ args.map }}|{% for k, v in args|items %}{{ k }}={{ v | string }};{% endfor %}|{{ \"%s and %r\" | format(args.flag, \"it's\") }}|{{ tools is iterable }}|{{ args.list is iterable }}|{{ args.missing is iterable }}",
    )
        .with_default_kwargs(
            serde_json::json!({"args": {"flag": true, "none": null, "f": 1e-05, "list": ["a", "b's", 2, 0.5], "map": {"k": "v", "n": [null, false]}}})
                .as_object()
                .unwrap()
                .clone(),
        );
    assert_eq!(
        tok.apply_chat_template(&Chat::new(vec![ChatMessage::new("user", "x")]))
            .unwrap(),
        r#"True|None|1e-05|['a', "b's", 2, 0.5]|{'k': 'v', 'n': [None, False]}|flag=True;none=None;f=1e-05;list=['a', "b's", 2, 0.5];map={'k': 'v', 'n': [None, False]};|True and "it's"|False|True|True"#
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// A tokenizer in `dir` whose `tokenizer_config.json` lists a `default` and a `tool_use`
/// template, as a model with a tool-use template ships them; its `tokenizer.json`'s path.
fn with_tool_use_template(
    dir: &std::path::Path,
    default: &str,
    tool_use: &str,
) -> std::path::PathBuf {
    let path = fixture(dir, false);
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::json!({"chat_template": [
            {"name": "default", "template": default},
            {"name": "tool_use", "template": tool_use},
        ]})
        .to_string(),
    )
    .unwrap();
    path
}

/// A model with a `tool_use` template (in `tokenizer_config.json`'s list, or saved by
/// transformers 5 under `additional_chat_templates/`) has requests with tools, even an empty
/// list, rendered with it, as transformers picks it; an explicit template is used for all.
#[test]
fn requests_with_tools_use_the_models_tool_use_template() {
    let with_tools = |tools: Option<Vec<Value>>| Chat {
        tools,
        ..Chat::new(vec![ChatMessage::new("user", "hello")])
    };
    let dir = tempdir("tool-use-config");
    let path = with_tool_use_template(&dir, "default", "tools: {{ tools | length }}");
    let renders = |tok: &HfTokenizer, without: &str, with: &str| {
        assert_eq!(tok.apply_chat_template(&with_tools(None)).unwrap(), without);
        assert_eq!(
            tok.apply_chat_template(&with_tools(Some(vec![]))).unwrap(),
            with
        );
    };
    renders(
        &HfTokenizer::load(&path, None).unwrap(),
        "default",
        "tools: 0",
    );
    // Given beside that config (`with_template` would rewrite it without the list).
    let explicit = dir.join("explicit.jinja");
    std::fs::write(&explicit, "explicit").unwrap();
    let tok = HfTokenizer::load(&path, Some(&explicit)).unwrap();
    renders(&tok, "explicit", "explicit");
    let _ = std::fs::remove_dir_all(dir);

    let dir = tempdir("tool-use-saved");
    let path = fixture(&dir, false);
    std::fs::write(dir.join("chat_template.jinja"), "default").unwrap();
    std::fs::create_dir_all(dir.join("additional_chat_templates")).unwrap();
    std::fs::write(
        dir.join("additional_chat_templates/tool_use.jinja"),
        "tool use",
    )
    .unwrap();
    renders(
        &HfTokenizer::load(&path, None).unwrap(),
        "default",
        "tool use",
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// An engine started with `--exclude-tools-when-tool-choice-none` renders a chat whose
/// `tool_choice` is `"none"` without its tools (so with the default template, not `tool_use`);
/// any other choice, or an engine without the flag, renders them.
#[test]
fn tool_choice_none_drops_the_tools_only_where_the_engine_excludes_them() {
    let dir = tempdir("tool-choice-none");
    let path = with_tool_use_template(&dir, "default: {{ tools }}", "tools: {{ tools | length }}");
    let chat = |tool_choice_none: bool| Chat {
        tools: Some(vec![
            serde_json::json!({"type": "function", "function": {"name": "f"}}),
        ]),
        tool_choice_none,
        ..Chat::new(vec![ChatMessage::new("user", "hello")])
    };
    let (none, other) = (chat(true), chat(false));
    let engine = HfTokenizer::load(&path, None).unwrap();
    for c in [&none, &other] {
        assert_eq!(engine.apply_chat_template(c).unwrap(), "tools: 1");
    }
    let excluding = engine.excluding_tools_when_tool_choice_none(true);
    assert_eq!(
        excluding.apply_chat_template(&none).unwrap(),
        "default: None"
    );
    assert_eq!(excluding.apply_chat_template(&other).unwrap(), "tools: 1");
    let _ = std::fs::remove_dir_all(dir);
}

/// A template that loops over a message's content gets it as parts, as vLLM detects and
/// passes it; the configured format wins over the detected one.
#[test]
fn a_template_looping_over_content_gets_parts() {
    let dir = tempdir("content-parts");
    let tok = with_template(
        &dir,
        "{% for m in messages %}{% if m.content is string %}[{{ m.content }}]{% else %}{% for p in m.content %}<{{ p.type }}:{{ p.text }}>{% endfor %}{% endif %}{% endfor %}",
    );
    let chat = Chat::new(vec![
        ChatMessage::from_api(&serde_json::json!({"role": "user", "content": [
            {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "u"}}, {"type": "text", "text": "b"},
        ]}))
        .unwrap(),
    ]);
    assert_eq!(tok.content_format(), Some(ContentFormat::OpenAi));
    assert_eq!(
        tok.apply_chat_template(&chat).unwrap(),
        "<text:a><image:><text:b>"
    );
    let tok = tok.with_content_format(Some(ContentFormat::String));
    assert_eq!(tok.apply_chat_template(&chat).unwrap(), "[a\nb]");
    let _ = std::fs::remove_dir_all(dir);
}

/// `format` as Python's `%` (expected texts printed by CPython for the same arguments).
#[test]
fn format_reads_as_pythons_percent_operator() {
    let dir = tempdir("format");
    let tok = with_template(
        &dir,
        "{{ '%s|%5s|%-5s|%.2s' | format('ab', 'ab', 'ab', 'abc') }}\n{{ '%d|%i|%05d|%+d|% d|%d' | format(42, -7, 42, 3, 3, 2.9) }}\n{{ '%.2f|%8.3f|%-8.1f|%08.2f|%f|%F' | format(3.14159, -2.5, 1.25, -1.5, 1, true) }}\n{{ '%e|%.2E|%x|%X|%o|%%|%r' | format(12345.678, 0.00012, 255, -255, 8, \"it's\") }}",
    );
    assert_eq!(
        tok.apply_chat_template(&Chat::new(vec![])).unwrap(),
        "ab|   ab|ab   |ab\n42|-7|00042|+3| 3|2\n3.14|  -2.500|1.2     |-0001.50|1.000000|1.000000\n1.234568e+04|1.20E-04|ff|-FF|10|%|\"it's\""
    );
    let e = with_template(&dir, "{{ '%g' | format(1) }}")
        .apply_chat_template(&Chat::new(vec![]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("unsupported conversion %g"), "{e}");
    let e = with_template(&dir, "{{ '%999999999d' | format(1) }}")
        .apply_chat_template(&Chat::new(vec![]))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("width or precision 999999999 is above 1024"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// A template cannot make the router allocate without bound: an indent past 64 is an error.
#[test]
fn a_huge_tojson_indent_is_refused() {
    let dir = tempdir("indent");
    let e = with_template(&dir, "{{ [1] | tojson(indent=100000000) }}")
        .apply_chat_template(&Chat::new(vec![]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("indent 100000000 is above 64"), "{e}");
    assert_eq!(
        with_template(&dir, "{{ [1] | tojson(indent=2) }}")
            .apply_chat_template(&Chat::new(vec![]))
            .unwrap(),
        "[\n  1\n]"
    );
    let _ = std::fs::remove_dir_all(dir);
}
