//! Managed shell executions (contract §3, R-RUN-5): accepted with 202, run in the
//! background in FIFO order per workspace, logs stored while they run, cancellable, durable
//! across restarts (never replayed), and each ending in a committed workspace version.

pub mod db;
pub mod logs;
pub mod manager;

pub use manager::Manager;
pub use runner_store::execution_state::ManagedState;
