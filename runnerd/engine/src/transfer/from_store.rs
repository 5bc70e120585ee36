//! A restore from the object store (issue #34): the bucket's latest head for a workspace (or a
//! named version), its closure fetched (each object verified on arrival), installed here at
//! an epoch above the bucket's, and the bucket's head document moved to this node — so the
//! copy the store came from, should its node return, finds a higher epoch and fences itself.

use std::sync::Arc;

use super::receive::{self, Install, Installed};
use super::{Ident, TransferFailed};
use crate::app::App;
use crate::replica::{Fetched, HeadDoc};

/// What a restore from the store did.
#[derive(Debug)]
pub struct FromStore {
    pub installed: Installed,
    pub fetched: Fetched,
    /// The node whose replication the restored head came from.
    pub from_node: String,
}

/// Restores `ident` from the object store: its latest replicated head, or `version` (a head
/// record's digest the bucket holds).
pub async fn restore(
    app: &Arc<App>,
    ident: &Ident,
    version: Option<&str>,
) -> Result<FromStore, TransferFailed> {
    let replica = app.replica.as_ref().ok_or(TransferFailed::ReplicationOff)?;
    let doc = replica.read_head(ident).await.map_err(TransferFailed::Replica)?;
    let doc = doc.ok_or_else(|| TransferFailed::NotInStore { ident: ident.to_string() })?;
    let head = match version {
        None => doc.head.clone(),
        Some(digest) if digest == doc.head.digest => doc.head.clone(),
        Some(digest) => replica
            .bucket
            .record_ref(digest)
            .await
            .map_err(TransferFailed::Replica)?
            .ok_or_else(|| TransferFailed::NotInStore { ident: format!("{ident} version {digest}") })?,
    };
    let fetched = replica.fetch_closure(&head).await.map_err(TransferFailed::Replica)?;
    let (canonical, _) = receive::ensure_workspace(app, ident)?;
    let epoch = doc.epoch.max(receive::local_epoch(app, &canonical)?).saturating_add(1);
    let installed =
        receive::install(app, ident, &head, Install::SameHead { epoch, replace_live: true }).await?;
    // The bucket names this node now, unless another restore raised it meanwhile: then this
    // copy is the older one, and it is fenced as replication would fence it.
    let now = replica.read_head(ident).await.map_err(TransferFailed::Replica)?;
    // (This node's own replicator may have written the document at this epoch already.)
    if let Some(newer) = now.filter(|d| d.epoch > epoch || (d.epoch == epoch && d.node != replica.node)) {
        app.versions.placement().fence(&canonical, newer.epoch, &newer.node, crate::timefmt::now_ms())?;
        return Err(TransferFailed::Stale { ident: ident.to_string(), local: epoch, offered: newer.epoch });
    }
    let doc2 = HeadDoc {
        ident: ident.clone(),
        head: installed.head.clone(),
        epoch,
        node: replica.node.clone(),
        committed_at_ms: crate::timefmt::now_ms(),
    };
    replica.bucket.write_head(&doc2).await.map_err(TransferFailed::Replica)?;
    tracing::info!(event = "workspace_restored_from_store", workspace = %ident, from = %doc.node, epoch,
        head = %installed.head.digest, objects = fetched.objects, bytes = fetched.bytes);
    Ok(FromStore { installed, fetched, from_node: doc.node })
}
