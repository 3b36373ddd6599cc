//! Request paths made canonical before routing, so that `/v1/../sim/restart` can never reach an
//! engine path the router does not forward.

use http::Uri;
use http::uri::PathAndQuery;

/// Percent-encodings of `.`, `/` and `\`: a path hiding them is refused rather than guessed at.
const HIDDEN_SEPARATORS: [&str; 3] = ["%2e", "%2f", "%5c"];

/// The URI with its path's `.` and `..` segments resolved and empty segments dropped (a
/// trailing slash is kept), or `None` when the path hides separators (`%2e`, `%2f`, `%5c`, `\`)
/// and cannot be routed safely.
pub fn normalize(uri: &Uri) -> Option<Uri> {
    let path = uri.path();
    let lower = path.to_ascii_lowercase();
    if path.contains('\\') || HIDDEN_SEPARATORS.iter().any(|s| lower.contains(s)) {
        return None;
    }
    let mut segments: Vec<&str> = Vec::new();
    for segment in path.split('/') {
        match segment {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            s => segments.push(s),
        }
    }
    let mut canonical = format!("/{}", segments.join("/"));
    if path.len() > 1 && path.ends_with('/') && !segments.is_empty() {
        canonical.push('/');
    }
    if canonical == path {
        return Some(uri.clone());
    }
    if let Some(query) = uri.query() {
        canonical = format!("{canonical}?{query}");
    }
    let mut parts = uri.clone().into_parts();
    parts.path_and_query = Some(PathAndQuery::try_from(canonical).ok()?);
    Uri::from_parts(parts).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn norm(s: &str) -> Option<String> {
        normalize(&s.parse().unwrap()).map(|u| u.to_string())
    }

    #[test]
    fn dot_segments_and_empty_segments_are_resolved() {
        assert_eq!(norm("/v1/../sim/restart").as_deref(), Some("/sim/restart"));
        assert_eq!(norm("/v1/./embeddings").as_deref(), Some("/v1/embeddings"));
        assert_eq!(norm("//v1//models").as_deref(), Some("/v1/models"));
        assert_eq!(norm("/../../etc").as_deref(), Some("/etc"));
        assert_eq!(norm("/v1/x/..?a=1").as_deref(), Some("/v1?a=1"));
        assert_eq!(norm("/v1/models/").as_deref(), Some("/v1/models/"));
        assert_eq!(norm("/").as_deref(), Some("/"));
        assert_eq!(
            norm("/v1/models?x=/../").as_deref(),
            Some("/v1/models?x=/../")
        );
    }

    #[test]
    fn hidden_separators_are_refused() {
        for bad in [
            "/v1/%2e%2e/sim",
            "/v1/%2E./x",
            "/v1%2fsim",
            "/v1/a%5Cb",
            "/v1\\x",
        ] {
            assert_eq!(norm(bad), None, "{bad}");
        }
    }
}
