//! npu-brokerd: the host NPU broker (R-NPU-5). Off unless runnerd is configured with
//! `SCIENCE_AGENT_NPU_BROKER`; when on, runnerd forwards the original's `/npu/workloads`
//! and `/npu/jobs…` routes here over a Unix socket. It runs only allowlisted workloads,
//! each with a fixed argv from the whitelist, no shell, in the host namespace (the NPU
//! driver and toolkit live there), as its own unprivileged user, one job at a time.
//!
//! * [`config`]: flags, variables and the configuration file.
//! * [`workloads`]: the whitelist and its validation; [`template`]: its expressions.
//! * [`af3`]: AlphaFold3 intent refusal; [`environ`]: a job's filtered environment.
//! * [`jobs`]: job records and their durable store; [`broker`]: queue, runs, cancel.
//! * [`control`]: the SO_PEERCRED-checked control socket; [`confine`]: self-confinement.

pub mod af3;
pub mod broker;
pub mod config;
pub mod confine;
pub mod control;
pub mod environ;
pub mod jobs;
pub mod template;
pub(crate) use common::timefmt;
pub mod workloads;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use anyhow::Context;

use common::audit::{LogSettings, Sink};
use common::daemon::{self, Args, Daemon};
use common::settings::{Row, render};
use config::{Config, Loaded};

pub fn version() -> String {
    env!("CARGO_PKG_VERSION").to_owned()
}

/// Entry point of the `npu-brokerd` binary; returns the exit status.
pub fn run() -> i32 {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    daemon::run::<NpuBrokerd>(&argv)
}

/// npu-brokerd in the daemons' start-up scaffold.
#[derive(Debug)]
pub struct NpuBrokerd;

impl Daemon for NpuBrokerd {
    const NAME: &'static str = "npu-brokerd";
    const USAGE: &'static str = config::USAGE;
    const GRAMMAR: daemon::Grammar = config::GRAMMAR;
    const FAILED_EVENT: Option<&'static str> = Some("npu_brokerd_failed");
    type Loaded = Loaded;
    type ValueError = std::convert::Infallible;
    type Prepared = Prepared;
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

    fn prepare(_: &Args, loaded: &Loaded) -> anyhow::Result<Prepared> {
        prepare(loaded)
    }

    fn check(_: &Args, loaded: &Loaded, prepared: &Prepared) -> anyhow::Result<String> {
        Ok(check(loaded, prepared))
    }

    fn serve(_: Args, loaded: Loaded, prepared: Prepared, sink: Option<Sink>) -> anyhow::Result<i32> {
        tracing::info!(event = "config_loaded", version = %version(), config_file = %loaded.settings.file_status(), log_sink = %daemon::sink_name(sink));
        serve(loaded, prepared).map(|()| 0)
    }
}

/// What start-up validates before it touches anything.
#[derive(Debug)]
pub struct Prepared {
    pub runner_uid: u32,
    pub socket_gid: Option<u32>,
    pub workloads: Vec<workloads::Workload>,
    pub workload_config: String,
}

fn prepare(loaded: &Loaded) -> anyhow::Result<Prepared> {
    let cfg = &loaded.config;
    let runner_uid = match cfg.runner_uid.as_deref() {
        None => nix::unistd::getuid().as_raw(),
        Some(v) => match v.parse::<u32>() {
            Ok(uid) => uid,
            Err(_) => nix::unistd::User::from_name(v)
                .ok()
                .flatten()
                .map(|u| u.uid.as_raw())
                .with_context(|| format!("runner_uid: there is no user named {v:?}"))?,
        },
    };
    let socket_gid = match cfg.socket_group.as_deref() {
        None => None,
        Some(v) => Some(match v.parse::<u32>() {
            Ok(gid) => gid,
            Err(_) => nix::unistd::Group::from_name(v)
                .ok()
                .flatten()
                .map(|g| g.gid.as_raw())
                .with_context(|| format!("socket_group: there is no group named {v:?}"))?,
        }),
    };
    let (workloads, workload_config) = match &cfg.workload_config {
        None => (workloads::defaults(), "built-in defaults".to_owned()),
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("could not read the workload whitelist {}", path.display()))?;
            let list = workloads::parse(&text)
                .with_context(|| format!("the workload whitelist {} is invalid", path.display()))?;
            (list, path.display().to_string())
        }
    };
    Ok(Prepared { runner_uid, socket_gid, workloads, workload_config })
}

fn check(loaded: &Loaded, p: &Prepared) -> String {
    let ids: Vec<&str> = p.workloads.iter().map(|w| w.id.as_str()).collect();
    let checks = [
        Row::new("runner uid", p.runner_uid.to_string(), ""),
        Row::new("socket", p.socket_gid.map_or("0600".to_owned(), |g| format!("0660, gid {g}")), ""),
        Row::new("workloads", format!("{} ({})", ids.join(", "), p.workload_config), ""),
        Row::new("job state", config_state_file(&loaded.config), ""),
    ];
    format!(
        "npu-brokerd configuration is valid.\nconfiguration file: {}\nsettings (value, origin):\n{}checks:\n{}",
        loaded.settings.file_status(),
        render(&loaded.rows()),
        render(&checks)
    )
}

fn config_state_file(cfg: &Config) -> String {
    jobs::Store::new(&cfg.state_dir).path.display().to_string()
}

fn bind_control(path: &Path, gid: Option<u32>) -> anyhow::Result<std::os::unix::net::UnixListener> {
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
    if let Some(gid) = gid {
        nix::unistd::chown(path, None, Some(nix::unistd::Gid::from_raw(gid)))
            .with_context(|| format!("could not give {} to gid {gid}", path.display()))?;
    }
    let mode = if gid.is_some() { 0o660 } else { 0o600 };
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

fn serve(loaded: Loaded, p: Prepared) -> anyhow::Result<()> {
    let cfg = loaded.config.clone();
    let store = jobs::Store::new(&cfg.state_dir);
    let now = timefmt::now_iso();
    let found = store.load(&now).context("could not load the NPU job state")?;
    if let Some((why, aside)) = &found.set_aside {
        tracing::warn!(event = "npu_state_unreadable", error = %why, moved_to = %aside.display(), "the job state file could not be read; starting with no jobs");
    }
    for id in &found.interrupted {
        tracing::info!(event = "npu_job_interrupted", job_id = %id, error = jobs::INTERRUPTED);
    }
    let repo_root = std::fs::canonicalize(&cfg.repo_root).unwrap_or_else(|_| cfg.repo_root.clone());
    let settings = loaded.settings;
    let template_env = move |k: &str| settings.var(k);
    let broker_settings = broker::Settings {
        workloads: p.workloads,
        workload_config: p.workload_config,
        data_dir: cfg.data_dir.clone(),
        repo_root,
        python: cfg.python.clone(),
        template_env: Box::new(template_env),
        host_env: std::env::vars().collect(),
    };
    let listener = bind_control(&cfg.control_socket, p.socket_gid)?;
    let control_dir = cfg.control_socket.parent().unwrap_or(Path::new("/")).to_owned();
    // Landlock binds the calling thread and its future children: confine before the
    // runtime starts its workers.
    let confinement = if cfg.confine {
        // runnerd makes its workspace roots lazily: until one exists, the data directory
        // stands in for it (a rule needs an existing directory).
        let [projects, remote] = common::layout::workspace_roots(&cfg.data_dir)
            .map(|dir| if dir.is_dir() { dir } else { cfg.data_dir.clone() });
        let writable =
            [cfg.state_dir.clone(), projects, remote, control_dir.clone(), "/dev".into(), "/tmp".into()];
        let refs: Vec<&Path> = writable.iter().map(|p| p.as_path()).collect();
        confine::apply(&refs).context("npu-brokerd could not confine itself")?
    } else {
        confine::skipped()
    };
    tracing::info!(
        event = "confinement_applied",
        landlock = %confinement.landlock,
        seccomp = confinement.seccomp,
        no_new_privs = confinement.no_new_privs,
    );
    let broker = broker::Broker::new(broker_settings, store, found.jobs, confinement);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("could not start the async runtime")?;
    runtime.block_on(async move {
        let listener = tokio::net::UnixListener::from_std(listener)?;
        let worker = tokio::spawn(broker.clone().work());
        tracing::info!(
            event = "npu_brokerd_started",
            version = %version(),
            control_socket = %cfg.control_socket.display(),
            runner_uid = p.runner_uid,
            state_file = %config_state_file(&cfg),
        );
        if let Err(e) = common::systemd::notify("READY=1\nSTATUS=serving NPU jobs") {
            tracing::warn!(event = "notify_failed", error = %e);
        }
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            _ = control::serve(listener, broker.clone(), p.runner_uid) => {}
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        worker.abort();
        let _ = worker.await;
        broker.kill_running();
        let _ = std::fs::remove_file(&cfg.control_socket);
        tracing::info!(event = "npu_brokerd_stopped");
        anyhow::Ok(())
    })
}
