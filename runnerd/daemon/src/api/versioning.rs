//! `GET /versioning` and `POST /versioning/gc` (ours, beyond the contract; issue #32): what
//! the version history holds, workspace by workspace, and the collector run on demand.
//! `runnerctl history` and `runnerctl gc` call them.

use std::sync::Arc;

use serde_json::{Value, json};

use super::ApiResponse;
use super::error::ApiError;
use super::request;
use crate::app::App;
use crate::history::Trigger;

/// The settings and the last collection's full report (`null` before the first).
pub fn get(app: &App) -> Result<ApiResponse, ApiError> {
    let last = app.history.last().map(|(trigger, report)| {
        let mut v = serde_json::to_value(&*report).unwrap_or_default();
        if let Value::Object(map) = &mut v {
            map.insert("trigger".into(), Value::from(trigger.as_str()));
        }
        v
    });
    let mut body = app.history.health();
    if let Value::Object(map) = &mut body {
        map.remove("lastCollection");
        map.insert("lastCollection".into(), last.unwrap_or(Value::Null));
    }
    Ok(ApiResponse::json(200, body.to_string()))
}

/// Runs a collection now (`{"dryRun": true}` accounts and deletes nothing); answers its
/// report. An empty body is a real collection.
pub async fn collect(app: &Arc<App>, body: &[u8]) -> Result<ApiResponse, ApiError> {
    let dry_run = if body.iter().all(u8::is_ascii_whitespace) {
        false
    } else {
        let obj = request::parse_object(body)?;
        match obj.get("dryRun") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => return Err(ApiError::bad_request("invalid_request", "dryRun must be a boolean")),
        }
    };
    let report = app.history.collect(app, Trigger::Requested, dry_run).await.map_err(|e| match e {
        crate::history::HistoryError::Running => {
            ApiError::with_status(409, "collection_running", e.to_string())
        }
        e => ApiError::with_status(500, "history_collection_failed", crate::error_chain(&e)),
    })?;
    let mut v = serde_json::to_value(&*report).unwrap_or_else(|_| json!({}));
    if let Value::Object(map) = &mut v {
        map.insert("trigger".into(), Value::from("requested"));
    }
    Ok(ApiResponse::json(200, v.to_string()))
}
