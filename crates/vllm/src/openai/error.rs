//! The one mapping from an error to an OpenAI-shaped HTTP response, shared by the router and the
//! simulator: the status, the `{"error": {...}}` body, `Retry-After` when a retry may succeed,
//! and who failed.

use serde::{Deserialize, Serialize};

/// An error in OpenAI's shape, with its HTTP status.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    /// HTTP status.
    pub status: u16,
    /// What is wrong, for a person.
    pub message: String,
    /// The request field at fault, if one is.
    pub param: Option<String>,
}

/// Who failed, as an error's status says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The request was wrong, too large, too slow or over a limit (4xx).
    Client,
    /// The engine behind failed or did not answer in time (502, 504).
    Engine,
    /// The server itself could not serve it now (other 5xx, including 503 overload).
    Internal,
}

#[derive(Serialize, Deserialize)]
struct ErrorBody {
    error: ErrorDetail,
}

#[derive(Serialize, Deserialize)]
struct ErrorDetail {
    message: String,
    #[serde(rename = "type")]
    kind: String,
    param: Option<String>,
    code: u16,
}

/// Seconds a client is told to wait before retrying an overloaded server.
const RETRY_AFTER_S: &str = "1";

impl ApiError {
    /// 400: the body is malformed or a field is invalid.
    pub fn bad_request(message: impl Into<String>, param: Option<&str>) -> Self {
        Self {
            status: 400,
            message: message.into(),
            param: param.map(str::to_owned),
        }
    }

    /// Any status with a message.
    pub fn new(status: u16, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            param: None,
        }
    }

    /// 404: no such model or path.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(404, message)
    }

    /// 408: the client did not send its request in time.
    pub fn client_timeout(message: impl Into<String>) -> Self {
        Self::new(408, message)
    }

    /// 413: the request is larger than allowed.
    pub fn too_large(message: impl Into<String>) -> Self {
        Self::new(413, message)
    }

    /// 429: too many requests are waiting; retry later.
    pub fn rate_limited(message: impl Into<String>) -> Self {
        Self::new(429, message)
    }

    /// 502: the engine behind failed.
    pub fn engine_failed(message: impl Into<String>) -> Self {
        Self::new(502, message)
    }

    /// 503: the server cannot serve it now (overloaded, unhealthy, shutting down); retry later.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(503, message)
    }

    /// 504: the engine behind did not answer in time.
    pub fn engine_timeout(message: impl Into<String>) -> Self {
        Self::new(504, message)
    }

    /// Who failed.
    pub fn fault(&self) -> Fault {
        match self.status {
            400..=499 => Fault::Client,
            502 | 504 => Fault::Engine,
            _ => Fault::Internal,
        }
    }

    /// Whether the same request may succeed if sent again.
    pub fn retry_allowed(&self) -> bool {
        matches!(self.status, 408 | 429 | 502 | 503 | 504)
    }

    /// The `Retry-After` value to send, if any (overload: 429 and 503).
    pub fn retry_after(&self) -> Option<&'static str> {
        matches!(self.status, 429 | 503).then_some(RETRY_AFTER_S)
    }

    /// The JSON body: `{"error": {"message", "type", "param", "code"}}`.
    pub fn to_json(&self) -> String {
        let kind = match self.status {
            400 => "BadRequestError",
            401 => "AuthenticationError",
            404 => "NotFoundError",
            405 => "MethodNotAllowedError",
            408 => "TimeoutError",
            413 => "RequestTooLargeError",
            429 => "RateLimitError",
            503 => "ServiceUnavailableError",
            504 => "TimeoutError",
            _ => "InternalServerError",
        };
        serde_json::to_string(&ErrorBody {
            error: ErrorDetail {
                message: self.message.clone(),
                kind: kind.into(),
                param: self.param.clone(),
                code: self.status,
            },
        })
        .expect("error bodies serialize")
    }

    /// The whole HTTP response: status (500 if not a valid one), JSON content type, the body,
    /// and `Retry-After` when the server is overloaded.
    pub fn to_response(&self) -> http::Response<String> {
        let status = http::StatusCode::from_u16(self.status)
            .unwrap_or(http::StatusCode::INTERNAL_SERVER_ERROR);
        let mut builder = http::Response::builder()
            .status(status)
            .header(http::header::CONTENT_TYPE, "application/json");
        if let Some(seconds) = self.retry_after() {
            builder = builder.header(http::header::RETRY_AFTER, seconds);
        }
        builder
            .body(self.to_json())
            .expect("a valid status and static headers make a valid response")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overload_says_when_to_retry_and_who_failed() {
        let busy = ApiError::new(503, "busy").to_response();
        assert_eq!(busy.status(), 503);
        assert_eq!(busy.headers()[http::header::RETRY_AFTER], "1");
        assert_eq!(
            busy.headers()[http::header::CONTENT_TYPE],
            "application/json"
        );
        let bad = ApiError::bad_request("no", Some("prompt"));
        assert!(
            bad.to_response()
                .headers()
                .get(http::header::RETRY_AFTER)
                .is_none()
        );
        assert_eq!(bad.fault(), Fault::Client);
        assert!(!bad.retry_allowed());
        assert_eq!(ApiError::new(502, "x").fault(), Fault::Engine);
        assert!(ApiError::new(504, "x").retry_allowed());
        assert_eq!(ApiError::new(1000, "x").to_response().status(), 500);
    }
}
