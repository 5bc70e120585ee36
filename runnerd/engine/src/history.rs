//! The bound on version history (issue #32): the retention and collector settings, the
//! collections runnerd runs — on demand (`POST /versioning/gc`, `runnerctl gc`),
//! periodically, and when the data directory's filesystem runs short — and the last
//! report, which `/health`, `GET /versioning` and `/metrics` show.
//!
//! Every execution stores what changed into the shared store; without this, history was
//! counted by no quota and never pruned, so one tenant could fill the disk for all.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde_json::{Value, json};

use crate::versioning::gc::{self, Collection, Report};
use crate::versioning::retention::Retention;

pub const KEEP_VERSIONS_VAR: &str = "SCIENCE_AGENT_HISTORY_KEEP_VERSIONS";
pub const KEEP_DAYS_VAR: &str = "SCIENCE_AGENT_HISTORY_KEEP_DAYS";
pub const INTERVAL_VAR: &str = "SCIENCE_AGENT_HISTORY_GC_INTERVAL_SECS";
pub const FREE_PERCENT_VAR: &str = "SCIENCE_AGENT_HISTORY_GC_FREE_PERCENT";
pub const GRACE_VAR: &str = "SCIENCE_AGENT_HISTORY_GC_GRACE_SECS";

pub const DEFAULT_KEEP_VERSIONS: u64 = 100;
pub const DEFAULT_KEEP_DAYS: u64 = 30;
pub const DEFAULT_INTERVAL_SECS: u64 = 6 * 3600;
pub const DEFAULT_FREE_PERCENT: u64 = 10;
pub const DEFAULT_GRACE_SECS: u64 = 3600;

/// How often the disk-pressure check looks at the filesystem.
const PRESSURE_EVERY: Duration = Duration::from_secs(60);
/// After a collection under pressure, how long before pressure may start another: one
/// that freed too little must not run back to back.
const PRESSURE_BACKOFF: Duration = Duration::from_secs(30 * 60);

/// The operator's settings (README, `packaging/config/runnerd.toml`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HistorySettings {
    pub retention: Retention,
    /// Seconds between periodic collections (0: none).
    pub interval_secs: u64,
    /// A collection starts when the data directory's filesystem has less than this
    /// percentage free (0: never for that reason).
    pub free_percent: u64,
    /// Objects younger than this are never deleted.
    pub grace_secs: u64,
}

impl Default for HistorySettings {
    fn default() -> Self {
        HistorySettings {
            retention: Retention {
                keep_versions: DEFAULT_KEEP_VERSIONS,
                keep_days: DEFAULT_KEEP_DAYS,
                pressed: false,
            },
            interval_secs: DEFAULT_INTERVAL_SECS,
            free_percent: DEFAULT_FREE_PERCENT,
            grace_secs: DEFAULT_GRACE_SECS,
        }
    }
}

/// Why a collection ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trigger {
    Requested,
    Periodic,
    DiskPressure,
}

impl Trigger {
    pub fn as_str(self) -> &'static str {
        match self {
            Trigger::Requested => "requested",
            Trigger::Periodic => "periodic",
            Trigger::DiskPressure => "disk_pressure",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum HistoryError {
    #[error("a collection is already running; its report will be in GET /versioning")]
    Running,
    #[error("the collection stopped; nothing more was deleted")]
    Store(#[source] crate::versioning::VersionError),
    #[error("the collection could not read the managed executions' records; nothing was deleted")]
    Managed(#[source] crate::managed::db::DbError),
    #[error("the collection's task stopped unexpectedly")]
    Task(#[source] crate::blocking::Panicked),
}

/// The collector's state: one collection at a time, and the last report.
#[derive(Debug, Default)]
pub struct History {
    pub settings: HistorySettings,
    running: tokio::sync::Mutex<()>,
    last: std::sync::Mutex<Option<(Trigger, Arc<Report>)>>,
    runs: AtomicU64,
    deleted_objects: AtomicU64,
    deleted_bytes: AtomicU64,
    pruned_versions: AtomicU64,
    failures: AtomicU64,
}

impl History {
    pub fn new(settings: HistorySettings) -> History {
        History { settings, ..History::default() }
    }

    /// Runs one collection (waiting for one already running to finish first).
    pub async fn collect(
        &self,
        app: &Arc<crate::app::App>,
        trigger: Trigger,
        dry_run: bool,
    ) -> Result<Arc<Report>, HistoryError> {
        let _one = match trigger {
            // A caller's request never queues behind (or piles up on) a running one.
            Trigger::Requested => self.running.try_lock().map_err(|_| HistoryError::Running)?,
            _ => self.running.lock().await,
        };
        let how = Collection {
            retention: Retention { pressed: trigger == Trigger::DiskPressure, ..self.settings.retention },
            grace: Duration::from_secs(self.settings.grace_secs),
            dry_run,
        };
        let app2 = app.clone();
        let done = crate::blocking::run(move || {
            let named = app2.managed.named_versions().map_err(HistoryError::Managed)?;
            let roots = app2.versions.lifecycle().registered_roots();
            let heads = gc::head_names(roots.iter().map(|p| p.as_path()));
            app2.versions.collect(&named, &|name| heads.get(name).cloned(), how).map_err(HistoryError::Store)
        })
        .await
        .map_err(HistoryError::Task)
        .and_then(|r| r);
        match done {
            Ok(report) => {
                let report = Arc::new(report);
                tracing::info!(
                    event = "history_collected",
                    trigger = trigger.as_str(),
                    dry_run,
                    versions_pruned = report.versions_pruned,
                    objects_deleted = report.objects_deleted,
                    disk_bytes_deleted = report.disk_bytes_deleted,
                    objects_kept_young = report.objects_kept_young,
                    disk_bytes_stored = report.disk_bytes_stored,
                    unreadable = report.unreadable_count,
                    took_ms = report.took_ms,
                );
                if !dry_run {
                    self.runs.fetch_add(1, Ordering::Relaxed);
                    self.deleted_objects.fetch_add(report.objects_deleted, Ordering::Relaxed);
                    self.deleted_bytes.fetch_add(report.disk_bytes_deleted, Ordering::Relaxed);
                    self.pruned_versions.fetch_add(report.versions_pruned as u64, Ordering::Relaxed);
                }
                *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Some((trigger, report.clone()));
                Ok(report)
            }
            Err(e) => {
                self.failures.fetch_add(1, Ordering::Relaxed);
                tracing::error!(event = "history_collection_failed", trigger = trigger.as_str(), error = %crate::error_chain(&e),
                    remedy = "fix what the error names (permissions, a damaged disk), then `runnerctl gc`");
                Err(e)
            }
        }
    }

    /// The background collections: periodic, and under disk pressure.
    pub fn start(app: &Arc<crate::app::App>) {
        let settings = app.history.settings;
        if settings.interval_secs == 0 && settings.free_percent == 0 {
            return;
        }
        let weak = Arc::downgrade(app);
        let mut stopping = app.shutdown.subscribe();
        tokio::spawn(async move {
            let started = tokio::time::Instant::now();
            let mut last_periodic = started;
            let mut last_pressure: Option<tokio::time::Instant> = None;
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(PRESSURE_EVERY) => {}
                    _ = stopping.changed() => return,
                }
                let Some(app) = weak.upgrade() else { return };
                let now = tokio::time::Instant::now();
                let trigger = if settings.interval_secs > 0
                    && now.duration_since(last_periodic) >= Duration::from_secs(settings.interval_secs)
                {
                    last_periodic = now;
                    Some(Trigger::Periodic)
                } else if settings.free_percent > 0
                    && last_pressure.is_none_or(|at| now.duration_since(at) >= PRESSURE_BACKOFF)
                    && free_percent(&app.data_dir).is_some_and(|free| free < settings.free_percent as f64)
                {
                    last_pressure = Some(now);
                    Some(Trigger::DiskPressure)
                } else {
                    None
                };
                if let Some(trigger) = trigger {
                    let _ = app.history.collect(&app, trigger, false).await;
                }
            }
        });
    }

    /// `/health`'s `history`: the settings and the last collection's totals (no disk).
    pub fn health(&self) -> Value {
        let last = self.last.lock().unwrap_or_else(|p| p.into_inner()).clone();
        json!({
            "keepVersions": self.settings.retention.keep_versions,
            "keepDays": self.settings.retention.keep_days,
            "collectEverySecs": self.settings.interval_secs,
            "collectBelowFreePercent": self.settings.free_percent,
            "graceSecs": self.settings.grace_secs,
            "lastCollection": last.map(|(trigger, r)| json!({
                "trigger": trigger.as_str(),
                "dryRun": r.dry_run,
                "startedAt": r.started_at,
                "tookMs": r.took_ms,
                "versionsKept": r.versions_kept,
                "versionsPruned": r.versions_pruned,
                "objectsStored": r.objects_stored,
                "diskBytesStored": r.disk_bytes_stored,
                "objectsDeleted": r.objects_deleted,
                "diskBytesDeleted": r.disk_bytes_deleted,
                "unreadable": r.unreadable_count,
            })),
        })
    }

    /// The last report in full (`GET /versioning`), if a collection ran.
    pub fn last(&self) -> Option<(Trigger, Arc<Report>)> {
        self.last.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The totals `/metrics` shows.
    pub fn metrics(&self) -> crate::metrics::HistoryCounts {
        crate::metrics::HistoryCounts {
            collections: self.runs.load(Ordering::Relaxed),
            failures: self.failures.load(Ordering::Relaxed),
            objects_deleted: self.deleted_objects.load(Ordering::Relaxed),
            disk_bytes_deleted: self.deleted_bytes.load(Ordering::Relaxed),
            versions_pruned: self.pruned_versions.load(Ordering::Relaxed),
            disk_bytes_stored: self.last().map(|(_, r)| r.disk_bytes_stored),
        }
    }
}

/// The percentage of the filesystem holding `dir` that unprivileged users may still fill.
fn free_percent(dir: &std::path::Path) -> Option<f64> {
    let st = nix::sys::statvfs::statvfs(dir).ok()?;
    let total = st.blocks() as f64;
    (total > 0.0).then(|| st.blocks_available() as f64 * 100.0 / total)
}
