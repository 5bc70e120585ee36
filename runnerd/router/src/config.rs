//! runner-router's settings: flags over `SCIENCE_AGENT_*` variables over the configuration
//! file (`/etc/sciencediscovery/runner-router.toml`, `--config` or
//! `SCIENCE_AGENT_ROUTER_CONFIG`) over defaults, through `common::settings` like the other
//! daemons. Where a setting is runnerd's too (listen address, token, data directory) it has
//! runnerd's name, so one environment serves both. Resolution is pure: every rule is tested.

use std::path::PathBuf;
use std::time::Duration;

use common::audit::LogSettings;
use common::daemon::{self, ArgError, Blank, Grammar, Setting};
pub use common::daemon::{Args, Mode};
use common::settings::{Key, Kind, Layered, Origin, Row, Schema, parse_non_negative};

use crate::fleet::Pool;

pub const USAGE: &str = "\
runner-router: one URL in front of many runnerd nodes (issue #35). It speaks runnerd's HTTP
API exactly: point SCIENCE_AGENT_RUNNER_URL at it. A new workspace goes to the least loaded
of a few sampled ready nodes of its pool; every later call of that workspace goes to the node
that holds it; a node that stops being ready answers 503 with Retry-After for its workspaces.

Usage:
  runner-router [options]        serve
  runner-router --check-config [options]
                                 validate the settings, print each with where it came from
  runner-router --help | --version

Nodes come from one of:
  --nodes LIST            static: comma-separated node URLs, each optionally POOL=URL
                          (pools: cpu, nvidia, ascend; default cpu), e.g.
                          http://10.0.0.2:4311,nvidia=http://10.0.0.9:4311
                          [SCIENCE_AGENT_ROUTER_NODES]
  --kube-services LIST    Kubernetes: POOL=SERVICE,… the pools' headless Services, whose
                          EndpointSlices are watched (in-cluster config, else KUBECONFIG)
                          [SCIENCE_AGENT_ROUTER_KUBE_SERVICES]
  --kube-namespace NS     their namespace [SCIENCE_AGENT_ROUTER_KUBE_NAMESPACE, default: the
                          pod's own namespace, else the kubeconfig's]

Options (each also read from the variable in brackets; a flag wins):
  --config PATH           [SCIENCE_AGENT_ROUTER_CONFIG, default
                          /etc/sciencediscovery/runner-router.toml; that one may be absent]
  --host ADDR             listen address [SCIENCE_AGENT_RUNNER_HOST, default 127.0.0.1]
  --port N                listen port [SCIENCE_AGENT_RUNNER_PORT, default 4311]
  --token-file PATH       the token (the nodes' token: requests are forwarded unchanged)
                          [SCIENCE_AGENT_RUNNER_TOKEN_FILE; or SCIENCE_AGENT_RUNNER_TOKEN, or
                          $CREDENTIALS_DIRECTORY/runner-token, or DATA_DIR/runner-token]
  --data-dir DIR          the nodes' data directory, to name a workspaceRoot's workspace
                          [SCIENCE_AGENT_DATA_DIR, default /var/lib/sciencediscovery]
  --sample N              nodes sampled for a new workspace (best of N) [SCIENCE_AGENT_ROUTER_SAMPLE,
                          default 2]
  --load-interval-ms N    how often each node's load is read [SCIENCE_AGENT_ROUTER_LOAD_INTERVAL_MS,
                          default 2000]
  --lost-grace-secs N     after a node has been not ready this long, its workspaces are
                          restored on other nodes from the object store; 0: never
                          [SCIENCE_AGENT_ROUTER_LOST_GRACE_SECS, default 600]
  execution_signature_max_age_ms, as runnerd's [SCIENCE_AGENT_EXECUTION_SIGNATURE_MAX_AGE_MS]

Logs: journald (identifier runner-router) under systemd, else stderr
[SCIENCE_AGENT_LOG_TARGET]; SCIENCE_AGENT_LOG_LEVEL.
";

pub const DEFAULT_PORT: u16 = 4311;
pub const DEFAULT_SAMPLE: usize = 2;
pub const DEFAULT_LOAD_INTERVAL_MS: u64 = 2000;
pub const DEFAULT_LOST_GRACE_SECS: u64 = 600;
pub const DEFAULT_CONFIG_FILE: &str = "/etc/sciencediscovery/runner-router.toml";
pub const CONFIG_VAR: &str = "SCIENCE_AGENT_ROUTER_CONFIG";
const SIGNATURE_MAX_AGE: &str = "SCIENCE_AGENT_EXECUTION_SIGNATURE_MAX_AGE_MS";

/// Where the nodes come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Membership {
    /// Fixed node URLs with their pools; always ready unless their `/health` fails.
    Static(Vec<(Pool, String)>),
    /// The pools' headless Services, watched in `namespace` (`None`: the client's default).
    Kube { services: Vec<(Pool, String)>, namespace: Option<String> },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub host: String,
    pub port: u16,
    pub token_file: Option<PathBuf>,
    pub data_dir: PathBuf,
    pub membership: Membership,
    pub sample: usize,
    pub load_interval: Duration,
    /// `None`: never restore a lost node's workspaces elsewhere.
    pub lost_grace: Option<Duration>,
    pub signature_max_age_ms: u64,
}

/// `(key, flag, variable)` of each setting with a flag.
pub const SETTINGS: &[Setting] = &[
    ("nodes", "--nodes", "SCIENCE_AGENT_ROUTER_NODES"),
    ("kube_services", "--kube-services", "SCIENCE_AGENT_ROUTER_KUBE_SERVICES"),
    ("kube_namespace", "--kube-namespace", "SCIENCE_AGENT_ROUTER_KUBE_NAMESPACE"),
    ("runner_host", "--host", "SCIENCE_AGENT_RUNNER_HOST"),
    ("runner_port", "--port", "SCIENCE_AGENT_RUNNER_PORT"),
    ("runner_token_file", "--token-file", "SCIENCE_AGENT_RUNNER_TOKEN_FILE"),
    ("data_dir", "--data-dir", "SCIENCE_AGENT_DATA_DIR"),
    ("sample", "--sample", "SCIENCE_AGENT_ROUTER_SAMPLE"),
    ("load_interval_ms", "--load-interval-ms", "SCIENCE_AGENT_ROUTER_LOAD_INTERVAL_MS"),
    ("lost_grace_secs", "--lost-grace-secs", "SCIENCE_AGENT_ROUTER_LOST_GRACE_SECS"),
];

pub const GRAMMAR: Grammar = Grammar {
    daemon: "runner-router",
    help: &["--help", "-h"],
    switches: &[],
    settings: SETTINGS,
    split_every_flag: true,
    blank: Blank::Missing,
};

pub fn parse_args(args: &[String]) -> Result<Args, ArgError> {
    daemon::parse_args(&GRAMMAR, args)
}

pub static SCHEMA: Schema = Schema {
    daemon: "runner-router",
    keys: &[
        Key::new("nodes", "SCIENCE_AGENT_ROUTER_NODES", Kind::List),
        Key::new("kube_services", "SCIENCE_AGENT_ROUTER_KUBE_SERVICES", Kind::List),
        Key::new("kube_namespace", "SCIENCE_AGENT_ROUTER_KUBE_NAMESPACE", Kind::Text),
        Key::new("runner_host", "SCIENCE_AGENT_RUNNER_HOST", Kind::Text),
        Key::new("runner_port", "SCIENCE_AGENT_RUNNER_PORT", Kind::Integer),
        Key::new("runner_token_file", "SCIENCE_AGENT_RUNNER_TOKEN_FILE", Kind::Text),
        Key::new("data_dir", "SCIENCE_AGENT_DATA_DIR", Kind::Text),
        Key::new("sample", "SCIENCE_AGENT_ROUTER_SAMPLE", Kind::Integer),
        Key::new("load_interval_ms", "SCIENCE_AGENT_ROUTER_LOAD_INTERVAL_MS", Kind::Integer),
        Key::new("lost_grace_secs", "SCIENCE_AGENT_ROUTER_LOST_GRACE_SECS", Kind::Integer),
        Key::new("execution_signature_max_age_ms", SIGNATURE_MAX_AGE, Kind::Integer),
        Key::new("log_level", common::audit::LEVEL_VAR, Kind::Text),
        Key::new("log_target", common::audit::TARGET_VAR, Kind::Text),
    ],
    refused: &[("runner_token", "put the token in a file and name it with runner_token_file")],
};

/// A setting's value that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("{name}: {value:?} is not {expected}")]
    Invalid { name: String, value: String, expected: &'static str },
    #[error("no nodes: set {nodes} (static) or {services} (Kubernetes)")]
    NoNodes { nodes: &'static str, services: &'static str },
    #[error("{nodes} and {services} are both set: choose one source of nodes")]
    BothSources { nodes: &'static str, services: &'static str },
    #[error("the settings could not be read from the file")]
    Settings,
}

impl daemon::Usage for ConfigError {
    fn is_usage(&self) -> bool {
        false
    }
}

fn invalid(name: &str, value: &str, expected: &'static str) -> ConfigError {
    ConfigError::Invalid { name: name.to_owned(), value: value.to_owned(), expected }
}

/// `[POOL=]VALUE` items of a comma-separated list; `value_ok` checks each value.
fn pooled(
    name: &str,
    text: &str,
    default_pool: Option<Pool>,
    expected: &'static str,
    value_ok: impl Fn(&str) -> Option<String>,
) -> Result<Vec<(Pool, String)>, ConfigError> {
    let mut out: Vec<(Pool, String)> = Vec::new();
    for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (pool, value) = match item.split_once('=') {
            Some((p, v)) => (Pool::parse(p.trim()).ok_or_else(|| invalid(name, item, expected))?, v.trim()),
            None => (default_pool.ok_or_else(|| invalid(name, item, expected))?, item),
        };
        let value = value_ok(value).ok_or_else(|| invalid(name, item, expected))?;
        if !out.iter().any(|(_, v)| *v == value) {
            out.push((pool, value));
        }
    }
    Ok(out)
}

/// A node URL as the router keeps it: `http://host:port`, no path, no trailing slash.
pub fn node_url(text: &str) -> Option<String> {
    let rest = text.strip_prefix("http://")?.trim_end_matches('/');
    let ok = !rest.is_empty()
        && !rest.contains(['/', '?', '#', '@', ' '])
        && rest.rsplit_once(':').is_none_or(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0));
    ok.then(|| format!("http://{rest}"))
}

/// A Kubernetes object name (RFC 1123 label).
fn dns_label(text: &str) -> Option<String> {
    let ok = (1..=63).contains(&text.len())
        && text.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !text.starts_with('-')
        && !text.ends_with('-');
    ok.then(|| text.to_owned())
}

/// Flags over `var` (the environment over the file) over the defaults.
pub fn resolve(args: &Args, var: impl Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
    let get = |key: &str| -> Option<(String, String)> {
        let (_, flag, name) = SETTINGS.iter().find(|(k, _, _)| *k == key)?;
        let flagged =
            args.flags.iter().rev().find(|(f, _)| f == flag).map(|(_, v)| ((*flag).to_owned(), v.clone()));
        flagged.or_else(|| var(name).filter(|v| !v.trim().is_empty()).map(|v| ((*name).to_owned(), v)))
    };
    let number = |key: &str, default: u64, min: u64, max: u64| -> Result<u64, ConfigError> {
        match get(key) {
            None => Ok(default),
            Some((name, v)) => parse_non_negative(&v)
                .filter(|n| (min..=max).contains(n))
                .ok_or_else(|| invalid(&name, &v, "an integer in range")),
        }
    };
    let (nodes_var, services_var) = ("SCIENCE_AGENT_ROUTER_NODES", "SCIENCE_AGENT_ROUTER_KUBE_SERVICES");
    let membership = match (get("nodes"), get("kube_services")) {
        (Some(_), Some(_)) => {
            return Err(ConfigError::BothSources { nodes: nodes_var, services: services_var });
        }
        (None, None) => return Err(ConfigError::NoNodes { nodes: nodes_var, services: services_var }),
        (Some((name, v)), None) => {
            let nodes = pooled(&name, &v, Some(Pool::Cpu), "[POOL=]http://HOST:PORT, …", node_url)?;
            if nodes.is_empty() {
                return Err(invalid(&name, &v, "[POOL=]http://HOST:PORT, …"));
            }
            Membership::Static(nodes)
        }
        (None, Some((name, v))) => {
            let services = pooled(&name, &v, None, "POOL=SERVICE, …", dns_label)?;
            if services.is_empty() {
                return Err(invalid(&name, &v, "POOL=SERVICE, …"));
            }
            let namespace = match get("kube_namespace") {
                None => None,
                Some((n, ns)) => {
                    Some(dns_label(ns.trim()).ok_or_else(|| invalid(&n, &ns, "a namespace name"))?)
                }
            };
            Membership::Kube { services, namespace }
        }
    };
    let port = number("runner_port", u64::from(DEFAULT_PORT), 0, 65535)?;
    let grace = number("lost_grace_secs", DEFAULT_LOST_GRACE_SECS, 0, 30 * 86_400)?;
    let max_age = match var(SIGNATURE_MAX_AGE).filter(|v| !v.trim().is_empty()) {
        None => runnerd::config::DEFAULT_SIGNATURE_MAX_AGE_MS,
        Some(v) => {
            parse_non_negative(&v).ok_or_else(|| invalid(SIGNATURE_MAX_AGE, &v, "a non-negative integer"))?
        }
    };
    Ok(Config {
        host: get("runner_host").map_or_else(|| "127.0.0.1".to_owned(), |(_, v)| v.trim().to_owned()),
        port: u16::try_from(port).unwrap_or(DEFAULT_PORT),
        token_file: get("runner_token_file").map(|(_, v)| PathBuf::from(v.trim())),
        data_dir: get("data_dir")
            .map_or_else(|| "/var/lib/sciencediscovery".into(), |(_, v)| v.trim().into()),
        membership,
        sample: usize::try_from(number("sample", DEFAULT_SAMPLE as u64, 1, 16)?).unwrap_or(DEFAULT_SAMPLE),
        load_interval: Duration::from_millis(number(
            "load_interval_ms",
            DEFAULT_LOAD_INTERVAL_MS,
            100,
            600_000,
        )?),
        lost_grace: (grace > 0).then(|| Duration::from_secs(grace)),
        signature_max_age_ms: max_age,
    })
}

pub type LoadError = daemon::LoadError<ConfigError>;

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
    let config = resolve(&args, |k| settings.var(k)).map_err(|e| match e {
        ConfigError::Invalid { name, value, expected } => {
            ConfigError::Invalid { name: settings.describe(&name), value, expected }
        }
        other => other,
    });
    let config = config.map_err(daemon::LoadError::Value)?;
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
        let list = |items: &[(Pool, String)]| {
            items.iter().map(|(p, v)| format!("{}={v}", p.name())).collect::<Vec<_>>().join(",")
        };
        SCHEMA
            .keys
            .iter()
            .map(|k| {
                let value = match (k.name, &c.membership) {
                    ("nodes", Membership::Static(nodes)) => list(nodes),
                    ("kube_services", Membership::Kube { services, .. }) => list(services),
                    ("kube_namespace", Membership::Kube { namespace, .. }) => {
                        namespace.clone().unwrap_or_else(|| "the client's default".into())
                    }
                    ("nodes" | "kube_services" | "kube_namespace", _) => "-".into(),
                    ("runner_host", _) => c.host.clone(),
                    ("runner_port", _) => c.port.to_string(),
                    ("runner_token_file", _) => {
                        c.token_file.as_ref().map_or("unset".into(), |p| p.display().to_string())
                    }
                    ("data_dir", _) => c.data_dir.display().to_string(),
                    ("sample", _) => c.sample.to_string(),
                    ("load_interval_ms", _) => c.load_interval.as_millis().to_string(),
                    ("lost_grace_secs", _) => {
                        c.lost_grace.map_or("0 (never restore elsewhere)".into(), |d| d.as_secs().to_string())
                    }
                    ("execution_signature_max_age_ms", _) => c.signature_max_age_ms.to_string(),
                    ("log_level", _) => self.log.level_name().to_owned(),
                    ("log_target", _) => self.log.target_name().to_owned(),
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

    fn vars(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |k| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| (*v).to_owned())
    }

    #[test]
    fn static_nodes_with_pools_and_defaults() {
        let c = resolve(
            &args(&["--nodes", "http://10.0.0.2:4311/, nvidia=http://h:1,http://10.0.0.2:4311"]),
            |_| None,
        )
        .unwrap();
        assert_eq!(
            c.membership,
            Membership::Static(vec![
                (Pool::Cpu, "http://10.0.0.2:4311".into()),
                (Pool::Nvidia, "http://h:1".into())
            ])
        );
        assert_eq!((c.host.as_str(), c.port, c.sample), ("127.0.0.1", 4311, 2));
        assert_eq!((c.load_interval, c.lost_grace), (Duration::from_secs(2), Some(Duration::from_secs(600))));
        assert_eq!(c.data_dir, PathBuf::from("/var/lib/sciencediscovery"));
    }

    #[test]
    fn kubernetes_services_and_namespace() {
        let c = resolve(
            &args(&[]),
            vars(&[
                ("SCIENCE_AGENT_ROUTER_KUBE_SERVICES", "cpu=runner-node-cpu,ascend=runner-node-ascend"),
                ("SCIENCE_AGENT_ROUTER_KUBE_NAMESPACE", "sciencediscovery"),
                ("SCIENCE_AGENT_ROUTER_LOST_GRACE_SECS", "0"),
                ("SCIENCE_AGENT_RUNNER_PORT", "8080"),
            ]),
        )
        .unwrap();
        assert_eq!(
            c.membership,
            Membership::Kube {
                services: vec![
                    (Pool::Cpu, "runner-node-cpu".into()),
                    (Pool::Ascend, "runner-node-ascend".into())
                ],
                namespace: Some("sciencediscovery".into())
            }
        );
        assert_eq!((c.port, c.lost_grace), (8080, None));
    }

    #[test]
    fn the_shipped_example_is_valid() {
        let example =
            concat!(env!("CARGO_MANIFEST_DIR"), "/../../packaging/config/runner-router.toml.example");
        let loaded = load(args(&["--config", example]), |_| None).unwrap();
        assert_eq!(
            loaded.config.membership,
            Membership::Static(vec![
                (Pool::Cpu, "http://10.0.0.2:4311".into()),
                (Pool::Cpu, "http://10.0.0.3:4311".into())
            ])
        );
        assert_eq!(loaded.origin("nodes"), Origin::File { path: example.into(), line: 18 });
    }

    #[test]
    fn refusals_name_the_setting() {
        let cases: &[(&[&str], &str)] = &[
            (&[], "no nodes"),
            (&["--nodes", "http://a:1", "--kube-services", "cpu=s"], "both set"),
            (&["--nodes", "https://a:1"], "--nodes"),
            (&["--nodes", "http://a:1/path"], "--nodes"),
            (&["--nodes", "http://user@a:1"], "--nodes"),
            (&["--nodes", "gpu=http://a:1"], "--nodes"),
            (&["--nodes", "http://a:0"], "--nodes"),
            (&["--kube-services", "runner-node-cpu"], "--kube-services"),
            (&["--kube-services", "cpu=Bad_Name"], "--kube-services"),
            (&["--nodes", "http://a:1", "--sample", "0"], "--sample"),
            (&["--nodes", "http://a:1", "--port", "70000"], "--port"),
            (&["--nodes", "http://a:1", "--load-interval-ms", "5"], "--load-interval-ms"),
        ];
        for (a, want) in cases {
            let e = resolve(&args(a), |_| None).unwrap_err().to_string();
            assert!(e.contains(want), "{a:?}: {e}");
        }
    }
}
