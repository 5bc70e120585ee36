//! Sending one workspace's head to the bucket (issue #34), and the background task that does
//! it after each commit.
//!
//! One replication, in order:
//! 1. the workspace's portable name and this node's epoch for it; a fenced copy is never sent;
//! 2. the bucket's head document: one with a higher epoch means this copy is stale — it is
//!    fenced here, naming that node, and nothing is written;
//! 3. the head's closure, less the records whose closure the bucket already has
//!    (`Placement::is_replicated`);
//! 4. each object the bucket lacks, a few at a time;
//! 5. those records marked replicated, then (the epochs checked again) the head document;
//!    the head as replicated in the placement database.
//!
//! The head document is written last, so a reader of the bucket never finds a head whose
//! objects are not all there.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use runner_store::transfer::TransferError;

use super::client::{Bucket, ClientError};
use super::layout::HeadDoc;
use crate::transfer::Ident;
use crate::versioning::Ref;
use crate::writer::Versions;

/// Objects sent at once.
const CONCURRENT_OBJECTS: usize = 4;

#[derive(Debug, thiserror::Error)]
pub enum ReplicaError {
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error("the placement database failed")]
    Placement(#[source] TransferError),
    #[error("listing the objects the head {head} reaches failed")]
    Closure {
        head: String,
        #[source]
        source: TransferError,
    },
    #[error("{} is not a workspace with a portable name (a remote workspace key or a project under projects/)", .0.display())]
    Unnamed(PathBuf),
    #[error("{0} has no committed version yet")]
    NoHead(Ident),
    #[error("reading the workspace's head failed")]
    Head(#[source] crate::writer::WriteError),
    #[error("{ident} moved to {moved_to} (epoch {epoch}); this copy is not replicated")]
    Moved { ident: Ident, moved_to: String, epoch: u64 },
    #[error("a blocking task of the replication failed")]
    Task(#[source] crate::blocking::Panicked),
}

/// How a replication ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The bucket's head document names this head now.
    Replicated,
    /// The bucket holds a newer copy (a higher epoch, written by `node`): this one was
    /// fenced instead of overwriting it.
    Fenced { epoch: u64, node: String },
}

/// What one replication did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sent {
    pub ident: Ident,
    pub head: Ref,
    /// This node's epoch for the workspace, written into the head document.
    pub epoch: u64,
    /// Objects of the closure not already known to be in the bucket.
    pub listed: u64,
    /// Objects uploaded, and their bytes (the rest were there already).
    pub objects: u64,
    pub bytes: u64,
    pub outcome: Outcome,
}

/// What a replication needs.
#[derive(Debug, Clone)]
pub struct Target<'a> {
    pub bucket: &'a Bucket,
    pub versions: &'a Arc<Versions>,
    /// The data directory's real path (workspaces' canonical paths are beneath it).
    pub data_real: &'a Path,
    /// This node's URL, written into head documents.
    pub node: &'a str,
    /// Counts each object as it is sent (the metrics).
    pub counters: &'a super::Counters,
}

fn placement_err(e: TransferError) -> ReplicaError {
    ReplicaError::Placement(e)
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> Result<T, ReplicaError> {
    crate::blocking::run(f).await.map_err(ReplicaError::Task)
}

/// Replicates `head` of the workspace `canonical` (see the module documentation).
pub async fn replicate(t: &Target<'_>, canonical: &Path, head: &Ref) -> Result<Sent, ReplicaError> {
    let ident = Ident::from_canonical(t.data_real, canonical)
        .ok_or_else(|| ReplicaError::Unnamed(canonical.to_owned()))?;
    let placed = {
        let (v, c) = (t.versions.clone(), canonical.to_owned());
        blocking(move || v.placement().get(&c)).await?.map_err(placement_err)?.unwrap_or_default()
    };
    if let Some(moved_to) = placed.moved_to {
        return Err(ReplicaError::Moved { ident, moved_to, epoch: placed.epoch });
    }
    let epoch = placed.epoch;
    let mut sent = Sent {
        ident,
        head: head.clone(),
        epoch,
        listed: 0,
        objects: 0,
        bytes: 0,
        outcome: Outcome::Replicated,
    };
    if let Some(fenced) = fence_if_newer(t, canonical, &sent.ident, epoch).await? {
        sent.outcome = fenced;
        return Ok(sent);
    }
    let objects = {
        let (v, h) = (t.versions.clone(), head.clone());
        blocking(move || {
            let mut known = |r: &Ref| v.placement().is_replicated(r).unwrap_or(false);
            runner_store::transfer::closure::closure(v.store(), &h, &mut known)
        })
        .await?
        .map_err(|source| ReplicaError::Closure { head: head.digest.clone(), source })?
    };
    sent.listed = objects.len() as u64;
    let jobs: Vec<_> = objects
        .iter()
        .map(|r| {
            let (bucket, versions, counters, r) =
                (t.bucket.clone(), t.versions.clone(), t.counters.clone(), r.clone());
            async move { send_one(&bucket, &versions, &counters, &r).await }
        })
        .collect();
    let mut uploads = futures::stream::iter(jobs).buffer_unordered(CONCURRENT_OBJECTS);
    while let Some(done) = uploads.next().await {
        if let Some(bytes) = done? {
            sent.objects += 1;
            sent.bytes += bytes;
        }
    }
    drop(uploads);
    let records: Vec<Ref> = objects.into_iter().filter(Ref::is_record).collect();
    {
        let v = t.versions.clone();
        blocking(move || v.placement().mark_replicated(&records)).await?.map_err(placement_err)?;
    }
    if let Some(fenced) = fence_if_newer(t, canonical, &sent.ident, epoch).await? {
        sent.outcome = fenced;
        return Ok(sent);
    }
    let now = common::timefmt::now_ms();
    let doc = HeadDoc {
        ident: sent.ident.clone(),
        head: head.clone(),
        epoch,
        node: t.node.to_owned(),
        committed_at_ms: now,
    };
    t.bucket.write_head(&doc).await?;
    let (v, c, h) = (t.versions.clone(), canonical.to_owned(), head.clone());
    blocking(move || v.placement().set_replicated(&c, &h, epoch, now)).await?.map_err(placement_err)?;
    Ok(sent)
}

/// One object: sent unless the bucket has it. `Some(bytes)` when sent.
async fn send_one(
    bucket: &Bucket,
    versions: &Arc<Versions>,
    counters: &super::Counters,
    r: &Ref,
) -> Result<Option<u64>, ReplicaError> {
    // A record not known to be replicated is almost always new; a blob may be an unchanged
    // file of a changed directory, which the bucket has already.
    if !r.is_record() && bucket.has_object(r).await? {
        return Ok(None);
    }
    let bytes = bucket.put_object(versions, r).await?;
    counters.objects.inc();
    counters.bytes.inc_by(bytes);
    Ok(Some(bytes))
}

/// Fences the copy here when the bucket's head document has a higher epoch than `ours`.
async fn fence_if_newer(
    t: &Target<'_>,
    canonical: &Path,
    ident: &Ident,
    ours: u64,
) -> Result<Option<Outcome>, ReplicaError> {
    let Some(theirs) = t.bucket.read_head(ident).await? else { return Ok(None) };
    if theirs.epoch <= ours {
        return Ok(None);
    }
    let (v, c, node) = (t.versions.clone(), canonical.to_owned(), theirs.node.clone());
    blocking(move || v.placement().fence(&c, theirs.epoch, &node, common::timefmt::now_ms()))
        .await?
        .map_err(placement_err)?;
    tracing::warn!(event = "replica_fenced", workspace = %ident, our_epoch = ours, their_epoch = theirs.epoch,
        moved_to = %theirs.node, reason = "the object store holds a newer copy of this workspace");
    Ok(Some(Outcome::Fenced { epoch: theirs.epoch, node: theirs.node }))
}

/// The pause after a failed replication before the next try.
pub fn retry_after(failures: u32) -> Duration {
    Duration::from_millis(super::pending::backoff_ms(failures, 10_000))
}
