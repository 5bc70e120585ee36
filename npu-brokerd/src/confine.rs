//! Self-confinement after start-up (R-NPU-5, R-OPS-3). The broker runs jobs, so it cannot
//! take egressd's "no exec" filter; what it can give up, it does, and its jobs inherit it:
//!
//! * `no_new_privs`: no job can gain privileges through a setuid binary or file caps.
//! * landlock (best effort; the outcome is reported in `/health`, never assumed): the whole
//!   filesystem stays readable and executable (interpreters, drivers, toolkits), but writes
//!   are confined to the broker's state directory, runnerd's workspaces, the control
//!   socket's directory, `/dev` (the NPU device nodes) and `/tmp`.
//! * a seccomp deny list (EPERM): no namespaces or mounts, no ptrace or cross-process
//!   memory access, no kernel-module, BPF, keyring, io_uring or clock calls.
//!
//! Not confined: exec (jobs are programs), the network (workloads may fetch), and reads.

use std::path::Path;

use common::confine::{self, Confinement};
use landlock::{
    ABI, Access, AccessFs, CompatLevel, Compatible, RulesetAttr, RulesetCreatedAttr, path_beneath_rules,
};

#[derive(Debug, thiserror::Error)]
pub enum ConfineError {
    #[error("could not set no_new_privs")]
    NoNewPrivs(#[source] std::io::Error),
    #[error("could not build npu-brokerd's seccomp filter")]
    Seccomp(#[source] seccompiler::Error),
    #[error("could not install npu-brokerd's seccomp filter")]
    SeccompInstall(#[source] seccompiler::Error),
}

/// The calls neither the broker nor a job needs: the helper daemons' shared deny list
/// (exec and fork stay: jobs are programs).
pub fn denied_syscalls() -> Vec<i64> {
    confine::denied_to_every_daemon()
}

pub fn program() -> Result<seccompiler::BpfProgram, ConfineError> {
    confine::deny_program(denied_syscalls()).map_err(ConfineError::Seccomp)
}

/// Landlock, best effort: `enforced`, `partial`, or `unsupported: <why>`. Paths that do not
/// exist are left out (they cannot be written then either).
pub fn landlock(writable: &[&Path]) -> String {
    let abi = ABI::V5;
    let writable: Vec<&Path> = writable.iter().copied().filter(|p| p.exists()).collect();
    let attempt = || {
        landlock::Ruleset::default()
            .set_compatibility(CompatLevel::BestEffort)
            .handle_access(AccessFs::from_all(abi))?
            .create()?
            .add_rules(path_beneath_rules([Path::new("/")], AccessFs::from_read(abi)))?
            .add_rules(path_beneath_rules(writable, AccessFs::from_all(abi)))?
            .restrict_self()
    };
    confine::landlock_outcome(attempt())
}

/// Everything, in order; no_new_privs and seccomp are mandatory, landlock is reported.
pub fn apply(writable: &[&Path]) -> Result<Confinement, ConfineError> {
    confine::set_no_new_privs().map_err(ConfineError::NoNewPrivs)?;
    let landlock = landlock(writable);
    seccompiler::apply_filter_all_threads(&program()?).map_err(ConfineError::SeccompInstall)?;
    Ok(Confinement::applied(landlock))
}

pub fn skipped() -> Confinement {
    Confinement::skipped()
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHILD: &str = "NPU_BROKERD_CONFINE_TEST_CHILD";

    #[test]
    fn a_confined_broker_still_runs_programs_but_cannot_unshare_or_write_elsewhere() {
        if std::env::var_os(CHILD).is_none() {
            let test =
                "confine::tests::a_confined_broker_still_runs_programs_but_cannot_unshare_or_write_elsewhere";
            let out = std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--exact", test, "--nocapture", "--test-threads=1"])
                .env(CHILD, "1")
                .output()
                .unwrap();
            let text =
                String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "{text}");
            assert!(text.contains("CONFINED-OK"), "{text}");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let (state, other) = (dir.path().join("state"), dir.path().join("other"));
        std::fs::create_dir(&state).unwrap();
        std::fs::create_dir(&other).unwrap();
        let report = apply(&[&state]).unwrap();
        assert!(report.seccomp && report.no_new_privs);
        // Jobs are programs: exec works, and a child writes where the broker may.
        let status = std::process::Command::new("/bin/sh")
            .args(["-c", "echo ok > \"$0/f\"", state.to_str().unwrap()])
            .status()
            .unwrap();
        assert!(status.success());
        // A job inherits no_new_privs: no setuid binary or file capability lifts it.
        let status = std::process::Command::new("/bin/sh")
            .args(["-c", "grep -Eq '^NoNewPrivs:[[:space:]]+1$' /proc/self/status"])
            .status()
            .unwrap();
        assert!(status.success(), "a job does not run with no_new_privs");
        // SAFETY: unshare takes a flag word only.
        let rc = unsafe { libc::unshare(libc::CLONE_NEWUSER) };
        assert_eq!((rc, std::io::Error::last_os_error().raw_os_error()), (-1, Some(libc::EPERM)));
        // The child inherits the filter: unshare(1) fails there too.
        if Path::new("/usr/bin/unshare").exists() {
            let out = std::process::Command::new("/usr/bin/unshare").args(["-U", "true"]).output().unwrap();
            assert!(!out.status.success(), "unshare -U succeeded in a confined child");
        }
        if report.landlock == "enforced" || report.landlock == "partial" {
            assert!(std::fs::write(other.join("f"), b"x").is_err(), "landlock let a file be written outside");
        } else {
            eprintln!("NOTE: landlock is not available here ({}); only seccomp was checked", report.landlock);
        }
        println!("CONFINED-OK landlock={}", report.landlock);
    }
}
