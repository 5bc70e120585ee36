//! The synchronous executions, `POST /execute-shell` and `POST /execute`, in the original's
//! order (contract §2A): parse → kernelMode → workspace → mounts → executionId dedupe →
//! admission and queues → quota pre-check → sandbox (with quota polling, timeout and
//! client-disconnect cancellation) → quota post-check → result.

pub mod admission;
pub mod answer;
pub mod dedupe;
pub mod error;
pub mod files;
pub mod registry;
pub mod request;
pub mod stop;

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::Value;

use crate::app::{App, runner_version};
use crate::coordination::CoordError;
use crate::launch::{Launch, OutputBudget, OutputSink, OutputText, Stream, Termination, default_rlimits};
use crate::sandbox::{
    EgressMount, FdSlots, Language, SandboxSpec, WorkspaceFds, WorkspaceLayout, argv, ownership, preflight,
};
use crate::timefmt;
pub(crate) use crate::workspace;
use crate::writer::WriteError;
use common::egress::protocol::GatewayPolicy;
use common::egress::route::ProxySetting;
use common::plan::IdPair;
use common::seccomp::Profile;
pub use error::EngineError;
use registry::ActiveExecution;
pub use stop::{StopReason, StopToken};

/// Ours: ids are UUIDs in practice; anything longer than this is refused before it is kept.
pub const MAX_EXECUTION_ID: usize = 1024;

/// The error code of a sandbox that did not die: its caller keeps the workspace locked.
pub const UNRESPONSIVE: &str = "sandbox_unresponsive";

/// How often the workspace quota is re-measured during a run, at the most: the original
/// polls every 100 ms; ours waits 25 ms, or as long as the last walk took if that was longer
/// (a large workspace is never walked more than half the time), so the overshoot between
/// two measurements is a quarter of the original's on a small workspace.
pub const QUOTA_POLL: Duration = Duration::from_millis(25);

/// How often the quota is brought up to date from the change journal when no event comes.
const JOURNAL_TICK: Duration = Duration::from_secs(1);

/// An insertion-ordered string map (the env map is reported in injection order).
#[derive(Debug, Clone)]
pub struct OrderedMap(Vec<(String, String)>);

impl Serialize for OrderedMap {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            map.serialize_entry(k, v)?;
        }
        map.end()
    }
}

/// `ShellExecutionResult` / `PythonExecutionResult`, fields in the original's order.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ExecutionResult {
    pub exit_code: i32,
    /// The kept output, as the budget rendered it (no copy; see [`answer`]).
    pub stdout: OutputText,
    pub stderr: OutputText,
    pub cgroup_mode: &'static str,
    pub created_files: Vec<String>,
    pub modified_files: Vec<String>,
    pub environment_revision_id: String,
    pub environment_variables: OrderedMap,
    pub execution_id: String,
    pub finished_at: String,
    pub kernel_id: String,
    pub kernel_mode: &'static str,
    pub language: &'static str,
    pub network_access_revision: String,
    pub network_policy: String,
    pub runner_version: &'static str,
    pub sandbox: &'static str,
    pub started_at: String,
    pub working_directory: String,
    /// Ours (issue #8): how the run ended and what it used; see `crate::limits::outcome_fields`.
    #[serde(flatten)]
    pub limits: crate::limits::ResultFields,
    /// The committed WorkspaceTree ref after the run (appended last, like the original).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub workspace_snapshot: Option<Value>,
}

fn language_name(l: Language) -> &'static str {
    match l {
        Language::Shell => "shell",
        Language::Python => "python",
        Language::R => "r",
    }
}

/// The seccomp profile a request's sandbox runs under: `network` for a domain-allowlist
/// policy (the bridge needs its sockets), else `baseline`. The same rule as `argv::build`
/// (a domain-allowlist run without a gateway never starts), known before the sandbox is.
/// With Ascend chips and no network, `npu` (internals §4.4).
pub fn profile_for(network_mode: &str, ascend: bool) -> Profile {
    argv::profile(network_mode == "domain-allowlist", ascend)
}

/// The `execution_finished` audit record of one admitted execution: written once, by
/// whichever path ends it (the sandbox's own outcome, or the error that stopped it before
/// or instead of the sandbox), always with the same fields, so `journalctl
/// EVENT=execution_finished` sees every admitted execution end.
#[derive(Debug)]
pub struct FinishAudit {
    execution_id: String,
    session_id: String,
    agent_id: String,
    workspace: PathBuf,
    profile: Profile,
    admitted: Instant,
    written: AtomicBool,
    /// Where the end is also counted (`GET /metrics`), under this route.
    metrics: Option<(Arc<crate::metrics::Metrics>, &'static str)>,
    /// The execution's phase marks (`runner_execution_phase_seconds`), when it keeps them.
    clock: Option<crate::metrics::PhaseClock>,
}

impl FinishAudit {
    pub fn new(
        execution_id: &str,
        session_id: &str,
        agent_id: &str,
        workspace: &Path,
        profile: Profile,
    ) -> Self {
        FinishAudit {
            execution_id: execution_id.to_owned(),
            session_id: session_id.to_owned(),
            agent_id: agent_id.to_owned(),
            workspace: workspace.to_owned(),
            profile,
            admitted: Instant::now(),
            written: AtomicBool::new(false),
            metrics: None,
            clock: None,
        }
    }

    /// Keeps the execution's phase marks on `clock` (see [`FinishAudit::mark`]).
    pub fn clocked(mut self, clock: crate::metrics::PhaseClock) -> Self {
        self.clock = Some(clock);
        self
    }

    /// Charges the time since the previous mark to `phase` (nothing without a clock).
    pub fn mark(&self, phase: crate::metrics::Phase) {
        if let Some(c) = &self.clock {
            c.mark(phase);
        }
    }

    /// Counts the end in `metrics` too, under `route`.
    pub fn counted(mut self, metrics: &Arc<crate::metrics::Metrics>, route: &'static str) -> Self {
        self.metrics = Some((metrics.clone(), route));
        self
    }

    /// `execution_admitted`: the ids, the language, and whether it is a managed run.
    pub fn admitted(&self, language: &str, managed: bool) {
        tracing::info!(
            event = "execution_admitted",
            managed,
            execution_id = %self.execution_id,
            session_id = %self.session_id,
            agent_id = %self.agent_id,
            workspace = %self.workspace.display(),
            profile = %self.profile,
            language,
        );
    }

    /// `execution_started`, with the same ids.
    pub fn started(&self) {
        tracing::info!(
            event = "execution_started",
            execution_id = %self.execution_id,
            session_id = %self.session_id,
            agent_id = %self.agent_id,
            workspace = %self.workspace.display(),
            profile = %self.profile,
        );
    }

    /// Writes the record unless one was written. `duration_ms` counts from admission (queue
    /// included); `run_ms` is the sandbox's own time when one ran; `exit_code` is present
    /// only when the sandboxed command exited by itself.
    pub fn finished(
        &self,
        outcome: &str,
        exit_code: Option<i32>,
        run: Option<Duration>,
        error: Option<&str>,
    ) {
        if self.written.swap(true, Ordering::SeqCst) {
            return;
        }
        if let Some((m, route)) = &self.metrics {
            m.finished(route, outcome, self.profile.name(), self.admitted.elapsed());
        }
        let duration_ms = self.admitted.elapsed().as_millis() as u64;
        let run_ms = run.map(|d| d.as_millis() as u64);
        macro_rules! record {
            ($level:ident) => {
                tracing::$level!(
                    event = "execution_finished",
                    execution_id = %self.execution_id,
                    session_id = %self.session_id,
                    agent_id = %self.agent_id,
                    workspace = %self.workspace.display(),
                    profile = %self.profile,
                    outcome,
                    exit_code,
                    duration_ms,
                    run_ms,
                    error,
                )
            };
        }
        if outcome == "sandbox_launch_failed" || outcome == UNRESPONSIVE {
            record!(error);
        } else {
            record!(info);
        }
    }

    /// The record for an execution that an error ended: the error's code is the outcome.
    pub fn failed(&self, e: &EngineError) {
        self.finished(e.code(), None, None, Some(&e.to_string()));
    }
}

impl Drop for FinishAudit {
    /// The last resort: a task dropped before any path recorded the end still leaves one.
    fn drop(&mut self) {
        self.finished(
            "dropped",
            None,
            None,
            Some("the task running the execution ended before it recorded an outcome"),
        );
    }
}

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

/// The workspace a request runs in, resolved beneath the data directory (step 4).
#[derive(Debug, Clone)]
pub struct Located {
    pub root: PathBuf,
    pub read_only: Option<PathBuf>,
}

/// Workspace resolution (step 4): a `runnerWorkspaceKey` wins and drops
/// `readOnlyWorkspaceRoot`; otherwise `workspaceRoot` must be inside the roots.
pub fn locate(app: &App, ws: &request::WorkspaceRef) -> Result<Located, EngineError> {
    let data = &app.data_dir;
    if let Some(key) = &ws.key {
        let root = workspace::ensure_remote_workspace(data, key, &app.sandbox.user)?;
        return Ok(Located { root: workspace::validated_workspace(data, &root)?, read_only: None });
    }
    let root = ws.root.as_deref().ok_or_else(|| {
        EngineError::invalid("workspace_required", "workspaceRoot or runnerWorkspaceKey is required")
    })?;
    let root = workspace::validated_workspace(data, Path::new(root))?;
    let read_only = match &ws.read_only {
        Some(p) => Some(workspace::validated_workspace(data, Path::new(p))?),
        None => None,
    };
    Ok(Located { root, read_only })
}

/// A synchronous execution's admission (steps 5–9): the mounts, a place in the bounded
/// queue, then the id — length, the 60 s dedupe, blank — and the agent.
pub fn admit(app: &App, req: &request::ExecRequest) -> Result<admission::Ticket, EngineError> {
    if !req.single_workspace_mount {
        return Err(request::mounts_error(req.language));
    }
    // Ours: a full queue answers 503 before the id is recorded, so a retry after
    // `Retry-After` is not refused as a duplicate.
    let ticket = app.admission.admit();
    app.metrics.admission(ticket.is_ok());
    let ticket = ticket?;
    let id = &req.execution_id;
    if id.len() > MAX_EXECUTION_ID {
        return Err(EngineError::invalid(
            "execution_id_too_long",
            format!("Execution ID must be at most {MAX_EXECUTION_ID} bytes"),
        ));
    }
    if !app.recent_ids.record(id, Instant::now()) {
        return Err(EngineError::Duplicate);
    }
    if id.trim().is_empty() {
        return Err(EngineError::invalid("execution_id_required", "Execution ID is required"));
    }
    if req.agent_id.trim().is_empty() {
        return Err(EngineError::invalid("agent_id_required", "Agent ID is required"));
    }
    Ok(ticket)
}

/// Runs one synchronous execution: locate, admit, prepare, then the run under its locks
/// ([`run_sandbox`]) and the commit. `stop` ends it early: a queued call leaves the queue,
/// a running sandbox is killed. `clock` started when the request arrived (its parse phase).
pub async fn execute(
    app: Arc<App>,
    req: request::ExecRequest,
    stop: StopToken,
    clock: crate::metrics::PhaseClock,
) -> Result<ExecutionResult, EngineError> {
    use crate::metrics::Phase;
    let located = locate(&app, &req.workspace)?;
    let ticket = admit(&app, &req)?;
    let route = req.route;
    let mut prepared = prepare(&app, req, located, RunOptions::SYNC)?;
    attach_egress(&app, &mut prepared).await?;
    clock.mark(Phase::Parse);

    let _ticket = ticket;
    let language = prepared.language;
    let registration = app.registry.register(ActiveExecution {
        agent_id: prepared.agent_id.clone(),
        execution_id: prepared.execution_id.clone(),
        kernel_mode: "ephemeral",
        language: language_name(language),
        queued_at: timefmt::now_iso(),
        session_id: prepared.session_id.clone(),
        started_at: None,
        status: "queued",
    });
    let audit = FinishAudit::new(
        &prepared.execution_id,
        &prepared.session_id,
        &prepared.agent_id,
        &prepared.root,
        prepared.profile,
    )
    .counted(&app.metrics, route.name())
    .clocked(clock);
    audit.admitted(language_name(language), false);
    let key = admission::agent_key(&prepared.session_id, &prepared.agent_id);
    let abandoned = || {
        audit.finished("abandoned_in_queue", None, None, None);
        EngineError::Aborted { label: language.label() }
    };
    let ended = |e: EngineError| {
        audit.failed(&e);
        e
    };
    let running = tokio::select! {
        held = app.admission.acquire(&prepared.session_id, &key, &prepared.root) => held,
        _ = stop.stopped() => return Err(abandoned()),
    };
    audit.mark(Phase::Admit);
    // The cross-process writer lease (shared with the API process), inside our own queues;
    // `running` only once both are held.
    let pinned = workspace::open_beneath(&app.data_dir, &prepared.root).map_err(ended)?;
    let mut writer = match app.versions.begin(&prepared.root, pinned, Some(&stop.watch())).await {
        Ok(w) => w,
        Err(WriteError::Coordination(CoordError::Aborted)) => return Err(abandoned()),
        Err(e) => return Err(ended(EngineError::Workspace(e))),
    };
    audit.mark(Phase::Lease);
    let started_at = timefmt::iso8601(timefmt::now_ms());
    registration.running(started_at.clone());
    let ran = run_sandbox(&app, &prepared, &audit, started_at, None, &stop, &mut writer).await;
    audit.mark(Phase::Snapshot);
    if ran.as_ref().is_err_and(EngineError::is_unresponsive) {
        // The sandbox may still be writing: keep its workspace locked (fail closed) rather
        // than let the next writer in. An operator restart clears it.
        drop(writer.take_journal());
        std::mem::forget(writer);
        std::mem::forget(running);
        return ran;
    }
    // Whatever happened, the files as the run left them become the workspace's head
    // (`legacy-execution`, failed when the run failed), before the lease is released — but
    // never more than the quota is stored.
    writer.limit_snapshot_bytes(prepared.max_workspace);
    let commit_started = Instant::now();
    let (committed, snapshot_took) = app
        .versions
        .commit_mutation_timed(&writer, "legacy-execution", Some(prepared.execution_id.clone()), ran.is_ok())
        .await;
    app.metrics.committed(committed.is_ok(), commit_started.elapsed());
    if let Some(c) = &audit.clock {
        c.split(Phase::Snapshot, snapshot_took, Phase::Commit);
    }
    drop(writer);
    drop(running);
    drop(registration);
    let tree = match committed {
        Ok(tree) => tree,
        Err(e) => {
            // The run's own failure (its quota, say) answers when the commit only refused
            // what that run left behind (the workspace is not poisoned then).
            if e.is_content() {
                ran?;
            }
            return Err(EngineError::CommitFailed(e.to_string()));
        }
    };
    let mut result = ran?;
    result.workspace_snapshot = Some(tree.to_value());
    if let Some(c) = &audit.clock {
        c.mark(Phase::Answer);
        app.metrics.phases(c);
    }
    Ok(result)
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
    let unavailable = |m: &str| EngineError::unavailable("capability_unavailable", m.to_owned());
    let selected = |r: Result<crate::envs::store::Selection, crate::envs::store::StoreError>| {
        r.map_err(|e| EngineError::invalid("environment_unavailable", e.to_string()))
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

/// The request's remaining checks, in the contract's order (after the workspace and the
/// id), and everything the run needs decided once. The managed route calls it before it
/// answers 202, so a request that cannot run is refused with nothing recorded.
pub fn prepare(
    app: &App,
    req: request::ExecRequest,
    located: Located,
    opts: RunOptions,
) -> Result<Prepared, EngineError> {
    let language = req.language;
    if req.code.trim().is_empty() {
        return Err(EngineError::invalid("code_required", request::code_required(language)));
    }
    let epoch_revision = req.epoch_environment_revision_id.as_deref();
    let (environment_revision_id, environment) = select_environment(app, &req, epoch_revision)?;
    let network = req.network;
    let egress_route = match network.mode.as_str() {
        "none" => ProxySetting::Direct,
        "domain-allowlist" => {
            if network.revision.trim().is_empty() || network.revision == "none" {
                return Err(EngineError::invalid(
                    "invalid_network_access",
                    "permissionEpoch.networkAccess.revision is required for a domain-allowlist policy",
                ));
            }
            crate::egress::proxy_setting(req.egress_proxy.as_ref())
                .map_err(|m| EngineError::invalid("invalid_egress_proxy", m))?
        }
        other => {
            return Err(EngineError::unavailable(
                "network_unavailable",
                format!(
                    "Sandbox network access is unavailable: policy {other:?} is not supported (only \"none\" and \"domain-allowlist\"); nothing was run"
                ),
            ));
        }
    };
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
    let max_output = req.max_output_bytes.unwrap_or(cfg.max_output_bytes);
    let max_workspace = req.max_workspace_bytes.unwrap_or(cfg.max_workspace_bytes);
    let (cwd, deferred_cwd) = match req.cwd {
        Some(cwd) if opts.defer_cwd => {
            workspace::check_cwd_text(&cwd)?;
            (None, Some(cwd))
        }
        Some(cwd) => (Some(workspace::resolve_cwd(&app.data_dir, &located.root, &cwd)?), None),
        None => (None, None),
    };
    let limits = crate::limits::requested(req.resource_limits.as_ref(), &cfg.limits)
        .map_err(|m| EngineError::invalid("invalid_resource_limits", m))?;
    sandbox_shape(app)?;
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
    if p.network.mode != "domain-allowlist" || p.egress.is_some() {
        return Ok(());
    }
    let policy = GatewayPolicy {
        revision: p.network.revision.clone(),
        allowed_domains: p.network.allowed_domains.clone(),
        allow_private_network: p.network.allow_private_network,
        pinned_origins: Vec::new(),
    };
    // The host uid the sandbox runs as (runnerd's own, or the user a root runnerd hands
    // sandboxes to): the only uid the lease's socket admits.
    let sandbox_uid = app.sandbox.user.uid;
    match app.egress.acquire(policy, p.egress_route.clone(), sandbox_uid).await {
        Ok(lease) => {
            p.egress = Some(lease);
            Ok(())
        }
        Err(e) => {
            tracing::warn!(event = "egress_unavailable", execution_id = %p.execution_id, revision = %p.network.revision, error = %crate::error_chain(&e));
            Err(EngineError::unavailable(
                "network_unavailable",
                format!(
                    "Sandbox network access (domain-allowlist) is unavailable: {}; nothing was run",
                    crate::error_chain(&e)
                ),
            ))
        }
    }
}

fn sandbox_shape(app: &App) -> Result<crate::sandbox::SandboxShape, EngineError> {
    app.sandbox.capability.shape().ok_or_else(|| {
        EngineError::unavailable(
            "sandbox_unavailable",
            preflight::sandbox_unusable_message(
                &app.sandbox.bwrap.to_string_lossy(),
                app.sandbox.capability.detail.as_deref(),
            ),
        )
    })
}

/// Sends the sandbox's output to the result budget and, for managed runs, to the logs.
struct Tee<'a, 'b> {
    budget: &'a mut OutputBudget,
    extra: Option<&'b mut (dyn OutputSink + 'b)>,
}

impl OutputSink for Tee<'_, '_> {
    fn write(&mut self, stream: Stream, bytes: &[u8]) {
        self.budget.write(stream, bytes);
        if let Some(extra) = self.extra.as_mut() {
            extra.write(stream, bytes);
        }
    }

    fn backlog(&self) -> Option<Arc<tokio::sync::Notify>> {
        self.extra.as_ref().and_then(|e| e.backlog())
    }
}

/// Runs a prepared request in a fresh sandbox: quota pre-check, launch with timeout and a
/// quota watchdog (both stop `stop`, as the caller does), quota post-check, result.
/// The caller holds the workspace's locks, and `root_fd` is the workspace directory its
/// writer pinned: the sandbox runs in exactly the directory the version will snapshot,
/// whatever its path names by now (another workspace's sandbox may rename directories
/// around it while this one queued). The run's change journal goes to the writer, whose
/// commit then snapshots only what changed.
/// Writes `audit`'s `execution_finished` record on every path (its outcome, or the error).
pub async fn run_sandbox(
    app: &App,
    p: &Prepared,
    audit: &FinishAudit,
    started_at: String,
    logs: Option<&mut dyn OutputSink>,
    stop: &StopToken,
    writer: &mut crate::writer::Writer,
) -> Result<ExecutionResult, EngineError> {
    let mut journal = None;
    let ran = sandbox_run(app, p, audit, started_at, logs, stop, writer.pinned(), &mut journal).await;
    if let Some(journal) = journal {
        writer.attach_journal(journal);
    }
    if let Err(e) = &ran {
        // A no-op when the run recorded its own outcome.
        audit.failed(e);
    }
    ran
}

/// The sandbox's command and the descriptors its options name, decided together: every
/// bind by descriptor takes its slot from one [`FdSlots`].
#[allow(clippy::too_many_arguments)]
fn sandbox_command(
    app: &App,
    shape: crate::sandbox::SandboxShape,
    p: &Prepared,
    root_fd: &OwnedFd,
    parent_fd: Option<&OwnedFd>,
    (root_owner, parent_owner): (Option<IdPair>, Option<IdPair>),
    accel: Option<&crate::accel::mount::AccelMount>,
    skills: Option<&crate::skills::Mount>,
    runtime: Option<&crate::envs::store::Runtime>,
) -> Result<(crate::sandbox::SandboxCommand, FdSlots), EngineError> {
    let by_fd = app.sandbox.features.bind_fd;
    let layout = WorkspaceLayout::new(p.root.clone(), p.read_only.clone());
    let mut slots = FdSlots::default();
    let workspace_fds = match by_fd {
        true => {
            let root = slots.push_dir(root_fd, root_owner, false).map_err(EngineError::internal)?;
            let read_only = parent_fd
                .map(|fd| slots.push_dir(fd, parent_owner, true))
                .transpose()
                .map_err(EngineError::internal)?;
            Some(WorkspaceFds { root, read_only })
        }
        false => None,
    };
    let mut slot = |fd: &OwnedFd| slots.push(fd).map_err(EngineError::internal);
    let egress_mount = match (&p.egress, p.network.mode.as_str()) {
        (Some(lease), _) => Some(EgressMount {
            bridge: app.egress.bridge.clone(),
            gateway_socket: lease.socket.clone(),
            gateway_fd: by_fd.then(|| slot(&lease.socket_fd)).transpose()?,
        }),
        (None, "none") => None,
        (None, _) => {
            return Err(EngineError::unavailable(
                "network_unavailable",
                "Sandbox network access (domain-allowlist) is unavailable: no egress gateway was acquired; nothing was run",
            ));
        }
    };
    let skills_mount = match skills {
        Some(m) => Some(crate::sandbox::argv::SkillsMount {
            packages: m.packages_path.clone(),
            extensions: m.extensions_path.clone(),
            fds: match by_fd {
                true => Some((slot(&m.packages)?, slot(&m.extensions)?)),
                false => None,
            },
        }),
        None => None,
    };
    let python_packages = crate::sandbox::host::python_packages_for_execution(
        &app.data_dir,
        &app.config.python_path,
        &app.sandbox.user,
    );
    let cmd = argv::build(&SandboxSpec {
        shape,
        host: &app.sandbox.host,
        workspace: &layout,
        cwd: p.cwd.as_deref(),
        language: p.language,
        interpreter_masks: runtime.map(|r| r.masks.as_slice()).unwrap_or_default(),
        python: &app.config.python_path,
        science_env: runtime.map(|r| r.prefix.as_path()),
        workspace_fds,
        egress: egress_mount.as_ref(),
        accel,
        command: None,
        tmp_bytes: p.limits.tmp_bytes,
        python_packages: python_packages.as_deref(),
        skills: skills_mount.as_ref(),
        profile: p.profile,
        binds: &[],
        extra_env: &[],
    });
    Ok((cmd, slots))
}

/// Whose ids the workspace and its read-only parent are seen with (issue #30): `Some(owner)`
/// for a directory sandbox-init mounts idmapped. A writable workspace that the sandbox user
/// could not write is refused here, before anything runs.
fn workspace_owners(
    app: &App,
    p: &Prepared,
    root_fd: &OwnedFd,
    parent_fd: Option<&OwnedFd>,
) -> Result<(Option<IdPair>, Option<IdPair>), EngineError> {
    let layout = WorkspaceLayout::new(p.root.clone(), p.read_only.clone());
    let (who, support) = (&app.sandbox.user, &app.sandbox.idmap);
    let refused =
        |e: ownership::Unwritable| EngineError::unavailable("workspace_not_writable", e.to_string());
    // A read-only directory at or inside the writable root is reached through the root's
    // own bind too: idmapping it would make it writable there as its owner. It is bound as
    // it is, as before issue #30.
    let parent_inside_root = p.read_only.as_deref().is_some_and(|ro| ro.starts_with(&p.root));
    let parent = match (parent_fd, p.read_only.as_deref()) {
        (Some(_), Some(_)) if parent_inside_root => None,
        (Some(fd), Some(path)) => {
            ownership::access_of(fd, path, who, support, false, false).map_err(refused)?.owner()
        }
        _ => None,
    };
    let under_idmapped = matches!(layout, WorkspaceLayout::Nested { .. }) && parent.is_some();
    let root =
        ownership::access_of(root_fd, &p.root, who, support, true, under_idmapped).map_err(refused)?.owner();
    Ok((root, parent))
}

#[allow(clippy::too_many_arguments)]
async fn sandbox_run(
    app: &App,
    p: &Prepared,
    audit: &FinishAudit,
    started_at: String,
    logs: Option<&mut dyn OutputSink>,
    stop: &StopToken,
    root_fd: &OwnedFd,
    journal: &mut Option<crate::journal::RunWatch>,
) -> Result<ExecutionResult, EngineError> {
    let shape = sandbox_shape(app)?;
    let (language, execution_id) = (p.language, &p.execution_id);
    let parent_fd = match p.read_only.as_ref() {
        Some(ro) => Some(workspace::open_beneath(&app.data_dir, ro)?),
        None => None,
    };
    let owners = workspace_owners(app, p, root_fd, parent_fd.as_ref())?;
    // The workspace before the run: from the change journal when it vouches for it (no
    // walk), else one walk (which also sets its watches up for the next runs).
    let (measured, watch) = {
        let (journal, key) = (app.journal.clone(), p.root.clone());
        let fd = root_fd.try_clone().map_err(EngineError::internal)?;
        crate::blocking::run(move || journal.begin(&key, &fd))
            .await
            .unwrap_or_else(|e| (files::unmeasured(&e.to_string()), None))
    };
    journal.clone_from(&watch);
    let before = match files::check(measured, p.max_workspace) {
        Ok(m) if owners.0.is_some() && m.set_id.is_some() => {
            let path = m.set_id.unwrap_or_default();
            audit.finished(
                "workspace_not_writable",
                None,
                None,
                Some("a set-ID file in an idmapped workspace"),
            );
            return Err(EngineError::unavailable(
                "workspace_not_writable",
                format!(
                    "Runner workspace {} holds a set-user-ID or set-group-ID file ({path}), which a sandbox \
                     writing as the workspace's owner could rewrite; nothing was run. Clear the bit (chmod u-s,g-s) \
                     to run here",
                    p.root.display()
                ),
            ));
        }
        Ok(m) => m.prints,
        Err(breach) => {
            audit.finished("workspace_quota_exceeded_before_run", None, None, None);
            return Err(EngineError::QuotaExceeded(files::breach_message(p.max_workspace, &breach, false)));
        }
    };

    // A fresh probe of exactly the named chips, as close to the launch as possible; one
    // refused chip refuses the run (never a run on fewer chips).
    let accel = crate::accel::select::resolve(
        &app.accel.config,
        &p.npu_devices,
        &p.gpu_devices,
        &crate::accel::probe::SandboxProber { app },
    )
    .await?;
    let skills = match &p.skills {
        // A bind by path would reach `.sciencediscovery` again after it was checked; an
        // enclosing workspace's sandbox could swap it for a symlink in between.
        Some(_) if !app.sandbox.features.bind_fd => {
            return Err(EngineError::unavailable(
                "skills_unavailable",
                "Skill packages need bubblewrap with --bind-fd (0.8 or later) on this host",
            ));
        }
        Some(req) => Some(
            crate::skills::prepare_mount(&app.data_dir, req, root_fd, &p.root, &app.sandbox.user, owners.0)
                .map_err(EngineError::Skill)?,
        ),
        None => None,
    };
    // The environment's read lease, held until the run ends: after the agent queue and the
    // workspace lease (a writer queued on the environment cannot wait on this run's locks).
    let runtime = match &p.environment {
        Some(selection) => Some(app.envs.lease(selection).await.map_err(|e| {
            audit.finished("environment_unavailable", None, None, Some(&e.to_string()));
            EngineError::invalid("environment_unavailable", e.to_string())
        })?),
        None => None,
    };
    let (cmd, slots) = sandbox_command(
        app,
        shape,
        p,
        root_fd,
        parent_fd.as_ref(),
        owners,
        accel.as_ref(),
        skills.as_ref(),
        runtime.as_ref(),
    )?;
    let environment_variables = OrderedMap(cmd.env.clone());
    let working_directory = cmd.cwd.clone();
    let profile = cmd.seccomp;
    let mut launch = Launch::sandboxed(app.sandbox.bwrap.clone(), cmd, slots);
    launch.rlimits = default_rlimits(files::file_size_cap(p.max_workspace));
    launch.rlimits.extend(crate::limits::rlimits_for(app.limits.mode, &p.limits, p.timeout_ms));
    let rlimits = launch.rlimits.clone();
    let cgroup = match app.limits.create(&p.limits).and_then(|c| {
        let fds = c.as_ref().map(|c| c.procs_fds()).transpose()?;
        Ok((c, fds.unwrap_or_default()))
    }) {
        Ok((cgroup, fds)) => {
            launch.cgroup_procs = fds;
            cgroup
        }
        Err(e) => {
            let error = crate::error_chain(&e);
            audit.finished("sandbox_launch_failed", None, None, Some(&error));
            return Err(EngineError::LaunchFailed(format!(
                "the execution's cgroup could not be prepared, nothing was run: {error}"
            )));
        }
    };
    launch.stdin = p.code.clone().into_bytes();
    launch.timeout = (p.timeout_ms > 0).then(|| Duration::from_millis(p.timeout_ms));
    launch.cancel = Some(stop.watch());
    let watchdog = tokio::spawn(quota_watchdog(
        root_fd.try_clone().map_err(EngineError::internal)?,
        p.max_workspace,
        stop.clone(),
        watch.clone(),
    ));
    audit.started();
    audit.mark(crate::metrics::Phase::Launch);
    let launched = Instant::now();

    let mut output = OutputBudget::pooled(p.max_output, &app.output_pool);
    let outcome = app.sandbox.launcher.run(launch, &mut Tee { budget: &mut output, extra: logs }).await;
    watchdog.abort();
    // The workspace as the run left it (`createdFiles`), measured in the cgroup's blocking
    // task right after its kill rather than on a hop of its own; only for a run that ended
    // (the launcher saw the sandbox end). A launch failure, an unresponsive sandbox, a
    // timeout or a cancel answers without it, so nothing waits on a walk of a workspace a
    // live sandbox may still be writing.
    let ended = matches!(&outcome, Ok(o) if matches!(o.termination, Termination::Exited(_) | Termination::Signaled(_)));
    let walked = root_fd.try_clone();
    let (usage, after) = app
        .limits
        .finish_execution(cgroup, move || match (ended, walked) {
            (true, Ok(fd)) => Some(after_run(watch.as_ref(), &fd)),
            (true, Err(e)) => {
                Some(After::Walked(files::unmeasured(&format!("cannot open the workspace again: {e}")), None))
            }
            (false, _) => None,
        })
        .await
        .unwrap_or_else(|| {
            (None, Some(After::Walked(files::unmeasured("the measuring task stopped"), None)))
        });
    let outcome = match outcome {
        Ok(o) => {
            if let Some(latency) = o.launch_latency {
                app.metrics.launched(profile.name(), latency);
            }
            if let Some(c) = &audit.clock {
                let exec = o.launch_latency.unwrap_or_default();
                c.split(crate::metrics::Phase::Launch, exec, crate::metrics::Phase::Wait);
            }
            o
        }
        Err(e) => {
            if let Some(step) = crate::metrics::init_step_of(&e) {
                app.metrics.init_failed(step);
            }
            let error = crate::error_chain(&e);
            let unresponsive = matches!(e, crate::launch::LaunchError::Unresponsive { .. });
            let outcome = if unresponsive { UNRESPONSIVE } else { "sandbox_launch_failed" };
            audit.finished(outcome, None, Some(launched.elapsed()), Some(&error));
            if unresponsive {
                tracing::error!(event = "workspace_locked", workspace = %p.root.display(), reason = "a sandbox did not die");
                return Err(EngineError::Unresponsive(error));
            }
            if let crate::launch::LaunchError::Init(f) = &e
                && f.step == common::plan::InitStep::Idmap
            {
                // The start-up probe passed, but this workspace's filesystem refused.
                return Err(EngineError::unavailable(
                    "workspace_not_writable",
                    format!(
                        "Runner workspace {} could not be mounted for the sandbox user ({f}); nothing was run. Run \
                         runnerd as the data directory's owner, or keep workspaces on a filesystem that supports \
                         idmapped mounts",
                        p.root.display()
                    ),
                ));
            }
            return Err(EngineError::LaunchFailed(error));
        }
    };

    let finish = |outcome_name: &str, exit: Option<i32>| {
        audit.finished(outcome_name, exit, Some(outcome.elapsed), None);
    };
    let exit_code = match outcome.termination {
        Termination::Exited(code) => code,
        Termination::Signaled(_) => 1,
        Termination::TimedOut => {
            finish("timed_out", None);
            return Err(EngineError::TimedOut { label: language.label(), ms: p.timeout_ms });
        }
        Termination::Cancelled => {
            return Err(match stop.take_breach() {
                Some(breach) => {
                    finish("workspace_quota_exceeded", None);
                    EngineError::QuotaExceeded(files::breach_message(p.max_workspace, &breach, true))
                }
                None => {
                    finish("aborted", None);
                    EngineError::Aborted { label: language.label() }
                }
            });
        }
    };
    let after =
        after.unwrap_or_else(|| After::Walked(files::unmeasured("the run's end was not measured"), None));
    let (after, changes) = match after {
        After::Journal(m, changes) => (m, Some(changes)),
        After::Walked(m, before_override) => {
            let changes = files::changes(before_override.as_ref().unwrap_or(&before), &m.prints);
            (m, Some(changes))
        }
    };
    let (created_files, modified_files) = match files::check(after, p.max_workspace) {
        Ok(_) => changes.unwrap_or_default(),
        Err(breach) => {
            finish("workspace_quota_exceeded", Some(exit_code));
            return Err(EngineError::QuotaExceeded(files::breach_message(p.max_workspace, &breach, false)));
        }
    };
    let collected = output.finish_text();
    finish("completed", Some(exit_code));
    let limits = crate::limits::outcome_fields(
        outcome.termination,
        collected.stderr.is_empty(),
        usage.as_ref(),
        &p.limits,
        &rlimits,
        app.limits.mode,
    );
    app.metrics.limits_in_result(&limits);
    Ok(ExecutionResult {
        exit_code,
        stdout: collected.stdout,
        stderr: collected.stderr,
        cgroup_mode: app.limits.mode.label(),
        created_files,
        modified_files,
        environment_revision_id: runtime
            .as_ref()
            .map_or_else(|| p.environment_revision_id.clone(), |r| r.revision_id.clone()),
        environment_variables,
        execution_id: execution_id.clone(),
        finished_at: timefmt::now_iso(),
        kernel_id: format!("ephemeral:{execution_id}"),
        kernel_mode: "ephemeral",
        language: language_name(language),
        network_access_revision: p.network.revision.clone(),
        network_policy: p.network.mode.clone(),
        runner_version: runner_version(),
        sandbox: "bubblewrap",
        started_at,
        working_directory,
        limits,
        workspace_snapshot: None,
    })
}

/// The workspace after a run (its sandbox gone): from the journal, with the run's changes;
/// or walked, with the fingerprints from before the run when the journal lost track during
/// it (the walk before the run was skipped then).
enum After {
    Journal(files::Measured, crate::journal::Changes),
    Walked(files::Measured, Option<files::Fingerprints>),
}

fn after_run(watch: Option<&crate::journal::RunWatch>, root: &OwnedFd) -> After {
    let walk = || files::measure(std::os::fd::AsFd::as_fd(root));
    match watch.map(|w| w.finish()) {
        Some(Ok((m, changes))) => After::Journal(m, changes),
        Some(Err(before)) => After::Walked(walk(), Some(before)),
        None => After::Walked(walk(), None),
    }
}

/// Stops the run when the workspace outgrows its quota. With the change journal, the total
/// is brought up to date whenever an event concerns the workspace (the files it names are
/// read again), never by walking; without it (or once it lost track), the workspace is
/// walked every [`QUOTA_POLL`] or the last walk's duration, one walk at a time.
async fn quota_watchdog(
    root: OwnedFd,
    max_workspace: u64,
    stop: StopToken,
    watch: Option<crate::journal::RunWatch>,
) {
    if max_workspace == 0 {
        return;
    }
    if let Some(watch) = watch {
        loop {
            // Also once a second with no event: a descriptor writing a linked file through a
            // name that is gone raises none (the journal's tree reads the file's other names
            // at every update).
            tokio::select! {
                _ = watch.changed() => {}
                _ = tokio::time::sleep(JOURNAL_TICK) => {}
            }
            let w = watch.clone();
            match crate::blocking::run(move || w.measure()).await {
                Ok(Some(m)) => {
                    if let Err(breach) = files::check(m, max_workspace) {
                        stop.stop(StopReason::Quota(breach));
                        return;
                    }
                }
                _ => break,
            }
        }
    }
    let mut pause = QUOTA_POLL;
    loop {
        tokio::time::sleep(pause).await;
        let walk = Instant::now();
        if let Err(breach) = files::check(files::measure_blocking(&root).await, max_workspace) {
            stop.stop(StopReason::Quota(breach));
            return;
        }
        pause = QUOTA_POLL.max(walk.elapsed());
    }
}

/// Completes when the client is gone; never, if its handle is simply dropped.
pub async fn gone(client_gone: &mut tokio::sync::watch::Receiver<bool>) {
    if client_gone.wait_for(|g| *g).await.is_err() {
        std::future::pending::<()>().await;
    }
}
