//! runnerd: the HTTP layer and the daemon binary (issue #33). It reads requests, checks
//! who may call ([`auth::Gate`]: the bearer token, the signatures and their replay cache),
//! hands the engine typed requests ([`api::request`]) and maps the engine's errors to
//! answers ([`api::error`]); [`cli`] starts it (`runnerd serve`, `selftest`,
//! `--check-config`).
//!
//! The crates below it, each of its own so that the compiler forbids reaching back up:
//! * `runner_engine` — executions, managed runs, environments, skills, accelerators, the
//!   change journal, the daemon's state; re-exported here under the paths it always had.
//! * `runner_isolation` — the [`isolation`] seam every sandbox goes through, its bubblewrap
//!   backend, the [`sandbox`] form, the [`launch`]er and the [`limits`].
//! * `runner_store` — versions, coordination, the writer, workspace resolution, the remote
//!   workspace's files.
//!
//! `runnerctl` (`runnerd/ctl`) may use this library, never the other way round. What it
//! takes from here is what must match the daemon exactly: [`ClientSettings`] (where runnerd
//! listens, read from its own configuration), [`token`]'s resolution, [`skill_bundle`]'s ids
//! and hashes, and [`auth::sign`].

pub mod api;
pub mod auth;
pub(crate) mod check;
pub mod cli;
pub(crate) mod http;
/// The HTTP front's limits, and how it refuses a body over them, which a fleet router in
/// front of runnerd keeps the same.
pub mod http_limits {
    pub use crate::http::{BODY_TIMEOUT, MAX_CONNECTIONS, announced_over_limit, discard};
}
pub mod memory;
pub mod peer;
pub(crate) mod selftest;
pub mod token;

// The engine's modules and, through it, the store's and the isolation crate's, under the
// paths the HTTP layer, the integration suite and the benchmarks use.
pub use runner_engine::{
    ClientSettings, accel, app, audit, blocking, client_settings, config, coordination, dbcheck, egress,
    envs, error_chain, exec, fsat, history, isolation, journal, launch, limits, managed, measure, metrics,
    npu_broker, quota, remote, replica, sandbox, skill_bundle, skills, startup, timefmt, transfer,
    versioning, workspace, writer,
};
