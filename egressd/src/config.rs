//! egressd's settings: command-line flags over `SCIENCE_AGENT_EGRESS_*` variables over the
//! configuration file (`/etc/sciencediscovery/egressd.toml`, or `--config`, or
//! `SCIENCE_AGENT_EGRESS_CONFIG`) over defaults. Parsing is a pure function of the arguments
//! and a variable lookup (the environment layered over the file by `common::settings`), so
//! every rule is table-tested.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use common::audit::LogSettings;
use common::daemon::{self, ArgError, Blank, Grammar, Setting, Usage};
pub use common::daemon::{Args, Mode};
use common::settings::{Key, Kind, Layered, Origin, Row, Schema};

pub const USAGE: &str = "\
egressd: the sandbox egress gateway (a domain-allowlisting HTTP proxy per policy revision).

Usage:
  egressd [options]            serve the control socket and the gateways
  egressd --check-config [options]
                               validate the settings (and the users, the socket paths, the
                               DNS servers), print each with where it came from, exit 0 or 1
  egressd --help | --version

Configuration: flags override variables, variables override the file, the file overrides
the defaults. The file's keys are the long flags' names with - as _ (max_tunnels = 256;
nameservers = [\"10.0.0.2\"]), plus log_level and log_target.
  --config PATH           the configuration file (TOML) [SCIENCE_AGENT_EGRESS_CONFIG, default
                          /etc/sciencediscovery/egressd.toml; that one may be absent]

Options (each also read from the variable in brackets; a flag wins):
  --control-socket PATH   where runnerd asks for gateways
                          [SCIENCE_AGENT_EGRESS_SOCKET, default /run/egressd/control.sock]
  --runtime-dir DIR       gateway sockets live in DIR/eg/<16 hex>; keep it short (Unix socket
                          paths are limited to 107 bytes)
                          [SCIENCE_AGENT_EGRESS_RUNTIME_DIR, default $RUNTIME_DIRECTORY or /run/egressd]
  --runner-uid UID|NAME   the only user allowed on the control socket (runnerd's user)
                          [SCIENCE_AGENT_EGRESS_RUNNER_UID, default: egressd's own uid]
  --socket-group GROUP    make the sockets 0660 and owned by GROUP (runnerd's user must be a
                          member, so that bwrap can bind a gateway into a sandbox); without it
                          sockets are 0600 and runnerd must run as egressd's user
                          [SCIENCE_AGENT_EGRESS_SOCKET_GROUP]
  --nameserver ADDR       DNS server (IP or IP:port), repeatable; default: resolv.conf
                          [SCIENCE_AGENT_EGRESS_NAMESERVERS, comma-separated]
  --resolv-conf PATH      [SCIENCE_AGENT_EGRESS_RESOLV_CONF, default /etc/resolv.conf]
  --hosts-file PATH       names answered before DNS (canonical addresses only; every address
                          is still vetted like a DNS answer); reread when it changes
                          [SCIENCE_AGENT_EGRESS_HOSTS_FILE, default /etc/hosts]
  --max-tunnels N         a gateway's shared connections (a sandbox  [_MAX_TUNNELS, 256]
                          holds at most half; 429 beyond)
  --tunnel-idle-ms MS     close a connection idle this long          [_TUNNEL_IDLE_MS, 300000]
  --header-timeout-ms MS  a client must send its request head within [_HEADER_TIMEOUT_MS, 10000]
  --connect-timeout-ms MS dialling an upstream                       [_CONNECT_TIMEOUT_MS, 10000]
  --gateway-idle-ms MS    reap a gateway unused (no lease, no connection) this long
                                                                     [_GATEWAY_IDLE_MS, 300000]
  --no-confine            skip landlock and the seccomp filter (debugging only; health says so)

Logs: journald (identifier egressd) under systemd, else stderr [SCIENCE_AGENT_LOG_TARGET:
journald, stderr]; SCIENCE_AGENT_LOG_LEVEL (error, warn, info, debug, trace, off).
";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub control_socket: PathBuf,
    pub runtime_dir: PathBuf,
    /// `None`: egressd's own uid.
    pub runner_uid: Option<UserSpec>,
    pub socket_group: Option<String>,
    /// Empty: read `resolv_conf`.
    pub nameservers: Vec<SocketAddr>,
    pub resolv_conf: PathBuf,
    /// Consulted before DNS (`dns::hosts`).
    pub hosts_file: PathBuf,
    pub max_tunnels: usize,
    pub tunnel_idle: Duration,
    pub header_timeout: Duration,
    pub connect_timeout: Duration,
    pub gateway_idle: Duration,
    pub confine: bool,
}

/// A user given by number or by name (resolved at start-up).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UserSpec {
    Uid(u32),
    Name(String),
}

/// What the command line asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    Serve(Config),
    CheckConfig(Config),
    Help,
    Version,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error(transparent)]
    Args(#[from] ArgError),
    #[error("{name} must be a positive integer, not {value:?}")]
    Positive { name: String, value: String },
    #[error("{name}: {value:?} is not an IP address or IP:port")]
    Nameserver { name: String, value: String },
}

fn positive(name: &str, value: &str) -> Result<u64, ConfigError> {
    value
        .trim()
        .parse::<u64>()
        .ok()
        .filter(|n| *n > 0)
        .ok_or_else(|| ConfigError::Positive { name: name.to_owned(), value: value.to_owned() })
}

/// `IP`, `IP:port` or `[v6]:port`; port 53 by default.
pub fn parse_nameserver(name: &str, value: &str) -> Result<SocketAddr, ConfigError> {
    let v = value.trim();
    if let Ok(addr) = v.parse::<SocketAddr>() {
        return Ok(addr);
    }
    v.parse::<std::net::IpAddr>()
        .map(|ip| SocketAddr::new(ip, 53))
        .map_err(|_| ConfigError::Nameserver { name: name.to_owned(), value: value.to_owned() })
}

fn user_spec(value: &str) -> UserSpec {
    match value.trim().parse::<u32>() {
        Ok(uid) => UserSpec::Uid(uid),
        Err(_) => UserSpec::Name(value.trim().to_owned()),
    }
}

/// Each setting: its key in the configuration file, its flag, its variable. The keys are
/// the flags' names with `-` as `_`, the list of nameservers in the plural.
pub const SETTINGS: &[Setting] = &[
    ("control_socket", "--control-socket", "SCIENCE_AGENT_EGRESS_SOCKET"),
    ("runtime_dir", "--runtime-dir", "SCIENCE_AGENT_EGRESS_RUNTIME_DIR"),
    ("runner_uid", "--runner-uid", "SCIENCE_AGENT_EGRESS_RUNNER_UID"),
    ("socket_group", "--socket-group", "SCIENCE_AGENT_EGRESS_SOCKET_GROUP"),
    ("nameservers", "--nameserver", "SCIENCE_AGENT_EGRESS_NAMESERVERS"),
    ("resolv_conf", "--resolv-conf", "SCIENCE_AGENT_EGRESS_RESOLV_CONF"),
    ("hosts_file", "--hosts-file", "SCIENCE_AGENT_EGRESS_HOSTS_FILE"),
    ("max_tunnels", "--max-tunnels", "SCIENCE_AGENT_EGRESS_MAX_TUNNELS"),
    ("tunnel_idle_ms", "--tunnel-idle-ms", "SCIENCE_AGENT_EGRESS_TUNNEL_IDLE_MS"),
    ("header_timeout_ms", "--header-timeout-ms", "SCIENCE_AGENT_EGRESS_HEADER_TIMEOUT_MS"),
    ("connect_timeout_ms", "--connect-timeout-ms", "SCIENCE_AGENT_EGRESS_CONNECT_TIMEOUT_MS"),
    ("gateway_idle_ms", "--gateway-idle-ms", "SCIENCE_AGENT_EGRESS_GATEWAY_IDLE_MS"),
];

/// egressd's command line: the setting flags and `--no-confine`; a blank value is refused
/// as empty.
pub const GRAMMAR: Grammar = Grammar {
    daemon: "egressd",
    help: &["--help", "-h"],
    switches: &["--no-confine"],
    settings: SETTINGS,
    split_every_flag: true,
    blank: Blank::Empty,
};

/// Parses the arguments (without the program name); values are checked by [`resolve`].
pub fn parse_args(args: &[String]) -> Result<Args, ArgError> {
    daemon::parse_args(&GRAMMAR, args)
}

/// The settings: flags over the variables read through `var` (in production the environment
/// over the configuration file) over the defaults.
pub fn resolve(args: &Args, var: impl Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
    let get = |name: &str| var(name).filter(|v| !v.trim().is_empty());
    let ms = |name: &str, default: u64| -> Result<Duration, ConfigError> {
        get(name).map_or(Ok(default), |v| positive(name, &v)).map(Duration::from_millis)
    };
    let mut cfg = Config {
        control_socket: get("SCIENCE_AGENT_EGRESS_SOCKET")
            .unwrap_or("/run/egressd/control.sock".into())
            .into(),
        runtime_dir: get("SCIENCE_AGENT_EGRESS_RUNTIME_DIR")
            .or_else(|| get("RUNTIME_DIRECTORY").map(|d| d.split(':').next().unwrap_or_default().to_owned()))
            .unwrap_or("/run/egressd".into())
            .into(),
        runner_uid: get("SCIENCE_AGENT_EGRESS_RUNNER_UID").map(|v| user_spec(&v)),
        socket_group: get("SCIENCE_AGENT_EGRESS_SOCKET_GROUP"),
        nameservers: match get("SCIENCE_AGENT_EGRESS_NAMESERVERS") {
            None => Vec::new(),
            Some(list) => list
                .split(',')
                .filter(|s| !s.trim().is_empty())
                .map(|s| parse_nameserver("SCIENCE_AGENT_EGRESS_NAMESERVERS", s))
                .collect::<Result<_, _>>()?,
        },
        resolv_conf: get("SCIENCE_AGENT_EGRESS_RESOLV_CONF").unwrap_or("/etc/resolv.conf".into()).into(),
        hosts_file: get("SCIENCE_AGENT_EGRESS_HOSTS_FILE").unwrap_or("/etc/hosts".into()).into(),
        max_tunnels: get("SCIENCE_AGENT_EGRESS_MAX_TUNNELS")
            .map_or(Ok(256), |v| positive("SCIENCE_AGENT_EGRESS_MAX_TUNNELS", &v))?
            as usize,
        tunnel_idle: ms("SCIENCE_AGENT_EGRESS_TUNNEL_IDLE_MS", 300_000)?,
        header_timeout: ms("SCIENCE_AGENT_EGRESS_HEADER_TIMEOUT_MS", 10_000)?,
        connect_timeout: ms("SCIENCE_AGENT_EGRESS_CONNECT_TIMEOUT_MS", 10_000)?,
        gateway_idle: ms("SCIENCE_AGENT_EGRESS_GATEWAY_IDLE_MS", 300_000)?,
        confine: args.confine(),
    };
    let mut nameservers_from_flags = Vec::new();
    for (flag, value) in &args.flags {
        let flag = *flag;
        let value = value.clone();
        match flag {
            "--control-socket" => cfg.control_socket = value.into(),
            "--runtime-dir" => cfg.runtime_dir = value.into(),
            "--runner-uid" => cfg.runner_uid = Some(user_spec(&value)),
            "--socket-group" => cfg.socket_group = Some(value),
            "--nameserver" => nameservers_from_flags.push(parse_nameserver(flag, &value)?),
            "--resolv-conf" => cfg.resolv_conf = value.into(),
            "--hosts-file" => cfg.hosts_file = value.into(),
            "--max-tunnels" => cfg.max_tunnels = positive(flag, &value)? as usize,
            "--tunnel-idle-ms" => cfg.tunnel_idle = Duration::from_millis(positive(flag, &value)?),
            "--header-timeout-ms" => cfg.header_timeout = Duration::from_millis(positive(flag, &value)?),
            "--connect-timeout-ms" => cfg.connect_timeout = Duration::from_millis(positive(flag, &value)?),
            "--gateway-idle-ms" => cfg.gateway_idle = Duration::from_millis(positive(flag, &value)?),
            other => return Err(ArgError::Unknown { daemon: "egressd", arg: other.to_owned() }.into()),
        }
    }
    if !nameservers_from_flags.is_empty() {
        cfg.nameservers = nameservers_from_flags;
    }
    Ok(cfg)
}

/// Parses the arguments (without the program name) over the variables read through `var`.
pub fn parse(args: &[String], var: impl Fn(&str) -> Option<String>) -> Result<Command, ConfigError> {
    let parsed = parse_args(args)?;
    Ok(match parsed.mode {
        Mode::Help => Command::Help,
        Mode::Version => Command::Version,
        Mode::CheckConfig => Command::CheckConfig(resolve(&parsed, var)?),
        Mode::Serve => Command::Serve(resolve(&parsed, var)?),
    })
}

/// The file egressd reads when neither `--config` nor `SCIENCE_AGENT_EGRESS_CONFIG` names
/// one; when it does not exist, the defaults apply.
pub const DEFAULT_CONFIG_FILE: &str = "/etc/sciencediscovery/egressd.toml";
/// Names the configuration file (a file named so must exist).
pub const CONFIG_VAR: &str = "SCIENCE_AGENT_EGRESS_CONFIG";

/// Every key of egressd's configuration file (the same settings as [`SETTINGS`], plus the
/// log settings, which have no flag).
pub static SCHEMA: Schema = Schema {
    daemon: "egressd",
    keys: &[
        Key::new("control_socket", "SCIENCE_AGENT_EGRESS_SOCKET", Kind::Text),
        Key::new("runtime_dir", "SCIENCE_AGENT_EGRESS_RUNTIME_DIR", Kind::Text),
        Key::new("runner_uid", "SCIENCE_AGENT_EGRESS_RUNNER_UID", Kind::Name),
        Key::new("socket_group", "SCIENCE_AGENT_EGRESS_SOCKET_GROUP", Kind::Name),
        Key::new("nameservers", "SCIENCE_AGENT_EGRESS_NAMESERVERS", Kind::List),
        Key::new("resolv_conf", "SCIENCE_AGENT_EGRESS_RESOLV_CONF", Kind::Text),
        Key::new("hosts_file", "SCIENCE_AGENT_EGRESS_HOSTS_FILE", Kind::Text),
        Key::new("max_tunnels", "SCIENCE_AGENT_EGRESS_MAX_TUNNELS", Kind::Integer),
        Key::new("tunnel_idle_ms", "SCIENCE_AGENT_EGRESS_TUNNEL_IDLE_MS", Kind::Integer),
        Key::new("header_timeout_ms", "SCIENCE_AGENT_EGRESS_HEADER_TIMEOUT_MS", Kind::Integer),
        Key::new("connect_timeout_ms", "SCIENCE_AGENT_EGRESS_CONNECT_TIMEOUT_MS", Kind::Integer),
        Key::new("gateway_idle_ms", "SCIENCE_AGENT_EGRESS_GATEWAY_IDLE_MS", Kind::Integer),
        Key::new("log_level", common::audit::LEVEL_VAR, Kind::Text),
        Key::new("log_target", common::audit::TARGET_VAR, Kind::Text),
    ],
    refused: &[],
};

impl ConfigError {
    /// The same error with a variable named by `describe(variable)` (flags stay as they are).
    pub fn renamed(self, describe: impl Fn(&str) -> String) -> ConfigError {
        match self {
            ConfigError::Positive { name, value } => ConfigError::Positive { name: describe(&name), value },
            ConfigError::Nameserver { name, value } => {
                ConfigError::Nameserver { name: describe(&name), value }
            }
            other => other,
        }
    }
}

/// A configuration that start-up validated, and where each value came from.
#[derive(Debug)]
pub struct Loaded {
    pub args: Args,
    pub config: Config,
    pub log: LogSettings,
    pub settings: Layered,
}

pub type LoadError = daemon::LoadError<ConfigError>;

impl From<ConfigError> for LoadError {
    fn from(e: ConfigError) -> LoadError {
        LoadError::Value(e)
    }
}

impl Usage for ConfigError {
    /// A bad command line, or a bad value given by a flag (rather than by a variable or
    /// the file).
    fn is_usage(&self) -> bool {
        match self {
            ConfigError::Args(_) => true,
            ConfigError::Positive { name, .. } | ConfigError::Nameserver { name, .. } => {
                name.starts_with("--")
            }
        }
    }
}

/// Flags over the environment `env` over the chosen file over the defaults.
pub fn load(
    args: Args,
    env: impl Fn(&str) -> Option<String> + Send + Sync + 'static,
) -> Result<Loaded, LoadError> {
    let settings = daemon::layered(&SCHEMA, args.config.as_deref(), CONFIG_VAR, DEFAULT_CONFIG_FILE, env)?;
    layer(args, settings)
}

/// Validates flags over a layered lookup; errors name the key and the file when the value
/// came from it.
pub fn layer(args: Args, settings: Layered) -> Result<Loaded, LoadError> {
    let describe = |var: &str| settings.describe(var);
    let config = resolve(&args, |k| settings.var(k)).map_err(|e| e.renamed(describe))?;
    let log = daemon::log_settings(&settings)?;
    Ok(Loaded { args, config, log, settings })
}

impl Loaded {
    /// Where the setting `key` came from.
    pub fn origin(&self, key: &str) -> Origin {
        let Some((_, flag, var)) = SETTINGS.iter().find(|(k, _, _)| *k == key) else {
            return SCHEMA.key(key).map_or(Origin::Default, |k| self.settings.origin(k.var));
        };
        if self.args.has(flag) {
            return Origin::Flag((*flag).to_owned());
        }
        match self.settings.origin(var) {
            Origin::Default if key == "runtime_dir" && self.settings.var("RUNTIME_DIRECTORY").is_some() => {
                Origin::Environment("RUNTIME_DIRECTORY".to_owned())
            }
            origin => origin,
        }
    }

    /// Every setting with its effective value and origin.
    pub fn rows(&self) -> Vec<Row> {
        let c = &self.config;
        let ms = |d: Duration| d.as_millis().to_string();
        let mut rows: Vec<Row> = SCHEMA
            .keys
            .iter()
            .map(|k| {
                let value = match k.name {
                    "control_socket" => c.control_socket.display().to_string(),
                    "runtime_dir" => c.runtime_dir.display().to_string(),
                    "runner_uid" => match &c.runner_uid {
                        None => "unset (egressd's own uid)".to_owned(),
                        Some(UserSpec::Uid(uid)) => uid.to_string(),
                        Some(UserSpec::Name(name)) => name.clone(),
                    },
                    "socket_group" => {
                        c.socket_group.clone().unwrap_or_else(|| "unset (sockets 0600)".to_owned())
                    }
                    "nameservers" if c.nameservers.is_empty() => "unset (read resolv_conf)".to_owned(),
                    "nameservers" => {
                        c.nameservers.iter().map(|a| a.to_string()).collect::<Vec<_>>().join(", ")
                    }
                    "resolv_conf" => c.resolv_conf.display().to_string(),
                    "hosts_file" => c.hosts_file.display().to_string(),
                    "max_tunnels" => c.max_tunnels.to_string(),
                    "tunnel_idle_ms" => ms(c.tunnel_idle),
                    "header_timeout_ms" => ms(c.header_timeout),
                    "connect_timeout_ms" => ms(c.connect_timeout),
                    "gateway_idle_ms" => ms(c.gateway_idle),
                    "log_level" => self.log.level_name().to_owned(),
                    "log_target" => self.log.target_name().to_owned(),
                    other => format!("<{other}>"),
                };
                Row::new(k.name, value, self.origin(k.name))
            })
            .collect();
        let confine_origin =
            if c.confine { Origin::Default } else { Origin::Flag("--no-confine".to_owned()) };
        rows.push(Row::new("confine", c.confine.to_string(), confine_origin));
        rows
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use common::settings::FileChoice;
    use std::collections::HashMap;

    fn run(args: &[&str], vars: &[(&str, &str)]) -> Result<Command, ConfigError> {
        let map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        parse(&args, |k| map.get(k).cloned())
    }

    fn serve(args: &[&str], vars: &[(&str, &str)]) -> Config {
        match run(args, vars).unwrap() {
            Command::Serve(c) => c,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn defaults() {
        let c = serve(&[], &[]);
        assert_eq!(c.control_socket, PathBuf::from("/run/egressd/control.sock"));
        assert_eq!(c.runtime_dir, PathBuf::from("/run/egressd"));
        assert_eq!((c.max_tunnels, c.runner_uid, c.confine), (256, None, true));
        assert!(c.nameservers.is_empty());
        assert_eq!(c.header_timeout, Duration::from_secs(10));
        assert_eq!(c.hosts_file, PathBuf::from("/etc/hosts"));
        let vars = [("SCIENCE_AGENT_EGRESS_HOSTS_FILE", "/srv/hosts")];
        assert_eq!(serve(&[], &vars).hosts_file, PathBuf::from("/srv/hosts"));
        assert_eq!(serve(&["--hosts-file=/x/h"], &vars).hosts_file, PathBuf::from("/x/h"));
    }

    #[test]
    fn flags_win_over_variables_and_variables_over_defaults() {
        let vars = [
            ("SCIENCE_AGENT_EGRESS_SOCKET", "/var/a.sock"),
            ("SCIENCE_AGENT_EGRESS_NAMESERVERS", "10.0.0.2, [::1]:5353"),
            ("RUNTIME_DIRECTORY", "/run/x:/run/y"),
            ("SCIENCE_AGENT_EGRESS_RUNNER_UID", "runnerd"),
        ];
        let c = serve(&[], &vars);
        assert_eq!(c.control_socket, PathBuf::from("/var/a.sock"));
        assert_eq!(c.runtime_dir, PathBuf::from("/run/x"));
        assert_eq!(c.runner_uid, Some(UserSpec::Name("runnerd".into())));
        assert_eq!(c.nameservers, vec!["10.0.0.2:53".parse().unwrap(), "[::1]:5353".parse().unwrap()]);
        let c = serve(
            &[
                "--control-socket",
                "/b.sock",
                "--nameserver=127.0.0.1:5300",
                "--runner-uid",
                "1000",
                "--no-confine",
            ],
            &vars,
        );
        assert_eq!(c.control_socket, PathBuf::from("/b.sock"));
        assert_eq!(c.nameservers, vec!["127.0.0.1:5300".parse().unwrap()]);
        assert_eq!(c.runner_uid, Some(UserSpec::Uid(1000)));
        assert!(!c.confine);
    }

    #[test]
    fn errors_name_the_setting() {
        type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], &'a str);
        let cases: &[Case] = &[
            (&["--max-tunnels", "0"], &[], "--max-tunnels must be a positive integer"),
            (&["--bogus"], &[], "unknown argument \"--bogus\""),
            (&["--nameserver"], &[], "--nameserver needs a value"),
            (&["--nameserver", "dns.google"], &[], "is not an IP address"),
            (
                &[],
                &[("SCIENCE_AGENT_EGRESS_TUNNEL_IDLE_MS", "-5")],
                "SCIENCE_AGENT_EGRESS_TUNNEL_IDLE_MS must be",
            ),
            (&["--runtime-dir="], &[], "--runtime-dir must not be empty"),
        ];
        for (args, vars, needle) in cases {
            let err = run(args, vars).unwrap_err().to_string();
            assert!(err.contains(needle), "{args:?}: {err}");
        }
    }

    #[test]
    fn modes() {
        assert_eq!(run(&["--help"], &[]).unwrap(), Command::Help);
        assert_eq!(run(&["-V"], &[]).unwrap(), Command::Version);
        assert!(matches!(run(&["--check-config"], &[]).unwrap(), Command::CheckConfig(_)));
    }

    fn loaded(args: &[&str], file: &str, vars: &[(&str, &str)]) -> Result<Loaded, LoadError> {
        let path = std::path::Path::new(DEFAULT_CONFIG_FILE);
        let parsed = common::settings::ConfigFile::parse(&SCHEMA, path, file)?;
        let map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
        let settings = Layered::new(&SCHEMA, FileChoice::Default(path.into()), Some(parsed), move |k| {
            map.get(k).cloned()
        });
        layer(parse_args(&args).map_err(ConfigError::from)?, settings)
    }

    const FILE: &str = "# egressd\ncontrol_socket = \"/run/f.sock\"\nnameservers = [\"10.0.0.2\", \"10.0.0.3:5353\"]\n\
                        max_tunnels = 64\nrunner_uid = 998\nlog_level = \"debug\"\n";

    #[test]
    fn flags_over_variables_over_the_file_over_defaults() {
        let l = loaded(&[], FILE, &[]).unwrap();
        assert_eq!(l.config.control_socket, PathBuf::from("/run/f.sock"));
        assert_eq!(
            l.config.nameservers,
            vec!["10.0.0.2:53".parse().unwrap(), "10.0.0.3:5353".parse().unwrap()]
        );
        assert_eq!((l.config.max_tunnels, l.config.runner_uid.clone()), (64, Some(UserSpec::Uid(998))));
        assert_eq!(l.log.level_name(), "debug");
        assert_eq!(l.origin("max_tunnels"), Origin::File { path: DEFAULT_CONFIG_FILE.into(), line: 4 });
        assert_eq!(l.origin("resolv_conf"), Origin::Default);

        let vars = [("SCIENCE_AGENT_EGRESS_MAX_TUNNELS", "32"), ("RUNTIME_DIRECTORY", "/run/egressd")];
        let l = loaded(&[], FILE, &vars).unwrap();
        assert_eq!(l.config.max_tunnels, 32);
        assert_eq!(l.origin("max_tunnels"), Origin::Environment("SCIENCE_AGENT_EGRESS_MAX_TUNNELS".into()));
        assert_eq!(l.origin("runtime_dir"), Origin::Environment("RUNTIME_DIRECTORY".into()));

        let l = loaded(&["--max-tunnels", "8", "--nameserver", "127.0.0.1"], FILE, &vars).unwrap();
        assert_eq!(l.config.max_tunnels, 8);
        assert_eq!(l.config.nameservers, vec!["127.0.0.1:53".parse().unwrap()]);
        assert_eq!(l.origin("max_tunnels"), Origin::Flag("--max-tunnels".into()));
        assert_eq!(l.origin("nameservers"), Origin::Flag("--nameserver".into()));
        assert_eq!(l.origin("control_socket"), Origin::File { path: DEFAULT_CONFIG_FILE.into(), line: 2 });
        let rows = l.rows();
        let row = |key: &str| rows.iter().find(|r| r.key == key).unwrap().clone();
        assert_eq!(
            (row("max_tunnels").value, row("max_tunnels").origin),
            ("8".into(), "flag --max-tunnels".into())
        );
        assert_eq!(row("confine").value, "true");
    }

    #[test]
    fn errors_name_the_key_and_the_file_when_the_value_came_from_it() {
        type Case<'a> = (&'a [&'a str], &'a str, &'a [(&'a str, &'a str)], &'a str, bool);
        let cases: &[Case] = &[
            (
                &[],
                "max_tunnels = 0",
                &[],
                "max_tunnels in /etc/sciencediscovery/egressd.toml:1 must be a positive integer, not \"0\"",
                false,
            ),
            (
                &[],
                "\nnameservers = [\"dns.google\"]",
                &[],
                "nameservers in /etc/sciencediscovery/egressd.toml:2: \"dns.google\" is not an IP address or IP:port",
                false,
            ),
            (
                &[],
                "tunnel_idle_ms = -5",
                &[],
                "tunnel_idle_ms in /etc/sciencediscovery/egressd.toml:1 must be",
                false,
            ),
            (
                &[],
                "log_target = \"syslog\"",
                &[],
                "log_target in /etc/sciencediscovery/egressd.toml:1 must be one of journald, stderr, auto",
                false,
            ),
            (
                &[],
                "max_tunnels = 0",
                &[("SCIENCE_AGENT_EGRESS_MAX_TUNNELS", "x")],
                "SCIENCE_AGENT_EGRESS_MAX_TUNNELS must be a positive integer, not \"x\"",
                false,
            ),
            (
                &["--max-tunnels", "0"],
                "max_tunnels = 5",
                &[],
                "--max-tunnels must be a positive integer",
                true,
            ),
            (&["--bogus"], "", &[], "unknown argument \"--bogus\"", true),
            (&["--config"], "", &[], "--config needs a value", true),
        ];
        for (args, file, vars, want, usage) in cases {
            let err = loaded(args, file, vars).unwrap_err();
            assert!(err.to_string().contains(want), "{args:?} {file}:\n  got  {err}\n  want {want}");
            assert_eq!(err.is_usage(), *usage, "{err}");
        }
        let err = loaded(&[], "max_tunnel = 1", &[]).unwrap_err().to_string();
        assert_eq!(
            err,
            "unknown key max_tunnel in /etc/sciencediscovery/egressd.toml:1 (did you mean max_tunnels?)"
        );
        let err = loaded(&[], "[egressd]\nmax_tunnels = 1", &[]).unwrap_err().to_string();
        assert!(err.contains("egressd's settings are top-level keys, without [sections]"), "{err}");
    }

    #[test]
    fn config_flag() {
        let args: Vec<String> =
            ["--config", "/srv/e.toml", "--check-config"].iter().map(|s| s.to_string()).collect();
        let a = parse_args(&args).unwrap();
        assert_eq!((a.mode, a.config), (Mode::CheckConfig, Some(PathBuf::from("/srv/e.toml"))));
        let a = parse_args(&["--config=/x.toml".to_owned()]).unwrap();
        assert_eq!(a.config, Some(PathBuf::from("/x.toml")));
    }

    /// The file's keys, the flags, the variables `resolve` reads, and the README stay in step.
    #[test]
    fn keys_flags_variables_and_readme_agree() {
        let read = std::cell::RefCell::new(std::collections::BTreeSet::new());
        let record = |k: &str| {
            read.borrow_mut().insert(k.to_owned());
            None
        };
        resolve(&parse_args(&[]).unwrap(), record).unwrap();
        LogSettings::from_vars(record).unwrap();
        let mut keys: std::collections::BTreeSet<String> =
            SCHEMA.keys.iter().map(|k| k.var.to_owned()).collect();
        keys.insert("RUNTIME_DIRECTORY".to_owned());
        assert_eq!(read.into_inner(), keys);
        for (key, flag, var) in SETTINGS {
            let k = SCHEMA.key(key).unwrap_or_else(|| panic!("{key} is no key of the file"));
            assert_eq!(k.var, *var);
            assert_eq!(
                flag.trim_start_matches("--").replace('-', "_").trim_end_matches('s'),
                key.trim_end_matches('s')
            );
            assert!(USAGE.contains(flag), "USAGE lacks {flag}");
        }
        assert_eq!(SETTINGS.len() + 2, SCHEMA.keys.len(), "only log_level and log_target have no flag");
        // Embedded at build time: the tests also run as an unprivileged user who may not be
        // able to enter the checkout.
        let readme = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md"));
        for k in SCHEMA.keys {
            assert!(readme.contains(&format!("`{}`", k.name)), "README lacks the key {}", k.name);
        }
    }
}
