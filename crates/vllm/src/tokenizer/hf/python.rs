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

/// The largest `tojson` indent rendered.
const MAX_INDENT: usize = 64;

/// The largest width or precision `format` writes.
const MAX_FORMAT_WIDTH: usize = 1_024;

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
                // The template sets it: bounded, so that no template can make the router
                // allocate without limit (templates indent by 2 or 4).
                let n = usize::try_from(n).unwrap_or(0);
                if n > MAX_INDENT {
                    return Err(invalid(format!("tojson: indent {n} is above {MAX_INDENT}")));
                }
                Some(" ".repeat(n))
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

/// Python's `format % args` as Jinja2's `format` filter applies it: conversions `s`, `r`, `d`,
/// `i`, `f`, `F`, `e`, `E`, `x`, `X`, `o` and `%%`, with the flags `-`, `+`, ` `, `0`, a width
/// and a precision (`%5.2f`, `%-8s`, `%03d`). Other conversions are an error (the request is then
/// routed without cache information, as for any template error).
fn format(template: &str, args: Rest<JinjaValue>) -> Result<String, JinjaError> {
    let invalid = |what: String| JinjaError::new(ErrorKind::InvalidOperation, what);
    let mut out = String::with_capacity(template.len());
    let mut args = args.iter();
    let mut chars = template.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let mut flags = String::new();
        while let Some(&f) = chars.peek().filter(|f| "-+ 0#".contains(**f)) {
            flags.push(f);
            chars.next();
        }
        let number = |chars: &mut std::iter::Peekable<std::str::Chars>| {
            let mut n = String::new();
            while let Some(&d) = chars.peek().filter(|d| d.is_ascii_digit()) {
                n.push(d);
                chars.next();
            }
            n.parse::<usize>().ok()
        };
        let width = number(&mut chars);
        let precision = if chars.peek() == Some(&'.') {
            chars.next();
            Some(number(&mut chars).unwrap_or(0))
        } else {
            None
        };
        // Set by the template: bounded as `tojson`'s indent is.
        if let Some(n) = width
            .into_iter()
            .chain(precision)
            .find(|n| *n > MAX_FORMAT_WIDTH)
        {
            return Err(invalid(format!(
                "format: width or precision {n} is above {MAX_FORMAT_WIDTH}"
            )));
        }
        let conversion = chars.next();
        if conversion == Some('%') {
            out.push('%');
            continue;
        }
        let arg = args
            .next()
            .ok_or_else(|| invalid("format: not enough arguments".into()))?;
        let number_of = |arg: &JinjaValue| -> Result<f64, JinjaError> {
            match arg.kind() {
                ValueKind::Bool => Ok(if arg.is_true() { 1.0 } else { 0.0 }),
                ValueKind::Number => f64::try_from(arg.clone()),
                _ => Err(invalid(format!("format: a number is required, not {arg}"))),
            }
        };
        let integer_of = |arg: &JinjaValue| -> Result<i128, JinjaError> {
            match arg.as_i64() {
                Some(n) => Ok(i128::from(n)),
                None => Ok(number_of(arg)?.trunc() as i128),
            }
        };
        let signed = |body: String, negative: bool| {
            let sign = if negative {
                "-"
            } else if flags.contains('+') {
                "+"
            } else if flags.contains(' ') {
                " "
            } else {
                ""
            };
            (sign, body)
        };
        let (sign, body) = match conversion {
            Some('s') => ("", truncated(python_str(arg), precision)),
            Some('r') => ("", truncated(python_repr(arg), precision)),
            Some('d' | 'i' | 'u') => {
                let n = integer_of(arg)?;
                signed(n.unsigned_abs().to_string(), n < 0)
            }
            Some(radix @ ('x' | 'X' | 'o')) => {
                let n = integer_of(arg)?;
                let digits = match radix {
                    'x' => format!("{:x}", n.unsigned_abs()),
                    'X' => format!("{:X}", n.unsigned_abs()),
                    _ => format!("{:o}", n.unsigned_abs()),
                };
                signed(digits, n < 0)
            }
            Some(kind @ ('f' | 'F' | 'e' | 'E')) => {
                let x = number_of(arg)?;
                let digits = precision.unwrap_or(6);
                let body = match kind {
                    'f' | 'F' => format!("{:.digits$}", x.abs()),
                    _ => python_exponent(&format!("{:.digits$e}", x.abs()), kind == 'E'),
                };
                signed(body, x.is_sign_negative() && x != 0.0)
            }
            _ => {
                return Err(invalid(format!(
                    "format: unsupported conversion %{}",
                    conversion.map(String::from).unwrap_or_default()
                )));
            }
        };
        let len = sign.chars().count() + body.chars().count();
        let pad = width.unwrap_or(0).saturating_sub(len);
        let numeric = !matches!(conversion, Some('s' | 'r'));
        if flags.contains('-') {
            out.push_str(sign);
            out.push_str(&body);
            out.extend(std::iter::repeat_n(' ', pad));
        } else if flags.contains('0') && numeric {
            out.push_str(sign);
            out.extend(std::iter::repeat_n('0', pad));
            out.push_str(&body);
        } else {
            out.extend(std::iter::repeat_n(' ', pad));
            out.push_str(sign);
            out.push_str(&body);
        }
    }
    Ok(out)
}

/// `text` cut to `precision` characters, as `%.Ns` does.
fn truncated(text: String, precision: Option<usize>) -> String {
    match precision {
        Some(n) => text.chars().take(n).collect(),
        None => text,
    }
}

/// Rust's `1.5e0` as Python's `%e` writes it: `1.5e+00` (a sign and at least two digits).
fn python_exponent(rust: &str, upper: bool) -> String {
    let (mantissa, exponent) = rust.split_once('e').unwrap_or((rust, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let sign = if exponent < 0 { '-' } else { '+' };
    let e = if upper { 'E' } else { 'e' };
    format!("{mantissa}{e}{sign}{:02}", exponent.abs())
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
