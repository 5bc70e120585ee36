//! Skill packages (R-WS-3, contract §5.2 and §2A): frozen, content-addressed bundles of an
//! agent's skills, published by `POST /skill-packages`, checked by `GET
//! /skill-packages/:id`, and mounted read-only at `/skills` in an execution that names one
//! as `skillPackagesRoot`, with the workspace's `.sciencediscovery/skill-extensions`
//! writable at `/skill-extensions`.
//!
//! * [`bundle`]: the pure checks, ids and hashes.
//! * [`store`]: publication, verification and removal on disk, by descriptor.
//! * [`in_use`]: which packages executions hold, so that one is deleted only when none does.
//!
//! Ours, stricter than the original: `skillPackagesRoot` must name a published package
//! (`<dataDir>/projects/.skill-packages/<id>`, no symlink on the way), which is verified in
//! full right before it is mounted, and mounted from the descriptor that was verified; the
//! packages directory is never a workspace (a reserved name in `runner_store::workspace`).

pub mod bundle;
pub mod in_use;
pub mod store;

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Component, Path, PathBuf};

use serde_json::Value;

use crate::code::ErrorCode;
use crate::fsat;
use crate::sandbox::user::Identity;

/// The original's body limit for `POST /skill-packages` (64 MiB).
pub const BODY_LIMIT: usize = 67_108_864;
/// `<workspace>/.sciencediscovery/skill-extensions`.
pub const EXTENSIONS_PARENT: &CStr = c".sciencediscovery";
pub const EXTENSIONS_DIR: &CStr = c"skill-extensions";

#[derive(Debug, thiserror::Error)]
pub enum SkillError {
    #[error("Skill package bundle is not valid JSON")]
    NotJson(#[source] serde_json::Error),
    #[error(transparent)]
    Bundle(#[from] bundle::BundleError),
    #[error(transparent)]
    Store(#[from] store::StoreError),
    #[error(
        "skillPackagesRoot must be the root of a published skill package (<dataDir>/projects/.skill-packages/<id>, as POST /skill-packages answered)"
    )]
    RootInvalid,
    #[error(
        "The sandbox user cannot reach the skill package: {} (mode {mode:o}) is not searchable by it; nothing was run",
        path.display()
    )]
    Unreachable { path: PathBuf, mode: u32 },
    #[error("Skill package {0} is not published on this runner")]
    NotPublished(String),
    #[error(
        "Skill package {id} is mounted by {executions} execution(s), queued or running; nothing was deleted: delete it once they have ended"
    )]
    InUse { id: String, executions: usize },
    #[error("The workspace's .sciencediscovery/skill-extensions directory could not be prepared")]
    Extensions(#[source] io::Error),
    #[error(
        "The workspace's .sciencediscovery/skill-extensions path must be a real directory, not a symbolic link or a file"
    )]
    ExtensionsNotDirectory,
}

impl SkillError {
    /// A stable code for the HTTP layer (one of the engine's: an execution's skill package
    /// fails with it too).
    pub fn code(&self) -> ErrorCode {
        match self {
            SkillError::NotJson(_) => ErrorCode::InvalidJson,
            SkillError::Bundle(bundle::BundleError::Metadata(_)) => ErrorCode::SkillMetadataInvalid,
            SkillError::Bundle(bundle::BundleError::Path { .. }) => ErrorCode::SkillPathInvalid,
            SkillError::Bundle(bundle::BundleError::Integrity(_)) => ErrorCode::SkillIntegrityFailed,
            SkillError::Bundle(bundle::BundleError::MissingSkillMd(_)) => ErrorCode::SkillMdMissing,
            SkillError::Store(store::StoreError::Io { .. }) => ErrorCode::SkillStoreUnavailable,
            SkillError::Store(_) => ErrorCode::SkillIntegrityFailed,
            SkillError::RootInvalid => ErrorCode::SkillRootInvalid,
            SkillError::NotPublished(_) => ErrorCode::SkillNotPublished,
            SkillError::InUse { .. } => ErrorCode::SkillPackageInUse,
            SkillError::Unreachable { .. } => ErrorCode::SkillUnreachable,
            SkillError::Extensions(_) | SkillError::ExtensionsNotDirectory => {
                ErrorCode::SkillExtensionsUnavailable
            }
        }
    }
}

/// `POST /skill-packages`: checks the bundle, publishes it (idempotent), returns
/// `(id, root)`. Blocking I/O: callers run it off the async threads.
pub fn publish(data_dir: &Path, body: &[u8]) -> Result<(String, PathBuf), SkillError> {
    let value: Value = serde_json::from_slice(body).map_err(SkillError::NotJson)?;
    let checked = bundle::parse(&value, bundle::Content::Inline)?;
    let id = bundle::bundle_id(&checked.skills);
    let root = store::publish(data_dir, &checked)?;
    Ok((id, root))
}

/// `GET /skill-packages/:id`: the verified root, `None` when absent.
pub fn lookup(data_dir: &Path, id: &str) -> Result<Option<PathBuf>, SkillError> {
    Ok(store::lookup(data_dir, id)?.map(|(root, _)| root))
}

/// `DELETE /skill-packages/:id` (ours): withdraws the package unless an execution holds it
/// (then [`SkillError::InUse`], nothing changed), and removes it; [`SkillError::NotPublished`]
/// when there is none. Blocking I/O: callers run it off the async threads.
pub fn delete(data_dir: &Path, in_use: &in_use::InUse, id: &str) -> Result<(), SkillError> {
    let withdrawn = in_use
        .unless_held(id, || store::withdraw(data_dir, id))
        .map_err(|executions| SkillError::InUse { id: id.to_owned(), executions })??
        .ok_or_else(|| SkillError::NotPublished(id.to_owned()))?;
    // Withdrawn is deleted as far as every caller can tell: a removal that fails here is
    // logged, and the next start-up removes what is left.
    if let Err(e) = store::discard(withdrawn) {
        tracing::warn!(event = "skill_package_discard_failed", id, error = %crate::error_chain(&e),
            detail = "the package is withdrawn; the next start-up removes what is left");
    }
    Ok(())
}

/// A request's `skillPackagesRoot`, resolved (not yet verified).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Requested {
    pub id: String,
}

/// The pure resolution of `skillPackagesRoot`: an absolute path that names
/// `projects/.skill-packages/<64 hex>` below the data directory, spelled from its canonical
/// path (`data_real`) or as configured (`data_dir`). Nothing else (no `..`, no `.`).
pub fn resolve_root(data_dir: &Path, data_real: &Path, root: &Path) -> Result<Requested, SkillError> {
    let rest = [data_real, data_dir]
        .into_iter()
        .filter(|d| d.is_absolute())
        .find_map(|d| root.strip_prefix(d).ok())
        .ok_or(SkillError::RootInvalid)?;
    let names: Vec<&str> = rest
        .components()
        .map(|c| match c {
            Component::Normal(n) => n.to_str().ok_or(SkillError::RootInvalid),
            _ => Err(SkillError::RootInvalid),
        })
        .collect::<Result<_, _>>()?;
    match names.as_slice() {
        [projects, packages, id]
            if *projects == crate::workspace::PROJECTS
                && *packages == store::PACKAGES_DIR
                && bundle::is_hex64(id) =>
        {
            Ok(Requested { id: (*id).to_owned() })
        }
        _ => Err(SkillError::RootInvalid),
    }
}

/// `skillPackagesRoot` of a request, when set (JavaScript-truthy).
pub fn requested(data_dir: &Path, value: &Value) -> Result<Requested, SkillError> {
    let text = value.as_str().ok_or(SkillError::RootInvalid)?;
    let data_real = std::fs::canonicalize(data_dir).unwrap_or_else(|_| data_dir.to_owned());
    resolve_root(data_dir, &data_real, Path::new(text))
}

/// What an execution with skills mounts: the verified package and the extensions
/// directory, each as the descriptor that was checked, with their host paths.
#[derive(Debug)]
pub struct Mount {
    pub packages: OwnedFd,
    pub packages_path: PathBuf,
    pub extensions: OwnedFd,
    pub extensions_path: PathBuf,
}

/// Right before the launch: verifies the package again, in full, and opens (creating when
/// missing, handed to the sandbox user) `<workspace>/.sciencediscovery/skill-extensions`
/// below the pinned workspace descriptor, with no symlink followed. In a workspace mounted
/// idmapped (`idmapped`: its owner, issue #30) the directories are made owned like it
/// instead: the sandbox reaches them through the workspace's map, which shows that owner's
/// files as the sandbox user's.
pub fn prepare_mount(
    data_dir: &Path,
    req: &Requested,
    workspace_fd: &OwnedFd,
    workspace_path: &Path,
    owner: &Identity,
    idmapped: Option<common::plan::IdPair>,
) -> Result<Mount, SkillError> {
    let (packages_path, packages) =
        store::lookup(data_dir, &req.id)?.ok_or_else(|| SkillError::NotPublished(req.id.clone()))?;
    // bwrap resolves even a descriptor bind by its path, as the sandbox user: say so
    // plainly rather than let bwrap fail on `/proc/self/fd/N`.
    if let Some((path, mode)) = crate::sandbox::user::unreachable_component(owner, &packages_path) {
        return Err(SkillError::Unreachable { path, mode });
    }
    let parent = ensure_dir(workspace_fd, EXTENSIONS_PARENT, owner, idmapped)?;
    let extensions = ensure_dir(&parent, EXTENSIONS_DIR, owner, idmapped)?;
    let extensions_path = workspace_path.join(".sciencediscovery").join("skill-extensions");
    Ok(Mount { packages, packages_path, extensions, extensions_path })
}

fn ensure_dir(
    dir: &OwnedFd,
    name: &CStr,
    owner: &Identity,
    idmapped: Option<common::plan::IdPair>,
) -> Result<OwnedFd, SkillError> {
    let created = match fsat::mkdir_at(dir, name, 0o755) {
        Ok(()) => true,
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => false,
        Err(e) => return Err(SkillError::Extensions(e)),
    };
    let fd = match fsat::open_at(dir, name, libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW) {
        Ok(fd) => fd,
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTDIR | libc::ELOOP)) => {
            return Err(SkillError::ExtensionsNotDirectory);
        }
        Err(e) => return Err(SkillError::Extensions(e)),
    };
    if created {
        match idmapped {
            Some(ids) => owner.hand_over_to(fd.as_fd(), ids.uid, ids.gid),
            None => owner.hand_over(fd.as_fd()),
        }
        .map_err(SkillError::Extensions)?;
    }
    Ok(fd)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skill_root_table() {
        let id = "a".repeat(64);
        let data = Path::new("/srv/data");
        let real = Path::new("/real/data");
        let ok = [
            format!("/srv/data/projects/.skill-packages/{id}"),
            format!("/real/data/projects/.skill-packages/{id}"),
            format!("/real/data/projects/.skill-packages/{id}/"),
        ];
        for p in ok {
            assert_eq!(resolve_root(data, real, Path::new(&p)).unwrap().id, id, "{p}");
        }
        let bad = [
            format!("/srv/data/projects/.skill-packages/{}", "A".repeat(64)),
            "/srv/data/projects/.skill-packages/abc".to_owned(),
            format!("/srv/data/projects/x/../.skill-packages/{id}"),
            format!("/srv/data/remote-workspaces/.skill-packages/{id}"),
            format!("/srv/data/projects/.skill-packages/{id}/demo"),
            format!("/elsewhere/projects/.skill-packages/{id}"),
            format!("srv/data/projects/.skill-packages/{id}"),
            "/srv/data/projects/.skill-packages".to_owned(),
        ];
        for p in bad {
            assert!(resolve_root(data, real, Path::new(&p)).is_err(), "{p}");
        }
    }
}
