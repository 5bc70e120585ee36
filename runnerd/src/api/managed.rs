//! `/shell-executions` routes (contract §3): create (signed, 202), status, logs and cancel
//! (202), each scoped to its owner `(sessionId, agentId)` from the query.

use std::sync::Arc;

use super::error::ApiError;
use super::{ApiResponse, query};
use crate::app::App;
use crate::exec::{self, request};

fn answer(status: u16, value: impl serde::Serialize) -> Result<ApiResponse, ApiError> {
    let body = serde_json::to_string(&value).map_err(|e| ApiError::bad_request("internal", e.to_string()))?;
    Ok(ApiResponse::json(status, body))
}

/// The owner named by the query; missing parameters mean `""`.
fn owner(q: Option<&str>) -> (String, String) {
    (query::get(q, "sessionId").unwrap_or_default(), query::get(q, "agentId").unwrap_or_default())
}

pub async fn start(app: &Arc<App>, body: &[u8]) -> Result<ApiResponse, ApiError> {
    let obj = request::parse_object(body)?;
    request::require_ephemeral(&obj)?;
    request::check_fields(request::Route::ShellExecutions, crate::sandbox::Language::Shell, &obj)?;
    let (root, read_only) = exec::resolve_workspace(app, &obj)?;
    let rec = app.managed.start(app.clone(), obj, root, read_only).await?;
    answer(202, rec)
}

pub async fn get(app: &App, id: &str, q: Option<&str>) -> Result<ApiResponse, ApiError> {
    let (session, agent) = owner(q);
    answer(200, app.managed.get(id, &session, &agent).await?)
}

pub async fn logs(app: &App, id: &str, q: Option<&str>) -> Result<ApiResponse, ApiError> {
    let (session, agent) = owner(q);
    let cursor = query::get(q, "cursor");
    answer(200, app.managed.logs(id, &session, &agent, cursor.as_deref()).await?)
}

pub async fn cancel(app: &App, id: &str, q: Option<&str>) -> Result<ApiResponse, ApiError> {
    let (session, agent) = owner(q);
    answer(202, app.managed.cancel(id, &session, &agent).await?)
}
