//! The in-sandbox egress bridge (R-NET-2).
//!
//! A `domain-allowlist` sandbox has its own network namespace with only `lo`; its one way out
//! is the egress gateway's Unix socket, bind-mounted at `/run/sciencediscovery/egress.sock`.
//! The bridge is the sandbox's command prefix: it listens on `127.0.0.1:18118` (where
//! `HTTP_PROXY`/`HTTPS_PROXY` point), relays every connection to that socket, runs the workload
//! and exits with its status.
//!
//! The order is fixed: block the forwarded signals (before any thread exists), listen, start
//! the workload (while the bridge still has one thread), start accepting, then wait for the
//! workload while forwarding signals to it. The listener is close-on-exec, so the workload never
//! holds it; the bridge never reads stdin and never writes stdout, which belong to the workload.
//!
//! * `cli`: the command line, parsed without I/O.
//! * `relay`: listener, accept loop, the two-way relay, the 502/503 refusals.
//! * `workload`: starting the workload, forwarding signals, mapping its status.

mod cli;
mod relay;
mod workload;

use std::fs::File;
use std::io::Write;

use cli::{Invocation, Options};
use relay::RelayError;
use workload::{ForwardedSignals, WorkloadError};

/// Exit status for a command line the bridge refuses.
const EXIT_USAGE: i32 = 2;
/// Exit status when the bridge itself could not be set up (as `env`, `timeout` and container
/// runtimes use it): the workload did not run.
pub(crate) const EXIT_BRIDGE_FAILED: i32 = 125;

/// Why the bridge could not do its job.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BridgeError {
    #[error(transparent)]
    Relay(#[from] RelayError),
    #[error(transparent)]
    Workload(#[from] WorkloadError),
}

impl BridgeError {
    /// The process exit status that reports this failure.
    pub(crate) fn exit_code(&self) -> i32 {
        match self {
            BridgeError::Workload(e) => e.exit_code().unwrap_or(EXIT_BRIDGE_FAILED),
            BridgeError::Relay(_) => EXIT_BRIDGE_FAILED,
        }
    }
}

/// Entry point of the `egress-bridge` binary; returns the process exit status.
pub fn run() -> i32 {
    let args: Vec<_> = std::env::args_os().skip(1).collect();
    let options = match cli::parse(&args) {
        Ok(Invocation::Run(options)) => options,
        Ok(Invocation::Help) => {
            // Help goes to stderr too: stdout is the workload's, even here.
            write_stderr(cli::USAGE);
            return 0;
        }
        Err(e) => {
            say(&format!("{e} (see egress-bridge --help)"));
            return EXIT_USAGE;
        }
    };
    match bridge(&options) {
        Ok(code) => code,
        Err(e) => {
            say(&common::error_chain(&e));
            e.exit_code()
        }
    }
}

fn bridge(options: &Options) -> Result<i32, BridgeError> {
    let signals = ForwardedSignals::block()?;
    let listener = relay::listen(options.listen)?;
    let child = workload::start(&options.argv, &signals)?;
    if let Err(e) = relay::start(listener, options.socket.clone(), options.max_connections) {
        workload::abandon(child);
        return Err(e.into());
    }
    release_stdin_and_stdout();
    let status = workload::supervise(child, signals)?;
    Ok(workload::exit_code(status))
}

/// Points the bridge's own stdin and stdout at `/dev/null` once the workload holds them, so
/// that the workload's readers and writers see end of file when the workload (and whatever it
/// handed them to) is done, not when the bridge exits. Best effort: if `/dev/null` cannot be
/// opened, the bridge keeps them, as it would have without this step.
fn release_stdin_and_stdout() {
    if let Ok(null) = File::options().read(true).write(true).open("/dev/null") {
        let _ = nix::unistd::dup2_stdin(&null);
        let _ = nix::unistd::dup2_stdout(&null);
    }
}

/// Writes one `egress bridge: …` line to stderr.
pub(crate) fn say(message: &str) {
    write_stderr(&format!("egress bridge: {message}\n"));
}

/// Writes `text` to stderr in one piece, so that a line does not interleave with the
/// workload's output (stderr is unbuffered: `eprintln!` may write a line in several parts).
/// A closed stderr is not the bridge's problem.
fn write_stderr(text: &str) {
    let _ = std::io::stderr().lock().write_all(text.as_bytes());
}
