//! Seccomp profiles for the sandbox (R-SBX-6).
//!
//! Three profiles, each for x86_64 and aarch64:
//! * `baseline`: the original runner's deny list (every socket call included), plus what it
//!   missed: an x32-ABI guard, `clone(CLONE_NEWUSER)`, `clone3` → ENOSYS, `fallocate` →
//!   EOPNOTSUPP (blocks reserved faster than the workspace quota's poll can see), `link` and
//!   `linkat` → EXDEV (a hard link the change journal cannot see being made), `ioctl`
//!   TIOCSTI/TIOCLINUX, the new mount API, `chroot`, `acct`, `quotactl`, `syslog`, `kcmp`,
//!   `lookup_dcookie` and the ptrace-class calls.
//! * `network`: the baseline with the socket calls allowed for the egress bridge, but only
//!   for the families AF_UNIX, AF_INET and AF_INET6.
//! * `npu`: like `network`, plus AF_NETLINK for the NPU driver (still no egress channel).
//!
//! [`rules`] holds the tables, [`bpf`] turns them into a classic BPF program, and
//! [`publish`] writes the program where operators and the original's tooling expect it.

pub mod bpf;
mod publish;
pub mod rules;
pub mod syscalls;

#[cfg(test)]
mod interp;
#[cfg(test)]
mod live_tests;

pub use bpf::{Program, compile};
pub use publish::publish;

use std::fmt;
use std::path::PathBuf;

/// The architectures we build filters for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Arch {
    X86_64,
    Aarch64,
}

impl Arch {
    /// The architecture this binary runs on.
    pub fn host() -> Result<Arch, SeccompError> {
        Arch::from_name(std::env::consts::ARCH)
    }

    /// Parses the kernel's name for an architecture (`uname -m`).
    pub fn from_name(name: &str) -> Result<Arch, SeccompError> {
        match name {
            "x86_64" => Ok(Arch::X86_64),
            "aarch64" => Ok(Arch::Aarch64),
            other => Err(SeccompError::UnsupportedArch(other.to_owned())),
        }
    }

    /// The name used in file names, as the original runner spells it.
    pub fn name(self) -> &'static str {
        match self {
            Arch::X86_64 => "x86_64",
            Arch::Aarch64 => "aarch64",
        }
    }

    /// `AUDIT_ARCH_*`: what the kernel reports in `seccomp_data.arch`.
    pub fn audit_arch(self) -> u32 {
        match self {
            Arch::X86_64 => 0xc000_003e,
            Arch::Aarch64 => 0xc000_00b7,
        }
    }
}

/// Which of the three filters a sandbox runs under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Profile {
    Baseline,
    Network,
    Npu,
}

impl Profile {
    pub const ALL: [Profile; 3] = [Profile::Baseline, Profile::Network, Profile::Npu];

    /// The published file name: `seccomp[-network|-npu]-<arch>.bpf`.
    pub fn file_name(self, arch: Arch) -> String {
        match self {
            Profile::Baseline => format!("seccomp-{}.bpf", arch.name()),
            Profile::Network => format!("seccomp-network-{}.bpf", arch.name()),
            Profile::Npu => format!("seccomp-npu-{}.bpf", arch.name()),
        }
    }

    /// The version label `/health` reports (the original's labels where it had them).
    pub fn version_label(self) -> &'static str {
        match self {
            Profile::Baseline => "multiarch-v1-profile-aware",
            Profile::Network => "multiarch-v1-egress-gateway",
            Profile::Npu => "multiarch-v1-npu-without-egress",
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Profile::Baseline => "baseline",
            Profile::Network => "network",
            Profile::Npu => "npu",
        }
    }
}

impl fmt::Display for Profile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a profile could not be built or published.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    #[error("Runner seccomp baseline is unavailable for architecture {0}")]
    UnsupportedArch(String),
    #[error("the {profile} rule table for {arch} cannot be compiled: {reason}")]
    Table { profile: Profile, arch: &'static str, reason: String },
    #[error("seccompiler rejected the {profile} filter for {arch}")]
    Compile {
        profile: Profile,
        arch: &'static str,
        #[source]
        source: seccompiler::BackendError,
    },
    #[error("could not publish the seccomp program to {path}")]
    Publish {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}
