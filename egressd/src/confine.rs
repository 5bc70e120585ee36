//! Self-confinement after start-up (R-OPS-3): egressd parses untrusted bytes from every
//! sandbox, so once its sockets exist it gives up what a proxy never needs.
//!
//! * `no_new_privs`: nothing it could exec would gain privileges.
//! * landlock (best effort; the outcome is reported, never assumed): the only filesystem
//!   access left is creating and removing gateway sockets in `<runtime>/eg`, removing the
//!   control socket at shutdown, and reading the hosts file (that inode: a file replaced by
//!   rename later cannot be read until egressd restarts; one rewritten in place can).
//! * a seccomp filter of its own: the helper daemons' shared deny list
//!   ([`common::confine`]: no namespaces or mounts, no ptrace or cross-process memory
//!   access, no kernel-module, BPF, keyring, io_uring or clock calls) plus no exec, no
//!   fork, no perf events, no syslog — each answered with EPERM.

use std::path::Path;

use common::confine::{self, Confinement};
use landlock::{
    ABI, Access, AccessFs, CompatLevel, Compatible, RestrictionStatus, Ruleset, RulesetAttr,
    RulesetCreatedAttr, path_beneath_rules,
};

#[derive(Debug, thiserror::Error)]
pub enum ConfineError {
    #[error("could not set no_new_privs")]
    NoNewPrivs(#[source] std::io::Error),
    #[error("could not build egressd's seccomp filter")]
    Seccomp(#[source] seccompiler::Error),
    #[error("could not install egressd's seccomp filter")]
    SeccompInstall(#[source] seccompiler::Error),
}

/// The calls egressd never makes: the shared list plus exec, fork, perf events and syslog.
pub fn denied_syscalls() -> Vec<i64> {
    let mut calls = confine::denied_to_every_daemon();
    calls.extend([libc::SYS_execve, libc::SYS_execveat, libc::SYS_perf_event_open, libc::SYS_syslog]);
    #[cfg(target_arch = "x86_64")]
    calls.extend([libc::SYS_fork, libc::SYS_vfork]);
    calls
}

/// egressd's deny list compiled for this architecture.
pub fn program() -> Result<seccompiler::BpfProgram, ConfineError> {
    confine::deny_program(denied_syscalls()).map_err(ConfineError::Seccomp)
}

/// Installs the deny-list filter on every thread of the process.
pub fn install_seccomp() -> Result<(), ConfineError> {
    seccompiler::apply_filter_all_threads(&program()?).map_err(ConfineError::SeccompInstall)
}

/// Landlock, best effort: `enforced`, `partial`, or `unsupported: <why>`.
pub fn landlock(gateway_dir: &Path, control_dir: &Path, hosts_file: &Path) -> String {
    let abi = ABI::V5;
    let sockets = AccessFs::MakeSock | AccessFs::RemoveFile | AccessFs::ReadDir;
    let attempt = || -> Result<RestrictionStatus, landlock::RulesetError> {
        Ruleset::default()
            .set_compatibility(CompatLevel::BestEffort)
            .handle_access(AccessFs::from_all(abi))?
            .create()?
            .add_rules(path_beneath_rules([gateway_dir], sockets))?
            .add_rules(path_beneath_rules([control_dir], AccessFs::RemoveFile))?
            // A file that does not exist yet is skipped (path_beneath_rules leaves it out).
            .add_rules(path_beneath_rules([hosts_file], AccessFs::ReadFile))?
            .restrict_self()
    };
    confine::landlock_outcome(attempt())
}

/// Everything, in order; what could not be applied is reported, and a failure of the
/// mandatory parts (no_new_privs, seccomp) is an error.
pub fn apply(gateway_dir: &Path, control_dir: &Path, hosts_file: &Path) -> Result<Confinement, ConfineError> {
    confine::set_no_new_privs().map_err(ConfineError::NoNewPrivs)?;
    let landlock = landlock(gateway_dir, control_dir, hosts_file);
    install_seccomp()?;
    Ok(Confinement::applied(landlock))
}

/// What `--no-confine` reports.
pub fn skipped() -> Confinement {
    Confinement::skipped()
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHILD: &str = "EGRESSD_CONFINE_TEST_CHILD";

    /// Runs `test` in a fresh copy of this test binary, so the confinement stays there.
    fn in_child(test: &str) -> std::process::Output {
        std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", test, "--nocapture", "--test-threads=1"])
            .env(CHILD, "1")
            .output()
            .unwrap()
    }

    #[test]
    fn a_confined_egressd_cannot_exec_unshare_or_write_outside_its_directory() {
        if std::env::var_os(CHILD).is_none() {
            let out = in_child(
                "confine::tests::a_confined_egressd_cannot_exec_unshare_or_write_outside_its_directory",
            );
            let text =
                String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "{text}");
            assert!(text.contains("CONFINED-OK"), "{text}");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let (eg, control, other) = (dir.path().join("eg"), dir.path().join("ctl"), dir.path().join("other"));
        for d in [&eg, &control, &other] {
            std::fs::create_dir(d).unwrap();
        }
        let hosts = dir.path().join("hosts");
        std::fs::write(&hosts, "127.0.0.1 x.test\n").unwrap();
        let report = apply(&eg, &control, &hosts).unwrap();
        assert!(report.seccomp && report.no_new_privs);
        // (landlock leaves no read of /proc here: ask the kernel directly)
        // SAFETY: prctl(PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0) takes no pointers.
        let nnp = unsafe { libc::prctl(libc::PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0) };
        assert_eq!(nnp, 1, "no_new_privs is not set");
        let exec = std::process::Command::new("/bin/true").status();
        assert_eq!(exec.unwrap_err().raw_os_error(), Some(libc::EPERM));
        // SAFETY: unshare takes a flag word only.
        let rc = unsafe { libc::unshare(libc::CLONE_NEWUSER) };
        assert_eq!((rc, std::io::Error::last_os_error().raw_os_error()), (-1, Some(libc::EPERM)));
        // The x32 spelling of the same call is refused by the filter, not by the kernel.
        // SAFETY: a raw syscall with an integer argument.
        let rc = unsafe { libc::syscall(0x4000_0000 | libc::SYS_unshare, libc::CLONE_NEWUSER) };
        assert_eq!((rc, std::io::Error::last_os_error().raw_os_error()), (-1, Some(libc::EPERM)));
        // clone with a namespace flag: EPERM; clone3: ENOSYS (glibc then uses clone).
        // SAFETY: clone with SIGCHLD and a namespace flag, no stack: a successful child
        // would _exit at once; the filter refuses it before that.
        let rc = unsafe { libc::syscall(libc::SYS_clone, libc::CLONE_NEWUSER | libc::SIGCHLD, 0, 0, 0, 0) };
        if rc == 0 {
            // SAFETY: we are the child of a clone that should not have happened; leave now.
            unsafe { libc::_exit(0) };
        }
        assert_eq!((rc, std::io::Error::last_os_error().raw_os_error()), (-1, Some(libc::EPERM)));
        let mut args = [0u64; 11];
        // SAFETY: clone3 with a zeroed argument block of the right size.
        let rc = unsafe { libc::syscall(libc::SYS_clone3, args.as_mut_ptr(), std::mem::size_of_val(&args)) };
        assert_eq!((rc, std::io::Error::last_os_error().raw_os_error()), (-1, Some(libc::ENOSYS)));
        // Threads still start.
        assert_eq!(std::thread::spawn(|| 7).join().unwrap(), 7);
        std::os::unix::net::UnixListener::bind(eg.join("sock")).unwrap();
        if report.landlock == "enforced" || report.landlock == "partial" {
            assert!(std::fs::write(other.join("f"), b"x").is_err(), "landlock let a file be written outside");
            assert!(std::os::unix::net::UnixListener::bind(other.join("sock")).is_err());
            assert!(std::fs::read(&hosts).is_ok(), "the hosts file stays readable");
            assert!(std::fs::write(&hosts, b"x").is_err(), "the hosts file is read-only to egressd");
        } else {
            eprintln!("NOTE: landlock is not available here ({}); only seccomp was checked", report.landlock);
        }
        println!("CONFINED-OK landlock={}", report.landlock);
    }

    #[test]
    fn the_deny_list_compiles_for_this_architecture() {
        assert!(denied_syscalls().contains(&libc::SYS_execve));
        assert!(program().unwrap().len() > denied_syscalls().len());
    }
}
