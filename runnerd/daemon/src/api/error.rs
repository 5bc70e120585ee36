//! The error every handler returns: the original's status and `error` text, plus our stable
//! machine-readable `code` (api.md improvement 1).

use serde::Serialize;

use crate::exec::EngineError;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    pub code: &'static str,
    /// Seconds, for 503 `queue_full`.
    pub retry_after: Option<u64>,
    /// Where a fenced workspace went (409 `workspace_moved`, issue #34; ours).
    pub moved_to: Option<String>,
}

#[derive(Serialize)]
struct Body<'a> {
    error: &'a str,
    code: &'a str,
    #[serde(rename = "movedTo", skip_serializing_if = "Option::is_none")]
    moved_to: Option<&'a str>,
}

impl ApiError {
    /// A 400 — the original answers every handler failure with 400.
    pub fn bad_request(code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status: 400, message: message.into(), code, retry_after: None, moved_to: None }
    }

    pub fn with_status(status: u16, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status, message: message.into(), code, retry_after: None, moved_to: None }
    }

    pub fn unauthorized() -> ApiError {
        ApiError::with_status(401, "unauthorized", "Unauthorized")
    }

    pub fn not_found() -> ApiError {
        ApiError::with_status(404, "not_found", "Not found")
    }

    pub fn body_json(&self) -> String {
        let body = Body { error: &self.message, code: self.code, moved_to: self.moved_to.as_deref() };
        serde_json::to_string(&body).unwrap_or_default()
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} ({})", self.status, self.message, self.code)
    }
}

impl std::error::Error for ApiError {}

/// The one place an engine failure becomes an answer: the contract's status (400 for every
/// handler failure, runnerd's own included — its `code` says `internal`; 409 for a duplicate
/// id; 503 with `Retry-After` for a full queue), the failure's stable `code`, and its text.
impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> ApiError {
        if let EngineError::Workspace(w) = &e
            && let Some(moved) = ApiError::moved(w)
        {
            return moved;
        }
        let status = match &e {
            EngineError::Duplicate => 409,
            EngineError::QueueFull { .. } => 503,
            _ => 400,
        };
        let retry_after = match &e {
            EngineError::QueueFull { retry_after_s, .. } => Some(*retry_after_s),
            _ => None,
        };
        ApiError { status, message: e.to_string(), code: e.code().as_str(), retry_after, moved_to: None }
    }
}

impl ApiError {
    /// A write refused because the workspace moved to another node: 409 naming where (ours,
    /// issue #34), for every route that writes.
    pub fn moved(e: &crate::writer::WriteError) -> Option<ApiError> {
        match e {
            crate::writer::WriteError::Fenced { moved_to, .. } => Some(ApiError {
                moved_to: Some(moved_to.clone()),
                ..ApiError::with_status(409, "workspace_moved", e.to_string())
            }),
            _ => None,
        }
    }

    /// A write's failure as the workspace routes answer it: 409 when the workspace moved,
    /// else 400 with the failure's code.
    pub fn from_write(e: crate::writer::WriteError) -> ApiError {
        ApiError::moved(&e).unwrap_or_else(|| {
            ApiError::bad_request(crate::exec::error::workspace_code(&e).as_str(), e.to_string())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::coordination::CoordError;
    use crate::exec::ErrorCode;
    use crate::writer::WriteError;

    /// Every engine error: its status, code and exact text.
    #[test]
    fn engine_error_table() {
        let (poisoned, no_baseline) = (CoordError::Poisoned.to_string(), WriteError::NoBaseline.to_string());
        let cases: Vec<(EngineError, u16, &str, &str)> = vec![
            (
                EngineError::invalid(ErrorCode::CodeRequired, "Shell code is required"),
                400,
                "code_required",
                "Shell code is required",
            ),
            (
                EngineError::unavailable(
                    ErrorCode::CapabilityUnavailable,
                    "Scientific environments are unavailable",
                ),
                400,
                "capability_unavailable",
                "Scientific environments are unavailable",
            ),
            (EngineError::Duplicate, 409, "duplicate_execution", "Execution ID has already been used"),
            (
                EngineError::QueueFull { capacity: 3, retry_after_s: 1 },
                503,
                "queue_full",
                "Runner queue is full (3 executions admitted); retry shortly",
            ),
            (
                EngineError::Workspace(WriteError::Coordination(CoordError::Poisoned)),
                400,
                "workspace_poisoned",
                &poisoned,
            ),
            (EngineError::Workspace(WriteError::NoBaseline), 400, "no_baseline", &no_baseline),
            (
                EngineError::TimedOut { label: "Shell", ms: 5 },
                400,
                "execution_timeout",
                "Shell timed out after 5 ms",
            ),
            (EngineError::Aborted { label: "Python" }, 400, "execution_aborted", "Python aborted"),
            (EngineError::QuotaExceeded("q".into()), 400, "workspace_quota_exceeded", "q"),
            (EngineError::LaunchFailed("l".into()), 400, "sandbox_launch_failed", "l"),
            (EngineError::Unresponsive("u".into()), 400, "sandbox_unresponsive", "u"),
            (EngineError::CommitFailed("c".into()), 400, "version_commit_failed", "c"),
            (EngineError::internal("i"), 400, "internal", "i"),
        ];
        for (e, status, code, text) in cases {
            let shown = format!("{e:?}");
            let a = ApiError::from(e);
            assert_eq!((a.status, a.code, a.message.as_str()), (status, code, text), "{shown}");
            assert_eq!(a.retry_after.is_some(), status == 503, "{shown}");
        }
        let skill = crate::skills::SkillError::NotJson(serde_json::from_str::<u8>("x").unwrap_err());
        let code = skill.code().as_str();
        let chain = crate::error_chain(&skill);
        let a = ApiError::from(EngineError::Skill(skill));
        assert_eq!((a.status, a.code, a.message), (400, code, chain));
    }
}
