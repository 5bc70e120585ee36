//! Types and policy shared by the daemons of the runner suite.
//!
//! * [`plan`]: the launch plan that `runnerd` hands to `sandbox-init`.
//! * [`channel`]: the length-prefixed, versioned postcard channel they speak, with file
//!   descriptors passed as `SCM_RIGHTS`.
//! * [`seccomp`]: the seccomp profiles (`baseline`, `network`, `npu`) for x86_64 and aarch64,
//!   as pure rule tables compiled to classic BPF.
//! * [`settings`]: a daemon's TOML configuration file layered under its variables.
//! * [`npu`]: the runnerd ↔ npu-brokerd protocol.
//! * [`out`]: command-line output that ends quietly when its reader has gone.
//! * [`sys`]: the one wrapper that turns a raw syscall's `-1` into `io::Error`.

#[cfg(feature = "daemon")]
pub mod audit;
pub mod channel;
#[cfg(feature = "daemon")]
pub mod channel_async;
pub mod confine;
pub mod egress;
pub mod npu;
pub mod out;
pub mod plan;
pub mod seccomp;
#[cfg(feature = "daemon")]
pub mod settings;
pub mod sys;
#[cfg(feature = "daemon")]
pub mod systemd;
pub mod timefmt;

/// The full chain of an error, `outer: inner: root`, for reports and logs.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}
