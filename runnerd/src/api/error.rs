//! The error every handler returns: the original's status and `error` text, plus our stable
//! machine-readable `code` (api.md improvement 1).

use serde::Serialize;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    pub code: &'static str,
    /// Seconds, for 503 `queue_full`.
    pub retry_after: Option<u64>,
}

#[derive(Serialize)]
struct Body<'a> {
    error: &'a str,
    code: &'a str,
}

impl ApiError {
    /// A 400 — the original answers every handler failure with 400.
    pub fn bad_request(code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status: 400, message: message.into(), code, retry_after: None }
    }

    pub fn with_status(status: u16, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status, message: message.into(), code, retry_after: None }
    }

    pub fn unauthorized() -> ApiError {
        ApiError::with_status(401, "unauthorized", "Unauthorized")
    }

    pub fn not_found() -> ApiError {
        ApiError::with_status(404, "not_found", "Not found")
    }

    pub fn body_json(&self) -> String {
        serde_json::to_string(&Body { error: &self.message, code: self.code }).unwrap_or_default()
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} ({})", self.status, self.message, self.code)
    }
}

impl std::error::Error for ApiError {}
