//! Workspaces that leave their node (issue #34): moved to another runnerd by object hash,
//! replicated to an object store, restored anywhere, fenced by epochs.
//!
//! A move is git-push semantics over the content-addressed store: the source lists its
//! head's closure, asks the target which objects it lacks, streams only those (each verified
//! by its digest on arrival), then asks the target to commit the head. The target checks the
//! whole closure, materializes the tree beside the workspace, swaps it in under the writer
//! lease and commits the *same* head ref at a higher epoch; only then is the source fenced.
//! A cut transfer leaves both copies as they were: what arrived stays (content-addressed, so
//! the next attempt asks for less), and the target's head has not moved.
//!
//! * [`ident`]: a workspace's name that means the same on every node.
//! * [`protocol`]: what two runnerd say to each other, parsed and bounded.
//! * [`receive`]: the target's side (which objects it lacks, the object stream, the import).
//! * [`outgoing`]: the source's side (the closure to send under the lease, then the fence),
//!   and the moves in flight that `where` shows.
//! * [`status`]: `where` — head, epoch, fence, replication, a move in flight.
//! * [`sweep`]: fenced copies removed after their grace.
//! * [`from_store`]: a restore from the object store (`crate::replica`), on any node.

pub mod draining;
pub mod from_store;
pub mod ident;
pub mod outgoing;
pub mod protocol;
pub mod receive;
pub mod status;
pub mod sweep;

pub use ident::{Ident, IdentError};

use crate::writer::WriteError;
use runner_store::transfer::TransferError;

/// Why a move, an import or a restore did not happen. Nothing changed on this node when one
/// of these is returned, except objects stored (content-addressed, harmless, collected when
/// nothing reaches them).
#[derive(Debug, thiserror::Error)]
pub enum TransferFailed {
    #[error(transparent)]
    Protocol(#[from] protocol::ProtocolError),
    #[error(transparent)]
    Workspace(#[from] crate::error::EngineError),
    /// This copy's epoch is not older than the one offered: the offer is from a stale copy.
    #[error("{ident} is at epoch {local} here; a copy at epoch {offered} is older and never replaces it")]
    Stale { ident: String, local: u64, offered: u64 },
    #[error("{ident} is held by a managed run; wait for it to finish or cancel it, then move the workspace")]
    Busy { ident: String },
    /// This node is itself sending the workspace away (a push to its own URL, or a commit
    /// arriving while a push of the same workspace is under way).
    #[error(
        "{ident} is being moved away from this node; a copy cannot arrive here at the same time (is the target this node itself?)"
    )]
    Sending { ident: String },
    /// The target holds a live copy of its own with files (a node that never had this
    /// workspace, an empty or a fenced copy take one; an operator restores over a live one).
    #[error(
        "this node holds a live copy of {ident} with files of its own; move or clear it first, or restore explicitly"
    )]
    Exists { ident: String },
    /// Workspaces are nested in this one (their leases live inside it): it cannot move or
    /// be replaced without theirs.
    #[error(
        "workspaces are nested inside this one (a .workspace-coordination directory holds their leases); move those, not their parent"
    )]
    Nested,
    #[error("the tree needs {needed} bytes and the data directory has {free} free")]
    NoSpace { needed: u64, free: u64 },
    #[error("no object store is configured on this node (replica_endpoint)")]
    ReplicationOff,
    #[error("the object store holds no {ident}")]
    NotInStore { ident: String },
    #[error("the object store failed")]
    Replica(#[source] crate::replica::ClientError),
    #[error("{ident} has no committed version to send")]
    NoHead { ident: String },
    #[error("the head is not a workspace version (a WorkspaceMutation or WorkspaceExecution with a tree)")]
    NotAHead,
    #[error("the workspace store refused the transfer")]
    Store(#[source] TransferError),
    #[error("the workspace version could not be written")]
    Write(#[source] WriteError),
    #[error("the transfer task failed: {0}")]
    Task(String),
}

impl From<TransferError> for TransferFailed {
    fn from(e: TransferError) -> TransferFailed {
        TransferFailed::Store(e)
    }
}

impl From<crate::versioning::VersionError> for TransferFailed {
    fn from(e: crate::versioning::VersionError) -> TransferFailed {
        TransferFailed::Store(TransferError::from(e))
    }
}

impl From<WriteError> for TransferFailed {
    fn from(e: WriteError) -> TransferFailed {
        TransferFailed::Write(e)
    }
}

impl TransferFailed {
    /// The stable machine-readable code (api.md improvement 1).
    pub fn code(&self) -> &'static str {
        match self {
            TransferFailed::Protocol(_) => "invalid_transfer_request",
            TransferFailed::Workspace(e) => e.code().as_str(),
            TransferFailed::Stale { .. } => "stale_epoch",
            TransferFailed::Busy { .. } => "workspace_busy",
            TransferFailed::Sending { .. } => "workspace_sending",
            TransferFailed::Exists { .. } => "workspace_exists",
            TransferFailed::Nested => "nested_workspaces",
            TransferFailed::ReplicationOff => "replication_off",
            TransferFailed::NotInStore { .. } => "not_in_store",
            TransferFailed::Replica(_) => "object_store_failed",
            TransferFailed::NoSpace { .. } => "insufficient_space",
            TransferFailed::Store(TransferError::TooLarge { .. }) => "workspace_quota_exceeded",
            TransferFailed::NoHead { .. } => "no_version",
            TransferFailed::NotAHead => "not_a_version",
            TransferFailed::Store(_) => "transfer_refused",
            TransferFailed::Write(WriteError::Fenced { .. }) => "workspace_moved",
            TransferFailed::Write(e) => crate::error::workspace_code(e).as_str(),
            TransferFailed::Task(_) => "internal",
        }
    }
}

/// Runs blocking store work off the async threads.
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, TransferFailed> + Send + 'static,
) -> Result<T, TransferFailed> {
    tokio::task::spawn_blocking(f).await.unwrap_or_else(|e| Err(TransferFailed::Task(e.to_string())))
}
