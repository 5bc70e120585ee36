//! runner-engine: what runnerd does, without HTTP (issue #33). The HTTP layer (the `runnerd`
//! crate) hands it typed requests and maps its errors; it never reaches back.
//!
//! * [`exec`]: the engine — every execution's one path (prepare → engine → stage → run).
//! * [`managed`]: managed (background) executions, their records and logs.
//! * [`envs`]: scientific environments (catalog, provisioning in sandboxes, leases).
//! * [`skills`]: skill packages (bundles, publication, mounts).
//! * [`accel`]: Ascend NPUs and NVIDIA GPUs (discovery, selection, the in-sandbox probes).
//! * [`journal`]: the change journal (what a run changed, from inotify events).
//! * [`history`]: the version history's retention and collection, scheduled.
//! * [`app`]: the daemon's state every part reads; [`config`]: its settings;
//!   [`metrics`]: `GET /metrics`; [`egress`], [`npu_broker`]: the helper daemons' clients;
//!   [`workspace`]: the store's workspace resolution with its refusals as `EngineError`s.
//! * [`transfer`]: workspaces moved between nodes, replicated and restored (issue #34);
//!   [`replica`]: the object-store replication of their versions.
//!
//! The workspace store (`runner_store`) and the isolation backends (`runner_isolation`) are
//! crates of their own below this one, re-exported here under the paths the engine uses.

pub mod accel;
pub mod app;
pub mod code;
pub mod config;
pub mod egress;
pub mod envs;
pub mod error;
pub mod exec;
pub mod history;
pub mod journal;
pub mod managed;
pub mod measure;
pub mod metrics;
pub mod npu_broker;
pub mod replica;
pub mod skills;
pub mod transfer;
pub mod workspace;

pub use common::{audit, error_chain, timefmt};
pub use runner_isolation::{isolation, launch, limits, sandbox, startup};
pub use runner_store::{blocking, coordination, dbcheck, fsat, quota, remote, versioning, writer};

pub use config::{ClientSettings, client_settings};
pub use skills::bundle as skill_bundle;

#[cfg(test)]
mod tests {
    /// As the store's errors (`writer`'s test) and the isolation crate's: each of the
    /// engine's own says its cause once, whichever way it is printed.
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
