//! runner-isolation: how runnerd isolates what it runs, a crate of its own (issue #33) so
//! that nothing in it can import the daemon (its HTTP layer, engine, configuration, skill
//! store or accelerator probes): callers describe a sandbox in plain values and hand it to
//! the [`isolation::Isolation`] seam, and its errors are its own, which runnerd maps to its
//! answers.
//!
//! * [`isolation`]: the seam every sandbox launch goes through, and the `Bubblewrap` backend.
//! * [`sandbox`]: what a sandbox looks like — host facts, preflight probes, the sandbox user,
//!   workspace ownership (idmapped mounts) and the bwrap argv.
//! * [`launch`]: starting sandboxes through `sandbox-init`, with streaming output, budgets,
//!   timeouts and clean kills.
//! * [`limits`]: per-execution resource limits, rlimits, cgroups and their spare pool.
//! * [`accel_mount`]: the accelerator chips a sandbox spec carries, as binds and variables
//!   (runnerd's `accel` discovers and probes them).
//! * [`startup`]: the sandbox side's start-up: bwrap, the seccomp programs, the sandbox
//!   user, the launcher, the probes, and the `Bubblewrap` backend built from them.

pub mod accel_mount;
pub mod isolation;
pub mod launch;
pub mod limits;
pub mod sandbox;
pub mod startup;

#[cfg(test)]
mod tests {
    /// As runnerd's and the store's: each error here says its cause once, whichever way it
    /// is printed.
    #[test]
    fn errors_say_their_cause_once() {
        use crate::launch::LaunchError;
        use crate::launch::spawner::SpawnError;
        use crate::limits::cgroup::CgroupError;
        let io = || std::io::Error::from_raw_os_error(libc::EACCES);
        let path = || std::path::PathBuf::from("/p");
        let bwrap = crate::sandbox::preflight::PreflightError::Unrunnable { path: "/b".into(), source: io() };
        let packages = crate::sandbox::host::PackagesError::Open { path: path(), source: io() };
        let launch = || LaunchError::Io { what: "write the plan", source: io() };
        let spawn = LaunchError::Spawn(SpawnError::Spawn { path: path(), source: io() });
        let startup = crate::startup::StartupError::Launcher { path: path(), source: launch() };
        let create = CgroupError::Create { path: path(), source: io() };
        let write = CgroupError::Write { path: path(), value: "1".into(), source: io() };
        let remove = CgroupError::Remove { path: path(), source: io() };
        let all: [&dyn std::error::Error; 8] =
            [&bwrap, &packages, &launch(), &spawn, &startup, &create, &write, &remove];
        for e in all {
            assert!(!common::repeats_its_source(e), "{e}");
            assert_eq!(common::error_chain(e).matches(&io().to_string()).count(), 1, "{e}");
        }
    }
}
