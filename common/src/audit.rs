//! Where a daemon's structured events go (R-OPS-2): journald under its own identifier
//! (`runnerd`, `egressd`) when it runs under systemd (or `SCIENCE_AGENT_LOG_TARGET=journald`, or
//! `log_target = "journald"` in its configuration file), else stderr.
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

/// Where events go: `SCIENCE_AGENT_LOG_TARGET` (`log_target` in the configuration file).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum LogTarget {
    /// journald under systemd (`JOURNAL_STREAM` or `INVOCATION_ID` set), else stderr.
    #[default]
    Auto,
    Journald,
    Stderr,
}

/// The daemon's logging settings, validated at start like every other setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogSettings {
    pub level: LevelFilter,
    pub target: LogTarget,
}

impl Default for LogSettings {
    fn default() -> LogSettings {
        LogSettings { level: LevelFilter::INFO, target: LogTarget::Auto }
    }
}

/// A log setting with a value it does not know. `name` is the variable, or the key and file
/// when the value came from the configuration file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{name} must be one of {expected}, not {value:?}")]
pub struct LogError {
    pub name: String,
    pub value: String,
    pub expected: &'static str,
}

pub const LEVEL_VAR: &str = "SCIENCE_AGENT_LOG_LEVEL";
pub const TARGET_VAR: &str = "SCIENCE_AGENT_LOG_TARGET";

impl LogSettings {
    /// Reads `SCIENCE_AGENT_LOG_LEVEL` and `SCIENCE_AGENT_LOG_TARGET` through `var` (the
    /// environment over the configuration file); unset or empty means the default.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<LogSettings, LogError> {
        let get = |name: &str| var(name).map(|v| v.trim().to_ascii_lowercase()).filter(|v| !v.is_empty());
        let level = match get(LEVEL_VAR).as_deref() {
            None | Some("info") => LevelFilter::INFO,
            Some("error") => LevelFilter::ERROR,
            Some("warn" | "warning") => LevelFilter::WARN,
            Some("debug") => LevelFilter::DEBUG,
            Some("trace") => LevelFilter::TRACE,
            Some("off") => LevelFilter::OFF,
            Some(_) => {
                return Err(LogError {
                    name: LEVEL_VAR.to_owned(),
                    value: var(LEVEL_VAR).unwrap_or_default(),
                    expected: "error, warn, info, debug, trace, off",
                });
            }
        };
        let target = match get(TARGET_VAR).as_deref() {
            None | Some("auto") => LogTarget::Auto,
            Some("journald") => LogTarget::Journald,
            Some("stderr") => LogTarget::Stderr,
            Some(_) => {
                return Err(LogError {
                    name: TARGET_VAR.to_owned(),
                    value: var(TARGET_VAR).unwrap_or_default(),
                    expected: "journald, stderr, auto",
                });
            }
        };
        Ok(LogSettings { level, target })
    }

    /// The level as written in the configuration (`info`).
    pub fn level_name(&self) -> &'static str {
        match self.level {
            LevelFilter::OFF => "off",
            LevelFilter::ERROR => "error",
            LevelFilter::WARN => "warn",
            LevelFilter::DEBUG => "debug",
            LevelFilter::TRACE => "trace",
            _ => "info",
        }
    }

    pub fn target_name(&self) -> &'static str {
        match self.target {
            LogTarget::Auto => "auto (journald under systemd, else stderr)",
            LogTarget::Journald => "journald",
            LogTarget::Stderr => "stderr",
        }
    }
}

/// Installs the global subscriber from the environment alone (once; later calls are
/// ignored). The daemons use [`init_with`] and the settings they validated at start.
pub fn init(identifier: &str) -> Sink {
    init_with(identifier, &LogSettings::from_vars(|k| std::env::var(k).ok()).unwrap_or_default())
}

/// Installs the global subscriber (once; later calls are ignored).
pub fn init_with(identifier: &str, settings: &LogSettings) -> Sink {
    let level = settings.level;
    let under_systemd =
        std::env::var_os("JOURNAL_STREAM").is_some() || std::env::var_os("INVOCATION_ID").is_some();
    let want_journald = match settings.target {
        LogTarget::Journald => true,
        LogTarget::Stderr => false,
        LogTarget::Auto => under_systemd,
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
    let ansi = std::io::stderr().is_terminal();
    let layer = tracing_subscriber::fmt::layer()
        .with_writer(move || EscapingStderr { keep_escape: ansi })
        .with_target(false)
        .with_ansi(ansi)
        .with_filter(level);
    let _ = tracing_subscriber::registry().with(layer).try_init();
    Sink::Stderr
}

/// The stderr sink, one event per `write`: a field value holding a newline (an id a caller
/// chose) must not start a line of its own that reads like another event (issue #14). Every
/// control byte but the event's final newline is written escaped (`\n`, `\r`, `\t`,
/// `\x1b`…); ESC is kept only when the sink colours a terminal itself.
struct EscapingStderr {
    keep_escape: bool,
}

impl std::io::Write for EscapingStderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        std::io::stderr().lock().write_all(&escape_line(buf, self.keep_escape))?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

/// `buf` with its control bytes escaped, a final newline kept as it is.
pub fn escape_line(buf: &[u8], keep_escape: bool) -> Vec<u8> {
    let (body, end) = match buf.strip_suffix(b"\n") {
        Some(body) => (body, &b"\n"[..]),
        None => (buf, &b""[..]),
    };
    let mut out = Vec::with_capacity(buf.len() + 8);
    for &b in body {
        match b {
            b'\n' => out.extend_from_slice(b"\\n"),
            b'\r' => out.extend_from_slice(b"\\r"),
            b'\t' => out.extend_from_slice(b"\\t"),
            0x1b if keep_escape => out.push(b),
            0..=0x1f | 0x7f => out.extend_from_slice(format!("\\x{b:02x}").as_bytes()),
            _ => out.push(b),
        }
    }
    out.extend_from_slice(end);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn settings(pairs: &[(&str, &str)]) -> Result<LogSettings, LogError> {
        let map: HashMap<&str, &str> = pairs.iter().copied().collect();
        LogSettings::from_vars(|k| map.get(k).map(|v| v.to_string()))
    }

    #[test]
    fn control_bytes_in_an_event_are_escaped_and_the_final_newline_kept() {
        let forged = b"INFO execution_id=a\nWARN event=\"auth_failed\"\r\t\x1b[2J\x07\n";
        let out = escape_line(forged, false);
        assert_eq!(out, b"INFO execution_id=a\\nWARN event=\"auth_failed\"\\r\\t\\x1b[2J\\x07\n");
        assert_eq!(out.iter().filter(|b| **b == b'\n').count(), 1);
        assert_eq!(escape_line(b"\x1b[32mINFO\x1b[0m ok\n", true), b"\x1b[32mINFO\x1b[0m ok\n");
        assert_eq!(escape_line(b"no newline", false), b"no newline");
        assert_eq!(escape_line("é 漢字\n".as_bytes(), false), "é 漢字\n".as_bytes());
    }

    #[test]
    fn levels_and_targets() {
        assert_eq!(settings(&[]).unwrap(), LogSettings::default());
        let s = settings(&[(LEVEL_VAR, "WARNING"), (TARGET_VAR, "stderr")]).unwrap();
        assert_eq!((s.level, s.target, s.level_name()), (LevelFilter::WARN, LogTarget::Stderr, "warn"));
        let s = settings(&[(LEVEL_VAR, " "), (TARGET_VAR, "journald")]).unwrap();
        assert_eq!((s.level, s.target), (LevelFilter::INFO, LogTarget::Journald));
        let err = settings(&[(LEVEL_VAR, "verbose")]).unwrap_err().to_string();
        assert_eq!(
            err,
            "SCIENCE_AGENT_LOG_LEVEL must be one of error, warn, info, debug, trace, off, not \"verbose\""
        );
        let err = settings(&[(TARGET_VAR, "syslog")]).unwrap_err().to_string();
        assert!(err.starts_with("SCIENCE_AGENT_LOG_TARGET must be one of journald"), "{err}");
    }
}
