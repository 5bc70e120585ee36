//! The routes (contract §2) and their handlers. Authentication happens before routing:
//! `GET /health` is the only route answered without a token.

pub mod answer;
mod envs;
pub mod error;
mod health;
mod managed;
mod npu;
pub mod query;
pub mod remote;
mod repair;
pub mod request;
mod resources;
pub mod skills;
pub mod stream;
mod transfer;
mod versioning;

use std::sync::Arc;

use serde_json::{Value, json};
use tokio::sync::watch;

use crate::app::{App, runner_version};
use crate::auth::{self, Gate};
use crate::exec;
use crate::timefmt;
use error::ApiError;

/// A request as the handlers see it: method, path, query, the signature headers, the body.
#[derive(Debug)]
pub struct ApiRequest {
    pub method: String,
    pub path: String,
    pub query: Option<String>,
    pub peer: String,
    pub timestamp: Option<String>,
    pub signature: Option<String>,
    pub body: Vec<u8>,
    pub headers: hyper::HeaderMap,
    /// The unread body of a streamed upload ([`streams_upload`]).
    pub upload: Option<hyper::body::Incoming>,
}

/// A JSON answer with its status.
#[derive(Debug)]
pub struct ApiResponse {
    pub status: u16,
    /// The serialized JSON (without the trailing newline).
    pub body: String,
    /// Raw bytes streamed instead of `body` (file downloads).
    pub download: Option<stream::Download>,
}

impl ApiResponse {
    pub fn json(status: u16, body: String) -> ApiResponse {
        ApiResponse { status, body, download: None }
    }
}

fn ok(body: Value) -> Result<ApiResponse, ApiError> {
    Ok(ApiResponse::json(200, body.to_string()))
}

/// The routes whose request body is streamed to disk rather than read whole.
pub fn streams_upload(method: &str, path: &str) -> bool {
    (method == "PUT" && matches!(path, "/remote-workspace/file" | "/remote-workspace/transfer-file"))
        || (method == "POST" && path == "/workspace-transfer/objects")
}

/// The most bytes a route's body may have: the original's 2,000,000, and 64 MiB for
/// `POST /skill-packages` (contract §1.2).
pub fn body_limit(method: &str, path: &str) -> usize {
    if method == "POST" && path == "/skill-packages" {
        crate::skills::BODY_LIMIT
    } else {
        crate::http::BODY_LIMIT
    }
}

/// The routes that carry an execution signature.
pub fn signed(method: &str, path: &str) -> bool {
    method == "POST"
        && (matches!(
            path,
            "/execute" | "/execute-shell" | "/shell-executions" | "/npu/jobs" | "/remote-workspace/repair"
        ) || (path.starts_with("/npu/jobs/") && path.ends_with("/cancel"))
            || path.starts_with("/workspace-transfer/"))
}

/// Whether the request may be answered before its body is read (health needs no body).
pub fn is_health(method: &str, path: &str) -> bool {
    method == "GET" && path == "/health"
}

/// Answers `GET /health` (no auth, no disk, no subprocess; one bounded question each to
/// egressd and npu-brokerd, asked together).
pub async fn health(app: &App) -> ApiResponse {
    let (egress, npu_broker) = tokio::join!(app.egress.status(), npu::status(app));
    let body = health::health(app, &egress, npu::health_entries(app, &npu_broker));
    ApiResponse::json(200, body.to_string())
}

/// The bearer check, made before the body is read (contract §1.3).
pub fn authorize(
    gate: &Gate,
    authorization: Option<&[u8]>,
    method: &str,
    path: &str,
    peer: &str,
) -> Result<(), ApiError> {
    if auth::bearer_ok(authorization, gate.token.expose()) {
        return Ok(());
    }
    let reason = if authorization.is_some() { "wrong token" } else { "no token" };
    tracing::warn!(event = "auth_failed", reason, method, path, peer);
    Err(ApiError::unauthorized())
}

/// Everything after the bearer check: the signature where required, then the route.
pub async fn handle(
    app: Arc<App>,
    gate: &Gate,
    req: ApiRequest,
    client_gone: watch::Receiver<bool>,
) -> Result<ApiResponse, ApiError> {
    if signed(&req.method, &req.path) {
        verify_signature(app.config.signature_max_age_ms, gate, &req)?;
    }
    // Exact paths only (contract §2): `//execute`, `/status/` or `/kernels//teardown` are
    // not routes. The signature check above saw this same string.
    let segments: Vec<&str> = req.path.strip_prefix('/').unwrap_or("").split('/').collect();
    if segments.iter().any(|s| s.is_empty()) {
        return Err(ApiError::not_found());
    }
    // The route table, left whole past 80 lines (issue #33): every route is one arm here,
    // read in one place against the contract; split by family, a route would be two looks away.
    match (req.method.as_str(), segments.as_slice()) {
        ("GET", ["status"]) => ok(status(&app, npu::active_jobs(&app).await)),
        ("GET", ["resources"]) => ok(resources::resources(&app).await),
        ("GET", ["load"]) => ok(resources::load(&app).await),
        ("GET", ["npu", "devices"]) => {
            let refresh = query::get(req.query.as_deref(), "refresh").as_deref() == Some("1");
            ok(serde_json::to_value(
                crate::accel::select::npu_view(&app.accel, &app.accel_prober(), refresh).await,
            )
            .unwrap_or_default())
        }
        ("GET", ["gpu", "devices"]) => {
            let refresh = query::get(req.query.as_deref(), "refresh").as_deref() == Some("1");
            ok(serde_json::to_value(
                crate::accel::select::gpu_view(&app.accel, &app.accel_prober(), refresh).await,
            )
            .unwrap_or_default())
        }
        ("GET", ["skill-packages", id]) if skills::is_package_id(id) => skills::get(&app, id).await,
        ("POST", ["skill-packages"]) => skills::post(&app, req.body).await,
        ("DELETE", ["skill-packages", id]) if skills::is_package_id(id) => {
            let id = (*id).to_owned();
            detached(async move { skills::delete(&app, &req.peer, &id).await }).await
        }
        ("GET", ["kernels"]) => ok(json!([])),
        ("POST", ["kernels", "teardown"]) => teardown_session(&app, &req.body).await,
        ("POST", ["kernels", id, "teardown"]) => teardown_kernel(id, &req.body),
        ("GET", ["metrics"]) => Ok(metrics(&app).await),
        ("GET", ["versioning"]) => versioning::get(&app),
        ("POST", ["versioning", "gc"]) => {
            detached(async move { versioning::collect(&app, &req.body).await }).await
        }
        ("POST", ["execute-shell"]) => {
            execute(app.clone(), request::Route::ExecuteShell, &req.body, client_gone).await
        }
        ("POST", ["execute"]) => execute(app.clone(), request::Route::Execute, &req.body, client_gone).await,
        ("POST", ["shell-executions"]) => {
            let started = managed::start(&app, &req.body).await;
            app.metrics
                .request(request::Route::ShellExecutions.name(), started.as_ref().err().map(|e| e.code));
            started
        }
        ("GET", ["remote-workspace", "files"]) => remote::list_all(&app, req.query.as_deref()).await,
        ("POST", ["remote-workspace", "files"]) => {
            remote::list_selected(&app, req.query.as_deref(), &req.body).await
        }
        // Writes run in their own task: a client that disconnects drops this handler, and
        // the writer must still finish, commit and release its lease in order.
        ("DELETE", ["remote-workspace"]) => {
            detached(async move { remote::clear(&app, req.query.as_deref()).await }).await
        }
        ("GET", ["remote-workspace", "file"]) => remote::get_file(&app, req.query.as_deref()).await,
        ("PUT", ["remote-workspace", "file"]) => {
            detached(async move {
                remote::put_file(&app, req.query.as_deref(), &req.headers, req.upload, false).await
            })
            .await
        }
        ("PUT", ["remote-workspace", "transfer-file"]) => {
            detached(async move {
                remote::put_file(&app, req.query.as_deref(), &req.headers, req.upload, true).await
            })
            .await
        }
        ("POST", ["remote-workspace", "repair"]) => {
            detached(async move { repair::repair(&app, &req.body).await }).await
        }
        ("POST", ["remote-workspace", "snapshots"]) => {
            detached(async move { remote::snapshot(&app, &req.body).await }).await
        }
        ("GET", ["remote-workspace", "snapshots", id, "file"]) if remote::is_export_id(id) => {
            remote::snapshot_file(&app, id, req.query.as_deref()).await
        }
        ("GET", ["shell-executions", id]) => {
            managed::get(&app, &percent_decode(id), req.query.as_deref()).await
        }
        ("GET", ["shell-executions", id, "logs"]) => {
            managed::logs(&app, &percent_decode(id), req.query.as_deref()).await
        }
        ("POST", ["shell-executions", id, "cancel"]) => {
            managed::cancel(&app, &percent_decode(id), req.query.as_deref()).await
        }
        ("GET", ["npu", "workloads"]) => npu::workloads(&app).await,
        ("GET", ["npu", "jobs"]) => npu::list(&app, req.query.as_deref()).await,
        ("POST", ["npu", "jobs"]) => npu::submit(&app, &req.body).await,
        ("GET", ["npu", "jobs", id]) => {
            npu::read(&app, percent_decode(id), req.query.as_deref(), npu::Read::Job).await
        }
        ("GET", ["npu", "jobs", id, "logs"]) => {
            npu::read(&app, percent_decode(id), req.query.as_deref(), npu::Read::Logs).await
        }
        ("GET", ["npu", "jobs", id, "result"]) => {
            npu::read(&app, percent_decode(id), req.query.as_deref(), npu::Read::Result).await
        }
        ("POST", ["npu", "jobs", id, "cancel"]) => npu::cancel(&app, percent_decode(id), &req.body).await,
        ("GET", ["environments"]) => envs::list(&app).await,
        ("POST", ["environments"]) => {
            detached(async move { envs::create(&app, &req.peer, &req.body).await }).await
        }
        ("DELETE", ["environments", id]) => {
            let id = percent_decode(id);
            detached(async move { envs::delete(&app, &req.peer, &id).await }).await
        }
        ("POST", ["environments", id, "install"]) => {
            let id = percent_decode(id);
            detached(async move { envs::install(&app, &req.peer, &id, &req.body).await }).await
        }
        ("POST", ["environments", id, "uninstall"]) => {
            let id = percent_decode(id);
            detached(async move { envs::uninstall(&app, &req.peer, &id, &req.body).await }).await
        }
        ("GET", ["environment-setup"]) => envs::setup(&app),
        ("POST", ["environment-setup"]) => envs::start_setup(&app, &req.peer, &req.body),
        ("GET", ["environment-revisions"]) => envs::revisions(&app).await,
        ("GET", ["environment-revisions", id, "snapshot"]) => envs::snapshot(&app, &percent_decode(id)).await,
        ("POST", ["workspace-transfer", "missing"]) => transfer::missing(&app, &req.body).await,
        ("POST", ["workspace-transfer", "objects"]) => transfer::objects(&app, req.upload).await,
        ("POST", ["workspace-transfer", "commit"]) => {
            detached(async move { transfer::commit(&app, &req.body).await }).await
        }
        ("POST", ["workspace-transfer", "push"]) => {
            let token = gate.token.expose().to_owned();
            detached(async move { transfer::push(&app, &token, &req.body).await }).await
        }
        ("POST", ["workspace-transfer", "draining"]) => transfer::set_draining(&app, &req.body).await,
        ("GET", ["workspace-transfer", "list"]) => transfer::list(&app, req.query.as_deref()).await,
        ("GET", ["workspace-transfer", "where"]) => transfer::where_is(&app, req.query.as_deref()).await,
        ("POST", ["workspace-transfer", "backup"]) => {
            detached(async move { transfer::backup(&app, &req.body).await }).await
        }
        ("POST", ["workspace-transfer", "restore"]) => {
            detached(async move { transfer::restore(&app, &req.body).await }).await
        }
        _ => Err(ApiError::not_found()),
    }
}

/// Which signed routes refuse a signature already accepted (api.md improvement 2). The
/// execution routes' bodies carry a required `executionId`, so a caller never signs the same
/// bytes twice there. The NPU job routes' bodies carry nothing unique (`{sessionId}` for every
/// cancel), and the original client's timestamps cluster on second boundaries (`Date.now()`
/// plus an offset learnt from a second-precision `Date` header, contract §6), so two distinct
/// submits or cancels can share a signature: refusing them would break callers (drop-in).
fn replay_checked(path: &str) -> bool {
    !(path == "/npu/jobs" || path.starts_with("/npu/jobs/"))
}

/// The execution signature of a signed route ([`signed`]) and its replay check, with
/// runnerd's answers. Public: a fleet router decides exactly as the node would.
pub fn verify_signature(max_age: u64, gate: &Gate, req: &ApiRequest) -> Result<(), ApiError> {
    let now = timefmt::now_ms();
    // A streamed object upload signs its path and query; its bytes are checked by digest.
    let streamed;
    let signed_bytes: &[u8] = if streams_upload(&req.method, &req.path) {
        streamed = transfer::signed_stream_bytes(&req.path, req.query.as_deref());
        &streamed
    } else {
        &req.body
    };
    let checked = auth::verify(
        gate.token.expose(),
        req.timestamp.as_deref(),
        req.signature.as_deref(),
        signed_bytes,
        now,
        max_age,
    )
    .and_then(|()| {
        if !replay_checked(&req.path) {
            return Ok(());
        }
        let ts = req.timestamp.as_deref().and_then(|t| t.parse::<u64>().ok()).unwrap_or(now);
        let signature = req.signature.as_deref().unwrap_or_default();
        if gate.replays.first_use(signature, now, ts.saturating_add(max_age)) {
            Ok(())
        } else {
            Err(auth::SignatureError::Replayed)
        }
    });
    match checked {
        Ok(()) => Ok(()),
        Err(e) => {
            tracing::warn!(event = "auth_failed", reason = e.reason(), method = %req.method, path = %req.path, peer = %req.peer);
            let message = if req.path.starts_with("/npu/jobs/") {
                "Invalid or expired NPU job cancel signature"
            } else if req.path == "/npu/jobs" {
                "Invalid or expired NPU job signature"
            } else {
                "Invalid or expired execution signature"
            };
            let code =
                if e == auth::SignatureError::Replayed { "replayed_request" } else { "invalid_signature" };
            Err(ApiError::with_status(401, code, message))
        }
    }
}

fn status(app: &App, npu_jobs: Value) -> Value {
    json!({
        "activeExecutions": app.registry.snapshot(),
        "capturedAt": timefmt::now_iso(),
        "kernels": [],
        "npuJobs": npu_jobs,
        "runnerVersion": runner_version(),
        "status": "ok",
    })
}

const DEFAULT_TEARDOWN_REASON: &str = "Persistent kernel memory was cleared";

async fn teardown_session(app: &App, body: &[u8]) -> Result<ApiResponse, ApiError> {
    let obj = request::parse_object(body)?;
    let session = request::non_blank(&obj, "sessionId")
        .ok_or_else(|| ApiError::bad_request("session_id_required", "sessionId is required"))?;
    request::refuse_control("sessionId", session)?;
    let reason = request::non_blank(&obj, "reason").unwrap_or(DEFAULT_TEARDOWN_REASON).to_owned();
    // No persistent kernels exist; the teardown still waits for the session's executions.
    let _exclusive = app.admission.session_exclusive(session).await;
    tracing::info!(event = "kernels_teardown", session_id = %session, count = 0);
    ok(json!({"count": 0, "reason": reason}))
}

fn teardown_kernel(id: &str, body: &[u8]) -> Result<ApiResponse, ApiError> {
    let obj = request::parse_object(body)?;
    let reason = request::non_blank(&obj, "reason").unwrap_or(DEFAULT_TEARDOWN_REASON).to_owned();
    ok(json!({"count": 0, "kernelId": percent_decode(id), "reason": reason}))
}

/// `GET /metrics`: the registry, with the queue's counts and egressd's decisions as of now.
async fn metrics(app: &App) -> ApiResponse {
    let egress = app.egress.status().await.ok().map(|s| s.decisions);
    let admitted = app.admission.admitted();
    let snapshot = crate::metrics::Snapshot {
        admitted: admitted as i64,
        running: app.admission.running() as i64,
        capacity: app.config.queue_capacity as i64,
        egress,
        journal: app.journal.metrics(),
        history: app.history.metrics(),
        replication: app.replica.as_ref().map(|r| r.gauges()),
        prestart: app.sandbox.isolation.prestarted(),
        microvm_pool: crate::isolation::Isolation::prestarted(&*app.sandbox.microvm),
    };
    let text = app.metrics.render(&snapshot);
    ApiResponse {
        status: 200,
        body: String::new(),
        download: Some(stream::Download::from_text(text, crate::metrics::CONTENT_TYPE)),
    }
}

async fn execute(
    app: Arc<App>,
    route: request::Route,
    body: &[u8],
    client_gone: watch::Receiver<bool>,
) -> Result<ApiResponse, ApiError> {
    let answered = execute_inner(app.clone(), route, body, client_gone).await;
    app.metrics.request(route.name(), answered.as_ref().err().map(|e| e.code));
    answered
}

async fn execute_inner(
    app: Arc<App>,
    route: request::Route,
    body: &[u8],
    client_gone: watch::Receiver<bool>,
) -> Result<ApiResponse, ApiError> {
    let clock = crate::metrics::PhaseClock::new();
    let req = request::parse(route, request::parse_object(body)?)?;
    // The execution runs in its own task: when the client disconnects, this handler is
    // dropped and `client_gone` fires, but the task still kills its sandbox, waits for the
    // namespace to end, and releases its locks in order. A stopping runnerd stops it too.
    let stop = exec::StopToken::new();
    let mut shutdown = app.shutdown.subscribe();
    let mut client_gone = client_gone;
    // Not tied to this handler (it may be dropped first): it ends with the execution.
    let relay = tokio::spawn({
        let stop = stop.clone();
        async move {
            tokio::select! {
                _ = exec::gone(&mut client_gone) => {}
                _ = exec::gone(&mut shutdown) => {}
            }
            stop.stop(exec::StopReason::Caller);
        }
    });
    let task = tokio::spawn(exec::execute(app, req, stop, clock));
    let answered = task.await;
    relay.abort();
    match answered {
        // Streamed straight from the kept output (it can be large): no copy of it is made.
        Ok(result) => {
            let answer =
                answer::Answer::new(result?).map_err(|e| ApiError::from(exec::EngineError::internal(e)))?;
            Ok(ApiResponse { status: 200, body: String::new(), download: Some(answer.into_download()) })
        }
        Err(e) => Err(exec::EngineError::Internal(format!("the execution task failed: {e}")).into()),
    }
}

/// Runs a handler in its own task, so that dropping the request (a client disconnect) does
/// not drop it halfway through a workspace write.
async fn detached(
    work: impl std::future::Future<Output = Result<ApiResponse, ApiError>> + Send + 'static,
) -> Result<ApiResponse, ApiError> {
    tokio::spawn(work)
        .await
        .unwrap_or_else(|e| Err(ApiError::bad_request("internal", format!("the request task failed: {e}"))))
}

/// `decodeURIComponent` for path parameters (see [`query::decode_path`]).
pub fn percent_decode(s: &str) -> String {
    query::decode_path(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signed_routes() {
        for (m, p, s) in [
            ("POST", "/execute", true),
            ("POST", "/execute-shell", true),
            ("POST", "/shell-executions", true),
            ("POST", "/npu/jobs", true),
            ("POST", "/npu/jobs/abc/cancel", true),
            ("GET", "/execute", false),
            ("POST", "/shell-executions/x/cancel", false),
            ("POST", "/kernels/teardown", false),
        ] {
            assert_eq!(signed(m, p), s, "{m} {p}");
        }
    }

    #[test]
    fn replay_checked_routes() {
        for (p, checked) in [
            ("/execute", true),
            ("/execute-shell", true),
            ("/shell-executions", true),
            ("/npu/jobs", false),
            ("/npu/jobs/abc/cancel", false),
        ] {
            assert_eq!(replay_checked(p), checked, "{p}");
        }
    }

    #[test]
    fn decoding() {
        assert_eq!(percent_decode("a%20b"), "a b");
        assert_eq!(percent_decode("%E8%AE%AD"), "训");
        assert_eq!(percent_decode("100%"), "100%");
        assert_eq!(percent_decode("%zz"), "%zz");
    }
}
