//! Staging: what a run gathers under its locks, right before its sandbox starts — the
//! workspace as it is (quota pre-check, from the change journal or one walk), whose ids the
//! sandbox sees it with, the named chips probed again, the skill package verified again, and
//! the environment's read lease. Nothing here starts a sandbox; [`super::run`] does.

use std::os::fd::OwnedFd;

use common::plan::IdPair;

use super::audit::FinishAudit;
use super::prepare::Prepared;
use super::{EngineError, ErrorCode, RunOutcome};
use crate::app::App;
use crate::measure;
use crate::sandbox::{WorkspaceLayout, ownership};
use crate::workspace;

/// Everything a run holds besides its request, until its sandbox has ended.
#[derive(Debug)]
pub(super) struct Staged {
    /// The read-only parent workspace, opened beneath the data directory.
    pub parent_fd: Option<OwnedFd>,
    /// Whose ids the workspace and its parent are seen with (`Some`: idmapped).
    pub owners: (Option<IdPair>, Option<IdPair>),
    /// The workspace's fingerprints before the run (empty when the journal vouches for it).
    pub before: measure::Fingerprints,
    /// The change journal's watch of this run, when it has one.
    pub watch: Option<crate::journal::RunWatch>,
    pub accel: Option<crate::accel::mount::AccelMount>,
    pub skills: Option<crate::skills::Mount>,
    /// The environment's read lease, held until the run ends.
    pub runtime: Option<crate::envs::store::Runtime>,
}

/// Stages the run of `p` in the workspace `root_fd` (its writer's pinned descriptor). An
/// error has recorded its outcome in `audit` where the error alone would not say it. The
/// run's change journal is in `journal` as soon as it has one, whatever happens next: the
/// writer's commit snapshots only what it says changed.
pub(super) async fn stage(
    app: &App,
    p: &Prepared,
    audit: &FinishAudit,
    root_fd: &OwnedFd,
    journal: &mut Option<crate::journal::RunWatch>,
) -> Result<Staged, EngineError> {
    if let Some(why) = app.sandbox.backend(p.isolation).unavailable() {
        return Err(EngineError::unavailable(ErrorCode::SandboxUnavailable, why));
    }
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
            .unwrap_or_else(|e| (measure::unmeasured(&e.to_string()), None))
    };
    journal.clone_from(&watch);
    let staged = Staged {
        before: before_run(p, audit, measured, owners.0.is_some())?,
        parent_fd,
        owners,
        watch,
        accel: None,
        skills: None,
        runtime: None,
    };
    with_resources(app, p, audit, root_fd, staged).await
}

/// The quota pre-check, and the set-ID check of an idmapped workspace: the fingerprints
/// before the run, or why it must not start.
fn before_run(
    p: &Prepared,
    audit: &FinishAudit,
    measured: measure::Measured,
    idmapped: bool,
) -> Result<measure::Fingerprints, EngineError> {
    match measure::check(measured, p.max_workspace) {
        Ok(m) if idmapped && m.set_id.is_some() => {
            let path = m.set_id.unwrap_or_default();
            audit.finished(
                ErrorCode::WorkspaceNotWritable,
                None,
                None,
                Some("a set-ID file in an idmapped workspace"),
            );
            Err(EngineError::unavailable(
                ErrorCode::WorkspaceNotWritable,
                format!(
                    "Runner workspace {} holds a set-user-ID or set-group-ID file ({path}), which a sandbox \
                     writing as the workspace's owner could rewrite; nothing was run. Clear the bit (chmod u-s,g-s) \
                     to run here",
                    p.root.display()
                ),
            ))
        }
        Ok(m) => Ok(m.prints),
        Err(breach) => {
            audit.finished(RunOutcome::WorkspaceQuotaExceededBeforeRun, None, None, None);
            Err(EngineError::QuotaExceeded(measure::breach_message(p.max_workspace, &breach, false)))
        }
    }
}

/// The chips, the skill package and the environment, in that order, as close to the launch
/// as possible.
async fn with_resources(
    app: &App,
    p: &Prepared,
    audit: &FinishAudit,
    root_fd: &OwnedFd,
    mut staged: Staged,
) -> Result<Staged, EngineError> {
    // A fresh probe of exactly the named chips; one refused chip refuses the run (never a
    // run on fewer chips).
    let prober = app.accel_prober();
    staged.accel =
        crate::accel::select::resolve(&app.accel.config, &p.npu_devices, &p.gpu_devices, &prober).await?;
    staged.skills = match &p.skills {
        // A bind by path would reach `.sciencediscovery` again after it was checked; an
        // enclosing workspace's sandbox could swap it for a symlink in between.
        Some(_) if !app.sandbox.backend(p.isolation).binds_by_descriptor() => {
            return Err(EngineError::unavailable(
                ErrorCode::SkillsUnavailable,
                "Skill packages need bubblewrap with --bind-fd (0.8 or later) on this host",
            ));
        }
        Some(req) => Some(
            crate::skills::prepare_mount(
                &app.data_dir,
                req,
                root_fd,
                &p.root,
                &app.sandbox.user,
                staged.owners.0,
            )
            .map_err(EngineError::Skill)?,
        ),
        None => None,
    };
    // After the agent queue and the workspace lease: a writer queued on the environment
    // cannot wait on this run's locks.
    staged.runtime = match &p.environment {
        Some(selection) => Some(app.envs.lease(selection).await.map_err(|e| {
            audit.finished(ErrorCode::EnvironmentUnavailable, None, None, Some(&e.to_string()));
            EngineError::invalid(ErrorCode::EnvironmentUnavailable, e.to_string())
        })?),
        None => None,
    };
    Ok(staged)
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
        |e: ownership::Unwritable| EngineError::unavailable(ErrorCode::WorkspaceNotWritable, e.to_string());
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
