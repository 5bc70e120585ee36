//! `sandbox-init`: the only code that runs between `runnerd`'s fork and bubblewrap.
//!
//! `runnerd` is multithreaded (tokio), so it never runs setup code between fork and exec.
//! Instead it spawns this small single-threaded program with one end of a socketpair on
//! standard input, and sends it the launch plan (postcard, versioned) followed by the
//! sandbox's descriptors (`SCM_RIGHTS`). This program then applies everything to itself in
//! one fixed order and execs bwrap:
//!
//! 0. Arm `PR_SET_PDEATHSIG(SIGKILL)`, so the launch dies with runnerd; stop if it already did.
//! 1. Make room for staging descriptors (soft `RLIMIT_NOFILE`), check that the channel on
//!    fd 0 was made by our parent (else runnerd died before step 0,
//!    or we were started by hand) and move it to a close-on-exec descriptor above every
//!    target number.
//! 2. Read the plan; a protocol version mismatch is reported as such. There is no timeout:
//!    runnerd starts the next sandbox-init ahead of its launch, so it may wait here for long;
//!    nothing before this step depends on the launch, and step 0 ties it to runnerd.
//! 3. Validate the plan (absolute bwrap path, distinct targets in range, sane limits).
//! 4. Receive the descriptors (each close-on-exec on arrival); join the execution's cgroups
//!    by writing `0` into each passed join file (`cgroup.procs`, or v1's `tasks`: this
//!    program is single-threaded, so its thread is the process), and close those.
//! 5. Place them at their target numbers (0–2 stdio, 3 seccomp program, 4 bwrap info);
//!    `dup2` leaves the targets inheritable. Then, for each directory the plan idmaps (a
//!    caller-made workspace, issue #30), while still root: in a private mount namespace of
//!    our own, attach an idmapped clone of it (its owner mapped to the sandbox user) over the
//!    directory itself, and place the clone's descriptor where bwrap's `--bind-fd` expects it.
//! 6. Close every other descriptor, whatever runnerd's environment leaked into us.
//! 7. Apply the resource limits (core 0, nofile, fsize; nproc/as when configured).
//! 8. Reset every signal disposition to default and unblock all signals (Rust ignores
//!    SIGPIPE in its runtime, and an ignored disposition survives exec).
//! 9. Switch to the plan's unprivileged sandbox user (groups, gids, uids; the death signal
//!    armed again), and refuse to go on as host uid 0 whatever the plan says: no sandbox
//!    code ever runs as host root.
//! 10. Send `Executing`, then `execve` bwrap with an **empty environment** (R-SBX-7): bwrap
//!     stays PID 1 of the sandbox and its environment is readable at `/proc/1/environ`.
//!
//! Any failure, including the exec itself, is sent back as an [`InitFailure`] and the
//! process exits with 127. Success is seen by runnerd as `Executing` followed by
//! end-of-file (the channel is close-on-exec); end-of-file alone means we died.

mod steps;

use std::os::unix::net::UnixStream;

use common::channel;
use common::plan::{InitFailure, InitReport};

/// Exit status after a reported failure (like a shell's "command not executable").
pub const FAILED_STATUS: i32 = 127;
/// Exit status when started by hand, without a channel.
pub const USAGE_STATUS: i32 = 2;

const USAGE: &str = "\
sandbox-init: per-launch helper of the ScienceDiscovery runner.

runnerd starts it with a Unix socket on standard input and sends it a launch plan; it then
places the seccomp program on fd 3, applies resource limits, closes every other descriptor
and execs bubblewrap with an empty environment. It is not meant to be run by hand.

Options:
  --help       print this text
  --version    print the version and the internal protocol version
";

/// Runs the fixed sequence; returns only on failure, with the exit status to use.
pub fn run() -> i32 {
    let mut args = std::env::args().skip(1);
    match args.next().as_deref() {
        None => {}
        Some("--help" | "-h") => {
            print!("{USAGE}");
            return 0;
        }
        Some("--version" | "-V") => {
            println!(
                "sandbox-init {} (protocol {})",
                env!("CARGO_PKG_VERSION"),
                common::plan::PROTOCOL_VERSION
            );
            return 0;
        }
        Some(other) => {
            eprintln!("sandbox-init: unknown argument {other:?}\n\n{USAGE}");
            return USAGE_STATUS;
        }
    }

    if let Err(message) = steps::die_with_parent() {
        eprintln!("sandbox-init: {message}");
        return FAILED_STATUS;
    }
    if let Err(message) = steps::room_for_staging() {
        eprintln!("sandbox-init: {message}");
        return FAILED_STATUS;
    }
    let channel = match steps::take_channel() {
        Ok(channel) => channel,
        Err(message) => {
            eprintln!("sandbox-init: {message}\n\n{USAGE}");
            return USAGE_STATUS;
        }
    };
    let failure = steps::launch(&channel);
    report(&channel, failure);
    FAILED_STATUS
}

fn report(channel: &UnixStream, failure: InitFailure) {
    // If runnerd is gone there is nobody to tell; the exit status still says it.
    let _ = channel::write_message(&mut &*channel, &InitReport::Failed(failure));
}
