//! The original's NPU broker routes (contract §2, §5.2), forwarded to npu-brokerd:
//! `GET /npu/workloads`, `GET /npu/jobs?session_id=`, signed `POST /npu/jobs`,
//! `GET /npu/jobs/:id[/logs|/result]?session_id=`, signed `POST /npu/jobs/:id/cancel`;
//! and the `npuBroker` / `npuBrokerd` blocks of `/health`. runnerd resolves the workspace
//! (as for executions) and maps the broker's refusals to the original's status codes.

use common::npu::{BrokerRequest, BrokerResponse, BrokerStatus, Failure, Submission};
use serde_json::{Value, json};

use super::error::ApiError;
use super::request;
use super::{ApiResponse, query};
use crate::app::App;
use crate::exec;
use crate::npu_broker::{BrokerError, REQUEST_TIMEOUT};

const SESSION_REQUIRED: &str = "session_id is required for NPU job access";
const DISABLED: &str = "NPU Broker is disabled";

fn unavailable(e: &BrokerError) -> ApiError {
    ApiError::with_status(
        503,
        "npu_broker_unavailable",
        format!(
            "NPU Broker is unavailable: {}; start npu-brokerd or check SCIENCE_AGENT_NPU_BROKER_SOCKET",
            crate::error_chain(e)
        ),
    )
}

fn failed(failure: Failure, message: String) -> ApiError {
    match failure {
        Failure::Invalid => ApiError::bad_request("npu_job_invalid", message),
        Failure::NotFound => ApiError::with_status(404, "npu_job_not_found", message),
        Failure::NotTerminal => ApiError::with_status(409, "npu_job_not_terminal", message),
    }
}

/// Forwards one request; `status` is the HTTP status of a success.
async fn forward(app: &App, req: BrokerRequest, status: u16) -> Result<ApiResponse, ApiError> {
    match app.npu_broker.request(&req, REQUEST_TIMEOUT).await {
        Ok(BrokerResponse::Json(body)) => Ok(ApiResponse::json(status, body)),
        Ok(BrokerResponse::Failed { failure, message }) => Err(failed(failure, message)),
        Ok(_) => Err(unavailable(&BrokerError::Unexpected)),
        Err(e) => Err(unavailable(&e)),
    }
}

/// `session_id` (or `sessionId`) from the query, required on every job read.
fn session(q: Option<&str>) -> Result<String, ApiError> {
    query::get(q, "session_id")
        .filter(|s| !s.trim().is_empty())
        .or_else(|| query::get(q, "sessionId").filter(|s| !s.trim().is_empty()))
        .ok_or_else(|| ApiError::bad_request("session_id_required", SESSION_REQUIRED))
}

pub async fn workloads(app: &App) -> Result<ApiResponse, ApiError> {
    if !app.npu_broker.enabled {
        return Ok(ApiResponse::json(200, "[]".into()));
    }
    let status = app.npu_broker.status().await.map_err(|e| unavailable(&e))?;
    Ok(ApiResponse::json(200, status.workloads))
}

pub async fn list(app: &App, q: Option<&str>) -> Result<ApiResponse, ApiError> {
    let session_id = session(q)?;
    if !app.npu_broker.enabled {
        return Ok(ApiResponse::json(200, "[]".into()));
    }
    forward(app, BrokerRequest::List { session_id }, 200).await
}

pub async fn submit(app: &App, body: &[u8]) -> Result<ApiResponse, ApiError> {
    if !app.npu_broker.enabled {
        return Err(ApiError::bad_request("npu_broker_disabled", DISABLED));
    }
    let obj = request::parse_object(body)?;
    if obj.get("runnerWorkspaceKey").is_some_and(|k| request::is_truthy(k) && !k.is_string()) {
        return Err(ApiError::bad_request("invalid_workspace_key", "Invalid remote workspace key"));
    }
    let workspace_root = exec::locate(app, &request::workspace_ref(&obj))?.root;
    // The broker runs jobs in the workspace without the writer lease: a moved one refuses here.
    app.versions.fenced(&workspace_root).map_err(ApiError::from_write)?;
    let text = |name: &str| request::string(&obj, name).map(str::to_owned);
    let submission = Submission {
        session_id: text("sessionId"),
        workload_id: text("workloadId"),
        config_path: text("configPath"),
        environment_revision_id: text("environmentRevisionId"),
        workspace_root,
    };
    forward(app, BrokerRequest::Submit(submission), 201).await
}

/// Which read of one job.
#[derive(Debug, Clone, Copy)]
pub enum Read {
    Job,
    Logs,
    Result,
}

pub async fn read(app: &App, id: String, q: Option<&str>, what: Read) -> Result<ApiResponse, ApiError> {
    let session_id = session(q)?;
    if !app.npu_broker.enabled {
        return Err(ApiError::with_status(404, "npu_job_not_found", "NPU job not found"));
    }
    let req = match what {
        Read::Job => BrokerRequest::Get { id, session_id },
        Read::Logs => BrokerRequest::Logs { id, session_id },
        Read::Result => BrokerRequest::Result { id, session_id },
    };
    forward(app, req, 200).await
}

pub async fn cancel(app: &App, id: String, body: &[u8]) -> Result<ApiResponse, ApiError> {
    let obj = request::parse_object(body)?;
    let session_id = request::non_blank(&obj, "sessionId")
        .ok_or_else(|| ApiError::bad_request("session_id_required", SESSION_REQUIRED))?
        .to_owned();
    if !app.npu_broker.enabled {
        return Err(ApiError::with_status(404, "npu_job_not_found", "NPU job not found"));
    }
    forward(app, BrokerRequest::Cancel { id, session_id }, 200).await
}

/// Queued and running jobs for `/status` (`[]` when the broker is off or unreachable).
pub async fn active_jobs(app: &App) -> Value {
    if !app.npu_broker.enabled {
        return json!([]);
    }
    match app.npu_broker.request(&BrokerRequest::Active, crate::npu_broker::STATUS_TIMEOUT).await {
        Ok(BrokerResponse::Json(body)) => serde_json::from_str(&body).unwrap_or_else(|_| json!([])),
        Ok(_) => json!([]),
        Err(e) => {
            tracing::warn!(event = "npu_broker_unreachable", error = %crate::error_chain(&e));
            json!([])
        }
    }
}

/// The broker's status, asked only when it is on.
pub async fn status(app: &App) -> Option<Result<BrokerStatus, BrokerError>> {
    if app.npu_broker.enabled { Some(app.npu_broker.status().await) } else { None }
}

/// `/health`'s `npuBroker` (the original's block) and `npuBrokerd` (ours: reachability and
/// confinement).
pub fn health_entries(app: &App, status: &Option<Result<BrokerStatus, BrokerError>>) -> (Value, Value) {
    let socket = app.npu_broker.socket.display().to_string();
    let (workloads, brokerd) = match status {
        None => (
            json!([]),
            json!({"enabled": false, "reachable": false, "controlSocket": socket,
                   "reason": "the NPU broker is off (SCIENCE_AGENT_NPU_BROKER is not set)"}),
        ),
        Some(Ok(s)) => (
            serde_json::from_str(&s.workloads).unwrap_or_else(|_| json!([])),
            json!({
                "enabled": true,
                "reachable": true,
                "controlSocket": socket,
                "version": s.version,
                "workloadConfig": s.workload_config,
                "queued": s.queued,
                "running": s.running,
                "confinement": {
                    "landlock": s.confinement.landlock,
                    "seccomp": s.confinement.seccomp,
                    "noNewPrivileges": s.confinement.no_new_privs,
                },
            }),
        ),
        Some(Err(e)) => (
            json!([]),
            json!({"enabled": true, "reachable": matches!(e, BrokerError::Refused(_)), "controlSocket": socket,
                   "reason": crate::error_chain(e)}),
        ),
    };
    (json!({"enabled": app.npu_broker.enabled, "queueConcurrency": 1, "workloads": workloads}), brokerd)
}
