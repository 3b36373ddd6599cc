//! Which content format a chat template takes, detected as vLLM 0.32 detects it
//! (`renderers/hf.py`, `_detect_content_format`): a template that loops over a message's
//! content gets the content as a list of parts ("openai"), any other gets one text ("string").
//!
//! vLLM walks the template's syntax tree; this reads the same facts from the block tags' text:
//! - the names bound to `messages`: `messages` itself and every `{% set x = y %}` whose `y` is
//!   one of them, whole or sliced, through filters (`messages[1:]`, `messages | list`);
//! - the message names: the targets of `{% for m in y %}` over those;
//! - a content loop: `{% for c in m['content'] %}` or `m.content` (sliced, filtered, with a loop
//!   condition) for a message name `m`; `{% for c in content %}` outside a macro; or a loop over
//!   a macro's parameter when some call of that macro passes it a message's content.
//!
//! A template written otherwise (a content loop only reached through an expression the text
//! does not show) can be told apart with the tokenizer's `chat_template_content_format`, as
//! vLLM's `--chat-template-content-format`.

use std::collections::HashSet;

use super::super::ContentFormat;

/// A block tag's text, without its delimiters and whitespace control, and where it starts.
struct Tag<'a> {
    at: usize,
    body: &'a str,
}

fn tags(source: &str) -> Vec<Tag<'_>> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(open) = source[from..].find("{%") {
        let start = from + open + 2;
        let Some(close) = source[start..].find("%}") else {
            break;
        };
        let body = source[start..start + close]
            .trim_start_matches(['-', '+'])
            .trim_end_matches(['-', '+'])
            .trim();
        out.push(Tag {
            at: from + open,
            body,
        });
        from = start + close + 2;
    }
    out
}

/// `expr` up to its first top-level occurrence of `stop` (outside brackets and quotes).
fn until_top_level<'a>(expr: &'a str, stop: &str) -> &'a str {
    let bytes = expr.as_bytes();
    let mut depth = 0i32;
    let mut quote: Option<u8> = None;
    for (i, &b) in bytes.iter().enumerate() {
        match quote {
            Some(q) if b == q => quote = None,
            Some(_) => {}
            None if depth == 0 && expr[i..].starts_with(stop) => return &expr[..i],
            None => match b {
                b'\'' | b'"' => quote = Some(b),
                b'(' | b'[' | b'{' => depth += 1,
                b')' | b']' | b'}' => depth -= 1,
                _ => {}
            },
        }
    }
    expr
}

/// The variable an expression reads, whole or sliced, through filters and tests: `messages`
/// for `messages[1:] | list`; with `key`, the variable whose `key` item it reads (`m` for
/// `m['content']` and `m.content`). `None` for any other expression.
fn accessed<'a>(expr: &'a str, key: Option<&str>) -> Option<&'a str> {
    let mut e = until_top_level(expr, "|").trim();
    e = until_top_level(e, " is ").trim();
    // Slices (`x[1:]`, `x[:-1]`) read the whole of `x`.
    while e.ends_with(']') {
        let open = e.rfind('[')?;
        if !e[open..].contains(':') {
            break;
        }
        e = e[..open].trim_end();
    }
    let var = match key {
        None => e,
        Some(key) => [
            format!("['{key}']"),
            format!("[\"{key}\"]"),
            format!(".{key}"),
        ]
        .iter()
        .find_map(|suffix| e.strip_suffix(suffix.as_str()))?
        .trim_end(),
    };
    let is_name = !var.is_empty()
        && var.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !var.starts_with(|c: char| c.is_ascii_digit());
    is_name.then_some(var)
}

/// A `{% for target in iter %}` tag's target name and iterated expression (its loop condition
/// and `recursive` left out).
fn for_loop(body: &str) -> Option<(&str, &str)> {
    let rest = body.strip_prefix("for ")?;
    let (targets, iter) = rest.split_once(" in ")?;
    let target = targets.trim();
    let iter = until_top_level(iter, " if ");
    let iter = iter.trim().trim_end_matches("recursive").trim();
    Some((target, iter))
}

/// A `{% set name = expr %}` tag's name and expression.
fn assignment(body: &str) -> Option<(&str, &str)> {
    let rest = body.strip_prefix("set ")?;
    let (name, expr) = rest.split_once('=')?;
    let name = name.trim();
    name.chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '_')
        .then_some((name, expr.trim()))
}

/// The arguments of each call `name(...)` in `source`, split at top-level commas.
fn calls<'a>(source: &'a str, name: &str) -> Vec<Vec<&'a str>> {
    let mut out = Vec::new();
    let pattern = format!("{name}(");
    let mut from = 0;
    while let Some(found) = source[from..].find(&pattern) {
        let start = from + found;
        from = start + pattern.len();
        let before = source[..start].chars().next_back();
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.') {
            continue;
        }
        let inner = until_top_level(&source[from..], ")");
        let mut args = Vec::new();
        let mut rest = inner;
        while !rest.trim().is_empty() {
            let arg = until_top_level(rest, ",");
            args.push(arg.trim());
            rest = rest.get(arg.len() + 1..).unwrap_or("");
        }
        out.push(args);
    }
    out
}

/// The content format `source` takes (see the module doc).
pub(super) fn detect(source: &str) -> ContentFormat {
    let tags = tags(source);
    // Names bound to the messages, transitively.
    let mut messages: HashSet<&str> = HashSet::from(["messages"]);
    loop {
        let before = messages.len();
        for tag in &tags {
            if let Some((name, expr)) = assignment(tag.body)
                && accessed(expr, None).is_some_and(|v| messages.contains(v))
            {
                messages.insert(name);
            }
        }
        if messages.len() == before {
            break;
        }
    }
    let message_names: HashSet<&str> = tags
        .iter()
        .filter_map(|t| for_loop(t.body))
        .filter(|(_, iter)| accessed(iter, None).is_some_and(|v| messages.contains(v)))
        .map(|(target, _)| target)
        .collect();
    let reads_content =
        |expr: &str| accessed(expr, Some("content")).is_some_and(|v| message_names.contains(v));
    // Macro bodies, and the parameters some call fills with a message's content.
    let mut macros: Vec<(usize, usize, HashSet<&str>)> = Vec::new();
    let mut open: Option<(usize, &str, Vec<&str>)> = None;
    for tag in &tags {
        if let Some(rest) = tag.body.strip_prefix("macro ") {
            let (name, params) = rest.split_once('(').unwrap_or((rest, ""));
            let params = until_top_level(params, ")")
                .split(',')
                .map(|p| p.split('=').next().unwrap_or("").trim())
                .collect();
            open = Some((tag.at, name.trim(), params));
        } else if (tag.body == "endmacro" || tag.body.starts_with("endmacro "))
            && let Some((start, name, params)) = open.take()
        {
            let mut content_params = HashSet::new();
            for args in calls(source, name) {
                for (i, arg) in args.iter().enumerate() {
                    // `param=value` by name, else by position.
                    let (param, value) = match arg.split_once('=') {
                        Some((key, value))
                            if !value.starts_with('=') && params.contains(&key.trim()) =>
                        {
                            (Some(key.trim()), value)
                        }
                        _ => (params.get(i).copied(), *arg),
                    };
                    if let Some(param) = param.filter(|_| reads_content(value)) {
                        content_params.insert(param);
                    }
                }
            }
            macros.push((start, tag.at, content_params));
        }
    }
    let loops_over_content = tags.iter().any(|tag| {
        let Some((_, iter)) = for_loop(tag.body) else {
            return false;
        };
        if reads_content(iter) {
            return true;
        }
        let name = accessed(iter, None).filter(|v| *v == iter);
        match macros.iter().find(|(s, e, _)| (*s..*e).contains(&tag.at)) {
            Some((_, _, params)) => name.is_some_and(|n| params.contains(n)),
            None => name == Some("content"),
        }
    });
    if loops_over_content {
        ContentFormat::OpenAi
    } else {
        ContentFormat::String
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each template with the format vLLM 0.32's `_detect_content_format` gives it.
    #[test]
    fn detects_what_vllm_detects() {
        let cases = [
            (
                "{% for m in messages %}{% for c in m['content'] %}{{ c.text }}{% endfor %}{% endfor %}",
                ContentFormat::OpenAi,
            ),
            (
                "{% set loop_messages = messages[1:] %}{% for m in loop_messages %}{% for c in m.content | selectattr('type','equalto','text') %}{{ c.text }}{% endfor %}{% endfor %}",
                ContentFormat::OpenAi,
            ),
            (
                "{% for m in messages %}{{ m.content }}{% endfor %}",
                ContentFormat::String,
            ),
            (
                "{% for m in messages %}{% set content = m.content %}{% for c in content %}{{ c }}{% endfor %}{% endfor %}",
                ContentFormat::OpenAi,
            ),
            (
                "{% macro r(x) %}{% for c in x %}{{ c }}{% endfor %}{% endmacro %}{% for m in messages %}{{ r(m.content) }}{% endfor %}",
                ContentFormat::OpenAi,
            ),
            (
                "{% macro r(content) %}{% for c in content %}{{ c }}{% endfor %}{% endmacro %}{% for m in messages %}{{ m.content }}{% endfor %}",
                ContentFormat::String,
            ),
            (
                "{% for m in messages[1:] %}{% for c in m['content'] if c.type == 'text' %}{{ c.text }}{% endfor %}{% endfor %}",
                ContentFormat::OpenAi,
            ),
            (
                "{% for m in messages %}{% for c in m.content[0] %}{{ c }}{% endfor %}{% endfor %}",
                ContentFormat::String,
            ),
            (
                "{%- for message in messages %}{%- if message.content is string %}{{ message.content }}{%- else %}{%- for part in message.content %}{{ part.text }}{%- endfor %}{%- endif %}{%- endfor %}",
                ContentFormat::OpenAi,
            ),
            // The tiny test model's template and a ChatML one.
            (
                "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n{% endfor %}",
                ContentFormat::String,
            ),
        ];
        for (template, format) in cases {
            assert_eq!(detect(template), format, "{template}");
        }
    }
}
