//! Revision prefixes on disk: made for the sandbox user, removed without following links,
//! swept when no environment names them.

use std::path::{Path, PathBuf};

use crate::app::App;
use crate::envs::catalog::{self, Catalog};

use super::{EnvStore, StoreError, open_dir};

impl EnvStore {
    fn prefix_path(&self, env: &str, rev: &str) -> PathBuf {
        self.root.join(common::layout::ENV_REVISIONS).join(env).join(rev)
    }

    /// An empty prefix directory the sandbox user may write (its parents are runnerd's).
    pub(super) fn fresh_prefix(&self, app: &App, env_id: &str, rev: &str) -> Result<PathBuf, StoreError> {
        let prefix = self.prefix_path(env_id, rev);
        let io = |source| StoreError::Io { path: prefix.clone(), source };
        let env_dir = catalog::ensure_env_dir(&open_dir(&self.root)?, env_id)?;
        let name =
            std::ffi::CString::new(rev).map_err(|_| io(std::io::Error::from_raw_os_error(libc::EINVAL)))?;
        crate::fsat::mkdir_at(&env_dir, &name, 0o755).map_err(io)?;
        let fd = crate::fsat::open_at(&env_dir, &name, libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW)
            .map_err(io)?;
        app.sandbox.user.hand_over(std::os::fd::AsFd::as_fd(&fd)).map_err(io)?;
        Ok(prefix)
    }
}

/// Removes a prefix (or an environment's revisions directory), never following a link.
pub(super) fn remove_prefix(path: &Path) -> std::io::Result<()> {
    let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else { return Ok(()) };
    let dir = crate::fsat::open_path(parent, libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW)?;
    let name = std::ffi::CString::new(std::os::unix::ffi::OsStrExt::as_bytes(name))
        .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    match crate::fsat::remove_tree_at(&dir, &name) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        r => r,
    }
}

/// Removes every `revisions/<env>/<rev>/` that no environment's prefix is (a create that a
/// crash interrupted, a delete that stopped half way); revision records and snapshots are
/// elsewhere and stay. Links are removed, never followed. Returns how many went.
pub(super) fn sweep_orphan_prefixes(revisions: &Path, catalog: &Catalog) -> usize {
    let live: std::collections::HashSet<(String, String)> =
        catalog.environments.iter().map(|e| (e.id.clone(), e.runtime_revision().to_owned())).collect();
    let Ok(top) = crate::fsat::open_path(revisions, libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW)
    else {
        return 0;
    };
    let mut swept = 0;
    for (env, env_c) in crate::fsat::names(&top).unwrap_or_default() {
        let env = env.to_string_lossy().into_owned();
        let keep_env = live.iter().any(|(e, _)| *e == env);
        let Ok(env_dir) = crate::fsat::open_dir_at(&top, &env_c) else {
            // Not a directory (or a link): nothing the store made.
            if crate::fsat::unlink_at(&top, &env_c).is_ok() {
                swept += 1;
            }
            continue;
        };
        for (rev, rev_c) in crate::fsat::names(&env_dir).unwrap_or_default() {
            let rev = rev.to_string_lossy().into_owned();
            if keep_env && live.contains(&(env.clone(), rev)) {
                continue;
            }
            if crate::fsat::remove_tree_at(&env_dir, &rev_c).is_ok() {
                swept += 1;
            }
        }
        if !keep_env {
            let _ = crate::fsat::rmdir_at(&top, &env_c);
        }
    }
    swept
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_no_environment_names_are_swept_and_live_ones_kept() {
        let dir = tempfile::tempdir().unwrap();
        let revisions = dir.path().join("revisions");
        for p in ["task-a/rev-1/bin", "task-a/rev-2", "task-gone/rev-3", "starter-python/rev-4"] {
            std::fs::create_dir_all(revisions.join(p)).unwrap();
        }
        let outside = dir.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        std::fs::write(outside.join("keep"), b"x").unwrap();
        std::os::unix::fs::symlink(&outside, revisions.join("task-a/rev-link")).unwrap();
        let mut catalog = Catalog::default();
        for (id, rev) in [("task-a", "rev-1"), ("starter-python", "rev-4")] {
            let mut e = catalog::tests::environment(id, rev);
            e.runtime_revision_id = Some(rev.to_owned());
            catalog.environments.push(e);
        }
        assert_eq!(sweep_orphan_prefixes(&revisions, &catalog), 3);
        assert!(revisions.join("task-a/rev-1/bin").is_dir());
        assert!(revisions.join("starter-python/rev-4").is_dir());
        assert!(!revisions.join("task-a/rev-2").exists() && !revisions.join("task-gone").exists());
        assert!(outside.join("keep").exists(), "a link is removed, not followed");
        assert_eq!(sweep_orphan_prefixes(&revisions, &catalog), 0);
    }
}
