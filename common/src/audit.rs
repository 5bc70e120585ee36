//! Where a daemon's structured events go (R-OPS-2): journald under its own identifier
//! (`runnerd`, `egressd`) when it runs under systemd (or `SCIENCE_AGENT_LOG_TARGET=journald`), else stderr.
//! Every decision that matters is one `tracing` event with fields (`event`, ids, outcome),
//! never the token.

use tracing::level_filters::LevelFilter;
use tracing_subscriber::Layer;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// Which sink was chosen, for the start-up line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sink {
    Journald,
    Stderr,
}

fn level(var: Option<String>) -> LevelFilter {
    match var.as_deref().map(str::to_ascii_lowercase).as_deref() {
        Some("error") => LevelFilter::ERROR,
        Some("warn" | "warning") => LevelFilter::WARN,
        Some("debug") => LevelFilter::DEBUG,
        Some("trace") => LevelFilter::TRACE,
        Some("off") => LevelFilter::OFF,
        _ => LevelFilter::INFO,
    }
}

/// Installs the global subscriber (once; later calls are ignored).
pub fn init(identifier: &str) -> Sink {
    let level = level(std::env::var("SCIENCE_AGENT_LOG_LEVEL").ok());
    let target = std::env::var("SCIENCE_AGENT_LOG_TARGET").ok();
    let under_systemd =
        std::env::var_os("JOURNAL_STREAM").is_some() || std::env::var_os("INVOCATION_ID").is_some();
    let want_journald = match target.as_deref() {
        Some("journald") => true,
        Some("stderr") => false,
        _ => under_systemd,
    };
    if want_journald && let Ok(layer) = tracing_journald::layer() {
        // No field prefix: `event` is `EVENT`, not `F_EVENT`, so `journalctl EVENT=auth_failed`
        // and `-o json` read the fields by the names the README lists.
        let layer =
            layer.with_syslog_identifier(identifier.to_owned()).with_field_prefix(None).with_filter(level);
        if tracing_subscriber::registry().with(layer).try_init().is_ok() {
            return Sink::Journald;
        }
    }
    use std::io::IsTerminal;
    let layer = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(std::io::stderr().is_terminal())
        .with_filter(level);
    let _ = tracing_subscriber::registry().with(layer).try_init();
    Sink::Stderr
}
