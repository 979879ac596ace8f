//! Errors in each API's own format: OpenAI `{"error": {...}}`, Anthropic `{"type": "error", ...}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use dsv4_engine::AdmitError;

/// Which API's error format to use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavor {
    OpenAi,
    Anthropic,
}

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub flavor: Flavor,
    pub message: String,
    /// The parameter at fault, when known (OpenAI `param`).
    pub param: Option<String>,
}

impl ApiError {
    pub fn new(status: StatusCode, flavor: Flavor, message: impl Into<String>) -> Self {
        ApiError { status, flavor, message: message.into(), param: None }
    }
    pub fn bad(flavor: Flavor, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, flavor, message)
    }
    pub fn param(mut self, p: &str) -> Self {
        self.param = Some(p.to_string());
        self
    }
    pub fn from_admit(flavor: Flavor, e: AdmitError) -> Self {
        let status = match e {
            AdmitError::QueueFull { .. } => StatusCode::TOO_MANY_REQUESTS,
            AdmitError::Stopped => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::BAD_REQUEST,
        };
        Self::new(status, flavor, e.to_string())
    }
    fn openai_type(&self) -> &'static str {
        match self.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            s if s.is_server_error() => "server_error",
            _ => "invalid_request_error",
        }
    }
    fn anthropic_type(&self) -> &'static str {
        match self.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::PAYLOAD_TOO_LARGE => "request_too_large",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            StatusCode::SERVICE_UNAVAILABLE => "overloaded_error",
            s if s.is_server_error() => "api_error",
            _ => "invalid_request_error",
        }
    }
    /// The JSON body (also used inside streams).
    pub fn body(&self) -> serde_json::Value {
        match self.flavor {
            Flavor::OpenAi => serde_json::json!({
                "error": {"message": self.message, "type": self.openai_type(), "param": self.param, "code": null}
            }),
            Flavor::Anthropic => serde_json::json!({
                "type": "error", "error": {"type": self.anthropic_type(), "message": self.message}
            }),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        // Clients (the OpenAI and Anthropic SDKs among them) wait this long before retrying.
        if matches!(self.status, StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE) {
            r.headers_mut().insert(axum::http::header::RETRY_AFTER, axum::http::HeaderValue::from_static("1"));
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_for_load_carry_retry_after() {
        let r = ApiError::from_admit(Flavor::OpenAi, AdmitError::QueueFull { waiting: 3 }).into_response();
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.headers()["retry-after"], "1");
        let r = ApiError::from_admit(Flavor::Anthropic, AdmitError::Stopped).into_response();
        assert_eq!(r.headers()["retry-after"], "1");
        let r = ApiError::bad(Flavor::OpenAi, "no").into_response();
        assert!(r.headers().get("retry-after").is_none());
    }
}
