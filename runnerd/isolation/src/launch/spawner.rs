//! The thread that forks every `sandbox-init`.
//!
//! `PR_SET_PDEATHSIG` (what bwrap's `--die-with-parent` and sandbox-init's step 0 arm) fires
//! when the *thread* that forked the process exits, not the process. tokio's blocking pool
//! retires idle threads after ten seconds, which would kill every sandbox spawned from one.
//! So all spawns happen on this one thread, which lives as long as the [`Spawner`].
//! Whoever sends a plan and its descriptors closes runnerd's copies of the sandbox's ends
//! right after the hand-over.
//!
//! Once a run has ended, the thread starts the next sandbox-init ahead of its request, off
//! the launch's critical path: the next launch then skips the fork and exec (issue #18).
//! Not right after the hand-over, nor at bubblewrap's exec: on two cores that fork and exec
//! competed with the launch it followed (launch phase 1.43 -> 1.77 ms when started at the
//! exec, 1.46 -> 1.38 ms when started after the run, each against the hand-over in one
//! interleaved run); after the run, the commit mostly waits for fsync.
//! The launch hands its plan to the waiting one itself, on its own thread: only a fork needs
//! this thread, and each round trip to it cost two cross-thread wake-ups.
//! The one idle sandbox-init only waits for a plan on its channel; nothing it does before
//! the plan depends on the launch (its death signal, the staging room, the channel check).
//! It is spawned from this thread, so it dies with it (its step 0 arms `PR_SET_PDEATHSIG`),
//! it is killed when the thread ends, and a launch that finds it dead starts a fresh one.
//! The first is started after the first launch, so it inherits runnerd's settled state.
//! Launches that overlap may find none waiting: each starts its own, as the first does.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex, mpsc};

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

/// What the spawner thread is asked to do.
#[derive(Debug)]
enum Job {
    Launch(SpawnJob),
    /// Start the next sandbox-init ahead, unless one is already waiting.
    Prepare,
}

/// Handle to the spawner thread; the thread ends when the last handle is dropped.
#[derive(Debug, Clone)]
pub struct Spawner {
    jobs: mpsc::Sender<Job>,
    /// The sandbox-init started ahead, waiting for a plan.
    idle: Arc<Mutex<Option<Waiting>>>,
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
        let (tx, rx) = mpsc::channel::<Job>();
        let idle: Arc<Mutex<Option<Waiting>>> = Arc::default();
        let slot = idle.clone();
        std::thread::Builder::new().name("sandbox-spawner".into()).spawn(move || {
            let _runtime = handle.enter();
            for job in rx {
                match job {
                    // A Prepare queued ahead of this launch may have filled the slot since
                    // the launch found it empty: that one is used, not a second fork.
                    Job::Launch(job) => {
                        let waiting = match take_alive(&slot) {
                            Some(waiting) => Ok(waiting),
                            None => Waiting::start(&init_path),
                        };
                        let _ = job.reply.send(waiting.map(|waiting| waiting.hand_over(job.frame, job.fds)));
                    }
                    // Forked outside the slot's lock, which a launch takes on a runtime
                    // worker. Only this thread fills the slot, so the check stays true.
                    // A failure here is not reported: the next launch starts its own and
                    // says why.
                    Job::Prepare if lock(&slot).is_none() => {
                        if let Ok(started) = Waiting::start(&init_path) {
                            *lock(&slot) = Some(started);
                        }
                    }
                    Job::Prepare => {}
                }
            }
            if let Some(mut waiting) = lock(&slot).take() {
                // Never handed a plan; dropping the Child leaves it to tokio to reap.
                let _ = waiting.child.start_kill();
            }
        })?;
        Ok(Spawner { jobs: tx, idle })
    }

    /// Hands the plan to the sandbox-init waiting for one, on this thread, when it is still
    /// alive (it may have been killed while idle); otherwise the spawner thread starts one.
    pub async fn spawn(&self, frame: Vec<u8>, fds: Vec<OwnedFd>) -> Result<Spawned, SpawnError> {
        if let Some(waiting) = take_alive(&self.idle) {
            return Ok(waiting.hand_over(frame, fds));
        }
        let (reply, answer) = oneshot::channel();
        self.jobs.send(Job::Launch(SpawnJob { frame, fds, reply })).map_err(|_| SpawnError::Stopped)?;
        answer.await.map_err(|_| SpawnError::Stopped)?
    }

    /// Asks for the next sandbox-init to be started ahead of its launch (call once a run no
    /// longer needs the CPU: it has ended).
    pub fn prepare_next(&self) {
        // A stopped thread has nothing to prepare; the next launch says so.
        let _ = self.jobs.send(Job::Prepare);
    }
}

fn lock(idle: &Mutex<Option<Waiting>>) -> std::sync::MutexGuard<'_, Option<Waiting>> {
    idle.lock().unwrap_or_else(|p| p.into_inner())
}

/// The waiting sandbox-init, unless there is none or it died while idle (dropped then,
/// and tokio reaps it).
fn take_alive(idle: &Mutex<Option<Waiting>>) -> Option<Waiting> {
    let waiting = lock(idle).take();
    waiting.and_then(|mut waiting| waiting.alive().then_some(waiting))
}

/// A sandbox-init started and waiting for a plan on `channel`.
#[derive(Debug)]
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

    /// Sends the plan and its descriptors; runnerd's copies are closed right after.
    fn hand_over(self, frame: Vec<u8>, fds: Vec<OwnedFd>) -> Spawned {
        let Waiting { child, channel: ours } = self;
        let hand_over = hand_over(&ours, &frame, &fds);
        drop(fds);
        if hand_over.is_err() {
            // sandbox-init may be waiting for the rest; end-of-file makes it report and exit.
            let _ = ours.shutdown(std::net::Shutdown::Write);
        }
        Spawned { child, channel: ours, hand_over }
    }
}

/// Sends the plan and the descriptors. A stuck sandbox-init cannot pin the sending thread
/// (a runtime worker, or the spawner thread): the frame and the descriptors are far
/// smaller than a socket buffer, and writes time out regardless.
fn hand_over(ours: &UnixStream, frame: &[u8], fds: &[OwnedFd]) -> Result<(), ChannelError> {
    ours.set_write_timeout(Some(HAND_OVER_TIMEOUT)).map_err(ChannelError::Write)?;
    std::io::Write::write_all(&mut &*ours, frame).map_err(ChannelError::Write)?;
    let borrowed: Vec<_> = fds.iter().map(|fd| fd.as_fd()).collect();
    channel::send_fds(ours.as_fd(), &borrowed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn idle_pid(spawner: &Spawner) -> Option<u32> {
        lock(&spawner.idle).as_ref().and_then(|w| w.child.id())
    }

    /// `cat` stands in for sandbox-init: it reads the plan off its channel and ignores it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_next_init_starts_only_when_asked_and_takes_the_next_plan_directly() {
        let spawner = Spawner::start(PathBuf::from("/bin/cat")).unwrap();
        let (r, w) = std::io::pipe().unwrap();
        let first = spawner.spawn(b"plan one".to_vec(), vec![OwnedFd::from(r)]).await.unwrap();
        first.hand_over.unwrap();
        // Nothing is started ahead until the launch says it no longer needs the CPU.
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert_eq!(idle_pid(&spawner), None);
        spawner.prepare_next();
        let started = std::time::Instant::now();
        let waiting = loop {
            if let Some(pid) = idle_pid(&spawner) {
                break pid;
            }
            assert!(started.elapsed() < std::time::Duration::from_secs(10), "no init was started ahead");
            std::thread::sleep(std::time::Duration::from_millis(5));
        };
        // Asking again while one waits keeps that one.
        spawner.prepare_next();
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert_eq!(idle_pid(&spawner), Some(waiting));
        let second = spawner.spawn(b"plan two".to_vec(), vec![OwnedFd::from(w)]).await.unwrap();
        second.hand_over.unwrap();
        assert_eq!(second.child.id(), Some(waiting), "the plan did not go to the init waiting for it");
        assert_ne!(first.child.id(), Some(waiting));
        std::thread::sleep(std::time::Duration::from_millis(100));
        assert_eq!(idle_pid(&spawner), None, "an init was started ahead unasked");
    }

    /// A launch that finds the slot empty while a Prepare is still forking gets that init
    /// (whichever of the two the thread or the launch gets to first): no second fork is
    /// made, and none is left waiting unasked.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_launch_right_after_a_prepare_uses_the_prepared_init() {
        let spawner = Spawner::start(PathBuf::from("/bin/cat")).unwrap();
        for _ in 0..5 {
            spawner.prepare_next();
            let (r, _w) = std::io::pipe().unwrap();
            let spawned = spawner.spawn(b"plan".to_vec(), vec![OwnedFd::from(r)]).await.unwrap();
            spawned.hand_over.unwrap();
            std::thread::sleep(std::time::Duration::from_millis(50));
            assert_eq!(
                idle_pid(&spawner),
                None,
                "the prepared init was left waiting and a second one forked"
            );
        }
    }
}
