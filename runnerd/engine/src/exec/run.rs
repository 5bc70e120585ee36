//! Running a staged execution in its sandbox: the [`SandboxSpec`] from the prepared request
//! and what staging gathered, the limits and the execution's cgroup, the quota watchdog, the
//! launch through the isolation backend (`app.sandbox.isolation`), then the workspace as the
//! run left it (quota post-check, `createdFiles`/`modifiedFiles`) and the result.

use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::audit::FinishAudit;
use super::prepare::Prepared;
use super::stage::{Staged, stage};
use super::{
    EngineError, ErrorCode, ExecutionResult, JOURNAL_TICK, OrderedMap, QUOTA_POLL, RunOutcome, StopReason,
    StopToken, UNRESPONSIVE, language_name,
};
use crate::app::{App, runner_version};
use crate::isolation::{Dir, Egress, Job, Ran, SandboxSpec, Skills, WorkspaceDirs};
use crate::launch::{LaunchError, OutputBudget, OutputSink, Stream, Termination, default_rlimits};
use crate::measure;
use crate::sandbox::WorkspaceLayout;
use crate::timefmt;

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

/// Runs a prepared request in a fresh sandbox: staging (quota pre-check, chips, skills, the
/// environment), the launch with its timeout and quota watchdog (both stop `stop`, as the
/// caller does), the quota post-check, the result.
/// The caller holds the workspace's locks, and the writer's pinned descriptor is the
/// workspace directory: the sandbox runs in exactly the directory the version will snapshot,
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
    let root_fd = writer.pinned();
    let ran = match stage(app, p, audit, root_fd, &mut journal).await {
        Ok(staged) => launch(app, p, audit, Started { at: started_at, logs, stop, root_fd }, staged).await,
        Err(e) => Err(e),
    };
    if let Some(journal) = journal {
        writer.attach_journal(journal);
    }
    if let Err(e) = &ran {
        // A no-op when the run recorded its own outcome.
        audit.failed(e);
    }
    ran
}

/// How one launch is attended: when it started, where its output also goes, what stops it,
/// and the workspace it runs in.
struct Started<'a, 'l> {
    at: String,
    logs: Option<&'l mut dyn OutputSink>,
    stop: &'a StopToken,
    root_fd: &'a OwnedFd,
}

/// What the sandbox holds and runs, from the request and what staging gathered.
fn sandbox_spec<'a>(
    app: &'a App,
    p: &'a Prepared,
    root_fd: &'a OwnedFd,
    staged: &'a Staged,
    layout: &'a WorkspaceLayout,
    python_packages: Option<&'a Path>,
) -> Result<SandboxSpec<'a>, EngineError> {
    let egress = match (&p.egress, p.network.mode.as_str()) {
        (Some(lease), _) => Some(Egress {
            bridge: &app.egress.bridge,
            gateway_socket: &lease.socket,
            gateway: Some(&lease.socket_fd),
        }),
        (None, "none") => None,
        (None, _) => {
            return Err(EngineError::unavailable(
                ErrorCode::NetworkUnavailable,
                "Sandbox network access (domain-allowlist) is unavailable: no egress gateway was acquired; nothing was run",
            ));
        }
    };
    let runtime = staged.runtime.as_ref();
    let mut spec = SandboxSpec::new(&app.sandbox.host, layout, p.language);
    spec.workspace_dirs = Some(WorkspaceDirs {
        root: Dir { fd: root_fd, owner: staged.owners.0 },
        read_only: staged.parent_fd.as_ref().map(|fd| Dir { fd, owner: staged.owners.1 }),
    });
    spec.cwd = p.cwd.as_deref();
    spec.interpreter_masks = runtime.map(|r| r.masks.as_slice()).unwrap_or_default();
    spec.python = &app.config.python_path;
    spec.science_env = runtime.map(|r| r.prefix.as_path());
    spec.egress = egress;
    spec.accel = staged.accel.as_ref();
    spec.tmp_bytes = p.limits.tmp_bytes;
    spec.python_packages = python_packages;
    spec.skills = staged.skills.as_ref().map(|m| Skills {
        packages: &m.packages_path,
        extensions: &m.extensions_path,
        fds: (&m.packages, &m.extensions),
    });
    spec.profile = p.profile;
    Ok(spec)
}

/// The job's limits: rlimits (the quota as the largest file, the request's limits), and the
/// execution's cgroup with its join files (the backend gives back the one the sandbox ran
/// in). An error with the outcome recorded when the cgroup could not be made.
fn limited(app: &App, p: &Prepared, audit: &FinishAudit, job: &mut Job<'_>) -> Result<(), EngineError> {
    job.rlimits = default_rlimits(measure::file_size_cap(p.max_workspace));
    job.rlimits.extend(crate::limits::rlimits_for(app.limits.mode, &p.limits, p.timeout_ms));
    let made = app.limits.create(&p.limits).and_then(|c| {
        let fds = c.as_ref().map(|c| c.procs_fds()).transpose()?;
        Ok((c, fds.unwrap_or_default()))
    });
    match made {
        Ok((cgroup, fds)) => {
            job.cgroup_procs = fds;
            job.cgroup = cgroup;
            Ok(())
        }
        Err(e) => {
            let error = crate::error_chain(&e);
            audit.finished(ErrorCode::SandboxLaunchFailed, None, None, Some(&error));
            Err(EngineError::LaunchFailed(format!(
                "the execution's cgroup could not be prepared, nothing was run: {error}"
            )))
        }
    }
}

/// Launches the staged run and waits for its end; then the workspace as it left it.
async fn launch(
    app: &App,
    p: &Prepared,
    audit: &FinishAudit,
    started: Started<'_, '_>,
    staged: Staged,
) -> Result<ExecutionResult, EngineError> {
    let Started { at: started_at, logs, stop, root_fd } = started;
    let layout = WorkspaceLayout::new(p.root.clone(), p.read_only.clone());
    let python_packages = crate::sandbox::host::python_packages_for_execution(
        &app.data_dir,
        &app.config.python_path,
        &app.sandbox.user,
    );
    let spec = sandbox_spec(app, p, root_fd, &staged, &layout, python_packages.as_deref())?;
    let mut job = Job::new(spec);
    limited(app, p, audit, &mut job)?;
    // An execution's sandbox may wait for it, started ahead (issue #37).
    job.prestart = Some(crate::isolation::Prestart {
        tenant: format!("{}\u{1f}{}", p.session_id, p.agent_id),
        cgroups: app.limits.cgroups(),
    });
    let rlimits = job.rlimits.clone();
    job.stdin = p.code.clone().into_bytes();
    job.timeout = (p.timeout_ms > 0).then(|| Duration::from_millis(p.timeout_ms));
    job.stop = Some(stop.watch());
    job.limits = Some(p.limits);
    let watch = staged.watch.clone();
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
    app.sandbox.running_in(p.isolation, job.spec.workspace.root());
    let Ran { outcome, env, cwd, cgroup } =
        app.sandbox.backend(p.isolation).run(job, &mut Tee { budget: &mut output, extra: logs }).await;
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
            (true, Err(e)) => Some(After::Walked(
                measure::unmeasured(&format!("cannot open the workspace again: {e}")),
                None,
            )),
            (false, _) => None,
        })
        .await
        .unwrap_or_else(|| {
            (None, Some(After::Walked(measure::unmeasured("the measuring task stopped"), None)))
        });
    let outcome = launched_or_failed(app, p, audit, outcome, launched)?;
    let end = End { outcome, after, usage, rlimits, env, cwd, started_at };
    finished(app, p, audit, stop, &staged, end, output)
}

/// The launcher's answer, counted; a launch that failed, recorded and mapped to its error.
fn launched_or_failed(
    app: &App,
    p: &Prepared,
    audit: &FinishAudit,
    outcome: Result<crate::launch::Outcome, LaunchError>,
    launched: Instant,
) -> Result<crate::launch::Outcome, EngineError> {
    let e = match outcome {
        Ok(o) => {
            // A sandbox started ahead was launched before this run: nothing to count.
            if let Some(latency) = o.launch_latency.filter(|_| !o.served_ahead) {
                app.metrics.launched(p.profile.name(), latency);
            }
            if let Some(c) = &audit.clock {
                let exec = o.launch_latency.unwrap_or_default();
                c.split(crate::metrics::Phase::Launch, exec, crate::metrics::Phase::Wait);
            }
            return Ok(o);
        }
        Err(e) => e,
    };
    if let Some(step) = crate::metrics::init_step_of(&e) {
        app.metrics.init_failed(step);
    }
    let error = crate::error_chain(&e);
    let unresponsive = matches!(e, LaunchError::Unresponsive { .. });
    let outcome = if unresponsive { UNRESPONSIVE } else { ErrorCode::SandboxLaunchFailed };
    audit.finished(outcome, None, Some(launched.elapsed()), Some(&error));
    if unresponsive {
        tracing::error!(event = "workspace_locked", workspace = %p.root.display(), reason = "a sandbox did not die");
        return Err(EngineError::Unresponsive(error));
    }
    if let LaunchError::Init(f) = &e
        && f.step == common::plan::InitStep::Idmap
    {
        // The start-up probe passed, but this workspace's filesystem refused.
        return Err(EngineError::unavailable(
            ErrorCode::WorkspaceNotWritable,
            format!(
                "Runner workspace {} could not be mounted for the sandbox user ({f}); nothing was run. Run \
                 runnerd as the data directory's owner, or keep workspaces on a filesystem that supports \
                 idmapped mounts",
                p.root.display()
            ),
        ));
    }
    Err(EngineError::LaunchFailed(error))
}

/// How a launched sandbox ended, and what the backend put in it.
struct End {
    outcome: crate::launch::Outcome,
    after: Option<After>,
    usage: Option<crate::limits::Usage>,
    rlimits: Vec<common::plan::Rlimit>,
    env: Vec<(String, String)>,
    cwd: String,
    started_at: String,
}

/// The result of a sandbox that ended: its termination (a deadline, a cancel or a quota
/// breach are errors), the quota post-check and the files it changed.
fn finished(
    app: &App,
    p: &Prepared,
    audit: &FinishAudit,
    stop: &StopToken,
    staged: &Staged,
    end: End,
    output: OutputBudget,
) -> Result<ExecutionResult, EngineError> {
    let End { outcome, after, mut usage, rlimits, env, cwd, started_at } = end;
    // A microVM's guest kernel counts its own OOM kills; the host cgroup never held it.
    if let Some(oom) = outcome.guest_oom {
        usage = Some(crate::limits::Usage { oom_kills: u64::from(oom), ..Default::default() });
    }
    let finish = |outcome_name: super::Outcome, exit: Option<i32>| {
        audit.finished(outcome_name, exit, Some(outcome.elapsed), None);
    };
    let exit_code = exit_code(p, stop, outcome.termination, &finish)?;
    let (created_files, modified_files) = changed_files(p, &staged.before, after, exit_code, &finish)?;
    let collected = output.finish_text();
    finish(RunOutcome::Completed.into(), Some(exit_code));
    let mut limits = crate::limits::outcome_fields(
        outcome.termination,
        collected.stderr.is_empty(),
        usage.as_ref(),
        &p.limits,
        &rlimits,
        app.limits.mode,
    );
    // In a microVM the limits are the VM's size, not a cgroup's (issue #36).
    let microvm = p.isolation == crate::isolation::select::Backend::Microvm;
    if microvm {
        limits.resource_limits.enforced = crate::isolation::microvm::enforced(&p.limits);
    }
    app.metrics.limits_in_result(&limits);
    let execution_id = &p.execution_id;
    Ok(ExecutionResult {
        exit_code,
        stdout: collected.stdout,
        stderr: collected.stderr,
        cgroup_mode: if microvm { "microvm" } else { app.limits.mode.label() },
        created_files,
        modified_files,
        environment_revision_id: staged
            .runtime
            .as_ref()
            .map_or_else(|| p.environment_revision_id.clone(), |r| r.revision_id.clone()),
        environment_variables: OrderedMap(env),
        execution_id: execution_id.clone(),
        finished_at: timefmt::now_iso(),
        kernel_id: format!("ephemeral:{execution_id}"),
        kernel_mode: "ephemeral",
        language: language_name(p.language),
        network_access_revision: p.network.revision.clone(),
        network_policy: p.network.mode.clone(),
        runner_version: runner_version(),
        sandbox: app.sandbox.backend(p.isolation).name(),
        started_at,
        working_directory: cwd,
        limits,
        workspace_snapshot: None,
    })
}

/// The command's exit code (1 when bwrap itself was killed); a deadline, a quota breach or
/// a cancel is the run's error, recorded through `finish`.
fn exit_code(
    p: &Prepared,
    stop: &StopToken,
    termination: Termination,
    finish: &dyn Fn(super::Outcome, Option<i32>),
) -> Result<i32, EngineError> {
    let label = p.language.label();
    match termination {
        Termination::Exited(code) => Ok(code),
        Termination::Signaled(_) => Ok(1),
        Termination::TimedOut => {
            finish(RunOutcome::TimedOut.into(), None);
            Err(EngineError::TimedOut { label, ms: p.timeout_ms })
        }
        Termination::Cancelled => Err(match stop.take_breach() {
            Some(breach) => {
                finish(ErrorCode::WorkspaceQuotaExceeded.into(), None);
                EngineError::QuotaExceeded(measure::breach_message(p.max_workspace, &breach, true))
            }
            None => {
                finish(RunOutcome::Aborted.into(), None);
                EngineError::Aborted { label }
            }
        }),
    }
}

/// `createdFiles` and `modifiedFiles`, after the quota post-check of the workspace as the run
/// left it (from the journal, or walked against the fingerprints from before the run).
fn changed_files(
    p: &Prepared,
    before: &measure::Fingerprints,
    after: Option<After>,
    exit_code: i32,
    finish: &dyn Fn(super::Outcome, Option<i32>),
) -> Result<(Vec<String>, Vec<String>), EngineError> {
    let after =
        after.unwrap_or_else(|| After::Walked(measure::unmeasured("the run's end was not measured"), None));
    let (after, changes) = match after {
        After::Journal(m, changes) => (m, changes),
        After::Walked(m, before_override) => {
            let changes = measure::changes(before_override.as_ref().unwrap_or(before), &m.prints);
            (m, changes)
        }
    };
    match measure::check(after, p.max_workspace) {
        Ok(_) => Ok(changes),
        Err(breach) => {
            finish(ErrorCode::WorkspaceQuotaExceeded.into(), Some(exit_code));
            Err(EngineError::QuotaExceeded(measure::breach_message(p.max_workspace, &breach, false)))
        }
    }
}

/// The workspace after a run (its sandbox gone): from the journal, with the run's changes;
/// or walked, with the fingerprints from before the run when the journal lost track during
/// it (the walk before the run was skipped then).
enum After {
    Journal(measure::Measured, crate::journal::Changes),
    Walked(measure::Measured, Option<measure::Fingerprints>),
}

fn after_run(watch: Option<&crate::journal::RunWatch>, root: &OwnedFd) -> After {
    let walk = || measure::measure(std::os::fd::AsFd::as_fd(root));
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
                    if let Err(breach) = measure::check(m, max_workspace) {
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
        if let Err(breach) = measure::check(measure::measure_blocking(&root).await, max_workspace) {
            stop.stop(StopReason::Quota(breach));
            return;
        }
        pause = QUOTA_POLL.max(walk.elapsed());
    }
}
