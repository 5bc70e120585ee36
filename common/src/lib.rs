//! Types and policy shared by the daemons of the runner suite.
//!
//! Without features this is the protocol `sandbox-init` speaks, and nothing more (it runs
//! once per launch and is built static):
//! * [`plan`]: the launch plan that `runnerd` hands to `sandbox-init`.
//! * [`channel`]: the length-prefixed, versioned postcard channel they speak, with file
//!   descriptors passed as `SCM_RIGHTS`.
//! * [`sys`]: the one wrapper that turns a raw syscall's `-1` into `io::Error`.
//! * [`names`]: [`named_enum!`], the closed sets of names that cross a boundary as text.
//!
//! Behind features, for the daemons:
//! * `seccomp` — [`seccomp`]: the sandbox's profiles (`baseline`, `network`, `npu`) for
//!   x86_64 and aarch64, as pure rule tables compiled to classic BPF.
//! * `egress` — [`egress`]: the egress policy and the runnerd ↔ egressd protocol.
//! * `npu` — [`npu`]: the runnerd ↔ npu-brokerd protocol.
//! * `provision` — [`provision`]: the runnerd ↔ `runner-provisioner` protocol (conda
//!   environments).
//! * `confine` — [`confine`]: the helper daemons' self-confinement.
//! * `daemon` — [`daemon`]: the start-up scaffold of the three daemons; [`layout`]: the data directory's names; [`settings`]: a daemon's TOML configuration file layered under its
//!   variables; [`audit`], [`systemd`], [`channel_async`], [`out`] (command-line output that
//!   ends quietly when its reader has gone) and [`timefmt`].

#[cfg(feature = "daemon")]
pub mod audit;
pub mod channel;
#[cfg(feature = "daemon")]
pub mod channel_async;
#[cfg(feature = "confine")]
pub mod confine;
#[cfg(any(feature = "confine", feature = "egress", feature = "npu"))]
mod confinement;
#[cfg(feature = "daemon")]
pub mod daemon;
#[cfg(feature = "egress")]
pub mod egress;
#[cfg(feature = "daemon")]
pub mod layout;
pub mod names;
#[cfg(feature = "npu")]
pub mod npu;
#[cfg(feature = "daemon")]
pub mod out;
pub mod plan;
#[cfg(feature = "provision")]
pub mod provision;
#[cfg(feature = "seccomp")]
pub mod seccomp;
#[cfg(feature = "daemon")]
pub mod settings;
pub mod sys;
#[cfg(feature = "daemon")]
pub mod systemd;
#[cfg(any(feature = "daemon", feature = "provision"))]
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

/// Whether `e`'s own message already contains its source's (`"...: {source}"`), which
/// [`error_chain`] would then print twice. For tests over an error enum's variants: every
/// module's enum keeps its message to itself and lets the chain add the cause.
pub fn repeats_its_source(e: &dyn std::error::Error) -> bool {
    e.source().is_some_and(|s| {
        let inner = s.to_string();
        !inner.is_empty() && e.to_string().contains(&inner)
    })
}

#[cfg(test)]
mod chain_tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    enum Sample {
        #[error("could not open {path}: {source}")]
        Repeats { path: &'static str, source: std::io::Error },
        #[error("could not open {path}")]
        Chained { path: &'static str, source: std::io::Error },
    }

    #[test]
    fn a_message_that_repeats_its_source_is_caught() {
        let io = || std::io::Error::from_raw_os_error(libc::ENOENT);
        let bad = Sample::Repeats { path: "/x", source: io() };
        assert!(repeats_its_source(&bad));
        let good = Sample::Chained { path: "/x", source: io() };
        assert!(!repeats_its_source(&good));
        assert_eq!(error_chain(&good), format!("could not open /x: {}", io()));
        assert!(!repeats_its_source(&io()), "no source, nothing repeated");
    }
}
