//! Syscall numbers for the two architectures we build filters for.
//!
//! Kept as our own table (not `libc::SYS_*`) because a filter for aarch64 must be buildable
//! and testable on an x86_64 host and vice versa. A unit test checks the host column against
//! `libc`.

use super::Arch;

/// A syscall we name in a rule, with its number on each architecture (`None`: absent there).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Syscall {
    pub name: &'static str,
    pub x86_64: Option<u32>,
    pub aarch64: Option<u32>,
}

impl Syscall {
    /// The number on `arch`, if the syscall exists there.
    pub fn number(&self, arch: Arch) -> Option<u32> {
        match arch {
            Arch::X86_64 => self.x86_64,
            Arch::Aarch64 => self.aarch64,
        }
    }
}

macro_rules! syscalls {
    ($($ident:ident = $name:literal : $x:expr, $a:expr;)*) => {
        $(pub const $ident: Syscall = Syscall { name: $name, x86_64: $x, aarch64: $a };)*
        /// Every syscall this module knows, for lookups by name in tests and tools.
        pub const ALL: &[Syscall] = &[$($ident),*];
    };
}

syscalls! {
    // Sockets (the baseline denies all of them; `network`/`npu` filter socket families).
    SOCKET = "socket": Some(41), Some(198);
    CONNECT = "connect": Some(42), Some(203);
    ACCEPT = "accept": Some(43), Some(202);
    BIND = "bind": Some(49), Some(200);
    LISTEN = "listen": Some(50), Some(201);
    SOCKETPAIR = "socketpair": Some(53), Some(199);
    ACCEPT4 = "accept4": Some(288), Some(242);
    // The original runner's deny list, beyond sockets.
    PTRACE = "ptrace": Some(101), Some(117);
    PIVOT_ROOT = "pivot_root": Some(155), Some(41);
    MOUNT = "mount": Some(165), Some(40);
    UMOUNT2 = "umount2": Some(166), Some(39);
    SWAPON = "swapon": Some(167), Some(224);
    SWAPOFF = "swapoff": Some(168), Some(225);
    REBOOT = "reboot": Some(169), Some(142);
    INIT_MODULE = "init_module": Some(175), Some(105);
    DELETE_MODULE = "delete_module": Some(176), Some(106);
    KEXEC_LOAD = "kexec_load": Some(246), Some(104);
    ADD_KEY = "add_key": Some(248), Some(217);
    REQUEST_KEY = "request_key": Some(249), Some(218);
    KEYCTL = "keyctl": Some(250), Some(219);
    UNSHARE = "unshare": Some(272), Some(97);
    PERF_EVENT_OPEN = "perf_event_open": Some(298), Some(241);
    OPEN_BY_HANDLE_AT = "open_by_handle_at": Some(304), Some(265);
    SETNS = "setns": Some(308), Some(268);
    PROCESS_VM_READV = "process_vm_readv": Some(310), Some(270);
    PROCESS_VM_WRITEV = "process_vm_writev": Some(311), Some(271);
    KCMP = "kcmp": Some(312), Some(272);
    FINIT_MODULE = "finit_module": Some(313), Some(273);
    BPF = "bpf": Some(321), Some(280);
    USERFAULTFD = "userfaultfd": Some(323), Some(282);
    IO_URING_SETUP = "io_uring_setup": Some(425), Some(425);
    IO_URING_ENTER = "io_uring_enter": Some(426), Some(426);
    IO_URING_REGISTER = "io_uring_register": Some(427), Some(427);
    // What we add: the holes the original leaves open.
    CLONE = "clone": Some(56), Some(220);
    CLONE3 = "clone3": Some(435), Some(435);
    FALLOCATE = "fallocate": Some(285), Some(47);
    LINK = "link": Some(86), None;
    LINKAT = "linkat": Some(265), Some(37);
    IOCTL = "ioctl": Some(16), Some(29);
    OPEN_TREE = "open_tree": Some(428), Some(428);
    MOVE_MOUNT = "move_mount": Some(429), Some(429);
    FSOPEN = "fsopen": Some(430), Some(430);
    FSCONFIG = "fsconfig": Some(431), Some(431);
    FSMOUNT = "fsmount": Some(432), Some(432);
    FSPICK = "fspick": Some(433), Some(433);
    MOUNT_SETATTR = "mount_setattr": Some(442), Some(442);
    OPEN_TREE_ATTR = "open_tree_attr": Some(467), Some(467);
    CHROOT = "chroot": Some(161), Some(51);
    ACCT = "acct": Some(163), Some(89);
    QUOTACTL = "quotactl": Some(179), Some(60);
    QUOTACTL_FD = "quotactl_fd": Some(443), Some(443);
    SYSLOG = "syslog": Some(103), Some(116);
    LOOKUP_DCOOKIE = "lookup_dcookie": Some(212), Some(18);
    KEXEC_FILE_LOAD = "kexec_file_load": Some(320), Some(294);
    PIDFD_GETFD = "pidfd_getfd": Some(438), Some(438);
    PROCESS_MADVISE = "process_madvise": Some(440), Some(440);
    MODIFY_LDT = "modify_ldt": Some(154), None;
    USELIB = "uselib": Some(134), None;
    IOPL = "iopl": Some(172), None;
    IOPERM = "ioperm": Some(173), None;
    // Calls whose mode argument may carry set-user-ID or set-group-ID bits.
    CHMOD = "chmod": Some(90), None;
    FCHMOD = "fchmod": Some(91), Some(52);
    FCHMODAT = "fchmodat": Some(268), Some(53);
    FCHMODAT2 = "fchmodat2": Some(452), Some(452);
    OPEN = "open": Some(2), None;
    OPENAT = "openat": Some(257), Some(56);
    OPENAT2 = "openat2": Some(437), Some(437);
    CREAT = "creat": Some(85), None;
    MKNOD = "mknod": Some(133), None;
    MKNODAT = "mknodat": Some(259), Some(33);
}

/// Looks a syscall up by name.
pub fn by_name(name: &str) -> Option<Syscall> {
    ALL.iter().copied().find(|s| s.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique() {
        let mut names: Vec<_> = ALL.iter().map(|s| s.name).collect();
        names.sort_unstable();
        let before = names.len();
        names.dedup();
        assert_eq!(before, names.len());
    }

    #[test]
    fn numbers_are_unique_per_arch() {
        for arch in [Arch::X86_64, Arch::Aarch64] {
            let mut numbers: Vec<_> = ALL.iter().filter_map(|s| s.number(arch)).collect();
            numbers.sort_unstable();
            let before = numbers.len();
            numbers.dedup();
            assert_eq!(before, numbers.len(), "duplicate number on {arch:?}");
        }
    }

    /// The host column must agree with the C library's headers.
    #[test]
    fn host_column_matches_libc() {
        let Ok(host) = Arch::host() else { return };
        let libc_table: &[(&str, libc::c_long)] = &[
            ("socket", libc::SYS_socket),
            ("connect", libc::SYS_connect),
            ("accept", libc::SYS_accept),
            ("bind", libc::SYS_bind),
            ("listen", libc::SYS_listen),
            ("socketpair", libc::SYS_socketpair),
            ("accept4", libc::SYS_accept4),
            ("ptrace", libc::SYS_ptrace),
            ("pivot_root", libc::SYS_pivot_root),
            ("mount", libc::SYS_mount),
            ("umount2", libc::SYS_umount2),
            ("swapon", libc::SYS_swapon),
            ("swapoff", libc::SYS_swapoff),
            ("reboot", libc::SYS_reboot),
            ("init_module", libc::SYS_init_module),
            ("delete_module", libc::SYS_delete_module),
            ("kexec_load", libc::SYS_kexec_load),
            ("add_key", libc::SYS_add_key),
            ("request_key", libc::SYS_request_key),
            ("keyctl", libc::SYS_keyctl),
            ("unshare", libc::SYS_unshare),
            ("perf_event_open", libc::SYS_perf_event_open),
            ("open_by_handle_at", libc::SYS_open_by_handle_at),
            ("setns", libc::SYS_setns),
            ("process_vm_readv", libc::SYS_process_vm_readv),
            ("process_vm_writev", libc::SYS_process_vm_writev),
            ("kcmp", libc::SYS_kcmp),
            ("finit_module", libc::SYS_finit_module),
            ("bpf", libc::SYS_bpf),
            ("userfaultfd", libc::SYS_userfaultfd),
            ("io_uring_setup", libc::SYS_io_uring_setup),
            ("io_uring_enter", libc::SYS_io_uring_enter),
            ("io_uring_register", libc::SYS_io_uring_register),
            ("clone", libc::SYS_clone),
            ("clone3", libc::SYS_clone3),
            ("fallocate", libc::SYS_fallocate),
            ("linkat", libc::SYS_linkat),
            ("ioctl", libc::SYS_ioctl),
            ("open_tree", libc::SYS_open_tree),
            ("move_mount", libc::SYS_move_mount),
            ("fsopen", libc::SYS_fsopen),
            ("fsconfig", libc::SYS_fsconfig),
            ("fsmount", libc::SYS_fsmount),
            ("fspick", libc::SYS_fspick),
            ("mount_setattr", libc::SYS_mount_setattr),
            ("chroot", libc::SYS_chroot),
            ("acct", libc::SYS_acct),
            ("quotactl", libc::SYS_quotactl),
            ("quotactl_fd", libc::SYS_quotactl_fd),
            ("syslog", libc::SYS_syslog),
            ("lookup_dcookie", libc::SYS_lookup_dcookie),
            ("kexec_file_load", libc::SYS_kexec_file_load),
            ("pidfd_getfd", libc::SYS_pidfd_getfd),
            ("process_madvise", libc::SYS_process_madvise),
            ("fchmod", libc::SYS_fchmod),
            ("fchmodat", libc::SYS_fchmodat),
            ("fchmodat2", libc::SYS_fchmodat2),
            ("openat", libc::SYS_openat),
            ("openat2", libc::SYS_openat2),
            ("mknodat", libc::SYS_mknodat),
        ];
        for (name, number) in libc_table {
            let ours = by_name(name).and_then(|s| s.number(host));
            assert_eq!(ours, u32::try_from(*number).ok(), "{name} on {host:?}");
        }
        // open_tree_attr (Linux 6.15) is newer than this libc's tables.
        assert_eq!(OPEN_TREE_ATTR.number(host), Some(467));
        assert_eq!(libc_table.len() + 1 + x86_only(host), ALL.len());
    }

    fn x86_only(host: Arch) -> usize {
        let only: Vec<_> = ALL.iter().filter(|s| s.aarch64.is_none()).collect();
        match host {
            Arch::X86_64 => {
                #[cfg(target_arch = "x86_64")]
                {
                    assert_eq!(MODIFY_LDT.x86_64, u32::try_from(libc::SYS_modify_ldt).ok());
                    assert_eq!(USELIB.x86_64, u32::try_from(libc::SYS_uselib).ok());
                    assert_eq!(IOPL.x86_64, u32::try_from(libc::SYS_iopl).ok());
                    assert_eq!(IOPERM.x86_64, u32::try_from(libc::SYS_ioperm).ok());
                    assert_eq!(CHMOD.x86_64, u32::try_from(libc::SYS_chmod).ok());
                    assert_eq!(OPEN.x86_64, u32::try_from(libc::SYS_open).ok());
                    assert_eq!(CREAT.x86_64, u32::try_from(libc::SYS_creat).ok());
                    assert_eq!(MKNOD.x86_64, u32::try_from(libc::SYS_mknod).ok());
                    assert_eq!(LINK.x86_64, u32::try_from(libc::SYS_link).ok());
                }
                only.len()
            }
            Arch::Aarch64 => only.len(),
        }
    }
}
