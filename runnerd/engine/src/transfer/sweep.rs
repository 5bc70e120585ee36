//! Fenced copies removed after their grace (issue #34): a workspace that moved keeps its
//! files here for `moved_workspace_grace_secs` (an operator can still read them, or move the
//! workspace back), then they are removed. Its fence and head stay: writes keep answering
//! where it went, and the collector keeps what the head reaches until the ref is superseded.

use std::sync::Arc;
use std::time::Duration;

use crate::app::App;

pub const GRACE_VAR: &str = "SCIENCE_AGENT_MOVED_WORKSPACE_GRACE_SECS";
pub const DEFAULT_GRACE_SECS: u64 = 3600;
/// How often the fenced copies are looked at, at most: half the grace, within 1–30 s.
fn every(grace_secs: u64) -> Duration {
    Duration::from_secs((grace_secs / 2).clamp(1, 30))
}

/// Removes the files of every copy fenced longer than the grace ago; returns how many.
pub async fn remove_due(app: &Arc<App>) -> usize {
    let grace_ms = app.config.moved_grace_secs.saturating_mul(1000);
    let before = crate::timefmt::now_ms().saturating_sub(grace_ms);
    let due = match app.versions.placement().due_for_removal(before) {
        Ok(due) => due,
        Err(e) => {
            tracing::error!(event = "moved_workspace_sweep_failed", error = %crate::error_chain(&e));
            return 0;
        }
    };
    let mut removed = 0;
    for canonical in due {
        match remove_one(app, &canonical, before).await {
            Ok(()) => {
                removed += 1;
                tracing::info!(event = "moved_workspace_removed", workspace = %canonical.display());
            }
            Err(e) => {
                tracing::warn!(event = "moved_workspace_not_removed", workspace = %canonical.display(), error = %e)
            }
        }
    }
    removed
}

async fn remove_one(app: &Arc<App>, canonical: &std::path::Path, before: u64) -> Result<(), String> {
    let now = crate::timefmt::now_ms();
    let pinned = match runner_store::workspace::open_beneath(&app.data_dir, canonical) {
        Ok(fd) => fd,
        // Gone already (deleted by hand): nothing left to remove.
        Err(_)
            if std::fs::symlink_metadata(canonical)
                .is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound) =>
        {
            return app.versions.placement().mark_removed(canonical, now).map_err(|e| crate::error_chain(&e));
        }
        Err(e) => return Err(crate::error_chain(&e)),
    };
    let held = pinned.try_clone().map_err(|e| e.to_string())?;
    // The lease, so no writer the fence let through before it was set is still at work.
    let writer =
        app.versions.begin_import(canonical, held, None).await.map_err(|e| crate::error_chain(&e))?;
    // Under the lease, the row again: a copy that came back meanwhile (an install cleared the
    // fence) is live and keeps its files.
    let still_due =
        app.versions.placement().get(canonical).map_err(|e| crate::error_chain(&e))?.is_some_and(|p| {
            p.moved_to.is_some() && p.removed_at_ms.is_none() && p.fenced_at_ms.is_some_and(|at| at <= before)
        });
    if !still_due {
        return Ok(());
    }
    let probe = pinned.try_clone().map_err(|e| e.to_string())?;
    let nested = tokio::task::spawn_blocking(move || {
        runner_store::transfer::materialize::contains_nested(std::os::fd::AsFd::as_fd(&probe))
    })
    .await
    .map_err(|e| e.to_string())?
    .map_err(|e| crate::error_chain(&e))?;
    if nested {
        // A workspace made inside the moved one since: its files are its own.
        return Err("workspaces are nested inside it; its files stay".into());
    }
    let cleared = tokio::task::spawn_blocking(move || crate::remote::files::clear(&pinned))
        .await
        .map_err(|e| e.to_string())?;
    drop(writer);
    cleared.map_err(|e| crate::error_chain(&e))?;
    app.versions.placement().mark_removed(canonical, now).map_err(|e| crate::error_chain(&e))
}

/// The periodic sweep.
pub fn start(app: &Arc<App>) {
    let weak = Arc::downgrade(app);
    let mut stopping = app.shutdown.subscribe();
    let period = every(app.config.moved_grace_secs);
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(period) => {}
                _ = stopping.changed() => return,
            }
            let Some(app) = weak.upgrade() else { return };
            remove_due(&app).await;
        }
    });
}
