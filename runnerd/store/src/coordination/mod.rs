//! Cross-process coordination of workspace writers, compatible with the API process
//! (versioning reference §6): the lifecycle registry's fences and per-root admission lock
//! (outer), then the writer lease with its `.active` and `.failed` markers (inner).
//!
//! Every lock is SQLite's own `BEGIN IMMEDIATE` (a POSIX fcntl lock through SQLite's unix
//! VFS), so Node holders in the API process and our holders exclude each other. Locks die
//! with their process; the markers do not, which is how an interrupted writer is noticed.
//!
//! A workspace's lease files live in its *parent*, so the sandbox of the enclosing workspace
//! can write them: nothing there is ever followed. The directory is reached from the data
//! directory one `O_NOFOLLOW` component at a time and opened `O_DIRECTORY | O_NOFOLLOW`;
//! every marker operation is `openat`/`fstatat`/`unlinkat` relative to it (`O_EXCL` where
//! new), and SQLite opens the lock database through that descriptor ([`vfs`]). A symlink,
//! FIFO or other planted entry fails the write closed with an error naming the entry
//! relative to the workspace's parent (never a host path).

pub mod lease;
pub mod lifecycle;
mod sqlite_lock;
mod vfs;
pub use sqlite_lock::enable_wal;

use std::ffi::CString;
use std::os::fd::OwnedFd;
use std::path::{Component, Path};

use crate::fsat::{self, Stat};

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
    #[error("Could not use the workspace lock database {name}")]
    Sqlite {
        /// Relative to the workspace's parent (or the data directory): never a host path.
        name: String,
        #[source]
        source: rusqlite::Error,
    },
    #[error("Could not {what} {name}")]
    Io {
        what: &'static str,
        name: String,
        #[source]
        source: std::io::Error,
    },
    /// Something other than what runnerd and the API process create stands at a coordination
    /// path; it is not followed, and writes to the workspace stay refused until it is removed.
    #[error(
        "Refusing the workspace coordination entry {name}: it is {found}, not {expected}; nothing was followed"
    )]
    Planted { name: String, found: &'static str, expected: &'static str },
    #[error("Workspace is not beneath the runner data directory")]
    NotBeneath,
}

impl CoordError {
    fn io(what: &'static str, name: &str, source: std::io::Error) -> CoordError {
        CoordError::Io { what, name: name.to_owned(), source }
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

/// Creates `dir` (and parents) 0700, as the original does for its lifecycle directory
/// and the lease journal (both in the data directory, where no sandbox writes).
fn private_dir(dir: &Path) -> Result<(), CoordError> {
    use std::os::unix::fs::DirBuilderExt;
    let shown = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    // Created 0700 (less umask); an existing directory keeps its mode, as in the original
    // (a data directory shared with the API process through its group must stay so).
    if let Err(e) = std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir) {
        return Err(CoordError::io("create the directory", &shown, e));
    }
    let meta = std::fs::symlink_metadata(dir).map_err(|e| CoordError::io("inspect", &shown, e))?;
    if !meta.is_dir() {
        return Err(CoordError::Planted {
            name: shown,
            found: kind_name(&meta_kind(&meta)),
            expected: "a directory",
        });
    }
    Ok(())
}

fn meta_kind(meta: &std::fs::Metadata) -> u32 {
    use std::os::unix::fs::MetadataExt;
    meta.mode() & libc::S_IFMT
}

/// What an entry's type is, in words.
fn kind_name(kind: &u32) -> &'static str {
    match *kind {
        libc::S_IFLNK => "a symbolic link",
        libc::S_IFIFO => "a FIFO",
        libc::S_IFSOCK => "a socket",
        libc::S_IFCHR | libc::S_IFBLK => "a device node",
        libc::S_IFDIR => "a directory",
        libc::S_IFREG => "a regular file",
        _ => "an unknown kind of file",
    }
}

/// A coordination file must be a regular file with exactly one link (a hard link would
/// make a write through it land in another file).
fn require_regular(st: &Stat, shown: &str) -> Result<(), CoordError> {
    if st.kind() != libc::S_IFREG {
        return Err(CoordError::Planted {
            name: shown.to_owned(),
            found: kind_name(&st.kind()),
            expected: "a regular file",
        });
    }
    if st.nlink != 1 {
        return Err(CoordError::Planted {
            name: shown.to_owned(),
            found: "a file with several hard links",
            expected: "a file of its own",
        });
    }
    Ok(())
}

fn cname(name: &str, shown: &str) -> Result<CString, CoordError> {
    CString::new(name)
        .map_err(|_| CoordError::io("name", shown, std::io::Error::from_raw_os_error(libc::EINVAL)))
}

/// The data directory as runnerd opened it: coordination directories are reached from here.
#[derive(Debug)]
pub struct DataDir {
    /// `realpath(dataDir)`: canonical roots lie beneath it.
    pub real: std::path::PathBuf,
    fd: OwnedFd,
}

impl DataDir {
    pub fn open(real: std::path::PathBuf) -> Result<DataDir, CoordError> {
        let c = CString::new(real.as_os_str().as_encoded_bytes()).map_err(|_| {
            CoordError::io("open", "the data directory", std::io::Error::from_raw_os_error(libc::EINVAL))
        })?;
        let fd = fsat::open_at(&AtCwd, &c, libc::O_PATH | libc::O_DIRECTORY)
            .map_err(|e| CoordError::io("open", "the data directory", e))?;
        Ok(DataDir { real, fd })
    }

    /// Opens (creating it 0700 if absent) the coordination directory of `canonical`:
    /// `dirname(canonical)/<name>`, walked from the data directory without following any
    /// symlink, the directory itself opened `O_DIRECTORY | O_NOFOLLOW`.
    pub fn coordination_dir(&self, canonical: &Path, name: &str) -> Result<OwnedFd, CoordError> {
        let rel = canonical.strip_prefix(&self.real).map_err(|_| CoordError::NotBeneath)?;
        let parent = rel.parent().ok_or(CoordError::NotBeneath)?;
        if parent.components().any(|c| !matches!(c, Component::Normal(_))) {
            return Err(CoordError::NotBeneath);
        }
        let (parent_fd, _) =
            fsat::walk_beneath(&self.fd, parent.components()).map_err(|stopped| match stopped {
                fsat::Stopped::Missing(e) => CoordError::io("reach the directory of", name, e),
                fsat::Stopped::Symlink => CoordError::Planted {
                    name: name.to_owned(),
                    found: "under a symbolic link",
                    expected: "beneath the data directory",
                },
                fsat::Stopped::NotDirectory | fsat::Stopped::Escapes => CoordError::NotBeneath,
            })?;
        self::open_private_dir_at(&parent_fd, name)
    }

    /// The lifecycle directory `realpath(dataDir)/<name>`, opened like a coordination directory.
    pub fn own_dir(&self, name: &str) -> Result<OwnedFd, CoordError> {
        open_private_dir_at(&self.fd, name)
    }
}

/// `mkdirat(0700)` (an existing entry is kept) then `openat(O_DIRECTORY | O_NOFOLLOW)`; a
/// symlink or anything else in its place is refused.
fn open_private_dir_at(parent: &OwnedFd, name: &str) -> Result<OwnedFd, CoordError> {
    let c = cname(name, name)?;
    match fsat::mkdir_at(parent, &c, 0o700) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(CoordError::io("create the directory", name, e)),
    }
    match fsat::open_dir_at(parent, &c) {
        Ok(fd) => Ok(fd),
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTDIR | libc::ELOOP)) => {
            let found = Stat::at(parent, &c).map(|st| kind_name(&st.kind())).unwrap_or("not a directory");
            Err(CoordError::Planted { name: name.to_owned(), found, expected: "a directory" })
        }
        Err(e) => Err(CoordError::io("open the directory", name, e)),
    }
}

/// `AT_FDCWD`, for the one absolute open that starts the walk (the operator's data dir).
struct AtCwd;

impl std::os::fd::AsRawFd for AtCwd {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        libc::AT_FDCWD
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Whether another process can take the SQLite lock on `db` right now.
    pub(crate) fn free_for_another_process(db: &Path) -> bool {
        // SQLite refuses paths over 512 bytes, so a long one is probed at SQLite's RESERVED
        // byte (the POSIX lock `BEGIN IMMEDIATE` takes), from the file's directory.
        let script = if db.as_os_str().len() > 500 {
            "import fcntl,os,sys\nfd=os.open(sys.argv[1],os.O_RDWR)\ntry:\n fcntl.lockf(fd,fcntl.LOCK_EX|fcntl.LOCK_NB,1,0x40000001)\nexcept OSError:\n sys.exit(3)\n"
        } else {
            "import sqlite3,sys\nc=sqlite3.connect(sys.argv[1],timeout=0,isolation_level=None)\ntry:\n c.execute('BEGIN IMMEDIATE')\nexcept sqlite3.OperationalError:\n sys.exit(3)\n"
        };
        let status = std::process::Command::new("python3")
            .args(["-c", script])
            .arg(db.file_name().expect("a file"))
            .current_dir(db.parent().expect("a directory"))
            .status()
            .expect("python3 runs");
        match status.code() {
            Some(0) => true,
            Some(3) => false,
            other => panic!("the lock probe failed: {other:?}"),
        }
    }

    #[test]
    fn path_hex_matches_the_reference_vector() {
        assert_eq!(
            path_hex(Path::new("/srv/sd-data/remote-workspaces/project-1/session-1")),
            "a4a7686a94446f5d656e37e92ba1dcf4b0b00a48a1e588d6d5554ea53c5ea9f4"
        );
    }
}
