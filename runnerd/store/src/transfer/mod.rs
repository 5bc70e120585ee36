//! Moving a workspace's versions between nodes (issue #34): which objects a head reaches
//! ([`closure`]), writing a tree back out as files ([`materialize`]), and where each workspace
//! lives ([`placement`]). The HTTP routes and the object-store replica build on these.

use std::io;
use std::path::PathBuf;

use crate::versioning::VersionError;

pub mod closure;

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
}
