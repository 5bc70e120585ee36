//! The bubblewrap backend: a [`SandboxSpec`] becomes bwrap's argv ([`argv::build`], pure),
//! its descriptors are placed at the slot numbers that argv names, and sandbox-init starts it
//! ([`Launcher::run`]). An execution's next sandbox of the same shape is started ahead and
//! waits in the [`Pool`] (issue #37); a call of that shape is handed to it
//! ([`crate::launch::Waiting::finish`]). Also the backend's start-up probe form ([`probe`]):
//! the original's probe argv, unfiltered, through the same launcher.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use common::plan::IdPair;

use super::prestart::{self, Discard, Pool, Prestart, PrestartSettings, Scope, Shape, release};
use super::{Isolation, Job, Ran, RunFuture, SandboxSpec};
use crate::launch::{Launch, LaunchError, Launcher, Outcome, OutputSink};
use crate::limits::{ExecCgroup, Limits};
use crate::sandbox::argv::{self, BwrapSpec, EgressMount, ExtraBind, SkillsMount};
use crate::sandbox::{FdSlots, SandboxCommand, SandboxShape, WorkspaceFds};

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
    /// Sandboxes started ahead for executions (issue #37); `None`: off.
    pool: Option<Arc<Pool>>,
    /// The next sandbox of each workspace whose call has not ended yet, with a fresh
    /// cgroup of its limits if one is at hand.
    pending: prestart::Pending<(Next, Option<ExecCgroup>)>,
}

impl Bubblewrap {
    pub fn new(
        bwrap: PathBuf,
        launcher: Arc<Launcher>,
        shape: Option<SandboxShape>,
        unusable: String,
        bind_fd: bool,
    ) -> Bubblewrap {
        Bubblewrap { bwrap, launcher, shape, unusable, bind_fd, pool: None, pending: Default::default() }
    }

    /// Starts executions' next sandboxes ahead, within `settings` (none when its per-node
    /// bound is 0, or without `--bind-fd`: a sandbox bound by path could not be checked to
    /// hold the objects a later call names).
    pub fn with_prestart(mut self, settings: PrestartSettings) -> Bubblewrap {
        let usable = self.shape.is_some() && self.bind_fd;
        self.pool = (settings.per_node > 0 && usable).then(|| Pool::new(settings));
        self
    }

    /// What the next sandbox of `job`'s shape needs, when the job is an execution's that
    /// may be served ahead: its shape, and its own duplicates of the descriptors.
    fn next_of(&self, job: &mut Job<'_>, cmd: &SandboxCommand, shape: SandboxShape) -> Option<Next> {
        self.pool.as_ref()?;
        let prestart = job.prestart.take()?;
        let dirs = job.spec.workspace_dirs.filter(|_| prestartable(&job.spec))?;
        let slots = command(&job.spec, shape, true).1.placed().ok()?;
        let cwd = match job.spec.cwd.filter(|c| !c.is_empty() && *c != ".") {
            Some(rel) => {
                let (dir, _) =
                    runner_store::fsat::walk_beneath(dirs.root.fd, Path::new(rel).components()).ok()?;
                Some(prestart::identity(&dir).ok()?)
            }
            None => None,
        };
        // The directory this call runs in: what a waiting sandbox must be in to serve it.
        let runs_in = match cwd {
            Some(id) => id,
            None => prestart::identity(dirs.root.fd).ok()?,
        };
        let limits = job.cgroup.as_ref().map(|c| *c.limits());
        let shape = Shape {
            options: cmd.options.clone(),
            command: cmd.command.clone(),
            profile: cmd.seccomp,
            rlimits: job.rlimits.clone(),
            limits,
            idmaps: slots.idmaps().to_vec(),
            objects: slots.identities().ok()?,
            cwd,
        };
        let root = job.spec.workspace.root().to_owned();
        let (cmd, rlimits) = (cmd.clone(), job.rlimits.clone());
        Some(Next { root, runs_in, prestart, shape, cmd, slots, rlimits, limits })
    }

    /// Keeps what the next sandbox of a call's workspace needs until the call ends
    /// ([`Isolation::call_ended`]).
    fn hold_next(&self, next: Next, cgroup: Option<ExecCgroup>) {
        self.pending.hold(next.root.clone(), (next, cgroup)).into_iter().for_each(|(_, c)| release(c));
    }

    /// Starts the next sandbox of a shape in the background and files it in the pool, when
    /// the pool's bounds admit it; `cgroup` is a fresh one of the shape's limits, if at hand.
    fn start_next(&self, next: Next, cgroup: Option<ExecCgroup>) {
        let Some(pool) = &self.pool else { return release(cgroup) };
        let Some(reservation) = pool.reserve(&next.root, &next.prestart.tenant, &next.shape) else {
            return release(cgroup);
        };
        pool.ensure_sweeper();
        let (pool, launcher, bwrap) = (pool.clone(), self.launcher.clone(), self.bwrap.clone());
        tokio::spawn(async move {
            let Next { shape, cmd, slots, rlimits, limits, prestart, .. } = next;
            let made = match (cgroup, limits) {
                (Some(c), _) => Ok(Some(c)),
                (None, Some(l)) => tokio::task::spawn_blocking(move || prestart.cgroups.create(&l))
                    .await
                    .map_err(|_| StartError::Panicked)
                    .and_then(|r| r.map_err(StartError::Cgroup)),
                (None, None) => Ok(None),
            };
            let joined = made.and_then(|c| {
                let joins = c.as_ref().map(|c| c.procs_fds()).transpose().map_err(StartError::Cgroup)?;
                Ok((c, joins.unwrap_or_default()))
            });
            let (cgroup, joins) = match joined {
                Ok(joined) => joined,
                Err(e) => return pool.failed(reservation, &e),
            };
            let mut launch = Launch::sandboxed(bwrap, cmd, slots);
            launch.rlimits = rlimits;
            launch.cgroup_procs = joins;
            match launcher.start(launch).await {
                Ok(waiting) => pool.insert(reservation, shape, waiting, cgroup, ()),
                Err(e) => pool.failed(reservation, &StartError::Launch(e)),
            }
        });
    }
}

/// Whether an execution's sandbox can wait for it ([`prestart::ahead`]).
fn prestartable(spec: &SandboxSpec<'_>) -> bool {
    prestart::ahead(&prestart::Parts {
        own_command: spec.command.is_some(),
        chips: spec.accel.is_some(),
        extra: !spec.binds.is_empty() || !spec.extra_env.is_empty(),
        egress: spec.egress.is_some(),
        by_descriptor: spec.workspace_dirs.is_some(),
    })
}

/// How long a call waits for a sandbox started ahead that bwrap is still setting up: what
/// is left of a setup that began earlier is less than a fresh launch's whole one, however
/// loaded the host; only a bwrap stuck in its setup costs this much.
const SETTLE_LIMIT: Duration = Duration::from_secs(2);

/// `entry` if bwrap has set it up (waiting at most [`SETTLE_LIMIT`]) in the directory the call
/// runs in: bwrap entered it by path when it started, so whatever happened in between, the
/// directory it is in must be the one the call found. Else it is discarded.
async fn ready_in(pool: &Pool, mut entry: prestart::Entry, runs_in: (u64, u64)) -> Option<prestart::Entry> {
    if !entry.waiting.settled(SETTLE_LIMIT).await {
        // One whose bwrap exited meanwhile did not fail to settle: it died.
        let miss = if entry.waiting.alive() { prestart::Miss::Unsettled } else { prestart::Miss::Died };
        pool.refuse(entry, miss);
        return None;
    }
    if entry.waiting.cwd() != Some(runs_in) {
        pool.refuse(entry, prestart::Miss::Shape);
        return None;
    }
    pool.served();
    Some(entry)
}

/// Why a sandbox could not be started ahead (logged; the next call launches as usual).
#[derive(Debug, thiserror::Error)]
enum StartError {
    #[error("its cgroup could not be made")]
    Cgroup(#[source] crate::limits::cgroup::CgroupError),
    #[error("making its cgroup panicked")]
    Panicked,
    #[error("it could not be launched")]
    Launch(#[source] LaunchError),
}

/// What starting the next sandbox of an execution's shape takes.
#[derive(Debug)]
struct Next {
    root: PathBuf,
    /// (device, inode) of the directory the call runs in.
    runs_in: (u64, u64),
    prestart: Prestart,
    shape: Shape,
    cmd: SandboxCommand,
    slots: FdSlots,
    rlimits: Vec<common::plan::Rlimit>,
    limits: Option<Limits>,
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

    fn run<'a>(&'a self, mut job: Job<'a>, sink: &'a mut dyn OutputSink) -> RunFuture<'a> {
        Box::pin(async move {
            let Some(shape) = self.shape else {
                let outcome = Err(LaunchError::Unavailable(self.unusable.clone()));
                return Ran { outcome, env: Vec::new(), cwd: String::new(), cgroup: job.cgroup };
            };
            let (cmd, slots) = command(&job.spec, shape, self.bind_fd);
            let (env, cwd) = (cmd.env.clone(), cmd.cwd.clone());
            let slots = match slots.placed() {
                Ok(slots) => slots,
                Err(source) => {
                    let outcome = Err(LaunchError::Io { what: "pass a descriptor to the sandbox", source });
                    return Ran { outcome, env, cwd, cgroup: job.cgroup };
                }
            };
            let asked = job.prestart.is_some();
            let next = self.next_of(&mut job, &cmd, shape);
            let taken = match (&self.pool, &next) {
                (Some(pool), Some(next)) => {
                    match pool.take_started(&next.root, &next.shape, SETTLE_LIMIT).await {
                        Ok(entry) => ready_in(pool, entry, next.runs_in).await,
                        Err(_) => None,
                    }
                }
                // An execution whose shape could not be made (a cwd that cannot be walked,
                // a workspace not bound by descriptor…): nothing waiting for its workspace
                // can be checked to match it.
                (Some(pool), None) if asked => {
                    pool.forget(Scope::Exactly(job.spec.workspace.root()), Discard::Shape);
                    None
                }
                _ => None,
            };
            let (outcome, ran_in, spare) = match taken {
                // The job's own cgroup, fresh and of the same limits, serves the next one.
                Some(entry) => {
                    let outcome =
                        entry.waiting.finish(&self.launcher, job.stdin, job.timeout, job.stop, sink).await;
                    (outcome, entry.cgroup, job.cgroup)
                }
                None => {
                    let mut launch = Launch::sandboxed(self.bwrap.clone(), cmd, slots);
                    launch.stdin = job.stdin;
                    launch.timeout = job.timeout;
                    launch.cancel = job.stop;
                    launch.rlimits = job.rlimits;
                    launch.cgroup_procs = job.cgroup_procs;
                    (self.launcher.run(launch, sink).await, job.cgroup, None)
                }
            };
            match next {
                // A sandbox that could not be launched is not started again ahead.
                Some(next) if outcome.is_ok() => self.hold_next(next, spare),
                _ => release(spare),
            }
            Ran { outcome, env, cwd, cgroup: ran_in }
        })
    }

    fn call_ended(&self, workspace: &Path) {
        if let Some((next, cgroup)) = self.pending.take(workspace) {
            self.start_next(next, cgroup);
        }
    }

    fn forget(&self, scope: Scope<'_>, why: Discard) {
        let Some(pool) = &self.pool else { return };
        // What waits for a call's end in that scope is dropped too (an environment change
        // reaches only what binds one).
        let env_only = why == Discard::Environment;
        let dropped = self.pending.forget(scope, |(next, _)| !env_only || next.shape.binds_environment());
        dropped.into_iter().for_each(|(_, c)| release(c));
        pool.forget(scope, why);
    }

    fn prestarted(&self) -> Option<prestart::Report> {
        self.pool.as_ref().map(|p| p.report())
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
