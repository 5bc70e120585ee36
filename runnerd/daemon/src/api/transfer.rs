//! `/workspace-transfer/*` (ours, issue #34): workspaces moved between runnerd nodes by object
//! hash, their placement shown, restored. Every route needs the bearer token; every `POST` is
//! signed like the execution routes (the object stream's signature covers its query, its
//! bytes are verified by their digests).
//!
//! The target's routes: `missing`, `objects`, `commit`. The source's: `push` (drives the
//! target's three through [`crate::peer`]). Either's: `where`, `restore`, `backup`.

use std::io::Read;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use http_body_util::BodyExt;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::error::ApiError;
use super::stream::UPLOAD_IDLE;
use super::{ApiResponse, query};
use crate::app::App;
use crate::peer::{Peer, PeerError};
use crate::transfer::protocol::{self, ProtocolError};
use crate::transfer::receive::{self, Install};
use crate::transfer::{Ident, TransferFailed, outgoing, status};
use crate::versioning::Ref;

/// The one place a transfer failure becomes an answer.
impl From<TransferFailed> for ApiError {
    fn from(e: TransferFailed) -> ApiError {
        let message = crate::error_chain(&e);
        match e {
            TransferFailed::Write(ref w) if ApiError::moved(w).is_some() => {
                ApiError::moved(w).expect("checked just above")
            }
            TransferFailed::Stale { .. }
            | TransferFailed::Busy { .. }
            | TransferFailed::Sending { .. }
            | TransferFailed::Exists { .. }
            | TransferFailed::Nested => ApiError::with_status(409, e.code(), message),
            TransferFailed::Task(_) => ApiError::with_status(500, e.code(), message),
            TransferFailed::NoSpace { .. } => ApiError::with_status(507, e.code(), message),
            TransferFailed::ReplicationOff => ApiError::with_status(503, e.code(), message),
            TransferFailed::NotInStore { .. } => ApiError::with_status(404, e.code(), message),
            TransferFailed::Replica(_) => ApiError::with_status(502, e.code(), message),
            TransferFailed::Workspace(w) => ApiError::from(w),
            _ => ApiError::bad_request(e.code(), message),
        }
    }
}

impl From<ProtocolError> for ApiError {
    fn from(e: ProtocolError) -> ApiError {
        ApiError::from(TransferFailed::from(e))
    }
}

fn peer_err(e: PeerError) -> ApiError {
    let code = match &e {
        PeerError::Refused { status: 409, .. } => "target_refused",
        PeerError::Refused { .. } => "target_refused",
        PeerError::Local(_) => "transfer_refused",
        _ => "target_unreachable",
    };
    let status = match &e {
        PeerError::Refused { status: 409, .. } => 409,
        PeerError::Local(_) => 400,
        _ => 502,
    };
    ApiError::with_status(status, code, crate::error_chain(&e))
}

fn ok(status: u16, body: Value) -> Result<ApiResponse, ApiError> {
    Ok(ApiResponse::json(status, body.to_string()))
}

/// `POST /workspace-transfer/missing` `{objects: [Ref…]}` → `{missing: [Ref…]}`.
pub async fn missing(app: &Arc<App>, body: &[u8]) -> Result<ApiResponse, ApiError> {
    let asked = protocol::asked(&protocol::object(body)?)?;
    let versions = app.versions.clone();
    let lacking = tokio::task::spawn_blocking(move || receive::missing(versions.store(), &asked))
        .await
        .map_err(|e| ApiError::with_status(500, "internal", e.to_string()))?;
    ok(200, json!({"missing": lacking}))
}

/// `POST /workspace-transfer/objects?stream=ID`: the object stream, read as it arrives.
pub async fn objects(app: &Arc<App>, upload: Option<hyper::body::Incoming>) -> Result<ApiResponse, ApiError> {
    let upload =
        upload.ok_or_else(|| ApiError::bad_request("body_unreadable", "The object stream is missing"))?;
    let (tx, rx) = mpsc::channel::<Result<hyper::body::Bytes, String>>(8);
    let pump = tokio::spawn(pump(upload, tx));
    let versions = app.versions.clone();
    let received = tokio::task::spawn_blocking(move || {
        let mut stream =
            std::io::BufReader::with_capacity(256 * 1024, BodyReader { rx, current: Default::default() });
        receive::receive_objects(versions.store(), &mut stream)
    })
    .await
    .map_err(|e| ApiError::with_status(500, "internal", e.to_string()))?;
    pump.abort();
    let got = received?;
    tracing::info!(
        event = "workspace_objects_received",
        stored = got.stored,
        present = got.present,
        bytes = got.bytes
    );
    ok(200, json!({"stored": got.stored, "present": got.present, "bytes": got.bytes}))
}

/// Feeds an upload's frames to the blocking reader; an idle or broken upload ends it with an
/// error (the reader then fails the object it was reading: nothing partial is published).
async fn pump(mut body: hyper::body::Incoming, tx: mpsc::Sender<Result<hyper::body::Bytes, String>>) {
    loop {
        let frame = match tokio::time::timeout(UPLOAD_IDLE, body.frame()).await {
            Err(_) => Err("the object stream stalled".to_owned()),
            Ok(None) => return,
            Ok(Some(Err(e))) => Err(format!("the object stream broke: {e}")),
            Ok(Some(Ok(frame))) => match frame.into_data() {
                Ok(data) => Ok(data),
                Err(_) => continue,
            },
        };
        let failed = frame.is_err();
        if tx.send(frame).await.is_err() || failed {
            return;
        }
    }
}

/// A blocking reader over the frames [`pump`] sends.
struct BodyReader {
    rx: mpsc::Receiver<Result<hyper::body::Bytes, String>>,
    current: hyper::body::Bytes,
}

impl Read for BodyReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.current.is_empty() {
            match self.rx.blocking_recv() {
                None => return Ok(0),
                Some(Ok(data)) => self.current = data,
                Some(Err(e)) => return Err(std::io::Error::other(e)),
            }
        }
        let n = buf.len().min(self.current.len());
        buf[..n].copy_from_slice(&self.current.split_to(n));
        Ok(n)
    }
}

/// `POST /workspace-transfer/commit` `{workspace|project, head, epoch, from?}`: the head (whose
/// closure must all be here) becomes this node's copy at `epoch`.
pub async fn commit(app: &Arc<App>, body: &[u8]) -> Result<ApiResponse, ApiError> {
    let req = protocol::commit_request(&protocol::object(body)?)?;
    let installed = receive::install(
        app,
        &req.ident,
        &req.head,
        Install::SameHead { epoch: req.epoch, replace_live: false },
    )
    .await?;
    tracing::info!(event = "workspace_arrived", workspace = %req.ident, from = %req.from, epoch = req.epoch,
        head = %req.head.digest, files = installed.materialized.files, bytes = installed.materialized.bytes);
    ok(200, installed_json(&req.ident, &installed))
}

fn installed_json(ident: &Ident, installed: &receive::Installed) -> Value {
    let m = &installed.materialized;
    json!({
        "ident": ident.to_json(),
        "head": installed.head,
        "tree": installed.tree,
        "epoch": installed.epoch,
        "files": m.files,
        "directories": m.dirs,
        "symlinks": m.symlinks,
        "bytes": m.bytes,
    })
}

/// `POST /workspace-transfer/push` `{workspace|project, to}`: moves the workspace to the runnerd
/// at `to` and fences this copy. Resumable: objects that arrived before a break are not sent
/// again. The fence is set only once the target has said it holds this head at this epoch.
pub async fn push(app: &Arc<App>, token: &str, body: &[u8]) -> Result<ApiResponse, ApiError> {
    let req = protocol::push_request(&protocol::object(body)?)?;
    let peers = &app.config.transfer_peers;
    if !peers.is_empty() && !peers.contains(&req.to) {
        return Err(ApiError::with_status(
            403,
            "peer_not_allowed",
            format!(
                "{} is not among this node's transfer_peers; a push carries the fleet's token to its target",
                req.to
            ),
        ));
    }
    let out = outgoing::prepare(app, &req.ident, &req.to).await?;
    let peer = Peer::new(&req.to, token);
    let lacking = peer.missing(&out.objects).await.map_err(peer_err)?;
    let total_objects = out.objects.len() as u64;
    let total_bytes = out.progress.bytes_total.load(Ordering::Relaxed);
    let (sent_objects, sent_bytes) = (lacking.len() as u64, lacking.iter().map(|r| r.size).sum::<u64>());
    if !lacking.is_empty() {
        peer.send_objects(app.versions.clone(), lacking, out.progress.clone()).await.map_err(peer_err)?;
    }
    let mut offer = req.ident.to_json();
    offer["head"] = serde_json::to_value(&out.head).unwrap_or_default();
    offer["epoch"] = json!(out.epoch);
    offer["from"] = json!(app.config.node_url);
    let arrived = match peer.post("/workspace-transfer/commit", &offer).await {
        Ok(answer) => answer,
        // Refused: the target did not take it. Anything else (the connection broke, no answer
        // in time) is ambiguous: the target may have committed. Ask it before deciding.
        Err(e @ PeerError::Refused { .. }) => return Err(peer_err(e)),
        Err(e) => confirmed(&peer, &req.ident, &out).await.ok_or_else(|| peer_err(e))?,
    };
    if !holds(&arrived, &out.head, out.epoch) {
        return Err(peer_err(PeerError::Answer(req.to.clone(), format!("its commit answered {arrived}"))));
    }
    let (head, tree, epoch) = (out.head.clone(), out.tree.clone(), out.epoch);
    out.fence()?;
    ok(
        200,
        json!({
            "ident": req.ident.to_json(),
            "to": req.to,
            "head": head,
            "tree": tree,
            "epoch": epoch,
            "objects": {"total": total_objects, "sent": sent_objects, "alreadyThere": total_objects.saturating_sub(sent_objects)},
            "bytes": {"total": total_bytes, "sent": sent_bytes, "alreadyThere": total_bytes.saturating_sub(sent_bytes)},
            "target": arrived,
        }),
    )
}

/// Whether a peer's answer says it holds `head` at `epoch`.
fn holds(answer: &Value, head: &Ref, epoch: u64) -> bool {
    answer["head"]["digest"].as_str() == Some(head.digest.as_str()) && answer["epoch"].as_u64() == Some(epoch)
}

/// After an ambiguous commit, the target's own word on where the workspace is: its `where`
/// answer when it holds this head at this epoch, else none (the move failed; this copy stays
/// live, and the target's copy, if its commit is still running, is refused by the next
/// push's epoch or fenced by replication).
async fn confirmed(peer: &Peer, ident: &Ident, out: &outgoing::Outgoing) -> Option<Value> {
    let answer = peer.get(&format!("/workspace-transfer/where?{}", ident.query())).await.ok()?;
    let held = holds(&answer, &out.head, out.epoch) && answer["fenced"] == json!(false);
    tracing::warn!(event = "workspace_move_unconfirmed", workspace = %ident, to = %peer.url, confirmed = held);
    held.then_some(answer)
}

/// `POST /workspace-transfer/draining {"draining": bool}`: a fleet router's drain (or its
/// end); every router reads it back from `GET /load`.
pub async fn set_draining(app: &Arc<App>, body: &[u8]) -> Result<ApiResponse, ApiError> {
    let obj = protocol::object(body)?;
    let draining = obj
        .get("draining")
        .and_then(Value::as_bool)
        .ok_or_else(|| ApiError::bad_request("bad_request", "draining must be true or false"))?;
    let data_dir = app.data_dir.clone();
    tokio::task::spawn_blocking(move || crate::transfer::draining::set(&data_dir, draining))
        .await
        .map_err(|e| ApiError::with_status(500, "internal", e.to_string()))?
        .map_err(|e| ApiError::with_status(500, "draining_io", format!("could not record the drain: {e}")))?;
    tracing::info!(event = "node_draining", draining);
    ok(200, json!({"draining": draining}))
}

/// `GET /workspace-transfer/list?after=NAME&limit=N`: the workspaces held live here, a page
/// at a time (what a drain moves away); `next` continues, `null` at the end.
pub async fn list(app: &Arc<App>, q: Option<&str>) -> Result<ApiResponse, ApiError> {
    let after = query::get(q, "after").filter(|a| !a.is_empty());
    let limit = match query::get(q, "limit") {
        None => status::LIST_LIMIT,
        Some(n) => common::settings::parse_non_negative(&n)
            .and_then(|n| usize::try_from(n).ok())
            .filter(|n| (1..=status::LIST_LIMIT).contains(n))
            .ok_or_else(|| {
                ApiError::bad_request("bad_limit", format!("limit must be 1 to {}", status::LIST_LIMIT))
            })?,
    };
    let app2 = app.clone();
    let (held, next) = tokio::task::spawn_blocking(move || status::held(&app2, after.as_deref(), limit))
        .await
        .map_err(|e| ApiError::with_status(500, "internal", e.to_string()))?;
    let workspaces: Vec<Value> = held.iter().map(Ident::to_json).collect();
    ok(200, json!({"workspaces": workspaces, "next": next}))
}

/// `GET /workspace-transfer/where?workspace=K` (or `project=P`).
pub async fn where_is(app: &Arc<App>, q: Option<&str>) -> Result<ApiResponse, ApiError> {
    let mut obj = serde_json::Map::new();
    for name in ["workspace", "project"] {
        if let Some(v) = query::get(q, name) {
            obj.insert(name.to_owned(), Value::String(v));
        }
    }
    let ident = Ident::from_json(&obj).map_err(ProtocolError::from)?;
    let app2 = app.clone();
    let ident2 = ident.clone();
    let mut answer = tokio::task::spawn_blocking(move || status::where_is(&app2, &ident2))
        .await
        .map_err(|e| ApiError::with_status(500, "internal", e.to_string()))??;
    // `store=1`: also the object store's head (a fleet router asks before it calls a
    // workspace it finds nowhere new: one that was on a lost node is restored instead).
    if query::get(q, "store").as_deref() == Some("1") {
        answer["store"] = match &app.replica {
            None => json!({"enabled": false}),
            Some(replica) => match replica.read_head(&ident).await {
                Ok(Some(doc)) => json!({"enabled": true, "head": doc.to_json()}),
                Ok(None) => json!({"enabled": true, "head": null}),
                Err(e) => json!({"enabled": true, "error": crate::error_chain(&e)}),
            },
        };
    }
    ok(200, answer)
}

/// `POST /workspace-transfer/restore` `{workspace|project, version?, fromStore?}`: from this
/// node's history, a version (a head record's digest) becomes the workspace's files again,
/// committed as a `workspace-restore`; `fromStore`: the object store's latest head (or that
/// version) becomes this node's copy at an epoch above the store's.
pub async fn restore(app: &Arc<App>, body: &[u8]) -> Result<ApiResponse, ApiError> {
    let req = protocol::restore_request(&protocol::object(body)?)?;
    if req.from_store {
        let restored = crate::transfer::from_store::restore(app, &req.ident, req.version.as_deref()).await?;
        let mut answer = installed_json(&req.ident, &restored.installed);
        answer["fromNode"] = json!(restored.from_node);
        answer["fetched"] = json!({
            "objects": restored.fetched.objects,
            "bytes": restored.fetched.bytes,
            "alreadyHere": restored.fetched.present,
        });
        return ok(200, answer);
    }
    let version = req.version.clone().ok_or_else(|| {
        ApiError::bad_request(
            "version_required",
            "name the version to restore (`version`: a head record's digest)",
        )
    })?;
    let head = local_version(app, &req.ident, &version).await?;
    let installed = receive::install(app, &req.ident, &head, Install::Restored).await?;
    tracing::info!(event = "workspace_restored", workspace = %req.ident, version = %version, head = %installed.head.digest);
    ok(200, installed_json(&req.ident, &installed))
}

/// `POST /workspace-transfer/backup` `{workspace|project}`: the workspace's head replicated to
/// the object store now.
pub async fn backup(app: &Arc<App>, body: &[u8]) -> Result<ApiResponse, ApiError> {
    use crate::replica::{Outcome, ReplicaError};
    let obj = protocol::object(body)?;
    let ident = Ident::from_json(&obj).map_err(ProtocolError::from)?;
    let replica = app.replica.as_ref().ok_or_else(|| ApiError::from(TransferFailed::ReplicationOff))?;
    let (canonical, _) = receive::existing_workspace(app, &ident).map_err(ApiError::from)?;
    let sent = replica.backup_now(&canonical).await.map_err(|e| match e {
        ReplicaError::Moved { ref moved_to, epoch, .. } => {
            ApiError::from_write(crate::writer::WriteError::Fenced { moved_to: moved_to.clone(), epoch })
        }
        ReplicaError::NoHead(_) => ApiError::bad_request("no_version", crate::error_chain(&e)),
        ReplicaError::Client(_) => ApiError::with_status(502, "object_store_failed", crate::error_chain(&e)),
        _ => ApiError::with_status(500, "internal", crate::error_chain(&e)),
    })?;
    let outcome = match &sent.outcome {
        Outcome::Replicated => json!("replicated"),
        Outcome::Fenced { epoch, node } => json!({"fenced": {"epoch": epoch, "movedTo": node}}),
    };
    ok(
        200,
        json!({
            "ident": ident.to_json(),
            "head": sent.head,
            "epoch": sent.epoch,
            "objects": {"listed": sent.listed, "sent": sent.objects},
            "bytes": sent.bytes,
            "outcome": outcome,
        }),
    )
}

/// The record of `digest` in this node's history of `ident`.
async fn local_version(app: &Arc<App>, ident: &Ident, digest: &str) -> Result<Ref, ApiError> {
    let (canonical, _) = receive::existing_workspace(app, ident).map_err(ApiError::from)?;
    let history = app.versions.history(&canonical).map_err(ApiError::from_write)?;
    history.into_iter().rev().find(|r| r.digest == digest).ok_or_else(|| {
        ApiError::bad_request(
            "version_not_found",
            format!("{ident} has no version {digest} in this node's history"),
        )
    })
}

/// The signed bytes of a `/workspace-transfer/objects` request: its path and query (its body
/// is verified object by object instead).
pub fn signed_stream_bytes(path: &str, q: Option<&str>) -> Vec<u8> {
    match q {
        Some(q) => format!("{path}?{q}").into_bytes(),
        None => path.as_bytes().to_vec(),
    }
}
