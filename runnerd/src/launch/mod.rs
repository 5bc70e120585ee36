//! Launching a sandbox: the API the HTTP layer calls.
//!
//! [`Launcher::run`] prepares the sandbox's descriptors (stdio pipes, a sealed memfd with the
//! seccomp program, bwrap's info pipe), has the [`spawner`] thread start `sandbox-init` and
//! hand it the plan, then — all async — waits for the exec (end-of-file on the channel) or a
//! typed failure, learns the sandbox's PID-namespace init from bwrap's `--info-fd`, feeds
//! stdin, streams stdout/stderr into an [`OutputSink`], and enforces the wall-clock timeout.
//!
//! A sandbox is ended by SIGKILL to its PID-namespace init (through a pidfd, immune to pid
//! reuse): the kernel then kills every process in the namespace, background ones included.
//! The same happens when the future is dropped (a client went away).

pub mod output;
pub mod spawner;

use std::io;
use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use common::channel::{self, ChannelError};
use common::plan::{
    INFO_FD, InitFailure, InitReport, InitStep, LaunchPlan, PROTOCOL_VERSION, Rlimit, SECCOMP_FD,
};
use common::seccomp::{self, Arch, Profile, Program, SeccompError};
use common::sys;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::pipe;

pub use output::{CollectedOutput, OutputBudget, OutputSink, Stream};
use spawner::{SpawnError, Spawner};

/// One sandbox launch, fully decided.
#[derive(Debug, Clone)]
pub struct Launch {
    /// Absolute path of bwrap.
    pub bwrap: PathBuf,
    /// bwrap's arguments, the command included. Must say `--seccomp 3` when `seccomp` is set
    /// and `--info-fd 4` when `info_fd` is set.
    pub args: Vec<String>,
    pub seccomp: Option<Profile>,
    pub info_fd: bool,
    pub rlimits: Vec<Rlimit>,
    pub stdin: Vec<u8>,
    pub timeout: Option<Duration>,
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
}

#[derive(Debug, Clone)]
pub struct Outcome {
    pub termination: Termination,
    /// Host pid of the sandbox's PID-namespace init, when bwrap reported it.
    pub sandbox_pid: Option<i32>,
    pub elapsed: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("bubblewrap was not found at {path}")]
    BwrapMissing { path: String },
    #[error("sandbox-init could not start bubblewrap")]
    Init(#[source] InitFailure),
    #[error("could not start sandbox-init")]
    Spawn(#[source] SpawnError),
    #[error("the channel to sandbox-init failed")]
    Channel(#[source] ChannelError),
    #[error("could not {what}")]
    Io {
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("the seccomp program could not be built")]
    Seccomp(#[source] SeccompError),
}

fn io_err(what: &'static str) -> impl FnOnce(io::Error) -> LaunchError {
    move |source| LaunchError::Io { what, source }
}

/// Starts sandboxes through `sandbox-init`. Sandboxes die with their launcher (their
/// parent is its spawner thread), so keep one for the life of the daemon.
#[derive(Debug)]
pub struct Launcher {
    spawner: Spawner,
    programs: Vec<(Profile, Program)>,
    init_path: PathBuf,
}

impl Launcher {
    /// Compiles the three seccomp programs for this machine and starts the spawner thread.
    /// Must be called inside a tokio runtime.
    pub fn new(init_path: PathBuf) -> Result<Launcher, LaunchError> {
        let arch = Arch::host().map_err(LaunchError::Seccomp)?;
        let programs = Profile::ALL
            .iter()
            .map(|p| seccomp::compile(*p, arch).map(|prog| (*p, prog)))
            .collect::<Result<_, _>>()
            .map_err(LaunchError::Seccomp)?;
        let spawner = Spawner::start(init_path.clone()).map_err(io_err("start the spawner thread"))?;
        Ok(Launcher { spawner, programs, init_path })
    }

    pub fn init_path(&self) -> &Path {
        &self.init_path
    }

    fn program(&self, profile: Profile) -> &Program {
        &self.programs.iter().find(|(p, _)| *p == profile).expect("all profiles compiled").1
    }

    /// Runs one sandbox to its end, streaming its output into `sink`.
    pub async fn run(&self, launch: Launch, sink: &mut dyn OutputSink) -> Result<Outcome, LaunchError> {
        let started = Instant::now();
        let (stdin_r, stdin_w) = pipe_pair()?;
        let (stdout_r, stdout_w) = pipe_pair()?;
        let (stderr_r, stderr_w) = pipe_pair()?;
        let mut fds = vec![stdin_r, stdout_w, stderr_w];
        let mut targets = vec![0, 1, 2];
        if let Some(profile) = launch.seccomp {
            fds.push(sealed_memfd(self.program(profile).bytes())?);
            targets.push(SECCOMP_FD);
        }
        let info_r = if launch.info_fd {
            let (r, w) = pipe_pair()?;
            fds.push(w);
            targets.push(INFO_FD);
            Some(r)
        } else {
            None
        };
        let plan = LaunchPlan {
            program: launch.bwrap.to_string_lossy().into_owned(),
            args: launch.args,
            fds: targets,
            rlimits: launch.rlimits,
        };
        let frame = channel::encode_frame(PROTOCOL_VERSION, &plan).map_err(LaunchError::Channel)?;
        let spawned = self.spawner.spawn(frame, fds).await.map_err(LaunchError::Spawn)?;

        let mut child = spawned.child;
        let namespace_init: OnceLock<OwnedFd> = OnceLock::new();
        // bwrap is not reaped before `work` ends, so its pid cannot be reused meanwhile.
        let bwrap_pidfd = child.id().and_then(|pid| sys::pidfd_open(pid as i32).ok());
        let mut guard =
            KillOnDrop { namespace_init: &namespace_init, bwrap: bwrap_pidfd.as_ref(), armed: true };
        let work = async {
            wait_for_exec(spawned.channel, spawned.hand_over, &plan.program).await?;
            let sandbox_pid = match info_r {
                Some(info) => read_child_pid(info).await,
                None => None,
            };
            if let Some(pidfd) = sandbox_pid.and_then(|pid| sys::pidfd_open(pid).ok()) {
                let _ = namespace_init.set(pidfd);
            }
            let stdin = pipe::Sender::from_owned_fd(stdin_w).map_err(io_err("open the stdin pipe"))?;
            let feeder = tokio::spawn(feed_stdin(stdin, launch.stdin));
            pump_output(stdout_r, stderr_r, sink).await?;
            let status = child.wait().await.map_err(io_err("wait for bubblewrap"))?;
            feeder.abort();
            Ok::<_, LaunchError>((status, sandbox_pid))
        };
        tokio::pin!(work);
        let timed_out;
        let result = match launch.timeout {
            None => {
                timed_out = false;
                work.await
            }
            Some(limit) => tokio::select! {
                r = &mut work => { timed_out = false; r }
                _ = tokio::time::sleep(limit) => {
                    timed_out = true;
                    end_sandbox(&namespace_init, bwrap_pidfd.as_ref());
                    work.await
                }
            },
        };
        let (status, sandbox_pid) = result?;
        guard.armed = false;
        use std::os::unix::process::ExitStatusExt;
        let termination = if timed_out {
            Termination::TimedOut
        } else if let Some(code) = status.code() {
            Termination::Exited(code)
        } else {
            Termination::Signaled(status.signal().unwrap_or(0))
        };
        Ok(Outcome { termination, sandbox_pid, elapsed: started.elapsed() })
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
struct KillOnDrop<'a> {
    namespace_init: &'a OnceLock<OwnedFd>,
    bwrap: Option<&'a OwnedFd>,
    armed: bool,
}

impl Drop for KillOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            end_sandbox(self.namespace_init, self.bwrap);
        }
    }
}

/// SIGKILL to the PID-namespace init: the kernel kills every process in the namespace, and
/// the bwrap monitor reaps the init and exits by itself. Before bwrap has reported the
/// init, the monitor is killed instead; `--die-with-parent` then takes the init down.
/// (Killing both would leave the init a zombie for the host's PID 1 to reap.)
fn end_sandbox(namespace_init: &OnceLock<OwnedFd>, bwrap: Option<&OwnedFd>) {
    let target = namespace_init.get().or(bwrap);
    if let Some(pidfd) = target {
        // ESRCH (already gone) is fine.
        let _ = sys::pidfd_send_signal(pidfd.as_fd(), libc::SIGKILL);
    }
}

fn pipe_pair() -> Result<(OwnedFd, OwnedFd), LaunchError> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two new descriptors into the array.
    sys::cvt(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }).map_err(io_err("create a pipe"))?;
    // SAFETY: both descriptors were just created and are owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// A memfd holding `bytes`, sealed against any change, positioned at 0 (bwrap reads the
/// program from the current offset to end-of-file).
fn sealed_memfd(bytes: &[u8]) -> Result<OwnedFd, LaunchError> {
    use nix::fcntl::{FcntlArg, SealFlag, fcntl};
    use nix::sys::memfd::{MFdFlags, memfd_create};
    let fd = memfd_create("sciencediscovery-seccomp", MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING)
        .map_err(|e| LaunchError::Io { what: "create the seccomp memfd", source: e.into() })?;
    let mut file = std::fs::File::from(fd);
    io::Write::write_all(&mut file, bytes).map_err(io_err("write the seccomp memfd"))?;
    io::Seek::rewind(&mut file).map_err(io_err("rewind the seccomp memfd"))?;
    let seals =
        SealFlag::F_SEAL_SEAL | SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_WRITE;
    fcntl(&file, FcntlArg::F_ADD_SEALS(seals))
        .map_err(|e| LaunchError::Io { what: "seal the seccomp memfd", source: e.into() })?;
    Ok(OwnedFd::from(file))
}

/// End-of-file on the channel means bwrap is running; a message is sandbox-init's failure.
async fn wait_for_exec(
    channel: std::os::unix::net::UnixStream,
    hand_over: Result<(), ChannelError>,
    bwrap: &str,
) -> Result<(), LaunchError> {
    channel.set_nonblocking(true).map_err(io_err("configure the sandbox-init channel"))?;
    let mut channel =
        tokio::net::UnixStream::from_std(channel).map_err(io_err("register the sandbox-init channel"))?;
    let mut bytes = Vec::new();
    (&mut channel)
        .take((channel::MAX_FRAME + 4) as u64)
        .read_to_end(&mut bytes)
        .await
        .map_err(|e| LaunchError::Channel(ChannelError::Read(e)))?;
    if bytes.is_empty() {
        return hand_over.map_err(LaunchError::Channel);
    }
    match channel::read_message::<InitReport>(&mut bytes.as_slice()).map_err(LaunchError::Channel)? {
        InitReport::Failed(f) if f.step == InitStep::Exec && f.errno == libc::ENOENT => {
            Err(LaunchError::BwrapMissing { path: bwrap.to_owned() })
        }
        InitReport::Failed(f) => Err(LaunchError::Init(f)),
    }
}

/// bwrap's `--info-fd` JSON: `{"child-pid": N, …}`, then end-of-file.
async fn read_child_pid(info: OwnedFd) -> Option<i32> {
    let mut info = pipe::Receiver::from_owned_fd(info).ok()?;
    let mut text = Vec::new();
    (&mut info).take(64 * 1024).read_to_end(&mut text).await.ok()?;
    let value: serde_json::Value = serde_json::from_slice(&text).ok()?;
    value.get("child-pid")?.as_i64().and_then(|p| i32::try_from(p).ok())
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
    }
    Ok(())
}
