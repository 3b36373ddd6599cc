//! Usage on every stream: a streamed answer reports its usage (`cached_tokens`,
//! `completion_tokens`) only when the request sets `stream_options.include_usage`, which
//! OpenAI clients leave unset by default. A router that learns from usage (prediction error,
//! prefill rates, output lengths) asks for it on a stream that names no `stream_options`
//! ([`request_stream_usage`]) and takes the usage event vLLM then sends last out of the stream
//! again ([`is_usage_only_event`], [`sse_event_end`]), so that the client gets the stream it
//! asked for.

use serde_json::Value;

/// The key and value added to a streamed request that names no `stream_options`.
const ASK_USAGE: &[u8] = br#""stream_options":{"include_usage":true}"#;

/// `body` (a JSON object, as a generation request's body is once parsed) with
/// `"stream_options":{"include_usage":true}` added as its last member; every other byte is the
/// client's. `None` when the body does not end its object where expected (never for a body
/// [`super::parse_chat`] or [`super::parse_completion`] accepted). Call it only for a request
/// whose body names no `stream_options` ([`super::GenerationRequest::stream_options_given`]):
/// a second key of one name is read differently by different JSON parsers.
pub fn request_stream_usage(body: &[u8]) -> Option<Vec<u8>> {
    let is_space = |b: &u8| matches!(b, b' ' | b'\t' | b'\n' | b'\r');
    let close = body.iter().rposition(|b| !is_space(b))?;
    let open = body.iter().position(|b| !is_space(b))?;
    if body[close] != b'}' || body[open] != b'{' || open >= close {
        return None;
    }
    let empty = body[open + 1..close].iter().all(is_space);
    let mut out = Vec::with_capacity(body.len() + ASK_USAGE.len() + 1);
    out.extend_from_slice(&body[..close]);
    if !empty {
        out.push(b',');
    }
    out.extend_from_slice(ASK_USAGE);
    out.extend_from_slice(&body[close..]);
    Some(out)
}

/// [`request_stream_usage`] for a body the router builds itself from the client's (a P/D
/// decode leg): `stream_options.include_usage` set in `body`, a JSON object whose client named
/// no `stream_options` (one already there is left as it is, as is anything but an object).
pub fn ask_stream_usage(body: &mut Value) {
    if let Some(map) = body.as_object_mut() {
        map.entry("stream_options")
            .or_insert_with(|| serde_json::json!({"include_usage": true}));
    }
}

/// Where the first complete server-sent event in `buf` ends: the index just past the blank
/// line that ends it (`\n\n`, `\r\n\r\n` or `\n\r\n`), or `None` while the event is incomplete.
pub fn sse_event_end(buf: &[u8]) -> Option<usize> {
    let mut at = 0;
    while let Some(newline) = buf[at..].iter().position(|&b| b == b'\n') {
        let after = at + newline + 1;
        match buf.get(after) {
            Some(b'\n') => return Some(after + 1),
            Some(b'\r') if buf.get(after + 1) == Some(&b'\n') => return Some(after + 2),
            _ => at = after,
        }
    }
    None
}

/// Whether a complete server-sent event is the usage-only chunk vLLM (as OpenAI) sends last
/// when `stream_options.include_usage` is set: `data: {...}` whose `choices` is empty and whose
/// `usage` is an object. A chunk with generated text never is (its `choices` has the text),
/// whatever the text says.
pub fn is_usage_only_event(event: &[u8]) -> bool {
    if !has_usage_object(event) {
        return false; // every chunk but the last: no parse
    }
    let text = String::from_utf8_lossy(event);
    let data: String = text
        .lines()
        .filter_map(|line| line.strip_prefix("data:"))
        .map(str::trim_start)
        .collect::<Vec<_>>()
        .join("\n");
    let Ok(chunk) = serde_json::from_str::<Value>(&data) else {
        return false;
    };
    chunk
        .get("choices")
        .and_then(Value::as_array)
        .is_some_and(Vec::is_empty)
        && chunk.get("usage").is_some_and(Value::is_object)
}

/// Whether a chunk of a stream is whole events (it ends at a blank line) none of which can be
/// the usage event: it can be passed on as it is, with nothing taken out or held back.
pub fn passes_unexamined(chunk: &[u8]) -> bool {
    chunk.ends_with(b"\n\n") && !has_usage_object(chunk)
}

/// Whether `bytes` hold a `"usage"` key whose value opens an object: the cheap test before any
/// parse. A chunk with `"usage": null` (as OpenAI-compatible servers other than vLLM put on
/// every chunk) has none; a quote inside a JSON string is escaped, so text cannot match.
fn has_usage_object(bytes: &[u8]) -> bool {
    const KEY: &[u8] = b"\"usage\"";
    let is_space = |b: &u8| matches!(b, b' ' | b'\t' | b'\n' | b'\r');
    let mut rest = bytes;
    while let Some(at) = rest.windows(KEY.len()).position(|w| w == KEY) {
        rest = &rest[at + KEY.len()..];
        let mut value = rest.iter().skip_while(|b| is_space(b));
        if value.next() == Some(&b':') && value.find(|b| !is_space(b)) == Some(&b'{') {
            return true;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn asked(body: &str) -> Value {
        let out = request_stream_usage(body.as_bytes()).expect("an object");
        serde_json::from_slice(&out).expect("still JSON")
    }

    #[test]
    fn usage_is_asked_for_and_the_rest_of_the_body_kept() {
        let body = r#"{"model":"m","messages":[{"role":"user","content":"a } b"}],"stream":true}"#;
        let out = request_stream_usage(body.as_bytes()).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(text.starts_with(&body[..body.len() - 1]), "{text}");
        let value: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(value["stream_options"]["include_usage"], true);
        assert_eq!(value["messages"][0]["content"], "a } b");
        // Whitespace around the object, and an empty object.
        assert_eq!(asked(" {\"stream\": true}\n\n")["stream"], true);
        assert_eq!(
            asked("{ }"),
            serde_json::json!({"stream_options": {"include_usage": true}})
        );
    }

    #[test]
    fn a_body_that_is_not_an_object_is_left_alone() {
        for body in ["[1, 2]", "", "   ", "{\"a\": 1", "\"{}\""] {
            assert_eq!(request_stream_usage(body.as_bytes()), None, "{body:?}");
        }
    }

    #[test]
    fn only_whole_events_without_usage_pass_unexamined() {
        assert!(passes_unexamined(
            b"data: {\"choices\":[]}\n\ndata: [DONE]\n\n"
        ));
        assert!(!passes_unexamined(b"data: {\"choices\":[]}\n\ndata: [DO"));
        assert!(!passes_unexamined(
            b"data: {\"choices\":[],\"usage\":{}}\n\n"
        ));
        assert!(!passes_unexamined(
            b"data: {\"choices\":[],\"usage\" :\n {\"prompt_tokens\":1}}\n\n"
        ));
        // Every chunk of a server that writes `"usage": null` on each passes as it is.
        assert!(passes_unexamined(
            b"data: {\"choices\":[{\"text\":\"x\"}],\"usage\": null}\n\n"
        ));
        assert!(!passes_unexamined(
            b"data: {\"choices\":[{\"text\":\"x\"}],\"usage\":null}\n\ndata: {\"choices\":[],\"usage\":{}}\n\n"
        ));
    }

    #[test]
    fn events_end_at_a_blank_line() {
        assert_eq!(sse_event_end(b"data: a\n\ndata: b"), Some(9));
        assert_eq!(sse_event_end(b"data: a\r\n\r\nrest"), Some(11));
        assert_eq!(sse_event_end(b"data: a\n\r\n"), Some(10));
        assert_eq!(sse_event_end(b"data: a\ndata: b\n"), None);
        assert_eq!(sse_event_end(b"data: a\r\n"), None);
        assert_eq!(sse_event_end(b""), None);
    }

    #[test]
    fn only_the_usage_chunk_is_usage_only() {
        // vLLM's last chunk, as `model_dump_json(exclude_unset=True, exclude_none=True)` writes it.
        let usage = br#"data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[],"usage":{"prompt_tokens":9,"total_tokens":12,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":0}}}

"#;
        assert!(is_usage_only_event(usage));
        let spaced = b"data: { \"choices\" : [ ], \"usage\" : {\"prompt_tokens\": 1} }\r\n\r\n";
        assert!(is_usage_only_event(spaced));
        let others: [&[u8]; 5] = [
            // Chunks with text, with `"usage": null` as OpenAI adds to each chunk then.
            br#"data: {"choices":[{"index":0,"delta":{"content":"\"usage\":{}"}}],"usage":null}

"#,
            br#"data: {"choices":[{"index":0,"text":"x","finish_reason":"stop"}]}

"#,
            b"data: [DONE]\n\n",
            br#"data: {"error":{"message":"usage","code":500}}

"#,
            b"data: {\"choices\":[],\"usage\":{\n\n",
        ];
        for other in others {
            assert!(
                !is_usage_only_event(other),
                "{}",
                String::from_utf8_lossy(other)
            );
        }
    }
}
