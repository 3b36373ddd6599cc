//! Python's behaviour where a chat template sees it, for minijinja to render as Jinja2 does in
//! transformers (which vLLM renders through). Each difference here was found rendering vLLM's
//! example tool-calling templates (Hermes, Llama 3.1 and 4, Qwen3-Coder, Mistral) both ways:
//! - `tojson` is transformers' `json.dumps` ([`super::super::pyjson`]), not Jinja's;
//! - a value printed (`{{ x }}`), `x | string` and `"%s" | format(x)` read as Python's `str()`:
//!   `True`, `None`, `1e-05`, `['a', 1]`, `{'k': 'v'}` (a Qwen3-Coder template prints each tool
//!   argument with `| string`: a boolean argument is `True` in the prompt, not `true`);
//! - `is iterable` is false for none (minijinja iterates none as empty; Hermes's
//!   `tools is iterable and tools | length > 0` then fails without tools).

use std::fmt::Write as _;

use minijinja::value::{Kwargs, Rest, ValueKind};
use minijinja::{Environment, Error as JinjaError, ErrorKind, Value as JinjaValue};

use super::super::pyjson::{self, Layout};

/// Registers Python's filters, test and printing on `env`.
pub(super) fn install(env: &mut Environment<'static>) {
    env.add_filter("tojson", tojson);
    env.add_filter("string", |v: &JinjaValue| python_str(v));
    env.add_filter("format", format);
    env.add_test("iterable", iterable);
    env.set_formatter(|out, state, value| {
        if matches!(value.kind(), ValueKind::String | ValueKind::Undefined) {
            return minijinja::escape_formatter(out, state, value);
        }
        out.write_str(&python_str(value))
            .map_err(|e| JinjaError::new(ErrorKind::WriteFailure, e.to_string()))
    });
}

/// transformers' `tojson`: Python's `json.dumps(x, ensure_ascii=False, indent=None,
/// separators=None, sort_keys=False)`, positionally or by name (not Jinja's, which escapes HTML
/// characters and writes no spaces).
fn tojson(
    value: &JinjaValue,
    ensure_ascii: Option<JinjaValue>,
    indent: Option<JinjaValue>,
    separators: Option<JinjaValue>,
    kwargs: Kwargs,
) -> Result<String, JinjaError> {
    let invalid = |what: String| JinjaError::new(ErrorKind::InvalidOperation, what);
    let arg =
        |positional: Option<JinjaValue>, name: &str| -> Result<Option<JinjaValue>, JinjaError> {
            Ok(match positional {
                Some(v) => Some(v),
                None => kwargs.get::<Option<JinjaValue>>(name)?,
            })
        };
    let ensure_ascii = arg(ensure_ascii, "ensure_ascii")?.is_some_and(|v| v.is_true());
    let indent = match arg(indent, "indent")? {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => match v.as_str() {
            Some(text) => Some(text.to_owned()),
            None => {
                let n = i64::try_from(v.clone())
                    .map_err(|_| invalid(format!("tojson: indent must be a number, not {v}")))?;
                Some(" ".repeat(usize::try_from(n).unwrap_or(0)))
            }
        },
    };
    let separators = match arg(separators, "separators")? {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => {
            let pair: Vec<String> = v
                .try_iter()
                .map_err(|_| invalid("tojson: separators must be two strings".into()))?
                .map(|s| s.as_str().map(str::to_owned))
                .collect::<Option<_>>()
                .ok_or_else(|| invalid("tojson: separators must be two strings".into()))?;
            match <[String; 2]>::try_from(pair) {
                Ok([item, key]) => Some((item, key)),
                Err(_) => return Err(invalid("tojson: separators must be two strings".into())),
            }
        }
    };
    let sort_keys = kwargs
        .get::<Option<JinjaValue>>("sort_keys")?
        .is_some_and(|v| v.is_true());
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(value)
        .map_err(|e| invalid(format!("tojson: cannot write {value} as JSON: {e}")))?;
    Ok(pyjson::dumps(
        &json,
        &Layout {
            ensure_ascii,
            indent,
            separators,
            sort_keys,
        },
    ))
}

/// Python's `str(value)`.
fn python_str(value: &JinjaValue) -> String {
    match value.kind() {
        ValueKind::Undefined => String::new(),
        ValueKind::String => value.as_str().unwrap_or_default().to_owned(),
        _ => python_repr(value),
    }
}

/// Python's `repr(value)` (a string quoted; the rest as `str()`).
fn python_repr(value: &JinjaValue) -> String {
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => "None".into(),
        ValueKind::Bool if value.is_true() => "True".into(),
        ValueKind::Bool => "False".into(),
        ValueKind::Number if value.is_integer() => value.to_string(),
        ValueKind::Number => f64::try_from(value.clone())
            .map(pyjson::float_repr)
            .unwrap_or_else(|_| value.to_string()),
        ValueKind::String => quoted(value.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<String> = value
                .try_iter()
                .map(|it| it.map(|v| python_repr(&v)).collect())
                .unwrap_or_default();
            format!("[{}]", items.join(", "))
        }
        ValueKind::Map => {
            let pairs: Vec<String> = value
                .try_iter()
                .map(|keys| {
                    keys.map(|k| {
                        let v = value.get_item(&k).unwrap_or_default();
                        format!("{}: {}", python_repr(&k), python_repr(&v))
                    })
                    .collect()
                })
                .unwrap_or_default();
            format!("{{{}}}", pairs.join(", "))
        }
        _ => value.to_string(),
    }
}

/// A string as Python's `repr` quotes it: single quotes, or double ones when it holds a single
/// quote and no double one; backslash, the quote, tabs, new lines and other control characters
/// escaped.
fn quoted(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c == '\u{7f}' => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

/// Python's `format % args` as Jinja2's `format` filter applies it: `%s` (`str()`), `%r`
/// (`repr()`), `%d` (an integer) and `%%`.
fn format(template: &str, args: Rest<JinjaValue>) -> Result<String, JinjaError> {
    let mut out = String::with_capacity(template.len());
    let mut args = args.iter();
    let mut chars = template.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let spec = chars.next();
        if spec == Some('%') {
            out.push('%');
            continue;
        }
        let arg = args.next().ok_or_else(|| {
            JinjaError::new(ErrorKind::InvalidOperation, "format: not enough arguments")
        })?;
        match spec {
            Some('s') => out.push_str(&python_str(arg)),
            Some('r') => out.push_str(&python_repr(arg)),
            Some('d') => out.push_str(
                &arg.as_i64()
                    .map_or_else(|| python_str(arg), |n| n.to_string()),
            ),
            _ => {
                return Err(JinjaError::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "format: unsupported conversion %{}",
                        spec.map(String::from).unwrap_or_default()
                    ),
                ));
            }
        }
    }
    Ok(out)
}

/// Jinja2's `is iterable` on Python values: strings, lists, maps and undefined (which iterates
/// as nothing) are; none, numbers and booleans are not.
fn iterable(value: &JinjaValue) -> bool {
    matches!(
        value.kind(),
        ValueKind::String
            | ValueKind::Bytes
            | ValueKind::Seq
            | ValueKind::Map
            | ValueKind::Iterable
            | ValueKind::Undefined
    )
}
