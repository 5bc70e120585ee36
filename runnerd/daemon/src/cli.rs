//! The `runnerd` command line.

use std::io::Write;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::Context;

use common::audit::Sink;
use common::daemon::{self, ArgError, Args, Blank, Daemon, Grammar};

use crate::app::{App, runner_version};
use crate::config::{self, Loaded, RunnerConfig};
use crate::http::{self, Listener};
use crate::managed::Manager;
use crate::startup::{self, SandboxConfig, SandboxRuntime};
use crate::token::{self, Fallback};
use crate::writer::Versions;

const USAGE: &str = "\
runnerd: the ScienceDiscovery code runner (bubblewrap + seccomp sandboxes for agents).

Usage:
  runnerd [serve] [--dev] [--insecure-default-token] [--config PATH]
                       serve the HTTP API (127.0.0.1:4311 unless configured)
      --dev            development start: generate a random token into
                       <data dir>/runner-token (0600) when none is configured; as
                       root, sandboxes run as nobody unless a user is configured
      --insecure-default-token
                       accept the original's well-known token when none is
                       configured (local compatibility tests only)
  runnerd --check-config [--config PATH] [--dev | --insecure-default-token]
                       validate everything start-up validates (settings, token, listen
                       address, bubblewrap, sandbox-init, seccomp) without binding or
                       writing; print each setting and where it came from; exit 0 or 1
  runnerd preflight    check bubblewrap, probe the sandbox form this host allows, publish
                       the seccomp programs, and print the conclusions as JSON
  runnerd selftest     preflight, then run one real sandbox and check what it printed
                       (for deploy scripts: exit status 0 means executions will work)
  runnerd --help | --version

Configuration: variables override the file, the file overrides the defaults.
  --config PATH        the configuration file (TOML) [SCIENCE_AGENT_CONFIG, default
                       /etc/sciencediscovery/runnerd.toml; that one may be absent]
  Its keys are the variables' names, lower-cased, without SCIENCE_AGENT_ (runner_port =
  4311); the README lists every one. The token never goes in the file.
  SCIENCE_AGENT_RUNNER_HOST / _PORT / _SOCKET   where to listen (default 127.0.0.1:4311)
  SCIENCE_AGENT_RUNNER_TOKEN / _TOKEN_FILE      the token (or $CREDENTIALS_DIRECTORY/runner-token)
  SCIENCE_AGENT_DATA_DIR                        data directory (default .sciencediscovery-data)
  SCIENCE_AGENT_BWRAP_PATH                      bubblewrap (default: bwrap in PATH)
  SCIENCE_AGENT_SANDBOX_USER                    user[:group] or uid[:gid] sandboxes run as when
                                                runnerd is root (never root itself)
";

/// `--config PATH`, for every sub-command (the selftest and the benchmark load through
/// [`sandbox_config_from_env`]). Unset: `SCIENCE_AGENT_CONFIG`, else the default file.
static CONFIG_FILE: OnceLock<PathBuf> = OnceLock::new();

/// The settings from the environment over the configuration file.
pub fn load_config() -> Result<Loaded, config::LoadError> {
    config::load(CONFIG_FILE.get().map(PathBuf::as_path), |k| std::env::var(k).ok())
}

/// runnerd's command line: sub-commands and two switches, no setting flags (settings come
/// from the variables and the file). Only `--config` takes a value, and only it is split at
/// `=`; an error prints the usage after it.
pub const GRAMMAR: Grammar = Grammar {
    daemon: "runnerd",
    help: &["--help", "-h", "help"],
    switches: &["serve", "preflight", "selftest", "--dev", "--insecure-default-token"],
    settings: &[],
    split_every_flag: false,
    blank: Blank::Verbatim,
};

/// The sub-commands; the last one given counts, `serve` when none is.
const COMMANDS: [&str; 3] = ["serve", "preflight", "selftest"];

/// Entry point of the `runnerd` binary; returns the process exit status.
pub fn run() -> i32 {
    // Before any thread exists: glibc makes its arenas per thread.
    crate::memory::configure();
    let args: Vec<String> = std::env::args().skip(1).collect();
    daemon::run::<Runnerd>(&args)
}

/// runnerd in the daemons' start-up scaffold.
#[derive(Debug)]
pub struct Runnerd;

/// What runnerd starts before it checks or serves: the async runtime everything runs on.
#[derive(Debug)]
pub struct Started {
    runtime: tokio::runtime::Runtime,
}

fn fallback(args: &Args) -> Fallback {
    match (args.switched("--dev"), args.switched("--insecure-default-token")) {
        (_, true) => Fallback::WellKnown,
        (true, false) => Fallback::Generate,
        (false, false) => Fallback::None,
    }
}

impl Daemon for Runnerd {
    const NAME: &'static str = "runnerd";
    const USAGE: &'static str = USAGE;
    const GRAMMAR: Grammar = GRAMMAR;
    const FAILED_EVENT: Option<&'static str> = None;
    type Loaded = Loaded;
    type ValueError = config::ConfigError;
    type Prepared = Started;
    type Error = anyhow::Error;

    fn version() -> String {
        format!("{} ({})", env!("CARGO_PKG_VERSION"), runner_version())
    }

    fn usage_error(e: &ArgError) -> String {
        match e {
            ArgError::Unknown { arg, .. } => format!("runnerd: unknown argument {arg:?}\n\n{USAGE}"),
            ArgError::MissingValue { flag, .. } | ArgError::Empty { flag } => {
                format!("runnerd: {flag} needs a path\n\n{USAGE}")
            }
        }
    }

    fn load(args: &Args) -> Result<Loaded, config::LoadError> {
        if let Some(path) = &args.config {
            let _ = CONFIG_FILE.set(path.clone());
        }
        load_config()
    }

    fn log_settings(loaded: &Loaded) -> &common::audit::LogSettings {
        &loaded.log
    }

    fn prepare(_: &Args, _: &Loaded) -> anyhow::Result<Started> {
        // 8 MiB stacks: a snapshot recurses once per directory level (up to MAX_DEPTH).
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .thread_stack_size(8 << 20)
            .build()
            .context("cannot start the async runtime")?;
        Ok(Started { runtime })
    }

    /// `--check-config`: the report, or the error.
    fn check(args: &Args, loaded: &Loaded, started: &Started) -> anyhow::Result<String> {
        started.runtime.block_on(crate::check::check(loaded, fallback(args)))
    }

    /// Only `serve` logs: `preflight` and `selftest` print their findings.
    fn logs(args: &Args) -> bool {
        args.last_of(&COMMANDS).unwrap_or("serve") == "serve"
    }

    fn serve(args: Args, loaded: Loaded, started: Started, sink: Option<Sink>) -> anyhow::Result<i32> {
        let dev = args.switched("--dev");
        started.runtime.block_on(async {
            match args.last_of(&COMMANDS).unwrap_or("serve") {
                "preflight" => preflight(&loaded.config, dev).await,
                "selftest" => selftest(&loaded.config, dev).await,
                _ => serve(loaded, sink, fallback(&args), dev).await,
            }
        })
    }
}

fn sandbox_config(config: &RunnerConfig, dev: bool) -> SandboxConfig {
    SandboxConfig {
        bwrap: config.bwrap_path.clone(),
        data_dir: config.data_dir.clone(),
        sandbox_init: startup::locate_sandbox_init(config.sandbox_init.clone()),
        sandbox_user: config.sandbox_user.clone(),
        dev,
        prestart: config.prestart,
        isolation: config.isolation.clone(),
    }
}

/// The sandbox configuration from the `SCIENCE_AGENT_*` variables over the configuration file.
pub fn sandbox_config_from_env(dev: bool) -> anyhow::Result<SandboxConfig> {
    Ok(sandbox_config(&load_config()?.config, dev))
}

async fn prepare(config: &SandboxConfig) -> anyhow::Result<SandboxRuntime> {
    std::fs::create_dir_all(&config.data_dir)
        .with_context(|| format!("creating the data directory {}", config.data_dir.display()))?;
    let runtime = startup::prepare(config).await?;
    for w in &runtime.warnings {
        eprintln!("WARNING: {}", w.text);
        tracing::warn!(event = w.event, detail = %w.text);
    }
    Ok(runtime)
}

/// Raises the soft open-file limit to the hard one: every connection and every launch
/// (five descriptors) counts against it.
fn raise_nofile() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE)
        && soft < hard
    {
        let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
    }
}

/// How long a stopping runnerd waits for managed executions to record their end.
const MANAGED_GRACE: Duration = Duration::from_secs(20);

async fn serve(loaded: Loaded, sink: Option<Sink>, fallback: Fallback, dev: bool) -> anyhow::Result<i32> {
    raise_nofile();
    let mut config = loaded.config;
    std::fs::create_dir_all(&config.data_dir)
        .with_context(|| format!("creating the data directory {}", config.data_dir.display()))?;
    let (token, source) =
        token::resolve(|k| std::env::var(k).ok(), config.token_file.as_deref(), &config.data_dir, fallback)?;
    if let token::TokenSource::Generated(path) = &source {
        eprintln!("runnerd: development token in {} (clients read it from there)", path.display());
    }
    let sandbox = prepare(&sandbox_config(&config, dev)).await?;
    let listener = match (Listener::from_activation()?, &config.socket_path) {
        (Some(activated), _) => activated,
        (None, Some(path)) => Listener::unix(path)?,
        (None, None) => Listener::tcp(&config.host, config.port).await?,
    };
    log_config(&config, &source, &sandbox, sink, &loaded.settings.file_status());
    startup::log_confinement();
    let address = listener.describe();
    // Port 0 asks for any port: unless node_url was set, this node's name is the one it got.
    if config.port == 0
        && config.socket_path.is_none()
        && loaded.settings.origin(crate::replica::settings::NODE_URL_VAR) == common::settings::Origin::Default
        && address.starts_with("http://")
    {
        config.node_url = address.clone();
    }
    let usable = sandbox.capability.sandbox_usable;
    let versions = open_versions(&config).await?;
    let managed = Arc::new(
        Manager::open(&config.data_dir)
            .with_context(|| format!("opening the execution records under {}", config.data_dir.display()))?,
    );
    let limits = detect_limits(&config)?;
    let envs = open_envs(&config, &sandbox)?;
    let replica = crate::replica::connect(config.replica.as_ref(), &config.data_dir, &config.node_url, |k| {
        std::env::var(k).ok()
    })
    .context("setting up replication to the object store")?;
    let app = Arc::new(App::new(config, sandbox, versions, managed, limits, envs, replica));
    let gate = Arc::new(crate::auth::Gate::new(token));
    // Before anyone can learn that runnerd listens: a stop from then on is graceful.
    let signals = StopSignals::register();
    announce(&app, &address, usable)?;
    tracing::info!(event = "listening", address = %address);
    // After listen, in the background: `/health` answers while it runs (contract §4).
    crate::envs::store::EnvStore::start_setup(&app);
    crate::history::History::start(&app);
    crate::transfer::sweep::start(&app);
    if let Some(replica) = &app.replica {
        replica.start(app.shutdown.subscribe());
    }
    // Type=notify: systemd starts dependants (and counts the start as done) only now.
    if let Err(e) = common::systemd::notify(&format!("READY=1\nSTATUS=listening on {address}")) {
        tracing::warn!(event = "notify_failed", error = %e);
    }
    http::serve(app.clone(), gate, listener, shutdown(signals, app.clone())).await;
    app.managed.close(MANAGED_GRACE).await;
    app.limits.remove_spares();
    app.sandbox.forget(crate::isolation::prestart::Scope::All, crate::isolation::prestart::Discard::Stopping);
    tracing::info!(event = "stopped");
    Ok(0)
}

/// The effective start-up settings, once resolved.
fn log_config(
    config: &RunnerConfig,
    source: &token::TokenSource,
    sandbox: &SandboxRuntime,
    sink: Option<Sink>,
    config_file: &str,
) {
    tracing::info!(
        event = "config_loaded",
        data_dir = %config.data_dir.display(),
        token_source = %source,
        bwrap = %sandbox.bwrap.display(),
        sandbox_uid = sandbox.user.uid,
        sandbox_gid = sandbox.user.gid,
        sandbox_user = %sandbox.user.describe(),
        workspace_idmap = %sandbox.idmap.describe(),
        sandbox_usable = sandbox.capability.sandbox_usable,
        proc_mode = ?sandbox.capability.proc_mode,
        disable_userns = sandbox.capability.disable_userns,
        log_sink = %daemon::sink_name(sink),
        config_file = %config_file,
    );
}

/// The workspace version store, once what a previous process left is swept (half-received
/// uploads, skills' staging) and its interrupted writes are recovered.
async fn open_versions(config: &RunnerConfig) -> anyhow::Result<Arc<Versions>> {
    let versions = Versions::open(&config.data_dir).with_context(|| {
        format!("opening the workspace version store under {}", config.data_dir.display())
    })?;
    let versions = Arc::new(versions.with_default_snapshot_limit(config.max_workspace_bytes));
    let swept = crate::api::stream::sweep_staging(&config.data_dir.join(crate::api::remote::STAGING));
    crate::skills::store::sweep_staging(&config.data_dir);
    let staged = crate::transfer::receive::sweep_staging(&config.data_dir);
    if staged > 0 {
        tracing::info!(
            event = "transfers_swept",
            count = staged,
            reason = "trees left staged by a previous process"
        );
    }
    if swept > 0 {
        tracing::info!(
            event = "uploads_swept",
            count = swept,
            reason = "left half-received by a previous process"
        );
    }
    for root in versions.recover_interrupted().await {
        eprintln!("runnerd: recovered the interrupted write of {} (see the audit log)", root.display());
    }
    Ok(versions)
}

/// How resource limits are enforced here (cgroups), logged.
fn detect_limits(config: &RunnerConfig) -> anyhow::Result<crate::limits::Enforcement> {
    let limits = crate::limits::Enforcement::detect(&config.limits)?;
    tracing::info!(
        event = "limits_enforcement",
        cgroup_mode = limits.mode.label(),
        cgroup_root = %limits.root.display(),
        delegated = limits.delegated,
        reasons = %limits.reasons.join("; "),
    );
    Ok(limits)
}

/// The scientific environment store, provisioning with runnerd's own runner-provisioner.
fn open_envs(
    config: &RunnerConfig,
    sandbox: &SandboxRuntime,
) -> anyhow::Result<crate::envs::store::EnvStore> {
    let provisioner =
        crate::startup::locate_helper(config.scientific.provisioner.clone(), "runner-provisioner");
    let envs = crate::envs::store::EnvStore::open(
        &config.data_dir,
        config.scientific.clone(),
        provisioner,
        &sandbox.user,
    )
    .with_context(|| format!("opening the scientific environments under {}", config.data_dir.display()))?;
    if std::env::var_os("SCIENCE_AGENT_PROVISIONER_PATH").is_some() {
        tracing::warn!(
            event = "setting_ignored",
            variable = "SCIENCE_AGENT_PROVISIONER_PATH",
            reason = "runnerd provisions with its own runner-provisioner (SCIENCE_AGENT_RUNNER_PROVISIONER_PATH); no micromamba is used"
        );
    }
    Ok(envs)
}

/// What runnerd prints on stdout once it listens: the address, the sandbox, the limits.
fn announce(app: &App, address: &str, usable: bool) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "ScienceDiscovery runner listening on {address}")?;
    writeln!(
        out,
        "sandbox: bubblewrap ({}) as {}, data dir {}, max workspace {} bytes, max output {} bytes, timeout {} ms",
        if usable { "usable" } else { "UNUSABLE: executions will fail" },
        app.sandbox.user.describe(),
        app.data_dir.display(),
        app.config.max_workspace_bytes,
        app.config.max_output_bytes,
        app.config.exec_timeout_ms,
    )?;
    writeln!(out, "caller-made workspaces: idmapped mounts {}", app.sandbox.idmap.describe())?;
    if let Some(note) = app.managed.startup_note() {
        writeln!(out, "{note}")?;
    }
    out.flush()?;
    Ok(())
}

/// Resolves at the first stop signal, after telling executions to abort; a second signal
/// exits at once.
async fn shutdown(mut signals: StopSignals, stopping: Arc<App>) {
    signals.recv().await;
    tracing::info!(event = "stopping", detail = "aborting executions; a second signal exits at once");
    let _ = stopping.shutdown.send(true);
    tokio::spawn(async move {
        signals.recv().await;
        eprintln!("runnerd: second signal, exiting now");
        std::process::exit(130);
    });
}

/// SIGTERM, SIGINT and SIGHUP, caught from the moment this exists: registered before
/// runnerd says it listens, so a stop right after start-up is graceful, not a kill.
struct StopSignals(Option<[tokio::signal::unix::Signal; 3]>);

impl StopSignals {
    fn register() -> StopSignals {
        use tokio::signal::unix::{SignalKind, signal};
        match (signal(SignalKind::terminate()), signal(SignalKind::interrupt()), signal(SignalKind::hangup()))
        {
            (Ok(term), Ok(int), Ok(hup)) => StopSignals(Some([term, int, hup])),
            _ => StopSignals(None),
        }
    }

    /// The next of the three; never, if they could not be registered.
    async fn recv(&mut self) {
        match &mut self.0 {
            Some([term, int, hup]) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = int.recv() => {}
                    _ = hup.recv() => {}
                }
            }
            None => std::future::pending().await,
        }
    }
}

async fn preflight(config: &RunnerConfig, dev: bool) -> anyhow::Result<i32> {
    let runtime = prepare(&sandbox_config(config, dev)).await?;
    let report = serde_json::json!({
        "bwrap": runtime.bwrap,
        "sandboxInit": runtime.launcher.init_path(),
        "sandboxProfile": runtime.capability,
        "seccompFiles": runtime.seccomp_files,
        "warnings": runtime.warnings.iter().map(|w| w.event).collect::<Vec<_>>(),
    });
    let status = if runtime.capability.sandbox_usable { 0 } else { 1 };
    Ok(common::out::print_status(&format!("{}\n", serde_json::to_string_pretty(&report)?), status))
}

async fn selftest(config: &RunnerConfig, dev: bool) -> anyhow::Result<i32> {
    let runtime = prepare(&sandbox_config(config, dev)).await?;
    crate::selftest::run(&runtime).await
}
