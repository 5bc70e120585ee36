//! runnerd: the runner daemon's library.
//!
//! * the sandbox side — the [`isolation`] seam and its bubblewrap backend, what a
//!   [`sandbox`] looks like, the [`launch`]er through `sandbox-init`, resource [`limits`]
//!   and the [`startup`] that decides and prepares all of it — is the `runner_isolation`
//!   crate (issue #33), re-exported here under its old paths.
//! * `egress`: asking egressd for a policy's gateway (network sandboxes).
//! * [`cli`]: the `runnerd` command line (the benchmarks are the `runnerd-bench` crate).
//! * the workspace store — versions, coordination, the writer, workspace resolution, the
//!   remote workspace's files — is the `runner_store` crate (issue #33), re-exported here
//!   under its old paths; [`workspace`] gives its resolution's refusals as `EngineError`s.
//!
//! * `runnerctl`, the command-line client, is a crate of its own (`runnerd/ctl`, issue
//!   #33): it may use this library, never the other way round. What it takes from here is
//!   what must match the daemon exactly: [`ClientSettings`] (where runnerd listens, read
//!   from its own configuration), [`token`]'s resolution, [`skill_bundle`]'s ids and
//!   hashes, and [`auth::sign`].
//!
//! Public are only the modules the binaries, `runnerctl`, the integration suite (`tests/`)
//! and the benchmarks (`runnerd/bench`) use; the rest (the HTTP layer, the daemon's state,
//! the stores) is `pub(crate)`, so the compiler reports what nobody calls.

pub(crate) mod accel;
pub(crate) mod api;
pub(crate) mod app;
pub use common::audit;
pub mod auth;
pub(crate) use runner_store::blocking;
pub(crate) mod check;
pub mod cli;
pub(crate) mod config;
pub use runner_store::coordination;
pub(crate) use runner_store::dbcheck;
pub(crate) mod egress;
pub(crate) mod envs;
pub mod exec;
pub(crate) use runner_store::fsat;
pub mod history;
pub(crate) mod http;
pub use runner_isolation::{isolation, launch, limits};
pub mod journal;
pub(crate) mod managed;
pub mod memory;
pub(crate) mod metrics;
pub(crate) mod npu_broker;
pub use runner_isolation::sandbox;
pub(crate) use runner_store::{quota, remote};
pub(crate) mod selftest;
pub(crate) mod skills;
pub use common::timefmt;
pub use runner_isolation::startup;
pub mod token;
pub(crate) use runner_store::versioning;
pub mod workspace;
pub use runner_store::writer;

pub use config::{ClientSettings, client_settings};
pub use skills::bundle as skill_bundle;

pub use common::error_chain;

#[cfg(test)]
mod tests {
    /// As the store's errors (`writer`'s test) and the isolation crate's: each of runnerd's
    /// own says its cause once, whichever way it is printed.
    #[test]
    fn errors_say_their_cause_once() {
        let io = || std::io::Error::from_raw_os_error(libc::EACCES);
        let db = crate::managed::db::DbError::Dir { path: "/e".into(), source: io() };
        let all: [&dyn std::error::Error; 1] = [&db];
        for e in all {
            assert!(!common::repeats_its_source(e), "{e}");
            assert_eq!(crate::error_chain(e).matches(&io().to_string()).count(), 1, "{e}");
        }
    }
}
