//! The workload: started like a shell would start it, with the bridge's stdio, environment and
//! working directory; sent the signals the bridge receives; its status becomes the bridge's.

use std::ffi::OsString;
use std::io;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread;

use nix::errno::Errno;
use nix::sys::signal::{self, SigSet, SigmaskHow, Signal};
use nix::sys::wait::{Id, WaitPidFlag, waitid};
use nix::unistd::Pid;

/// The signals the bridge passes on to the workload.
pub(crate) const FORWARDED_SIGNALS: [Signal; 3] = [Signal::SIGTERM, Signal::SIGINT, Signal::SIGHUP];

/// Exit status when the program was found but cannot be executed (as in a shell).
pub(crate) const EXIT_CANNOT_EXECUTE: i32 = 126;
/// Exit status when the program cannot be started at all, usually because it does not exist.
pub(crate) const EXIT_NOT_FOUND: i32 = 127;

/// Why the workload could not be run to completion.
#[derive(Debug, thiserror::Error)]
pub(crate) enum WorkloadError {
    #[error("cannot block SIGTERM, SIGINT and SIGHUP for forwarding them to the workload")]
    BlockSignals(#[source] Errno),
    #[error("cannot start {argv0}")]
    Spawn {
        argv0: String,
        #[source]
        source: io::Error,
    },
    #[error("cannot start the signal-forwarding thread; the workload was killed")]
    Forwarder(#[source] io::Error),
    #[error("cannot wait for the workload")]
    Wait(#[source] io::Error),
}

impl WorkloadError {
    /// The shell's status for a program that could not be started; `None` when the failure is
    /// the bridge's own.
    pub(crate) fn exit_code(&self) -> Option<i32> {
        match self {
            WorkloadError::Spawn { source, .. } => Some(spawn_failure_code(source)),
            _ => None,
        }
    }
}

/// The forwarded signals, blocked in the thread that called [`ForwardedSignals::block`] and in
/// every thread it starts afterwards, so that only [`supervise`]'s forwarding thread takes them.
#[derive(Debug)]
pub(crate) struct ForwardedSignals {
    set: SigSet,
    /// The mask the bridge was started with, which the workload gets back.
    original_mask: SigSet,
}

impl ForwardedSignals {
    /// Blocks the forwarded signals. Call it before the process starts any thread: a thread
    /// that does not block them would take their default action and end the bridge instead.
    pub(crate) fn block() -> Result<ForwardedSignals, WorkloadError> {
        let set: SigSet = FORWARDED_SIGNALS.into_iter().collect();
        let original_mask =
            set.thread_swap_mask(SigmaskHow::SIG_BLOCK).map_err(WorkloadError::BlockSignals)?;
        Ok(ForwardedSignals { set, original_mask })
    }
}

/// Starts the workload with everything inherited: stdio, environment, working directory and
/// the signal mask the bridge itself was started with. Descriptors opened by `std` are
/// close-on-exec, so the workload receives nothing else of the bridge's. Call it while the
/// bridge has a single thread.
pub(crate) fn start(argv: &[OsString], signals: &ForwardedSignals) -> Result<Child, WorkloadError> {
    let (program, args) = argv.split_first().ok_or_else(|| WorkloadError::Spawn {
        argv0: String::new(),
        source: io::Error::new(io::ErrorKind::InvalidInput, "no program given"),
    })?;
    let mut command = Command::new(program);
    command.args(args);
    // `Command` leaves the signal mask as it is (it resets only SIGPIPE), and a workload
    // started with SIGTERM blocked could not be stopped by it: restore the original mask.
    let mask = signals.original_mask;
    // SAFETY: the closure runs in the child between fork and exec, where only
    // async-signal-safe calls are allowed: it makes one, pthread_sigmask, and neither
    // allocates nor locks (an `Errno` converts to an `io::Error` without allocating).
    unsafe {
        command.pre_exec(move || mask.thread_set_mask().map_err(io::Error::from));
    }
    command
        .spawn()
        .map_err(|source| WorkloadError::Spawn { argv0: program.to_string_lossy().into_owned(), source })
}

/// Kills and reaps a workload the bridge cannot serve: fail closed.
pub(crate) fn abandon(mut child: Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// Forwards the blocked signals to `child` until it has exited, then reaps it.
pub(crate) fn supervise(mut child: Child, signals: ForwardedSignals) -> Result<ExitStatus, WorkloadError> {
    let pid = match i32::try_from(child.id()) {
        Ok(pid) => Pid::from_raw(pid),
        Err(_) => return child.wait().map_err(WorkloadError::Wait),
    };
    // `true` once the child has exited; the pid stays reserved (a zombie) until it turns true.
    let exited = Arc::new(Mutex::new(false));
    let forwarder = {
        let exited = Arc::clone(&exited);
        thread::Builder::new().name("egress-signals".into()).spawn(move || forward(&signals, pid, &exited))
    };
    if let Err(e) = forwarder {
        // A workload that the bridge's signals could not reach must not run on.
        abandon(child);
        return Err(WorkloadError::Forwarder(e));
    }
    // Wait without reaping, so that a signal sent meanwhile can never reach a recycled pid.
    loop {
        match waitid(Id::Pid(pid), WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT) {
            Ok(_) => break,
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(WorkloadError::Wait(e.into())),
        }
    }
    *exited.lock().unwrap_or_else(PoisonError::into_inner) = true;
    child.wait().map_err(WorkloadError::Wait)
}

fn forward(signals: &ForwardedSignals, pid: Pid, exited: &Mutex<bool>) {
    // `wait` fails only for an invalid set; there is nothing to forward then.
    while let Ok(sig) = signals.set.wait() {
        let exited = exited.lock().unwrap_or_else(PoisonError::into_inner);
        if *exited {
            return;
        }
        // The child is alive or an unreaped zombie: the pid is still its own.
        let _ = signal::kill(pid, sig);
    }
}

/// The bridge's exit status for the workload's: its exit code, or 128+S when signal S ended
/// it, as a shell reports it.
pub(crate) fn exit_code(status: ExitStatus) -> i32 {
    match (status.code(), status.signal()) {
        (Some(code), _) => code,
        (None, Some(signal)) => 128 + signal,
        // `wait` reports only exits and deaths; a stopped child never gets here.
        (None, None) => super::EXIT_BRIDGE_FAILED,
    }
}

/// A shell's status for a program it could not start: 126 when the file is there but cannot
/// be executed, 127 otherwise.
pub(crate) fn spawn_failure_code(error: &io::Error) -> i32 {
    match error.raw_os_error() {
        Some(libc::EACCES | libc::EPERM | libc::ENOEXEC | libc::EISDIR | libc::ETXTBSY) => {
            EXIT_CANNOT_EXECUTE
        }
        _ => EXIT_NOT_FOUND,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_status_mapping() {
        // Raw wait statuses: exit code in bits 8..16, terminating signal in bits 0..7, 0x80
        // when a core was dumped.
        let table = [
            (0, 0),
            (7 << 8, 7),
            (255 << 8, 255),
            (libc::SIGTERM, 143),
            (libc::SIGKILL, 137),
            (libc::SIGINT, 130),
            (libc::SIGSEGV | 0x80, 139),
        ];
        for (raw, expected) in table {
            assert_eq!(exit_code(ExitStatus::from_raw(raw)), expected, "raw status {raw:#x}");
        }
    }

    #[test]
    fn spawn_failure_codes() {
        let table = [
            (libc::ENOENT, 127),
            (libc::ENOTDIR, 127),
            (libc::E2BIG, 127),
            (libc::EACCES, 126),
            (libc::EPERM, 126),
            (libc::ENOEXEC, 126),
            (libc::EISDIR, 126),
            (libc::ETXTBSY, 126),
        ];
        for (errno, expected) in table {
            assert_eq!(spawn_failure_code(&io::Error::from_raw_os_error(errno)), expected, "errno {errno}");
        }
        let custom = io::Error::new(io::ErrorKind::InvalidInput, "no program given");
        assert_eq!(spawn_failure_code(&custom), 127);
    }

    #[test]
    fn spawn_failure_names_the_program_and_the_cause() {
        let argv = vec![OsString::from("/nonexistent/program")];
        let signals = ForwardedSignals {
            set: SigSet::empty(),
            original_mask: SigSet::thread_get_mask().expect("mask"),
        };
        let e = start(&argv, &signals).expect_err("started a program that does not exist");
        assert_eq!(e.exit_code(), Some(127));
        let text = common::error_chain(&e);
        assert!(text.starts_with("cannot start /nonexistent/program: "), "{text}");
        assert!(text.contains("No such file or directory"), "{text}");
    }
}
