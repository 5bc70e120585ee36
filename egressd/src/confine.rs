//! Self-confinement after start-up (R-OPS-3): egressd parses untrusted bytes from every
//! sandbox, so once its sockets exist it gives up what a proxy never needs.
//!
//! * `no_new_privs`: nothing it could exec would gain privileges.
//! * landlock (best effort; the outcome is reported, never assumed): the only filesystem
//!   access left is creating and removing gateway sockets in `<runtime>/eg` and removing the
//!   control socket at shutdown.
//! * a seccomp filter of its own: no exec, no namespaces or mounts, no ptrace or
//!   cross-process memory access, no kernel-module, BPF, keyring, io_uring or clock calls —
//!   each answered with EPERM. A deny list rather than an allow list: tokio and glibc pick
//!   their syscalls by kernel version, and a proxy killed by a missing entry would take
//!   every sandbox's network with it.

use std::collections::BTreeMap;
use std::path::Path;

use common::egress::protocol::Confinement;
use landlock::{
    ABI, Access, AccessFs, CompatLevel, Compatible, RestrictionStatus, Ruleset, RulesetAttr,
    RulesetCreatedAttr, RulesetStatus, path_beneath_rules,
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

/// The calls egressd never makes (numbers for the build architecture).
pub fn denied_syscalls() -> Vec<i64> {
    let mut calls = vec![
        libc::SYS_execve,
        libc::SYS_execveat,
        libc::SYS_ptrace,
        libc::SYS_process_vm_readv,
        libc::SYS_process_vm_writev,
        libc::SYS_mount,
        libc::SYS_umount2,
        libc::SYS_pivot_root,
        libc::SYS_chroot,
        libc::SYS_unshare,
        libc::SYS_setns,
        libc::SYS_bpf,
        libc::SYS_perf_event_open,
        libc::SYS_keyctl,
        libc::SYS_add_key,
        libc::SYS_request_key,
        libc::SYS_init_module,
        libc::SYS_finit_module,
        libc::SYS_delete_module,
        libc::SYS_kexec_load,
        libc::SYS_reboot,
        libc::SYS_swapon,
        libc::SYS_swapoff,
        libc::SYS_userfaultfd,
        libc::SYS_io_uring_setup,
        libc::SYS_io_uring_enter,
        libc::SYS_io_uring_register,
        libc::SYS_open_by_handle_at,
        libc::SYS_name_to_handle_at,
        libc::SYS_acct,
        libc::SYS_quotactl,
        libc::SYS_syslog,
        libc::SYS_fanotify_init,
        libc::SYS_move_mount,
        libc::SYS_open_tree,
        libc::SYS_fsopen,
        libc::SYS_fsconfig,
        libc::SYS_fsmount,
        libc::SYS_fspick,
        libc::SYS_mount_setattr,
        libc::SYS_settimeofday,
        libc::SYS_clock_settime,
        libc::SYS_clock_adjtime,
        libc::SYS_adjtimex,
        libc::SYS_pidfd_getfd,
    ];
    #[cfg(target_arch = "x86_64")]
    calls.extend([
        libc::SYS_fork,
        libc::SYS_vfork,
        libc::SYS_kexec_file_load,
        libc::SYS_iopl,
        libc::SYS_ioperm,
    ]);
    calls
}

fn arch() -> Result<seccompiler::TargetArch, ConfineError> {
    std::env::consts::ARCH
        .try_into()
        .map_err(|e: seccompiler::BackendError| ConfineError::Seccomp(seccompiler::Error::Backend(e)))
}

/// Namespace flags `clone` may not carry (threads and plain forks stay possible).
const NAMESPACE_FLAGS: [u64; 7] = [
    libc::CLONE_NEWUSER as u64,
    libc::CLONE_NEWNS as u64,
    libc::CLONE_NEWPID as u64,
    libc::CLONE_NEWNET as u64,
    libc::CLONE_NEWIPC as u64,
    libc::CLONE_NEWUTS as u64,
    libc::CLONE_NEWCGROUP as u64,
];

/// `clone` with any namespace flag: one rule per flag (rules of a call are alternatives).
fn clone_rules() -> Result<Vec<seccompiler::SeccompRule>, seccompiler::BackendError> {
    use seccompiler::{SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompRule};
    NAMESPACE_FLAGS
        .iter()
        .map(|&flag| {
            SeccompRule::new(vec![SeccompCondition::new(
                0,
                SeccompCmpArgLen::Qword,
                SeccompCmpOp::MaskedEq(flag),
                flag,
            )?])
        })
        .collect()
}

/// Instructions placed before seccompiler's program, for what its rule tables cannot say:
/// x32-ABI numbers (bit 30) would slip past every per-number rule, so they are refused; and
/// `clone3`, whose flags live in memory a filter cannot read, answers ENOSYS, which makes
/// glibc fall back to `clone` (where the flags are checked) — EPERM would break threads.
fn prelude() -> Vec<seccompiler::sock_filter> {
    const RET_ERRNO: u32 = 0x0005_0000;
    let insn = |code: u16, jt: u8, jf: u8, k: u32| seccompiler::sock_filter { code, jt, jf, k };
    vec![
        insn(0x20, 0, 0, 0),                               // ld [0]: the syscall number
        insn(0x35, 0, 1, 0x4000_0000),                     // jge x32 bit
        insn(0x06, 0, 0, RET_ERRNO | libc::EPERM as u32),  // ret ERRNO(EPERM)
        insn(0x15, 0, 1, libc::SYS_clone3 as u32),         // jeq clone3
        insn(0x06, 0, 0, RET_ERRNO | libc::ENOSYS as u32), // ret ERRNO(ENOSYS)
    ]
}

/// The deny list compiled for this architecture: EPERM for the listed calls and for
/// namespace-creating `clone`, allow the rest; after [`prelude`].
pub fn program() -> Result<seccompiler::BpfProgram, ConfineError> {
    let backend = |e| ConfineError::Seccomp(seccompiler::Error::Backend(e));
    let mut rules: BTreeMap<i64, Vec<seccompiler::SeccompRule>> =
        denied_syscalls().into_iter().map(|n| (n, Vec::new())).collect();
    rules.insert(libc::SYS_clone, clone_rules().map_err(backend)?);
    let filter = seccompiler::SeccompFilter::new(
        rules,
        seccompiler::SeccompAction::Allow,
        seccompiler::SeccompAction::Errno(libc::EPERM as u32),
        arch()?,
    )
    .map_err(backend)?;
    let compiled: seccompiler::BpfProgram = filter.try_into().map_err(backend)?;
    Ok(prelude().into_iter().chain(compiled).collect())
}

/// Installs the deny-list filter on every thread of the process.
pub fn install_seccomp() -> Result<(), ConfineError> {
    seccompiler::apply_filter_all_threads(&program()?).map_err(ConfineError::SeccompInstall)
}

fn set_no_new_privs() -> Result<(), ConfineError> {
    // SAFETY: prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) takes no pointers and only sets a
    // process flag.
    let rc = unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) };
    if rc != 0 {
        return Err(ConfineError::NoNewPrivs(std::io::Error::last_os_error()));
    }
    Ok(())
}

/// Landlock, best effort: `enforced`, `partial`, or `unsupported: <why>`.
pub fn landlock(gateway_dir: &Path, control_dir: &Path) -> String {
    let abi = ABI::V5;
    let sockets = AccessFs::MakeSock | AccessFs::RemoveFile | AccessFs::ReadDir;
    let attempt = || -> Result<RestrictionStatus, landlock::RulesetError> {
        Ruleset::default()
            .set_compatibility(CompatLevel::BestEffort)
            .handle_access(AccessFs::from_all(abi))?
            .create()?
            .add_rules(path_beneath_rules([gateway_dir], sockets))?
            .add_rules(path_beneath_rules([control_dir], AccessFs::RemoveFile))?
            .restrict_self()
    };
    match attempt() {
        Ok(status) => match status.ruleset {
            RulesetStatus::FullyEnforced => "enforced".into(),
            RulesetStatus::PartiallyEnforced => "partial".into(),
            RulesetStatus::NotEnforced => {
                "unsupported: this kernel has no landlock (or it is disabled)".into()
            }
        },
        Err(e) => format!("unsupported: {e}"),
    }
}

/// Everything, in order; what could not be applied is reported, and a failure of the
/// mandatory parts (no_new_privs, seccomp) is an error.
pub fn apply(gateway_dir: &Path, control_dir: &Path) -> Result<Confinement, ConfineError> {
    set_no_new_privs()?;
    let landlock = landlock(gateway_dir, control_dir);
    install_seccomp()?;
    Ok(Confinement { landlock, seccomp: true, no_new_privs: true })
}

/// What `--no-confine` reports.
pub fn skipped() -> Confinement {
    Confinement {
        landlock: "unsupported: disabled by --no-confine".into(),
        seccomp: false,
        no_new_privs: false,
    }
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
        let report = apply(&eg, &control).unwrap();
        assert!(report.seccomp && report.no_new_privs);
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
