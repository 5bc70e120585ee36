//! One provisioning step (a conda solve and install by `runner-provisioner`, a pip install,
//! an R install, an inventory) run inside one of our sandboxes — never on the host as the
//! original does. The step sees the host's read-only system (`/usr`, the CA store), an empty
//! scratch workspace, and exactly the paths it names ([`Step::binds`], each at its own path:
//! conda prefixes embed it); nothing else of the data directory, never the token. Network,
//! when a step needs it, goes only through egressd to the step's hosts.

use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use common::egress::protocol::GatewayPolicy;
use common::egress::route::ProxySetting;

use crate::app::App;
use crate::isolation::{Bind, Dir, Egress, Job, SandboxSpec, WorkspaceDirs};
use crate::launch::{OutputBudget, Termination};
use crate::sandbox::argv;
use crate::sandbox::{Language, WorkspaceLayout};

use super::cache_growth;

/// Where the provisioner binary appears inside its sandbox.
pub const PROVISIONER_MOUNT: &str = "/opt/runner-provisioner";
/// The name revisions record (`EnvironmentRevision.provisioner`).
pub const PROVISIONER_NAME: &str = "runner-provisioner";

static SCRATCH: AtomicU64 = AtomicU64::new(0);

/// What one step runs and may reach.
#[derive(Debug, Clone)]
pub struct Step {
    /// What the audit and errors call it: `conda`, `pip`, `cran`, `bioconductor`, `inventory`.
    pub label: &'static str,
    pub command: Vec<String>,
    pub stdin: Vec<u8>,
    /// Host paths bound at the same place; `true` = writable.
    pub binds: Vec<(PathBuf, bool)>,
    /// Bind the provisioner binary at [`PROVISIONER_MOUNT`].
    pub provisioner: Option<PathBuf>,
    pub env: Vec<(String, String)>,
    /// Hosts the step may reach through egressd (with `origins` empty: no network at all,
    /// baseline seccomp).
    pub hosts: Vec<String>,
    /// Origins admitted exactly (`scheme://host:port`): the operator's own mirrors named by
    /// IP literal or single-label name, which no allowlist entry can name (issue #30).
    pub origins: Vec<String>,
    /// A channel the operator configured on a private address is allowed as configured.
    pub allow_private: bool,
    pub timeout: Duration,
    /// What the step writes beyond its scratch workspace, watched while it runs and after.
    pub writes: Option<Writes>,
}

/// What a step writes beyond its scratch workspace (never both: no step has the cache and a
/// prefix writable).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Writes {
    /// An environment's prefix (a link, pip or R step): what it holds, against
    /// `env_step_max_prefix_bytes`.
    Prefix(PathBuf),
    /// The shared package cache (a conda fetch step, which holds the cache's exclusive
    /// gate): what it gains, against `env_step_max_fetch_bytes` ([`cache_growth`]). A step
    /// stopped or failed leaves nothing new there.
    Cache(PathBuf),
}

/// What the step printed and how it ended.
#[derive(Debug)]
pub struct StepOutput {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub truncated: bool,
}

impl StepOutput {
    pub fn succeeded(&self) -> bool {
        self.code == Some(0)
    }

    /// The last non-blank lines of stderr (then stdout): what an operator needs to see.
    pub fn tail(&self) -> String {
        let text = if self.stderr.trim().is_empty() { &self.stdout } else { &self.stderr };
        let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        let start = lines.len().saturating_sub(6);
        lines[start..].join("\n")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SandboxedError {
    #[error("the sandbox is unavailable: {0}")]
    Unavailable(String),
    #[error("could not prepare the {label} step's sandbox")]
    Prepare {
        label: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("the {label} step needs {path}, which does not exist")]
    Missing { label: &'static str, path: PathBuf },
    #[error("the {label} step could not reach its package hosts through egressd")]
    Egress {
        label: &'static str,
        #[source]
        source: crate::egress::EgressError,
    },
    #[error("the {label} step could not be launched")]
    Launch {
        label: &'static str,
        #[source]
        source: crate::launch::LaunchError,
    },
    #[error("the {label} step did not finish within {secs} s")]
    TimedOut { label: &'static str, secs: u64 },
    #[error("the {label} step was cancelled")]
    Cancelled { label: &'static str },
    #[error(
        "the {label} step ran out of memory (limit {limit_bytes} bytes, SCIENCE_AGENT_LIMIT_MAX_MEMORY_BYTES) and was killed"
    )]
    OutOfMemory { label: &'static str, limit_bytes: u64 },
    #[error(
        "the {label} step was stopped: the environment's prefix held {bytes} bytes, more than the {limit} a prefix may hold (env_step_max_prefix_bytes, SCIENCE_AGENT_ENV_STEP_MAX_PREFIX_BYTES); install fewer or smaller packages, or ask the operator to raise the limit"
    )]
    PrefixTooLarge { label: &'static str, bytes: u64, limit: u64 },
    #[error(
        "the {label} step was stopped: the environment's prefix held {entries} files, directories and links, more than the {limit} a prefix may hold; install fewer packages"
    )]
    PrefixTooManyEntries { label: &'static str, entries: u64, limit: u64 },
    #[error(
        "the {label} step was stopped: the environment's prefix could not be measured against its byte limit (env_step_max_prefix_bytes) at {path}"
    )]
    PrefixUnmeasured {
        label: &'static str,
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the {label} step was stopped: it added {bytes} bytes to the shared package cache, more than the {limit} one fetch may add (env_step_max_fetch_bytes, SCIENCE_AGENT_ENV_STEP_MAX_FETCH_BYTES); install fewer or smaller packages, or ask the operator to raise the limit"
    )]
    FetchTooLarge { label: &'static str, bytes: u64, limit: u64 },
    #[error(
        "the {label} step was stopped: it added {entries} files, directories and links to the shared package cache, more than the {limit} one fetch may add; install fewer packages"
    )]
    FetchTooManyEntries { label: &'static str, entries: u64, limit: u64 },
    #[error(
        "the {label} step was stopped: what it added to the shared package cache could not be measured against its byte limit (env_step_max_fetch_bytes) at {path}"
    )]
    FetchUnmeasured {
        label: &'static str,
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "the {label} step was killed for writing a file larger than {limit} bytes, the most one file may take (env_step_max_file_bytes, SCIENCE_AGENT_ENV_STEP_MAX_FILE_BYTES); ask the operator to raise the limit if the package is genuine"
    )]
    FileTooLarge { label: &'static str, limit: u64 },
}

/// How often a step's prefix is measured at the least (the last walk's duration, doubled,
/// if that is longer: a large prefix is never walked more than a third of the time). A
/// step can exceed the limit by what it writes between two walks; each of its files is
/// capped by `RLIMIT_FSIZE` meanwhile.
const PREFIX_POLL: Duration = Duration::from_millis(200);

/// The most entries a step may leave in a prefix or add to the package cache (one bound
/// with the provisioner's link check).
pub use common::provision::MAX_PREFIX_ENTRIES;

/// Why a step's prefix (or what it added to the cache) is over one of its budgets.
#[derive(Debug)]
enum PrefixBreach {
    Bytes(crate::measure::Breach),
    Entries(u64),
}

/// Which place a breach was found in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    Prefix,
    Cache,
}

fn prefix_breach(label: &'static str, place: Place, limit: u64, breach: PrefixBreach) -> SandboxedError {
    use crate::measure::Breach;
    match (place, breach) {
        (Place::Prefix, PrefixBreach::Bytes(Breach::Over { bytes })) => {
            SandboxedError::PrefixTooLarge { label, bytes, limit }
        }
        (Place::Prefix, PrefixBreach::Bytes(Breach::Unreadable(u))) => {
            SandboxedError::PrefixUnmeasured { label, path: u.path, source: u.error }
        }
        (Place::Prefix, PrefixBreach::Entries(entries)) => {
            SandboxedError::PrefixTooManyEntries { label, entries, limit: MAX_PREFIX_ENTRIES }
        }
        (Place::Cache, PrefixBreach::Bytes(Breach::Over { bytes })) => {
            SandboxedError::FetchTooLarge { label, bytes, limit }
        }
        (Place::Cache, PrefixBreach::Bytes(Breach::Unreadable(u))) => {
            SandboxedError::FetchUnmeasured { label, path: u.path, source: u.error }
        }
        (Place::Cache, PrefixBreach::Entries(entries)) => {
            SandboxedError::FetchTooManyEntries { label, entries, limit: MAX_PREFIX_ENTRIES }
        }
    }
}

/// What a running step's watchdog measures.
#[derive(Clone)]
enum Watched {
    /// A prefix, all of it.
    Prefix(Arc<OwnedFd>),
    /// What the shared package cache gained since the step started.
    Cache(Arc<OwnedFd>, Arc<cache_growth::Start>),
}

impl Watched {
    fn place(&self) -> Place {
        match self {
            Watched::Prefix(_) => Place::Prefix,
            Watched::Cache(..) => Place::Cache,
        }
    }

    /// One walk, judged against `limit` (0: no byte limit) and [`MAX_PREFIX_ENTRIES`], on
    /// the blocking pool.
    async fn measure(&self, limit: u64) -> Result<(), PrefixBreach> {
        let m = match self {
            Watched::Prefix(root) => crate::measure::count_blocking(root).await,
            Watched::Cache(root, start) => cache_growth::grown_blocking(root, start).await,
        };
        judge_prefix(m, limit, MAX_PREFIX_ENTRIES)
    }
}

/// The verdict on one walk of a prefix: its entries against `max_entries`, its bytes against
/// `max_bytes` (0: no byte limit). Pure.
fn judge_prefix(m: crate::measure::Measured, max_bytes: u64, max_entries: u64) -> Result<(), PrefixBreach> {
    if m.entries > max_entries {
        return Err(PrefixBreach::Entries(m.entries));
    }
    crate::measure::check(m, max_bytes).map(drop).map_err(PrefixBreach::Bytes)
}

/// Completes with the breach once the prefix (or the cache's growth) outgrows a budget;
/// never otherwise. Each walk counts as the workspace quota measures a workspace (no link
/// followed, each file its size plus the blocks allocated beyond it; what cannot be read
/// fails closed), keeping no paths. Spawned as a task of its own, its walks on the blocking
/// pool: the step's output, timeout and cancellation are served meanwhile.
async fn watchdog(watched: Watched, limit: u64) -> PrefixBreach {
    let mut pause = PREFIX_POLL;
    loop {
        tokio::time::sleep(pause).await;
        let walk = std::time::Instant::now();
        if let Err(breach) = watched.measure(limit).await {
            return breach;
        }
        pause = PREFIX_POLL.max(walk.elapsed() * 2);
    }
}

/// The combined output a step may print (the provisioner's answer is at most
/// `common::provision::MAX_RESPONSE_BYTES`).
const MAX_STEP_OUTPUT: u64 = 16 << 20;

/// The descriptors a step's sandbox is given, opened (no link followed) before it starts.
struct Opened {
    scratch: OwnedFd,
    /// `step.binds`, in order.
    binds: Vec<OwnedFd>,
}

impl Opened {
    fn open(step: &Step, scratch: &Scratch) -> Result<Opened, SandboxedError> {
        let label = step.label;
        let scratch = open_path(&scratch.path).map_err(|source| SandboxedError::Prepare { label, source })?;
        let binds = step
            .binds
            .iter()
            .map(|(path, _)| {
                open_path(path).map_err(|source| match source.kind() {
                    std::io::ErrorKind::NotFound => SandboxedError::Missing { label, path: path.clone() },
                    _ => SandboxedError::Prepare { label, source },
                })
            })
            .collect::<Result<_, _>>()?;
        Ok(Opened { scratch, binds })
    }
}

/// The step's gateway from egressd, for a step that names hosts or origins.
async fn step_egress(app: &App, step: &Step) -> Result<Option<crate::egress::EgressLease>, SandboxedError> {
    if step.hosts.is_empty() && step.origins.is_empty() {
        return Ok(None);
    }
    // egressd refuses a revision named again with another policy: the revision names this
    // step's own allowlist.
    let mut hosts = step.hosts.join(",");
    hosts.push_str(if step.allow_private { ";private" } else { ";public" });
    if !step.origins.is_empty() {
        hosts.push_str(&format!(";{}", step.origins.join(",")));
    }
    let digest = crate::versioning::names::sha256_hex(hosts.as_bytes());
    let policy = GatewayPolicy {
        revision: format!("env-provision-{}", &digest[..16]),
        allowed_domains: step.hosts.clone(),
        allow_private_network: step.allow_private,
        pinned_origins: step.origins.clone(),
    };
    let label = step.label;
    app.egress
        .acquire(policy, ProxySetting::Direct, app.sandbox.user.uid)
        .await
        .map(Some)
        .map_err(|source| SandboxedError::Egress { label, source })
}

/// What the step's watchdog measures, with its limit: the prefix it writes, or what the
/// shared cache gains (read before the step starts; the step holds the cache's exclusive
/// gate, so what it gains from here on is its own). Watched whatever the byte limit: the
/// entries are bounded too.
async fn watched(app: &App, step: &Step) -> Result<(Option<Watched>, u64), SandboxedError> {
    let prepare = |source| SandboxedError::Prepare { label: step.label, source };
    let settings = &app.envs.settings;
    match &step.writes {
        None => Ok((None, 0)),
        Some(Writes::Prefix(prefix)) => {
            let root = Arc::new(open_dir(prefix).map_err(prepare)?);
            Ok((Some(Watched::Prefix(root)), settings.step_max_prefix_bytes))
        }
        Some(Writes::Cache(cache)) => {
            let root = open_dir(cache).map_err(prepare)?;
            let (root, start) = tokio::task::spawn_blocking(move || {
                let start = cache_growth::start(&root);
                (root, start)
            })
            .await
            .map_err(|e| prepare(std::io::Error::other(e.to_string())))?;
            let start = Arc::new(start.map_err(prepare)?);
            Ok((Some(Watched::Cache(Arc::new(root), start)), settings.step_max_fetch_bytes))
        }
    }
}

/// Runs `job`, stopping it when `watched` outgrows `limit`; the breach, if one stopped it
/// or the walk right after the end finds one (what the step wrote just before it ended
/// counts too).
async fn run_watched(
    app: &App,
    mut job: Job<'_>,
    output: &mut OutputBudget,
    watched: Option<&Watched>,
    limit: u64,
) -> (Result<crate::launch::Outcome, crate::launch::LaunchError>, Option<PrefixBreach>) {
    let Some(w) = watched else {
        return (app.sandbox.isolation.run(job, output).await.outcome, None);
    };
    // Ended by the watchdog when the prefix outgrows its limit (the run answers `Cancelled`).
    let (stop, stopped) = tokio::sync::watch::channel(false);
    job.stop = Some(stopped);
    let mut dog = tokio::spawn(watchdog(w.clone(), limit));
    let run = app.sandbox.isolation.run(job, output);
    tokio::pin!(run);
    let (ran, mut breach) = tokio::select! {
        ran = &mut run => {
            dog.abort();
            (ran, None)
        }
        found = &mut dog => {
            // A watchdog that panicked stops nothing; the walk at the end still counts.
            let breach = found.ok();
            if breach.is_some() {
                let _ = stop.send(true);
            }
            (run.await, breach)
        }
    };
    if breach.is_none() {
        breach = w.measure(limit).await.err();
    }
    (ran.outcome, breach)
}

/// Runs `step` in a fresh sandbox and waits for it.
pub async fn run(app: &App, mut step: Step) -> Result<StepOutput, SandboxedError> {
    // The request goes to the sandbox's stdin as it is (moved, never copied).
    let stdin = std::mem::take(&mut step.stdin);
    let label = step.label;
    let prepare = |source| SandboxedError::Prepare { label, source };
    if let Some(why) = app.sandbox.isolation.unavailable() {
        return Err(SandboxedError::Unavailable(why));
    }
    // Bounded like executions (each step may take the execution maximums), waited for
    // before anything is made.
    let _slot = app.provisioning_steps.acquire().await.map_err(|_| SandboxedError::Cancelled { label })?;
    let scratch = Scratch::make(&app.data_dir, &app.sandbox.user).map_err(prepare)?;
    let opened = Opened::open(&step, &scratch)?;
    let mut binds: Vec<Bind> = step
        .binds
        .iter()
        .zip(&opened.binds)
        .map(|((path, writable), fd)| Bind { source: path, target: path, writable: *writable, fd: Some(fd) })
        .collect();
    if let Some(binary) = &step.provisioner {
        let target = Path::new(PROVISIONER_MOUNT);
        binds.push(Bind { source: binary, target, writable: false, fd: None });
    }
    let lease = step_egress(app, &step).await?;
    let layout = WorkspaceLayout::new(scratch.path.clone(), None);
    let mut spec = SandboxSpec::new(&app.sandbox.host, &layout, Language::Shell);
    spec.workspace_dirs =
        Some(WorkspaceDirs { root: Dir { fd: &opened.scratch, owner: None }, read_only: None });
    spec.command = Some(&step.command);
    spec.binds = &binds;
    spec.extra_env = &step.env;
    spec.egress = lease.as_ref().map(|l| Egress {
        bridge: &app.egress.bridge,
        gateway_socket: &l.socket,
        gateway: Some(&l.socket_fd),
    });
    // 0: the fallback size (1 GiB); packages unpack into the cache, not /tmp.
    spec.tmp_bytes = 0;
    spec.profile = argv::profile(lease.is_some(), false);
    let mut job = Job::new(spec);
    job.timeout = Some(step.timeout);
    job.stdin = stdin;
    // No file a step writes (a package's, the cache's, a build's) grows past this: a
    // hostile package is stopped at its first oversized file, whatever it links or unpacks.
    let max_file = app.envs.settings.step_max_file_bytes;
    job.rlimits = crate::launch::default_rlimits(Some(max_file));
    // The most an execution may ask for (memory, processes, CPU; the default where there is
    // no maximum), enforced as for executions: a solve or a build needs more than a default
    // run, and a hostile setup.py or R install script must not take the host down for every
    // tenant.
    let (watched, limit) = watched(app, &step).await?;
    let limits = &provisioning_limits(&app.config.limits);
    let millis = u64::try_from(step.timeout.as_millis()).unwrap_or(u64::MAX);
    job.rlimits.extend(crate::limits::rlimits_for(app.limits.mode, limits, millis));
    let cgroup =
        app.limits.create(limits).map_err(|e| prepare(std::io::Error::other(crate::error_chain(&e))))?;
    if let Some(c) = &cgroup {
        job.cgroup_procs =
            c.procs_fds().map_err(|e| prepare(std::io::Error::other(crate::error_chain(&e))))?;
    }
    let mut output = OutputBudget::pooled(MAX_STEP_OUTPUT, &app.output_pool);
    let (ran, breach) = run_watched(app, job, &mut output, watched.as_ref(), limit).await;
    let usage = crate::limits::finish(cgroup).await;
    // A fetch step stopped, killed or failed may have left half an extraction (or a
    // bomb's worth of bytes) in the shared cache: taken out before the caller gives the
    // cache's gate back, so no later lookup finds it and no tenant pays for it.
    if let Some(Watched::Cache(root, start)) = &watched {
        let exited = matches!(&ran, Ok(o) if matches!(o.termination, Termination::Exited(0)));
        if breach.is_some() || !exited {
            restore_cache(label, root, start).await;
        }
    }
    drop(lease);
    let outcome = ran.map_err(|source| SandboxedError::Launch { label, source })?;
    if let (Some(breach), Some(w)) = (breach, &watched) {
        return Err(prefix_breach(label, w.place(), limit, breach));
    }
    let oom = usage.is_some_and(|u| u.oom_kills > 0);
    verdict(&step, outcome.termination, oom, limits.memory_bytes, max_file, output.finish())
}

/// The step's answer from how it ended: a file over `max_file` (SIGXFSZ), an out-of-memory
/// kill, the deadline, a cancel, or its exit code and output.
fn verdict(
    step: &Step,
    termination: Termination,
    oom: bool,
    limit_bytes: u64,
    max_file: u64,
    out: crate::launch::CollectedOutput,
) -> Result<StepOutput, SandboxedError> {
    let label = step.label;
    if oom && !matches!(termination, Termination::Exited(0)) {
        return Err(SandboxedError::OutOfMemory { label, limit_bytes });
    }
    let code = match termination {
        // bwrap answers a command killed by signal N as 128+N.
        Termination::Exited(c) if c == 128 + libc::SIGXFSZ && max_file > 0 => {
            return Err(SandboxedError::FileTooLarge { label, limit: max_file });
        }
        Termination::Signaled(libc::SIGXFSZ) if max_file > 0 => {
            return Err(SandboxedError::FileTooLarge { label, limit: max_file });
        }
        Termination::Exited(c) => Some(c),
        Termination::Signaled(_) => None,
        Termination::TimedOut => {
            return Err(SandboxedError::TimedOut { label, secs: step.timeout.as_secs() });
        }
        Termination::Cancelled => return Err(SandboxedError::Cancelled { label }),
    };
    Ok(StepOutput { code, stdout: out.stdout, stderr: out.stderr, truncated: out.truncated })
}

/// Removes what a fetch step added to or changed in the shared cache
/// ([`cache_growth::remove_new`]), on the blocking pool; a failure is logged (what is left
/// is cache: a later fetch replaces what it needs).
async fn restore_cache(label: &'static str, root: &Arc<OwnedFd>, start: &Arc<cache_growth::Start>) {
    let (root, start) = (root.clone(), start.clone());
    let began = std::time::Instant::now();
    match tokio::task::spawn_blocking(move || cache_growth::remove_new(&root, &start)).await {
        Ok((removed, None)) => tracing::info!(
            event = "package_cache_restored",
            step = label,
            removed,
            millis = u64::try_from(began.elapsed().as_millis()).unwrap_or(u64::MAX),
            "what a fetch step that did not finish added to the shared package cache was removed"
        ),
        Ok((removed, Some(e))) => tracing::warn!(
            event = "package_cache_left",
            step = label,
            removed,
            error = %e,
            "some of what a fetch step that did not finish added to the shared package cache could not be removed"
        ),
        Err(e) => tracing::warn!(
            event = "package_cache_left",
            step = label,
            error = %e,
            "what a fetch step that did not finish added to the shared package cache could not be removed"
        ),
    }
}

/// A provisioning step's limits: each the execution maximum, or the default where there is
/// no maximum (0).
fn provisioning_limits(settings: &crate::limits::LimitSettings) -> crate::limits::Limits {
    let pick = |max: u64, default: u64| if max > 0 { max } else { default };
    let (d, m) = (&settings.default, &settings.max);
    crate::limits::Limits {
        memory_bytes: pick(m.memory_bytes, d.memory_bytes),
        pids: pick(m.pids, d.pids),
        cpu_millicores: pick(m.cpu_millicores, d.cpu_millicores),
        tmp_bytes: pick(m.tmp_bytes, d.tmp_bytes),
    }
}

/// A directory runnerd made, opened to be walked (its last component is not followed).
fn open_dir(path: &Path) -> std::io::Result<OwnedFd> {
    crate::fsat::open_path(path, libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
}

/// `O_PATH` descriptor of a path runnerd made (its last component is not followed).
fn open_path(path: &Path) -> std::io::Result<OwnedFd> {
    crate::fsat::open_path(path, libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC)
}

/// A fresh, empty directory that is the step's workspace, removed when dropped.
///
/// The step had it writable at `/workspace`, so whatever is in it was made by hostile code
/// (a 70,000-deep chain of directories, say): it is removed with [`crate::fsat::remove_tree_at`]
/// (bounded descriptors and memory, no recursion, no link followed), on the blocking pool.
/// Names carry this process's tag, so the first step of a process can sweep what an earlier
/// one (killed, or stopped mid-removal) left, without touching its own.
struct Scratch {
    path: PathBuf,
    parent: OwnedFd,
    name: std::ffi::CString,
}

/// This process's scratch names' prefix.
fn scratch_tag() -> &'static str {
    static TAG: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    TAG.get_or_init(crate::versioning::names::new_uuid_v4)
}

impl Scratch {
    fn make(data_dir: &Path, owner: &crate::sandbox::user::Identity) -> std::io::Result<Scratch> {
        use std::os::unix::fs::PermissionsExt;
        static SWEPT: std::sync::Once = std::sync::Once::new();
        let n = SCRATCH.fetch_add(1, Ordering::Relaxed);
        let runtime = data_dir.join(common::layout::RUNTIME);
        let parent_path = runtime.join(common::layout::PROVISION_SCRATCH);
        std::fs::create_dir_all(&parent_path)?;
        for p in [&runtime, &parent_path] {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o711))?;
        }
        let parent =
            crate::fsat::open_path(&parent_path, libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW)?;
        SWEPT.call_once(|| {
            if let Ok(dir) = crate::fsat::dup(&parent) {
                remove_in_background(dir, None);
            }
        });
        let name = format!("{}-{n}", scratch_tag());
        let dir = parent_path.join(&name);
        std::fs::create_dir(&dir)?;
        let name =
            std::ffi::CString::new(name).map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
        let scratch = Scratch { path: std::fs::canonicalize(&dir)?, parent, name };
        owner.hand_over(open_path(&dir)?.as_fd())?;
        Ok(scratch)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if let Ok(dir) = crate::fsat::dup(&self.parent) {
            remove_in_background(dir, Some(std::mem::take(&mut self.name)));
        }
    }
}

/// Removes `name` below `parent` — or, for `None`, every entry of another process's tag —
/// on the blocking pool (inline outside a runtime); a failure is logged, and the next
/// process's first step sweeps what is left.
fn remove_in_background(parent: OwnedFd, name: Option<std::ffi::CString>) {
    let remove = move || {
        let sweep = name.is_none();
        let names = match name {
            Some(n) => vec![n],
            None => match crate::fsat::names(&parent) {
                Ok(names) => names
                    .into_iter()
                    .filter(|(n, _)| !n.to_string_lossy().starts_with(scratch_tag()))
                    .map(|(_, c)| c)
                    .collect(),
                Err(e) => {
                    tracing::warn!(event = "provision_scratch_left", error = %e, "the provisioning scratch directory could not be listed");
                    Vec::new()
                }
            },
        };
        let mut removed = 0usize;
        for n in names {
            match crate::fsat::remove_tree_at(&parent, &n) {
                Ok(()) => removed += 1,
                Err(e) => tracing::warn!(
                    event = "provision_scratch_left",
                    name = %n.to_string_lossy(),
                    error = %e,
                    "a provisioning step's scratch directory could not be removed; the next start sweeps it"
                ),
            }
        }
        if sweep && removed > 0 {
            tracing::info!(
                event = "provision_scratch_swept",
                count = removed,
                reason = "left by a previous process"
            );
        }
    };
    match tokio::runtime::Handle::try_current() {
        Ok(handle) => drop(handle.spawn_blocking(remove)),
        Err(_) => remove(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_is_judged_by_its_entries_and_its_bytes() {
        let walk = |bytes, entries| {
            let mut m = crate::measure::Measured::default();
            (m.bytes, m.entries) = (bytes, entries);
            m
        };
        for (bytes, entries, limit, want) in [
            (10, 5, 10, "ok"),
            (11, 5, 10, "bytes"),
            (u64::MAX, 5, 0, "ok"),
            (10, 6, 10, "entries"),
            (11, 6, 0, "entries"),
        ] {
            let got = match judge_prefix(walk(bytes, entries), limit, 5) {
                Ok(()) => "ok",
                Err(PrefixBreach::Bytes(_)) => "bytes",
                Err(PrefixBreach::Entries(n)) => {
                    assert_eq!(n, entries);
                    "entries"
                }
            };
            assert_eq!(got, want, "{bytes} bytes, {entries} entries, limit {limit}");
        }
        let e = prefix_breach("pip", Place::Prefix, 10, PrefixBreach::Entries(2_000_001)).to_string();
        assert!(e.contains("held 2000001 files, directories and links, more than the 2000000"), "{e}");
        let over = crate::measure::Breach::Over { bytes: 11 };
        for (place, breach, want) in [
            (
                Place::Cache,
                PrefixBreach::Bytes(over),
                "it added 11 bytes to the shared package cache, more than the 10 one fetch may add (env_step_max_fetch_bytes, SCIENCE_AGENT_ENV_STEP_MAX_FETCH_BYTES)",
            ),
            (
                Place::Cache,
                PrefixBreach::Entries(2_000_001),
                "it added 2000001 files, directories and links to the shared package cache, more than the 2000000",
            ),
        ] {
            let e = prefix_breach("conda", place, 10, breach).to_string();
            assert!(e.starts_with("the conda step was stopped: ") && e.contains(want), "{e}");
        }
    }

    #[test]
    fn a_sweep_removes_other_processes_scratches_however_deep_and_keeps_its_own() {
        let tmp = tempfile::tempdir().unwrap();
        let mut deep = tmp.path().join("0f0e-stale-7");
        for _ in 0..300 {
            deep.push("d");
        }
        std::fs::create_dir_all(&deep).unwrap();
        std::fs::write(deep.join("left.txt"), "x").unwrap();
        let own = format!("{}-3", scratch_tag());
        std::fs::create_dir(tmp.path().join(&own)).unwrap();
        let dir = || crate::fsat::open_path(tmp.path(), libc::O_RDONLY | libc::O_DIRECTORY).unwrap();
        remove_in_background(dir(), None);
        let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left, [std::ffi::OsString::from(&own)]);
        remove_in_background(dir(), Some(std::ffi::CString::new(own).unwrap()));
        assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
    }
}
