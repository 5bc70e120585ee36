//! runner-store: runnerd's workspace store, a crate of its own (issue #33) so that nothing in
//! it can import the daemon (its HTTP layer, engine, sandbox or journal): what it needs of
//! them comes in as plain values or through the small traits it defines
//! ([`owner::HandOver`], [`writer::SnapshotJournal`]), and its errors are its own, which
//! runnerd maps to its answers.
//!
//! * [`fsat`]: `*at` system calls by descriptor, never following a symlink.
//! * [`workspace`]: which directory a request may run in, resolved beneath the data directory.
//! * [`versioning`]: the content-addressed version store, its refs and its collector.
//! * [`coordination`]: the cross-process writer admission and lease of a workspace.
//! * [`writer`]: the writer protocol over both (lease, snapshot, commit, recovery, repair).
//! * [`remote`]: the remote workspace's file operations.
//! * [`transfer`]: moving a workspace's versions between nodes (closure, files, placement).
//! * [`dbcheck`]: whether a shared SQLite database is damaged, and the remedy.
//! * [`execution_state`]: a managed execution's state, in its record and its version.
//! * [`blocking`], [`owner`], [`quota`]: the blocking-work helper, the sandbox user's hand-over
//!   and a file's cost against the quota.

pub mod blocking;
pub mod coordination;
pub mod dbcheck;
pub mod execution_state;
pub mod fsat;
pub mod owner;
pub mod quota;
pub mod remote;
pub mod transfer;
pub mod versioning;
pub mod workspace;
pub mod writer;
