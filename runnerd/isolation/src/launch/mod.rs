//! Launching a sandbox through sandbox-init: what the bubblewrap backend (`crate::isolation`) runs.
//!
//! [`Launcher::run`] prepares the sandbox's descriptors (stdio pipes, a sealed memfd with the
//! seccomp program, bwrap's info pipe), has the [`spawner`] thread start `sandbox-init` and
//! hand it the plan, then — all async — waits for sandbox-init's answer ([`handshake`]),
//! learns the sandbox's PID-namespace init from bwrap's `--info-fd` ([`sandbox`]), feeds
//! stdin, streams stdout/stderr into an [`OutputSink`], and enforces the wall-clock timeout
//! and cancellation.
//!
//! A sandbox is ended by SIGKILL to its PID-namespace init (through a pidfd, immune to pid
//! reuse): the kernel then kills every process in the namespace, background ones included.
//! The same happens when the run's future is dropped (a client went away).

mod handshake;
pub mod output;
pub mod pool;
mod sandbox;
pub mod spawner;

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::channel::{self, ChannelError};
use common::plan::{INFO_FD, InitFailure, LaunchPlan, PROTOCOL_VERSION, Rlimit, SECCOMP_FD, SandboxUser};
use common::seccomp::{self, Arch, Profile, SeccompError};
use common::sys;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::pipe;
use tokio::sync::watch;

pub use output::{
    CollectedOutput, CollectedText, Held, OutputBudget, OutputPool, OutputSink, OutputText, Piece, Stream,
    Utf8Stream,
};
use sandbox::Sandbox;
use spawner::{SpawnError, Spawner};

/// How long the output may keep flowing after a sandbox was ended before the run gives up
/// on it (every writer is in the killed namespace, so this only trips on a kernel or
/// bwrap misbehaviour).
pub const DRAIN_LIMIT: Duration = Duration::from_secs(10);

/// Which seccomp program bwrap installs.
#[derive(Debug, Clone)]
pub enum Filter {
    Profile(Profile),
    /// A specific program (tests use marked variants of the profiles).
    Program(Arc<[u8]>),
}

/// One sandbox launch, fully decided.
#[derive(Debug)]
pub struct Launch {
    /// Absolute path of bwrap.
    pub bwrap: PathBuf,
    /// bwrap's options. The launcher appends `--info-fd 4` and, with a filter, `--seccomp 3`
    /// itself, so a launch can never name a descriptor it does not get (or run unfiltered
    /// by forgetting the option); options that name descriptors are refused.
    pub options: Vec<String>,
    /// The program and its arguments.
    pub command: Vec<String>,
    /// `None` only for preflight probes (the original probes without a filter).
    pub filter: Option<Filter>,
    pub rlimits: Vec<Rlimit>,
    pub stdin: Vec<u8>,
    pub timeout: Option<Duration>,
    /// When this turns `true`, the sandbox is ended and the run reports `Cancelled`.
    pub cancel: Option<watch::Receiver<bool>>,
    /// The descriptors the options name (`--bind-fd`), each placed at its slot's number.
    pub extra_fds: crate::sandbox::FdSlots,
    /// The join files of the execution's cgroups (`cgroup.procs`, or v1's `tasks`), opened
    /// for writing: sandbox-init joins each before it execs bwrap
    /// (`crate::limits::ExecCgroup::procs_fds`).
    pub cgroup_procs: Vec<OwnedFd>,
}

impl Launch {
    /// A start-up probe: no seccomp filter (the original probes without one), no limits,
    /// no input, ended after `timeout`.
    pub fn probe(
        bwrap: PathBuf,
        options: Vec<String>,
        command: Vec<String>,
        extra_fds: crate::sandbox::FdSlots,
        timeout: Duration,
    ) -> Launch {
        Launch {
            bwrap,
            options,
            command,
            filter: None,
            rlimits: Vec::new(),
            stdin: Vec::new(),
            timeout: Some(timeout),
            cancel: None,
            extra_fds,
            cgroup_procs: Vec::new(),
        }
    }

    /// A launch of `cmd` under its seccomp profile with the default limits; callers set
    /// stdin, timeout and cancellation.
    pub fn sandboxed(
        bwrap: PathBuf,
        cmd: crate::sandbox::SandboxCommand,
        extra_fds: crate::sandbox::FdSlots,
    ) -> Launch {
        Launch {
            bwrap,
            options: cmd.options,
            command: cmd.command,
            filter: Some(Filter::Profile(cmd.seccomp)),
            rlimits: default_rlimits(None),
            stdin: Vec::new(),
            timeout: None,
            cancel: None,
            extra_fds,
            cgroup_procs: Vec::new(),
        }
    }
}

/// bwrap's full argument list for a launch: the options, the launcher's descriptor options,
/// the command. (Public so the benchmark can give bare bwrap the identical argv.)
pub fn bwrap_args(options: &[String], filtered: bool, command: &[String]) -> Vec<String> {
    let mut args = options.to_vec();
    args.extend(["--info-fd".to_owned(), INFO_FD.to_string()]);
    if filtered {
        args.extend(["--seccomp".to_owned(), SECCOMP_FD.to_string()]);
    }
    args.extend(command.iter().cloned());
    args
}

/// How the sandbox ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Termination {
    /// bwrap exited with this code (the command's code; 128+N if the command died of signal N).
    Exited(i32),
    /// bwrap itself was killed by this signal.
    Signaled(i32),
    /// The wall-clock limit expired and the sandbox was killed.
    TimedOut,
    /// The cancel signal fired and the sandbox was killed.
    Cancelled,
}

#[derive(Debug, Clone)]
pub struct Outcome {
    pub termination: Termination,
    /// Host pid of the sandbox's PID-namespace init, when bwrap reported it.
    pub sandbox_pid: Option<i32>,
    pub elapsed: Duration,
    /// From the start of the launch to bubblewrap executing (sandbox-init's hand-over done),
    /// when it got that far; for a sandbox started ahead, to the script's hand-over.
    pub launch_latency: Option<Duration>,
    /// The run was handed to a sandbox started ahead of it (issue #37).
    pub served_ahead: bool,
    /// Whether a guest kernel's OOM killer ended the command, when the backend runs one
    /// (microvm); `None` here: the cgroup's counters say.
    pub guest_oom: Option<bool>,
}

#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("bubblewrap was not found at {path}")]
    BwrapMissing { path: String },
    #[error("sandbox-init could not start bubblewrap")]
    Init(#[source] InitFailure),
    #[error("sandbox-init exited before it could report; it was killed or its channel was not runnerd's")]
    InitVanished,
    #[error("could not start sandbox-init")]
    Spawn(#[source] SpawnError),
    #[error("the channel to sandbox-init failed")]
    Channel(#[source] ChannelError),
    #[error("the launch names descriptor option {0}, which only the launcher may set")]
    ReservedOption(String),
    #[error("the sandbox did not finish within {} s of being killed (namespace init {init:?})", DRAIN_LIMIT.as_secs())]
    Unresponsive { init: Option<i32> },
    #[error("could not {what}")]
    Io {
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("the seccomp program could not be built")]
    Seccomp(#[source] SeccompError),
    /// No sandbox can be built on this host (the start-up probes' conclusion).
    #[error("{0}")]
    Unavailable(String),
}

fn io_err(what: &'static str) -> impl FnOnce(io::Error) -> LaunchError {
    move |source| LaunchError::Io { what, source }
}

/// bwrap options that name a descriptor of ours: only the launcher sets them.
const RESERVED_OPTIONS: &[&str] = &[
    "--seccomp",
    "--add-seccomp-fd",
    "--info-fd",
    "--json-status-fd",
    "--sync-fd",
    "--block-fd",
    "--userns-block-fd",
];

/// Who every sandbox of a launcher is (issue #14): the host user sandbox-init switches to
/// (`None`: runnerd's own, unprivileged, user) and the one-line `/etc/passwd` and
/// `/etc/group` the sandbox sees for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchIdentity {
    pub user: Option<SandboxUser>,
    pub passwd: Vec<u8>,
    pub group: Vec<u8>,
}

impl LaunchIdentity {
    /// The identity of sandboxes run as `who`.
    pub fn of(who: &crate::sandbox::user::Identity) -> LaunchIdentity {
        let name = crate::sandbox::host::sandbox_user_name(Some(&who.name));
        let (passwd, group) = crate::sandbox::host::identity_lines(name, who.uid, who.gid);
        LaunchIdentity { user: who.switch(), passwd: passwd.into_bytes(), group: group.into_bytes() }
    }
}

/// Starts sandboxes through `sandbox-init`. Sandboxes die with their launcher (their
/// parent is its spawner thread), so keep one for the life of the daemon.
#[derive(Debug)]
pub struct Launcher {
    spawner: Spawner,
    /// Each profile's program, sealed once; launches reopen it.
    programs: Vec<(Profile, SealedData)>,
    init_path: PathBuf,
    identity: LaunchIdentity,
    /// `identity`'s passwd and group, sealed once, with their sandbox paths.
    identity_files: [(SealedData, &'static str); 2],
}

impl Launcher {
    /// Compiles the three seccomp programs for this machine and starts the spawner thread.
    /// Must be called inside a tokio runtime.
    pub fn new(init_path: PathBuf, identity: LaunchIdentity) -> Result<Launcher, LaunchError> {
        let arch = Arch::host().map_err(LaunchError::Seccomp)?;
        let programs = Profile::ALL
            .iter()
            .map(|p| {
                let prog = seccomp::compile(*p, arch).map_err(LaunchError::Seccomp)?;
                Ok((*p, SealedData::new(prog.bytes())?))
            })
            .collect::<Result<_, LaunchError>>()?;
        let identity_files = [
            (SealedData::new(&identity.passwd)?, "/etc/passwd"),
            (SealedData::new(&identity.group)?, "/etc/group"),
        ];
        let spawner = Spawner::start(init_path.clone()).map_err(io_err("start the spawner thread"))?;
        Ok(Launcher { spawner, programs, init_path, identity, identity_files })
    }

    pub fn init_path(&self) -> &Path {
        &self.init_path
    }

    /// The host user sandboxes are switched to (`None`: runnerd's own).
    pub fn sandbox_user(&self) -> Option<SandboxUser> {
        self.identity.user
    }

    /// The filter's program as a sealed descriptor of its own (a profile's is made once at
    /// start and reopened; a test's marked program is sealed for this launch).
    fn program_fd(&self, filter: &Filter) -> Result<OwnedFd, LaunchError> {
        match filter {
            Filter::Profile(profile) => {
                self.programs.iter().find(|(p, _)| p == profile).expect("all profiles compiled").1.reopen()
            }
            Filter::Program(bytes) => sealed_memfd(bytes),
        }
    }

    /// The plan sandbox-init runs and the descriptors it places, each at its number: the
    /// stdio and info pipes, the seccomp program, the launch's slots, the identity files
    /// (bwrap copies them from sealed memfds: a bind of a file under the data directory would
    /// need the sandbox user to reach it), and the cgroups' join files.
    fn plan(&self, launch: Launch) -> Result<Planned, LaunchError> {
        if let Some(reserved) = launch.options.iter().find(|o| RESERVED_OPTIONS.contains(&o.as_str())) {
            return Err(LaunchError::ReservedOption(reserved.clone()));
        }
        let (stdin_r, stdin_w) = pipe_pair()?;
        let (stdout_r, stdout_w) = pipe_pair()?;
        let (stderr_r, stderr_w) = pipe_pair()?;
        let (info_r, info_w) = pipe_pair()?;
        let mut fds = vec![stdin_r, stdout_w, stderr_w, info_w];
        let mut targets = vec![0, 1, 2, INFO_FD];
        if let Some(filter) = &launch.filter {
            fds.push(self.program_fd(filter)?);
            targets.push(SECCOMP_FD);
        }
        let mut next_fd = launch.extra_fds.next();
        let idmaps = launch.extra_fds.idmaps().to_vec();
        for (slot, fd) in launch.extra_fds.into_placed() {
            fds.push(fd);
            targets.push(slot);
        }
        let mut options = launch.options;
        for (data, target) in &self.identity_files {
            fds.push(data.reopen()?);
            targets.push(next_fd);
            options.extend(["--ro-bind-data".to_owned(), next_fd.to_string(), (*target).to_owned()]);
            next_fd += 1;
        }
        // `/` goes read-only last, after every mount point exists.
        options.extend(["--remount-ro".to_owned(), "/".to_owned()]);
        let join_cgroups = launch.cgroup_procs.len();
        fds.extend(launch.cgroup_procs);
        let plan = LaunchPlan {
            program: launch.bwrap.to_string_lossy().into_owned(),
            args: bwrap_args(&options, launch.filter.is_some(), &launch.command),
            fds: targets,
            rlimits: launch.rlimits,
            join_cgroups,
            user: self.identity.user,
            idmaps,
        };
        Ok(Planned {
            plan,
            fds,
            stdin: (stdin_w, launch.stdin),
            stdout: stdout_r,
            stderr: stderr_r,
            info: info_r,
            timeout: launch.timeout,
            cancel: launch.cancel,
        })
    }

    /// Runs one sandbox to its end, streaming its output into `sink`.
    pub async fn run(&self, launch: Launch, sink: &mut dyn OutputSink) -> Result<Outcome, LaunchError> {
        let started = Instant::now();
        let Planned { plan, fds, stdin: (stdin_w, input), stdout, stderr, info, timeout, cancel } =
            self.plan(launch)?;
        let frame = channel::encode_frame(PROTOCOL_VERSION, &plan).map_err(LaunchError::Channel)?;
        let spawned = self.spawner.spawn(frame, fds).await.map_err(LaunchError::Spawn)?;
        let sandbox = Sandbox::new(spawned.child.id().map(|p| p as i32).unwrap_or(0));
        tokio::spawn(sandbox.clone().watch(info));
        let handshake = handshake::wait_for_exec(spawned.channel, spawned.hand_over, &plan.program);
        let running = Running { sandbox, child: spawned.child, stdin: stdin_w, stdout, stderr };
        self.attend(running, handshake, Attend { ahead: false, input, timeout, cancel, started }, sink).await
    }

    /// Starts a sandbox ahead of its input (issue #37): bwrap runs, and its command waits on
    /// stdin until [`Waiting::finish`] hands it over. The launch's timeout and cancel are not
    /// used: the run's own start at the hand-over. An unfinished `Waiting` ends its sandbox
    /// when dropped.
    pub async fn start(&self, launch: Launch) -> Result<Waiting, LaunchError> {
        let Planned { plan, fds, stdin: (stdin_w, _), stdout, stderr, info, .. } = self.plan(launch)?;
        let frame = channel::encode_frame(PROTOCOL_VERSION, &plan).map_err(LaunchError::Channel)?;
        let spawned = self.spawner.spawn(frame, fds).await.map_err(LaunchError::Spawn)?;
        let sandbox = Sandbox::new(spawned.child.id().map(|p| p as i32).unwrap_or(0));
        tokio::spawn(sandbox.clone().watch(info));
        let running = Running { sandbox, child: spawned.child, stdin: stdin_w, stdout, stderr };
        // Ends the sandbox if the hand-over fails.
        let waiting = Waiting { running: Some(running) };
        let handshake = handshake::wait_for_exec(spawned.channel, spawned.hand_over, &plan.program);
        let answered = tokio::time::timeout(DRAIN_LIMIT, handshake).await;
        // This start took the sandbox-init waiting ahead: the next launch gets another.
        self.spawner.prepare_next();
        match answered {
            Ok(Ok(())) => Ok(waiting),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(LaunchError::Unresponsive { init: None }),
        }
    }

    /// Attends a started sandbox: `ready` (sandbox-init's hand-over, or nothing for a
    /// sandbox started ahead), then stdin fed and the output streamed until bwrap exits, the
    /// deadline passes or the run is cancelled; every process of the namespace gone before
    /// it answers (R-RUN-4).
    async fn attend(
        &self,
        running: Running,
        ready: impl std::future::Future<Output = Result<(), LaunchError>>,
        how: Attend,
        sink: &mut dyn OutputSink,
    ) -> Result<Outcome, LaunchError> {
        let Running { sandbox, mut child, stdin: stdin_w, stdout, stderr } = running;
        let Attend { ahead, input, timeout, cancel, started } = how;
        // bwrap (sandbox-init's image after exec) is not reaped before `work` ends, so its
        // pid cannot be reused meanwhile.
        let mut guard = EndOnDrop { sandbox: &sandbox, armed: true };

        let handed_over = std::sync::Mutex::new(None);
        let work = async {
            ready.await?;
            *handed_over.lock().unwrap_or_else(|p| p.into_inner()) = Some(started.elapsed());
            let stdin = pipe::Sender::from_owned_fd(stdin_w).map_err(io_err("open the stdin pipe"))?;
            let feeder = tokio::spawn(feed_stdin(stdin, input));
            pump_output(stdout, stderr, sink).await?;
            let status = child.wait().await.map_err(io_err("wait for bubblewrap"))?;
            feeder.abort();
            Ok::<_, LaunchError>(status)
        };
        tokio::pin!(work);
        let (result, ended) = tokio::select! {
            r = &mut work => (r, None),
            why = stopped(timeout, cancel) => {
                sandbox.end();
                match tokio::time::timeout(DRAIN_LIMIT, &mut work).await {
                    Ok(r) => (r, Some(why)),
                    Err(_) => return Err(LaunchError::Unresponsive { init: sandbox.init_pid() }),
                }
            }
        };
        // The next launch's sandbox-init is started now that this one no longer needs the
        // CPU: the commit that follows mostly waits for fsync.
        self.spawner.prepare_next();
        // The namespace must be empty before anyone looks at the workspace (R-RUN-4).
        sandbox.ensure_ended(DRAIN_LIMIT).await;
        let termination = match (result, ended) {
            // The guard, still armed, ends the sandbox.
            (Err(e), None) => return Err(e),
            // A sandbox ended during the hand-over reports as ended, not as a broken channel.
            (_, Some(why)) => why,
            (Ok(status), None) => {
                use std::os::unix::process::ExitStatusExt;
                match status.code() {
                    Some(code) => Termination::Exited(code),
                    None => Termination::Signaled(status.signal().unwrap_or(0)),
                }
            }
        };
        guard.armed = false;
        Ok(Outcome {
            termination,
            sandbox_pid: sandbox.init_pid(),
            elapsed: started.elapsed(),
            launch_latency: *handed_over.lock().unwrap_or_else(|p| p.into_inner()),
            served_ahead: ahead,
            guest_oom: None,
        })
    }
}

/// A sandbox's processes and runnerd's ends of its pipes.
#[derive(Debug)]
struct Running {
    sandbox: Arc<Sandbox>,
    child: tokio::process::Child,
    stdin: OwnedFd,
    stdout: OwnedFd,
    stderr: OwnedFd,
}

/// How a run is attended: its input, its deadline and cancel, and when its clock started.
struct Attend {
    /// Started ahead: `started` is the hand-over.
    ahead: bool,
    input: Vec<u8>,
    timeout: Option<Duration>,
    cancel: Option<watch::Receiver<bool>>,
    started: Instant,
}

/// A sandbox started by [`Launcher::start`]: bwrap runs and its command waits on stdin.
/// Dropped unfinished, it ends the sandbox (every process of its namespace).
#[derive(Debug)]
pub struct Waiting {
    running: Option<Running>,
}

impl Waiting {
    /// Whether bwrap still runs (a sandbox whose setup failed, or that was killed, has
    /// exited).
    pub fn alive(&mut self) -> bool {
        self.running.as_mut().is_some_and(|r| matches!(r.child.try_wait(), Ok(None)))
    }

    /// Waits (at most `limit`) until bwrap has set the sandbox up: its namespace init has
    /// started the command, so the mounts are made and the working directory entered.
    /// Whether it did.
    pub async fn settled(&self, limit: Duration) -> bool {
        let Some(r) = &self.running else { return false };
        let deadline = Instant::now() + limit;
        loop {
            if set_up(r.sandbox.init_pid()) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_micros(500)).await;
        }
    }

    /// (device, inode) of the working directory of the sandbox's namespace init, which
    /// bwrap changed into before it started the command (read through
    /// `/proc/PID/cwd`); `None` before bwrap reported its init, or where it cannot be read.
    pub fn cwd(&self) -> Option<(u64, u64)> {
        let init = self.running.as_ref()?.sandbox.init_pid()?;
        let st = std::fs::metadata(format!("/proc/{init}/cwd")).ok()?;
        use std::os::unix::fs::MetadataExt;
        Some((st.dev(), st.ino()))
    }

    /// bwrap's pid and its namespace init's (as the host sees them), without reading /proc:
    /// what [`sandbox_pids`] starts from.
    pub fn roots(&self) -> (Option<i32>, Option<i32>) {
        match &self.running {
            Some(r) => (r.child.id().map(|p| p as i32), r.sandbox.init_pid()),
            None => (None, None),
        }
    }

    /// Hands `input` to the waiting command and attends the run as [`Launcher::run`] does;
    /// the deadline, the cancel and the outcome's `elapsed` start now.
    pub async fn finish(
        mut self,
        launcher: &Launcher,
        input: Vec<u8>,
        timeout: Option<Duration>,
        cancel: Option<watch::Receiver<bool>>,
        sink: &mut dyn OutputSink,
    ) -> Result<Outcome, LaunchError> {
        let running = self.running.take().expect("a Waiting is finished once");
        let how = Attend { ahead: true, input, timeout, cancel, started: Instant::now() };
        launcher.attend(running, async { Ok(()) }, how, sink).await
    }
}

impl Waiting {
    /// Ends the sandbox and waits until its namespace is gone and bwrap reaped (a discarded
    /// sandbox's cgroup can be removed after this).
    pub async fn end(mut self) {
        if let Some(mut r) = self.running.take() {
            r.sandbox.end();
            r.sandbox.ensure_ended(DRAIN_LIMIT).await;
            let _ = tokio::time::timeout(DRAIN_LIMIT, r.child.wait()).await;
        }
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if let Some(r) = &self.running {
            r.sandbox.end();
        }
    }
}

/// Host pids of a sandbox's processes: bwrap's monitor, its namespace init and what the init
/// started (for their memory).
pub fn sandbox_pids(bwrap: Option<i32>, init: Option<i32>) -> Vec<i32> {
    let mut pids: Vec<i32> = bwrap.into_iter().chain(init).collect();
    if let Some(init) = init {
        pids.extend(children(init));
    }
    pids
}

/// Whether bwrap has set a sandbox up: its namespace init (`init`, once bwrap reported it)
/// has started the command.
pub fn set_up(init: Option<i32>) -> bool {
    init.is_some_and(|init| !children(init).is_empty())
}

/// The children of `init` (`/proc/PID/task/PID/children`); none if it is gone.
fn children(init: i32) -> Vec<i32> {
    let text = std::fs::read_to_string(format!("/proc/{init}/task/{init}/children")).unwrap_or_default();
    text.split_whitespace().filter_map(|p| p.parse().ok()).collect()
}

/// A launch ready for the spawner: the plan, the descriptors it places, and runnerd's ends.
struct Planned {
    plan: LaunchPlan,
    fds: Vec<OwnedFd>,
    /// The stdin pipe's write end and what to feed it.
    stdin: (OwnedFd, Vec<u8>),
    stdout: OwnedFd,
    stderr: OwnedFd,
    /// bwrap's `--info-fd` pipe.
    info: OwnedFd,
    timeout: Option<Duration>,
    cancel: Option<watch::Receiver<bool>>,
}

/// Completes when the launch's deadline passes or it is cancelled, saying which; never
/// without either.
async fn stopped(timeout: Option<Duration>, cancel: Option<watch::Receiver<bool>>) -> Termination {
    let timeout = async {
        match timeout {
            Some(limit) => tokio::time::sleep(limit).await,
            None => std::future::pending().await,
        }
    };
    let cancel = async {
        match cancel {
            Some(mut rx) => {
                if rx.wait_for(|c| *c).await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = timeout => Termination::TimedOut,
        _ = cancel => Termination::Cancelled,
    }
}

/// Open files a sandbox may hold, unless runnerd's own hard limit is lower.
pub const SANDBOX_NOFILE: u64 = 4096;

/// The limits every sandbox gets: no core dumps, a bounded number of open files (never
/// above runnerd's own hard limit, which an unprivileged process cannot exceed), and, when
/// given, a largest file size (a file can never be larger than the workspace quota).
pub fn default_rlimits(max_file_bytes: Option<u64>) -> Vec<Rlimit> {
    use common::plan::Resource;
    let hard = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .map(|(_, hard)| hard)
        .unwrap_or(SANDBOX_NOFILE);
    let mut limits =
        vec![Rlimit::fixed(Resource::Core, 0), Rlimit::fixed(Resource::NoFile, SANDBOX_NOFILE.min(hard))];
    if let Some(bytes) = max_file_bytes.filter(|b| *b > 0) {
        limits.push(Rlimit::fixed(Resource::FSize, bytes));
    }
    limits
}

/// Ends the sandbox if the run is abandoned (its future dropped) before it finished.
struct EndOnDrop<'a> {
    sandbox: &'a Arc<Sandbox>,
    armed: bool,
}

impl Drop for EndOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.sandbox.end();
        }
    }
}

fn pipe_pair() -> Result<(OwnedFd, OwnedFd), LaunchError> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two new descriptors into the array.
    sys::cvt(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }).map_err(io_err("create a pipe"))?;
    // SAFETY: both descriptors were just created and are owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Bytes every launch hands to bwrap (a seccomp program, passwd, group), sealed once. Each
/// launch gets its own open file description through `/proc/self/fd` — its own offset at 0,
/// since bwrap reads from the current offset to end-of-file — for one `open` instead of a
/// memfd made, written, rewound and sealed per launch. The seals keep what a running launch
/// reads unchangeable.
#[derive(Debug)]
struct SealedData(OwnedFd);

impl SealedData {
    fn new(bytes: &[u8]) -> Result<SealedData, LaunchError> {
        sealed_memfd(bytes).map(SealedData)
    }

    fn reopen(&self) -> Result<OwnedFd, LaunchError> {
        let path = std::ffi::CString::new(format!("/proc/self/fd/{}", self.0.as_raw_fd()))
            .expect("no NUL in a number");
        // SAFETY: opens a path we built as a new descriptor; the result is checked.
        let fd = sys::cvt(unsafe { libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) })
            .map_err(io_err("reopen a sealed sandbox memfd"))?;
        // SAFETY: the descriptor was just opened and is owned by nobody else.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }
}

/// A memfd holding `bytes`, sealed against any change, positioned at 0 (bwrap reads the
/// program from the current offset to end-of-file).
fn sealed_memfd(bytes: &[u8]) -> Result<OwnedFd, LaunchError> {
    use nix::fcntl::{FcntlArg, SealFlag, fcntl};
    use nix::sys::memfd::{MFdFlags, memfd_create};
    let fd = memfd_create("sciencediscovery-sandbox", MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING)
        .map_err(|e| LaunchError::Io { what: "create the seccomp memfd", source: e.into() })?;
    let mut file = std::fs::File::from(fd);
    io::Write::write_all(&mut file, bytes).map_err(io_err("write a sandbox memfd"))?;
    io::Seek::rewind(&mut file).map_err(io_err("rewind a sandbox memfd"))?;
    let seals =
        SealFlag::F_SEAL_SEAL | SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_WRITE;
    fcntl(&file, FcntlArg::F_ADD_SEALS(seals))
        .map_err(|e| LaunchError::Io { what: "seal the seccomp memfd", source: e.into() })?;
    Ok(OwnedFd::from(file))
}

async fn feed_stdin(mut stdin: pipe::Sender, bytes: Vec<u8>) {
    // A command that never reads its stdin (or exits early) is not an error: EPIPE is ignored.
    let _ = stdin.write_all(&bytes).await;
}

async fn pump_output(stdout: OwnedFd, stderr: OwnedFd, sink: &mut dyn OutputSink) -> Result<(), LaunchError> {
    let mut out = pipe::Receiver::from_owned_fd(stdout).map_err(io_err("open the stdout pipe"))?;
    let mut err = pipe::Receiver::from_owned_fd(stderr).map_err(io_err("open the stderr pipe"))?;
    let mut out_buf = vec![0u8; 64 * 1024];
    let mut err_buf = vec![0u8; 64 * 1024];
    let (mut out_open, mut err_open) = (true, true);
    while out_open || err_open {
        tokio::select! {
            r = out.read(&mut out_buf), if out_open => match r {
                Ok(0) | Err(_) => out_open = false,
                Ok(n) => sink.write(Stream::Stdout, &out_buf[..n]),
            },
            r = err.read(&mut err_buf), if err_open => match r {
                Ok(0) | Err(_) => err_open = false,
                Ok(n) => sink.write(Stream::Stderr, &err_buf[..n]),
            },
        }
        // A sink with a backlog (rows not yet written) is let drain before the next read.
        while let Some(drained) = sink.backlog() {
            let notified = drained.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if sink.backlog().is_none() || tokio::time::timeout(output::BACKLOG_WAIT, notified).await.is_err()
            {
                break;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    #[test]
    fn sealed_data_reopens_at_offset_zero_and_cannot_change() {
        let data = SealedData::new(b"seccomp program bytes").unwrap();
        let (a, b) = (data.reopen().unwrap(), data.reopen().unwrap());
        let mut first = String::new();
        std::fs::File::from(a).read_to_string(&mut first).unwrap();
        // A second launch's descriptor has its own offset: it reads everything again.
        let mut b = std::fs::File::from(b);
        let mut second = String::new();
        b.read_to_string(&mut second).unwrap();
        assert_eq!((first.as_str(), second.as_str()), ("seccomp program bytes", "seccomp program bytes"));
        // Read-only, and the memfd itself is sealed against writes, growth, shrinking and
        // further sealing: nothing can change what a running launch reads.
        assert!(b.write_all(b"x").is_err());
        // SAFETY: F_GET_SEALS on a descriptor we own.
        let seals = unsafe { libc::fcntl(data.0.as_raw_fd(), libc::F_GET_SEALS) };
        let all = libc::F_SEAL_SEAL | libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_WRITE;
        assert_eq!(seals & all, all);
        let mut original = std::fs::File::from(data.0.try_clone().unwrap());
        assert!(original.write_all(b"x").is_err(), "the sealed memfd took a write");
    }
}
