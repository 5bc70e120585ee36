//! Cross-process coordination of workspace writers, compatible with the API process
//! (versioning reference §6): the lifecycle registry's fences and per-root admission lock
//! (outer), then the writer lease with its `.active` and `.failed` markers (inner).
//!
//! Every lock is SQLite's own `BEGIN IMMEDIATE` (a POSIX fcntl lock through SQLite's unix
//! VFS), so Node holders in the API process and our holders exclude each other. Locks die
//! with their process; the markers do not, which is how an interrupted writer is noticed.

pub mod lease;
pub mod lifecycle;
mod sqlite_lock;
pub use sqlite_lock::enable_wal;

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

pub use lease::{Lease, LeasePaths};
pub use lifecycle::{Admitted, Lifecycle};

/// The lease's poison text (`.failed` content and the refusal).
pub const POISONED: &str = "Workspace version commit failed; repair storage before resuming writes";
/// The refusal while a crashed writer's `.active` marker remains.
pub const INTERRUPTED: &str = "Workspace has an interrupted operation; recover before resuming writes";
/// The `.active` marker's exact content (no trailing newline).
pub const ACTIVE_TEXT: &str = "Unfinished Workspace operation; verify processes and recover before resuming";
/// The admission refusal under a retirement fence (code `WORKSPACE_RETIRED`).
pub const RETIRED: &str = "Workspace is being deleted or has been deleted; no new writes are admitted";
/// Node's AbortError message, which the original surfaces for a cancelled wait.
pub const ABORTED: &str = "This operation was aborted";

#[derive(Debug, thiserror::Error)]
pub enum CoordError {
    #[error("{POISONED}")]
    Poisoned,
    #[error("{INTERRUPTED}")]
    Interrupted,
    #[error("{RETIRED}")]
    Retired,
    #[error("{ABORTED}")]
    Aborted,
    #[error("Could not use the workspace lock database {}: {source}", path.display())]
    Sqlite {
        path: PathBuf,
        #[source]
        source: rusqlite::Error,
    },
    #[error("Could not {what} {}: {source}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl CoordError {
    fn io(what: &'static str, path: &Path, source: std::io::Error) -> CoordError {
        CoordError::Io { what, path: path.to_owned(), source }
    }

    /// The original's error code, where it has one.
    pub fn code(&self) -> Option<&'static str> {
        matches!(self, CoordError::Retired).then_some("WORKSPACE_RETIRED")
    }
}

/// Lowercase hex SHA-256 of a path's UTF-8 text (Node hashes the path string; non-UTF-8
/// bytes are replaced like Node's decoder would).
pub fn path_hex(path: &Path) -> String {
    let text = path.to_string_lossy();
    let digest = Sha256::digest(text.as_bytes());
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// Creates `dir` (and parents) and makes `dir` itself 0700, as the original does for its
/// coordination and lifecycle directories.
fn private_dir(dir: &Path) -> Result<(), CoordError> {
    use std::os::unix::fs::DirBuilderExt;
    // Created 0700 (less umask); an existing directory keeps its mode, as in the original
    // (a data directory shared with the API process through its group must stay so).
    if let Err(e) = std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir) {
        return Err(CoordError::io("create the directory", dir, e));
    }
    let meta = std::fs::symlink_metadata(dir).map_err(|e| CoordError::io("inspect", dir, e))?;
    if !meta.is_dir() {
        return Err(CoordError::io(
            "use as a directory",
            dir,
            std::io::Error::other("it is not a directory (a symlink or file is in the way)"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_hex_matches_the_reference_vector() {
        assert_eq!(
            path_hex(Path::new("/srv/sd-data/remote-workspaces/project-1/session-1")),
            "a4a7686a94446f5d656e37e92ba1dcf4b0b00a48a1e588d6d5554ea53c5ea9f4"
        );
    }
}
