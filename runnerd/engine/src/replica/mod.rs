//! Replication of workspace versions to an S3-compatible object store (issue #34,
//! deliverable 3): after each commit the new objects and the head go to the bucket in the
//! background, with bounded lag and bounded memory, so a workspace survives its node and can
//! be restored on any other. Off unless `replica_endpoint` is set.
//!
//! * [`settings`]: the configuration (pure); [`layout`]: keys and the head document (pure);
//! * [`pending`]: the queue, one entry per workspace (pure);
//! * [`client`]: the bucket through `object_store` (objects up and down, head documents);
//!   epochs, fences and what was replicated are the version store's placement database
//!   (`Versions::placement`);
//! * [`replicator`]: one workspace's replication, fencing a stale copy;
//! * this module: [`Replica`], the running replicator with its report (`/health`,
//!   `/metrics`) and [`Replica::backup_now`] for the routes.

pub mod client;
pub mod layout;
pub mod pending;
pub mod replicator;
pub mod settings;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde_json::{Value, json};

pub use client::{Bucket, ClientError, Fetched};
pub use layout::HeadDoc;
pub use replicator::{Outcome, ReplicaError, Sent};
pub use settings::ReplicaSettings;

use crate::transfer::Ident;
use crate::versioning::Ref;
use crate::writer::Versions;

/// Why replication cannot start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("the object store's credentials")]
    Credentials(#[source] settings::SettingsError),
    #[error("the data directory {} has no real path", .path.display())]
    DataDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Client(#[from] ClientError),
}

/// The replication counters `/metrics` shows (registered by `crate::metrics::Metrics`).
#[derive(Debug, Clone, Default)]
pub struct Counters {
    pub objects: prometheus_client::metrics::counter::Counter,
    pub bytes: prometheus_client::metrics::counter::Counter,
    pub errors: prometheus_client::metrics::counter::Counter,
}

/// What start-up resolved: the bucket's client and where workspaces live.
#[derive(Debug)]
pub struct Connection {
    pub settings: ReplicaSettings,
    pub bucket: Bucket,
    /// The data directory's real path.
    pub data_real: PathBuf,
    /// This node's URL (`node_url`).
    pub node: String,
}

/// The configured bucket's client, or `None` when replication is off. `env` gives the
/// secret's variable when no secret file is set.
pub fn connect(
    settings: Option<&ReplicaSettings>,
    data_dir: &Path,
    node: &str,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Option<Connection>, StartError> {
    let Some(settings) = settings else { return Ok(None) };
    let credentials = settings::secret(settings, env).map_err(StartError::Credentials)?;
    let data_real = std::fs::canonicalize(data_dir)
        .map_err(|source| StartError::DataDir { path: data_dir.to_owned(), source })?;
    let bucket = Bucket::connect(settings, credentials)?;
    Ok(Some(Connection { settings: settings.clone(), bucket, data_real, node: node.to_owned() }))
}

/// The running replicator: its queue, its last error and its totals.
#[derive(Debug)]
pub struct Replica {
    pub settings: ReplicaSettings,
    pub bucket: Bucket,
    pub data_real: PathBuf,
    pub node: String,
    versions: Arc<Versions>,
    counters: Counters,
    queue: Mutex<pending::Queue>,
    /// Wakes the background task when a head is queued.
    wake: tokio::sync::Notify,
    /// One replication at a time (the background task's or a requested backup).
    running: tokio::sync::Mutex<()>,
    last_error: Mutex<Option<String>>,
    replicated: AtomicU64,
}

impl Replica {
    /// The replicator over `connection` (not started: [`Replica::start`]).
    pub fn new(connection: Connection, versions: Arc<Versions>, counters: Counters) -> Replica {
        Replica {
            settings: connection.settings,
            bucket: connection.bucket,
            data_real: connection.data_real,
            node: connection.node,
            versions,
            counters,
            queue: Mutex::default(),
            wake: tokio::sync::Notify::new(),
            running: tokio::sync::Mutex::new(()),
            last_error: Mutex::default(),
            replicated: AtomicU64::new(0),
        }
    }

    fn queue(&self) -> std::sync::MutexGuard<'_, pending::Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A workspace head was committed: queue it (replacing an older head waiting for the
    /// same workspace). Cheap and non-blocking: called from the commit path.
    pub fn committed(&self, canonical: &Path, head: &Ref) {
        self.queue().push(canonical, head.clone(), common::timefmt::now_ms());
        self.wake.notify_one();
    }

    fn target(&self) -> replicator::Target<'_> {
        replicator::Target {
            bucket: &self.bucket,
            versions: &self.versions,
            data_real: &self.data_real,
            node: &self.node,
            counters: &self.counters,
        }
    }

    fn record(&self, canonical: &Path, result: &Result<Sent, ReplicaError>) {
        match result {
            Ok(sent) => {
                self.replicated.fetch_add(1, Ordering::Relaxed);
                *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = None;
                tracing::info!(event = "replicated", workspace = %sent.ident, head = %sent.head.digest,
                    epoch = sent.epoch, objects = sent.objects, bytes = sent.bytes, listed = sent.listed,
                    fenced = matches!(sent.outcome, Outcome::Fenced { .. }));
            }
            Err(e) => {
                self.counters.errors.inc();
                let text = crate::error_chain(e);
                tracing::warn!(event = "replication_failed", workspace = %canonical.display(), error = %text,
                    remedy = "check the object store's endpoint, bucket and credentials; runnerd retries");
                *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(text);
            }
        }
    }

    /// Replicates the current head of the workspace `canonical` now (a requested backup) and
    /// answers what was sent.
    pub async fn backup_now(&self, canonical: &Path) -> Result<Sent, ReplicaError> {
        let ident = Ident::from_canonical(&self.data_real, canonical)
            .ok_or_else(|| ReplicaError::Unnamed(canonical.to_owned()))?;
        let head =
            self.versions.head(canonical).map_err(ReplicaError::Head)?.ok_or(ReplicaError::NoHead(ident))?;
        let _one = self.running.lock().await;
        let result = replicator::replicate(&self.target(), canonical, &head).await;
        self.record(canonical, &result);
        if result.is_ok() {
            self.queue().replicated(canonical, &head);
        }
        result
    }

    /// The canonical path of `ident` on this node (for [`Replica::backup_now`]).
    pub fn canonical(&self, ident: &Ident) -> PathBuf {
        ident.path_under(&self.data_real)
    }

    /// The bucket's head document for `ident`, if any.
    pub async fn read_head(&self, ident: &Ident) -> Result<Option<HeadDoc>, ClientError> {
        self.bucket.read_head(ident).await
    }

    /// Downloads what the local store lacks of `head`'s closure (a restore's first step).
    pub async fn fetch_closure(&self, head: &Ref) -> Result<Fetched, ClientError> {
        self.bucket.fetch_closure(&self.versions, head).await
    }

    /// Follows the version store's commits ([`Versions::on_commit`]) and starts the
    /// background task: replicates queued heads, oldest first, retrying with backoff.
    pub fn start(self: &Arc<Self>, mut stopping: tokio::sync::watch::Receiver<bool>) {
        // Weak: the version store holds the hook, and this holds the version store.
        let weak = Arc::downgrade(self);
        self.versions.on_commit(Arc::new(move |canonical: &Path, head: &Ref| {
            if let Some(replica) = weak.upgrade() {
                replica.committed(canonical, head);
            }
        }));
        let replica = self.clone();
        tokio::spawn(async move {
            let me = replica.clone();
            match crate::blocking::run(move || me.backfill()).await {
                Ok(0) => {}
                Ok(queued) => tracing::info!(
                    event = "replica_backfill",
                    workspaces = queued,
                    reason = "heads committed while this process did not replicate them"
                ),
                Err(e) => tracing::warn!(event = "replica_backfill_failed", error = %e),
            }
            let mut failures = 0u32;
            loop {
                if failures > 0 {
                    tokio::select! {
                        _ = tokio::time::sleep(replicator::retry_after(failures)) => {}
                        _ = stopping.changed() => return,
                    }
                }
                let Some((canonical, pending)) = replica.queue().take() else {
                    tokio::select! {
                        _ = replica.wake.notified() => {}
                        _ = stopping.changed() => return,
                    }
                    continue;
                };
                let result = {
                    let _one = replica.running.lock().await;
                    // The head now, not the one queued: a requested backup may have sent a
                    // newer head meanwhile, and the bucket's head must never go back.
                    let head = replica.current_head(&canonical).await.unwrap_or(pending.head);
                    replicator::replicate(&replica.target(), &canonical, &head).await
                };
                replica.record(&canonical, &result);
                // A workspace that cannot be named or has moved is not retried.
                let done =
                    matches!(result, Ok(_) | Err(ReplicaError::Unnamed(_) | ReplicaError::Moved { .. }));
                replica.queue().finish(done);
                failures = if done { 0 } else { failures.saturating_add(1) };
            }
        });
    }

    /// Queues every workspace here whose head is not the one last replicated (not fenced,
    /// with a portable name): what a previous process left unsent when it stopped, or all of
    /// them when replication has just been switched on. Each is checked and queued in one
    /// step, and never over an entry a commit queued meanwhile (which is newer). Answers how
    /// many it queued.
    fn backfill(&self) -> usize {
        let mut queued = 0;
        for canonical in self.versions.lifecycle().registered_roots() {
            if Ident::from_canonical(&self.data_real, &canonical).is_none() {
                continue;
            }
            let Ok(Some(head)) = self.versions.head(&canonical) else { continue };
            let placed = self.versions.placement().get(&canonical).ok().flatten().unwrap_or_default();
            if placed.moved_to.is_none()
                && placed.replicated_head.as_ref() != Some(&head)
                && self.queue().push_if_absent(&canonical, head, common::timefmt::now_ms())
            {
                queued += 1;
            }
        }
        queued
    }

    /// The workspace's head as the version store has it now (`None` when it cannot be read).
    async fn current_head(&self, canonical: &Path) -> Option<Ref> {
        let (versions, canonical) = (self.versions.clone(), canonical.to_owned());
        crate::blocking::run(move || versions.head(&canonical)).await.ok()?.ok()?
    }

    /// `/health`'s `replication`.
    pub fn health(&self) -> Value {
        let now = common::timefmt::now_ms();
        let (pending, lag, oldest) = {
            let q = self.queue();
            let oldest = q.oldest().map(|(canonical, since)| {
                json!({
                    "workspace": Ident::from_canonical(&self.data_real, canonical).map(|i| i.to_json()),
                    "pendingSince": common::timefmt::iso8601(since),
                })
            });
            (q.len(), q.lag_seconds(now), oldest)
        };
        json!({
            "enabled": true,
            "endpoint": self.settings.endpoint,
            "bucket": self.settings.bucket,
            "prefix": self.settings.prefix,
            "node": self.node,
            "pending": pending,
            "lagSeconds": lag,
            "oldestUnreplicated": oldest,
            "lastError": *self.last_error.lock().unwrap_or_else(|p| p.into_inner()),
            "replications": self.replicated.load(Ordering::Relaxed),
            "objectsSent": self.counters.objects.get(),
            "bytesSent": self.counters.bytes.get(),
            "errors": self.counters.errors.get(),
        })
    }

    /// `/health`'s `replication` when it is off.
    pub fn health_off() -> Value {
        json!({"enabled": false})
    }

    /// The gauges `/metrics` sets at a scrape: (lag in seconds, workspaces pending).
    pub fn gauges(&self) -> (f64, u64) {
        let q = self.queue();
        (q.lag_seconds(common::timefmt::now_ms()), q.len() as u64)
    }
}
