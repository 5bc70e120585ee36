//! `/shell-executions` routes (contract §3): create (signed, 202), status, logs and cancel
//! (202), each scoped to its owner `(sessionId, agentId)` from the query. Status and cancel
//! answer the stored record verbatim; a large one streams, its memory held from the output
//! pool until it is sent.

use std::io::Read;
use std::sync::Arc;

use super::error::ApiError;
use super::request;
use super::stream::Download;
use super::{ApiResponse, query};
use crate::app::App;
use crate::exec;
use crate::launch::Held;
use crate::managed::manager::{ManagedError, RecordText};

/// The one place a managed-execution failure becomes an answer.
impl From<ManagedError> for ApiError {
    fn from(e: ManagedError) -> ApiError {
        match e {
            ManagedError::OutputBusy => {
                ApiError { retry_after: Some(1), ..ApiError::with_status(503, e.code(), e.to_string()) }
            }
            ManagedError::Moved { ref moved_to, .. } => ApiError {
                moved_to: Some(moved_to.clone()),
                ..ApiError::with_status(409, e.code(), e.to_string())
            },
            _ => ApiError::bad_request(e.code(), e.to_string()),
        }
    }
}

fn answer(status: u16, value: impl serde::Serialize) -> Result<ApiResponse, ApiError> {
    let body = serde_json::to_string(&value).map_err(|e| ApiError::bad_request("internal", e.to_string()))?;
    Ok(ApiResponse::json(status, body))
}

/// A reader that keeps output memory counted until it is dropped.
struct Holding<R> {
    reader: R,
    _held: Held,
}

impl<R: Read> Read for Holding<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.reader.read(buf)
    }
}

fn record(status: u16, rec: RecordText) -> ApiResponse {
    match rec.held {
        None => ApiResponse::json(status, rec.text),
        Some(held) => {
            let len = rec.text.len() as u64 + 1;
            let reader = Holding {
                reader: std::io::Cursor::new(rec.text.into_bytes()).chain(&b"\n"[..]),
                _held: held,
            };
            let download = Download::from_reader(reader, Some(len)).json();
            ApiResponse { status, body: String::new(), download: Some(download) }
        }
    }
}

/// The owner named by the query; missing parameters mean `""`.
fn owner(q: Option<&str>) -> (String, String) {
    (query::get(q, "sessionId").unwrap_or_default(), query::get(q, "agentId").unwrap_or_default())
}

pub async fn start(app: &Arc<App>, body: &[u8]) -> Result<ApiResponse, ApiError> {
    let req = request::parse(request::Route::ShellExecutions, request::parse_object(body)?)?;
    let located = exec::locate(app, &req.workspace)?;
    let rec = app.managed.start(app.clone(), req, located).await?;
    answer(202, rec)
}

pub async fn get(app: &App, id: &str, q: Option<&str>) -> Result<ApiResponse, ApiError> {
    let (session, agent) = owner(q);
    Ok(record(200, app.managed.record(&app.output_pool, id, &session, &agent).await?))
}

pub async fn logs(app: &App, id: &str, q: Option<&str>) -> Result<ApiResponse, ApiError> {
    let (session, agent) = owner(q);
    let cursor = query::get(q, "cursor");
    answer(200, app.managed.logs(id, &session, &agent, cursor.as_deref()).await?)
}

pub async fn cancel(app: &App, id: &str, q: Option<&str>) -> Result<ApiResponse, ApiError> {
    let (session, agent) = owner(q);
    Ok(record(202, app.managed.cancel(&app.output_pool, id, &session, &agent).await?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::managed::manager::{INVALID_CURSOR, INVALID_ID, NOT_FOUND, POISONED_HERE, USED_ID};

    /// Every managed failure: its status, code and exact text.
    #[test]
    fn managed_error_table() {
        for (e, status, code, text) in [
            (ManagedError::ShuttingDown, 400, "shutting_down", "Runner is shutting down"),
            (ManagedError::InvalidId, 400, "invalid_execution_id", INVALID_ID),
            (ManagedError::Poisoned, 400, "workspace_poisoned", POISONED_HERE),
            (ManagedError::IdUsed, 400, "execution_id_used", USED_ID),
            (ManagedError::NotFound, 400, "execution_not_found", NOT_FOUND),
            (ManagedError::InvalidCursor, 400, "invalid_cursor", INVALID_CURSOR),
            (
                ManagedError::OutputBusy,
                503,
                "output_memory_busy",
                "The runner's output memory is in use; retry the status request",
            ),
            (ManagedError::Store("disk I/O error".into()), 400, "internal", "disk I/O error"),
        ] {
            let a = ApiError::from(e);
            assert_eq!((a.status, a.code, a.message.as_str()), (status, code, text));
            assert_eq!(a.retry_after.is_some(), status == 503);
        }
    }
}
