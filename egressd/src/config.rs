//! egressd's settings: command-line flags over `SCIENCE_AGENT_EGRESS_*` variables over
//! defaults. Parsing is a pure function of the arguments and a variable lookup, so every
//! rule is table-tested.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

pub const USAGE: &str = "\
egressd: the sandbox egress gateway (a domain-allowlisting HTTP proxy per policy revision).

Usage:
  egressd [options]            serve the control socket and the gateways
  egressd --check-config       validate the settings, print them, and exit
  egressd --help | --version

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
  --max-tunnels N         open connections per gateway before 429   [_MAX_TUNNELS, 256]
  --tunnel-idle-ms MS     close a connection idle this long          [_TUNNEL_IDLE_MS, 300000]
  --header-timeout-ms MS  a client must send its request head within [_HEADER_TIMEOUT_MS, 10000]
  --connect-timeout-ms MS dialling an upstream                       [_CONNECT_TIMEOUT_MS, 10000]
  --gateway-idle-ms MS    reap a gateway unused (no lease, no connection) this long
                                                                     [_GATEWAY_IDLE_MS, 300000]
  --no-confine            skip landlock and the seccomp filter (debugging only; health says so)

Logs: journald (identifier egressd) under systemd, else stderr; SCIENCE_AGENT_LOG_LEVEL.
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
    #[error("unknown argument {0:?}; see egressd --help")]
    Unknown(String),
    #[error("{0} needs a value; see egressd --help")]
    MissingValue(String),
    #[error("{name} must be a positive integer, not {value:?}")]
    Positive { name: String, value: String },
    #[error("{name}: {value:?} is not an IP address or IP:port")]
    Nameserver { name: String, value: String },
    #[error("{name} must not be empty")]
    Empty { name: String },
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

/// Parses the arguments (without the program name) over the variables read through `var`.
pub fn parse(args: &[String], var: impl Fn(&str) -> Option<String>) -> Result<Command, ConfigError> {
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
        max_tunnels: get("SCIENCE_AGENT_EGRESS_MAX_TUNNELS")
            .map_or(Ok(256), |v| positive("SCIENCE_AGENT_EGRESS_MAX_TUNNELS", &v))?
            as usize,
        tunnel_idle: ms("SCIENCE_AGENT_EGRESS_TUNNEL_IDLE_MS", 300_000)?,
        header_timeout: ms("SCIENCE_AGENT_EGRESS_HEADER_TIMEOUT_MS", 10_000)?,
        connect_timeout: ms("SCIENCE_AGENT_EGRESS_CONNECT_TIMEOUT_MS", 10_000)?,
        gateway_idle: ms("SCIENCE_AGENT_EGRESS_GATEWAY_IDLE_MS", 300_000)?,
        confine: true,
    };
    let mut check = false;
    let mut nameservers_from_flags = Vec::new();
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f, Some(v.to_owned())),
            _ => (arg.as_str(), None),
        };
        let mut value = || -> Result<String, ConfigError> {
            let v = match inline.clone() {
                Some(v) => v,
                None => it.next().cloned().ok_or_else(|| ConfigError::MissingValue(flag.to_owned()))?,
            };
            if v.trim().is_empty() {
                return Err(ConfigError::Empty { name: flag.to_owned() });
            }
            Ok(v)
        };
        match flag {
            "--help" | "-h" => return Ok(Command::Help),
            "--version" | "-V" => return Ok(Command::Version),
            "--check-config" => check = true,
            "--no-confine" => cfg.confine = false,
            "--control-socket" => cfg.control_socket = value()?.into(),
            "--runtime-dir" => cfg.runtime_dir = value()?.into(),
            "--runner-uid" => cfg.runner_uid = Some(user_spec(&value()?)),
            "--socket-group" => cfg.socket_group = Some(value()?),
            "--nameserver" => nameservers_from_flags.push(parse_nameserver(flag, &value()?)?),
            "--resolv-conf" => cfg.resolv_conf = value()?.into(),
            "--max-tunnels" => cfg.max_tunnels = positive(flag, &value()?)? as usize,
            "--tunnel-idle-ms" => cfg.tunnel_idle = Duration::from_millis(positive(flag, &value()?)?),
            "--header-timeout-ms" => cfg.header_timeout = Duration::from_millis(positive(flag, &value()?)?),
            "--connect-timeout-ms" => cfg.connect_timeout = Duration::from_millis(positive(flag, &value()?)?),
            "--gateway-idle-ms" => cfg.gateway_idle = Duration::from_millis(positive(flag, &value()?)?),
            other => return Err(ConfigError::Unknown(other.to_owned())),
        }
    }
    if !nameservers_from_flags.is_empty() {
        cfg.nameservers = nameservers_from_flags;
    }
    Ok(if check { Command::CheckConfig(cfg) } else { Command::Serve(cfg) })
}

#[cfg(test)]
mod tests {
    use super::*;
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
}
