//! runnerd's configuration from the original's `SCIENCE_AGENT_*` variables (contract §5.5),
//! with the original's defaults and start-up errors, plus our additive settings. Parsing is
//! a pure function of a variable lookup, so every rule is table-tested.
//!
//! The same settings may come from a TOML file ([`DEFAULT_CONFIG_FILE`], or `--config`, or
//! `SCIENCE_AGENT_CONFIG`): one key per variable ([`SCHEMA`]), variables overriding the file.
//! [`load`] layers the two (`common::settings`) and feeds the result to [`RunnerConfig::from_vars`].

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::audit::LogSettings;
use common::settings::{Key, Kind, Layered, Origin, Row, Schema};

/// Defaults from the original runner (internals §2.1, contract §5.5).
pub const DEFAULT_PORT: u16 = 4311;
pub const DEFAULT_HOST: &str = "127.0.0.1";
pub const DEFAULT_MAX_WORKSPACE_BYTES: u64 = 10_737_418_240;
pub const DEFAULT_MAX_OUTPUT_BYTES: u64 = 1_073_741_824;
/// Ours: output held in memory across all executions (issue #14 hole 4).
pub const DEFAULT_MAX_BUFFERED_OUTPUT_BYTES: u64 = 1_073_741_824;
pub const DEFAULT_SIGNATURE_MAX_AGE_MS: u64 = 30_000;
/// The original's well-known token, accepted only with `--insecure-default-token`.
pub const WELL_KNOWN_TOKEN: &str = "sciencediscovery-runner-local";
/// The shared parsers of numeric settings (the resource limits' settings use them too).
pub use common::settings::{MAX_SAFE_INTEGER, parse_non_negative};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunnerConfig {
    pub host: String,
    pub port: u16,
    /// `SCIENCE_AGENT_RUNNER_SOCKET`: listen on this Unix socket instead of TCP.
    pub socket_path: Option<PathBuf>,
    pub data_dir: PathBuf,
    pub bwrap_path: String,
    pub sandbox_init: Option<PathBuf>,
    /// `SCIENCE_AGENT_SANDBOX_USER`: the unprivileged user sandboxes run as when runnerd
    /// is root (`crate::sandbox::user`).
    pub sandbox_user: Option<String>,
    pub exec_timeout_ms: u64,
    pub max_output_bytes: u64,
    /// Ours: the server-wide ceiling on output held in memory (`crate::launch::OutputPool`).
    pub max_buffered_output_bytes: u64,
    pub max_workspace_bytes: u64,
    pub signature_max_age_ms: u64,
    /// Legacy, validated like the original and otherwise unused.
    pub kernel_idle_ms: u64,
    /// `SCIENCE_AGENT_PYTHON_PATH`: the host Python for `/execute`.
    pub python_path: String,
    pub npu_broker_enabled: bool,
    /// `SCIENCE_AGENT_NPU_BROKER_SOCKET`: npu-brokerd's control socket.
    pub npu_broker_socket: PathBuf,
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
    /// NPU/GPU tools, toolkit, device directories (`crate::accel`).
    pub accel: crate::accel::AccelConfig,
    /// Ours: per-execution resource limits and their enforcement (`crate::limits`).
    pub limits: crate::limits::LimitSettings,
    /// Scientific environments: on/off, channels, package cache, starters (`crate::envs`).
    pub scientific: crate::envs::settings::EnvSettings,
    /// Ours: the change journal's bounds (`crate::journal`).
    pub journal: crate::journal::JournalSettings,
    /// Ours: the version history's retention and collector (`crate::history`).
    pub history: crate::history::HistorySettings,
    /// Ours (issue #37): how many sandboxes wait started ahead for executions' next calls.
    pub prestart: crate::isolation::PrestartSettings,
    /// Ours (issue #34): how long a copy that moved to another node keeps its files before
    /// they are removed (`crate::transfer::sweep`).
    pub moved_grace_secs: u64,
    /// Ours (issue #34): the node URLs a push may send a workspace to (empty: any). A push
    /// carries the fleet's token to its target, so a fleet names its nodes here.
    pub transfer_peers: Vec<String>,
    /// Ours: replication to an S3-compatible object store (`crate::replica`); `None`: off.
    pub replica: Option<crate::replica::ReplicaSettings>,
    /// Ours (`SCIENCE_AGENT_NODE_URL`): the URL other nodes and the object store's head
    /// documents name this node by.
    pub node_url: String,
    /// Ours (issue #36): the executions' default isolation backend and the microvm backend's
    /// QEMU, kernel, initramfs and accelerator (`runner_isolation::isolation::select`).
    pub isolation: crate::isolation::select::IsolationSettings,
}

/// A setting's value that start-up refuses. `name` is the variable; when the value came from
/// the configuration file, [`load`] rewrites it to `key in FILE:LINE`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("{name} must be an integer between 0 and 65535, not {value:?}")]
    Port { name: String, value: String },
    #[error("{name} must be a non-negative integer, not {value:?}")]
    NonNegative { name: String, value: String },
    #[error("{name} must be a positive integer number of milliseconds")]
    SignatureMaxAge { name: String },
    #[error("{name} must be a positive integer, not {value:?}")]
    Positive { name: String, value: String },
    #[error("{name} must be one of {allowed}, not {value:?}")]
    Choice { name: String, value: String, allowed: &'static str },
    #[error("{name}: {reason}")]
    Invalid { name: String, reason: String },
}

impl ConfigError {
    /// The same error with the setting named by `describe(variable)`.
    pub fn renamed(self, describe: impl Fn(&str) -> String) -> ConfigError {
        match self {
            ConfigError::Port { name, value } => ConfigError::Port { name: describe(&name), value },
            ConfigError::NonNegative { name, value } => {
                ConfigError::NonNegative { name: describe(&name), value }
            }
            ConfigError::SignatureMaxAge { name } => ConfigError::SignatureMaxAge { name: describe(&name) },
            ConfigError::Positive { name, value } => ConfigError::Positive { name: describe(&name), value },
            ConfigError::Choice { name, value, allowed } => {
                ConfigError::Choice { name: describe(&name), value, allowed }
            }
            ConfigError::Invalid { name, reason } => ConfigError::Invalid { name: describe(&name), reason },
        }
    }
}

/// The limits' settings refuse a value with the same texts (limits::SettingsError).
impl From<crate::limits::SettingsError> for ConfigError {
    fn from(e: crate::limits::SettingsError) -> ConfigError {
        match e {
            crate::limits::SettingsError::NonNegative { name, value } => {
                ConfigError::NonNegative { name, value }
            }
            crate::limits::SettingsError::Choice { name, value, allowed } => {
                ConfigError::Choice { name, value, allowed }
            }
        }
    }
}

fn truthy(text: &str) -> bool {
    matches!(text.trim().to_ascii_lowercase().as_str(), "1" | "true" | "yes")
}

const PORT: &str = "SCIENCE_AGENT_RUNNER_PORT";
const SIGNATURE_MAX_AGE: &str = "SCIENCE_AGENT_EXECUTION_SIGNATURE_MAX_AGE_MS";

impl RunnerConfig {
    /// Reads the configuration through `var` (the process environment in production).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<RunnerConfig, ConfigError> {
        let vars = Vars(var);
        let get = |name: &str| vars.get(name);
        let port = match get(PORT) {
            None => DEFAULT_PORT,
            Some(v) => parse_non_negative(&v)
                .and_then(|p| u16::try_from(p).ok())
                .ok_or(ConfigError::Port { name: PORT.to_owned(), value: v })?,
        };
        let signature_max_age_ms = match get(SIGNATURE_MAX_AGE) {
            None => DEFAULT_SIGNATURE_MAX_AGE_MS,
            Some(v) => parse_non_negative(&v)
                .filter(|n| *n > 0)
                .ok_or(ConfigError::SignatureMaxAge { name: SIGNATURE_MAX_AGE.to_owned() })?,
        };
        let kernel_idle_ms = vars.non_negative("SCIENCE_AGENT_KERNEL_IDLE_MS", 0)?;
        let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(2);
        let host = get("SCIENCE_AGENT_RUNNER_HOST").unwrap_or_else(|| DEFAULT_HOST.to_owned());
        let replica_error = |e: crate::replica::settings::SettingsError| ConfigError::Invalid {
            name: e.variable().to_owned(),
            reason: e.to_string(),
        };
        let replica = crate::replica::settings::from_vars(get).map_err(replica_error)?;
        let node_url =
            crate::replica::settings::node_url(get(crate::replica::settings::NODE_URL_VAR), &host, port)
                .map_err(replica_error)?;
        Ok(RunnerConfig {
            host,
            port,
            socket_path: get("SCIENCE_AGENT_RUNNER_SOCKET").map(PathBuf::from),
            data_dir: get("SCIENCE_AGENT_DATA_DIR")
                .map(PathBuf::from)
                .unwrap_or(".sciencediscovery-data".into()),
            bwrap_path: get("SCIENCE_AGENT_BWRAP_PATH").unwrap_or_else(|| "bwrap".to_owned()),
            sandbox_init: get("SCIENCE_AGENT_SANDBOX_INIT_PATH").map(PathBuf::from),
            sandbox_user: get(crate::sandbox::user::USER_VAR),
            exec_timeout_ms: vars.non_negative("SCIENCE_AGENT_EXEC_TIMEOUT_MS", 0)?,
            max_output_bytes: vars
                .non_negative("SCIENCE_AGENT_MAX_OUTPUT_BYTES", DEFAULT_MAX_OUTPUT_BYTES)?,
            max_buffered_output_bytes: vars.positive(
                "SCIENCE_AGENT_MAX_BUFFERED_OUTPUT_BYTES",
                DEFAULT_MAX_BUFFERED_OUTPUT_BYTES as usize,
            )? as u64,
            max_workspace_bytes: vars
                .non_negative("SCIENCE_AGENT_MAX_WORKSPACE_BYTES", DEFAULT_MAX_WORKSPACE_BYTES)?,
            signature_max_age_ms,
            kernel_idle_ms,
            python_path: get("SCIENCE_AGENT_PYTHON_PATH").unwrap_or_else(|| "/usr/bin/python3".to_owned()),
            npu_broker_enabled: get("SCIENCE_AGENT_NPU_BROKER").is_some_and(|v| truthy(&v)),
            npu_broker_socket: get("SCIENCE_AGENT_NPU_BROKER_SOCKET")
                .unwrap_or_else(|| common::npu::DEFAULT_SOCKET.to_owned())
                .into(),
            token_file: get("SCIENCE_AGENT_RUNNER_TOKEN_FILE").map(PathBuf::from),
            queue_capacity: vars.positive("SCIENCE_AGENT_QUEUE_CAPACITY", 256)?,
            max_concurrent: vars.positive("SCIENCE_AGENT_MAX_CONCURRENT_EXECUTIONS", cpus.max(2) * 2)?,
            header_read_timeout: Duration::from_millis(
                vars.positive("SCIENCE_AGENT_HEADER_READ_TIMEOUT_MS", 10_000)? as u64,
            ),
            egress_socket: get("SCIENCE_AGENT_EGRESS_SOCKET")
                .unwrap_or_else(|| crate::egress::DEFAULT_CONTROL_SOCKET.to_owned())
                .into(),
            egress_bridge: get("SCIENCE_AGENT_EGRESS_BRIDGE_PATH").map(PathBuf::from),
            accel: crate::accel::AccelConfig::from_vars(&get),
            limits: crate::limits::LimitSettings::from_vars(get)?,
            scientific: crate::envs::settings::EnvSettings::from_vars(get)?,
            journal: vars.journal()?,
            history: vars.history()?,
            prestart: vars.prestart()?,
            moved_grace_secs: vars.non_negative(
                crate::transfer::sweep::GRACE_VAR,
                crate::transfer::sweep::DEFAULT_GRACE_SECS,
            )?,
            transfer_peers: vars.transfer_peers()?,
            replica,
            node_url,
            isolation: crate::isolation::select::IsolationSettings::from_vars(get)
                .map_err(|e| ConfigError::Invalid { name: e.name.to_owned(), reason: e.reason })?,
        })
    }
}

/// Ours (issue #37): how many sandboxes wait started ahead on this node (0: none).
pub const PRESTART_VAR: &str = "SCIENCE_AGENT_PRESTART_SANDBOXES";
/// Ours (issue #37): how many of them wait for one session's agent.
pub const PRESTART_PER_TENANT_VAR: &str = "SCIENCE_AGENT_PRESTART_PER_TENANT";
/// Ours (issue #37): seconds a started sandbox waits before it is discarded.
pub const PRESTART_IDLE_VAR: &str = "SCIENCE_AGENT_PRESTART_IDLE_SECS";

/// The variables as [`RunnerConfig::from_vars`] reads them: an empty one is unset.
struct Vars<F>(F);

impl<F: Fn(&str) -> Option<String>> Vars<F> {
    fn get(&self, name: &str) -> Option<String> {
        (self.0)(name).filter(|v| !v.is_empty())
    }

    /// Pre-started sandboxes (issue #37): per node (0: off), per tenant, idle seconds.
    fn prestart(&self) -> Result<crate::isolation::PrestartSettings, ConfigError> {
        let d = crate::isolation::PrestartSettings::default();
        Ok(crate::isolation::PrestartSettings {
            per_node: self.non_negative(PRESTART_VAR, d.per_node as u64)? as usize,
            per_tenant: self.positive(PRESTART_PER_TENANT_VAR, d.per_tenant)?,
            idle: Duration::from_secs(self.positive(PRESTART_IDLE_VAR, d.idle.as_secs() as usize)? as u64),
        })
    }

    fn non_negative(&self, name: &'static str, default: u64) -> Result<u64, ConfigError> {
        match self.get(name) {
            None => Ok(default),
            Some(v) => {
                parse_non_negative(&v).ok_or(ConfigError::NonNegative { name: name.to_owned(), value: v })
            }
        }
    }

    fn positive(&self, name: &'static str, default: usize) -> Result<usize, ConfigError> {
        match self.get(name) {
            None => Ok(default),
            Some(v) => parse_non_negative(&v)
                .filter(|n| *n > 0)
                .and_then(|n| usize::try_from(n).ok())
                .ok_or(ConfigError::Positive { name: name.to_owned(), value: v }),
        }
    }

    /// The change journal's limits.
    fn journal(&self) -> Result<crate::journal::JournalSettings, ConfigError> {
        Ok(crate::journal::JournalSettings {
            workspaces: self
                .non_negative(crate::journal::WORKSPACES_VAR, crate::journal::DEFAULT_WORKSPACES as u64)?
                as usize,
            watches: self.positive(crate::journal::WATCHES_VAR, crate::journal::DEFAULT_WATCHES)?,
            files: self.positive(crate::journal::FILES_VAR, crate::journal::DEFAULT_FILES)?,
        })
    }

    /// The node URLs a push may target, each normalised as a node is named.
    fn transfer_peers(&self) -> Result<Vec<String>, ConfigError> {
        let var = crate::transfer::protocol::PEERS_VAR;
        let Some(list) = self.get(var) else { return Ok(Vec::new()) };
        list.split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(|p| {
                crate::transfer::protocol::node_url(p).ok_or_else(|| ConfigError::Invalid {
                    name: var.to_owned(),
                    reason: format!("{p:?} is not an http://host:port node URL"),
                })
            })
            .collect()
    }

    /// Version history: retention, collection interval, the disk's free-space floor.
    fn history(&self) -> Result<crate::history::HistorySettings, ConfigError> {
        use crate::history as h;
        let free_percent = self.non_negative(h::FREE_PERCENT_VAR, h::DEFAULT_FREE_PERCENT)?;
        if free_percent > 100 {
            return Err(ConfigError::Invalid {
                name: h::FREE_PERCENT_VAR.to_owned(),
                reason: format!("a percentage of the disk is 0 to 100, not {free_percent}"),
            });
        }
        Ok(h::HistorySettings {
            retention: crate::versioning::retention::Retention {
                keep_versions: self.non_negative(h::KEEP_VERSIONS_VAR, h::DEFAULT_KEEP_VERSIONS)?,
                keep_days: self.non_negative(h::KEEP_DAYS_VAR, h::DEFAULT_KEEP_DAYS)?,
                pressed: false,
            },
            interval_secs: self.non_negative(h::INTERVAL_VAR, h::DEFAULT_INTERVAL_SECS)?,
            free_percent,
            grace_secs: self.non_negative(h::GRACE_VAR, h::DEFAULT_GRACE_SECS)?,
        })
    }
}

/// The file runnerd reads when neither `--config` nor `SCIENCE_AGENT_CONFIG` names one;
/// when it does not exist, the defaults apply.
pub const DEFAULT_CONFIG_FILE: &str = "/etc/sciencediscovery/runnerd.toml";
/// Names the configuration file (a file named so must exist).
pub const CONFIG_VAR: &str = "SCIENCE_AGENT_CONFIG";

/// Every key of runnerd's configuration file: the variable's name, lower-cased, without
/// `SCIENCE_AGENT_`. The token is not among them: it never goes in the file.
pub static SCHEMA: Schema = Schema {
    daemon: "runnerd",
    keys: &[
        Key::new("runner_host", "SCIENCE_AGENT_RUNNER_HOST", Kind::Text),
        Key::new("runner_port", PORT, Kind::Integer),
        Key::new("runner_socket", "SCIENCE_AGENT_RUNNER_SOCKET", Kind::Text),
        Key::new("runner_token_file", "SCIENCE_AGENT_RUNNER_TOKEN_FILE", Kind::Text),
        Key::new("data_dir", "SCIENCE_AGENT_DATA_DIR", Kind::Text),
        Key::new("bwrap_path", "SCIENCE_AGENT_BWRAP_PATH", Kind::Text),
        Key::new("sandbox_init_path", "SCIENCE_AGENT_SANDBOX_INIT_PATH", Kind::Text),
        Key::new("sandbox_user", crate::sandbox::user::USER_VAR, Kind::Text),
        Key::new("python_path", "SCIENCE_AGENT_PYTHON_PATH", Kind::Text),
        Key::new("exec_timeout_ms", "SCIENCE_AGENT_EXEC_TIMEOUT_MS", Kind::Integer),
        Key::new("max_output_bytes", "SCIENCE_AGENT_MAX_OUTPUT_BYTES", Kind::Integer),
        Key::new("max_buffered_output_bytes", "SCIENCE_AGENT_MAX_BUFFERED_OUTPUT_BYTES", Kind::Integer),
        Key::new("max_workspace_bytes", "SCIENCE_AGENT_MAX_WORKSPACE_BYTES", Kind::Integer),
        Key::new("execution_signature_max_age_ms", SIGNATURE_MAX_AGE, Kind::Integer),
        Key::new("kernel_idle_ms", "SCIENCE_AGENT_KERNEL_IDLE_MS", Kind::Integer),
        Key::new("npu_broker", "SCIENCE_AGENT_NPU_BROKER", Kind::Bool),
        Key::new("npu_broker_socket", "SCIENCE_AGENT_NPU_BROKER_SOCKET", Kind::Text),
        Key::new("queue_capacity", "SCIENCE_AGENT_QUEUE_CAPACITY", Kind::Integer),
        Key::new("max_concurrent_executions", "SCIENCE_AGENT_MAX_CONCURRENT_EXECUTIONS", Kind::Integer),
        Key::new("header_read_timeout_ms", "SCIENCE_AGENT_HEADER_READ_TIMEOUT_MS", Kind::Integer),
        Key::new("egress_socket", "SCIENCE_AGENT_EGRESS_SOCKET", Kind::Text),
        Key::new("egress_bridge_path", "SCIENCE_AGENT_EGRESS_BRIDGE_PATH", Kind::Text),
        Key::new("npu_smi_path", crate::accel::NPU_SMI_VAR, Kind::Text),
        Key::new("ascend_toolkit", crate::accel::TOOLKIT_VAR, Kind::Text),
        Key::new("npu_device_dir", crate::accel::NPU_DEVICE_DIR_VAR, Kind::Text),
        Key::new("npu_dcmi_library", crate::accel::DCMI_VAR, Kind::Text),
        Key::new("nvidia_smi_path", crate::accel::NVIDIA_SMI_VAR, Kind::Text),
        Key::new("gpu_device_dir", crate::accel::GPU_DEVICE_DIR_VAR, Kind::Text),
        Key::new("limit_memory_bytes", "SCIENCE_AGENT_LIMIT_MEMORY_BYTES", Kind::Integer),
        Key::new("limit_pids", "SCIENCE_AGENT_LIMIT_PIDS", Kind::Integer),
        Key::new("limit_cpu_millicores", "SCIENCE_AGENT_LIMIT_CPU_MILLICORES", Kind::Integer),
        Key::new("limit_tmp_bytes", "SCIENCE_AGENT_LIMIT_TMP_BYTES", Kind::Integer),
        Key::new("limit_max_memory_bytes", "SCIENCE_AGENT_LIMIT_MAX_MEMORY_BYTES", Kind::Integer),
        Key::new("limit_max_pids", "SCIENCE_AGENT_LIMIT_MAX_PIDS", Kind::Integer),
        Key::new("limit_max_cpu_millicores", "SCIENCE_AGENT_LIMIT_MAX_CPU_MILLICORES", Kind::Integer),
        Key::new("limit_max_tmp_bytes", "SCIENCE_AGENT_LIMIT_MAX_TMP_BYTES", Kind::Integer),
        Key::new("cgroup_mode", crate::limits::MODE_VAR, Kind::Text),
        Key::new("cgroup_root", crate::limits::ROOT_VAR, Kind::Text),
        Key::new("scientific_envs", crate::envs::settings::ENABLED_VAR, Kind::Bool),
        Key::new("scientific_channels", crate::envs::settings::CHANNELS_VAR, Kind::Text),
        Key::new("journal_workspaces", crate::journal::WORKSPACES_VAR, Kind::Integer),
        Key::new("journal_watches", crate::journal::WATCHES_VAR, Kind::Integer),
        Key::new("journal_files", crate::journal::FILES_VAR, Kind::Integer),
        Key::new("history_keep_versions", crate::history::KEEP_VERSIONS_VAR, Kind::Integer),
        Key::new("history_keep_days", crate::history::KEEP_DAYS_VAR, Kind::Integer),
        Key::new("history_gc_interval_secs", crate::history::INTERVAL_VAR, Kind::Integer),
        Key::new("history_gc_free_percent", crate::history::FREE_PERCENT_VAR, Kind::Integer),
        Key::new("history_gc_grace_secs", crate::history::GRACE_VAR, Kind::Integer),
        Key::new("moved_workspace_grace_secs", crate::transfer::sweep::GRACE_VAR, Kind::Integer),
        Key::new("prestart_sandboxes", PRESTART_VAR, Kind::Integer),
        Key::new("prestart_per_tenant", PRESTART_PER_TENANT_VAR, Kind::Integer),
        Key::new("prestart_idle_secs", PRESTART_IDLE_VAR, Kind::Integer),
        Key::new("transfer_peers", crate::transfer::protocol::PEERS_VAR, Kind::Text),
        Key::new("package_cache_dir", crate::envs::settings::PACKAGE_CACHE_VAR, Kind::Text),
        Key::new("starter_python_specs", crate::envs::settings::STARTER_PYTHON_VAR, Kind::Text),
        Key::new("starter_r_specs", crate::envs::settings::STARTER_R_VAR, Kind::Text),
        Key::new("runner_provisioner_path", crate::envs::settings::PROVISIONER_VAR, Kind::Text),
        Key::new("cran_repo", crate::envs::settings::CRAN_VAR, Kind::Text),
        Key::new("env_step_max_file_bytes", crate::envs::settings::STEP_MAX_FILE_VAR, Kind::Integer),
        Key::new("env_step_max_prefix_bytes", crate::envs::settings::STEP_MAX_PREFIX_VAR, Kind::Integer),
        Key::new("env_step_max_fetch_bytes", crate::envs::settings::STEP_MAX_FETCH_VAR, Kind::Integer),
        Key::new("replica_endpoint", crate::replica::settings::ENDPOINT_VAR, Kind::Text),
        Key::new("replica_bucket", crate::replica::settings::BUCKET_VAR, Kind::Text),
        Key::new("replica_prefix", crate::replica::settings::PREFIX_VAR, Kind::Text),
        Key::new("replica_region", crate::replica::settings::REGION_VAR, Kind::Text),
        Key::new("replica_access_key_id", crate::replica::settings::ACCESS_KEY_ID_VAR, Kind::Text),
        Key::new("replica_secret_access_key_file", crate::replica::settings::SECRET_FILE_VAR, Kind::Text),
        Key::new("replica_allow_http", crate::replica::settings::ALLOW_HTTP_VAR, Kind::Bool),
        Key::new("node_url", crate::replica::settings::NODE_URL_VAR, Kind::Text),
        Key::new("isolation", crate::isolation::select::ISOLATION_VAR, Kind::Text),
        Key::new("microvm_qemu", crate::isolation::select::QEMU_VAR, Kind::Text),
        Key::new("microvm_kernel", crate::isolation::select::KERNEL_VAR, Kind::Text),
        Key::new("microvm_initramfs", crate::isolation::select::INITRAMFS_VAR, Kind::Text),
        Key::new("microvm_accel", crate::isolation::select::ACCEL_VAR, Kind::Text),
        Key::new("microvm_pool", crate::isolation::select::POOL_VAR, Kind::Integer),
        Key::new("microvm_pool_per_tenant", crate::isolation::select::POOL_PER_TENANT_VAR, Kind::Integer),
        Key::new("log_level", common::audit::LEVEL_VAR, Kind::Text),
        Key::new("log_target", common::audit::TARGET_VAR, Kind::Text),
    ],
    refused: &[
        (
            "runner_token",
            "the token never goes in the configuration file; put it in a file only runnerd can read and \
             name that file with runner_token_file, or provide the systemd credential runner-token",
        ),
        (
            "replica_secret_access_key",
            "a secret never goes in the configuration file; put it in a file only runnerd can read and \
             name that file with replica_secret_access_key_file",
        ),
    ],
};

/// The configuration start-up validated, and where each value came from.
#[derive(Debug)]
pub struct Loaded {
    pub config: RunnerConfig,
    pub log: LogSettings,
    pub settings: Layered,
}

pub type LoadError = common::daemon::LoadError<ConfigError>;

impl From<ConfigError> for LoadError {
    fn from(e: ConfigError) -> LoadError {
        LoadError::Value(e)
    }
}

/// runnerd has no setting flags: a bad value is always a variable's or the file's (exit 1).
impl common::daemon::Usage for ConfigError {
    fn is_usage(&self) -> bool {
        false
    }
}

/// The settings from the environment `env` over the chosen file (`--config` is `flag`).
pub fn load(
    flag: Option<&Path>,
    env: impl Fn(&str) -> Option<String> + Send + Sync + 'static,
) -> Result<Loaded, LoadError> {
    layer(common::daemon::layered(&SCHEMA, flag, CONFIG_VAR, DEFAULT_CONFIG_FILE, env)?)
}

/// Validates a layered lookup; errors name the key and the file when the value came from it.
pub fn layer(settings: Layered) -> Result<Loaded, LoadError> {
    let describe = |var: &str| settings.describe(var);
    let config = RunnerConfig::from_vars(|k| settings.var(k)).map_err(|e| e.renamed(describe))?;
    let log = common::daemon::log_settings(&settings)?;
    Ok(Loaded { config, log, settings })
}

/// What a client of runnerd needs of its settings: where runnerd listens and where its token
/// is. `runnerctl` (a crate of its own, issue #33) reads it through [`client_settings`]
/// rather than the whole [`RunnerConfig`], which stays the daemon's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientSettings {
    pub host: String,
    pub port: u16,
    /// `SCIENCE_AGENT_RUNNER_SOCKET`: runnerd listens on this Unix socket instead of TCP.
    pub socket_path: Option<PathBuf>,
    /// `SCIENCE_AGENT_RUNNER_TOKEN_FILE`: a file holding the token.
    pub token_file: Option<PathBuf>,
    /// Where a development start leaves its generated token (`crate::token`).
    pub data_dir: PathBuf,
}

/// [`ClientSettings`] from the environment `env` over runnerd's configuration file, read by
/// [`load`] (no `--config`): the same file and variables, and the same validation, so a
/// setting runnerd would refuse to start with is refused here with the same message.
pub fn client_settings(
    env: impl Fn(&str) -> Option<String> + Send + Sync + 'static,
) -> anyhow::Result<ClientSettings> {
    let c = load(None, env)?.config;
    Ok(ClientSettings {
        host: c.host,
        port: c.port,
        socket_path: c.socket_path,
        token_file: c.token_file,
        data_dir: c.data_dir,
    })
}

/// A replication setting's value, or that replication is off.
fn replica_row(c: &RunnerConfig, show: impl Fn(&crate::replica::ReplicaSettings) -> String) -> String {
    c.replica.as_ref().map_or_else(|| "- (replication off)".to_owned(), show)
}

fn show_path(path: &Option<PathBuf>, unset: &str) -> String {
    path.as_ref().map_or_else(|| unset.to_owned(), |p| p.display().to_string())
}

impl Loaded {
    /// Every key with its effective value and origin, in [`SCHEMA`]'s order.
    pub fn rows(&self) -> Vec<Row> {
        let c = &self.config;
        SCHEMA
            .keys
            .iter()
            .map(|k| {
                let value = match k.name {
                    "runner_host" => c.host.clone(),
                    "runner_port" => c.port.to_string(),
                    "runner_socket" => show_path(&c.socket_path, "unset (TCP)"),
                    "runner_token_file" => show_path(&c.token_file, "unset"),
                    "data_dir" => c.data_dir.display().to_string(),
                    "bwrap_path" => c.bwrap_path.clone(),
                    "sandbox_init_path" => show_path(&c.sandbox_init, "unset (next to runnerd)"),
                    "sandbox_user" => c.sandbox_user.clone().unwrap_or_else(|| {
                        "unset (runnerd's own user; as root the package's user, or nobody with --dev)".into()
                    }),
                    "python_path" => c.python_path.clone(),
                    "exec_timeout_ms" => c.exec_timeout_ms.to_string(),
                    "max_output_bytes" => c.max_output_bytes.to_string(),
                    "max_buffered_output_bytes" => c.max_buffered_output_bytes.to_string(),
                    "max_workspace_bytes" => c.max_workspace_bytes.to_string(),
                    "execution_signature_max_age_ms" => c.signature_max_age_ms.to_string(),
                    "kernel_idle_ms" => c.kernel_idle_ms.to_string(),
                    "npu_broker" => c.npu_broker_enabled.to_string(),
                    "npu_broker_socket" => c.npu_broker_socket.display().to_string(),
                    "queue_capacity" => c.queue_capacity.to_string(),
                    "max_concurrent_executions" => c.max_concurrent.to_string(),
                    "header_read_timeout_ms" => c.header_read_timeout.as_millis().to_string(),
                    "egress_socket" => c.egress_socket.display().to_string(),
                    "egress_bridge_path" => show_path(&c.egress_bridge, "unset (next to runnerd)"),
                    "npu_smi_path" => show_path(
                        &c.accel.npu_smi_path,
                        "unset (searched in /usr/local/bin, /usr/local/sbin, /usr/bin)",
                    ),
                    "ascend_toolkit" => c.accel.ascend_toolkit.display().to_string(),
                    "npu_device_dir" => c.accel.npu_device_dir.display().to_string(),
                    "npu_dcmi_library" => c.accel.dcmi_library.display().to_string(),
                    "nvidia_smi_path" => {
                        show_path(&c.accel.nvidia_smi_path, "unset (searched in /usr/bin, /usr/local/bin)")
                    }
                    "gpu_device_dir" => c.accel.gpu_device_dir.display().to_string(),
                    "scientific_envs" => c.scientific.enabled.to_string(),
                    "scientific_channels" => c.scientific.channels.join(","),
                    "package_cache_dir" => show_path(&c.scientific.package_cache_dir, "unset (online)"),
                    "starter_python_specs" => c.scientific.starter_python.join(","),
                    "starter_r_specs" => c.scientific.starter_r.join(","),
                    "runner_provisioner_path" => {
                        show_path(&c.scientific.provisioner, "unset (next to runnerd)")
                    }
                    "cran_repo" => c.scientific.cran_repo.clone(),
                    "env_step_max_file_bytes" => c.scientific.step_max_file_bytes.to_string(),
                    "env_step_max_prefix_bytes" => c.scientific.step_max_prefix_bytes.to_string(),
                    "env_step_max_fetch_bytes" => c.scientific.step_max_fetch_bytes.to_string(),
                    "journal_workspaces" => c.journal.workspaces.to_string(),
                    "journal_watches" => c.journal.watches.to_string(),
                    "journal_files" => c.journal.files.to_string(),
                    "history_keep_versions" => c.history.retention.keep_versions.to_string(),
                    "history_keep_days" => c.history.retention.keep_days.to_string(),
                    "history_gc_interval_secs" => c.history.interval_secs.to_string(),
                    "history_gc_free_percent" => c.history.free_percent.to_string(),
                    "history_gc_grace_secs" => c.history.grace_secs.to_string(),
                    "moved_workspace_grace_secs" => c.moved_grace_secs.to_string(),
                    "prestart_sandboxes" if c.prestart.per_node == 0 => "0 (off)".to_owned(),
                    "prestart_sandboxes" => c.prestart.per_node.to_string(),
                    "prestart_per_tenant" => c.prestart.per_tenant.to_string(),
                    "prestart_idle_secs" => c.prestart.idle.as_secs().to_string(),
                    "transfer_peers" if c.transfer_peers.is_empty() => "unset (any node)".to_owned(),
                    "transfer_peers" => c.transfer_peers.join(","),
                    "replica_endpoint" => c
                        .replica
                        .as_ref()
                        .map_or_else(|| "unset (replication off)".to_owned(), |r| r.endpoint.clone()),
                    "replica_bucket" => replica_row(c, |r| r.bucket.clone()),
                    "replica_prefix" => replica_row(c, |r| format!("{:?}", r.prefix)),
                    "replica_region" => replica_row(c, |r| r.region.clone()),
                    "replica_access_key_id" => replica_row(c, |r| {
                        r.access_key_id.clone().unwrap_or_else(|| "unset (unsigned requests)".into())
                    }),
                    // The file's name only: the secret is never shown.
                    "replica_secret_access_key_file" => replica_row(c, |r| {
                        show_path(
                            &r.secret_access_key_file,
                            "unset (SCIENCE_AGENT_REPLICA_SECRET_ACCESS_KEY, if set)",
                        )
                    }),
                    "replica_allow_http" => replica_row(c, |r| r.allow_http.to_string()),
                    "node_url" => c.node_url.clone(),
                    "isolation"
                    | "microvm_qemu"
                    | "microvm_kernel"
                    | "microvm_initramfs"
                    | "microvm_accel"
                    | "microvm_pool"
                    | "microvm_pool_per_tenant" => c.isolation.row(k.name),
                    "log_level" => self.log.level_name().to_owned(),
                    "log_target" => self.log.target_name().to_owned(),
                    other => c.limits.show(other).unwrap_or_else(|| format!("<{other}>")),
                };
                Row::new(k.name, value, self.settings.origin(k.var))
            })
            .collect()
    }

    /// Where the value of `var` came from.
    pub fn origin(&self, var: &str) -> Origin {
        self.settings.origin(var)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use common::settings::FileChoice;
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
        assert_eq!(c.max_buffered_output_bytes, 1 << 30);
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
            ("SCIENCE_AGENT_MAX_BUFFERED_OUTPUT_BYTES", "0", "positive integer"),
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

    fn loaded(file: &str, vars: &[(&str, &str)]) -> Result<Loaded, LoadError> {
        let path = Path::new(DEFAULT_CONFIG_FILE);
        let parsed = common::settings::ConfigFile::parse(&SCHEMA, path, file)?;
        let map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let choice = FileChoice::Default(path.into());
        layer(Layered::new(&SCHEMA, choice, Some(parsed), move |k| map.get(k).cloned()))
    }

    #[test]
    fn the_file_sets_what_the_variables_set() {
        let file = "# runnerd\nrunner_port = 4400\ndata_dir = \"/var/lib/runnerd\"\nnpu_broker = true\n\
                    max_workspace_bytes = 0\nlog_level = \"debug\"\nlog_target = \"journald\"\n";
        let l = loaded(file, &[]).unwrap();
        assert_eq!((l.config.port, l.config.data_dir.as_path()), (4400, Path::new("/var/lib/runnerd")));
        assert!(l.config.npu_broker_enabled);
        assert_eq!(l.config.max_workspace_bytes, 0);
        assert_eq!(l.log.level_name(), "debug");
        assert_eq!(l.log.target, common::audit::LogTarget::Journald);
        assert_eq!(
            l.origin("SCIENCE_AGENT_RUNNER_PORT"),
            Origin::File { path: DEFAULT_CONFIG_FILE.into(), line: 2 }
        );
        assert_eq!(l.origin("SCIENCE_AGENT_RUNNER_HOST"), Origin::Default);
        // Variables override the file.
        let l = loaded(file, &[("SCIENCE_AGENT_RUNNER_PORT", "4500"), ("SCIENCE_AGENT_LOG_LEVEL", "warn")])
            .unwrap();
        assert_eq!((l.config.port, l.log.level_name()), (4500, "warn"));
        assert_eq!(
            l.origin("SCIENCE_AGENT_RUNNER_PORT"),
            Origin::Environment("SCIENCE_AGENT_RUNNER_PORT".into())
        );
        let row = l.rows().into_iter().find(|r| r.key == "runner_port").unwrap();
        assert_eq!(
            (row.value.as_str(), row.origin.as_str()),
            ("4500", "environment SCIENCE_AGENT_RUNNER_PORT")
        );
    }

    #[test]
    fn errors_name_the_key_and_the_file_when_the_value_came_from_it() {
        type Case<'a> = (&'a str, &'a [(&'a str, &'a str)], &'a str);
        let cases: &[Case] = &[
            (
                "\nmax_workspace_bytes = -1\n",
                &[],
                "max_workspace_bytes in /etc/sciencediscovery/runnerd.toml:2 must be a non-negative integer, not \"-1\"",
            ),
            (
                "runner_port = 70000",
                &[],
                "runner_port in /etc/sciencediscovery/runnerd.toml:1 must be an integer between 0 and 65535, not \"70000\"",
            ),
            (
                "execution_signature_max_age_ms = 0",
                &[],
                "execution_signature_max_age_ms in /etc/sciencediscovery/runnerd.toml:1 must be a positive integer number of milliseconds",
            ),
            (
                "queue_capacity = \"many\"",
                &[],
                "queue_capacity in /etc/sciencediscovery/runnerd.toml:1 must be a positive integer, not \"many\"",
            ),
            (
                "log_level = \"chatty\"",
                &[],
                "log_level in /etc/sciencediscovery/runnerd.toml:1 must be one of error, warn, info, debug, trace, off, not \"chatty\"",
            ),
            // The variable wins, so its name is the one in the message.
            (
                "max_workspace_bytes = 5",
                &[("SCIENCE_AGENT_MAX_WORKSPACE_BYTES", "-1")],
                "SCIENCE_AGENT_MAX_WORKSPACE_BYTES must be",
            ),
            (
                "runner_token = \"hunter2\"",
                &[],
                "runner_token in /etc/sciencediscovery/runnerd.toml:1 is not accepted: the token never goes in the configuration file",
            ),
            (
                "runner_url = \"http://x\"",
                &[],
                "unknown key runner_url in /etc/sciencediscovery/runnerd.toml:1",
            ),
            ("egress_bridge = \"/x\"", &[], "(did you mean egress_bridge_path?)"),
            (
                "replica_endpoint = \"http://10.1.1.1:9000\"\nreplica_bucket = \"b1x\"",
                &[],
                "replica_endpoint in /etc/sciencediscovery/runnerd.toml:1: plain http to 10.1.1.1",
            ),
            (
                "replica_endpoint = \"http://127.0.0.1:9000\"",
                &[],
                "SCIENCE_AGENT_REPLICA_BUCKET: is required when the replica endpoint",
            ),
            (
                "replica_secret_access_key = \"hunter2\"",
                &[],
                "replica_secret_access_key in /etc/sciencediscovery/runnerd.toml:1 is not accepted: a secret never goes in the configuration file",
            ),
        ];
        for (file, vars, want) in cases {
            let err = loaded(file, vars).unwrap_err().to_string();
            assert!(err.contains(want), "{file}:\n  got  {err}\n  want {want}");
            assert!(!err.contains("hunter2"));
        }
    }

    /// The file's keys, the variables `from_vars` reads, and the README's table stay in step.
    #[test]
    fn keys_variables_and_readme_agree() {
        let read = std::cell::RefCell::new(std::collections::BTreeSet::new());
        RunnerConfig::from_vars(|k| {
            read.borrow_mut().insert(k.to_owned());
            None
        })
        .unwrap();
        LogSettings::from_vars(|k| {
            read.borrow_mut().insert(k.to_owned());
            None
        })
        .unwrap();
        let keys: std::collections::BTreeSet<String> = SCHEMA.keys.iter().map(|k| k.var.to_owned()).collect();
        assert_eq!(read.into_inner(), keys);
        // Embedded at build time: the tests also run as an unprivileged user who may not be
        // able to enter the checkout.
        let readme = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md"));
        for k in SCHEMA.keys {
            // `SCIENTIFIC_ENVS` is the original's one variable without the prefix.
            assert_eq!(k.var.strip_prefix("SCIENCE_AGENT_").unwrap_or(k.var).to_ascii_lowercase(), k.name);
            assert!(readme.contains(&format!("`{}`", k.var)), "README lacks {}", k.var);
            assert!(readme.contains(&format!("`{}`", k.name)), "README lacks the key {}", k.name);
        }
    }
}
