//! Why the engine did not run a request, or why a run failed: the engine's own error, with
//! no HTTP in it. The HTTP layer's `runnerd::api::error` maps each variant to the contract's status, our stable
//! `code` and the text, in one table (`ApiError::from(EngineError)`).

use crate::code::ErrorCode;
use crate::coordination::CoordError;
use crate::workspace::WorkspaceError;
use crate::writer::WriteError;

/// The code of a refused or failed workspace write.
pub fn workspace_code(e: &WriteError) -> ErrorCode {
    match e {
        WriteError::Coordination(CoordError::Retired) => ErrorCode::WorkspaceRetired,
        WriteError::Coordination(CoordError::Interrupted) => ErrorCode::WorkspaceInterrupted,
        WriteError::Coordination(CoordError::Poisoned) => ErrorCode::WorkspacePoisoned,
        WriteError::NoBaseline => ErrorCode::NoBaseline,
        _ => ErrorCode::WorkspaceVersionFailed,
    }
}

/// The code of a refused workspace, remote workspace key or `cwd`.
pub fn refusal_code(e: &WorkspaceError) -> ErrorCode {
    match e {
        WorkspaceError::InvalidKey => ErrorCode::InvalidWorkspaceKey,
        WorkspaceError::KeySymlink | WorkspaceError::Symlink | WorkspaceError::Changed => {
            ErrorCode::WorkspaceSymlink
        }
        WorkspaceError::Reserved(_) => ErrorCode::ReservedWorkspaceName,
        WorkspaceError::Realpath { .. } => ErrorCode::PathNotFound,
        WorkspaceError::DataDirUnavailable(_) => ErrorCode::DataDirUnavailable,
        WorkspaceError::Create { .. } | WorkspaceError::HandOver { .. } => ErrorCode::WorkspaceCreateFailed,
        WorkspaceError::OutsideRoots => ErrorCode::WorkspaceOutsideRoots,
        WorkspaceError::IsARoot => ErrorCode::WorkspaceIsRoot,
        WorkspaceError::NotDirectory => ErrorCode::WorkspaceNotDirectory,
        WorkspaceError::CwdAbsolute
        | WorkspaceError::CwdOutside
        | WorkspaceError::CwdSymlink
        | WorkspaceError::CwdNotDirectory => ErrorCode::InvalidCwd,
    }
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The request, as sent, cannot run (a contract validation failure). `code` is the stable
    /// machine-readable name of the rule (api.md improvement 1); the text is the contract's.
    #[error("{message}")]
    Invalid { code: ErrorCode, message: String },
    /// This host lacks something the request needs (a capability, the sandbox, egress, a chip);
    /// nothing was run.
    #[error("{message}")]
    Unavailable { code: ErrorCode, message: String },
    /// The execution id was used within the dedupe window.
    #[error("Execution ID has already been used")]
    Duplicate,
    /// The bounded admission queue is full; a retry after `retry_after_s` may succeed.
    #[error("Runner queue is full ({capacity} executions admitted); retry shortly")]
    QueueFull { capacity: usize, retry_after_s: u64 },
    /// The workspace refused a writer (retired, interrupted, poisoned, no baseline, storage).
    #[error(transparent)]
    Workspace(WriteError),
    /// A skill package could not be found, verified or mounted. Its text is the whole chain
    /// of causes (the answer's and the managed record's), so the cause is not a `source`.
    #[error("{}", crate::error_chain(.0))]
    Skill(crate::skills::SkillError),
    /// The run passed its `executionTimeoutMs`.
    #[error("{label} timed out after {ms} ms")]
    TimedOut { label: &'static str, ms: u64 },
    /// The caller went away (or cancelled) before or while the run ran.
    #[error("{label} aborted")]
    Aborted { label: &'static str },
    /// The workspace outgrew `maxWorkspaceBytes` (the text names the measurement).
    #[error("{0}")]
    QuotaExceeded(String),
    /// The sandbox could not be started; nothing ran.
    #[error("{0}")]
    LaunchFailed(String),
    /// A sandbox that would not die: its workspace stays locked (fail closed).
    #[error("{0}")]
    Unresponsive(String),
    /// The run ended but its workspace version could not be recorded.
    #[error("{0}")]
    CommitFailed(String),
    /// A failure of runnerd itself (a descriptor it could not duplicate, say).
    #[error("{0}")]
    Internal(String),
}

/// A refused workspace is an invalid request: its code, and its text with the cause.
impl From<WorkspaceError> for EngineError {
    fn from(e: WorkspaceError) -> EngineError {
        EngineError::invalid(refusal_code(&e), crate::error_chain(&e))
    }
}

impl EngineError {
    pub fn invalid(code: ErrorCode, message: impl Into<String>) -> EngineError {
        EngineError::Invalid { code, message: message.into() }
    }

    pub fn unavailable(code: ErrorCode, message: impl Into<String>) -> EngineError {
        EngineError::Unavailable { code, message: message.into() }
    }

    pub fn internal(e: impl std::fmt::Display) -> EngineError {
        EngineError::Internal(e.to_string())
    }

    /// The stable machine-readable name of the failure: the answer's `code` (api.md
    /// improvement 1), the audit's outcome and the metrics' label.
    pub fn code(&self) -> ErrorCode {
        match self {
            EngineError::Invalid { code, .. } | EngineError::Unavailable { code, .. } => *code,
            EngineError::Duplicate => ErrorCode::DuplicateExecution,
            EngineError::QueueFull { .. } => ErrorCode::QueueFull,
            EngineError::Workspace(w) => workspace_code(w),
            EngineError::Skill(s) => s.code(),
            EngineError::TimedOut { .. } => ErrorCode::ExecutionTimeout,
            EngineError::Aborted { .. } => ErrorCode::ExecutionAborted,
            EngineError::QuotaExceeded(_) => ErrorCode::WorkspaceQuotaExceeded,
            EngineError::LaunchFailed(_) => ErrorCode::SandboxLaunchFailed,
            EngineError::Unresponsive(_) => ErrorCode::SandboxUnresponsive,
            EngineError::CommitFailed(_) => ErrorCode::VersionCommitFailed,
            EngineError::Internal(_) => ErrorCode::Internal,
        }
    }

    /// Whether the sandbox may still be running: the caller keeps the workspace locked.
    pub fn is_unresponsive(&self) -> bool {
        matches!(self, EngineError::Unresponsive(_))
    }
}
