//! npu-brokerd's settings: flags over `SCIENCE_AGENT_*` variables over the configuration
//! file (`/etc/sciencediscovery/npu-brokerd.toml`, or `--config`, or
//! `SCIENCE_AGENT_NPU_BROKER_CONFIG`) over defaults, through `common::settings` like egressd.
//! Resolution is a pure function of the flags and a variable lookup.

use std::convert::Infallible;
use std::path::PathBuf;

use common::audit::LogSettings;
use common::daemon::{self, ArgError, Blank, Grammar, Setting};
pub use common::daemon::{Args, Mode};
use common::settings::{Key, Kind, Layered, Origin, Row, Schema};

pub const USAGE: &str = "\
npu-brokerd: runs allowlisted host NPU jobs for runnerd, one at a time (R-NPU-5).

Usage:
  npu-brokerd [options]        serve the control socket and run jobs
  npu-brokerd --check-config [options]
                               validate the settings and the workload whitelist, print each
                               setting with where it came from, exit 0 or 1
  npu-brokerd --help | --version

Configuration: flags override variables, variables override the file, the file overrides
the defaults. The file's keys are the long flags' names with - as _, plus python,
log_level and log_target.
  --config PATH           [SCIENCE_AGENT_NPU_BROKER_CONFIG, default
                          /etc/sciencediscovery/npu-brokerd.toml; that one may be absent]

Options (each also read from the variable in brackets; a flag wins):
  --control-socket PATH   where runnerd connects
                          [SCIENCE_AGENT_NPU_BROKER_SOCKET, default /run/npu-brokerd/control.sock]
  --runner-uid UID|NAME   the only user allowed on the control socket (runnerd's user)
                          [SCIENCE_AGENT_NPU_BROKER_RUNNER_UID, default: npu-brokerd's own uid]
  --socket-group GROUP    make the control socket 0660 and owned by GROUP (runnerd's user
                          must be a member); without it the socket is 0600
                          [SCIENCE_AGENT_NPU_BROKER_SOCKET_GROUP]
  --state-dir DIR         job state (DIR/npu-jobs/jobs.json)
                          [SCIENCE_AGENT_NPU_BROKER_STATE_DIR, default $STATE_DIRECTORY or
                          /var/lib/npu-brokerd]
  --data-dir DIR          runnerd's data directory: workspaces and managed environments
                          [SCIENCE_AGENT_DATA_DIR, default /var/lib/sciencediscovery]
  --workload-config PATH  the workload whitelist (JSON); unset: the built-in defaults
                          [SCIENCE_AGENT_NPU_WORKLOAD_CONFIG]
  --repo-root DIR         the root of ${repo:…} paths
                          [SCIENCE_AGENT_NPU_REPO_ROOT, default /usr/share/sciencediscovery/npu]
  --no-confine            skip landlock and the seccomp filter (debugging only; health says so)
  python                  ${python} [SCIENCE_AGENT_NPU_PYTHON, default python3]

Logs: journald (identifier npu-brokerd) under systemd, else stderr [SCIENCE_AGENT_LOG_TARGET];
SCIENCE_AGENT_LOG_LEVEL.
";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub control_socket: PathBuf,
    pub runner_uid: Option<String>,
    pub socket_group: Option<String>,
    pub state_dir: PathBuf,
    pub data_dir: PathBuf,
    pub workload_config: Option<PathBuf>,
    pub repo_root: PathBuf,
    pub python: Option<String>,
    pub confine: bool,
}

/// `(key, flag, variable)` of each setting.
pub const SETTINGS: &[Setting] = &[
    ("control_socket", "--control-socket", "SCIENCE_AGENT_NPU_BROKER_SOCKET"),
    ("runner_uid", "--runner-uid", "SCIENCE_AGENT_NPU_BROKER_RUNNER_UID"),
    ("socket_group", "--socket-group", "SCIENCE_AGENT_NPU_BROKER_SOCKET_GROUP"),
    ("state_dir", "--state-dir", "SCIENCE_AGENT_NPU_BROKER_STATE_DIR"),
    ("data_dir", "--data-dir", "SCIENCE_AGENT_DATA_DIR"),
    ("workload_config", "--workload-config", "SCIENCE_AGENT_NPU_WORKLOAD_CONFIG"),
    ("repo_root", "--repo-root", "SCIENCE_AGENT_NPU_REPO_ROOT"),
];

/// npu-brokerd's command line: the setting flags and `--no-confine`; a blank value is a
/// missing one.
pub const GRAMMAR: Grammar = Grammar {
    daemon: "npu-brokerd",
    help: &["--help", "-h"],
    switches: &["--no-confine"],
    settings: SETTINGS,
    split_every_flag: true,
    blank: Blank::Missing,
};

pub fn parse_args(args: &[String]) -> Result<Args, ArgError> {
    daemon::parse_args(&GRAMMAR, args)
}

/// Flags over `var` (the environment over the file) over the defaults.
pub fn resolve(args: &Args, var: impl Fn(&str) -> Option<String>) -> Config {
    let get = |key: &str| -> Option<String> {
        let (_, flag, name) = SETTINGS.iter().find(|(k, _, _)| *k == key)?;
        args.flags
            .iter()
            .rev()
            .find(|(f, _)| f == flag)
            .map(|(_, v)| v.clone())
            .or_else(|| var(name).filter(|v| !v.trim().is_empty()))
    };
    Config {
        control_socket: get("control_socket").unwrap_or_else(|| common::npu::DEFAULT_SOCKET.into()).into(),
        runner_uid: get("runner_uid"),
        socket_group: get("socket_group"),
        state_dir: get("state_dir")
            .or_else(|| var("STATE_DIRECTORY").map(|d| d.split(':').next().unwrap_or_default().to_owned()))
            .filter(|d| !d.is_empty())
            .unwrap_or_else(|| "/var/lib/npu-brokerd".into())
            .into(),
        data_dir: get("data_dir").unwrap_or_else(|| "/var/lib/sciencediscovery".into()).into(),
        workload_config: get("workload_config").map(PathBuf::from),
        repo_root: get("repo_root").unwrap_or_else(|| "/usr/share/sciencediscovery/npu".into()).into(),
        python: var("SCIENCE_AGENT_NPU_PYTHON").filter(|v| !v.trim().is_empty()),
        confine: args.confine(),
    }
}

pub const DEFAULT_CONFIG_FILE: &str = "/etc/sciencediscovery/npu-brokerd.toml";
pub const CONFIG_VAR: &str = "SCIENCE_AGENT_NPU_BROKER_CONFIG";

pub static SCHEMA: Schema = Schema {
    daemon: "npu-brokerd",
    keys: &[
        Key::new("control_socket", "SCIENCE_AGENT_NPU_BROKER_SOCKET", Kind::Text),
        Key::new("runner_uid", "SCIENCE_AGENT_NPU_BROKER_RUNNER_UID", Kind::Name),
        Key::new("socket_group", "SCIENCE_AGENT_NPU_BROKER_SOCKET_GROUP", Kind::Name),
        Key::new("state_dir", "SCIENCE_AGENT_NPU_BROKER_STATE_DIR", Kind::Text),
        Key::new("data_dir", "SCIENCE_AGENT_DATA_DIR", Kind::Text),
        Key::new("workload_config", "SCIENCE_AGENT_NPU_WORKLOAD_CONFIG", Kind::Text),
        Key::new("repo_root", "SCIENCE_AGENT_NPU_REPO_ROOT", Kind::Text),
        Key::new("python", "SCIENCE_AGENT_NPU_PYTHON", Kind::Text),
        Key::new("smoke_script", "SCIENCE_AGENT_NPU_SMOKE_SCRIPT", Kind::Text),
        Key::new("protenix_script", "SCIENCE_AGENT_NPU_PROTENIX_SCRIPT", Kind::Text),
        Key::new("log_level", common::audit::LEVEL_VAR, Kind::Text),
        Key::new("log_target", common::audit::TARGET_VAR, Kind::Text),
    ],
    refused: &[],
};

/// Every value is taken as text (paths, names): only the file and the log settings can fail.
pub type LoadError = daemon::LoadError<Infallible>;

#[derive(Debug)]
pub struct Loaded {
    pub args: Args,
    pub config: Config,
    pub log: LogSettings,
    pub settings: Layered,
}

pub fn load(
    args: Args,
    env: impl Fn(&str) -> Option<String> + Send + Sync + 'static,
) -> Result<Loaded, LoadError> {
    let settings = daemon::layered(&SCHEMA, args.config.as_deref(), CONFIG_VAR, DEFAULT_CONFIG_FILE, env)?;
    let config = resolve(&args, |k| settings.var(k));
    let log = daemon::log_settings(&settings)?;
    Ok(Loaded { args, config, log, settings })
}

impl Loaded {
    pub fn origin(&self, key: &str) -> Origin {
        if let Some((_, flag, var)) = SETTINGS.iter().find(|(k, _, _)| *k == key) {
            if self.args.flags.iter().any(|(f, _)| f == flag) {
                return Origin::Flag((*flag).to_owned());
            }
            return self.settings.origin(var);
        }
        SCHEMA.key(key).map_or(Origin::Default, |k| self.settings.origin(k.var))
    }

    pub fn rows(&self) -> Vec<Row> {
        let c = &self.config;
        let show = |p: &Option<String>, none: &str| p.clone().unwrap_or_else(|| none.to_owned());
        SCHEMA
            .keys
            .iter()
            .map(|k| {
                let value = match k.name {
                    "control_socket" => c.control_socket.display().to_string(),
                    "runner_uid" => show(&c.runner_uid, "unset (npu-brokerd's own uid)"),
                    "socket_group" => show(&c.socket_group, "unset (socket 0600)"),
                    "state_dir" => c.state_dir.display().to_string(),
                    "data_dir" => c.data_dir.display().to_string(),
                    "workload_config" => c
                        .workload_config
                        .as_ref()
                        .map_or("unset (built-in defaults)".into(), |p| p.display().to_string()),
                    "repo_root" => c.repo_root.display().to_string(),
                    "python" => show(&c.python, "unset (python3)"),
                    "log_level" => self.log.level_name().to_owned(),
                    "log_target" => self.log.target_name().to_owned(),
                    _ => self.settings.var(k.var).unwrap_or_else(|| "unset".to_owned()),
                };
                Row::new(k.name, value, self.origin(k.name))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Args {
        parse_args(&a.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap()
    }

    #[test]
    fn flags_over_variables_over_defaults() {
        let none = |_: &str| None;
        let d = resolve(&args(&[]), none);
        assert_eq!(d.control_socket, PathBuf::from("/run/npu-brokerd/control.sock"));
        assert_eq!(d.state_dir, PathBuf::from("/var/lib/npu-brokerd"));
        assert_eq!(d.data_dir, PathBuf::from("/var/lib/sciencediscovery"));
        assert_eq!((d.workload_config, d.runner_uid, d.confine), (None, None, true));
        let vars = |k: &str| match k {
            "SCIENCE_AGENT_NPU_BROKER_SOCKET" => Some("/v.sock".to_owned()),
            "STATE_DIRECTORY" => Some("/var/lib/x:/other".to_owned()),
            "SCIENCE_AGENT_NPU_WORKLOAD_CONFIG" => Some("/w.json".to_owned()),
            "SCIENCE_AGENT_NPU_PYTHON" => Some("/py".to_owned()),
            _ => None,
        };
        let c = resolve(&args(&["--control-socket", "/f.sock", "--no-confine", "--runner-uid=7"]), vars);
        assert_eq!(c.control_socket, PathBuf::from("/f.sock"));
        assert_eq!(c.state_dir, PathBuf::from("/var/lib/x"));
        assert_eq!(c.workload_config, Some(PathBuf::from("/w.json")));
        assert_eq!(
            (c.runner_uid.as_deref(), c.python.as_deref(), c.confine),
            (Some("7"), Some("/py"), false)
        );
    }

    #[test]
    fn bad_command_lines() {
        let err = |a: &[&str]| parse_args(&a.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap_err();
        let missing = ArgError::MissingValue { daemon: "npu-brokerd", flag: "--state-dir".into() };
        assert_eq!(err(&["--bogus"]), ArgError::Unknown { daemon: "npu-brokerd", arg: "--bogus".into() });
        assert_eq!(err(&["--state-dir"]), missing);
        assert_eq!(err(&["--state-dir="]), missing);
        assert_eq!(err(&["--bogus"]).to_string(), "unknown argument \"--bogus\"; see npu-brokerd --help");
        assert_eq!(missing.to_string(), "--state-dir needs a value; see npu-brokerd --help");
        assert_eq!(args(&["--check-config"]).mode, Mode::CheckConfig);
        assert_eq!(args(&["--help", "--bogus"]).mode, Mode::Help);
    }

    #[test]
    fn the_packaged_file_names_only_known_keys_each_once() {
        // Embedded at build time (the unprivileged test user may not enter the checkout).
        let packaged =
            include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../packaging/config/npu-brokerd.toml"));
        let settings: Vec<&str> = packaged
            .lines()
            .filter_map(|l| l.strip_prefix("# "))
            .filter(|l| {
                l.split_once(" = ")
                    .is_some_and(|(k, _)| k.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
            })
            .collect();
        assert!(settings.len() >= 10, "{settings:?}");
        let uncommented = settings.join("\n");
        let file = common::settings::ConfigFile::parse(
            &SCHEMA,
            std::path::Path::new("npu-brokerd.toml"),
            &uncommented,
        );
        assert!(file.is_ok(), "{:?}", file.err());
    }

    #[test]
    fn the_file_is_read_under_the_environment() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("npu-brokerd.toml");
        std::fs::write(&file, "state_dir = \"/from/file\"\nrepo_root = \"/repo\"\nrunner_uid = 1000\n")
            .unwrap();
        let path = file.display().to_string();
        let l = load(args(&["--config", &path, "--repo-root", "/flag"]), |k| {
            (k == "SCIENCE_AGENT_NPU_BROKER_STATE_DIR").then(|| "/from/env".to_owned())
        })
        .unwrap();
        assert_eq!(l.config.state_dir, PathBuf::from("/from/env"));
        assert_eq!(l.config.repo_root, PathBuf::from("/flag"));
        assert_eq!(l.config.runner_uid.as_deref(), Some("1000"));
        assert_eq!(l.origin("runner_uid"), Origin::File { path: file.clone(), line: 3 });
        let bad = dir.path().join("bad.toml");
        std::fs::write(&bad, "workloads = \"x\"\n").unwrap();
        let e = load(args(&["--config", &bad.display().to_string()]), |_| None).unwrap_err().to_string();
        assert!(e.contains("workloads"), "{e}");
    }
}
