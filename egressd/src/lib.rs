//! egressd: the egress gateway daemon (R-NET-3). Sandboxes have no network interface; the
//! only way out is a Unix socket bound into them, served here by a domain-allowlisting HTTP
//! proxy: one gateway per policy (its content-derived identity), one socket per sandbox. It runs as its own unprivileged user, so a proxy bug
//! cannot reach runnerd's token or workspaces, and confines itself once its sockets exist.
//!
//! * [`config`]: flags, variables and the configuration file.
//! * [`control`]: the control socket runnerd uses (SO_PEERCRED-checked).
//! * [`registry`]: gateways per policy, a socket and connection slots per lease, reaping.
//! * [`proxy`]: the HTTP proxy on each gateway (decision, forwarding, tunnels).
//! * [`dns`]: the stub resolver (no getaddrinfo).
//! * [`own`]: this host's addresses, refused as destinations.
//! * [`confine`]: no_new_privs, landlock, seccomp.
//! * [`bridge`]: the in-sandbox end (`egress-bridge` binary).

pub mod bench;
pub mod bridge;
pub mod config;
pub mod confine;
pub mod control;
pub mod dns;
pub mod own;
pub mod proxy;
pub mod registry;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;

use common::audit::{LogSettings, Sink};
use common::daemon::{self, Args, Daemon};
use common::settings::{Origin, Row, render};
use config::{Config, Loaded, UserSpec};
use dns::{HostsResolver, ResolverConfig, StubResolver};
use registry::{Registry, SocketAccess};

/// `<crate version> (<commit>)`.
pub fn version() -> String {
    env!("CARGO_PKG_VERSION").to_owned()
}

/// Entry point of the `egressd` binary; returns the exit status.
pub fn run() -> i32 {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    daemon::run::<Egressd>(&argv)
}

/// egressd in the daemons' start-up scaffold. Flags over variables over the configuration
/// file; errors name the key and the file. A bad command line exits 2 (usage), a bad
/// configuration 1.
#[derive(Debug)]
pub struct Egressd;

impl Daemon for Egressd {
    const NAME: &'static str = "egressd";
    const USAGE: &'static str = config::USAGE;
    const GRAMMAR: daemon::Grammar = config::GRAMMAR;
    const FAILED_EVENT: Option<&'static str> = Some("egressd_failed");
    type Loaded = Loaded;
    type ValueError = config::ConfigError;
    type Prepared = ();
    type Error = anyhow::Error;

    fn version() -> String {
        version()
    }

    fn load(args: &Args) -> Result<Loaded, config::LoadError> {
        config::load(args.clone(), |k| std::env::var(k).ok())
    }

    fn log_settings(loaded: &Loaded) -> &LogSettings {
        &loaded.log
    }

    fn prepare(_: &Args, loaded: &Loaded) -> anyhow::Result<()> {
        check_names(loaded).map(|_| ())
    }

    fn check(_: &Args, loaded: &Loaded, (): &()) -> anyhow::Result<String> {
        check(loaded)
    }

    fn serve(_: Args, loaded: Loaded, (): (), sink: Option<Sink>) -> anyhow::Result<i32> {
        let config_file = loaded.settings.file_status();
        serve(loaded.config, sink, config_file).map(|()| 0)
    }
}

/// The runner user and the socket group exist, with the setting named where it was set.
fn check_names(loaded: &Loaded) -> anyhow::Result<(u32, Option<u32>)> {
    let named = |key: &str| match loaded.origin(key) {
        Origin::File { path, line } => format!("{key} in {}:{line}", path.display()),
        Origin::Environment(var) => var,
        Origin::Flag(flag) => flag,
        Origin::Default => key.to_owned(),
    };
    let uid =
        uid_of(&loaded.config.runner_uid).with_context(|| format!("checking {}", named("runner_uid")))?;
    let gid =
        gid_of(&loaded.config.socket_group).with_context(|| format!("checking {}", named("socket_group")))?;
    Ok((uid, gid))
}

fn uid_of(spec: &Option<UserSpec>) -> anyhow::Result<u32> {
    match spec {
        None => Ok(nix::unistd::getuid().as_raw()),
        Some(UserSpec::Uid(uid)) => Ok(*uid),
        Some(UserSpec::Name(name)) => nix::unistd::User::from_name(name)
            .ok()
            .flatten()
            .map(|u| u.uid.as_raw())
            .with_context(|| format!("there is no user named {name:?}")),
    }
}

fn gid_of(group: &Option<String>) -> anyhow::Result<Option<u32>> {
    let Some(name) = group else { return Ok(None) };
    if let Ok(gid) = name.parse::<u32>() {
        return Ok(Some(gid));
    }
    nix::unistd::Group::from_name(name)
        .ok()
        .flatten()
        .map(|g| Some(g.gid.as_raw()))
        .with_context(|| format!("there is no group named {name:?}"))
}

fn resolver_config(cfg: &Config) -> anyhow::Result<ResolverConfig> {
    if !cfg.nameservers.is_empty() {
        return Ok(ResolverConfig::with_nameservers(cfg.nameservers.clone()));
    }
    ResolverConfig::from_resolv_conf(&cfg.resolv_conf)
        .with_context(|| format!("could not read the DNS servers from {}", cfg.resolv_conf.display()))
}

/// `--check-config`: everything `serve` validates before it touches the filesystem, and
/// each setting with where it came from.
fn check(loaded: &Loaded) -> anyhow::Result<String> {
    let cfg = &loaded.config;
    let (uid, gid) = check_names(loaded)?;
    registry::check_path_length(&cfg.runtime_dir)?;
    let dns = resolver_config(cfg)?;
    let checks = [
        Row::new("runner uid", uid.to_string(), ""),
        Row::new("control socket", gid.map_or("0600".to_owned(), |g| format!("0660, gid {g}")), ""),
        Row::new(
            "lease sockets",
            format!(
                "{}/eg/<16 hex>, one per sandbox, 0600 (0622 for another sandbox uid)",
                cfg.runtime_dir.display()
            ),
            "",
        ),
        Row::new(
            "nameservers",
            dns.nameservers.iter().map(|a| a.to_string()).collect::<Vec<_>>().join(", "),
            "",
        ),
        Row::new(
            "confinement",
            if cfg.confine { "landlock + seccomp + no_new_privs" } else { "off (--no-confine)" },
            "",
        ),
    ];
    Ok(format!(
        "egressd configuration is valid.\nconfiguration file: {}\nsettings (value, origin):\n{}checks:\n{}",
        loaded.settings.file_status(),
        render(&loaded.rows()),
        render(&checks),
    ))
}

fn bind_control(path: &Path, access: SocketAccess) -> anyhow::Result<std::os::unix::net::UnixListener> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).with_context(|| format!("could not create {}", parent.display()))?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) if std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()) => std::fs::remove_file(path)?,
        Ok(_) => anyhow::bail!("{} exists and is not a socket; refusing to replace it", path.display()),
        Err(_) => {}
    }
    let listener = std::os::unix::net::UnixListener::bind(path)
        .with_context(|| format!("could not listen on the control socket {}", path.display()))?;
    access.apply(path, false)?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

fn serve(cfg: Config, sink: Option<Sink>, config_file: String) -> anyhow::Result<()> {
    let runner_uid = uid_of(&cfg.runner_uid)?;
    let access = SocketAccess { group: gid_of(&cfg.socket_group)? };
    let dns = resolver_config(&cfg)?;
    log_config(&cfg, sink, &config_file, runner_uid, access, &dns);
    let resolver = HostsResolver::new(cfg.hosts_file.clone(), StubResolver::new(dns));
    let shared = Arc::new(proxy::Shared {
        resolver: Arc::new(resolver),
        own: own::OwnAddresses::default(),
        header_timeout: cfg.header_timeout,
        connect_timeout: cfg.connect_timeout,
        dns_timeout: Duration::from_secs(5),
        tunnel_idle: cfg.tunnel_idle,
    });
    let registry = Arc::new(Registry::new(cfg.runtime_dir.clone(), access, cfg.max_tunnels, shared)?);
    let listener = bind_control(&cfg.control_socket, access)?;
    let confinement = confine_self(&cfg, &registry)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("could not start the async runtime")?;
    runtime.block_on(serve_control(cfg, registry, listener, runner_uid, confinement))
}

/// The effective settings (egressd holds no secret), once resolved.
fn log_config(
    cfg: &Config,
    sink: Option<Sink>,
    config_file: &str,
    runner_uid: u32,
    access: SocketAccess,
    dns: &ResolverConfig,
) {
    let ms = |d: Duration| d.as_millis() as u64;
    tracing::info!(
        event = "config_loaded",
        version = %version(),
        config_file = %config_file,
        control_socket = %cfg.control_socket.display(),
        runtime_dir = %cfg.runtime_dir.display(),
        runner_uid,
        socket_group = %access.group.map_or("none (sockets 0600)".to_owned(), |g| format!("gid {g} (sockets 0660)")),
        nameservers = %dns.nameservers.iter().map(ToString::to_string).collect::<Vec<_>>().join(","),
        hosts_file = %cfg.hosts_file.display(),
        max_tunnels = cfg.max_tunnels,
        tunnel_idle_ms = ms(cfg.tunnel_idle),
        header_timeout_ms = ms(cfg.header_timeout),
        connect_timeout_ms = ms(cfg.connect_timeout),
        gateway_idle_ms = ms(cfg.gateway_idle),
        confine = cfg.confine,
        log_sink = %daemon::sink_name(sink),
    );
}

/// Landlock binds the calling thread and its future children: this runs before the
/// runtime starts its workers.
fn confine_self(cfg: &Config, registry: &Registry) -> anyhow::Result<common::confine::Confinement> {
    let control_dir = cfg.control_socket.parent().unwrap_or(Path::new("/")).to_owned();
    let confinement = if cfg.confine {
        confine::apply(&registry.gateway_dir(), &control_dir, &cfg.hosts_file)
            .context("egressd could not confine itself")?
    } else {
        confine::skipped()
    };
    tracing::info!(
        event = "confinement_applied",
        landlock = %confinement.landlock,
        seccomp = confinement.seccomp,
        no_new_privs = confinement.no_new_privs,
    );
    Ok(confinement)
}

/// Serves the control socket until SIGTERM or Ctrl-C, reaping idle gateways meanwhile;
/// then closes every gateway and removes the socket.
async fn serve_control(
    cfg: Config,
    registry: Arc<Registry>,
    listener: std::os::unix::net::UnixListener,
    runner_uid: u32,
    confinement: common::confine::Confinement,
) -> anyhow::Result<()> {
    let listener = tokio::net::UnixListener::from_std(listener)?;
    let control = Arc::new(control::Control { registry: registry.clone(), runner_uid, confinement });
    tracing::info!(
        event = "egressd_started",
        version = %version(),
        control_socket = %cfg.control_socket.display(),
        gateway_dir = %registry.gateway_dir().display(),
        runner_uid,
    );
    if let Err(e) = common::systemd::notify("READY=1\nSTATUS=serving gateways") {
        tracing::warn!(event = "notify_failed", error = %e);
    }
    let reaper = {
        let registry = registry.clone();
        let idle = cfg.gateway_idle;
        tokio::spawn(async move {
            let tick = (idle / 4).clamp(Duration::from_millis(50), Duration::from_secs(30));
            loop {
                tokio::time::sleep(tick).await;
                registry.reap(idle);
            }
        })
    };
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = control::serve(listener, control) => {}
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    reaper.abort();
    registry.close_all();
    let _ = std::fs::remove_file(&cfg.control_socket);
    tracing::info!(event = "egressd_stopped");
    anyhow::Ok(())
}
