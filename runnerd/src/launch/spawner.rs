//! The thread that forks every `sandbox-init`.
//!
//! `PR_SET_PDEATHSIG` (what bwrap's `--die-with-parent` and sandbox-init's step 0 arm) fires
//! when the *thread* that forked the process exits, not the process. tokio's blocking pool
//! retires idle threads after ten seconds, which would kill every sandbox spawned from one.
//! So all spawns happen on this one thread, which lives as long as the [`Spawner`].
//! It also sends each plan and its descriptors, so runnerd's copies of the sandbox's ends
//! are closed right after the hand-over.
//!
//! After each hand-over the thread starts the next sandbox-init ahead of its request, off
//! the launch's critical path: the next launch then skips the fork and exec (issue #18).
//! The one idle sandbox-init only waits for a plan on its channel; nothing it does before
//! the plan depends on the launch (its death signal, the staging room, the channel check).
//! It is spawned from this thread, so it dies with it (its step 0 arms `PR_SET_PDEATHSIG`),
//! it is killed when the thread ends, and a launch that finds it dead starts a fresh one.
//! The first is started after the first launch, so it inherits runnerd's settled state.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::mpsc;

use common::channel::{self, ChannelError};
use tokio::process::{Child, Command};
use tokio::runtime::Handle;
use tokio::sync::oneshot;

const HAND_OVER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// One launch for the spawner thread: the frame (plan) and the descriptors that follow it.
pub struct SpawnJob {
    pub frame: Vec<u8>,
    pub fds: Vec<OwnedFd>,
    pub reply: oneshot::Sender<Result<Spawned, SpawnError>>,
}

/// A started sandbox-init and runnerd's end of its channel.
#[derive(Debug)]
pub struct Spawned {
    pub child: Child,
    pub channel: UnixStream,
    /// Set when the plan or its descriptors could not be delivered. sandbox-init may have
    /// refused early (and said why on the channel), so the caller reads the channel first.
    pub hand_over: Result<(), ChannelError>,
}

#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    #[error("could not create the channel to sandbox-init")]
    Socketpair(#[source] io::Error),
    #[error("could not start sandbox-init at {path}")]
    Spawn {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("the sandbox-init spawner thread has stopped")]
    Stopped,
}

/// Handle to the spawner thread; the thread ends when the last handle is dropped.
#[derive(Debug, Clone)]
pub struct Spawner {
    jobs: mpsc::Sender<SpawnJob>,
}

impl std::fmt::Debug for SpawnJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpawnJob")
            .field("frame_len", &self.frame.len())
            .field("fds", &self.fds.len())
            .finish()
    }
}

impl Spawner {
    /// Starts the thread. Must be called inside a tokio runtime (children are tokio
    /// `Child`ren, reaped by that runtime).
    pub fn start(init_path: PathBuf) -> io::Result<Spawner> {
        let handle = Handle::current();
        let (tx, rx) = mpsc::channel::<SpawnJob>();
        std::thread::Builder::new().name("sandbox-spawner".into()).spawn(move || {
            let _runtime = handle.enter();
            let mut idle: Option<Waiting> = None;
            for job in rx {
                let result = launch_one(&init_path, idle.take(), job.frame, job.fds);
                let _ = job.reply.send(result);
                // A failure here is not reported: the next launch starts its own and says why.
                idle = Waiting::start(&init_path).ok();
            }
            if let Some(mut waiting) = idle {
                // Never handed a plan; dropping the Child leaves it to tokio to reap.
                let _ = waiting.child.start_kill();
            }
        })?;
        Ok(Spawner { jobs: tx })
    }

    pub async fn spawn(&self, frame: Vec<u8>, fds: Vec<OwnedFd>) -> Result<Spawned, SpawnError> {
        let (reply, answer) = oneshot::channel();
        self.jobs.send(SpawnJob { frame, fds, reply }).map_err(|_| SpawnError::Stopped)?;
        answer.await.map_err(|_| SpawnError::Stopped)?
    }
}

/// A sandbox-init started ahead of its launch, waiting for a plan on `channel`.
struct Waiting {
    child: Child,
    channel: UnixStream,
}

impl Waiting {
    fn start(init_path: &PathBuf) -> Result<Waiting, SpawnError> {
        // std's socketpair is close-on-exec on both ends; the child's end becomes its stdin,
        // which dup2 leaves inheritable.
        let (ours, theirs) = UnixStream::pair().map_err(SpawnError::Socketpair)?;
        let child = Command::new(init_path)
            .stdin(Stdio::from(OwnedFd::from(theirs)))
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .env_clear()
            // Not kill_on_drop: an abandoned run ends its sandbox through the namespace init
            // (see `Sandbox::end`); a dropped Child is still reaped by tokio.
            .spawn()
            .map_err(|source| SpawnError::Spawn { path: init_path.clone(), source })?;
        Ok(Waiting { child, channel: ours })
    }

    /// Whether it is still waiting (it may have been killed while idle).
    fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

/// Hands the plan to the idle sandbox-init when it is still alive, else to a fresh one.
fn launch_one(
    init_path: &PathBuf,
    idle: Option<Waiting>,
    frame: Vec<u8>,
    fds: Vec<OwnedFd>,
) -> Result<Spawned, SpawnError> {
    // A dead one is dropped (tokio reaps it) and replaced.
    let waiting = match idle.and_then(|mut waiting| waiting.alive().then_some(waiting)) {
        Some(waiting) => waiting,
        None => Waiting::start(init_path)?,
    };
    let Waiting { child, channel: ours } = waiting;
    let hand_over = hand_over(&ours, &frame, &fds);
    drop(fds);
    if hand_over.is_err() {
        // sandbox-init may be waiting for the rest; end-of-file makes it report and exit.
        let _ = ours.shutdown(std::net::Shutdown::Write);
    }
    Ok(Spawned { child, channel: ours, hand_over })
}

/// Sends the plan and the descriptors. A stuck sandbox-init cannot pin this thread: the
/// frame is far smaller than a socket buffer, and writes time out regardless.
fn hand_over(ours: &UnixStream, frame: &[u8], fds: &[OwnedFd]) -> Result<(), ChannelError> {
    ours.set_write_timeout(Some(HAND_OVER_TIMEOUT)).map_err(ChannelError::Write)?;
    std::io::Write::write_all(&mut &*ours, frame).map_err(ChannelError::Write)?;
    let borrowed: Vec<_> = fds.iter().map(|fd| fd.as_fd()).collect();
    channel::send_fds(ours.as_fd(), &borrowed)
}
