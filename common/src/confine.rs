//! What the helper daemons (egressd, npu-brokerd) share to confine themselves after start-up
//! (R-OPS-3): `no_new_privs`, a seccomp *deny* list with the same prelude and `clone` rules,
//! and the report of the landlock outcome. Each daemon keeps its own policy — which calls it
//! adds to the list, which paths landlock leaves writable — and its own tests that try the
//! forbidden things from a confined child.
//!
//! A deny list rather than an allow list: tokio and glibc pick their syscalls by kernel
//! version, and a daemon killed by a missing entry would take every sandbox's network (or
//! every NPU job) with it.

use std::collections::BTreeMap;

pub use crate::confinement::Confinement;

/// Calls no helper daemon (nor anything it runs) needs: namespaces and mounts, ptrace and
/// cross-process memory, kernel modules, BPF, keyrings, io_uring, clocks, swap, reboot
/// (numbers for the build architecture). Daemons add their own ([`deny_program`]).
pub fn denied_to_every_daemon() -> Vec<i64> {
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

/// The deny list compiled for this architecture: EPERM for `denied` and for
/// namespace-creating `clone`, allow the rest; after [`prelude`].
pub fn deny_program(denied: Vec<i64>) -> Result<seccompiler::BpfProgram, seccompiler::Error> {
    let backend = seccompiler::Error::Backend;
    let mut rules: BTreeMap<i64, Vec<seccompiler::SeccompRule>> =
        denied.into_iter().map(|n| (n, Vec::new())).collect();
    rules.insert(libc::SYS_clone, clone_rules().map_err(backend)?);
    let arch = std::env::consts::ARCH.try_into().map_err(backend)?;
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

/// `PR_SET_NO_NEW_PRIVS`: nothing the process execs gains privileges (setuid, file caps).
pub fn set_no_new_privs() -> std::io::Result<()> {
    // SAFETY: prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) takes no pointers and only sets a
    // process flag.
    crate::sys::cvt(unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) })?;
    Ok(())
}

/// A landlock attempt as `/health` reports it: `enforced`, `partial`, or
/// `unsupported: <why>` — never assumed.
#[cfg(feature = "confine")]
pub fn landlock_outcome(attempt: Result<landlock::RestrictionStatus, landlock::RulesetError>) -> String {
    match attempt {
        Ok(status) => match status.ruleset {
            landlock::RulesetStatus::FullyEnforced => "enforced".into(),
            landlock::RulesetStatus::PartiallyEnforced => "partial".into(),
            landlock::RulesetStatus::NotEnforced => {
                "unsupported: this kernel has no landlock (or it is disabled)".into()
            }
        },
        Err(e) => format!("unsupported: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shared_deny_list_compiles_for_this_architecture() {
        let denied = denied_to_every_daemon();
        let n = denied.len();
        assert!(deny_program(denied).unwrap().len() > n + prelude().len());
    }
}
