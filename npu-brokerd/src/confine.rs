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

use std::collections::BTreeMap;
use std::path::Path;

use common::npu::Confinement;
use landlock::{
    ABI, Access, AccessFs, CompatLevel, Compatible, RulesetAttr, RulesetCreatedAttr, RulesetStatus,
    path_beneath_rules,
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

/// The calls neither the broker nor a job needs (numbers for the build architecture).
pub fn denied_syscalls() -> Vec<i64> {
    let mut calls = vec![
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
    calls.extend([libc::SYS_kexec_file_load, libc::SYS_iopl, libc::SYS_ioperm]);
    calls
}

const NAMESPACE_FLAGS: [u64; 7] = [
    libc::CLONE_NEWUSER as u64,
    libc::CLONE_NEWNS as u64,
    libc::CLONE_NEWPID as u64,
    libc::CLONE_NEWNET as u64,
    libc::CLONE_NEWIPC as u64,
    libc::CLONE_NEWUTS as u64,
    libc::CLONE_NEWCGROUP as u64,
];

/// x32 numbers are refused; `clone3` answers ENOSYS so that libc falls back to `clone`,
/// whose flags the filter can read (as egressd's filter does).
fn prelude() -> Vec<seccompiler::sock_filter> {
    const RET_ERRNO: u32 = 0x0005_0000;
    let insn = |code: u16, jt: u8, jf: u8, k: u32| seccompiler::sock_filter { code, jt, jf, k };
    vec![
        insn(0x20, 0, 0, 0),
        insn(0x35, 0, 1, 0x4000_0000),
        insn(0x06, 0, 0, RET_ERRNO | libc::EPERM as u32),
        insn(0x15, 0, 1, libc::SYS_clone3 as u32),
        insn(0x06, 0, 0, RET_ERRNO | libc::ENOSYS as u32),
    ]
}

pub fn program() -> Result<seccompiler::BpfProgram, ConfineError> {
    use seccompiler::{SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompRule};
    let backend = |e| ConfineError::Seccomp(seccompiler::Error::Backend(e));
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
        denied_syscalls().into_iter().map(|n| (n, Vec::new())).collect();
    let clone_rules = NAMESPACE_FLAGS
        .iter()
        .map(|&flag| {
            SeccompRule::new(vec![SeccompCondition::new(
                0,
                SeccompCmpArgLen::Qword,
                SeccompCmpOp::MaskedEq(flag),
                flag,
            )?])
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(backend)?;
    rules.insert(libc::SYS_clone, clone_rules);
    let arch = std::env::consts::ARCH
        .try_into()
        .map_err(|e: seccompiler::BackendError| ConfineError::Seccomp(seccompiler::Error::Backend(e)))?;
    let filter = seccompiler::SeccompFilter::new(
        rules,
        seccompiler::SeccompAction::Allow,
        seccompiler::SeccompAction::Errno(libc::EPERM as u32),
        arch,
    )
    .map_err(backend)?;
    let compiled: seccompiler::BpfProgram = filter.try_into().map_err(backend)?;
    Ok(prelude().into_iter().chain(compiled).collect())
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
    match attempt() {
        Ok(status) => match status.ruleset {
            RulesetStatus::FullyEnforced => "enforced".into(),
            RulesetStatus::PartiallyEnforced => "partial".into(),
            RulesetStatus::NotEnforced => {
                "unsupported: this kernel has no landlock (or it is disabled)".into()
            }
        },
        Err(e) => {
            let e: landlock::RulesetError = e;
            format!("unsupported: {e}")
        }
    }
}

/// Everything, in order; no_new_privs and seccomp are mandatory, landlock is reported.
pub fn apply(writable: &[&Path]) -> Result<Confinement, ConfineError> {
    set_no_new_privs()?;
    let landlock = landlock(writable);
    seccompiler::apply_filter_all_threads(&program()?).map_err(ConfineError::SeccompInstall)?;
    Ok(Confinement { landlock, seccomp: true, no_new_privs: true })
}

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
