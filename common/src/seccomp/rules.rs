//! The rule tables of the three profiles, as pure data.
//!
//! Each [`Rule`] says which syscall is refused, under which argument condition, and with
//! which errno. Compilation to BPF lives in [`super::bpf`]; nothing here touches the kernel.

use super::syscalls::{self as sc, Syscall};
use super::{Arch, Profile};

/// `ioctl` request that pushes a byte into the terminal's input queue (a sandbox escape
/// through a shared terminal).
pub const TIOCSTI: u32 = 0x5412;
/// `ioctl` request family for the virtual console (can also inject input).
pub const TIOCLINUX: u32 = 0x541C;
/// `clone` flag that makes a new user namespace (and with it a full capability set).
pub const CLONE_NEWUSER: u32 = 0x1000_0000;
/// The x32 ABI marks its syscall numbers with this bit; x32 calls bypass per-number rules.
pub const X32_SYSCALL_BIT: u32 = 0x4000_0000;

/// Mode bits that make an executable run with its file's owner or group (`S_ISUID`,
/// `S_ISGID`).
pub const SET_ID_BITS: [u32; 2] = [0o4000, 0o2000];
/// Calls that set a file's mode, and the argument that carries it. A sandbox that writes
/// into a caller-made workspace through an idmapped mount writes files owned on disk by the
/// directory's owner, root included (issue #30): a set-user-ID bit there would be a
/// set-user-ID root program on the host, whatever `nosuid` does inside the sandbox.
const MODE_ARGUMENTS: &[(Syscall, u8)] = &[
    (sc::CHMOD, 1),
    (sc::FCHMOD, 1),
    (sc::FCHMODAT, 2),
    (sc::FCHMODAT2, 2),
    (sc::OPEN, 2),
    (sc::OPENAT, 3),
    (sc::CREAT, 1),
    (sc::MKNOD, 1),
    (sc::MKNODAT, 2),
];

pub const AF_UNIX: u32 = 1;
pub const AF_INET: u32 = 2;
pub const AF_INET6: u32 = 10;
pub const AF_NETLINK: u32 = 16;

/// Address families a `network` sandbox may open: the egress bridge needs Unix and IP.
const NETWORK_FAMILIES: &[u32] = &[AF_UNIX, AF_INET, AF_INET6];
/// The NPU driver also talks netlink.
const NPU_FAMILIES: &[u32] = &[AF_UNIX, AF_INET, AF_INET6, AF_NETLINK];

/// When a rule applies to a call of its syscall.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum When {
    /// Every call.
    Always,
    /// The low 32 bits of argument `arg` have every bit of `mask` set.
    ArgHasBits { arg: u8, mask: u32 },
    /// The low 32 bits of argument `arg` equal `value`. Only the low half is compared
    /// because the kernel truncates `ioctl`'s request to `unsigned int`: comparing 64 bits
    /// would let garbage in the high half slip past.
    ArgEquals { arg: u8, value: u32 },
    /// The low 32 bits of argument `arg` are none of `allowed`.
    ArgNotIn { arg: u8, allowed: &'static [u32] },
}

/// One refusal: calls of `syscall` that match `when` fail with `errno`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rule {
    pub syscall: Syscall,
    pub when: When,
    pub errno: i32,
}

impl Rule {
    const fn deny(syscall: Syscall) -> Self {
        Rule { syscall, when: When::Always, errno: libc::EPERM }
    }
    const fn deny_when(syscall: Syscall, when: When) -> Self {
        Rule { syscall, when, errno: libc::EPERM }
    }
}

/// The original runner's x86_64 deny list, in its order (internals §1.2).
const ORIGINAL_X86_64: &[Syscall] = &[
    sc::SOCKET,
    sc::CONNECT,
    sc::ACCEPT,
    sc::BIND,
    sc::LISTEN,
    sc::SOCKETPAIR,
    sc::PTRACE,
    sc::PIVOT_ROOT,
    sc::MOUNT,
    sc::UMOUNT2,
    sc::SWAPON,
    sc::SWAPOFF,
    sc::REBOOT,
    sc::INIT_MODULE,
    sc::DELETE_MODULE,
    sc::KEXEC_LOAD,
    sc::ADD_KEY,
    sc::REQUEST_KEY,
    sc::KEYCTL,
    sc::UNSHARE,
    sc::ACCEPT4,
    sc::PERF_EVENT_OPEN,
    sc::OPEN_BY_HANDLE_AT,
    sc::SETNS,
    sc::PROCESS_VM_READV,
    sc::PROCESS_VM_WRITEV,
    sc::FINIT_MODULE,
    sc::BPF,
    sc::USERFAULTFD,
    sc::IO_URING_SETUP,
    sc::IO_URING_ENTER,
    sc::IO_URING_REGISTER,
];

/// The original runner's aarch64 deny list, in its order (asm-generic numbering).
const ORIGINAL_AARCH64: &[Syscall] = &[
    sc::UMOUNT2,
    sc::MOUNT,
    sc::PIVOT_ROOT,
    sc::UNSHARE,
    sc::KEXEC_LOAD,
    sc::INIT_MODULE,
    sc::DELETE_MODULE,
    sc::PTRACE,
    sc::REBOOT,
    sc::SOCKET,
    sc::SOCKETPAIR,
    sc::BIND,
    sc::LISTEN,
    sc::ACCEPT,
    sc::CONNECT,
    sc::ADD_KEY,
    sc::REQUEST_KEY,
    sc::KEYCTL,
    sc::SWAPON,
    sc::SWAPOFF,
    sc::ACCEPT4,
    sc::OPEN_BY_HANDLE_AT,
    sc::SETNS,
    sc::PROCESS_VM_READV,
    sc::PROCESS_VM_WRITEV,
    sc::KCMP,
    sc::FINIT_MODULE,
    sc::BPF,
    sc::USERFAULTFD,
    sc::IO_URING_SETUP,
    sc::IO_URING_ENTER,
    sc::IO_URING_REGISTER,
];

/// The socket syscalls that the `network` and `npu` profiles stop denying outright
/// (the original's `NETWORK_SYSCALLS`).
const SOCKET_SYSCALLS: &[Syscall] =
    &[sc::SOCKET, sc::CONNECT, sc::ACCEPT, sc::BIND, sc::LISTEN, sc::SOCKETPAIR, sc::ACCEPT4];

/// Unconditional refusals we add to every profile on every architecture, beyond the
/// original's list: the new mount API, filesystem-root and accounting knobs, kernel log,
/// and the ptrace-class calls the original forgot. Entries missing on an arch are skipped.
const ADDED_DENIALS: &[Syscall] = &[
    sc::OPEN_TREE,
    sc::MOVE_MOUNT,
    sc::FSOPEN,
    sc::FSCONFIG,
    sc::FSMOUNT,
    sc::FSPICK,
    sc::MOUNT_SETATTR,
    sc::OPEN_TREE_ATTR,
    sc::CHROOT,
    sc::ACCT,
    sc::QUOTACTL,
    sc::QUOTACTL_FD,
    sc::SYSLOG,
    sc::KCMP,
    sc::LOOKUP_DCOOKIE,
    sc::PERF_EVENT_OPEN,
    sc::KEXEC_FILE_LOAD,
    sc::PIDFD_GETFD,
    sc::PROCESS_MADVISE,
    sc::MODIFY_LDT,
    sc::USELIB,
    sc::IOPL,
    sc::IOPERM,
];

/// The original runner's deny list for `arch`, in its order.
pub fn original_deny_list(arch: Arch) -> &'static [Syscall] {
    match arch {
        Arch::X86_64 => ORIGINAL_X86_64,
        Arch::Aarch64 => ORIGINAL_AARCH64,
    }
}

/// The full rule table of `profile` on `arch`: the original's list first (minus the socket
/// calls for `network`/`npu`), then our additions, then argument filters, each syscall at
/// most once per condition.
pub fn rules(profile: Profile, arch: Arch) -> Vec<Rule> {
    let mut rules: Vec<Rule> = Vec::new();
    let mut push = |rule: Rule| {
        if rule.syscall.number(arch).is_some() && !rules.contains(&rule) {
            rules.push(rule);
        }
    };

    for syscall in original_deny_list(arch) {
        if profile != Profile::Baseline && SOCKET_SYSCALLS.contains(syscall) {
            continue;
        }
        push(Rule::deny(*syscall));
    }
    for syscall in ADDED_DENIALS {
        push(Rule::deny(*syscall));
    }

    // A new user namespace hands the caller every capability inside it: the root of most
    // container escapes. `unshare` is denied outright above; `clone` is needed for threads
    // and processes, so only the flag is refused.
    push(Rule::deny_when(sc::CLONE, When::ArgHasBits { arg: 0, mask: CLONE_NEWUSER }));
    // clone3 passes its flags in a struct that seccomp cannot read. ENOSYS (not EPERM) makes
    // glibc fall back to clone, where the flags are visible to the rule above.
    push(Rule { syscall: sc::CLONE3, when: When::Always, errno: libc::ENOSYS });
    // fallocate reserves blocks without writing them, gigabytes per call (past the end of a
    // file with FALLOC_FL_KEEP_SIZE, which RLIMIT_FSIZE does not check), far faster than
    // the workspace quota's poll can see (issue #14). EOPNOTSUPP, what a filesystem without
    // it answers: glibc's posix_fallocate then writes the blocks, which RLIMIT_FSIZE caps.
    push(Rule { syscall: sc::FALLOCATE, when: When::Always, errno: libc::EOPNOTSUPP });
    // A hard link made in a directory the change journal does not watch yet, written
    // through and removed again, changes its target with no event naming any path the
    // journal watches (issue #31): the workspace's receipt, snapshot and quota would miss
    // it. EXDEV, what a link across filesystems answers, so tools copy instead (git, uv,
    // conda, cp --link fall back to a copy; `ln` says "Invalid cross-device link").
    push(Rule { syscall: sc::LINK, when: When::Always, errno: libc::EXDEV });
    push(Rule { syscall: sc::LINKAT, when: When::Always, errno: libc::EXDEV });
    // No set-user-ID or set-group-ID file is made from inside (see MODE_ARGUMENTS); the
    // kernel refuses the bits in mkdir's mode by itself. openat2 passes its mode in a
    // struct that seccomp cannot read: ENOSYS makes callers fall back to openat.
    for (syscall, arg) in MODE_ARGUMENTS {
        for mask in SET_ID_BITS {
            push(Rule::deny_when(*syscall, When::ArgHasBits { arg: *arg, mask }));
        }
    }
    push(Rule { syscall: sc::OPENAT2, when: When::Always, errno: libc::ENOSYS });
    // Terminal input injection.
    push(Rule::deny_when(sc::IOCTL, When::ArgEquals { arg: 1, value: TIOCSTI }));
    push(Rule::deny_when(sc::IOCTL, When::ArgEquals { arg: 1, value: TIOCLINUX }));

    match profile {
        Profile::Baseline => {}
        Profile::Network => {
            push(Rule::deny_when(sc::SOCKET, When::ArgNotIn { arg: 0, allowed: NETWORK_FAMILIES }));
        }
        Profile::Npu => {
            push(Rule::deny_when(sc::SOCKET, When::ArgNotIn { arg: 0, allowed: NPU_FAMILIES }));
        }
    }
    rules
}

#[cfg(test)]
mod tests {
    use super::*;

    fn numbers(rules: &[Rule], arch: Arch, when: When) -> Vec<u32> {
        rules
            .iter()
            .filter(|r| r.when == when && r.errno == libc::EPERM)
            .filter_map(|r| r.syscall.number(arch))
            .collect()
    }

    /// Internals §1.2: the original's numbers, per arch, are all still denied outright.
    #[test]
    fn baseline_keeps_the_original_list() {
        let x86: &[u32] = &[
            41, 42, 43, 49, 50, 53, 101, 155, 165, 166, 167, 168, 169, 175, 176, 246, 248, 249, 250, 272,
            288, 298, 304, 308, 310, 311, 313, 321, 323, 425, 426, 427,
        ];
        let arm: &[u32] = &[
            39, 40, 41, 97, 104, 105, 106, 117, 142, 198, 199, 200, 201, 202, 203, 217, 218, 219, 224, 225,
            242, 265, 268, 270, 271, 272, 273, 280, 282, 425, 426, 427,
        ];
        for (arch, expected) in [(Arch::X86_64, x86), (Arch::Aarch64, arm)] {
            let denied = numbers(&rules(Profile::Baseline, arch), arch, When::Always);
            assert_eq!(&denied[..expected.len()], expected, "{arch:?} order");
        }
    }

    #[test]
    fn network_and_npu_drop_exactly_the_socket_calls() {
        for arch in [Arch::X86_64, Arch::Aarch64] {
            let base = numbers(&rules(Profile::Baseline, arch), arch, When::Always);
            let sockets: Vec<u32> = SOCKET_SYSCALLS.iter().filter_map(|s| s.number(arch)).collect();
            let expected: Vec<u32> = base.iter().copied().filter(|n| !sockets.contains(n)).collect();
            for profile in [Profile::Network, Profile::Npu] {
                let got = numbers(&rules(profile, arch), arch, When::Always);
                assert_eq!(got, expected, "{profile:?} on {arch:?}");
            }
        }
    }

    #[test]
    fn additions_table() {
        let cases: &[(&str, When, i32)] = &[
            ("clone", When::ArgHasBits { arg: 0, mask: CLONE_NEWUSER }, libc::EPERM),
            ("clone3", When::Always, libc::ENOSYS),
            ("openat2", When::Always, libc::ENOSYS),
            ("fchmodat", When::ArgHasBits { arg: 2, mask: 0o4000 }, libc::EPERM),
            ("fchmodat", When::ArgHasBits { arg: 2, mask: 0o2000 }, libc::EPERM),
            ("fchmod", When::ArgHasBits { arg: 1, mask: 0o4000 }, libc::EPERM),
            ("openat", When::ArgHasBits { arg: 3, mask: 0o4000 }, libc::EPERM),
            ("mknodat", When::ArgHasBits { arg: 2, mask: 0o2000 }, libc::EPERM),
            ("fallocate", When::Always, libc::EOPNOTSUPP),
            ("linkat", When::Always, libc::EXDEV),
            ("ioctl", When::ArgEquals { arg: 1, value: TIOCSTI }, libc::EPERM),
            ("ioctl", When::ArgEquals { arg: 1, value: TIOCLINUX }, libc::EPERM),
            ("open_tree", When::Always, libc::EPERM),
            ("move_mount", When::Always, libc::EPERM),
            ("fsopen", When::Always, libc::EPERM),
            ("fsconfig", When::Always, libc::EPERM),
            ("fsmount", When::Always, libc::EPERM),
            ("fspick", When::Always, libc::EPERM),
            ("mount_setattr", When::Always, libc::EPERM),
            ("chroot", When::Always, libc::EPERM),
            ("acct", When::Always, libc::EPERM),
            ("quotactl", When::Always, libc::EPERM),
            ("syslog", When::Always, libc::EPERM),
            ("kcmp", When::Always, libc::EPERM),
            ("lookup_dcookie", When::Always, libc::EPERM),
            ("perf_event_open", When::Always, libc::EPERM),
        ];
        for profile in [Profile::Baseline, Profile::Network, Profile::Npu] {
            for arch in [Arch::X86_64, Arch::Aarch64] {
                let table = rules(profile, arch);
                for (name, when, errno) in cases {
                    let syscall = sc::by_name(name).unwrap();
                    let rule = Rule { syscall, when: *when, errno: *errno };
                    assert!(table.contains(&rule), "{profile:?}/{arch:?} lacks {rule:?}");
                }
            }
        }
    }

    #[test]
    fn socket_families_per_profile() {
        let family_rule = |profile, arch| {
            rules(profile, arch)
                .into_iter()
                .find(|r| r.syscall == sc::SOCKET && r.when != When::Always)
                .map(|r| r.when)
        };
        for arch in [Arch::X86_64, Arch::Aarch64] {
            assert_eq!(family_rule(Profile::Baseline, arch), None);
            assert_eq!(
                family_rule(Profile::Network, arch),
                Some(When::ArgNotIn { arg: 0, allowed: &[AF_UNIX, AF_INET, AF_INET6] })
            );
            assert_eq!(
                family_rule(Profile::Npu, arch),
                Some(When::ArgNotIn { arg: 0, allowed: &[AF_UNIX, AF_INET, AF_INET6, AF_NETLINK] })
            );
        }
    }

    #[test]
    fn x86_only_calls_are_skipped_on_aarch64() {
        let table = rules(Profile::Baseline, Arch::Aarch64);
        assert!(table.iter().all(|r| r.syscall.aarch64.is_some()));
        assert!(rules(Profile::Baseline, Arch::X86_64).iter().any(|r| r.syscall == sc::MODIFY_LDT));
    }
}
