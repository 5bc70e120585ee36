//! The execution request the engine runs (contract §2A): [`ExecRequest`], the body read
//! once into typed fields by the HTTP layer (`runnerd::api::request`). What the contract checks
//! after the route-level checks (blank ids, code, the network policy …) the engine checks in
//! its order on these fields; the JSON is not consulted again.

use serde_json::Value;

use super::code::ErrorCode;
use super::error::EngineError;
pub use super::network_mode::NetworkMode;
use crate::sandbox::Language;
pub use crate::workspace::WorkspaceRef;

/// Which route asked: its language and error labels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    ExecuteShell,
    Execute,
    /// `POST /shell-executions`: an `/execute-shell` body, validated before it is queued.
    ShellExecutions,
}

impl Route {
    /// The route's path without its slash (a metrics label).
    pub fn name(self) -> &'static str {
        match self {
            Route::ExecuteShell => "execute-shell",
            Route::Execute => "execute",
            Route::ShellExecutions => "shell-executions",
        }
    }
}

/// The text for blank (or, ours, non-string) code.
pub fn code_required(language: Language) -> &'static str {
    match language {
        Language::Shell => "Shell code is required",
        Language::Python => "Python code is required",
        Language::R => "R code is required",
    }
}

pub fn mounts_text(language: Language) -> &'static str {
    match language {
        Language::Shell => "Shell execution accepts exactly one read-write workspace mount",
        Language::Python | Language::R => "M1 runner accepts exactly one read-write workspace mount",
    }
}

/// The network access a request's permission epoch grants (contract §2A "Network policy"):
/// `networkAccess` only if its mode equals `networkPolicy`, else none.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NetworkAccess {
    pub mode: NetworkMode,
    pub revision: String,
    /// Strings only; anything else in the array is dropped (egressd skips entries that do
    /// not parse, as the original's matcher does).
    pub allowed_domains: Vec<String>,
    pub allow_private_network: bool,
}

impl NetworkAccess {
    pub fn none() -> NetworkAccess {
        NetworkAccess { mode: "none".into(), revision: "none".into(), ..NetworkAccess::default() }
    }
}

/// An execution request read once, after the route-level checks (`runnerd::api::request::parse`): typed fields,
/// the JSON dropped. Semantic checks that the contract orders after the workspace and the
/// admission (blank ids, code, the network policy …) are the engine's, on these fields.
#[derive(Debug)]
pub struct ExecRequest {
    pub route: Route,
    pub language: Language,
    pub workspace: WorkspaceRef,
    /// `permissionEpoch.mounts` is exactly one read-write workspace mount.
    pub single_workspace_mount: bool,
    /// As sent (`""` when absent).
    pub execution_id: String,
    pub session_id: String,
    pub agent_id: String,
    pub code: String,
    /// Shell: `environmentId`, when non-blank.
    pub environment_id: Option<String>,
    /// Python and R: `environmentRevisionId`, when non-blank.
    pub environment_revision_id: Option<String>,
    /// `permissionEpoch.environmentRevisionId`.
    pub epoch_environment_revision_id: Option<String>,
    pub network: NetworkAccess,
    pub egress_proxy: Option<Value>,
    pub npu_devices: Option<Value>,
    pub gpu_devices: Option<Value>,
    /// `skillPackagesRoot`, when non-empty.
    pub skill_packages_root: Option<String>,
    /// The three limits, already range-checked by the HTTP layer (`runnerd::api::request::check_fields`); `None` = the default.
    pub execution_timeout_ms: Option<u64>,
    pub max_output_bytes: Option<u64>,
    pub max_workspace_bytes: Option<u64>,
    /// Shell: `cwd`, when non-empty.
    pub cwd: Option<String>,
    pub resource_limits: Option<Value>,
    /// Ours (issue #36): `isolation`, the backend this execution asks for.
    pub isolation: Option<String>,
}

/// The contract's text when the mounts are not exactly one read-write workspace mount.
pub fn mounts_error(language: Language) -> EngineError {
    EngineError::invalid(ErrorCode::InvalidMounts, mounts_text(language))
}
