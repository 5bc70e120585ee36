//! From a parsed request to a run, decided once (contract §2A steps 5–9 and the checks after
//! them; the workspace is found first by `crate::workspace::locate`): the synchronous routes'
//! admission ([`admit`]: mounts, the bounded queue, then the id), both routes' mounts check
//! and budgets, and everything the sandbox needs ([`prepare`] → [`Prepared`]), with the
//! deferred cwd found ([`resolve_cwd`]) and the egress gateway held ([`attach_egress`]) when
//! the run starts.

use std::path::{Path, PathBuf};

use common::egress::protocol::GatewayPolicy;
use common::egress::route::ProxySetting;
use common::seccomp::Profile;
use serde_json::Value;
use std::time::Instant;

use super::request::NetworkMode;
use super::{EngineError, ErrorCode, MAX_EXECUTION_ID, admission, profile_for, request};
use crate::app::App;
use crate::sandbox::Language;
use crate::workspace::{self, Located};

/// How the routes differ in one engine: the synchronous routes honour `executionTimeoutMs`
/// and run at once; the managed route has no deadline (the caller's concern, contract §3)
/// and is validated before it queues, so its `cwd` is found when it starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunOptions {
    pub honour_timeout: bool,
    /// Check `cwd` now but find its directory when the run starts ([`resolve_cwd`]).
    pub defer_cwd: bool,
}

impl RunOptions {
    pub const SYNC: RunOptions = RunOptions { honour_timeout: true, defer_cwd: false };
    pub const MANAGED: RunOptions = RunOptions { honour_timeout: false, defer_cwd: true };
}

/// The mounts check (step 5), both routes': exactly one read-write workspace mount.
pub fn check_mounts(req: &request::ExecRequest) -> Result<(), EngineError> {
    match req.single_workspace_mount {
        true => Ok(()),
        false => Err(request::mounts_error(req.language)),
    }
}

/// The output and workspace budgets of a request (`maxOutputBytes`, `maxWorkspaceBytes`):
/// its own, else the configured defaults. Both routes', decided once here.
pub fn budgets(app: &App, req: &request::ExecRequest) -> (u64, u64) {
    let cfg = &app.config;
    (
        req.max_output_bytes.unwrap_or(cfg.max_output_bytes),
        req.max_workspace_bytes.unwrap_or(cfg.max_workspace_bytes),
    )
}

/// A synchronous execution's admission (steps 5–9): the mounts, a place in the bounded
/// queue, then the id — length, the 60 s dedupe, blank — and the agent.
pub fn admit(app: &App, req: &request::ExecRequest) -> Result<admission::Ticket, EngineError> {
    check_mounts(req)?;
    // Ours: a full queue answers 503 before the id is recorded, so a retry after
    // `Retry-After` is not refused as a duplicate.
    let ticket = app.admission.admit();
    app.metrics.admission(ticket.is_ok());
    let ticket = ticket?;
    let id = &req.execution_id;
    if id.len() > MAX_EXECUTION_ID {
        return Err(EngineError::invalid(
            ErrorCode::ExecutionIdTooLong,
            format!("Execution ID must be at most {MAX_EXECUTION_ID} bytes"),
        ));
    }
    if !app.recent_ids.record(id, Instant::now()) {
        return Err(EngineError::Duplicate);
    }
    if id.trim().is_empty() {
        return Err(EngineError::invalid(ErrorCode::ExecutionIdRequired, "Execution ID is required"));
    }
    if req.agent_id.trim().is_empty() {
        return Err(EngineError::invalid(ErrorCode::AgentIdRequired, "Agent ID is required"));
    }
    Ok(ticket)
}

/// A validated request, ready to run: everything the sandbox needs, decided once.
#[derive(Debug)]
pub struct Prepared {
    pub language: Language,
    pub root: PathBuf,
    pub read_only: Option<PathBuf>,
    pub execution_id: String,
    pub session_id: String,
    pub agent_id: String,
    pub code: String,
    pub environment_revision_id: String,
    /// The scientific environment to lease when the run starts (`crate::envs`).
    pub environment: Option<crate::envs::store::Selection>,
    pub network: request::NetworkAccess,
    /// How allowed egress leaves this host (`sandboxEgressProxy`).
    pub egress_route: ProxySetting,
    /// The gateway held for this run ([`attach_egress`]); `None` without network.
    pub egress: Option<crate::egress::EgressLease>,
    /// The seccomp profile, decided here once: the audit, the metrics and the sandbox use it.
    pub profile: Profile,
    /// 0: no deadline (always for managed runs).
    pub timeout_ms: u64,
    pub max_output: u64,
    pub max_workspace: u64,
    /// The working directory, found beneath the workspace.
    pub cwd: Option<String>,
    /// A `cwd` checked but not yet found ([`RunOptions::defer_cwd`]).
    pub deferred_cwd: Option<String>,
    /// `npuDevices` / `gpuDevices`, validated; probed right before the launch (R-NPU-2).
    pub npu_devices: Vec<u32>,
    pub gpu_devices: Vec<u32>,
    /// Memory, processes, CPU and `/tmp` size for this run (`resourceLimits`, issue #8).
    pub limits: crate::limits::Limits,
    /// `skillPackagesRoot`, resolved; verified again right before the launch.
    pub skills: Option<crate::skills::Requested>,
    /// Keeps that package from being deleted until this execution has ended (issue #32).
    pub skill_hold: Option<crate::skills::in_use::Hold>,
    /// The backend this run uses (issue #36; `crate::exec::backend`).
    pub isolation: crate::isolation::select::Backend,
}

/// The environment a run uses (contract §2A "Environment selection"): with the store
/// available, Python and R run in one (`starter-<language>` unless a revision is named) and a
/// shell run in the one it names; otherwise the original's capability errors. The result's
/// `environmentRevisionId` is the runtime's once it is leased.
fn select_environment(
    app: &App,
    req: &request::ExecRequest,
    epoch_revision: Option<&str>,
) -> Result<(String, Option<crate::envs::store::Selection>), EngineError> {
    let language = req.language;
    let named = req.environment_revision_id.as_deref();
    let store = &app.envs;
    let unavailable = |m: &str| EngineError::unavailable(ErrorCode::CapabilityUnavailable, m.to_owned());
    let selected = |r: Result<crate::envs::store::Selection, crate::envs::store::StoreError>| {
        r.map_err(|e| EngineError::invalid(ErrorCode::EnvironmentUnavailable, e.to_string()))
    };
    match language {
        Language::Python | Language::R if store.available() => {
            let selection = selected(store.select(language, None, named))?;
            let shown = named.or(epoch_revision).unwrap_or("system-python3-bwrap-v1").to_owned();
            Ok((shown, Some(selection)))
        }
        Language::R => Err(unavailable("R execution requires the scientific environment capability")),
        Language::Python => {
            if named.is_some() && named != epoch_revision {
                return Err(unavailable(
                    "Named environment execution requires the scientific environment capability",
                ));
            }
            Ok((named.or(epoch_revision).unwrap_or("system-python3-bwrap-v1").to_owned(), None))
        }
        Language::Shell => match req.environment_id.as_deref() {
            None => Ok(("system-shell-bwrap-v1".to_owned(), None)),
            Some(_) if !store.available() => Err(unavailable("Scientific environments are unavailable")),
            Some(id) => Ok((
                "system-shell-bwrap-v1".to_owned(),
                Some(selected(store.select(language, Some(id), None))?),
            )),
        },
    }
}

/// How a domain-allowlist request's egress leaves this host (`sandboxEgressProxy`); a policy
/// other than `none` and `domain-allowlist` is refused.
fn egress_route(req: &request::ExecRequest) -> Result<ProxySetting, EngineError> {
    let network = &req.network;
    match &network.mode {
        NetworkMode::None => Ok(ProxySetting::Direct),
        NetworkMode::DomainAllowlist => {
            if network.revision.trim().is_empty() || network.revision == "none" {
                return Err(EngineError::invalid(
                    ErrorCode::InvalidNetworkAccess,
                    "permissionEpoch.networkAccess.revision is required for a domain-allowlist policy",
                ));
            }
            crate::egress::proxy_setting(req.egress_proxy.as_ref())
                .map_err(|m| EngineError::invalid(ErrorCode::InvalidEgressProxy, m))
        }
        NetworkMode::Other(other) => Err(EngineError::unavailable(
            ErrorCode::NetworkUnavailable,
            format!(
                "Sandbox network access is unavailable: policy {other:?} is not supported (only \"none\" and \"domain-allowlist\"); nothing was run"
            ),
        )),
    }
}

/// `cwd` found beneath the workspace now, or (`opts.defer_cwd`) checked now and found when
/// the run starts ([`resolve_cwd`]): `(found, deferred)`.
fn working_directory(
    app: &App,
    root: &Path,
    cwd: Option<String>,
    opts: RunOptions,
) -> Result<(Option<String>, Option<String>), EngineError> {
    match cwd {
        Some(cwd) if opts.defer_cwd => {
            workspace::check_cwd_text(&cwd)?;
            Ok((None, Some(cwd)))
        }
        Some(cwd) => Ok((Some(workspace::resolve_cwd(&app.data_dir, root, &cwd)?), None)),
        None => Ok((None, None)),
    }
}

/// The request's remaining checks, in the contract's order (after the workspace and the
/// id), and everything the run needs decided once. The managed route calls it when it
/// accepts a request; a request it refuses is still accepted (202) and its record fails
/// when the run starts, as the original's does (see `crate::managed::Manager::start`).
pub fn prepare(
    app: &App,
    req: request::ExecRequest,
    located: Located,
    opts: RunOptions,
) -> Result<Prepared, EngineError> {
    let language = req.language;
    if req.code.trim().is_empty() {
        return Err(EngineError::invalid(ErrorCode::CodeRequired, request::code_required(language)));
    }
    let epoch_revision = req.epoch_environment_revision_id.as_deref();
    let (environment_revision_id, environment) = select_environment(app, &req, epoch_revision)?;
    let egress_route = egress_route(&req)?;
    let (max_output, max_workspace) = budgets(app, &req);
    let network = req.network;
    let npu_devices = crate::accel::select::requested(req.npu_devices.as_ref(), "npuDevices")?;
    let gpu_devices = crate::accel::select::requested(req.gpu_devices.as_ref(), "gpuDevices")?;
    let skills = match &req.skill_packages_root {
        Some(root) => Some(
            crate::skills::requested(&app.data_dir, &Value::String(root.clone()))
                .map_err(EngineError::Skill)?,
        ),
        None => None,
    };
    let cfg = &app.config;
    let timeout_ms = match opts.honour_timeout {
        true => req.execution_timeout_ms.unwrap_or(cfg.exec_timeout_ms),
        false => 0,
    };
    let (cwd, deferred_cwd) = working_directory(app, &located.root, req.cwd, opts)?;
    let limits = crate::limits::requested(req.resource_limits.as_ref(), &cfg.limits)
        .map_err(|m| EngineError::invalid(ErrorCode::InvalidResourceLimits, m))?;
    let accel = !npu_devices.is_empty() || !gpu_devices.is_empty();
    let isolation = crate::exec::backend::chosen(app, req.isolation.as_deref(), accel)?;
    if let Some(why) = app.sandbox.backend(isolation).unavailable() {
        return Err(EngineError::unavailable(ErrorCode::SandboxUnavailable, why));
    }
    Ok(Prepared {
        language,
        root: located.root,
        read_only: located.read_only,
        execution_id: req.execution_id,
        session_id: req.session_id,
        agent_id: req.agent_id,
        code: req.code,
        environment_revision_id,
        environment,
        profile: profile_for(&network.mode, !npu_devices.is_empty()),
        network,
        egress_route,
        egress: None,
        timeout_ms,
        max_output,
        max_workspace,
        cwd,
        deferred_cwd,
        npu_devices,
        gpu_devices,
        limits,
        skill_hold: skills.as_ref().map(|r| app.skills_in_use.hold(&r.id)),
        isolation,
        skills,
    })
}

/// Finds a deferred `cwd` beneath the workspace, now that the run starts.
pub fn resolve_cwd(app: &App, p: &mut Prepared) -> Result<(), EngineError> {
    if let Some(cwd) = p.deferred_cwd.take() {
        p.cwd = Some(workspace::resolve_cwd(&app.data_dir, &p.root, &cwd)?);
    }
    Ok(())
}

/// For a domain-allowlist request: the policy's gateway from egressd, held until the
/// prepared run is dropped. Fails closed (400 `network_unavailable`) when egressd or the
/// bridge is missing, so an unfiltered run never happens.
pub async fn attach_egress(app: &App, p: &mut Prepared) -> Result<(), EngineError> {
    if p.network.mode != NetworkMode::DomainAllowlist || p.egress.is_some() {
        return Ok(());
    }
    let policy = GatewayPolicy {
        revision: p.network.revision.clone(),
        allowed_domains: p.network.allowed_domains.clone(),
        allow_private_network: p.network.allow_private_network,
        pinned_origins: Vec::new(),
    };
    // The host uid that connects to the lease's socket, the only uid it admits. Under bwrap:
    // the uid the sandbox runs as (runnerd's own, or the user a root runnerd hands sandboxes
    // to), which connects through the socket bound into the sandbox. Under microvm: runnerd
    // itself, which relays the guest's egress port to the socket (`microvm::egress`). That is
    // no weaker: the socket is bound into no sandbox for a VM (QEMU and the guest never see
    // it; the guest reaches it only through runnerd's relay, whose streams egressd judges as
    // any sandbox's), and in an unprivileged runnerd the two uids are the same anyway.
    let sandbox_uid = match p.isolation {
        crate::isolation::select::Backend::Bwrap => app.sandbox.user.uid,
        crate::isolation::select::Backend::Microvm => nix::unistd::geteuid().as_raw(),
    };
    match app.egress.acquire(policy, p.egress_route.clone(), sandbox_uid).await {
        Ok(lease) => {
            p.egress = Some(lease);
            Ok(())
        }
        Err(e) => {
            tracing::warn!(event = "egress_unavailable", execution_id = %p.execution_id, revision = %p.network.revision, error = %crate::error_chain(&e));
            Err(EngineError::unavailable(
                ErrorCode::NetworkUnavailable,
                format!(
                    "Sandbox network access (domain-allowlist) is unavailable: {}; nothing was run",
                    crate::error_chain(&e)
                ),
            ))
        }
    }
}
