//! Start-up of the sandbox side of runnerd (R-API-5): resolve and check bwrap, publish the
//! seccomp programs, choose the (never root) sandbox user, start the launcher, and run the probes.
//! The HTTP server opens its port only after this returns.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::seccomp::{self, Arch, Profile, SeccompError};

use crate::isolation::{Bubblewrap, Isolation};
use crate::launch::{LaunchError, LaunchIdentity, Launcher};
use crate::sandbox::HostRuntime;
use crate::sandbox::host;
use crate::sandbox::preflight::{self, Capability, CapabilityCache, PreflightError, Warning};
use crate::sandbox::user::{self, Identity, UserError};

/// Where to find things; the daemon's configuration fills this in.
#[derive(Debug, Clone)]
pub struct SandboxConfig {
    /// `SCIENCE_AGENT_BWRAP_PATH`: a name searched in `PATH`, or a path.
    pub bwrap: String,
    /// `SCIENCE_AGENT_DATA_DIR`.
    pub data_dir: PathBuf,
    pub sandbox_init: PathBuf,
    /// `SCIENCE_AGENT_SANDBOX_USER`: who sandboxes run as when runnerd is root.
    pub sandbox_user: Option<String>,
    /// `--dev`: a root start may fall back to `nobody` for sandboxes.
    pub dev: bool,
    /// Sandboxes started ahead for executions (issue #37).
    pub prestart: crate::isolation::PrestartSettings,
    /// The executions' default backend and the microvm backend's settings (issue #36).
    pub isolation: crate::isolation::select::IsolationSettings,
}

/// Everything executions need from start-up.
#[derive(Debug)]
pub struct SandboxRuntime {
    /// Every sandbox starts here ([`crate::isolation`]); the fields below are the bubblewrap
    /// backend's start-up facts, for `/health`, `--check-config`, the probes and the bench.
    pub isolation: Arc<dyn Isolation>,
    pub launcher: Arc<Launcher>,
    pub bwrap: PathBuf,
    pub host: HostRuntime,
    /// The host user every sandbox runs as (never root).
    pub user: Identity,
    pub capability: Capability,
    pub features: preflight::BwrapFeatures,
    /// Whether workspaces owned by another user can be mounted idmapped (issue #30).
    pub idmap: crate::sandbox::ownership::IdmapSupport,
    pub warnings: Vec<Warning>,
    pub seccomp_files: Vec<PathBuf>,
    pub probes: CapabilityCache,
    /// The microvm backend (issue #36), built whatever the default; its `unavailable` says
    /// why it cannot run here.
    pub microvm: Arc<crate::isolation::Microvm>,
    /// The backend of executions that name none.
    pub default_backend: crate::isolation::select::Backend,
}

impl SandboxRuntime {
    /// The backend an execution runs in. Everything else (provisioning, probes, selftest)
    /// uses [`SandboxRuntime::isolation`].
    pub fn backend(&self, backend: crate::isolation::select::Backend) -> &dyn Isolation {
        match backend {
            crate::isolation::select::Backend::Bwrap => &*self.isolation,
            crate::isolation::select::Backend::Microvm => &*self.microvm,
        }
    }

    /// A workspace's call ended (its version committed): each backend starts what waits for
    /// that workspace's next call, if it ran the call ([`Isolation::call_ended`]).
    pub fn call_ended(&self, workspace: &std::path::Path) {
        self.isolation.call_ended(workspace);
        self.microvm.call_ended(workspace);
    }

    /// An execution of `workspace` runs in `backend`: what the other backend keeps waiting
    /// for that workspace was made for a call of another backend, cannot serve the next one,
    /// and goes (a VM booted ahead holds a tenant's place and about 280 MiB under TCG).
    pub fn running_in(&self, backend: crate::isolation::select::Backend, workspace: &std::path::Path) {
        let other: &dyn Isolation = match backend {
            crate::isolation::select::Backend::Bwrap => &*self.microvm,
            crate::isolation::select::Backend::Microvm => &*self.isolation,
        };
        other.forget(
            crate::isolation::prestart::Scope::Exactly(workspace),
            crate::isolation::prestart::Discard::Shape,
        );
    }

    /// Discards what waits, in every backend, for the workspaces in `scope` ([`Isolation::forget`]).
    pub fn forget(
        &self,
        scope: crate::isolation::prestart::Scope<'_>,
        why: crate::isolation::prestart::Discard,
    ) {
        self.isolation.forget(scope, why);
        self.microvm.forget(scope, why);
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StartupError {
    #[error(transparent)]
    Preflight(#[from] PreflightError),
    #[error("could not publish the seccomp programs under {dir}")]
    Seccomp {
        dir: PathBuf,
        #[source]
        source: SeccompError,
    },
    #[error(transparent)]
    User(#[from] UserError),
    #[error(
        "sandboxes run as {user}, who cannot reach the data directory {data_dir}: {blocked} (mode {mode:o}) is not \
         searchable for that user; allow it (chmod o+x, or a group the user has) or choose another data directory"
    )]
    DataDirUnreachable { user: String, data_dir: PathBuf, blocked: PathBuf, mode: u32 },
    #[error("could not start the sandbox launcher (sandbox-init at {path})")]
    Launcher {
        path: PathBuf,
        #[source]
        source: LaunchError,
    },
    #[error(
        "sandbox-init was not found at {0}; set SCIENCE_AGENT_SANDBOX_INIT_PATH or install it next to runnerd"
    )]
    SandboxInitMissing(PathBuf),
}

/// `sandbox-init` next to the running executable (a cargo build, or /usr/libexec in a
/// package where runnerd is linked there too), unless configured.
pub fn locate_sandbox_init(configured: Option<PathBuf>) -> PathBuf {
    locate_helper(configured, "sandbox-init")
}

/// A helper binary: as configured, else next to the running executable (a cargo build, or
/// a package that links runnerd into libexec), else the package's libexec directory.
pub fn locate_helper(configured: Option<PathBuf>, name: &str) -> PathBuf {
    if let Some(path) = configured {
        return path;
    }
    let beside = std::env::current_exe().ok().and_then(|exe| exe.parent().map(|d| d.join(name)));
    match beside {
        Some(path) if path.exists() => path,
        _ => PathBuf::from("/usr/libexec/sciencediscovery").join(name),
    }
}

/// Runs the whole sequence. Missing or inadequate bwrap is fatal (as in the original); an
/// unusable sandbox is not — it is reported in the capability and warnings.
pub async fn prepare(config: &SandboxConfig) -> Result<SandboxRuntime, StartupError> {
    let bwrap = preflight::resolve_bwrap(&config.bwrap, std::env::var_os("PATH").as_deref())?;
    let features = preflight::check_bwrap_options(&bwrap).await?;
    let seccomp_files = publish_seccomp(&config.data_dir)?;
    let user = user::resolve(config.sandbox_user.as_deref(), config.dev)?;
    if let Some((blocked, mode)) = user::unreachable_component(&user, &config.data_dir) {
        return Err(StartupError::DataDirUnreachable {
            user: user.describe(),
            data_dir: config.data_dir.clone(),
            blocked,
            mode,
        });
    }
    let host = host::detect_host_runtime();
    if !config.sandbox_init.exists() {
        return Err(StartupError::SandboxInitMissing(config.sandbox_init.clone()));
    }
    let launcher = Launcher::new(config.sandbox_init.clone(), LaunchIdentity::of(&user))
        .map_err(|source| StartupError::Launcher { path: config.sandbox_init.clone(), source })?;
    let probes = CapabilityCache::default();
    let capability = probes.get(&launcher, &bwrap).await;
    let mut warnings = preflight::warnings(&bwrap.to_string_lossy(), &capability);
    if capability.sandbox_usable && !features.bind_fd {
        warnings.push(Warning {
            event: "sandbox_option_unavailable",
            text: format!(
                "bubblewrap at \"{}\" has no --bind-fd (bwrap < 0.8): workspaces are bound by path, re-checked just \
                 before each launch, which leaves a short window in which a sandbox that can rename directories of \
                 another workspace could redirect its bind. Upgrade bubblewrap to close it.",
                bwrap.display()
            ),
        });
    }
    let idmap = crate::sandbox::ownership::probe(
        &launcher,
        &bwrap,
        &capability,
        features.bind_fd,
        &user,
        &config.data_dir,
    )
    .await;
    if let crate::sandbox::ownership::IdmapSupport::Unavailable(_) = &idmap {
        warnings.push(Warning {
            event: "workspace_idmap_unavailable",
            text: format!("idmapped workspaces: {}", idmap.describe()),
        });
    }
    let launcher = Arc::new(launcher);
    let isolation = Arc::new(
        Bubblewrap::new(
            bwrap.clone(),
            launcher.clone(),
            capability.shape(),
            preflight::sandbox_unusable_message(&bwrap.to_string_lossy(), capability.detail.as_deref()),
            features.bind_fd,
        )
        .with_prestart(config.prestart),
    );
    let mut microvm_settings = config.isolation.microvm.clone();
    microvm_settings.pool.idle = config.prestart.idle;
    let mut microvm = crate::isolation::Microvm::new(
        microvm_settings,
        bwrap.clone(),
        launcher.clone(),
        user.clone(),
        capability.shape(),
        features.bind_fd,
    );
    microvm.probe_kvm().await;
    let microvm = Arc::new(microvm);
    microvm.try_kvm();
    Ok(SandboxRuntime {
        isolation,
        launcher,
        bwrap,
        host,
        user,
        capability,
        features,
        idmap,
        warnings,
        seccomp_files,
        probes,
        microvm,
        default_backend: config.isolation.default,
    })
}

/// Publishes every profile for this machine's architecture.
pub fn publish_seccomp(data_dir: &Path) -> Result<Vec<PathBuf>, StartupError> {
    let dir = data_dir.join(common::layout::RUNTIME);
    let err = |source| StartupError::Seccomp { dir: dir.clone(), source };
    let arch = Arch::host().map_err(err)?;
    Profile::ALL.iter().map(|p| seccomp::publish(&dir, *p, arch).map_err(err)).collect()
}

/// runnerd's own confinement, as the kernel reports it (`/proc/self/status`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnConfinement {
    pub no_new_privs: bool,
    /// `none`, `strict` or `filter` (a filter runnerd inherited, e.g. the unit's
    /// `SystemCallFilter=`; runnerd installs none on itself).
    pub seccomp: String,
    /// The effective capability set, hex.
    pub capabilities: String,
}

/// Reads the `NoNewPrivs`, `Seccomp` and `CapEff` lines of a `/proc/<pid>/status` text.
pub fn own_confinement(status: &str) -> OwnConfinement {
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .map(str::trim)
            .unwrap_or("unknown")
            .to_owned()
    };
    let seccomp = match field("Seccomp").as_str() {
        "0" => "none".to_owned(),
        "1" => "strict".to_owned(),
        "2" => "filter".to_owned(),
        other => other.to_owned(),
    };
    OwnConfinement { no_new_privs: field("NoNewPrivs") == "1", seccomp, capabilities: field("CapEff") }
}

/// The `confinement` audit record. runnerd cannot landlock or seccomp-filter itself the way
/// egressd does: bwrap, which it runs for every sandbox, must create namespaces and mount
/// host paths, and landlock or a mount-denying filter on runnerd would be inherited by it.
/// What protects runnerd is the service manager's hardening around it and each sandbox's own
/// confinement (namespaces, a seccomp profile, no_new_privs, rlimits) below it.
pub fn log_confinement() {
    let own = own_confinement(&std::fs::read_to_string("/proc/self/status").unwrap_or_default());
    tracing::info!(
        event = "confinement",
        landlock = "not applied: bwrap must mount each sandbox's filesystem, and would inherit it",
        seccomp = %own.seccomp,
        no_new_privs = own.no_new_privs,
        capabilities = %own.capabilities,
        protected_by = "the service manager's hardening of runnerd; per sandbox: namespaces, seccomp profile, no_new_privs, rlimits",
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_confinement_reads_the_kernel_status_lines() {
        let status =
            "Name:\trunnerd\nCapEff:\t0000000000000000\nNoNewPrivs:\t1\nSeccomp:\t2\nSeccomp_filters:\t1\n";
        assert_eq!(
            own_confinement(status),
            OwnConfinement {
                no_new_privs: true,
                seccomp: "filter".into(),
                capabilities: "0000000000000000".into()
            }
        );
        let bare = own_confinement("Name:\trunnerd\n");
        assert_eq!((bare.no_new_privs, bare.seccomp.as_str()), (false, "unknown"));
    }
}
