//! The confinement report a helper daemon (egressd, npu-brokerd) answers runnerd with: a
//! wire type of both protocols (`egress`, `npu`), so it lives apart from
//! `confine`, which only the confined daemons compile (seccompiler, landlock).

use serde::{Deserialize, Serialize};

/// How far a daemon confined itself after start-up, as `/health` reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Confinement {
    /// `enforced`, `partial`, or `unsupported: <why>`.
    pub landlock: String,
    /// Whether the daemon's own seccomp filter is installed.
    pub seccomp: bool,
    pub no_new_privs: bool,
}

impl Confinement {
    /// Everything applied; `landlock` is the reported outcome (`confine::landlock_outcome`).
    pub fn applied(landlock: String) -> Confinement {
        Confinement { landlock, seccomp: true, no_new_privs: true }
    }

    /// What `--no-confine` reports.
    pub fn skipped() -> Confinement {
        Confinement {
            landlock: "unsupported: disabled by --no-confine".into(),
            seccomp: false,
            no_new_privs: false,
        }
    }
}
