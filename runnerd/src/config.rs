//! runnerd's configuration from the original's `SCIENCE_AGENT_*` variables (contract §5.5),
//! with the original's defaults and start-up errors, plus our additive settings. Parsing is
//! a pure function of a variable lookup, so every rule is table-tested.

use std::path::PathBuf;
use std::time::Duration;

/// Defaults from the original runner (internals §2.1, contract §5.5).
pub const DEFAULT_PORT: u16 = 4311;
pub const DEFAULT_HOST: &str = "127.0.0.1";
pub const DEFAULT_MAX_WORKSPACE_BYTES: u64 = 10_737_418_240;
pub const DEFAULT_MAX_OUTPUT_BYTES: u64 = 1_073_741_824;
pub const DEFAULT_SIGNATURE_MAX_AGE_MS: u64 = 30_000;
/// The original's well-known token, accepted only with `--insecure-default-token`.
pub const WELL_KNOWN_TOKEN: &str = "sciencediscovery-runner-local";
/// JavaScript's `Number.MAX_SAFE_INTEGER`: the original validates "safe integers".
pub const MAX_SAFE_INTEGER: u64 = (1 << 53) - 1;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunnerConfig {
    pub host: String,
    pub port: u16,
    /// `SCIENCE_AGENT_RUNNER_SOCKET`: listen on this Unix socket instead of TCP.
    pub socket_path: Option<PathBuf>,
    pub data_dir: PathBuf,
    pub bwrap_path: String,
    pub sandbox_init: Option<PathBuf>,
    pub exec_timeout_ms: u64,
    pub max_output_bytes: u64,
    pub max_workspace_bytes: u64,
    pub signature_max_age_ms: u64,
    /// Legacy, validated like the original and otherwise unused.
    pub kernel_idle_ms: u64,
    /// `SCIENCE_AGENT_PYTHON_PATH`: the host Python for `/execute`.
    pub python_path: String,
    pub npu_broker_enabled: bool,
    /// `SCIENCE_AGENT_RUNNER_TOKEN_FILE`: a file holding the token.
    pub token_file: Option<PathBuf>,
    /// Ours: executions admitted (queued + running) before 503 `queue_full`.
    pub queue_capacity: usize,
    /// Ours: sandboxes running at once, across workspaces.
    pub max_concurrent: usize,
    /// Ours: a client must send its request head within this time.
    pub header_read_timeout: Duration,
    /// `SCIENCE_AGENT_EGRESS_SOCKET`: egressd's control socket.
    pub egress_socket: PathBuf,
    /// `SCIENCE_AGENT_EGRESS_BRIDGE_PATH`: the bridge bound into network sandboxes.
    pub egress_bridge: Option<PathBuf>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("SCIENCE_AGENT_RUNNER_PORT must be an integer between 0 and 65535, not {0:?}")]
    Port(String),
    #[error("{name} must be a non-negative integer, not {value:?}")]
    NonNegative { name: &'static str, value: String },
    #[error("SCIENCE_AGENT_EXECUTION_SIGNATURE_MAX_AGE_MS must be a positive integer number of milliseconds")]
    SignatureMaxAge,
    #[error("{name} must be a positive integer, not {value:?}")]
    Positive { name: &'static str, value: String },
}

/// A non-negative safe integer in decimal, like the original's parser accepts.
pub fn parse_non_negative(text: &str) -> Option<u64> {
    let t = text.trim();
    if t.is_empty() || !t.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    t.parse::<u64>().ok().filter(|v| *v <= MAX_SAFE_INTEGER)
}

fn truthy(text: &str) -> bool {
    matches!(text.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes")
}

impl RunnerConfig {
    /// Reads the configuration through `var` (the process environment in production).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<RunnerConfig, ConfigError> {
        let get = |name: &str| var(name).filter(|v| !v.is_empty());
        let non_negative = |name: &'static str, default: u64| -> Result<u64, ConfigError> {
            match get(name) {
                None => Ok(default),
                Some(v) => parse_non_negative(&v).ok_or(ConfigError::NonNegative { name, value: v }),
            }
        };
        let positive = |name: &'static str, default: usize| -> Result<usize, ConfigError> {
            match get(name) {
                None => Ok(default),
                Some(v) => parse_non_negative(&v)
                    .filter(|n| *n > 0)
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or(ConfigError::Positive { name, value: v }),
            }
        };
        let port = match get("SCIENCE_AGENT_RUNNER_PORT") {
            None => DEFAULT_PORT,
            Some(v) => {
                parse_non_negative(&v).and_then(|p| u16::try_from(p).ok()).ok_or(ConfigError::Port(v))?
            }
        };
        let signature_max_age_ms = match get("SCIENCE_AGENT_EXECUTION_SIGNATURE_MAX_AGE_MS") {
            None => DEFAULT_SIGNATURE_MAX_AGE_MS,
            Some(v) => parse_non_negative(&v).filter(|n| *n > 0).ok_or(ConfigError::SignatureMaxAge)?,
        };
        let kernel_idle_ms = non_negative("SCIENCE_AGENT_KERNEL_IDLE_MS", 0)?;
        let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2);
        Ok(RunnerConfig {
            host: get("SCIENCE_AGENT_RUNNER_HOST").unwrap_or_else(|| DEFAULT_HOST.to_owned()),
            port,
            socket_path: get("SCIENCE_AGENT_RUNNER_SOCKET").map(PathBuf::from),
            data_dir: get("SCIENCE_AGENT_DATA_DIR")
                .map(PathBuf::from)
                .unwrap_or(".sciencediscovery-data".into()),
            bwrap_path: get("SCIENCE_AGENT_BWRAP_PATH").unwrap_or_else(|| "bwrap".to_owned()),
            sandbox_init: get("SCIENCE_AGENT_SANDBOX_INIT_PATH").map(PathBuf::from),
            exec_timeout_ms: non_negative("SCIENCE_AGENT_EXEC_TIMEOUT_MS", 0)?,
            max_output_bytes: non_negative("SCIENCE_AGENT_MAX_OUTPUT_BYTES", DEFAULT_MAX_OUTPUT_BYTES)?,
            max_workspace_bytes: non_negative(
                "SCIENCE_AGENT_MAX_WORKSPACE_BYTES",
                DEFAULT_MAX_WORKSPACE_BYTES,
            )?,
            signature_max_age_ms,
            kernel_idle_ms,
            python_path: get("SCIENCE_AGENT_PYTHON_PATH").unwrap_or_else(|| "/usr/bin/python3".to_owned()),
            npu_broker_enabled: get("SCIENCE_AGENT_NPU_BROKER").is_some_and(|v| truthy(&v)),
            token_file: get("SCIENCE_AGENT_RUNNER_TOKEN_FILE").map(PathBuf::from),
            queue_capacity: positive("SCIENCE_AGENT_QUEUE_CAPACITY", 256)?,
            max_concurrent: positive("SCIENCE_AGENT_MAX_CONCURRENT_EXECUTIONS", cpus.max(2) * 2)?,
            header_read_timeout: Duration::from_millis(positive(
                "SCIENCE_AGENT_HEADER_READ_TIMEOUT_MS",
                10_000,
            )? as u64),
            egress_socket: get("SCIENCE_AGENT_EGRESS_SOCKET")
                .unwrap_or_else(|| crate::egress::DEFAULT_CONTROL_SOCKET.to_owned())
                .into(),
            egress_bridge: get("SCIENCE_AGENT_EGRESS_BRIDGE_PATH").map(PathBuf::from),
        })
    }

    pub fn from_env() -> Result<RunnerConfig, ConfigError> {
        RunnerConfig::from_vars(|k| std::env::var(k).ok())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn config(vars: &[(&str, &str)]) -> Result<RunnerConfig, ConfigError> {
        let map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        RunnerConfig::from_vars(|k| map.get(k).cloned())
    }

    #[test]
    fn defaults_are_the_originals() {
        let c = config(&[]).unwrap();
        assert_eq!((c.host.as_str(), c.port), ("127.0.0.1", 4311));
        assert_eq!(c.bwrap_path, "bwrap");
        assert_eq!(c.data_dir, PathBuf::from(".sciencediscovery-data"));
        assert_eq!(c.exec_timeout_ms, 0);
        assert_eq!(c.max_workspace_bytes, 10_737_418_240);
        assert_eq!(c.max_output_bytes, 1_073_741_824);
        assert_eq!(c.signature_max_age_ms, 30_000);
        assert!(!c.npu_broker_enabled);
        assert_eq!(c.socket_path, None);
    }

    #[test]
    fn overrides_parse() {
        let c = config(&[
            ("SCIENCE_AGENT_RUNNER_PORT", "0"),
            ("SCIENCE_AGENT_RUNNER_SOCKET", "/run/x.sock"),
            ("SCIENCE_AGENT_EXEC_TIMEOUT_MS", "60000"),
            ("SCIENCE_AGENT_MAX_WORKSPACE_BYTES", "0"),
            ("SCIENCE_AGENT_NPU_BROKER", "YES"),
            ("SCIENCE_AGENT_EXECUTION_SIGNATURE_MAX_AGE_MS", "45000"),
        ])
        .unwrap();
        assert_eq!(c.port, 0);
        assert_eq!(c.socket_path, Some(PathBuf::from("/run/x.sock")));
        assert_eq!(c.exec_timeout_ms, 60_000);
        assert_eq!(c.max_workspace_bytes, 0);
        assert!(c.npu_broker_enabled);
        assert_eq!(c.signature_max_age_ms, 45_000);
    }

    #[test]
    fn bad_values_are_start_up_errors() {
        let cases: &[(&str, &str, &str)] = &[
            ("SCIENCE_AGENT_MAX_WORKSPACE_BYTES", "-1", "non-negative integer"),
            ("SCIENCE_AGENT_KERNEL_IDLE_MS", "-1", "non-negative integer"),
            ("SCIENCE_AGENT_MAX_OUTPUT_BYTES", "1.5", "non-negative integer"),
            ("SCIENCE_AGENT_EXEC_TIMEOUT_MS", "abc", "non-negative integer"),
            ("SCIENCE_AGENT_MAX_WORKSPACE_BYTES", "9007199254740992", "non-negative integer"),
            ("SCIENCE_AGENT_RUNNER_PORT", "65536", "between 0 and 65535"),
            ("SCIENCE_AGENT_RUNNER_PORT", "http", "between 0 and 65535"),
            ("SCIENCE_AGENT_EXECUTION_SIGNATURE_MAX_AGE_MS", "0", "positive integer number of milliseconds"),
            ("SCIENCE_AGENT_EXECUTION_SIGNATURE_MAX_AGE_MS", "-1", "positive integer number of milliseconds"),
            (
                "SCIENCE_AGENT_EXECUTION_SIGNATURE_MAX_AGE_MS",
                "abc",
                "positive integer number of milliseconds",
            ),
            (
                "SCIENCE_AGENT_EXECUTION_SIGNATURE_MAX_AGE_MS",
                "1.5",
                "positive integer number of milliseconds",
            ),
            ("SCIENCE_AGENT_QUEUE_CAPACITY", "0", "positive integer"),
        ];
        for (name, value, needle) in cases {
            let err = config(&[(name, value)]).unwrap_err().to_string();
            assert!(err.contains(needle), "{name}={value}: {err}");
        }
    }

    #[test]
    fn safe_integers() {
        assert_eq!(parse_non_negative("0"), Some(0));
        assert_eq!(parse_non_negative(" 42 "), Some(42));
        assert_eq!(parse_non_negative("9007199254740991"), Some(MAX_SAFE_INTEGER));
        for bad in ["", "-0", "+1", "1e3", "0x10", "1.0", "9007199254740992"] {
            assert_eq!(parse_non_negative(bad), None, "{bad}");
        }
    }
}
