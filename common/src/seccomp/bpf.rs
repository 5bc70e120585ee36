//! Compiles a rule table to one classic BPF program.
//!
//! seccompiler builds a filter with a single on-match action, so the program is assembled
//! in two parts:
//!
//! 1. A hand-written prologue: check the architecture (foreign → kill the process), load the
//!    syscall number, refuse x32-ABI numbers on x86_64 (EPERM), and return the rules whose
//!    errno is not EPERM (`clone3` → ENOSYS).
//! 2. The seccompiler program for every EPERM rule, argument conditions included, with
//!    "allow" as the default. It starts with its own architecture check and number load.
//!
//! BPF jumps are relative and only go forward, so the seccompiler program works unchanged
//! after the prologue: control reaches its first instruction by falling through.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule,
    TargetArch, sock_filter,
};

use super::rules::{self, Rule, When, X32_SYSCALL_BIT};
use super::{Arch, Profile, SeccompError};

pub const BPF_LD_W_ABS: u16 = 0x20;
pub const BPF_JMP_JEQ_K: u16 = 0x15;
pub const BPF_JMP_JSET_K: u16 = 0x45;
pub const BPF_RET_K: u16 = 0x06;

pub const SECCOMP_RET_KILL_PROCESS: u32 = 0x8000_0000;
pub const SECCOMP_RET_ERRNO: u32 = 0x0005_0000;
pub const SECCOMP_RET_ALLOW: u32 = 0x7fff_0000;

/// Offsets into `struct seccomp_data`.
pub const DATA_NR: u32 = 0;
pub const DATA_ARCH: u32 = 4;

/// A compiled filter: the instructions and their wire form (8 bytes each, little-endian),
/// which is what bwrap reads from `--seccomp <fd>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Program {
    instructions: Vec<sock_filter>,
    bytes: Vec<u8>,
}

impl Program {
    fn new(instructions: Vec<sock_filter>) -> Self {
        let bytes = instructions
            .iter()
            .flat_map(|i| {
                let mut b = [0u8; 8];
                b[0..2].copy_from_slice(&i.code.to_le_bytes());
                b[2] = i.jt;
                b[3] = i.jf;
                b[4..8].copy_from_slice(&i.k.to_le_bytes());
                b
            })
            .collect();
        Program { instructions, bytes }
    }

    pub fn instructions(&self) -> &[sock_filter] {
        &self.instructions
    }

    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The same program with every EPERM return answering `errno` instead. Tests run this
    /// "marked" variant to tell the filter's refusals from the kernel's own EPERM (a process
    /// without capabilities gets EPERM for `mount` with or without a filter).
    pub fn marked(&self, errno: i32) -> Program {
        let eperm = errno_ret(libc::EPERM);
        Program::new(
            self.instructions
                .iter()
                .map(|i| {
                    let mut i = i.clone();
                    if i.code == BPF_RET_K && i.k == eperm {
                        i.k = errno_ret(errno);
                    }
                    i
                })
                .collect(),
        )
    }
}

fn stmt(code: u16, k: u32) -> sock_filter {
    sock_filter { code, jt: 0, jf: 0, k }
}

fn jump(code: u16, k: u32, jt: u8, jf: u8) -> sock_filter {
    sock_filter { code, jt, jf, k }
}

fn errno_ret(errno: i32) -> u32 {
    SECCOMP_RET_ERRNO | (errno as u32 & 0xffff)
}

/// Builds the program of `profile` for `arch`.
pub fn compile(profile: Profile, arch: Arch) -> Result<Program, SeccompError> {
    let table = rules::rules(profile, arch);
    let table_err = |reason: String| SeccompError::Table { profile, arch: arch.name(), reason };

    let mut program = vec![
        stmt(BPF_LD_W_ABS, DATA_ARCH),
        jump(BPF_JMP_JEQ_K, arch.audit_arch(), 1, 0),
        stmt(BPF_RET_K, SECCOMP_RET_KILL_PROCESS),
        stmt(BPF_LD_W_ABS, DATA_NR),
    ];
    if arch == Arch::X86_64 {
        program.push(jump(BPF_JMP_JSET_K, X32_SYSCALL_BIT, 0, 1));
        program.push(stmt(BPF_RET_K, errno_ret(libc::EPERM)));
    }

    let mut eperm: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    let mut unconditional: Vec<i64> = Vec::new();
    for Rule { syscall, when, errno } in &table {
        let Some(nr) = syscall.number(arch) else { continue };
        if *errno != libc::EPERM {
            if *when != When::Always {
                return Err(table_err(format!(
                    "{} returns errno {errno} under an argument condition; only EPERM rules may have conditions",
                    syscall.name
                )));
            }
            program.push(jump(BPF_JMP_JEQ_K, nr, 0, 1));
            program.push(stmt(BPF_RET_K, errno_ret(*errno)));
            continue;
        }
        let nr = i64::from(nr);
        match when {
            When::Always => unconditional.push(nr),
            conditional => {
                let conditions = conditions(*conditional).map_err(|e| table_err(e.to_string()))?;
                let rule = SeccompRule::new(conditions).map_err(|e| table_err(e.to_string()))?;
                eperm.entry(nr).or_default().push(rule);
            }
        }
    }
    // An unconditional denial wins over any conditional one (an empty chain matches always).
    for nr in unconditional {
        eperm.insert(nr, Vec::new());
    }

    let target = match arch {
        Arch::X86_64 => TargetArch::x86_64,
        Arch::Aarch64 => TargetArch::aarch64,
    };
    let filter =
        SeccompFilter::new(eperm, SeccompAction::Allow, SeccompAction::Errno(libc::EPERM as u32), target)
            .map_err(|source| SeccompError::Compile { profile, arch: arch.name(), source })?;
    let body: BpfProgram =
        filter.try_into().map_err(|source| SeccompError::Compile { profile, arch: arch.name(), source })?;
    program.extend(body);
    if program.len() > 4096 {
        return Err(table_err(format!("{} instructions exceed the kernel's 4096", program.len())));
    }
    Ok(Program::new(program))
}

fn conditions(when: When) -> Result<Vec<SeccompCondition>, seccompiler::BackendError> {
    let low = SeccompCmpArgLen::Dword;
    match when {
        When::Always => Ok(Vec::new()),
        When::ArgHasBits { arg, mask } => Ok(vec![SeccompCondition::new(
            arg,
            low,
            SeccompCmpOp::MaskedEq(u64::from(mask)),
            u64::from(mask),
        )?]),
        When::ArgEquals { arg, value } => {
            Ok(vec![SeccompCondition::new(arg, low, SeccompCmpOp::Eq, u64::from(value))?])
        }
        When::ArgNotIn { arg, allowed } => allowed
            .iter()
            .map(|v| SeccompCondition::new(arg, low.clone(), SeccompCmpOp::Ne, u64::from(*v)))
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::super::interp::{Data, run};
    use super::super::rules::{AF_INET, AF_NETLINK, AF_UNIX, CLONE_NEWUSER, TIOCLINUX, TIOCSTI};
    use super::super::syscalls as sc;
    use super::*;

    const ARCHES: [Arch; 2] = [Arch::X86_64, Arch::Aarch64];
    const EPERM: u32 = SECCOMP_RET_ERRNO | 1;
    const ENOSYS: u32 = SECCOMP_RET_ERRNO | 38;

    fn eval(profile: Profile, arch: Arch, nr: u32, args: [u64; 6]) -> u32 {
        let program = compile(profile, arch).unwrap();
        run(program.instructions(), &Data { nr, arch: arch.audit_arch(), args })
    }

    fn nr(name: &str, arch: Arch) -> u32 {
        sc::by_name(name).unwrap().number(arch).unwrap()
    }

    /// Every rule of every table, evaluated on the compiled program of both architectures.
    #[test]
    fn every_rule_is_enforced_by_the_compiled_program() {
        for profile in Profile::ALL {
            for arch in ARCHES {
                for rule in rules::rules(profile, arch) {
                    let number = rule.syscall.number(arch).unwrap();
                    let expected = errno_ret(rule.errno);
                    let (hit, miss): ([u64; 6], Option<[u64; 6]>) = match rule.when {
                        When::Always => ([0; 6], None),
                        When::ArgHasBits { arg, mask } => {
                            let mut hit = [0; 6];
                            hit[arg as usize] = u64::from(mask) | 0x11;
                            (hit, Some([0x11; 6]))
                        }
                        When::ArgEquals { arg, value } => {
                            let mut hit = [0; 6];
                            // Garbage in the high half must not matter (the kernel truncates).
                            hit[arg as usize] = 0xdead_beef_0000_0000 | u64::from(value);
                            let mut miss = [0; 6];
                            miss[arg as usize] = u64::from(value) + 1;
                            (hit, Some(miss))
                        }
                        When::ArgNotIn { arg, allowed } => {
                            let mut hit = [0; 6];
                            hit[arg as usize] = 17; // AF_PACKET
                            let mut miss = [0; 6];
                            miss[arg as usize] = u64::from(allowed[0]);
                            (hit, Some(miss))
                        }
                    };
                    let name = rule.syscall.name;
                    assert_eq!(eval(profile, arch, number, hit), expected, "{profile}/{arch:?} {name} hit");
                    if let Some(miss) = miss {
                        let got = eval(profile, arch, number, miss);
                        assert_eq!(got, SECCOMP_RET_ALLOW, "{profile}/{arch:?} {name} miss");
                    }
                }
            }
        }
    }

    #[test]
    fn foreign_architecture_is_killed() {
        for profile in Profile::ALL {
            for arch in ARCHES {
                let program = compile(profile, arch).unwrap();
                let i386 = 0x4000_0003;
                let got = run(program.instructions(), &Data { nr: 1, arch: i386, args: [0; 6] });
                assert_eq!(got, SECCOMP_RET_KILL_PROCESS);
            }
        }
    }

    #[test]
    fn x32_numbers_are_refused_on_x86_64() {
        for profile in Profile::ALL {
            // x32 getpid; the plain number would be allowed.
            assert_eq!(eval(profile, Arch::X86_64, X32_SYSCALL_BIT | 39, [0; 6]), EPERM);
            assert_eq!(eval(profile, Arch::X86_64, 39, [0; 6]), SECCOMP_RET_ALLOW);
        }
    }

    #[test]
    fn table_of_decisions() {
        let cases: &[(Profile, &str, [u64; 6], u32)] = &[
            (Profile::Baseline, "socket", [AF_UNIX as u64, 1, 0, 0, 0, 0], EPERM),
            (Profile::Baseline, "socket", [AF_INET as u64, 1, 0, 0, 0, 0], EPERM),
            (Profile::Network, "socket", [AF_UNIX as u64, 1, 0, 0, 0, 0], SECCOMP_RET_ALLOW),
            (Profile::Network, "socket", [AF_INET as u64, 1, 0, 0, 0, 0], SECCOMP_RET_ALLOW),
            (Profile::Network, "socket", [10, 1, 0, 0, 0, 0], SECCOMP_RET_ALLOW),
            (Profile::Network, "socket", [AF_NETLINK as u64, 3, 0, 0, 0, 0], EPERM),
            (Profile::Network, "socket", [17, 3, 0, 0, 0, 0], EPERM),
            (Profile::Npu, "socket", [AF_NETLINK as u64, 3, 0, 0, 0, 0], SECCOMP_RET_ALLOW),
            (Profile::Npu, "socket", [17, 3, 0, 0, 0, 0], EPERM),
            (Profile::Network, "connect", [3, 0, 0, 0, 0, 0], SECCOMP_RET_ALLOW),
            (Profile::Network, "socketpair", [1, 1, 0, 0, 0, 0], SECCOMP_RET_ALLOW),
            (Profile::Network, "ptrace", [0; 6], EPERM),
            (Profile::Network, "mount", [0; 6], EPERM),
            (Profile::Network, "bpf", [0; 6], EPERM),
            (Profile::Baseline, "clone", [0x0111_0011, 0, 0, 0, 0, 0], SECCOMP_RET_ALLOW),
            (Profile::Baseline, "clone", [CLONE_NEWUSER as u64 | 0x11, 0, 0, 0, 0, 0], EPERM),
            (Profile::Baseline, "clone3", [0; 6], ENOSYS),
            (Profile::Baseline, "ioctl", [0, TIOCSTI as u64, 0, 0, 0, 0], EPERM),
            (Profile::Baseline, "ioctl", [0, TIOCLINUX as u64, 0, 0, 0, 0], EPERM),
            (Profile::Baseline, "ioctl", [0, 1 << 32 | TIOCSTI as u64, 0, 0, 0, 0], EPERM),
            (Profile::Baseline, "ioctl", [0, 0x5401, 0, 0, 0, 0], SECCOMP_RET_ALLOW),
            (Profile::Baseline, "unshare", [0; 6], EPERM),
            (Profile::Baseline, "perf_event_open", [0; 6], EPERM),
        ];
        for arch in ARCHES {
            for (profile, name, args, expected) in cases {
                let got = eval(*profile, arch, nr(name, arch), *args);
                assert_eq!(got, *expected, "{profile}/{arch:?} {name}({args:x?})");
            }
        }
    }

    #[test]
    fn unlisted_syscalls_are_allowed() {
        for profile in Profile::ALL {
            for arch in ARCHES {
                let listed: Vec<u32> =
                    rules::rules(profile, arch).iter().filter_map(|r| r.syscall.number(arch)).collect();
                let program = compile(profile, arch).unwrap();
                for number in (0..460).filter(|n| !listed.contains(n)) {
                    let data = Data { nr: number, arch: arch.audit_arch(), args: [0; 6] };
                    assert_eq!(run(program.instructions(), &data), SECCOMP_RET_ALLOW, "{number}");
                }
            }
        }
    }

    #[test]
    fn wire_form_is_eight_little_endian_bytes_per_instruction() {
        let program = compile(Profile::Baseline, Arch::Aarch64).unwrap();
        assert_eq!(program.bytes().len(), program.instructions().len() * 8);
        assert_eq!(&program.bytes()[0..8], &[0x20, 0, 0, 0, 4, 0, 0, 0]);
        assert_eq!(u32::from_le_bytes(program.bytes()[12..16].try_into().unwrap()), 0xc000_00b7);
    }
}
