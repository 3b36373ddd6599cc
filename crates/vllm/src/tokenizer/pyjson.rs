//! JSON text exactly as Python's `json.dumps` writes it, which is what a chat template's `tojson`
//! gives in vLLM: transformers replaces Jinja's filter with `json.dumps(x, ensure_ascii=False,
//! indent=None, separators=None, sort_keys=False)`. Tool schemas and tool-call arguments reach
//! the prompt through it, so a byte of difference (a missing space after a comma, an escaped
//! `<`, `1e+16` written `1e16`) changes the tokens and every block after them.
//!
//! Python's layout, reproduced here:
//! - separators `", "` and `": "`, or `","` and `": "` when indented, unless given;
//! - an indent (a number of spaces or a string) puts each item on its own line; an empty list or
//!   map stays `[]` / `{}`;
//! - strings escape `"`, `\`, `\n`, `\r`, `\t`, `\b`, `\f` and other control characters as
//!   `\u00XX` (lower-case hex), and with `ensure_ascii` every character past `~` as `\uXXXX`
//!   (astral ones as a surrogate pair);
//! - floats as `repr` writes them: the shortest digits that read back, fixed notation for
//!   exponents from -4 to 15 (always with a fraction: `1.0`), else `1e+16`, `1.5e-07`; `NaN`,
//!   `Infinity`, `-Infinity` (Python writes them, though they are not JSON).
//!
//! Maps keep their order (a request's keys, as Python's dicts do) unless `sort_keys`.

use serde_json::Value;

/// How to lay the text out: `json.dumps`'s arguments.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Layout {
    /// Write every character past `~` as an escape.
    pub ensure_ascii: bool,
    /// Put each item on its own line, indented by this text per level.
    pub indent: Option<String>,
    /// The item and key separators; Python's defaults when `None`.
    pub separators: Option<(String, String)>,
    /// Write map keys in sorted order.
    pub sort_keys: bool,
}

/// `value` as `json.dumps(value, **layout)` writes it.
pub fn dumps(value: &Value, layout: &Layout) -> String {
    let (item, key) = match &layout.separators {
        Some((item, key)) => (item.as_str(), key.as_str()),
        None if layout.indent.is_some() => (",", ": "),
        None => (", ", ": "),
    };
    let mut writer = Writer {
        out: String::new(),
        layout,
        item,
        key,
    };
    writer.value(value, 0);
    writer.out
}

struct Writer<'a> {
    out: String,
    layout: &'a Layout,
    item: &'a str,
    key: &'a str,
}

impl Writer<'_> {
    fn value(&mut self, value: &Value, level: usize) {
        match value {
            Value::Null => self.out.push_str("null"),
            Value::Bool(b) => self.out.push_str(if *b { "true" } else { "false" }),
            Value::Number(n) => match (n.as_u64(), n.as_i64(), n.as_f64()) {
                (Some(u), _, _) => self.out.push_str(&u.to_string()),
                (None, Some(i), _) => self.out.push_str(&i.to_string()),
                (None, None, Some(f)) => self.out.push_str(&float_repr(f)),
                (None, None, None) => self.out.push_str(&n.to_string()),
            },
            Value::String(s) => self.string(s),
            Value::Array(items) => {
                if items.is_empty() {
                    self.out.push_str("[]");
                    return;
                }
                self.out.push('[');
                for (i, item) in items.iter().enumerate() {
                    self.separate(i == 0, level + 1);
                    self.value(item, level + 1);
                }
                self.close(level);
                self.out.push(']');
            }
            Value::Object(map) => {
                if map.is_empty() {
                    self.out.push_str("{}");
                    return;
                }
                let mut entries: Vec<(&String, &Value)> = map.iter().collect();
                if self.layout.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                self.out.push('{');
                for (i, (k, v)) in entries.into_iter().enumerate() {
                    self.separate(i == 0, level + 1);
                    self.string(k);
                    self.out.push_str(self.key);
                    self.value(v, level + 1);
                }
                self.close(level);
                self.out.push('}');
            }
        }
    }

    /// Before an item at `level`: the item separator unless it is the first, then a new line
    /// and its indent when indenting.
    fn separate(&mut self, first: bool, level: usize) {
        if !first {
            self.out.push_str(self.item);
        }
        self.new_line(level);
    }

    /// Before a closing bracket at `level`.
    fn close(&mut self, level: usize) {
        self.new_line(level);
    }

    fn new_line(&mut self, level: usize) {
        if let Some(indent) = &self.layout.indent {
            self.out.push('\n');
            for _ in 0..level {
                self.out.push_str(indent);
            }
        }
    }

    fn string(&mut self, s: &str) {
        self.out.push('"');
        for c in s.chars() {
            match c {
                '"' => self.out.push_str("\\\""),
                '\\' => self.out.push_str("\\\\"),
                '\n' => self.out.push_str("\\n"),
                '\r' => self.out.push_str("\\r"),
                '\t' => self.out.push_str("\\t"),
                '\u{8}' => self.out.push_str("\\b"),
                '\u{c}' => self.out.push_str("\\f"),
                c if (c as u32) < 0x20 => self.unicode_escape(c as u32),
                c if self.layout.ensure_ascii && !(' '..='~').contains(&c) => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        self.unicode_escape(u32::from(*unit));
                    }
                }
                c => self.out.push(c),
            }
        }
        self.out.push('"');
    }

    fn unicode_escape(&mut self, unit: u32) {
        self.out.push_str(&format!("\\u{unit:04x}"));
    }
}

/// A float as Python's `repr` writes it.
pub fn float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    // Rust's `{:e}` gives the shortest digits that read back, as Python's repr does; only the
    // notation differs.
    let scientific = format!("{f:e}");
    let (mantissa, exponent) = scientific
        .split_once('e')
        .expect("`{:e}` always writes an exponent");
    let exponent: i32 = exponent.parse().expect("`{:e}` writes an integer exponent");
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => ("-", m),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let mut out = String::from(sign);
    if (-4..16).contains(&exponent) {
        // Fixed notation: the point goes after `exponent + 1` digits.
        let point = exponent + 1;
        if point <= 0 {
            out.push_str("0.");
            out.extend(std::iter::repeat_n('0', (-point) as usize));
            out.push_str(&digits);
        } else {
            let point = point as usize;
            if digits.len() <= point {
                out.push_str(&digits);
                out.extend(std::iter::repeat_n('0', point - digits.len()));
                out.push_str(".0");
            } else {
                out.push_str(&digits[..point]);
                out.push('.');
                out.push_str(&digits[point..]);
            }
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        let exp_sign = if exponent < 0 { '-' } else { '+' };
        out.push_str(&format!("e{exp_sign}{:02}", exponent.abs()));
    }
    out
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    // Expected texts are what CPython 3.12 prints for the same calls.

    #[test]
    fn python_default_layout_has_spaces_after_separators() {
        let v = json!({"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}});
        assert_eq!(
            dumps(&v, &Layout::default()),
            r#"{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}"#
        );
        assert_eq!(dumps(&json!([]), &Layout::default()), "[]");
        assert_eq!(dumps(&json!({}), &Layout::default()), "{}");
    }

    #[test]
    fn indented_items_take_a_line_each_and_commas_lose_their_space() {
        let v = json!({"a": [1, {"b": null}], "c": {}, "d": []});
        let layout = Layout {
            indent: Some("    ".into()),
            ..Layout::default()
        };
        assert_eq!(
            dumps(&v, &layout),
            "{\n    \"a\": [\n        1,\n        {\n            \"b\": null\n        }\n    ],\n    \"c\": {},\n    \"d\": []\n}"
        );
    }

    #[test]
    fn separators_and_sorted_keys_are_honoured() {
        let v = json!({"b": 1, "a": [true, false]});
        let layout = Layout {
            separators: Some((",".into(), ":".into())),
            sort_keys: true,
            ..Layout::default()
        };
        assert_eq!(dumps(&v, &layout), r#"{"a":[true,false],"b":1}"#);
    }

    #[test]
    fn strings_escape_as_python_does_and_keep_html_characters() {
        let v = json!("a\"b\\c\nd\te\u{8}\u{c}\r\u{1}\u{7f}<&>' é 😀");
        assert_eq!(
            dumps(&v, &Layout::default()),
            "\"a\\\"b\\\\c\\nd\\te\\b\\f\\r\\u0001\u{7f}<&>' é 😀\""
        );
        let ascii = Layout {
            ensure_ascii: true,
            ..Layout::default()
        };
        assert_eq!(
            dumps(&json!("\u{7f}é😀"), &ascii),
            r#""\u007f\u00e9\ud83d\ude00""#
        );
    }

    proptest::proptest! {
        /// Python's repr is the shortest text that reads back: so is ours, in its notation.
        #[test]
        fn a_float_reads_back_from_its_repr(bits in proptest::prelude::any::<u64>()) {
            let f = f64::from_bits(bits);
            proptest::prop_assume!(f.is_finite());
            let text = float_repr(f);
            proptest::prop_assert_eq!(text.parse::<f64>().unwrap().to_bits(), f.to_bits(), "{}", text);
            let fixed = text.contains('.') && !text.contains('e');
            proptest::prop_assert!(fixed || text.contains("e+") || text.contains("e-"), "{}", text);
        }
    }

    #[test]
    fn floats_read_as_python_repr() {
        let cases = [
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (1.0, "1.0"),
            (0.1, "0.1"),
            (123.456, "123.456"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1.2345678901234567e16, "1.2345678901234568e+16"),
            (-2.5e100, "-2.5e+100"),
            (f64::NAN, "NaN"),
            (f64::NEG_INFINITY, "-Infinity"),
        ];
        for (f, text) in cases {
            assert_eq!(float_repr(f), text, "{f:e}");
        }
        assert_eq!(
            dumps(
                &json!([1, -2, 2.5, 18446744073709551615u64]),
                &Layout::default()
            ),
            "[1, -2, 2.5, 18446744073709551615]"
        );
    }
}
