//! Workspace versions in the original's content-addressed store, byte for byte.
//!
//! The original API process shares the data directory with the runner and reads what the
//! runner writes, so everything here reproduces the TypeScript `packages/cas` formats exactly
//! (see `original-versioning-format.md`): two OCI-layout pools of immutable blobs under
//! `<dataDir>/versioning`, JCS-encoded records with declared dependencies, `WorkspaceTree`
//! snapshots, and compare-and-swap refs in `refs.sqlite`.
//!
//! * [`jcs`]: RFC 8785 canonical JSON, the only encoding records are hashed in.
//! * [`names`]: base64url, UUID v4, SHA-256 hex and workspace head names.
//! * [`object`]: pools and the 4-field [`Ref`].
//! * [`store`]: the blob pools and records; [`snapshot`] and [`export`] build on it.
//! * [`refs`]: live and history refs.
//! * [`records`]: the values of the record kinds the runner writes.
//!
//! Everything is blocking; async callers use `spawn_blocking`.

use std::io;
use std::path::PathBuf;

pub mod export;
pub mod gc;
pub mod jcs;
pub mod names;
pub mod object;
pub mod records;
pub mod refs;
pub mod retention;
pub mod snapshot;
pub(crate) mod sparse;
pub mod store;
pub mod sweep;
#[cfg(test)]
pub(crate) mod testutil;

pub use export::export_value;
pub use names::{new_uuid_v4, workspace_head_name};
pub use object::{Pool, Ref};
pub use records::{ExecutionFields, execution_value, mutation_value};
pub use refs::Refs;
pub use store::{Record, Store};

/// The cores this process may use, read once: `available_parallelism` reads the affinity
/// mask and the cgroup's CPU quota files on every call, and a snapshot asks once per
/// directory it hashes.
pub(crate) fn cores() -> usize {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// The mediaType of every record blob (`RECORD_MEDIA_TYPE` in the original).
pub const RECORD_MEDIA_TYPE: &str = "application/vnd.sciencediscovery.record.v1+json";
/// The mediaType of streamed workspace files and of `put` without an explicit type.
pub const OCTET_STREAM: &str = "application/octet-stream";

/// Everything that can go wrong in the version store. Where the original has an exact message
/// (the API and tests match on them) the text is the original's.
#[derive(Debug, thiserror::Error)]
pub enum VersionError {
    #[error("Corrupt immutable object: {}", .path.display())]
    Corrupt { path: PathBuf },
    #[error("Object integrity failure")]
    Integrity,
    #[error(
        "Object {digest} is missing from the {pool} pool (and from the other pool and the legacy store); \
         restore it from a backup"
    )]
    Missing { digest: String, pool: &'static str },
    /// A transferred object whose bytes are not the ones its ref names ([`Store::put_verified`]).
    #[error("Received {arrived} for the object {digest} of {size} bytes; nothing was stored")]
    Mismatch { digest: String, size: u64, arrived: String },
    #[error("Invalid or cross-pool reference")]
    InvalidRef,
    #[error("Unsupported or invalid record schema")]
    Schema,
    #[error("Expected a {expected} record but the ref points to a {found} record")]
    KindMismatch { expected: String, found: String },
    #[error("Undeclared record dependency")]
    UndeclaredDependency,
    #[error("JCS rejects lone surrogates")]
    LoneSurrogate,
    #[error("JCS rejects non-finite numbers")]
    NonFinite,
    #[error("Invalid base64url text {0:?} in a record")]
    Base64(String),
    #[error("Workspace root must be a directory, not a symlink")]
    RootNotDirectory,
    /// The original's text, then (ours) the workspace-relative path.
    #[error("Workspace snapshot rejects FIFO, socket and device files: {path:?} is one; remove it")]
    SpecialFile { path: String },
    #[error("Workspace changed during snapshot")]
    Changed,
    #[error(
        "Workspace nests directories deeper than {limit} levels at {path:?}; snapshots refuse it (flatten the tree)"
    )]
    TooDeep { limit: usize, path: String },
    #[error("Workspace snapshot cannot read {path:?}; make it readable or remove it")]
    Unreadable {
        path: String,
        #[source]
        source: io::Error,
    },
    #[error("Workspace exceeds the {limit} byte execution quota; its snapshot stores nothing beyond it")]
    OverQuota { limit: u64 },
    #[error("Invalid ref name")]
    InvalidRefName,
    #[error("Agent head changed")]
    HeadChanged,
    #[error("Snapshot filename cannot be represented by the Workspace path API")]
    NonUtf8Name,
    #[error("Invalid snapshot filename")]
    InvalidSnapshotFilename,
    #[error(
        "Snapshot paths must be relative Workspace paths without '.', '..', '\\\\' or empty segments: {0:?}"
    )]
    SelectionPath(String),
    #[error("A snapshot selects at most 50 paths; {0} were given")]
    TooManyPaths(usize),
    #[error("could not {action} {}", .path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("could not {action} in the refs database {}", .path.display())]
    Sqlite {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: rusqlite::Error,
    },
}

impl VersionError {
    /// Whether the workspace's own content is what the snapshot refused (a special file, a
    /// tree too deep or unreadable, more than the quota): the workspace can fix that itself
    /// (its next run, or a DELETE, removes it), so such a failure never poisons it.
    pub fn is_content(&self) -> bool {
        matches!(
            self,
            VersionError::SpecialFile { .. }
                | VersionError::TooDeep { .. }
                | VersionError::Unreadable { .. }
                | VersionError::OverQuota { .. }
        )
    }
}

/// `map_err` helper: an I/O failure with what was being done and to which path.
pub(crate) fn io_err(
    action: &'static str,
    path: impl Into<PathBuf>,
) -> impl FnOnce(io::Error) -> VersionError {
    let path = path.into();
    move |source| VersionError::Io { action, path, source }
}
