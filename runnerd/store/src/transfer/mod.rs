//! Moving a workspace's versions between nodes (issue #34): which objects a head reaches
//! ([`closure`]), what writing a tree out would cost ([`budget`]), writing it out as files
//! ([`materialize`]), and where each workspace lives ([`placement`]). The HTTP routes and the
//! object-store replica build on these.

use std::io;
use std::path::PathBuf;

use crate::versioning::VersionError;

pub mod budget;
pub mod closure;
pub mod materialize;
mod nested;
pub mod placement;
pub mod verify;

/// Everything that can go wrong moving a workspace.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    /// The version store's own error (integrity, a missing object, a bad record).
    #[error(transparent)]
    Version(#[from] VersionError),
    #[error("could not {what} {}", .path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("could not {what} in the placement database")]
    Sql {
        what: &'static str,
        #[source]
        source: rusqlite::Error,
    },
    #[error("could not open the placement directory beneath the data directory")]
    Dir(#[source] crate::coordination::CoordError),
    /// Only runnerd writes the placement directory: anything else at the database's name is
    /// damage, and is never used.
    #[error("Refusing {name}: it is not a database file of runnerd's own; remove it")]
    Planted { name: String },
    /// A tree entry name that would not be one plain entry of its directory, or one that
    /// runnerd reserves for its own coordination files.
    #[error(
        "Tree entry {name:?} is a path that escapes (empty, '.', '..', containing '/' or NUL, or repeated in its directory) or a name reserved for runner coordination files; the tree is refused"
    )]
    BadName { name: String },
    #[error("Tree entry in {} is malformed: {detail}; the tree is refused", .path.display())]
    BadEntry { path: PathBuf, detail: &'static str },
    #[error("{} is not a WorkspaceTree record", .path.display())]
    NotATree { path: PathBuf },
    #[error("could not write {path:?} from the version store")]
    Blob {
        path: String,
        #[source]
        source: Box<VersionError>,
    },
    #[error("A workspace is only written into an empty directory")]
    NotEmpty,
    #[error("could not empty the workspace directory")]
    Clear(#[source] crate::remote::files::RemoteError),
    /// [`materialize::swap_in`] renames, which cannot cross filesystems: refused before the
    /// live workspace is emptied. The devices are `major:minor`.
    #[error(
        "The staging directory (device {staging}) and the workspace (device {root}) are on different filesystems, so the tree cannot be renamed into place; the workspace was left as it was"
    )]
    NotSameFilesystem { staging: String, root: String },
    #[error("The workspace's files are the tree {found}, not the tree {expected}; nothing was committed")]
    TreeMismatch { expected: String, found: String },
    #[error("The head {head} being imported does not name the tree {tree}; nothing was committed")]
    HeadMismatch { head: String, tree: String },
    #[error("Workspace path {path:?} is not UTF-8; placement keys are text")]
    PathNotUtf8 { path: PathBuf },
    /// What a tree would write, counted before anything is ([`budget::tree_totals`]), is
    /// more than this node takes (entries, or the caller's quota or free disk).
    #[error(
        "The workspace would write at least {entries} entries and {bytes} bytes, more than this node takes; nothing was written"
    )]
    TooLarge { entries: u64, bytes: u64 },
}
