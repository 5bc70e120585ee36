//! Workspaces that leave their node (issue #34): moved to another runnerd by object hash,
//! replicated to an object store, restored anywhere, fenced by epochs.
//!
//! * [`ident`]: a workspace's name that means the same on every node.
//! * [`protocol`]: what two runnerd say to each other, parsed and bounded.

pub mod ident;
pub mod protocol;

pub use ident::{Ident, IdentError};
