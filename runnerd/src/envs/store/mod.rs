//! The environment store's operations (internals §5): setup, create, install, uninstall,
//! delete, the read lease of an execution, and the views the routes answer with. The catalog
//! is held in memory behind one lock (the original's `mutationTail`) and written through on
//! every change; each environment has a FIFO readers/writer gate ([`super::gate`]).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde_json::Value;

use common::provision::{self, Op};

use super::catalog::{self, Catalog, Environment, EnvironmentRevision, Kind, LocalWheel, Status};
use super::gate::{Gates, ReadGuard};
use super::ids::{Manager, STARTER_PYTHON, STARTER_R};
use super::sandboxed::{self, SandboxedError, StepOutput};
use super::settings::EnvSettings;
use super::setup::{FailureKind, Setup};
use super::snapshot::{self, CondaPackage, Installed, Parts, PythonPackage, RPackage, Snapshot};
use super::steps::{self, CondaPlaces, PipSource};
use super::{ids, wheels};
use crate::app::App;
use crate::sandbox::Language;

use super::steps::PYPI;

/// The original refuses a package source the manager does not use: `indexUrl` is pip's,
/// `channels` conda's (an empty list names nothing and passes).
fn check_sources(
    manager: Manager,
    channels: Option<&[String]>,
    index_url: Option<&str>,
) -> Result<(), StoreError> {
    if index_url.is_some() && manager != Manager::Pip {
        return Err(StoreError::Invalid("indexUrl is only supported for pip installs".into()));
    }
    if channels.is_some_and(|c| !c.is_empty()) && manager != Manager::Conda {
        return Err(StoreError::Invalid("channels are only supported for conda installs".into()));
    }
    Ok(())
}

/// The starters' display names, as the original's.
const STARTER_PYTHON_NAME: &str = "Starter Python";
const STARTER_R_NAME: &str = "Starter R";

/// The most one revision's package list may take, serialised (a real environment of a few
/// thousand packages takes a few hundred kilobytes).
pub(crate) const MAX_INSTALLED_BYTES: usize = 4 << 20;

#[derive(Debug, thiserror::Error)]
pub(crate) enum StoreError {
    /// The store cannot be used now (disabled, setup not ready): the reason is the text.
    #[error("{0}")]
    Unavailable(String),
    /// The request is wrong: the text says how.
    #[error("{0}")]
    Invalid(String),
    #[error("Environment not found: {0}")]
    NotFound(String),
    /// The original's text for a revision id that names nothing.
    #[error("Unknown environment revision: {0}")]
    UnknownRevision(String),
    #[error(transparent)]
    Ids(#[from] ids::IdError),
    #[error(transparent)]
    Catalog(#[from] super::catalog::CatalogError),
    #[error(transparent)]
    Snapshot(#[from] snapshot::SnapshotError),
    #[error(transparent)]
    Wheel(#[from] wheels::WheelError),
    /// A provisioning step failed; the text is what its output says.
    #[error("{label} step failed: {detail}")]
    Step { label: &'static str, detail: String },
    #[error(transparent)]
    Sandboxed(#[from] SandboxedError),
    #[error("the store's directory {path} could not be prepared")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl StoreError {
    /// For setup's action text.
    fn kind(&self) -> FailureKind {
        let disk_full = |e: &std::io::Error| e.raw_os_error() == Some(libc::ENOSPC);
        match self {
            StoreError::Io { source, .. } if disk_full(source) => FailureKind::DiskFull,
            StoreError::Step { detail, .. } if detail.contains("No space left") => FailureKind::DiskFull,
            StoreError::Step { label: "conda", .. } => FailureKind::Channels,
            StoreError::Step { label: "provisioner", .. } => FailureKind::Provisioner,
            StoreError::Sandboxed(SandboxedError::Missing { label: "conda", .. }) => FailureKind::Channels,
            StoreError::Sandboxed(_) => FailureKind::Sandbox,
            _ => FailureKind::Other,
        }
    }
}

/// An execution's selection, decided in `prepare` and leased when the run starts (after the
/// agent queue and the workspace lease: taking the read gate earlier could deadlock with a
/// queued writer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Selection {
    pub environment_id: String,
    /// `/execute`'s `environmentRevisionId`: must still be the current revision at the start.
    pub revision_id: Option<String>,
    pub language: Language,
}

/// A leased environment: the prefix stays as it is until this is dropped.
#[derive(Debug)]
pub(crate) struct Runtime {
    pub revision_id: String,
    pub prefix: PathBuf,
    /// Host interpreters to hide (Python and R runs only; internals §2.4).
    pub masks: Vec<PathBuf>,
    _guard: ReadGuard,
}

/// What `/health` and `/environment-setup` read without touching the disk.
#[derive(Debug)]
struct View {
    setup: Setup,
    starter_python_ready: bool,
    running: bool,
}

#[derive(Debug)]
pub struct EnvStore {
    pub settings: EnvSettings,
    /// `<dataDir>/scientific-envs`, absolute.
    root: PathBuf,
    provisioner: PathBuf,
    /// The package cache conda fetch steps write (`scientific-envs/provisioner`).
    cache_dir: PathBuf,
    /// The operator's offline cache (`SCIENCE_AGENT_PACKAGE_CACHE_DIR`), only ever read.
    read_only_caches: Vec<PathBuf>,
    masks: Vec<PathBuf>,
    catalog: Mutex<Catalog>,
    view: Mutex<View>,
    gates: Gates,
    /// The package cache: fetch steps (which may replace an entry) write, link steps (which
    /// copy from it, their rattler lock in a scratch layer of their own) read; a change holds
    /// it from its fetch to the end of its link (downgraded in between). A fetch step reads
    /// a prefix a pip or R step wrote while it holds this: the provisioner refuses what
    /// could hang it there (FIFOs, devices, more than two million entries) before reading.
    cache_gate: tokio::sync::RwLock<()>,
    /// The stored wheels installs in flight hold ([`wheels::InUse`]).
    wheels_in_use: Arc<wheels::InUse>,
}

/// The install body, read by the route.
#[derive(Debug, Clone)]
pub(crate) struct InstallRequest {
    pub packages: Vec<String>,
    pub channels: Option<Vec<String>>,
    pub manager: Manager,
    pub index_url: Option<String>,
    pub workspace: crate::exec::request::WorkspaceRef,
}

/// The environment language an execution language runs in (a shell runs in either).
fn env_language(l: Language) -> catalog::Language {
    match l {
        Language::R => catalog::Language::R,
        _ => catalog::Language::Python,
    }
}

/// Host interpreters in `/usr/bin` (`python`, `python3`, `python3.N`, `R`, `Rscript`),
/// resolved to their targets, deduplicated and sorted; dangling links dropped.
pub(crate) fn host_interpreters(bin: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(bin) else { return Vec::new() };
    let mut out: Vec<PathBuf> = entries
        .flatten()
        .filter(|e| is_interpreter_name(&e.file_name().to_string_lossy()))
        .filter_map(|e| std::fs::canonicalize(e.path()).ok())
        .collect();
    out.sort();
    out.dedup();
    out
}

/// `^(?:python(?:3(?:\.\d+)?)?|R|Rscript)$`.
pub(crate) fn is_interpreter_name(name: &str) -> bool {
    if name == "R" || name == "Rscript" || name == "python" || name == "python3" {
        return true;
    }
    name.strip_prefix("python3.").is_some_and(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
}

impl EnvStore {
    /// Opens the store under `data_dir` (created if absent), loads the catalog and marks an
    /// update interrupted by a crash as failed. Disabled: nothing is touched.
    pub(crate) fn open(
        data_dir: &Path,
        settings: EnvSettings,
        provisioner: PathBuf,
        sandbox_user: &crate::sandbox::user::Identity,
    ) -> Result<EnvStore, StoreError> {
        let mut root = data_dir.join(common::layout::SCIENTIFIC_ENVS);
        let mut catalog = Catalog::default();
        let mut cache_dir = PathBuf::new();
        if settings.enabled {
            // At its canonical path: conda prefixes embed theirs.
            let (path, _) = catalog::open_store(data_dir)?;
            root = path;
            // The operator's offline cache is only ever read (it may be read-only, or shared);
            // what the store fetches itself goes into its own.
            cache_dir = root.join(common::layout::ENV_PACKAGE_CACHE);
            prepare_cache(&cache_dir, sandbox_user)?;
            let dir = open_dir(&root)?;
            let swept = Catalog::sweep_temporaries(&dir) + wheels::sweep_incoming(&dir);
            if swept > 0 {
                tracing::info!(
                    event = "environment_temporaries_swept",
                    count = swept,
                    reason = "left by a previous process"
                );
            }
            catalog = Catalog::load(&dir)?;
            let wheels_swept =
                wheels::sweep_unreferenced(&dir, &|hash, name| named_by_live(&catalog, hash, name));
            if wheels_swept > 0 {
                tracing::info!(
                    event = "environment_wheels_swept",
                    count = wheels_swept,
                    reason = "named by no revision of a live environment"
                );
            }
            let orphans = sweep_orphan_prefixes(&root.join(common::layout::ENV_REVISIONS), &catalog);
            if orphans > 0 {
                tracing::info!(
                    event = "environment_prefixes_swept",
                    count = orphans,
                    reason = "left by a create a crash interrupted, or a delete"
                );
            }
            if catalog.recover_interrupted(&crate::timefmt::now_iso()) {
                catalog.save(&dir)?;
                tracing::warn!(
                    event = "environment_update_interrupted",
                    "an environment update was interrupted by a restart; the environment is marked failed"
                );
            }
        }
        let read_only_caches = settings.package_cache_dir.iter().cloned().collect();
        let starter_python_ready = starter_ready(&catalog, STARTER_PYTHON);
        let view = View { setup: Setup::initial(settings.enabled), starter_python_ready, running: false };
        Ok(EnvStore {
            masks: host_interpreters(Path::new("/usr/bin")),
            settings,
            root,
            provisioner,
            cache_dir,
            read_only_caches,
            catalog: Mutex::new(catalog),
            view: Mutex::new(view),
            gates: Gates::default(),
            cache_gate: tokio::sync::RwLock::new(()),
            wheels_in_use: Arc::default(),
        })
    }

    /// Changes the catalog durably: `change` is applied to a copy, the copy is written, and
    /// only then does it replace the catalog in memory, so memory never runs ahead of the
    /// disk (a failed write leaves both as they were).
    fn persist<T>(
        &self,
        change: impl FnOnce(&mut Catalog) -> Result<T, StoreError>,
    ) -> Result<T, StoreError> {
        let dir = open_dir(&self.root)?;
        let mut catalog = self.cat();
        let mut next = catalog.clone();
        let out = change(&mut next)?;
        next.save(&dir)?;
        *catalog = next;
        Ok(out)
    }

    /// The catalog, held only between awaits (a std lock: never across one).
    fn cat(&self) -> std::sync::MutexGuard<'_, Catalog> {
        self.catalog.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock_view(&self) -> std::sync::MutexGuard<'_, View> {
        self.view.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `/health.scientificEnvs`.
    pub(crate) fn health(&self) -> Value {
        let v = self.lock_view();
        v.setup.health(&self.settings, v.starter_python_ready)
    }

    /// `GET /environment-setup`.
    pub(crate) fn setup_view(&self) -> Value {
        self.lock_view().setup.view(&self.settings)
    }

    /// Whether executions may use environments now.
    pub(crate) fn available(&self) -> bool {
        let v = self.lock_view();
        self.settings.enabled && v.setup.state == super::setup::State::Ready && v.starter_python_ready
    }

    fn require_available(&self) -> Result<(), StoreError> {
        let v = self.lock_view();
        if !self.settings.enabled {
            return Err(StoreError::Unavailable(
                "Scientific environments are disabled by configuration".into(),
            ));
        }
        if v.setup.state == super::setup::State::Ready && v.starter_python_ready {
            return Ok(());
        }
        Err(StoreError::Unavailable(v.setup.unavailable_reason()))
    }

    /// Starts setup in the background unless it is running or disabled; `false` then.
    pub(crate) fn start_setup(app: &Arc<App>) -> bool {
        let store = &app.envs;
        {
            let mut v = store.lock_view();
            // A ready store answers `ready` and changes nothing, as the original's.
            if !store.settings.enabled
                || v.running
                || (v.setup.state == super::setup::State::Ready && v.starter_python_ready)
            {
                return false;
            }
            v.running = true;
            v.setup.begin(crate::timefmt::now_iso());
        }
        let app = app.clone();
        tokio::spawn(async move {
            let store = &app.envs;
            let outcome = store.run_setup(&app).await;
            let mut v = store.lock_view();
            v.running = false;
            let now = crate::timefmt::now_iso();
            match outcome {
                Ok(detail) => {
                    v.starter_python_ready = true;
                    tracing::info!(event = "environment_setup_ready", detail = %detail);
                    v.setup.ready(now, detail);
                }
                Err(e) => {
                    let text = crate::error_chain(&e);
                    let action = super::setup::action(
                        e.kind(),
                        &store.settings,
                        &store.provisioner.to_string_lossy(),
                        &store.root.to_string_lossy(),
                    );
                    tracing::warn!(event = "environment_setup_failed", error = %text, action = %action);
                    v.setup.failed(now, text, action);
                }
            }
        });
        true
    }

    async fn run_setup(&self, app: &App) -> Result<String, StoreError> {
        let detail = check_provisioner(&self.provisioner, &app.sandbox.user)
            .map_err(|e| StoreError::Step { label: "provisioner", detail: e });
        let detail = match detail {
            Ok(d) => d,
            Err(e) => {
                // The provisioner phase fails: the view says so before the error is returned.
                return Err(e);
            }
        };
        self.lock_view().setup.provisioner_ready(detail);
        if starter_ready(&self.cat(), STARTER_PYTHON) {
            return Ok("starter-python is ready".into());
        }
        self.create_starter(app, Language::Python).await?;
        Ok("starter-python was created".into())
    }

    /// A conda step over `channels`: when every host it reaches belongs to a channel the
    /// operator configured, that host may resolve to a private address (an offline site's
    /// mirror on the LAN is allowed as configured); a request's preset mirror may not.
    fn conda_step(
        &self,
        op: Op,
        prefix: &Path,
        channels: &[String],
        extra_ro: &[PathBuf],
        stage: provision::Stage,
    ) -> sandboxed::Step {
        let mut step = steps::conda(&self.places(), op, prefix, channels, extra_ro, stage);
        let configured_urls: Vec<String> =
            self.settings.channels.iter().filter_map(|c| ids::channel_url(c).ok()).collect();
        steps::pin_configured(&mut step, &configured_urls);
        step
    }

    /// The conda channels of a step that does not name its own (an uninstall, a clone): the
    /// ones a revision recorded that are still allowed, else the configured ones. A pip or
    /// CRAN revision records its index or repository, which must never be read as a conda
    /// channel (nor opened to egress for one).
    fn conda_channels(&self, recorded: &[String]) -> Vec<String> {
        let allowed: Vec<String> = recorded
            .iter()
            .filter(|c| ids::allowed_channels(std::slice::from_ref(*c), &self.settings.channels).is_ok())
            .cloned()
            .collect();
        match allowed.is_empty() {
            true => self.settings.channels.clone(),
            false => allowed,
        }
    }

    /// The conda step's places: the provisioner, the cache, offline or not.
    fn places(&self) -> CondaPlaces<'_> {
        CondaPlaces {
            provisioner: &self.provisioner,
            cache_dir: &self.cache_dir,
            read_only_caches: &self.read_only_caches,
            offline: self.settings.offline(),
            max_prefix_bytes: self.settings.step_max_prefix_bytes,
        }
    }

    fn channel_urls(&self, channels: &[String]) -> Result<Vec<String>, StoreError> {
        Ok(channels.iter().map(|c| ids::channel_url(c)).collect::<Result<_, _>>()?)
    }

    fn prefix_path(&self, env: &str, rev: &str) -> PathBuf {
        self.root.join(common::layout::ENV_REVISIONS).join(env).join(rev)
    }

    /// Creates a starter (`starter-python` at setup, `starter-r` as the base of the first R
    /// environment), named as the original names them.
    async fn create_starter(&self, app: &App, language: Language) -> Result<Environment, StoreError> {
        let (id, specs) = match language {
            Language::R => (STARTER_R, self.settings.starter_r.clone()),
            _ => (STARTER_PYTHON, self.settings.starter_python.clone()),
        };
        let _w = self.gates.write(id).await;
        if let Some(env) = self.cat().environment(id).filter(|e| e.status == Status::Ready).cloned() {
            return Ok(env);
        }
        let rev = ids::new_revision_id();
        let prefix = self.fresh_prefix(app, id, &rev)?;
        let channels = self.channel_urls(&self.settings.channels)?;
        let answer =
            self.conda_change(app, Op::Create { specs: specs.clone() }, &prefix, &channels, &[]).await;
        let answer = match answer {
            Ok(a) => a,
            Err(e) => {
                let _ = remove_prefix(&prefix);
                return Err(e);
            }
        };
        let name = match language {
            Language::R => STARTER_R_NAME,
            _ => STARTER_PYTHON_NAME,
        };
        let env = new_environment(id, name, Kind::Starter, env_language(language), &rev, None);
        // As the original: a starter's first revision records no requested change.
        let requested = Vec::new();
        let env = self.publish_new(app, env, &prefix, channels, &answer, requested, None).await?;
        audit("environment_created", id, &rev, "starter");
        Ok(env)
    }

    /// A new environment's first revision and its catalog entry (a starter replaces an entry
    /// of its id; a task environment's name must still be free). On any failure the prefix
    /// goes, so nothing is left that no record names.
    #[allow(clippy::too_many_arguments)]
    async fn publish_new(
        &self,
        app: &App,
        env: Environment,
        prefix: &Path,
        channels: Vec<String>,
        answer: &provision::Response,
        requested: Vec<String>,
        wheels: Option<Vec<LocalWheel>>,
    ) -> Result<Environment, StoreError> {
        let rev = env.current_revision_id.clone();
        let published =
            match self.record_revision(app, &env, &rev, prefix, channels, answer, requested, wheels).await {
                Ok(revision) => self.persist(|catalog| {
                    match env.kind {
                        Kind::Starter => catalog.environments.retain(|e| e.id != env.id),
                        // Names are unique: a concurrent create may have taken it meanwhile.
                        Kind::Task => ids::check_new_name(&env.name, catalog.names())?,
                    }
                    catalog.environments.push(env.clone());
                    catalog.revisions.push(revision);
                    Ok(())
                }),
                Err(e) => Err(e),
            };
        if let Err(e) = published {
            let _ = remove_prefix(prefix);
            return Err(e);
        }
        Ok(env)
    }

    /// An empty prefix directory the sandbox user may write (its parents are runnerd's).
    fn fresh_prefix(&self, app: &App, env_id: &str, rev: &str) -> Result<PathBuf, StoreError> {
        let prefix = self.prefix_path(env_id, rev);
        let io = |source| StoreError::Io { path: prefix.clone(), source };
        let env_dir = catalog::ensure_env_dir(&open_dir(&self.root)?, env_id)?;
        let name =
            std::ffi::CString::new(rev).map_err(|_| io(std::io::Error::from_raw_os_error(libc::EINVAL)))?;
        crate::fsat::mkdir_at(&env_dir, &name, 0o755).map_err(io)?;
        let fd = crate::fsat::open_at(&env_dir, &name, libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW)
            .map_err(io)?;
        app.sandbox.user.hand_over(std::os::fd::AsFd::as_fd(&fd)).map_err(io)?;
        Ok(prefix)
    }

    /// A conda change as its two steps (`provision::Stage`): fetch with the prefix read-only,
    /// then link that solution with the caches read-only. The caller holds the environment's
    /// write gate across both, so the prefix the link step finds is the one the fetch step
    /// solved for. A fetch that fails has changed no prefix.
    async fn conda_change(
        &self,
        app: &App,
        op: Op,
        prefix: &Path,
        channels: &[String],
        extra_ro: &[PathBuf],
    ) -> Result<provision::Response, StoreError> {
        let fetch = self.conda_step(op.clone(), prefix, channels, extra_ro, provision::Stage::Fetch);
        let writing = self.cache_gate.write().await;
        let fetched = self.conda(app, fetch).await?;
        let solution = fetched.solution.ok_or_else(|| StoreError::Step {
            label: "conda",
            detail: "the provisioner's fetch step answered no solution".into(),
        })?;
        let link = self.conda_step(op, prefix, channels, extra_ro, provision::Stage::Link { solution });
        // Downgraded, not released: no other fetch may replace an entry this solution links
        // before the link step has copied it; other link steps may run meanwhile.
        let reading = writing.downgrade();
        let mut linked = self.conda(app, link).await?;
        drop(reading);
        linked.solve_micros = fetched.solve_micros;
        linked.peak_rss_kib = linked.peak_rss_kib.max(fetched.peak_rss_kib);
        Ok(linked)
    }

    /// Runs a provisioner step and reads its answer.
    async fn conda(&self, app: &App, step: sandboxed::Step) -> Result<provision::Response, StoreError> {
        let out = sandboxed::run(app, step).await?;
        if out.truncated {
            return Err(StoreError::Step {
                label: "conda",
                detail: "the provisioner's answer was larger than runnerd reads".into(),
            });
        }
        let answer: Option<provision::Response> = serde_json::from_str(out.stdout.trim()).ok();
        match (out.succeeded(), answer) {
            (true, Some(a)) if a.error.is_none() => Ok(a),
            (_, Some(a)) if a.error.is_some() => Err(self.step_error("conda", a.error.unwrap_or_default())),
            _ => Err(self.step_error("conda", step_failure(&out))),
        }
    }

    /// The revision record and its snapshot for the prefix as it is now.
    #[allow(clippy::too_many_arguments)]
    async fn record_revision(
        &self,
        app: &App,
        env: &Environment,
        rev: &str,
        prefix: &Path,
        channels: Vec<String>,
        answer: &provision::Response,
        requested: Vec<String>,
        wheels: Option<Vec<LocalWheel>>,
    ) -> Result<EnvironmentRevision, StoreError> {
        // Which interpreters the prefix has, from the provisioner's answer: never a look at
        // the prefix from the host, where a pip or R step may have planted links.
        let has = |name: &str| answer.installed.iter().any(|p| p.name == name);
        let too_large =
            |e: steps::InventoryTooLarge| StoreError::Step { label: "inventory", detail: e.to_string() };
        let python = match has("python") {
            true => match sandboxed::run(app, steps::python_inventory(prefix)).await {
                Ok(out) => steps::parse_python_inventory(&out.stdout).map_err(too_large)?,
                Err(_) => Vec::new(),
            },
            false => Vec::new(),
        };
        let r = match env.language == catalog::Language::R && has("r-base") {
            true => match sandboxed::run(app, steps::r_inventory(prefix)).await {
                Ok(out) => steps::parse_r_inventory(&out.stdout).map_err(too_large)?,
                Err(_) => Vec::new(),
            },
            false => Vec::new(),
        };
        if answer.installed.len() > steps::MAX_INVENTORY_ENTRIES {
            return Err(too_large(steps::InventoryTooLarge { language: "conda" }));
        }
        let installed = Installed {
            conda: answer.installed.iter().map(CondaPackage::from).collect(),
            python: python
                .into_iter()
                .map(|(name, version, installer)| PythonPackage { name, version, installer })
                .collect(),
            r: r.into_iter()
                .map(|(name, version, repository)| RPackage { name, version, repository })
                .collect(),
        };
        // Every revision's list stays in the catalog: a forged one (long channel or build
        // texts in conda records a package step wrote) fails the change, not the catalog.
        let bytes = serde_json::to_vec(&installed).map_or(usize::MAX, |b| b.len());
        if bytes > MAX_INSTALLED_BYTES {
            return Err(StoreError::Step {
                label: "inventory",
                detail: format!(
                    "the environment's package list takes {bytes} bytes, more than {MAX_INSTALLED_BYTES}; a package step may have forged its records"
                ),
            });
        }
        let snap = Snapshot::new(Parts {
            revision_id: rev.to_owned(),
            environment_id: env.id.clone(),
            language: env.language,
            created_at: crate::timefmt::now_iso(),
            channels,
            requested_changes: requested,
            installed,
            local_wheels: wheels.filter(|w| !w.is_empty()),
        });
        Ok(snap.record(&open_dir(&self.root)?)?)
    }

    /// `GET /environments`.
    pub(crate) async fn list(&self) -> Result<Vec<Environment>, StoreError> {
        self.require_available()?;
        Ok(self.cat().environments.clone())
    }

    /// `GET /environment-revisions`.
    pub(crate) async fn revisions(&self) -> Result<Vec<EnvironmentRevision>, StoreError> {
        self.require_available()?;
        Ok(self.cat().revisions.clone())
    }

    /// `GET /environment-revisions/:id/snapshot`: the stored bytes, re-verified.
    pub(crate) async fn snapshot(&self, id: &str) -> Result<Vec<u8>, StoreError> {
        self.require_available()?;
        let revision = self.cat().revision(id).cloned();
        let revision = revision.ok_or_else(|| StoreError::UnknownRevision(id.to_owned()))?;
        let dir = open_dir(&self.root)?;
        Ok(snapshot::read_verified(&dir, &revision.id, &revision.snapshot)?)
    }

    /// `POST /environments`: a task environment cloned from its base's current packages.
    pub(crate) async fn create(
        &self,
        app: &App,
        name: &str,
        language: Language,
        base: Option<&str>,
    ) -> Result<Environment, StoreError> {
        self.require_available()?;
        let lang = env_language(language);
        ids::check_new_name(name, self.cat().names())?;
        let base_id = base.unwrap_or(lang.starter_id());
        ids::check_env_id(base_id).map_err(|_| StoreError::NotFound(base_id.to_owned()))?;
        if base_id == STARTER_R && self.cat().environment(STARTER_R).is_none() {
            self.create_starter(app, Language::R).await?;
        }
        let _r = self.gates.read(base_id).await;
        let base_env = self.cat().environment(base_id).cloned();
        let base_env = base_env.ok_or_else(|| StoreError::NotFound(base_id.to_owned()))?;
        if base_env.language != lang {
            return Err(StoreError::Invalid(format!(
                "Base environment {base_id} is a {} environment, not {}",
                base_env.language.as_str(),
                lang.as_str()
            )));
        }
        ready(&base_env)?;
        let source = self.root.join(base_env.prefix_rel()?);
        let id = ids::new_task_env_id();
        let rev = ids::new_revision_id();
        let prefix = self.fresh_prefix(app, &id, &rev)?;
        let base_rev = self.cat().revision(&base_env.current_revision_id).cloned();
        let channels =
            self.conda_channels(&base_rev.as_ref().map(|r| r.channels.clone()).unwrap_or_default());
        let urls = self.channel_urls(&channels)?;
        let clone = Op::Clone { source: source.clone() };
        let answer = match self.conda_change(app, clone, &prefix, &urls, std::slice::from_ref(&source)).await
        {
            Ok(a) => a,
            Err(e) => {
                let _ = remove_prefix(&prefix);
                return Err(e);
            }
        };
        let env = new_environment(&id, name, Kind::Task, lang, &rev, Some(base_id));
        let wheels = base_rev.and_then(|r| r.local_wheels);
        // As the original: a clone records no requested change (its base is in the record).
        let requested = Vec::new();
        let env = self.publish_new(app, env, &prefix, channels, &answer, requested, wheels).await?;
        audit("environment_created", &id, &rev, name);
        Ok(env)
    }

    /// The environment a change may touch: it exists and is not a starter.
    async fn task_environment(&self, id: &str) -> Result<Environment, StoreError> {
        ids::check_env_id(id).map_err(|_| StoreError::NotFound(id.to_owned()))?;
        let env = self.cat().environment(id).cloned();
        let env = env.ok_or_else(|| StoreError::NotFound(id.to_owned()))?;
        if env.kind == Kind::Starter {
            return Err(StoreError::Invalid(format!(
                "Starter environment {id} is read-only; create a task environment from it and change that"
            )));
        }
        Ok(env)
    }

    /// Marks the environment `updating` on disk before any package is touched.
    async fn begin_update(&self, id: &str) -> Result<(), StoreError> {
        self.persist(|catalog| {
            catalog.begin_update(id, &crate::timefmt::now_iso());
            Ok(())
        })
    }

    /// `failed` with the original's text, keeping the current revision.
    async fn fail_update(&self, id: &str) {
        let failed = self.persist(|catalog| {
            catalog.fail_update(id, &crate::timefmt::now_iso());
            Ok(())
        });
        if let Err(e) = failed {
            // The disk still says `updating`: a restart marks it failed ("interrupted").
            tracing::error!(event = "environment_catalog_write_failed", environment = id, error = %crate::error_chain(&e));
        }
    }

    /// `POST /environments/:id/install`.
    pub(crate) async fn install(
        &self,
        app: &App,
        id: &str,
        req: InstallRequest,
    ) -> Result<EnvironmentRevision, StoreError> {
        self.require_available()?;
        let env = self.task_environment(id).await?;
        if req.packages.is_empty() {
            return Err(ids::IdError::NoPackages.into());
        }
        check_sources(req.manager, req.channels.as_deref(), req.index_url.as_deref())?;
        let (wheel_paths, specs): (Vec<String>, Vec<String>) = match req.manager {
            Manager::Pip => req.packages.iter().cloned().partition(|p| wheels::is_wheel_request(p)),
            _ => (Vec::new(), req.packages.clone()),
        };
        for s in &specs {
            ids::check_spec(s)?;
        }
        if wheel_paths.len() > wheels::MAX_WHEELS_PER_INSTALL {
            return Err(StoreError::Invalid(format!(
                "At most {} local wheels may be installed at once",
                wheels::MAX_WHEELS_PER_INSTALL
            )));
        }
        for w in &wheel_paths {
            wheels::parse_request(w)?;
        }
        let channels = match req.manager {
            Manager::Conda => {
                ids::allowed_channels(req.channels.as_deref().unwrap_or_default(), &self.settings.channels)?
            }
            _ => Vec::new(),
        };
        let offline = self.settings.offline();
        let pip_source = match (req.manager, &req.index_url) {
            (Manager::Pip, _) if offline => self.settings.package_cache_dir.clone().map(PipSource::Offline),
            // Only workspace wheels and no index named: nothing is fetched.
            (Manager::Pip, None) if specs.is_empty() => Some(PipSource::WheelsOnly),
            (Manager::Pip, Some(url)) => {
                ids::check_index_url(url)?;
                Some(PipSource::Index(url.clone()))
            }
            (Manager::Pip, None) => Some(PipSource::Index(PYPI.to_owned())),
            _ => None,
        };
        if matches!(req.manager, Manager::Cran | Manager::Bioconductor) {
            if offline {
                return Err(StoreError::Invalid(format!(
                    "{} installs are unavailable in offline package-cache mode",
                    if req.manager == Manager::Cran { "CRAN" } else { "Bioconductor" }
                )));
            }
            if env.language != catalog::Language::R {
                return Err(StoreError::Invalid(format!("Environment {id} is not an R environment")));
            }
        }
        // The workspace is found now; its wheels are copied only once the gate is held and
        // everything else about the request has been checked (issue #32).
        let workspace = match wheel_paths.is_empty() {
            true => None,
            false => {
                if req.workspace.key.is_none() && req.workspace.root.is_none() {
                    return Err(wheels::WheelError::NoWorkspace.into());
                }
                let located = crate::exec::locate(app, &req.workspace)
                    .map_err(|e| StoreError::Invalid(e.to_string()))?;
                Some(located.root)
            }
        };
        let _w = self.gates.write(id).await;
        // The record may have changed while this waited.
        let env = self.task_environment(id).await?;
        let current = self.cat().revision(&env.current_revision_id).cloned();
        // Everything that can fail before a package is touched, before `updating`.
        let prefix = self.root.join(env.prefix_rel()?);
        let kept = current.as_ref().and_then(|r| r.local_wheels.as_deref()).unwrap_or_default();
        let mut names = Vec::with_capacity(wheel_paths.len());
        for w in &wheel_paths {
            names.push(wheels::parse_request(w)?.filename);
        }
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        if wheels::carried_after(kept, &names) > wheels::MAX_WHEELS_PER_REVISION {
            return Err(StoreError::Invalid(format!(
                "Environment {id} would carry more than {} local wheels; create a new environment for more",
                wheels::MAX_WHEELS_PER_REVISION
            )));
        }
        let urls = self.channel_urls(&channels)?;
        let new_wheels = match &workspace {
            Some(root) => self.persist_wheels(app, root, &wheel_paths).await?,
            None => Vec::new(),
        };
        // Whatever happens from here (an abandoned request included), this install lets go
        // of its copies: a failed one's go, unless another install holds them or a live
        // revision names them.
        let held = HeldWheels { store: self, wheels: new_wheels };
        let args = (current, channels, urls, pip_source, specs, wheel_paths);
        self.install_held(app, &env, &req, &prefix, args, &held.wheels).await
    }

    /// Copies the workspace wheels into the store (hashed, up to gigabytes each, on the
    /// blocking pool), each held until [`Self::release_wheels`]; if one fails, those copied
    /// before it are released.
    async fn persist_wheels(
        &self,
        app: &App,
        workspace: &Path,
        paths: &[String],
    ) -> Result<Vec<LocalWheel>, StoreError> {
        let root_fd = crate::exec::workspace::open_beneath(&app.data_dir, workspace)
            .map_err(|e| StoreError::Invalid(e.to_string()))?;
        let dir = open_dir(&self.root)?;
        let paths = paths.to_vec();
        let in_use = self.wheels_in_use.clone();
        let (done, failed) = tokio::task::spawn_blocking(move || {
            let mut done = Vec::with_capacity(paths.len());
            for p in &paths {
                match wheels::persist(&dir, &root_fd, p, &in_use) {
                    Ok(w) => done.push(w),
                    Err(e) => return (done, Some(StoreError::from(e))),
                }
            }
            (done, None)
        })
        .await
        .map_err(|e| StoreError::Invalid(format!("Local wheels could not be copied: {e}")))?;
        match failed {
            None => Ok(done),
            Some(e) => {
                self.release_wheels(&done);
                Err(e)
            }
        }
    }

    /// Lets go of wheels an install copied ([`wheels::release`]).
    fn release_wheels(&self, held: &[LocalWheel]) {
        if held.is_empty() {
            return;
        }
        let Ok(dir) = open_dir(&self.root) else { return };
        let removed = wheels::release(&dir, held, &self.wheels_in_use, &|w| self.wheel_named(w));
        if removed > 0 {
            tracing::info!(
                event = "environment_wheels_removed",
                count = removed,
                reason = "the install that copied them did not land"
            );
        }
    }

    /// Whether a revision of an environment that still exists names `wheel` (read now, from
    /// the catalog in memory).
    fn wheel_named(&self, wheel: &LocalWheel) -> bool {
        named_by_live(&self.cat(), &wheel.content.hash, &wheel.filename)
    }

    /// The install once its gate is held and its wheels are copied: the step, then the new
    /// revision (or `failed`).
    async fn install_held(
        &self,
        app: &App,
        env: &Environment,
        req: &InstallRequest,
        prefix: &Path,
        (current, channels, urls, pip_source, specs, wheel_paths): InstallParts,
        new_wheels: &[LocalWheel],
    ) -> Result<EnvironmentRevision, StoreError> {
        let id = env.id.as_str();
        let prefix = prefix.to_path_buf();
        let new_wheels = new_wheels.to_vec();
        let wheel_files = new_wheels.iter().map(|w| self.wheel_path(w)).collect::<Result<Vec<_>, _>>()?;
        self.begin_update(id).await?;
        let outcome = match req.manager {
            Manager::Conda => {
                self.conda_change(app, Op::Install { specs: specs.clone() }, &prefix, &urls, &[]).await
            }
            Manager::Pip => {
                let source = pip_source.clone().unwrap_or(PipSource::Index(PYPI.to_owned()));
                self.run_tool(app, steps::pip(&prefix, &source, &specs, &wheel_files)).await
            }
            Manager::Cran | Manager::Bioconductor => {
                let mut step = steps::r_install(
                    &prefix,
                    req.manager == Manager::Bioconductor,
                    &self.settings.cran_repo,
                    &specs,
                );
                steps::pin_configured(&mut step, std::slice::from_ref(&self.settings.cran_repo));
                self.run_tool(app, step).await
            }
        };
        let answer = match outcome {
            Ok(a) => a,
            Err(e) => {
                self.fail_update(id).await;
                audit_failed("environment_install_failed", id, &e);
                return Err(e);
            }
        };
        let mut requested = snapshot::requested_install(req.manager, &specs);
        requested.extend(snapshot::requested_install(req.manager, &wheel_paths));
        let revision_channels = match (req.manager, &pip_source) {
            (Manager::Conda, _) => channels,
            (Manager::Pip, Some(PipSource::Index(url))) => vec![url.clone()],
            (Manager::Cran | Manager::Bioconductor, _) => vec![self.settings.cran_repo.clone()],
            _ => current.as_ref().map(|r| r.channels.clone()).unwrap_or_default(),
        };
        // Carried wheels are recorded only while their stored copy is intact.
        let store_dir = open_dir(&self.root)?;
        let mut wheels_kept = current.as_ref().and_then(|r| r.local_wheels.clone()).unwrap_or_default();
        wheels_kept.retain(|w| match wheels::verify_persisted(&store_dir, w) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(event = "environment_wheel_dropped", environment = id, wheel = %w.filename, error = %crate::error_chain(&e));
                false
            }
        });
        for w in new_wheels {
            wheels_kept.retain(|k| k.filename != w.filename);
            wheels_kept.push(w);
        }
        self.commit_change(app, env, &prefix, revision_channels, answer, requested, Some(wheels_kept)).await
    }

    /// `POST /environments/:id/uninstall` (conda packages).
    pub(crate) async fn uninstall(
        &self,
        app: &App,
        id: &str,
        packages: Vec<String>,
    ) -> Result<EnvironmentRevision, StoreError> {
        self.require_available()?;
        self.task_environment(id).await?;
        ids::check_specs(&packages)?;
        let _w = self.gates.write(id).await;
        let env = self.task_environment(id).await?;
        let current = self.cat().revision(&env.current_revision_id).cloned();
        let prefix = self.root.join(env.prefix_rel()?);
        let channels = self.conda_channels(&current.as_ref().map(|r| r.channels.clone()).unwrap_or_default());
        let urls = self.channel_urls(&channels)?;
        self.begin_update(id).await?;
        let remove = Op::Remove { names: packages.clone() };
        let answer = match self.conda_change(app, remove, &prefix, &urls, &[]).await {
            Ok(a) => a,
            Err(e) => {
                self.fail_update(id).await;
                audit_failed("environment_uninstall_failed", id, &e);
                return Err(e);
            }
        };
        let requested = snapshot::requested_removal(&packages);
        let wheels = current.and_then(|r| r.local_wheels);
        self.commit_change(app, &env, &prefix, channels, answer, requested, wheels).await
    }

    /// pip or R: run it, then list the conda packages (unchanged by them, but the record
    /// carries the whole inventory).
    async fn run_tool(&self, app: &App, step: sandboxed::Step) -> Result<provision::Response, StoreError> {
        let label = step.label;
        let prefix = step.binds[0].0.clone();
        let out = sandboxed::run(app, step).await?;
        if !out.succeeded() {
            return Err(self.step_error(label, step_failure(&out)));
        }
        let urls: Vec<String> = Vec::new();
        let places = CondaPlaces { offline: true, ..self.places() };
        let list = steps::conda(&places, Op::List, &prefix, &urls, &[], provision::Stage::Fetch);
        self.conda(app, list).await
    }

    /// A successful change: a new revision and snapshot, the environment ready on it.
    #[allow(clippy::too_many_arguments)]
    async fn commit_change(
        &self,
        app: &App,
        env: &Environment,
        prefix: &Path,
        channels: Vec<String>,
        answer: provision::Response,
        requested: Vec<String>,
        wheels: Option<Vec<LocalWheel>>,
    ) -> Result<EnvironmentRevision, StoreError> {
        let rev = ids::new_revision_id();
        let recorded =
            self.record_revision(app, env, &rev, prefix, channels, &answer, requested, wheels).await;
        let revision = match recorded {
            Ok(r) => r,
            Err(e) => {
                self.fail_update(&env.id).await;
                return Err(e);
            }
        };
        let committed = self.persist(|catalog| {
            catalog.commit_revision(revision.clone(), &crate::timefmt::now_iso());
            Ok(())
        });
        if let Err(e) = committed {
            self.fail_update(&env.id).await;
            return Err(e);
        }
        audit("environment_changed", &env.id, &rev, &revision.packages.len().to_string());
        Ok(revision)
    }

    fn step_error(&self, label: &'static str, detail: String) -> StoreError {
        StoreError::Step { label, detail: with_file_limit(detail, self.settings.step_max_file_bytes) }
    }

    fn wheel_path(&self, w: &LocalWheel) -> Result<PathBuf, StoreError> {
        Ok(self.root.join(wheels::stored_rel_path(w)?))
    }

    /// `DELETE /environments/:id`: the prefix goes; revisions and snapshots stay.
    pub(crate) async fn delete(&self, id: &str) -> Result<String, StoreError> {
        self.require_available()?;
        if id == STARTER_PYTHON || id == STARTER_R {
            return Err(StoreError::Invalid(format!("Starter environment {id} cannot be deleted")));
        }
        self.task_environment(id).await?;
        let _w = self.gates.write(id).await;
        let kept = self.persist(|catalog| {
            if catalog.environment(id).is_none() {
                return Err(StoreError::NotFound(id.to_owned()));
            }
            catalog.environments.retain(|e| e.id != id);
            Ok(catalog.revisions_of(id).count())
        })?;
        // Its wheels no live environment names go with it (nothing installs from a deleted
        // environment's revisions again).
        let carried: Vec<LocalWheel> =
            self.cat().revisions_of(id).flat_map(|r| r.local_wheels.iter().flatten().cloned()).collect();
        if let Ok(dir) = open_dir(&self.root) {
            wheels::forget(&dir, &carried, &self.wheels_in_use, &|w| self.wheel_named(w));
        }
        // A prefix may hold whatever a pip or R step left (millions of files): removed on the
        // blocking pool, never on an async worker.
        let root = open_dir(&self.root)?;
        let owned = id.to_owned();
        let removed = tokio::task::spawn_blocking(move || catalog::remove_env_dir(&root, &owned)).await;
        match removed {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::warn!(event = "environment_prefix_left", environment = id, error = %crate::error_chain(&e))
            }
            Err(e) => tracing::warn!(event = "environment_prefix_left", environment = id, error = %e),
        }
        audit("environment_deleted", id, "", &format!("{kept} revisions and their snapshots kept"));
        Ok(id.to_owned())
    }

    /// The environment an execution names, checked at `prepare` (the texts of contract §2A).
    pub(crate) fn select(
        &self,
        language: Language,
        environment_id: Option<&str>,
        revision_id: Option<&str>,
    ) -> Result<Selection, StoreError> {
        self.require_available()?;
        let environment_id = match (environment_id, revision_id) {
            (Some(e), _) => e.to_owned(),
            (None, Some(rev)) => {
                let catalog = self.cat();
                let revision = catalog.revision(rev).ok_or_else(|| {
                    StoreError::Invalid("Unknown environment revision; select a current environment".into())
                })?;
                revision.environment_id.clone()
            }
            // There once an R environment was created (starter-r is its base); an execution
            // never installs it (issue #30: the original answers 400 until then).
            (None, None) if language == Language::R => STARTER_R.to_owned(),
            (None, None) => STARTER_PYTHON.to_owned(),
        };
        Ok(Selection { environment_id, revision_id: revision_id.map(str::to_owned), language })
    }

    /// The read lease for a run that is about to start.
    pub(crate) async fn lease(&self, selection: &Selection) -> Result<Runtime, StoreError> {
        let guard = self.gates.read(&selection.environment_id).await;
        let catalog = self.cat();
        let env = catalog.environment(&selection.environment_id).cloned().ok_or_else(|| {
            StoreError::Invalid(format!("Unknown scientific environment: {}", selection.environment_id))
        })?;
        drop(catalog);
        if let Some(rev) = &selection.revision_id
            && *rev != env.current_revision_id
        {
            return Err(StoreError::Invalid(
                "Historical environment revisions are audit-only; select the latest environment".into(),
            ));
        }
        if selection.language != Language::Shell && env.language != env_language(selection.language) {
            return Err(StoreError::Invalid(format!(
                "Environment {} is a {} environment, not {}",
                env.id,
                env.language.as_str(),
                env_language(selection.language).as_str()
            )));
        }
        ready(&env)?;
        let masks = match selection.language {
            Language::Shell => Vec::new(),
            _ => self.masks.clone(),
        };
        Ok(Runtime {
            prefix: self.root.join(env.prefix_rel()?),
            revision_id: env.current_revision_id,
            masks,
            _guard: guard,
        })
    }
}

/// A new environment, ready on its first revision (which is also its prefix's).
fn new_environment(
    id: &str,
    name: &str,
    kind: Kind,
    language: catalog::Language,
    rev: &str,
    base: Option<&str>,
) -> Environment {
    let now = crate::timefmt::now_iso();
    Environment {
        id: id.to_owned(),
        name: name.to_owned(),
        kind,
        language,
        status: Status::Ready,
        current_revision_id: rev.to_owned(),
        runtime_revision_id: Some(rev.to_owned()),
        base_environment_id: base.map(str::to_owned),
        created_at: now.clone(),
        updated_at: now,
        error: None,
    }
}

/// `Environment <id> is <status>; repair it …`.
fn ready(env: &Environment) -> Result<(), StoreError> {
    match env.status {
        Status::Ready => Ok(()),
        status => Err(StoreError::Invalid(format!(
            "Environment {} is {}; repair it through environment management before execution",
            env.id,
            status.as_str()
        ))),
    }
}

fn starter_ready(catalog: &Catalog, id: &str) -> bool {
    catalog.environment(id).is_some_and(|e| e.status == Status::Ready)
}

/// What an install checked before its gate, for [`EnvStore::install_held`]: the current
/// revision, the conda channels and their URLs, pip's source, the specs, the wheel paths.
type InstallParts =
    (Option<EnvironmentRevision>, Vec<String>, Vec<String>, Option<PipSource>, Vec<String>, Vec<String>);

/// The wheels an install copied, let go of when it ends however it ends.
struct HeldWheels<'a> {
    store: &'a EnvStore,
    wheels: Vec<LocalWheel>,
}

impl Drop for HeldWheels<'_> {
    fn drop(&mut self) {
        self.store.release_wheels(&self.wheels);
    }
}

/// Whether a revision of an environment the catalog still holds names the stored wheel
/// `hash`/`filename`: a deleted environment's revisions stay as records, but nothing
/// installs from them again.
fn named_by_live(catalog: &Catalog, hash: &str, filename: &str) -> bool {
    catalog.environments.iter().any(|env| {
        catalog.revisions_of(&env.id).any(|r| {
            r.local_wheels.iter().flatten().any(|w| w.content.hash == hash && w.filename == filename)
        })
    })
}

/// A step's own failure text, with the limit named when a write failed with `EFBIG` (the
/// provisioner and Python ignore `SIGXFSZ`, so `RLIMIT_FSIZE` reaches them as an error).
fn with_file_limit(detail: String, max_file: u64) -> String {
    let efbig = ["File too large", "os error 27", "Errno 27"].iter().any(|t| detail.contains(t));
    match efbig && max_file > 0 {
        true => format!(
            "{detail} (a provisioning step may write no file larger than {max_file} bytes: env_step_max_file_bytes, SCIENCE_AGENT_ENV_STEP_MAX_FILE_BYTES)"
        ),
        false => detail,
    }
}

fn step_failure(out: &StepOutput) -> String {
    let tail = out.tail();
    match (out.code, tail.is_empty()) {
        (Some(c), true) => format!("exited with code {c}"),
        (None, true) => "was killed by a signal".to_owned(),
        (_, false) => tail,
    }
}

fn audit(event: &'static str, environment: &str, revision: &str, detail: &str) {
    tracing::info!(event, environment, revision, detail);
}

fn audit_failed(event: &'static str, environment: &str, e: &StoreError) {
    tracing::warn!(event, environment, error = %crate::error_chain(e));
}

/// Removes every `revisions/<env>/<rev>/` that no environment's prefix is (a create that a
/// crash interrupted, a delete that stopped half way); revision records and snapshots are
/// elsewhere and stay. Links are removed, never followed. Returns how many went.
fn sweep_orphan_prefixes(revisions: &Path, catalog: &Catalog) -> usize {
    let live: std::collections::HashSet<(String, String)> =
        catalog.environments.iter().map(|e| (e.id.clone(), e.runtime_revision().to_owned())).collect();
    let Ok(top) = crate::fsat::open_path(revisions, libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW)
    else {
        return 0;
    };
    let mut swept = 0;
    for (env, env_c) in crate::fsat::names(&top).unwrap_or_default() {
        let env = env.to_string_lossy().into_owned();
        let keep_env = live.iter().any(|(e, _)| *e == env);
        let Ok(env_dir) = crate::fsat::open_dir_at(&top, &env_c) else {
            // Not a directory (or a link): nothing the store made.
            if crate::fsat::unlink_at(&top, &env_c).is_ok() {
                swept += 1;
            }
            continue;
        };
        for (rev, rev_c) in crate::fsat::names(&env_dir).unwrap_or_default() {
            let rev = rev.to_string_lossy().into_owned();
            if keep_env && live.contains(&(env.clone(), rev)) {
                continue;
            }
            if crate::fsat::remove_tree_at(&env_dir, &rev_c).is_ok() {
                swept += 1;
            }
        }
        if !keep_env {
            let _ = crate::fsat::rmdir_at(&top, &env_c);
        }
    }
    swept
}

/// The package cache: the provisioner (as the sandbox user) unpacks packages into it. One
/// runnerd made is handed to that user; an operator's is used as it is.
fn prepare_cache(cache: &Path, user: &crate::sandbox::user::Identity) -> Result<(), StoreError> {
    // `pkgs/` too: a link step (the cache read-only) must find the layer there, even when
    // every package came from the operator's cache and no fetch step wrote one.
    for dir in [cache.to_path_buf(), cache.join("pkgs")] {
        let io = |source| StoreError::Io { path: dir.clone(), source };
        if dir.exists() {
            continue;
        }
        std::fs::create_dir_all(&dir).map_err(io)?;
        let fd =
            crate::fsat::open_path(&dir, libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW).map_err(io)?;
        user.hand_over(std::os::fd::AsFd::as_fd(&fd)).map_err(io)?;
    }
    Ok(())
}

fn open_dir(path: &Path) -> Result<std::os::fd::OwnedFd, StoreError> {
    crate::fsat::open_path(path, libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW)
        .map_err(|source| StoreError::Io { path: path.to_path_buf(), source })
}

/// Removes a prefix (or an environment's revisions directory), never following a link.
fn remove_prefix(path: &Path) -> std::io::Result<()> {
    let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else { return Ok(()) };
    let dir = crate::fsat::open_path(parent, libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW)?;
    let name = std::ffi::CString::new(std::os::unix::ffi::OsStrExt::as_bytes(name))
        .map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    match crate::fsat::remove_tree_at(&dir, &name) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        r => r,
    }
}

/// The provisioner is a regular file the sandbox user may execute.
fn check_provisioner(path: &Path, user: &crate::sandbox::user::Identity) -> Result<String, String> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path).map_err(|e| format!("{} could not be read: {e}", path.display()))?;
    if !meta.is_file() {
        return Err(format!("{} is not a regular file", path.display()));
    }
    let mode = meta.mode();
    let bits = if user.uid == meta.uid() {
        mode >> 6
    } else if user.gid == meta.gid() {
        mode >> 3
    } else {
        mode
    };
    if bits & 0o1 == 0 {
        return Err(format!("{} is not executable by the sandbox user {}", path.display(), user.name));
    }
    Ok(format!("{} at {}", catalog::PROVISIONER, path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_stopped_by_the_file_limit_names_it() {
        for (detail, max, named) in [
            ("OSError: [Errno 27] File too large: '/p/lib/x'", 1 << 20, true),
            ("The packages could not be installed into /p: File too large (os error 27)", 1 << 20, true),
            ("ERROR: No matching distribution found for nothing", 1 << 20, false),
            ("OSError: [Errno 27] File too large", 0, false),
        ] {
            let out = with_file_limit(detail.to_owned(), max);
            assert_eq!(out.contains("env_step_max_file_bytes"), named, "{out}");
            assert!(out.starts_with(detail), "the step's own words come first: {out}");
        }
    }

    #[test]
    fn interpreter_names_are_the_originals_pattern() {
        for (name, yes) in [
            ("python", true),
            ("python3", true),
            ("python3.11", true),
            ("R", true),
            ("Rscript", true),
            ("python3.", false),
            ("python3.11-config", false),
            ("pythonic-tool", false),
            ("python2", false),
            ("Rscript2", false),
        ] {
            assert_eq!(is_interpreter_name(name), yes, "{name}");
        }
    }

    #[test]
    fn prefixes_no_environment_names_are_swept_and_live_ones_kept() {
        let dir = tempfile::tempdir().unwrap();
        let revisions = dir.path().join("revisions");
        for p in ["task-a/rev-1/bin", "task-a/rev-2", "task-gone/rev-3", "starter-python/rev-4"] {
            std::fs::create_dir_all(revisions.join(p)).unwrap();
        }
        let outside = dir.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        std::fs::write(outside.join("keep"), b"x").unwrap();
        std::os::unix::fs::symlink(&outside, revisions.join("task-a/rev-link")).unwrap();
        let mut catalog = Catalog::default();
        for (id, rev) in [("task-a", "rev-1"), ("starter-python", "rev-4")] {
            let mut e = catalog::tests::environment(id, rev);
            e.runtime_revision_id = Some(rev.to_owned());
            catalog.environments.push(e);
        }
        assert_eq!(sweep_orphan_prefixes(&revisions, &catalog), 3);
        assert!(revisions.join("task-a/rev-1/bin").is_dir());
        assert!(revisions.join("starter-python/rev-4").is_dir());
        assert!(!revisions.join("task-a/rev-2").exists() && !revisions.join("task-gone").exists());
        assert!(outside.join("keep").exists(), "a link is removed, not followed");
        assert_eq!(sweep_orphan_prefixes(&revisions, &catalog), 0);
    }

    #[test]
    fn masks_are_resolved_deduplicated_and_skip_dangling_links() {
        let dir = tempfile::tempdir().unwrap();
        let bin = dir.path();
        std::fs::write(bin.join("python3.11"), b"elf").unwrap();
        for link in ["python", "python3"] {
            std::os::unix::fs::symlink("python3.11", bin.join(link)).unwrap();
        }
        std::os::unix::fs::symlink("/nonexistent/Rscript", bin.join("Rscript")).unwrap();
        std::fs::write(bin.join("pythonic-tool"), b"x").unwrap();
        let real = std::fs::canonicalize(bin.join("python3.11")).unwrap();
        assert_eq!(host_interpreters(bin), [real]);
    }

    #[test]
    fn a_source_the_manager_does_not_use_is_refused() {
        let ch = vec!["conda-forge".to_owned()];
        type Case<'a> = (Manager, Option<&'a [String]>, Option<&'a str>, Option<&'a str>);
        let cases: &[Case] = &[
            (Manager::Conda, Some(&ch), None, None),
            (Manager::Pip, None, Some("https://x/simple"), None),
            (Manager::Pip, Some(&[]), None, None),
            (
                Manager::Conda,
                None,
                Some("https://x/simple"),
                Some("indexUrl is only supported for pip installs"),
            ),
            (
                Manager::Cran,
                None,
                Some("https://x/simple"),
                Some("indexUrl is only supported for pip installs"),
            ),
            (Manager::Pip, Some(&ch), None, Some("channels are only supported for conda installs")),
            (Manager::Cran, Some(&ch), None, Some("channels are only supported for conda installs")),
        ];
        for (manager, channels, index, want) in cases {
            let got = check_sources(*manager, *channels, *index).err().map(|e| e.to_string());
            assert_eq!(got.as_deref(), *want, "{manager:?} {channels:?} {index:?}");
        }
    }
}
