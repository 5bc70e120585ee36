//! `/remote-workspace/*` routes (contract §5.1): list, read, upload (plain and verified
//! transfer), clear, and snapshot exports. Uploads stream into a private staging file first
//! and take the writer lease only to publish, so a long upload never blocks executions;
//! every write commits a `WorkspaceMutation`.

use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::Arc;

use serde_json::{Value, json};

use super::error::ApiError;
use super::request::parse_object as request_parse;
use super::stream::{self, Download, UploadError};
use super::{ApiResponse, query};
use crate::app::App;
use crate::remote::files::{self, RemoteError};
use crate::remote::paths;
use crate::timefmt;
use crate::versioning::{self, Ref};
use crate::workspace;
use crate::writer::WriteError;

const MAX_PATHS: usize = 50;
/// Where uploads are received before they are published (under the data directory, so a
/// rename into a workspace stays on one filesystem).
pub const STAGING: &str = ".runner-uploads";

fn json_reply(status: u16, v: Value) -> Result<ApiResponse, ApiError> {
    Ok(ApiResponse::json(status, v.to_string()))
}

fn remote_err(e: RemoteError) -> ApiError {
    let code = match &e {
        RemoteError::Escapes => "workspace_symlink",
        RemoteError::NotRegular => "not_regular_file",
        RemoteError::ParentNotDir => "parent_not_directory",
        RemoteError::TargetSymlink => "target_symlink",
        RemoteError::Exists => "file_exists",
        RemoteError::Quota => "workspace_quota_exceeded",
        RemoteError::NotFound(_) => "file_not_found",
        RemoteError::Io { .. } => "workspace_io",
    };
    ApiError::bad_request(code, crate::error_chain(&e))
}

fn write_err(e: WriteError) -> ApiError {
    ApiError::from_write(e)
}

fn path_err(message: &'static str) -> ApiError {
    ApiError::bad_request("invalid_workspace_path", message)
}

/// A query value that names a workspace or a file, decoded strictly (issue #15): a bad
/// percent-escape is refused with that value's own contract text, never repaired into a
/// name the caller did not send. Absent means `""`, as before.
fn named(q: Option<&str>, name: &str) -> Result<String, ApiError> {
    query::get_strict(q, name).map(Option::unwrap_or_default).map_err(|e| {
        let message = if name == "workspace" { "Invalid remote workspace key" } else { paths::NOT_RELATIVE };
        tracing::info!(event = "request_refused", reason = %e);
        ApiError::bad_request("invalid_percent_escape", message)
    })
}

/// The workspace named by the `workspace` key (created segment by segment), its canonical
/// path and a descriptor pinning it.
fn workspace_root(app: &App, key: &str) -> Result<(PathBuf, OwnedFd), ApiError> {
    let root = workspace::ensure_remote_workspace(&app.data_dir, key, &app.sandbox.user)?;
    let root = workspace::validated_workspace(&app.data_dir, &root)?;
    let fd = workspace::open_beneath(&app.data_dir, &root)?;
    Ok((root, fd))
}

/// Listings walking at once: each holds a descriptor per level and its paths in memory, and
/// hundreds of concurrent ones over a deep tree would take runnerd's descriptors from every
/// commit (review helper).
static LISTINGS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(4);

/// [`blocking`] for a listing: waits for one of [`LISTINGS`].
async fn listing_walk<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let _slot = LISTINGS.acquire().await.map_err(|e| ApiError::bad_request("internal", e.to_string()))?;
    blocking(f).await
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .unwrap_or_else(|e| Err(ApiError::bad_request("internal", format!("the file task failed: {e}"))))
}

fn listing(files: Vec<files::Listed>) -> Value {
    Value::Array(
        files
            .into_iter()
            .map(|f| json!({"modifiedAt": timefmt::iso8601(f.mtime_ms), "path": f.path, "size": f.size}))
            .collect(),
    )
}

/// `GET /remote-workspace/files?workspace=K`
pub async fn list_all(app: &App, q: Option<&str>) -> Result<ApiResponse, ApiError> {
    let (_, fd) = workspace_root(app, &named(q, "workspace")?)?;
    let listed = listing_walk(move || files::list(&fd, None).map_err(remote_err)).await?;
    json_reply(200, listing(listed))
}

/// `POST /remote-workspace/files` with `{workspace?, paths?}`.
pub async fn list_selected(app: &App, q: Option<&str>, body: &[u8]) -> Result<ApiResponse, ApiError> {
    let obj = request_parse(body)?;
    let key = match obj.get("workspace").and_then(Value::as_str) {
        Some(k) => k.to_owned(),
        None => named(q, "workspace")?,
    };
    let (_, fd) = workspace_root(app, &key)?;
    let selection = match obj.get("paths") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => None,
        Some(Value::Array(paths)) if paths.len() <= MAX_PATHS => Some(paths.clone()),
        Some(Value::String(s)) if s.is_empty() => None,
        Some(Value::Number(n)) if n.as_f64() == Some(0.0) => None,
        Some(_) => {
            return Err(ApiError::bad_request(
                "too_many_paths",
                "Remote workspace paths must contain at most 50 entries",
            ));
        }
    };
    let selection: Option<Vec<String>> = selection
        .map(|paths| {
            paths
                .iter()
                .map(|p| p.as_str().map(str::to_owned).ok_or_else(|| path_err(paths::NOT_RELATIVE)))
                .collect::<Result<_, _>>()
        })
        .transpose()?;
    let listed = listing_walk(move || {
        let segs: Option<Vec<Vec<&str>>> = selection
            .as_ref()
            .map(|paths| paths.iter().map(|p| paths::segments(p).map_err(path_err)).collect::<Result<_, _>>())
            .transpose()?;
        files::list(&fd, segs.as_deref()).map_err(remote_err)
    })
    .await?;
    json_reply(200, listing(listed))
}

/// `GET /remote-workspace/file?workspace=K&path=P`: the raw bytes, streamed.
pub async fn get_file(app: &App, q: Option<&str>) -> Result<ApiResponse, ApiError> {
    let (root, fd) = workspace_root(app, &named(q, "workspace")?)?;
    let path = named(q, "path")?;
    let (file, size) = blocking(move || {
        let segs = paths::segments(&path).map_err(path_err)?;
        files::open_file(&fd, &root, &segs).map_err(remote_err)
    })
    .await?;
    Ok(ApiResponse {
        status: 200,
        body: String::new(),
        // `take`: a file that grows while it is sent must not overrun its Content-Length.
        download: Some(Download::from_reader(std::io::Read::take(file, size), Some(size))),
    })
}

/// The verified-transfer headers.
#[derive(Debug, Clone, Copy)]
struct Declared {
    size: u64,
    sha256: [u8; 64],
    executable: u32,
}

const BAD_METADATA: &str = "Invalid verified upload metadata";

fn declared(headers: &hyper::HeaderMap) -> Result<Declared, ApiError> {
    let bad = || ApiError::bad_request("invalid_upload_metadata", BAD_METADATA);
    let text =
        |name: &str| headers.get(name).map(|v| v.to_str().map(str::trim).map_err(|_| bad())).transpose();
    let size = text("x-workspace-size")?.ok_or_else(bad)?;
    let size: u64 = size
        .parse()
        .ok()
        .filter(|n| *n <= 9_007_199_254_740_991 && size.bytes().all(|b| b.is_ascii_digit()))
        .ok_or_else(bad)?;
    let sha = text("x-workspace-sha256")?.ok_or_else(bad)?;
    if sha.len() != 64 || !sha.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return Err(bad());
    }
    let mut sha256 = [0u8; 64];
    sha256.copy_from_slice(sha.as_bytes());
    let executable = match text("x-workspace-executable")? {
        None | Some("") => 0,
        Some(t) => t
            .parse::<u32>()
            .ok()
            .filter(|n| n & !0o111 == 0 && t.bytes().all(|b| b.is_ascii_digit()))
            .ok_or_else(bad)?,
    };
    Ok(Declared { size, sha256, executable })
}

/// `conflict=`: whether an existing file is replaced (`reject`, the default, or `overwrite`).
fn overwrites(q: Option<&str>, transfer: bool) -> Result<bool, ApiError> {
    match query::get(q, "conflict").as_deref() {
        None | Some("reject") => Ok(false),
        Some("overwrite") => Ok(true),
        Some(_) if transfer => Err(ApiError::bad_request("invalid_upload_metadata", BAD_METADATA)),
        Some(_) => Err(ApiError::bad_request("invalid_conflict", "Invalid workspace conflict policy")),
    }
}

/// The upload staged under `staging`, checked against what a transfer declared.
async fn receive(
    upload: hyper::body::Incoming,
    staging: &std::path::Path,
    declared: Option<Declared>,
    max: u64,
    transfer: bool,
) -> Result<stream::Staged, ApiError> {
    // A verified transfer is read no further than it declared; a plain upload no further
    // than the quota (the original's body limit for that route).
    let limit = match declared {
        Some(d) if max > 0 && d.size > max => return Err(remote_err(RemoteError::Quota)),
        Some(d) => Some(d.size),
        None => (max > 0).then_some(max),
    };
    let staged = stream::receive(upload, staging, limit).await.map_err(|e| match e {
        UploadError::TooLarge(declared_size) if transfer => {
            mismatch(format!("more than the declared {declared_size} bytes arrived"))
        }
        UploadError::TooLarge(limit) => {
            ApiError::bad_request("body_too_large", format!("Request body exceeds the {limit} byte limit"))
        }
        other => ApiError::bad_request("upload_failed", crate::error_chain(&other)),
    })?;
    if let Some(d) = declared
        && (staged.size != d.size || staged.sha256.as_bytes() != d.sha256)
    {
        return Err(mismatch(format!("received {} bytes, sha256 {}", staged.size, staged.sha256)));
    }
    Ok(staged)
}

fn mismatch(detail: String) -> ApiError {
    ApiError::bad_request(
        "upload_mismatch",
        format!(
            "Verified upload did not match its declared size and SHA-256 ({detail}); nothing was published"
        ),
    )
}

/// `PUT /remote-workspace/file` (`transfer: false`) and `PUT …/transfer-file` (`true`).
pub async fn put_file(
    app: &Arc<App>,
    q: Option<&str>,
    headers: &hyper::HeaderMap,
    upload: Option<hyper::body::Incoming>,
    transfer: bool,
) -> Result<ApiResponse, ApiError> {
    let (root, fd) = workspace_root(app, &named(q, "workspace")?)?;
    let overwrite = overwrites(q, transfer)?;
    let declared = if transfer { Some(declared(headers)?) } else { None };
    let path = named(q, "path")?;
    let segs: Vec<String> =
        paths::segments(&path).map_err(path_err)?.into_iter().map(str::to_owned).collect();
    let display_path = segs.join("/");
    let max = app.config.max_workspace_bytes;
    let upload = upload.ok_or_else(|| ApiError::bad_request("body_unreadable", "Upload body is missing"))?;
    let staged = receive(upload, &app.data_dir.join(STAGING), declared, max, transfer).await?;
    let pinned = fd.try_clone().map_err(|e| ApiError::bad_request("internal", e.to_string()))?;
    let writer = app.versions.begin(&root, pinned, None).await.map_err(write_err)?;
    let exec_bits = declared.map_or(0, |d| d.executable);
    let (size, sha) = (staged.size, staged.sha256.clone());
    let owner = app.sandbox.user.clone();
    let op = blocking(move || {
        let refs: Vec<&str> = segs.iter().map(String::as_str).collect();
        let (name, parents) = refs.split_last().expect("segments are never empty");
        let parent = files::parent_for_write(&fd, parents, &owner).map_err(remote_err)?;
        let replaced = files::replaced_size(&parent, name).map_err(remote_err)?;
        if replaced > 0 && !overwrite && !transfer {
            // Checked again by the no-clobber link; this answers before the quota does.
            return Err(ApiError::with_status(409, "file_exists", files::EXISTS));
        }
        if max > 0 {
            // A directory the walk cannot read counts as over the quota (fail closed).
            let m = crate::measure::measure(std::os::fd::AsFd::as_fd(&fd));
            let used = if m.unreadable.is_some() { u64::MAX } else { m.bytes };
            if used.saturating_sub(replaced).saturating_add(staged.size) > max {
                return Err(remote_err(RemoteError::Quota));
            }
        }
        files::publish(&parent, name, &staged.path, overwrite, exec_bits, &owner).map_err(|e| match e {
            RemoteError::Exists if !transfer => ApiError::with_status(409, "file_exists", files::EXISTS),
            other => remote_err(other),
        })
    })
    .await;
    let kind = if transfer { "workspace-transfer" } else { "workspace-upload" };
    let committed = app.versions.commit_mutation(&writer, kind, None, op.is_ok()).await;
    drop(writer);
    committed.map_err(write_err)?;
    op?;
    tracing::info!(event = "workspace_file_written", workspace = %root.display(), path = %display_path, size, transfer);
    let body = if transfer {
        json!({"path": display_path, "size": size, "sha256": sha})
    } else {
        json!({"path": display_path, "size": size})
    };
    json_reply(201, body)
}

/// `DELETE /remote-workspace?workspace=K`: empties the workspace, keeps its directory.
pub async fn clear(app: &Arc<App>, q: Option<&str>) -> Result<ApiResponse, ApiError> {
    let (root, fd) = workspace_root(app, &named(q, "workspace")?)?;
    let pinned = fd.try_clone().map_err(|e| ApiError::bad_request("internal", e.to_string()))?;
    let writer = app.versions.begin(&root, pinned, None).await.map_err(write_err)?;
    let op = blocking(move || files::clear(&fd).map_err(remote_err)).await;
    let committed = app.versions.commit_mutation(&writer, "workspace-clear", None, op.is_ok()).await;
    // While the lease is held: no call can end and start another in between.
    app.sandbox.forget(
        crate::isolation::prestart::Scope::Beneath(&root),
        crate::isolation::prestart::Discard::Workspace,
    );
    drop(writer);
    committed.map_err(write_err)?;
    op?;
    tracing::info!(event = "workspace_cleared", workspace = %root.display());
    json_reply(200, json!({"deleted": true}))
}

/// `POST /remote-workspace/snapshots` with `{workspace, paths?}`: an export of the
/// committed tree (a checkpoint is committed first when the idle workspace changed).
pub async fn snapshot(app: &Arc<App>, body: &[u8]) -> Result<ApiResponse, ApiError> {
    let obj = request_parse(body)?;
    let key = obj.get("workspace").and_then(Value::as_str).unwrap_or("").trim().to_owned();
    let paths_value = obj.get("paths").and_then(Value::as_array).cloned();
    if paths_value.as_ref().is_some_and(|p| p.len() > MAX_PATHS) {
        return Err(ApiError::bad_request("too_many_paths", "Snapshot accepts at most 50 paths"));
    }
    let selection: Option<Vec<String>> =
        paths_value.map(|p| p.iter().map(|v| v.as_str().unwrap_or("").to_owned()).collect());
    let (root, fd) = workspace_root(app, &key)?;
    let tree = app.versions.observed_tree(&root, &fd).await.map_err(write_err)?;
    let versions = app.versions.clone();
    let captured_at = timefmt::now_iso();
    let answered_at = captured_at.clone();
    let (id, files) = blocking(move || {
        let store = versions.store();
        let files = store
            .snapshot_files(&tree, selection.as_deref())
            .map_err(|e| ApiError::bad_request("invalid_snapshot_path", crate::error_chain(&e)))?;
        let value = versioning::export_value(&key, &tree, &files, &captured_at);
        let (id, _) = versions.put_export(value).map_err(write_err)?;
        Ok((id, files))
    })
    .await?;
    let files: Vec<Value> = files
        .iter()
        .map(|f| json!({"path": f.path, "size": f.content.size, "sha256": f.content.hex(), "executable": f.executable}))
        .collect();
    let key = obj.get("workspace").and_then(Value::as_str).unwrap_or("").trim();
    tracing::info!(event = "workspace_exported", export = %id, workspace = %key, files = files.len());
    json_reply(201, json!({"id": id, "workspace": key, "capturedAt": answered_at, "files": files}))
}

/// Whether a path parameter can be an export id (`[a-f0-9-]{36}`).
pub fn is_export_id(id: &str) -> bool {
    id.len() == 36 && id.bytes().all(|b| matches!(b, b'a'..=b'f' | b'0'..=b'9' | b'-'))
}

/// `GET /remote-workspace/snapshots/:id/file?workspace=K&path=P`: the exported bytes.
pub async fn snapshot_file(app: &Arc<App>, id: &str, q: Option<&str>) -> Result<ApiResponse, ApiError> {
    let key = named(q, "workspace")?;
    let path = named(q, "path")?;
    let versions = app.versions.clone();
    let id = id.to_owned();
    let reader = blocking(move || {
        let not_found = || ApiError::bad_request("snapshot_not_found", "Workspace snapshot not found");
        let record = match versions.read_export(&id) {
            Ok(Some(record)) => record,
            Ok(None) => return Err(not_found()),
            Err(e) => return Err(ApiError::bad_request("snapshot_unreadable", e.to_string())),
        };
        if record.value.get("workspace").and_then(Value::as_str) != Some(key.trim()) {
            return Err(ApiError::bad_request(
                "snapshot_other_workspace",
                "Workspace snapshot belongs to another Workspace",
            ));
        }
        let wanted = path.trim();
        let content = record
            .value
            .get("files")
            .and_then(Value::as_array)
            .and_then(|files| files.iter().find(|f| f.get("path").and_then(Value::as_str) == Some(wanted)))
            .and_then(|f| f.get("content"))
            .map(Ref::from_value)
            .transpose()
            .map_err(|e| ApiError::bad_request("snapshot_corrupt", crate::error_chain(&e)))?
            .ok_or_else(|| {
                ApiError::bad_request("file_not_selected", "File was not selected in this Workspace snapshot")
            })?;
        versions
            .store()
            .open_reader(&content)
            .map_err(|e| ApiError::bad_request("snapshot_corrupt", crate::error_chain(&e)))
    })
    .await?;
    Ok(ApiResponse { status: 200, body: String::new(), download: Some(Download::from_reader(reader, None)) })
}
