//! The isolation seam: every sandbox runnerd starts — an execution, a provisioning step, an
//! accelerator probe, `runnerd selftest` — is a [`Job`] handed to one [`Isolation`] backend,
//! which answers a [`Ran`]. The callers (`exec`, `envs`, `accel`, `selftest`) decide *what*
//! a sandbox holds and runs, in a backend-neutral [`SandboxSpec`]: paths, and the
//! descriptors runnerd opened and checked for them; the backend decides *how*.
//!
//! [`Bubblewrap`] is the one backend today: it turns a spec into bwrap's argv
//! ([`crate::sandbox::argv`]), places the descriptors in numbered slots, and starts it
//! through sandbox-init ([`crate::launch::Launcher`]). Its start-up probes (the sandbox's
//! form, idmapped mounts) use the same launcher with the original's probe argv
//! ([`bubblewrap::probe`]). An execution's job may be served by a sandbox the backend started
//! ahead of it ([`prestart`], issue #37): the job says so ([`Job::prestart`]) and gives the
//! backend its cgroup ([`Job::cgroup`]); [`Ran::cgroup`] is the one the sandbox ran in.

pub mod bubblewrap;
pub mod microvm;
pub mod prestart;
pub mod select;

use std::fmt;
use std::future::Future;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::time::Duration;

use common::plan::{IdPair, Rlimit};
use common::seccomp::Profile;
use tokio::sync::watch;

pub use bubblewrap::Bubblewrap;
pub use microvm::Microvm;
pub use prestart::{Prestart, PrestartSettings};

use crate::accel_mount::AccelMount;
use crate::launch::{LaunchError, Outcome, OutputSink};
use crate::limits::ExecCgroup;
use crate::sandbox::{HostRuntime, Language, WorkspaceLayout};

/// What one sandbox holds and runs, whatever isolates it.
#[derive(Debug, Clone)]
pub struct SandboxSpec<'a> {
    pub host: &'a HostRuntime,
    pub workspace: &'a WorkspaceLayout,
    /// The workspace directories as runnerd opened and checked them: a backend mounts these,
    /// never the paths, where it can (a path may name another directory by now).
    pub workspace_dirs: Option<WorkspaceDirs<'a>>,
    /// A workspace-relative directory inside the writable root, already validated.
    pub cwd: Option<&'a str>,
    pub language: Language,
    /// Host interpreter binaries to hide (resolved targets); empty unless a science
    /// environment is mounted.
    pub interpreter_masks: &'a [PathBuf],
    /// The Python interpreter for `Language::Python` without a science environment.
    pub python: &'a str,
    /// A science environment prefix, mounted read-only (R-SBX-5).
    pub science_env: Option<&'a Path>,
    /// A domain-allowlist sandbox's bridge and gateway (R-NET-2).
    pub egress: Option<Egress<'a>>,
    /// Accelerator chips, their nodes and environment (R-NPU-1, runnerd's `accel`).
    pub accel: Option<&'a AccelMount>,
    /// Runs this instead of the language's interpreter (probes, provisioning steps).
    pub command: Option<&'a [String]>,
    /// The size of the sandbox's `/tmp` in bytes (issue #8); 0 takes the fallback size.
    pub tmp_bytes: u64,
    /// `<dataDir>/python-packages[/pyX.Y|/py3]`, checked (`crate::sandbox::host`).
    pub python_packages: Option<&'a Path>,
    /// A verified skill package and the workspace's extensions directory.
    pub skills: Option<Skills<'a>>,
    /// The seccomp profile, decided once by the caller.
    pub profile: Profile,
    /// More directories, each at its own path (a provisioning step's prefix and cache).
    pub binds: &'a [Bind<'a>],
    /// Variables set after every other (a provisioning step's own).
    pub extra_env: &'a [(String, String)],
}

impl<'a> SandboxSpec<'a> {
    /// A shell spec with no cwd, no masks, the host `/usr/bin/python3`, nothing extra mounted,
    /// the baseline profile and the workspace bound by path; callers set what they decide.
    pub fn new(host: &'a HostRuntime, workspace: &'a WorkspaceLayout, language: Language) -> Self {
        SandboxSpec {
            host,
            workspace,
            workspace_dirs: None,
            cwd: None,
            language,
            interpreter_masks: &[],
            python: "/usr/bin/python3",
            science_env: None,
            egress: None,
            accel: None,
            command: None,
            tmp_bytes: 0,
            python_packages: None,
            skills: None,
            profile: Profile::Baseline,
            binds: &[],
            extra_env: &[],
        }
    }
}

/// A directory runnerd opened and checked, and whose ids the sandbox sees it with (`Some`:
/// mounted idmapped to that owner, issue #30).
#[derive(Debug, Clone, Copy)]
pub struct Dir<'a> {
    pub fd: &'a OwnedFd,
    pub owner: Option<IdPair>,
}

/// The writable workspace root and its read-only parent, if any.
#[derive(Debug, Clone, Copy)]
pub struct WorkspaceDirs<'a> {
    pub root: Dir<'a>,
    pub read_only: Option<Dir<'a>>,
}

/// A network sandbox's way out: the bridge binary and the policy's gateway socket (the
/// descriptor runnerd checked; the path is egressd's word only).
#[derive(Debug, Clone, Copy)]
pub struct Egress<'a> {
    pub bridge: &'a Path,
    pub gateway_socket: &'a Path,
    pub gateway: Option<&'a OwnedFd>,
}

/// A skill package (read-only) and the workspace's extensions directory (writable).
#[derive(Debug, Clone, Copy)]
pub struct Skills<'a> {
    pub packages: &'a Path,
    pub extensions: &'a Path,
    /// `(packages, extensions)` as runnerd opened and verified them.
    pub fds: (&'a OwnedFd, &'a OwnedFd),
}

/// A further directory at its own host path (conda prefixes embed their path).
#[derive(Debug, Clone, Copy)]
pub struct Bind<'a> {
    pub source: &'a Path,
    pub target: &'a Path,
    pub writable: bool,
    pub fd: Option<&'a OwnedFd>,
}

/// One sandbox to run: the spec and how it runs.
#[derive(Debug)]
pub struct Job<'a> {
    pub spec: SandboxSpec<'a>,
    pub stdin: Vec<u8>,
    /// Wall clock from the start; `None`: none.
    pub timeout: Option<Duration>,
    /// When this turns `true`, the sandbox is ended and the run reports `Cancelled`.
    pub stop: Option<watch::Receiver<bool>>,
    pub rlimits: Vec<Rlimit>,
    /// The execution's cgroups' join files (`crate::limits::ExecCgroup::procs_fds`).
    pub cgroup_procs: Vec<OwnedFd>,
    /// The execution's cgroup, given to the backend, which joins it or, serving the job
    /// from a sandbox started ahead, keeps it for the next one; [`Ran::cgroup`] is the one
    /// the sandbox ran in.
    pub cgroup: Option<ExecCgroup>,
    /// An execution's: its sandbox may have been started ahead, and the next one of its
    /// shape is (issue #37). `None` (probes, provisioning steps): never.
    pub prestart: Option<Prestart>,
    /// The request's resource limits, for a backend that enforces them itself (a microVM's
    /// size); `None`: the defaults.
    pub limits: Option<crate::limits::Limits>,
}

impl<'a> Job<'a> {
    /// `spec` with no input, no deadline, no stop, the default limits and no cgroup.
    pub fn new(spec: SandboxSpec<'a>) -> Job<'a> {
        Job {
            spec,
            stdin: Vec::new(),
            timeout: None,
            stop: None,
            rlimits: crate::launch::default_rlimits(None),
            cgroup_procs: Vec::new(),
            cgroup: None,
            prestart: None,
            limits: None,
        }
    }
}

/// How a job went, and what the backend put in the sandbox (provenance for the result).
#[derive(Debug)]
pub struct Ran {
    pub outcome: Result<Outcome, LaunchError>,
    /// The environment the command started with, in the order it was set.
    pub env: Vec<(String, String)>,
    /// The working directory inside the sandbox.
    pub cwd: String,
    /// The cgroup the sandbox ran in (the job's, or a pre-started sandbox's): its counters
    /// are the run's.
    pub cgroup: Option<ExecCgroup>,
}

/// The future of [`Isolation::run`].
pub type RunFuture<'a> = Pin<Box<dyn Future<Output = Ran> + Send + 'a>>;

/// A way of isolating a sandbox. Implementations end every process of a job before `run`
/// completes (R-RUN-4), also when the future is dropped.
pub trait Isolation: Send + Sync + fmt::Debug {
    /// The result's `sandbox` field.
    fn name(&self) -> &'static str;

    /// Why no sandbox can start on this host now (`None`: they can).
    fn unavailable(&self) -> Option<String>;

    /// Whether the spec's descriptors are what gets mounted. Without, paths are, and a
    /// caller refuses what must not be mounted by path (skill packages).
    fn binds_by_descriptor(&self) -> bool;

    /// Runs `job` to its end, streaming its output into `sink`.
    fn run<'a>(&'a self, job: Job<'a>, sink: &'a mut dyn OutputSink) -> RunFuture<'a>;

    /// An execution's call in `workspace` is over (its version committed, its locks gone):
    /// a sandbox for the workspace's next call may start now.
    fn call_ended(&self, _workspace: &Path) {}

    /// Discards the sandboxes started ahead for the workspaces in `scope`: cleared,
    /// repaired, moved or no longer a workspace, an environment changed, or runnerd stops.
    fn forget(&self, _scope: prestart::Scope<'_>, _why: prestart::Discard) {}

    /// The pre-started sandboxes' state, where the backend keeps any.
    fn prestarted(&self) -> Option<prestart::Report> {
        None
    }
}
