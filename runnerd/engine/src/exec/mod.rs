//! The execution path, in the original's order (contract §2A). The HTTP layer checks
//! `kernelMode`, the language and the field types and hands over a typed request; then the
//! workspace is found (`crate::workspace::locate`); the route accepts it (the synchronous
//! routes: [`prepare::admit`] — mounts, the bounded queue, the id's length, dedupe and blank,
//! the agent; the managed route: `crate::managed::Manager::start` — its id rules, the record,
//! the mounts) and [`prepare`] decides everything the sandbox needs; then both routes run
//! through the same [`engine::Execution`]: queue, writer lease, [`stage`] (owners, quota
//! pre-check, chips, skills, the environment lease), [`run`] (the sandbox through the
//! isolation backend, with quota watchdog, timeout and cancellation, then the quota
//! post-check), the version, the result. [`synchronous`] answers `/execute` and
//! `/execute-shell`.

pub mod admission;
mod audit;
pub mod backend;
pub mod dedupe;
pub mod engine;
pub mod network_mode;
pub mod outcome;
mod prepare;
pub mod registry;
pub mod request;
mod run;
mod stage;
pub mod stop;
mod synchronous;

use std::time::Duration;

use serde::Serialize;
use serde_json::Value;

pub use crate::code::{self, ErrorCode};
use crate::launch::OutputText;
use crate::sandbox::{Language, argv};
use common::seccomp::Profile;

pub use crate::error::{self, EngineError};
pub use crate::workspace::{Located, locate};
pub use audit::FinishAudit;
pub use outcome::{Outcome, RunOutcome};
pub use prepare::{Prepared, RunOptions, budgets, check_mounts, prepare};
use request::NetworkMode;
pub use run::run_sandbox;
pub use stop::{StopReason, StopToken};
pub use synchronous::execute;

/// Ours: ids are UUIDs in practice; anything longer than this is refused before it is kept.
pub const MAX_EXECUTION_ID: usize = 1024;

/// The error code of a sandbox that did not die: its caller keeps the workspace locked.
pub const UNRESPONSIVE: ErrorCode = ErrorCode::SandboxUnresponsive;

pub use crate::measure::QUOTA_POLL;

/// How often the quota is brought up to date from the change journal when no event comes.
pub const JOURNAL_TICK: Duration = Duration::from_secs(1);

/// An insertion-ordered string map (the env map is reported in injection order).
#[derive(Debug, Clone)]
pub struct OrderedMap(pub Vec<(String, String)>);

impl Serialize for OrderedMap {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            map.serialize_entry(k, v)?;
        }
        map.end()
    }
}

/// `ShellExecutionResult` / `PythonExecutionResult`, fields in the original's order.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ExecutionResult {
    pub exit_code: i32,
    /// The kept output, as the budget rendered it (no copy; see `runnerd::api::answer`).
    pub stdout: OutputText,
    pub stderr: OutputText,
    pub cgroup_mode: &'static str,
    pub created_files: Vec<String>,
    pub modified_files: Vec<String>,
    pub environment_revision_id: String,
    pub environment_variables: OrderedMap,
    pub execution_id: String,
    pub finished_at: String,
    pub kernel_id: String,
    pub kernel_mode: &'static str,
    pub language: &'static str,
    pub network_access_revision: String,
    pub network_policy: NetworkMode,
    pub runner_version: &'static str,
    pub sandbox: &'static str,
    pub started_at: String,
    pub working_directory: String,
    /// Ours (issue #8): how the run ended and what it used; see `crate::limits::outcome_fields`.
    #[serde(flatten)]
    pub limits: crate::limits::ResultFields,
    /// The committed WorkspaceTree ref after the run (appended last, like the original).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workspace_snapshot: Option<Value>,
}

pub fn language_name(l: Language) -> &'static str {
    match l {
        Language::Shell => "shell",
        Language::Python => "python",
        Language::R => "r",
    }
}

/// The seccomp profile a request's sandbox runs under: `network` for a domain-allowlist
/// policy (the bridge needs its sockets), else `baseline`. The same rule as `argv::build`
/// (a domain-allowlist run without a gateway never starts), known before the sandbox is.
/// With Ascend chips and no network, `npu` (internals §4.4).
pub fn profile_for(network_mode: &NetworkMode, ascend: bool) -> Profile {
    argv::profile(*network_mode == NetworkMode::DomainAllowlist, ascend)
}

/// Completes when the client is gone; never, if its handle is simply dropped.
pub async fn gone(client_gone: &mut tokio::sync::watch::Receiver<bool>) {
    if client_gone.wait_for(|g| *g).await.is_err() {
        std::future::pending::<()>().await;
    }
}
