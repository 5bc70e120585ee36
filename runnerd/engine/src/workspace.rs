//! Workspace resolution for the engine and the API: [`runner_store::workspace`]'s functions,
//! each refusal an [`EngineError`] with its stable code and the store's text
//! (`EngineError::from(WorkspaceError)`), as the callers answer it.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use crate::app::App;
use crate::code::ErrorCode;
use crate::error::EngineError;
use crate::sandbox::user::Identity;
use runner_store::workspace as store;

pub use runner_store::workspace::{PROJECTS, REMOTE_WORKSPACES, WorkspaceError};

/// Where the request says its workspace is (resolved by the engine, contract §2A step 4).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkspaceRef {
    /// `runnerWorkspaceKey`, when non-empty: it wins and drops `readOnlyWorkspaceRoot`.
    pub key: Option<String>,
    pub root: Option<String>,
    /// `readOnlyWorkspaceRoot`, when non-blank.
    pub read_only: Option<String>,
}

/// The workspace a request runs in, resolved beneath the data directory (step 4).
#[derive(Debug, Clone)]
pub struct Located {
    pub root: PathBuf,
    pub read_only: Option<PathBuf>,
}

/// Workspace resolution (step 4): a `runnerWorkspaceKey` wins and drops
/// `readOnlyWorkspaceRoot`; otherwise `workspaceRoot` must be inside the roots.
pub fn locate(app: &App, ws: &WorkspaceRef) -> Result<Located, EngineError> {
    let data = &app.data_dir;
    if let Some(key) = &ws.key {
        let root = ensure_remote_workspace(data, key, &app.sandbox.user)?;
        return Ok(Located { root: validated_workspace(data, &root)?, read_only: None });
    }
    let root = ws.root.as_deref().ok_or_else(|| {
        EngineError::invalid(ErrorCode::WorkspaceRequired, "workspaceRoot or runnerWorkspaceKey is required")
    })?;
    let root = validated_workspace(data, Path::new(root)).inspect_err(|_| {
        // Whatever waits for this path (a sandbox started ahead) mounts what is no longer a
        // workspace there: a directory swapped for a link, or gone.
        // Exactly this path: a refused path must not reach other workspaces' sandboxes.
        let scope = crate::isolation::prestart::Scope::Exactly(Path::new(root));
        app.sandbox.forget(scope, crate::isolation::prestart::Discard::Workspace);
    })?;
    let read_only = match &ws.read_only {
        Some(p) => Some(validated_workspace(data, Path::new(p))?),
        None => None,
    };
    Ok(Located { root, read_only })
}

/// [`store::ensure_remote_workspace`]: what it creates belongs to the sandbox user (`owner`).
pub fn ensure_remote_workspace(data_dir: &Path, key: &str, owner: &Identity) -> Result<PathBuf, EngineError> {
    Ok(store::ensure_remote_workspace(data_dir, key, owner)?)
}

/// [`store::ensure_project_workspace`]: what it creates belongs to the sandbox user (`owner`).
pub fn ensure_project_workspace(
    data_dir: &Path,
    path: &str,
    owner: &Identity,
) -> Result<PathBuf, EngineError> {
    Ok(store::ensure_project_workspace(data_dir, path, owner)?)
}

/// [`store::validated_workspace`].
pub fn validated_workspace(data_dir: &Path, path: &Path) -> Result<PathBuf, EngineError> {
    Ok(store::validated_workspace(data_dir, path)?)
}

/// [`store::resolve_cwd`].
pub fn resolve_cwd(data_dir: &Path, root: &Path, cwd: &str) -> Result<String, EngineError> {
    Ok(store::resolve_cwd(data_dir, root, cwd)?)
}

/// [`store::check_cwd_text`].
pub fn check_cwd_text(cwd: &str) -> Result<(), EngineError> {
    Ok(store::check_cwd_text(cwd)?)
}

/// [`store::open_beneath`].
pub fn open_beneath(data_dir: &Path, path: &Path) -> Result<OwnedFd, EngineError> {
    Ok(store::open_beneath(data_dir, path)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each refusal's code and text as the API answers them (the store's tests check which
    /// refusal each case gets).
    #[test]
    fn refusals_keep_their_codes_and_texts() {
        let io = || std::io::Error::from_raw_os_error(libc::EACCES);
        let denied = io().to_string();
        let cases = [
            (WorkspaceError::InvalidKey, "invalid_workspace_key", "Invalid remote workspace key".to_owned()),
            (
                WorkspaceError::KeySymlink,
                "workspace_symlink",
                "Remote workspace path must not contain symbolic links".to_owned(),
            ),
            (
                WorkspaceError::Reserved(".workspace-coordination"),
                "reserved_workspace_name",
                "\".workspace-coordination\" is reserved for runner coordination files and cannot name a workspace or a part of one".to_owned(),
            ),
            (
                WorkspaceError::Realpath { shown: "missing/x".into(), error: io() },
                "path_not_found",
                "EACCES: permission denied, realpath 'missing/x'".to_owned(),
            ),
            (
                WorkspaceError::DataDirUnavailable(io()),
                "data_dir_unavailable",
                format!("The runner data directory is unavailable: {denied}"),
            ),
            (
                WorkspaceError::Create { what: "'k'".into(), source: io() },
                "workspace_create_failed",
                format!("Could not create remote workspace directory 'k': {denied}"),
            ),
            (
                WorkspaceError::HandOver { shown: "k/s".into(), source: io() },
                "workspace_create_failed",
                format!("Could not hand remote workspace directory 'k/s' to the sandbox user: {denied}"),
            ),
            (WorkspaceError::OutsideRoots, "workspace_outside_roots", runner_store::workspace::OUTSIDE_ROOTS.into()),
            (WorkspaceError::IsARoot, "workspace_is_root", runner_store::workspace::IS_A_ROOT.into()),
            (WorkspaceError::Symlink, "workspace_symlink", runner_store::workspace::WORKSPACE_SYMLINK.into()),
            (WorkspaceError::NotDirectory, "workspace_not_directory", "Runner workspace must be a directory".into()),
            (
                WorkspaceError::Changed,
                "workspace_symlink",
                "Runner workspace changed under it: a path component is now a symbolic link or missing".into(),
            ),
            (WorkspaceError::CwdAbsolute, "invalid_cwd", "cwd must be workspace-relative".into()),
            (WorkspaceError::CwdOutside, "invalid_cwd", "cwd must remain inside the writable workspace".into()),
            (WorkspaceError::CwdSymlink, "invalid_cwd", "cwd must not contain symbolic links".into()),
            (WorkspaceError::CwdNotDirectory, "invalid_cwd", "cwd must be a directory".into()),
        ];
        for (refused, code, text) in cases {
            assert!(!common::repeats_its_source(&refused), "{refused}");
            let answered = EngineError::from(refused);
            assert_eq!((answered.code().as_str(), answered.to_string()), (code, text));
        }
    }
}
