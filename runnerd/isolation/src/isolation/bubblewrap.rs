//! The bubblewrap backend: a [`SandboxSpec`] becomes bwrap's argv ([`argv::build`], pure),
//! its descriptors are placed at the slot numbers that argv names, and sandbox-init starts it
//! ([`Launcher::run`]). Also the backend's start-up probe form ([`probe`]): the original's
//! probe argv, unfiltered, through the same launcher.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use common::plan::IdPair;

use super::{Isolation, Job, Ran, RunFuture, SandboxSpec};
use crate::launch::{Launch, LaunchError, Launcher, Outcome, OutputSink};
use crate::sandbox::argv::{self, BwrapSpec, EgressMount, ExtraBind, SkillsMount};
use crate::sandbox::{FdSlots, SandboxShape, WorkspaceFds};

/// bubblewrap through sandbox-init, in the form the start-up probes decided.
#[derive(Debug)]
pub struct Bubblewrap {
    bwrap: PathBuf,
    launcher: Arc<Launcher>,
    /// `None` when no sandbox could be built here; then `unusable` says why.
    shape: Option<SandboxShape>,
    unusable: String,
    /// bwrap has `--bind-fd` (0.8 or later).
    bind_fd: bool,
}

impl Bubblewrap {
    pub fn new(
        bwrap: PathBuf,
        launcher: Arc<Launcher>,
        shape: Option<SandboxShape>,
        unusable: String,
        bind_fd: bool,
    ) -> Bubblewrap {
        Bubblewrap { bwrap, launcher, shape, unusable, bind_fd }
    }
}

impl Isolation for Bubblewrap {
    fn name(&self) -> &'static str {
        "bubblewrap"
    }

    fn unavailable(&self) -> Option<String> {
        self.shape.is_none().then(|| self.unusable.clone())
    }

    fn binds_by_descriptor(&self) -> bool {
        self.bind_fd
    }

    fn run<'a>(&'a self, job: Job<'a>, sink: &'a mut dyn OutputSink) -> RunFuture<'a> {
        Box::pin(async move {
            let Some(shape) = self.shape else {
                let outcome = Err(LaunchError::Unavailable(self.unusable.clone()));
                return Ran { outcome, env: Vec::new(), cwd: String::new() };
            };
            let (cmd, slots) = command(&job.spec, shape, self.bind_fd);
            let (env, cwd) = (cmd.env.clone(), cmd.cwd.clone());
            let slots = match slots.placed() {
                Ok(slots) => slots,
                Err(source) => {
                    let outcome = Err(LaunchError::Io { what: "pass a descriptor to the sandbox", source });
                    return Ran { outcome, env, cwd };
                }
            };
            let mut launch = Launch::sandboxed(self.bwrap.clone(), cmd, slots);
            launch.stdin = job.stdin;
            launch.timeout = job.timeout;
            launch.cancel = job.stop;
            launch.rlimits = job.rlimits;
            launch.cgroup_procs = job.cgroup_procs;
            let outcome = self.launcher.run(launch, sink).await;
            Ran { outcome, env, cwd }
        })
    }
}

/// A start-up probe of this backend's form: `options` and `command` as given (the
/// original's probe argv), no seccomp filter, no limits, ended after `timeout`.
pub async fn probe(
    launcher: &Launcher,
    bwrap: &Path,
    options: Vec<String>,
    command: Vec<String>,
    slots: FdSlots,
    timeout: Duration,
    sink: &mut dyn OutputSink,
) -> Result<Outcome, LaunchError> {
    launcher.run(Launch::probe(bwrap.to_owned(), options, command, slots, timeout), sink).await
}

/// How a directory slot is mounted: idmapped to this owner (`None`: as it is), read-only.
type DirSlot = (Option<IdPair>, bool);

/// The descriptors a spec names, numbered as bwrap's options name them.
#[derive(Default)]
struct Numbered<'a> {
    fds: Vec<(&'a OwnedFd, Option<DirSlot>)>,
}

impl<'a> Numbered<'a> {
    fn push(&mut self, fd: &'a OwnedFd) -> i32 {
        self.fds.push((fd, None));
        common::plan::FIRST_EXTRA_FD + self.fds.len() as i32 - 1
    }

    fn push_dir(&mut self, dir: super::Dir<'a>, read_only: bool) -> i32 {
        self.fds.push((dir.fd, Some((dir.owner, read_only))));
        common::plan::FIRST_EXTRA_FD + self.fds.len() as i32 - 1
    }

    /// Duplicates each descriptor into its slot.
    fn placed(self) -> std::io::Result<FdSlots> {
        let mut slots = FdSlots::default();
        for (fd, dir) in self.fds {
            match dir {
                Some((owner, read_only)) => slots.push_dir(fd, owner, read_only)?,
                None => slots.push(fd)?,
            };
        }
        Ok(slots)
    }
}

/// The argv of `spec` in `shape`, and the descriptors it names (none without `--bind-fd`:
/// everything is bound by path then).
fn command<'a>(
    spec: &SandboxSpec<'a>,
    shape: SandboxShape,
    by_fd: bool,
) -> (argv::SandboxCommand, Numbered<'a>) {
    let mut n = Numbered::default();
    let workspace_fds = match (by_fd, spec.workspace_dirs) {
        (true, Some(dirs)) => Some(WorkspaceFds {
            root: n.push_dir(dirs.root, false),
            read_only: dirs.read_only.map(|d| n.push_dir(d, true)),
        }),
        _ => None,
    };
    let egress = spec.egress.map(|e| EgressMount {
        bridge: e.bridge.to_owned(),
        gateway_socket: e.gateway_socket.to_owned(),
        gateway_fd: e.gateway.filter(|_| by_fd).map(|fd| n.push(fd)),
    });
    let skills = spec.skills.map(|s| SkillsMount {
        packages: s.packages.to_owned(),
        extensions: s.extensions.to_owned(),
        fds: by_fd.then(|| (n.push(s.fds.0), n.push(s.fds.1))),
    });
    let binds: Vec<ExtraBind> = spec
        .binds
        .iter()
        .map(|b| ExtraBind {
            source: b.source.to_owned(),
            target: b.target.to_owned(),
            writable: b.writable,
            fd: b.fd.filter(|_| by_fd).map(|fd| n.push(fd)),
        })
        .collect();
    let cmd = argv::build(&BwrapSpec {
        shape,
        host: spec.host,
        workspace: spec.workspace,
        cwd: spec.cwd,
        language: spec.language,
        interpreter_masks: spec.interpreter_masks,
        python: spec.python,
        science_env: spec.science_env,
        workspace_fds,
        egress: egress.as_ref(),
        accel: spec.accel,
        command: spec.command,
        tmp_bytes: spec.tmp_bytes,
        python_packages: spec.python_packages,
        skills: skills.as_ref(),
        profile: spec.profile,
        binds: &binds,
        extra_env: spec.extra_env,
    });
    (cmd, n)
}
