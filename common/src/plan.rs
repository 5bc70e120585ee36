//! The launch plan: everything `sandbox-init` needs to exec bwrap, and nothing it has to
//! decide. `runnerd` assembles it; `sandbox-init` checks it with [`LaunchPlan::validate`]
//! and applies it in a fixed order.

use serde::{Deserialize, Serialize};

/// Bumped whenever a message layout on the runnerd ↔ sandbox-init channel changes.
pub const PROTOCOL_VERSION: u32 = 6;

/// bwrap reads the seccomp program from this descriptor (`--seccomp 3`).
pub const SECCOMP_FD: i32 = 3;
/// bwrap writes `{"child-pid": N, …}` to this descriptor (`--info-fd 4`): the host pid of
/// the sandbox's PID-namespace init, which is what we kill to end the whole sandbox.
pub const INFO_FD: i32 = 4;

/// Further descriptors (the workspace directories for `--bind-fd`) start here.
pub const FIRST_EXTRA_FD: i32 = 5;

/// The most descriptors a plan may place; keeps `sandbox-init`'s arithmetic trivial.
pub const MAX_FDS: usize = 16;
/// Target descriptor numbers must stay below this.
pub const MAX_TARGET_FD: i32 = 64;
/// The most cgroups a launch joins: one per cgroup v1 hierarchy (memory, pids, cpu), or one
/// on cgroup v2.
pub const MAX_CGROUPS: usize = 4;

/// A process resource limit for the sandbox (inherited through bwrap by the command).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rlimit {
    pub resource: Resource,
    /// `None` keeps the current value (an unprivileged process cannot raise a hard limit,
    /// so "unlimited" is never implied).
    pub soft: Option<u64>,
    pub hard: Option<u64>,
}

impl Rlimit {
    /// Soft and hard limit both `value`.
    pub const fn fixed(resource: Resource, value: u64) -> Self {
        Rlimit { resource, soft: Some(value), hard: Some(value) }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Resource {
    /// Core dump size.
    Core,
    /// Open descriptors.
    NoFile,
    /// Largest file a process may write.
    FSize,
    /// Processes of the (host) user.
    NProc,
    /// Address space.
    As,
    /// CPU seconds.
    Cpu,
}

/// What `runnerd` sends first on the channel; the descriptors follow, one per message, in
/// the order of `fds`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LaunchPlan {
    /// Absolute path of the bwrap binary; exec'd with an empty environment.
    pub program: String,
    /// `argv[1..]` for bwrap; `argv[0]` is `program`.
    pub args: Vec<String>,
    /// The descriptor number each passed descriptor must end up at, in passing order.
    pub fds: Vec<i32>,
    /// Limits applied before exec.
    pub rlimits: Vec<Rlimit>,
    /// How many descriptors follow the placed ones: each a cgroup's join file (`cgroup.procs`,
    /// or `tasks` on cgroup v1) opened for writing by runnerd. sandbox-init — single-threaded,
    /// so moving its thread moves the process — writes `0` (itself) into each before it execs
    /// bwrap, so the whole sandbox starts inside the execution's cgroups; they are never placed.
    pub join_cgroups: usize,
    /// The unprivileged host user bwrap (and so all sandbox code) runs as. sandbox-init, when
    /// started as root, switches to it after joining the cgroups; `None` keeps the caller's
    /// user, which must not be root: sandbox-init never execs bwrap as host uid 0.
    pub user: Option<SandboxUser>,
    /// Directories to mount idmapped before bwrap binds them; needs `user`.
    pub idmaps: Vec<Idmap>,
}

/// A placed directory descriptor that bwrap binds (`--bind-fd`/`--ro-bind-fd`) and that must
/// be seen through an idmapped mount (issue #30): its files owned by `owner` appear owned by
/// the plan's sandbox user, and what the sandbox writes lands on disk owned by `owner`.
/// sandbox-init, still root, unshares its own mount namespace, attaches an idmapped clone of
/// the directory over the directory itself there, and puts the clone's descriptor at `fd`;
/// the mount dies with the sandbox's namespaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Idmap {
    /// The target number of the placed descriptor (one of [`LaunchPlan::fds`]).
    pub fd: i32,
    /// The directory's owner and group on disk.
    pub owner: IdPair,
    /// Bound read-only: the staged mount is made read-only too (`MOUNT_ATTR_RDONLY`), so it
    /// is never a writable path, even where only sandbox-init's namespace sees it.
    pub read_only: bool,
}

/// A host user id and group id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdPair {
    pub uid: u32,
    pub gid: u32,
}

/// A host user and primary group for the sandbox; never 0 (checked by [`LaunchPlan::validate`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxUser {
    pub uid: u32,
    pub gid: u32,
}

/// A plan `sandbox-init` refuses to apply.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    #[error("the bwrap path {0:?} is not absolute")]
    RelativeProgram(String),
    #[error("an argument contains a NUL byte")]
    NulInArgument,
    #[error("the plan places {0} descriptors; at most {MAX_FDS} are allowed")]
    TooManyFds(usize),
    #[error("descriptor target {0} is outside 0..{MAX_TARGET_FD}")]
    TargetOutOfRange(i32),
    #[error("descriptor target {0} appears twice")]
    DuplicateTarget(i32),
    #[error("resource limit {0:?} appears twice")]
    DuplicateRlimit(Resource),
    #[error("the soft limit of {0:?} exceeds its hard limit")]
    SoftAboveHard(Resource),
    #[error("the plan joins {0} cgroups; at most {MAX_CGROUPS} are allowed")]
    TooManyCgroups(usize),
    #[error("the plan names uid {uid} / gid {gid} for the sandbox; sandboxes never run as host root")]
    RootSandboxUser { uid: u32, gid: u32 },
    #[error("the plan idmaps descriptor {0}, which it does not place")]
    IdmapUnplaced(i32),
    #[error("the plan idmaps descriptor {0} twice")]
    IdmapTwice(i32),
    #[error("the plan idmaps a directory but names no sandbox user to map its owner to")]
    IdmapWithoutUser,
}

impl LaunchPlan {
    /// Checks the plan without touching the system.
    pub fn validate(&self) -> Result<(), PlanError> {
        if !self.program.starts_with('/') {
            return Err(PlanError::RelativeProgram(self.program.clone()));
        }
        if self.program.contains('\0') || self.args.iter().any(|a| a.contains('\0')) {
            return Err(PlanError::NulInArgument);
        }
        if self.fds.len() > MAX_FDS {
            return Err(PlanError::TooManyFds(self.fds.len()));
        }
        for (i, target) in self.fds.iter().enumerate() {
            if !(0..MAX_TARGET_FD).contains(target) {
                return Err(PlanError::TargetOutOfRange(*target));
            }
            if self.fds[..i].contains(target) {
                return Err(PlanError::DuplicateTarget(*target));
            }
        }
        if self.join_cgroups > MAX_CGROUPS {
            return Err(PlanError::TooManyCgroups(self.join_cgroups));
        }
        if let Some(SandboxUser { uid, gid }) = self.user
            && (uid == 0 || gid == 0)
        {
            return Err(PlanError::RootSandboxUser { uid, gid });
        }
        for (i, map) in self.idmaps.iter().enumerate() {
            if self.user.is_none() {
                return Err(PlanError::IdmapWithoutUser);
            }
            if !self.fds.contains(&map.fd) || map.fd < FIRST_EXTRA_FD {
                return Err(PlanError::IdmapUnplaced(map.fd));
            }
            if self.idmaps[..i].iter().any(|m| m.fd == map.fd) {
                return Err(PlanError::IdmapTwice(map.fd));
            }
        }
        for (i, limit) in self.rlimits.iter().enumerate() {
            if self.rlimits[..i].iter().any(|l| l.resource == limit.resource) {
                return Err(PlanError::DuplicateRlimit(limit.resource));
            }
            if let (Some(soft), Some(hard)) = (limit.soft, limit.hard)
                && soft > hard
            {
                return Err(PlanError::SoftAboveHard(limit.resource));
            }
        }
        Ok(())
    }
}

/// What `sandbox-init` sends back: `Executing` right before `execve`, then nothing — the
/// channel is close-on-exec, so end-of-file after `Executing` means bwrap is running — or
/// `Failed`. End-of-file without either means sandbox-init died (it was killed, or started
/// wrongly), which runnerd must not mistake for a running sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum InitReport {
    Executing,
    Failed(InitFailure),
}

/// The step of `sandbox-init` that failed, in the order they run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum InitStep {
    ReadPlan,
    ValidatePlan,
    ReceiveFds,
    ArrangeFds,
    CloseFds,
    JoinCgroups,
    Idmap,
    Rlimits,
    Signals,
    SwitchUser,
    Exec,
}

impl InitStep {
    pub fn describe(self) -> &'static str {
        match self {
            InitStep::ReadPlan => "reading the launch plan",
            InitStep::ValidatePlan => "checking the launch plan",
            InitStep::ReceiveFds => "receiving the sandbox's file descriptors",
            InitStep::ArrangeFds => "placing the file descriptors",
            InitStep::CloseFds => "closing inherited file descriptors",
            InitStep::JoinCgroups => "joining the execution's cgroups",
            InitStep::Idmap => "mounting a workspace idmapped for the sandbox user",
            InitStep::Rlimits => "applying resource limits",
            InitStep::Signals => "resetting signal dispositions",
            InitStep::SwitchUser => "switching to the unprivileged sandbox user",
            InitStep::Exec => "executing bubblewrap",
        }
    }
}

/// A typed failure before (or of) the exec of bwrap.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("sandbox-init failed while {}: {detail}{}", step.describe(), errno_suffix(*errno))]
pub struct InitFailure {
    pub step: InitStep,
    /// The OS error number, 0 when the failure was not a syscall's.
    pub errno: i32,
    pub detail: String,
}

fn errno_suffix(errno: i32) -> String {
    if errno == 0 { String::new() } else { format!(" (os error {errno})") }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan() -> LaunchPlan {
        LaunchPlan {
            program: "/usr/bin/bwrap".into(),
            args: vec!["--unshare-all".into()],
            fds: vec![0, 1, 2, SECCOMP_FD, INFO_FD],
            rlimits: vec![Rlimit::fixed(Resource::Core, 0)],
            join_cgroups: 0,
            user: Some(SandboxUser { uid: 1000, gid: 1000 }),
            idmaps: vec![],
        }
    }

    #[test]
    fn validation_table() {
        type Edit = Box<dyn Fn(&mut LaunchPlan)>;
        let cases: Vec<(Edit, Option<PlanError>)> = vec![
            (Box::new(|_| {}), None),
            (Box::new(|p| p.program = "bwrap".into()), Some(PlanError::RelativeProgram("bwrap".into()))),
            (Box::new(|p| p.args.push("a\0b".into())), Some(PlanError::NulInArgument)),
            (Box::new(|p| p.fds = (0..17).collect()), Some(PlanError::TooManyFds(17))),
            (Box::new(|p| p.fds = vec![0, 64]), Some(PlanError::TargetOutOfRange(64))),
            (Box::new(|p| p.fds = vec![-1]), Some(PlanError::TargetOutOfRange(-1))),
            (Box::new(|p| p.fds = vec![3, 3]), Some(PlanError::DuplicateTarget(3))),
            (Box::new(|p| p.join_cgroups = MAX_CGROUPS), None),
            (
                Box::new(|p| p.join_cgroups = MAX_CGROUPS + 1),
                Some(PlanError::TooManyCgroups(MAX_CGROUPS + 1)),
            ),
            (Box::new(|p| p.user = None), None),
            (
                Box::new(|p| {
                    p.fds.push(5);
                    p.idmaps.push(Idmap { fd: 5, owner: IdPair { uid: 0, gid: 0 }, read_only: false })
                }),
                None,
            ),
            (
                Box::new(|p| {
                    p.idmaps.push(Idmap { fd: 5, owner: IdPair { uid: 0, gid: 0 }, read_only: false })
                }),
                Some(PlanError::IdmapUnplaced(5)),
            ),
            (
                Box::new(|p| {
                    p.idmaps.push(Idmap { fd: 0, owner: IdPair { uid: 0, gid: 0 }, read_only: false })
                }),
                Some(PlanError::IdmapUnplaced(0)),
            ),
            (
                Box::new(|p| {
                    p.fds.push(5);
                    p.idmaps = vec![Idmap { fd: 5, owner: IdPair { uid: 0, gid: 0 }, read_only: false }; 2]
                }),
                Some(PlanError::IdmapTwice(5)),
            ),
            (
                Box::new(|p| {
                    p.fds.push(5);
                    p.user = None;
                    p.idmaps.push(Idmap { fd: 5, owner: IdPair { uid: 0, gid: 0 }, read_only: false })
                }),
                Some(PlanError::IdmapWithoutUser),
            ),
            (
                Box::new(|p| p.user = Some(SandboxUser { uid: 0, gid: 1000 })),
                Some(PlanError::RootSandboxUser { uid: 0, gid: 1000 }),
            ),
            (
                Box::new(|p| p.user = Some(SandboxUser { uid: 1000, gid: 0 })),
                Some(PlanError::RootSandboxUser { uid: 1000, gid: 0 }),
            ),
            (
                Box::new(|p| p.rlimits.push(Rlimit::fixed(Resource::Core, 1))),
                Some(PlanError::DuplicateRlimit(Resource::Core)),
            ),
            (
                Box::new(|p| {
                    p.rlimits = vec![Rlimit { resource: Resource::NoFile, soft: Some(6), hard: Some(5) }]
                }),
                Some(PlanError::SoftAboveHard(Resource::NoFile)),
            ),
        ];
        for (i, (edit, expected)) in cases.into_iter().enumerate() {
            let mut p = plan();
            edit(&mut p);
            assert_eq!(p.validate().err(), expected, "case {i}");
        }
    }

    #[test]
    fn failure_messages_read_as_sentences() {
        let f = InitFailure { step: InitStep::Exec, errno: 2, detail: "/nope/bwrap".into() };
        assert_eq!(f.to_string(), "sandbox-init failed while executing bubblewrap: /nope/bwrap (os error 2)");
    }
}
