//! The source's side of a move: under the writer lease (so nothing writes meanwhile), the
//! live files committed as a `workspace-move` version, its closure listed, and — once the
//! target has committed it — this copy fenced at the new epoch. The moves in flight are kept
//! for `where` to show their progress.

use std::collections::HashMap;
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::receive::{existing_workspace, local_epoch};
use super::{Ident, TransferFailed, blocking};
use crate::app::App;
use crate::versioning::Ref;
use crate::writer::Writer;
use runner_store::transfer::closure::closure;

/// How far a move has got (read by `where` while it runs).
#[derive(Debug, Default)]
pub struct Progress {
    pub to: String,
    pub started_ms: u64,
    pub objects_total: AtomicU64,
    pub bytes_total: AtomicU64,
    pub objects_sent: AtomicU64,
    pub bytes_sent: AtomicU64,
}

impl Progress {
    pub fn to_json(&self) -> serde_json::Value {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        serde_json::json!({
            "to": self.to,
            "startedAt": crate::timefmt::iso8601(self.started_ms),
            "objectsTotal": get(&self.objects_total),
            "objectsSent": get(&self.objects_sent),
            "bytesTotal": get(&self.bytes_total),
            "bytesSent": get(&self.bytes_sent),
        })
    }
}

/// The moves in flight, by canonical workspace path.
#[derive(Debug, Default)]
pub struct Moves(Mutex<HashMap<PathBuf, Arc<Progress>>>);

impl Moves {
    pub fn get(&self, canonical: &std::path::Path) -> Option<Arc<Progress>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).get(canonical).cloned()
    }

    fn insert(&self, canonical: PathBuf, progress: Arc<Progress>) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).insert(canonical, progress);
    }

    fn remove(&self, canonical: &std::path::Path) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).remove(canonical);
    }
}

/// A move under way: the lease held, the version to send and what it is made of.
#[derive(Debug)]
pub struct Outgoing {
    pub ident: Ident,
    pub canonical: PathBuf,
    pub head: Ref,
    pub tree: Ref,
    /// The head's closure, children before the records naming them, the head last.
    pub objects: Vec<Ref>,
    /// The epoch the target will hold (this copy's + 1).
    pub epoch: u64,
    pub progress: Arc<Progress>,
    app: Arc<App>,
    writer: Option<Writer>,
}

impl Drop for Outgoing {
    fn drop(&mut self) {
        self.app.moves.remove(&self.canonical);
    }
}

/// Starts moving `ident` to `to`: refuses a workspace a managed run holds (before and after
/// the lease), takes the writer lease (a fenced copy is refused there, naming where it went),
/// commits the live files as a `workspace-move` version and lists its closure.
pub async fn prepare(app: &Arc<App>, ident: &Ident, to: &str) -> Result<Outgoing, TransferFailed> {
    let (canonical, pinned) = existing_workspace(app, ident)?;
    if app.managed.holds(&canonical) {
        return Err(TransferFailed::Busy { ident: ident.to_string() });
    }
    let nested_pin = pinned.try_clone().map_err(|e| TransferFailed::Task(e.to_string()))?;
    let writer = app.versions.begin(&canonical, pinned, None).await?;
    if app.managed.holds(&canonical) {
        return Err(TransferFailed::Busy { ident: ident.to_string() });
    }
    if blocking(move || Ok(runner_store::transfer::materialize::contains_nested(nested_pin.as_fd())?)).await?
    {
        return Err(TransferFailed::Nested);
    }
    let tree = app.versions.commit_mutation(&writer, "workspace-move", None, true).await?;
    let head =
        app.versions.head(&canonical)?.ok_or_else(|| TransferFailed::NoHead { ident: ident.to_string() })?;
    let epoch = local_epoch(app, &canonical)?
        .checked_add(1)
        .filter(|e| *e <= super::protocol::MAX_EPOCH)
        .ok_or_else(|| TransferFailed::Task("the workspace's epoch cannot be raised any further".into()))?;
    let versions = app.versions.clone();
    let root = head.clone();
    let objects = blocking(move || Ok(closure(versions.store(), &root, &mut |_| false)?)).await?;
    let progress = Arc::new(Progress {
        to: to.to_owned(),
        started_ms: crate::timefmt::now_ms(),
        objects_total: AtomicU64::new(objects.len() as u64),
        bytes_total: AtomicU64::new(objects.iter().map(|o| o.size).sum()),
        ..Progress::default()
    });
    app.moves.insert(canonical.clone(), progress.clone());
    Ok(Outgoing {
        ident: ident.clone(),
        canonical,
        head,
        tree,
        objects,
        epoch,
        progress,
        app: app.clone(),
        writer: Some(writer),
    })
}

impl Outgoing {
    /// The target committed the head at `self.epoch`: this copy is fenced (every write here
    /// now answers where it went) and the lease released.
    pub fn fence(mut self) -> Result<(), TransferFailed> {
        let now = crate::timefmt::now_ms();
        self.app.versions.placement().fence(&self.canonical, self.epoch, &self.progress.to, now)?;
        self.app.sandbox.forget(
            crate::isolation::prestart::Scope::Beneath(&self.canonical),
            crate::isolation::prestart::Discard::Workspace,
        );
        drop(self.writer.take());
        tracing::info!(event = "workspace_moved", workspace = %self.ident, to = %self.progress.to,
            epoch = self.epoch, head = %self.head.digest);
        Ok(())
    }
}
