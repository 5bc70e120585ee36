//! Every rule, checked by the kernel: each case forks a child, installs the real compiled
//! program of the host architecture, makes the call and reports the errno.
//!
//! To tell a filter's EPERM from the kernel's own EPERM (an unprivileged test run gets EPERM
//! for `mount` with or without a filter), the program is also run "marked": identical except
//! that its EPERM returns carry EHWPOISON, an errno no syscall here produces by itself.
//! Arguments are invalid on purpose (-1 everywhere), so a rule that failed to fire would
//! still do no harm to the machine running the tests.

use seccompiler::sock_filter;

use super::bpf::{SECCOMP_RET_ERRNO, compile};
use super::rules::{self, AF_INET, AF_INET6, AF_NETLINK, AF_UNIX, TIOCSTI, When, X32_SYSCALL_BIT};
use super::syscalls as sc;
use super::{Arch, Profile};

const MARK: i32 = libc::EHWPOISON;

#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Errno(i32),
    Ok,
    Killed(i32),
}

fn marked(program: &[sock_filter]) -> Vec<sock_filter> {
    let marked: Vec<sock_filter> = program
        .iter()
        .map(|i| {
            let mut i = i.clone();
            if i.code == 0x06 && i.k == SECCOMP_RET_ERRNO | libc::EPERM as u32 {
                i.k = SECCOMP_RET_ERRNO | MARK as u32;
            }
            i
        })
        .collect();
    marked
}

#[test]
fn program_marked_matches_the_test_marking() {
    let program = compile(Profile::Network, host()).unwrap();
    assert_eq!(program.marked(MARK).instructions(), marked(program.instructions()).as_slice());
    assert_ne!(program.marked(MARK).bytes(), program.bytes());
}

/// Forks; the child installs `program`, calls `nr(args)` and exits with the errno.
fn call_in_child(program: &[sock_filter], nr: u32, args: [u64; 6]) -> Outcome {
    let prog = libc::sock_fprog {
        len: u16::try_from(program.len()).unwrap(),
        filter: program.as_ptr() as *mut libc::sock_filter,
    };
    // SAFETY: the child only makes raw syscalls (async-signal-safe) and leaves with _exit.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        // SAFETY: plain prctl/syscall invocations on values that live until _exit.
        unsafe {
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
                libc::_exit(200);
            }
            if libc::prctl(libc::PR_SET_SECCOMP, libc::SECCOMP_MODE_FILTER, &prog) != 0 {
                libc::_exit(201);
            }
            let r = libc::syscall(i64::from(nr), args[0], args[1], args[2], args[3], args[4], args[5]);
            let code = if r == -1 { *libc::__errno_location() } else { 0 };
            libc::_exit(code & 0xff);
        }
    }
    let mut status = 0;
    // SAFETY: waiting for the child we just forked.
    let waited = unsafe { libc::waitpid(pid, &mut status, 0) };
    assert_eq!(waited, pid);
    if libc::WIFSIGNALED(status) {
        return Outcome::Killed(libc::WTERMSIG(status));
    }
    match libc::WEXITSTATUS(status) {
        200 | 201 => panic!("could not install the filter in the child"),
        0 => Outcome::Ok,
        e => Outcome::Errno(e),
    }
}

fn host() -> Arch {
    Arch::host().expect("tests run on x86_64 or aarch64")
}

/// Each rule of each profile fires in the kernel with the rule's errno.
#[test]
fn every_rule_fires_in_the_kernel() {
    let arch = host();
    for profile in Profile::ALL {
        let program = compile(profile, arch).unwrap();
        let marked = marked(program.instructions());
        for rule in rules::rules(profile, arch) {
            let nr = rule.syscall.number(arch).unwrap();
            let mut args = [u64::MAX; 6];
            match rule.when {
                When::Always => {}
                When::ArgHasBits { arg, mask } => args[arg as usize] = u64::from(mask) | 0xff,
                When::ArgEquals { arg, value } => args[arg as usize] = u64::from(value),
                When::ArgNotIn { arg, .. } => args[arg as usize] = 17, // AF_PACKET
            }
            if rule.syscall == sc::IOCTL {
                args[0] = 0; // a terminal-or-not fd; the filter answers before the driver
            }
            let expected = if rule.errno == libc::EPERM { MARK } else { rule.errno };
            let got = call_in_child(&marked, nr, args);
            assert_eq!(got, Outcome::Errno(expected), "{profile}: {} {:?}", rule.syscall.name, rule.when);
        }
    }
}

#[test]
fn the_unmarked_program_answers_eperm_and_enosys() {
    let arch = host();
    let program = compile(Profile::Baseline, arch).unwrap();
    let p = program.instructions();
    let nr = |s: sc::Syscall| s.number(arch).unwrap();
    assert_eq!(call_in_child(p, nr(sc::PTRACE), [u64::MAX; 6]), Outcome::Errno(libc::EPERM));
    assert_eq!(call_in_child(p, nr(sc::BPF), [u64::MAX; 6]), Outcome::Errno(libc::EPERM));
    assert_eq!(call_in_child(p, nr(sc::CLONE3), [u64::MAX; 6]), Outcome::Errno(libc::ENOSYS));
    assert_eq!(call_in_child(p, nr(sc::FALLOCATE), [u64::MAX; 6]), Outcome::Errno(libc::EOPNOTSUPP));
    assert_eq!(call_in_child(p, nr(sc::LINKAT), [u64::MAX; 6]), Outcome::Errno(libc::EXDEV));
    assert_eq!(
        call_in_child(p, nr(sc::SOCKET), [AF_UNIX as u64, 1, 0, 0, 0, 0]),
        Outcome::Errno(libc::EPERM)
    );
}

#[test]
fn what_the_rules_leave_alone_still_works() {
    let arch = host();
    let nr = |s: sc::Syscall| s.number(arch).unwrap();
    for profile in [Profile::Network, Profile::Npu] {
        let marked = marked(compile(profile, arch).unwrap().instructions());
        for family in [AF_UNIX, AF_INET, AF_INET6] {
            let got = call_in_child(&marked, nr(sc::SOCKET), [u64::from(family), 1, 0, 0, 0, 0]);
            assert_eq!(got, Outcome::Ok, "{profile} socket({family})");
        }
        let netlink = call_in_child(&marked, nr(sc::SOCKET), [u64::from(AF_NETLINK), 3, 0, 0, 0, 0]);
        let expected = if profile == Profile::Npu { Outcome::Ok } else { Outcome::Errno(MARK) };
        assert_eq!(netlink, expected, "{profile} netlink");
    }
    let marked = marked(compile(Profile::Baseline, arch).unwrap().instructions());
    // ioctl with another request reaches the kernel (EBADF on fd -1), as does plain clone
    // flags that do not ask for a user namespace (EINVAL for this nonsense combination).
    let tcgets = call_in_child(&marked, nr(sc::IOCTL), [u64::MAX, 0x5401, 0, 0, 0, 0]);
    assert_eq!(tcgets, Outcome::Errno(libc::EBADF));
    let high_garbage = call_in_child(&marked, nr(sc::IOCTL), [0, 1 << 32 | u64::from(TIOCSTI), 0, 0, 0, 0]);
    assert_eq!(high_garbage, Outcome::Errno(MARK), "TIOCSTI with garbage in the high half");
    let sighand_without_vm = call_in_child(&marked, nr(sc::CLONE), [0x800, 0, 0, 0, 0, 0]);
    assert_eq!(sighand_without_vm, Outcome::Errno(libc::EINVAL));
    let getpid = u32::try_from(libc::SYS_getpid).unwrap();
    assert_eq!(call_in_child(&marked, getpid, [0; 6]), Outcome::Ok);
}

#[cfg(target_arch = "x86_64")]
#[test]
fn x32_numbers_are_refused_in_the_kernel() {
    let marked = marked(compile(Profile::Baseline, Arch::X86_64).unwrap().instructions());
    // x32 getpid: refused by the guard whether or not the kernel has x32 enabled.
    assert_eq!(call_in_child(&marked, X32_SYSCALL_BIT | 39, [0; 6]), Outcome::Errno(MARK));
    assert_eq!(call_in_child(&marked, 39, [0; 6]), Outcome::Ok);
}

#[test]
fn a_foreign_architecture_is_killed_in_the_kernel() {
    let foreign = match host() {
        Arch::X86_64 => Arch::Aarch64,
        Arch::Aarch64 => Arch::X86_64,
    };
    let program = compile(Profile::Baseline, foreign).unwrap();
    assert_eq!(call_in_child(program.instructions(), 39, [0; 6]), Outcome::Killed(libc::SIGSYS));
}
