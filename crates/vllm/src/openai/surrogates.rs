//! Lone UTF-16 surrogates in JSON strings (`"\ud800"`): Python's `json` (and so vLLM) accepts
//! them, serde_json refuses them. Before a second parse attempt, each unpaired surrogate escape
//! is replaced by `\ufffd`, the replacement character; valid pairs and everything else are left
//! as they are.

/// `body` with every unpaired `\uD800`–`\uDFFF` escape inside a string replaced by `\ufffd`,
/// or `None` when it has none (the body's trouble lies elsewhere).
pub fn replace_lone_surrogates(body: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(body.len());
    let mut replaced = false;
    let mut in_string = false;
    let mut i = 0;
    while i < body.len() {
        let b = body[i];
        if !in_string {
            in_string = b == b'"';
            out.push(b);
            i += 1;
            continue;
        }
        match b {
            b'"' => {
                in_string = false;
                out.push(b);
                i += 1;
            }
            b'\\' => match (body.get(i + 1), escaped_unit(body, i)) {
                (Some(b'u'), Some(unit)) if is_high(unit) || is_low(unit) => {
                    let paired = is_high(unit) && escaped_unit(body, i + 6).is_some_and(is_low);
                    if paired {
                        out.extend_from_slice(&body[i..i + 12]);
                        i += 12;
                    } else {
                        out.extend_from_slice(b"\\ufffd");
                        replaced = true;
                        i += 6;
                    }
                }
                (Some(&next), _) => {
                    out.extend_from_slice(&[b, next]);
                    i += 2;
                }
                (None, _) => {
                    out.push(b);
                    i += 1;
                }
            },
            _ => {
                out.push(b);
                i += 1;
            }
        }
    }
    replaced.then_some(out)
}

/// The code unit of a `\uXXXX` escape starting at `at`.
fn escaped_unit(body: &[u8], at: usize) -> Option<u16> {
    let escape = body.get(at..at + 6)?;
    if escape[0] != b'\\' || escape[1] != b'u' {
        return None;
    }
    let hex = std::str::from_utf8(&escape[2..]).ok()?;
    u16::from_str_radix(hex, 16).ok()
}

fn is_high(unit: u16) -> bool {
    (0xD800..0xDC00).contains(&unit)
}

fn is_low(unit: u16) -> bool {
    (0xDC00..0xE000).contains(&unit)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fix(s: &str) -> Option<String> {
        replace_lone_surrogates(s.as_bytes()).map(|v| String::from_utf8(v).unwrap())
    }

    #[test]
    fn only_unpaired_surrogates_inside_strings_are_replaced() {
        assert_eq!(
            fix(r#"{"a":"x\ud800y"}"#).as_deref(),
            Some(r#"{"a":"x\ufffdy"}"#)
        );
        assert_eq!(fix(r#"["\udc00"]"#).as_deref(), Some(r#"["\ufffd"]"#));
        assert_eq!(
            fix(r#"["\ud800\ud800"]"#).as_deref(),
            Some(r#"["\ufffd\ufffd"]"#)
        );
        assert_eq!(fix(r#"["\ud83d\ude00 ok"]"#), None, "a valid pair");
        assert_eq!(
            fix(r#"["\\ud800"]"#),
            None,
            "an escaped backslash, not an escape"
        );
        assert_eq!(fix(r#"{"a":1}"#), None);
        assert_eq!(fix(r#"["\ud8"#), None, "truncated");
    }
}
