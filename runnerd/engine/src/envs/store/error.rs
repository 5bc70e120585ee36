//! The store's error: what each operation answers, and which setup action a failure asks for.

use std::path::PathBuf;

use crate::envs::catalog;
use crate::envs::ids;
use crate::envs::sandboxed::SandboxedError;
use crate::envs::setup::FailureKind;
use crate::envs::snapshot;
use crate::envs::wheels;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The store cannot be used now (disabled, setup not ready): the reason is the text.
    #[error("{0}")]
    Unavailable(String),
    /// The request is wrong: the text says how.
    #[error("{0}")]
    Invalid(String),
    #[error("Environment not found: {0}")]
    NotFound(String),
    /// The original's text for a revision id that names nothing.
    #[error("Unknown environment revision: {0}")]
    UnknownRevision(String),
    #[error(transparent)]
    Ids(#[from] ids::IdError),
    #[error(transparent)]
    Catalog(#[from] catalog::CatalogError),
    #[error(transparent)]
    Snapshot(#[from] snapshot::SnapshotError),
    #[error(transparent)]
    Wheel(#[from] wheels::WheelError),
    /// A provisioning step failed; the text is what its output says.
    #[error("{label} step failed: {detail}")]
    Step { label: &'static str, detail: String },
    #[error(transparent)]
    Sandboxed(#[from] SandboxedError),
    #[error("the store's directory {path} could not be prepared")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl StoreError {
    /// For setup's action text.
    pub(super) fn kind(&self) -> FailureKind {
        let disk_full = |e: &std::io::Error| e.raw_os_error() == Some(libc::ENOSPC);
        match self {
            StoreError::Io { source, .. } if disk_full(source) => FailureKind::DiskFull,
            StoreError::Step { detail, .. } if detail.contains("No space left") => FailureKind::DiskFull,
            StoreError::Step { label: "conda", .. } => FailureKind::Channels,
            StoreError::Step { label: "provisioner", .. } => FailureKind::Provisioner,
            StoreError::Sandboxed(SandboxedError::Missing { label: "conda", .. }) => FailureKind::Channels,
            StoreError::Sandboxed(_) => FailureKind::Sandbox,
            _ => FailureKind::Other,
        }
    }
}
