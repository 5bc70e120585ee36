//! The handle on one running sandbox's processes, and how it is ended.
//!
//! bwrap's monitor reports the PID-namespace init on `--info-fd` right after `clone`. Until
//! then there is nothing safe to kill: killing the monitor early leaves its child blocked
//! (re-parented, before it arms its own death signal) and holding the output pipes. So an
//! end request before the report is remembered, and the report kills the init at once.
//! A watcher task reads the report independently of the run, so this also works when the
//! run's future is dropped. Should bwrap never report (it failed before `clone`, or is
//! wedged), the monitor itself is killed after a grace period.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::sys;
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncReadExt, Interest};
use tokio::net::unix::pipe;
use tokio::sync::Notify;

/// How long an end request waits for bwrap's report before killing the monitor instead.
pub const REPORT_GRACE: Duration = Duration::from_secs(5);

#[derive(Debug, Default)]
struct State {
    /// pidfd of the PID-namespace init, once reported and verified.
    init: Option<OwnedFd>,
    init_pid: Option<i32>,
    /// bwrap has finished reporting (with or without an init).
    reported: bool,
    /// Someone asked for the sandbox to end.
    ending: bool,
}

/// Shared by the run, its watcher task and its drop guard.
#[derive(Debug)]
pub struct Sandbox {
    monitor: Option<OwnedFd>,
    monitor_pid: i32,
    state: Mutex<State>,
    end_requested: Notify,
    reported: Notify,
}

impl Sandbox {
    /// `monitor` is a pidfd of the bwrap process (sandbox-init exec'd into it).
    pub fn new(monitor_pid: i32) -> Arc<Sandbox> {
        Arc::new(Sandbox {
            monitor: sys::pidfd_open(monitor_pid).ok(),
            monitor_pid,
            state: Mutex::new(State::default()),
            end_requested: Notify::new(),
            reported: Notify::new(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Host pid of the namespace init, when known.
    pub fn init_pid(&self) -> Option<i32> {
        self.lock().init_pid
    }

    /// Ends the sandbox: SIGKILL to the namespace init, which takes every process of the
    /// namespace with it (the bwrap monitor then reaps it and exits). Idempotent.
    pub fn end(&self) {
        let mut state = self.lock();
        state.ending = true;
        self.kill_locked(&state);
        drop(state);
        self.end_requested.notify_one();
    }

    fn kill_locked(&self, state: &State) {
        if let Some(init) = &state.init {
            // ESRCH (already gone) is fine.
            let _ = sys::pidfd_send_signal(init.as_fd(), libc::SIGKILL);
        } else if state.reported {
            // bwrap reported no namespace: nothing inside to kill; stop the monitor.
            self.kill_monitor();
        }
        // Otherwise the report is still coming: `reported` will kill.
    }

    fn kill_monitor(&self) {
        if let Some(monitor) = &self.monitor {
            let _ = sys::pidfd_send_signal(monitor.as_fd(), libc::SIGKILL);
        }
    }

    fn reported(&self, init_pid: Option<i32>) {
        let init = init_pid.and_then(|pid| open_init(pid, self.monitor_pid));
        let mut state = self.lock();
        state.reported = true;
        state.init_pid = init.as_ref().and(init_pid);
        state.init = init;
        if state.ending {
            self.kill_locked(&state);
        }
        drop(state);
        self.reported.notify_waiters();
    }

    /// Waits until the PID namespace is really gone. bwrap's monitor can exit as soon as
    /// its init reports the command's exit status, a moment before the init itself exits
    /// and the kernel kills what is left in the namespace; background processes live in
    /// that moment. The init's pidfd turns readable only once its exit — and with it the
    /// namespace's teardown — is complete. Bounded by `limit`; kills the init if needed.
    pub async fn ensure_ended(&self, limit: Duration) {
        let reported = self.reported.notified();
        tokio::pin!(reported);
        reported.as_mut().enable();
        if !self.lock().reported {
            let _ = tokio::time::timeout(limit, reported).await;
        }
        let init = self.lock().init.as_ref().and_then(|fd| fd.try_clone().ok());
        let Some(init) = init else { return };
        if !wait_exited(&init, Duration::from_millis(200)).await {
            // Still alive after its command ended: end it now.
            let _ = sys::pidfd_send_signal(init.as_fd(), libc::SIGKILL);
            wait_exited(&init, limit).await;
        }
    }

    /// Reads bwrap's report from the info pipe; kills the monitor if an end was requested
    /// and the report does not come within [`REPORT_GRACE`].
    pub async fn watch(self: Arc<Self>, info: OwnedFd) {
        let report = read_child_pid(info);
        let give_up = async {
            self.end_requested.notified().await;
            tokio::time::sleep(REPORT_GRACE).await;
        };
        tokio::select! {
            pid = report => self.reported(pid),
            _ = give_up => {
                self.lock().reported = true;
                self.kill_monitor();
            }
        }
    }
}

/// Whether the process behind `pidfd` has exited (a pidfd turns readable then), waiting up
/// to `limit` on the runtime's reactor.
async fn wait_exited(pidfd: &OwnedFd, limit: Duration) -> bool {
    let mut poll = libc::pollfd { fd: pidfd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: poll reads one pollfd we own, with a zero timeout. A failed poll (EINTR,
    // say) answers "not yet", and the wait below decides.
    if common::sys::cvt(unsafe { libc::poll(&mut poll, 1, 0) }).is_ok_and(|ready| ready > 0) {
        return true;
    }
    let Ok(fd) = pidfd.try_clone() else { return false };
    // SAFETY: the AsyncFd owns this OwnedFd, which stays open and keeps its number until
    // the AsyncFd is dropped.
    let Ok(watched) = (unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }) else {
        return false;
    };
    tokio::time::timeout(limit, watched.readable()).await.is_ok_and(|r| r.is_ok())
}

/// A pidfd for the reported init, but only if it really is bwrap's child and PID 1 of its
/// namespace: the pid may in theory have been reaped and reused since bwrap wrote it.
fn open_init(pid: i32, monitor_pid: i32) -> Option<OwnedFd> {
    let pidfd = sys::pidfd_open(pid).ok()?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| status.lines().find_map(|l| l.strip_prefix(name)).map(str::trim);
    let parent_ok = field("PPid:")?.parse::<i32>().ok()? == monitor_pid;
    let init_ok = field("NSpid:")?.split_whitespace().last()? == "1";
    (parent_ok && init_ok).then_some(pidfd)
}

/// bwrap's `--info-fd` JSON: `{"child-pid": N, …}`, then end-of-file.
async fn read_child_pid(info: OwnedFd) -> Option<i32> {
    let mut info = pipe::Receiver::from_owned_fd(info).ok()?;
    let mut text = Vec::new();
    (&mut info).take(64 * 1024).read_to_end(&mut text).await.ok()?;
    let value: serde_json::Value = serde_json::from_slice(&text).ok()?;
    value.get("child-pid")?.as_i64().and_then(|p| i32::try_from(p).ok())
}
