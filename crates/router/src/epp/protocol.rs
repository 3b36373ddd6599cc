//! The Endpoint Picker Protocol's wire shapes (Gateway API Inference Extension, proposal 004)
//! on top of Envoy's ext_proc messages: reading headers and subset hints, and building the
//! answers (continue, route with fallbacks, immediate response). Pure functions, no state.

use std::collections::HashMap;

use envoy_types::pb::envoy::config::core::v3::header_value_option::HeaderAppendAction;
use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyMutation, BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, HttpHeaders,
    ImmediateResponse, ProcessingResponse, body_mutation, processing_response::Response,
};
use envoy_types::pb::envoy::r#type::v3::HttpStatus;
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};

/// The header (and `envoy.lb` metadata key) naming the picked endpoint, `ip:port`.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// The metadata namespace of the destination and of subset hints' answer.
pub const LB_NAMESPACE: &str = "envoy.lb";
/// The filter-metadata namespace a data plane puts a subset hint in.
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
/// The key of the subset hint: a list (or comma-separated string) of `ip:port`.
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// The header naming why flow control dropped a request (llm-d's name).
pub const DROPPED_REASON: &str = "x-llm-d-request-dropped-reason";
/// The request header naming a routed request's token, by which the observer stream (Envoy's
/// `observability_mode` filter after the picker's) claims its accounting ([`super::handoff`]).
/// The gateway removes it before the request goes upstream (`request_headers_to_remove`).
pub const EXCHANGE: &str = "x-kvroute-exchange";
/// The llm-d P/D sidecar's header naming the prefill endpoint, `ip:port`: set when `pd.mode`
/// is on and core chooses P/D (only ever an endpoint of the fleet), removed from every other
/// routed request, so a client cannot name one.
pub const PREFILLER: &str = "x-prefiller-host-port";

fn raw(h: &HeaderValue) -> &[u8] {
    if h.raw_value.is_empty() {
        h.value.as_bytes()
    } else {
        &h.raw_value
    }
}

/// The headers as an `http::HeaderMap`, pseudo-headers (`:path`, `:status`) left out; values
/// come in `raw_value` from current Envoy, `value` from older ones. Malformed names or values
/// are skipped.
pub fn header_map(headers: &HttpHeaders) -> http::HeaderMap {
    let mut map = http::HeaderMap::new();
    for h in headers.headers.iter().flat_map(|m| &m.headers) {
        let raw = raw(h);
        if let (Ok(name), Ok(value)) = (
            http::HeaderName::from_bytes(h.key.as_bytes()),
            http::HeaderValue::from_bytes(raw),
        ) {
            map.append(name, value);
        }
    }
    map
}

/// A pseudo-header's value (`:path`, `:method`, `:status`), as text.
pub fn pseudo(headers: &HttpHeaders, name: &str) -> Option<String> {
    headers
        .headers
        .iter()
        .flat_map(|m| &m.headers)
        .find(|h| h.key == name)
        .and_then(|h| std::str::from_utf8(raw(h)).ok().map(str::to_owned))
}

/// One header's value as text.
pub fn header<'a>(map: &'a http::HeaderMap, name: &str) -> Option<&'a str> {
    map.get(name).and_then(|v| v.to_str().ok())
}

/// The subset of endpoints (`ip:port`) the data plane allows, if it sent a hint.
pub fn subset_hint(metadata: Option<&Metadata>) -> Option<Vec<String>> {
    let value = metadata?
        .filter_metadata
        .get(SUBSET_NAMESPACE)?
        .fields
        .get(SUBSET_KEY)?;
    let mut out = Vec::new();
    match value.kind.as_ref()? {
        Kind::ListValue(list) => {
            for v in &list.values {
                if let Some(Kind::StringValue(s)) = &v.kind {
                    out.extend(split_list(s));
                }
            }
        }
        Kind::StringValue(s) => out.extend(split_list(s)),
        _ => {}
    }
    Some(out)
}

fn split_list(s: &str) -> impl Iterator<Item = String> + '_ {
    s.split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(str::to_owned)
}

/// A header set to `value`, replacing any the client sent under the same name (Envoy would
/// otherwise append: a client could add its own destination or exchange token).
fn set_header(key: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: key.to_owned(),
            raw_value: value.as_bytes().to_vec(),
            ..HeaderValue::default()
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
        ..HeaderValueOption::default()
    }
}

fn string_value(s: String) -> Value {
    Value {
        kind: Some(Kind::StringValue(s)),
    }
}

/// The answer that lets a request's headers continue, the body to come. A client's
/// `x-prefiller-host-port` is removed already here: should the picker fail before
/// it answers the body and the gateway pass the request on (`failure_mode_allow`), a client's
/// value must not reach the P/D sidecar, which would connect to it.
pub fn continue_request_headers() -> ProcessingResponse {
    respond(Response::RequestHeaders(HeadersResponse {
        response: Some(CommonResponse {
            header_mutation: Some(HeaderMutation {
                remove_headers: vec![PREFILLER.to_owned()],
                ..HeaderMutation::default()
            }),
            ..CommonResponse::default()
        }),
    }))
}

/// Continue a request-body chunk unchanged.
pub fn continue_request_body() -> ProcessingResponse {
    respond(Response::RequestBody(BodyResponse::default()))
}

/// Continue a response-body chunk unchanged.
pub fn continue_response_body() -> ProcessingResponse {
    respond(Response::ResponseBody(BodyResponse::default()))
}

/// Adds `headers` to the response on its way to the client.
pub fn response_headers(headers: &[(&str, &str)]) -> ProcessingResponse {
    respond(Response::ResponseHeaders(HeadersResponse {
        response: Some(mutation(headers, false)),
    }))
}

fn mutation(headers: &[(&str, &str)], clear_route_cache: bool) -> CommonResponse {
    CommonResponse {
        header_mutation: Some(HeaderMutation {
            set_headers: headers.iter().map(|(k, v)| set_header(k, v)).collect(),
            ..HeaderMutation::default()
        }),
        clear_route_cache,
        ..CommonResponse::default()
    }
}

fn respond(response: Response) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(response),
        ..ProcessingResponse::default()
    }
}

/// Where the request goes: the header names `first` (what an `ORIGINAL_DST` cluster keyed on
/// the header connects to), the `envoy.lb` metadata the ordered fallback list (`first`, then
/// `fallbacks`), and any `extra` headers (the P/D hook). `on_body` says whether this answers
/// the request body (buffered mode) or its headers (a bodiless request).
pub fn route(
    first: &str,
    fallbacks: &[String],
    extra: &[(&str, &str)],
    on_body: bool,
) -> ProcessingResponse {
    let mut headers = vec![(DESTINATION, first)];
    headers.extend_from_slice(extra);
    let mut common = mutation(&headers, true);
    // Only the picker names a prefiller: whatever a client sent is removed, so a request can
    // never make the sidecar connect outside the fleet.
    if !extra.iter().any(|(name, _)| *name == PREFILLER)
        && let Some(m) = common.header_mutation.as_mut()
    {
        m.remove_headers.push(PREFILLER.to_owned());
    }
    let common = Some(common);
    let response = if on_body {
        Response::RequestBody(BodyResponse { response: common })
    } else {
        Response::RequestHeaders(HeadersResponse { response: common })
    };
    let lb = Struct {
        fields: HashMap::from([(
            DESTINATION.to_owned(),
            string_value(
                std::iter::once(first)
                    .chain(fallbacks.iter().map(String::as_str))
                    .collect::<Vec<_>>()
                    .join(","),
            ),
        )]),
    };
    let metadata = Struct {
        fields: HashMap::from([(
            LB_NAMESPACE.to_owned(),
            Value {
                kind: Some(Kind::StructValue(lb)),
            },
        )]),
    };
    ProcessingResponse {
        response: Some(response),
        dynamic_metadata: Some(metadata),
        ..ProcessingResponse::default()
    }
}

/// Makes a routing answer to the (buffered) request body send `body` upstream instead of the
/// client's, with its `content-length`: in `BUFFERED` mode Envoy keeps the client's length and
/// refuses a replaced body whose length differs from it. A bodiless answer is left as it is.
pub fn replace_request_body(answer: &mut ProcessingResponse, body: Vec<u8>) {
    let Some(Response::RequestBody(BodyResponse {
        response: Some(common),
    })) = answer.response.as_mut()
    else {
        return;
    };
    let length = body.len().to_string();
    common
        .header_mutation
        .get_or_insert_with(HeaderMutation::default)
        .set_headers
        .push(set_header("content-length", &length));
    common.body_mutation = Some(BodyMutation {
        mutation: Some(body_mutation::Mutation::Body(body)),
    });
}

/// A response Envoy sends to the client at once, without an upstream: `body` is the OpenAI
/// error JSON; `dropped` names flow control's reason when it shed the request.
pub fn immediate(status: u16, body: String, dropped: Option<&str>) -> ProcessingResponse {
    let mut headers = vec![("content-type", "application/json")];
    if status == 503 || status == 429 {
        headers.push(("retry-after", "1"));
    }
    if let Some(reason) = dropped {
        headers.push((DROPPED_REASON, reason));
    }
    respond(Response::ImmediateResponse(ImmediateResponse {
        status: Some(HttpStatus {
            code: i32::from(status),
        }),
        headers: Some(HeaderMutation {
            set_headers: headers.iter().map(|(k, v)| set_header(k, v)).collect(),
            ..HeaderMutation::default()
        }),
        body: body.into_bytes(),
        details: "kvroute_epp".to_owned(),
        ..ImmediateResponse::default()
    }))
}

#[cfg(test)]
mod tests {
    use envoy_types::pb::envoy::config::core::v3::HeaderMap;
    use envoy_types::pb::google::protobuf::ListValue;

    use super::*;

    fn lb_metadata(r: &ProcessingResponse) -> String {
        let md = r.dynamic_metadata.as_ref().unwrap();
        let Some(Kind::StructValue(lb)) = &md.fields[LB_NAMESPACE].kind else {
            panic!("no envoy.lb struct");
        };
        let Some(Kind::StringValue(s)) = &lb.fields[DESTINATION].kind else {
            panic!("no destination");
        };
        s.clone()
    }

    #[test]
    fn route_names_the_first_endpoint_and_every_fallback_in_order() {
        let r = route("10.0.0.2:8000", &["10.0.0.1:8000".to_owned()], &[], true);
        assert_eq!(lb_metadata(&r), "10.0.0.2:8000,10.0.0.1:8000");
        let Some(Response::RequestBody(body)) = &r.response else {
            panic!("not a body response");
        };
        let common = body.response.as_ref().unwrap();
        assert!(common.clear_route_cache);
        let set = &common.header_mutation.as_ref().unwrap().set_headers;
        let h = set[0].header.as_ref().unwrap();
        assert_eq!(h.key, DESTINATION);
        assert_eq!(h.raw_value, b"10.0.0.2:8000");
    }

    #[test]
    fn a_replaced_request_body_comes_with_its_own_content_length() {
        let mut answer = route("10.0.0.2:8000", &[], &[], true);
        replace_request_body(&mut answer, b"{\"model\":\"m\"}".to_vec());
        let Some(Response::RequestBody(body)) = &answer.response else {
            panic!("not a body response");
        };
        let common = body.response.as_ref().unwrap();
        let Some(body_mutation::Mutation::Body(sent)) = common
            .body_mutation
            .as_ref()
            .and_then(|m| m.mutation.as_ref())
        else {
            panic!("no body mutation");
        };
        assert_eq!(sent, b"{\"model\":\"m\"}");
        let set = &common.header_mutation.as_ref().unwrap().set_headers;
        let length = set
            .iter()
            .filter_map(|h| h.header.as_ref())
            .find(|h| h.key == "content-length")
            .unwrap();
        assert_eq!(length.raw_value, b"13");
        // A bodiless request's answer (to its headers) has no body to replace.
        let mut headers_only = route("10.0.0.2:8000", &[], &[], false);
        let before = headers_only.clone();
        replace_request_body(&mut headers_only, b"{}".to_vec());
        assert_eq!(headers_only, before);
    }

    #[test]
    fn subset_hints_are_read_as_lists_or_comma_separated_strings() {
        let hint = |v: Value| Metadata {
            filter_metadata: HashMap::from([(
                SUBSET_NAMESPACE.to_owned(),
                Struct {
                    fields: HashMap::from([(SUBSET_KEY.to_owned(), v)]),
                },
            )]),
            ..Metadata::default()
        };
        let list = hint(Value {
            kind: Some(Kind::ListValue(ListValue {
                values: vec![string_value("a:1".into()), string_value("b:2, c:3".into())],
            })),
        });
        assert_eq!(subset_hint(Some(&list)).unwrap(), ["a:1", "b:2", "c:3"]);
        let text = hint(string_value("a:1,b:2".into()));
        assert_eq!(subset_hint(Some(&text)).unwrap(), ["a:1", "b:2"]);
        assert_eq!(subset_hint(None), None);
        assert_eq!(subset_hint(Some(&Metadata::default())), None);
    }

    #[test]
    fn headers_read_raw_or_text_values_and_skip_malformed_ones() {
        let h = HttpHeaders {
            headers: Some(HeaderMap {
                headers: vec![
                    HeaderValue {
                        key: ":path".into(),
                        raw_value: b"/v1/completions".to_vec(),
                        ..HeaderValue::default()
                    },
                    HeaderValue {
                        key: "x-session".into(),
                        value: "s1".into(),
                        ..HeaderValue::default()
                    },
                    HeaderValue {
                        key: "bad name".into(),
                        value: "x".into(),
                        ..HeaderValue::default()
                    },
                ],
            }),
            ..HttpHeaders::default()
        };
        let map = header_map(&h);
        assert_eq!(pseudo(&h, ":path").as_deref(), Some("/v1/completions"));
        assert_eq!(header(&map, "x-session"), Some("s1"));
        assert_eq!(map.len(), 1);
    }

    #[test]
    fn immediate_responses_carry_status_retry_after_and_drop_reason() {
        let r = immediate(429, "{}".into(), Some("rejected-saturated"));
        let Some(Response::ImmediateResponse(i)) = r.response else {
            panic!("not immediate");
        };
        assert_eq!(i.status.unwrap().code, 429);
        let keys: Vec<_> = i
            .headers
            .unwrap()
            .set_headers
            .into_iter()
            .map(|h| h.header.unwrap().key)
            .collect();
        assert!(keys.contains(&"retry-after".to_owned()));
        assert!(keys.contains(&DROPPED_REASON.to_owned()));
    }
}
