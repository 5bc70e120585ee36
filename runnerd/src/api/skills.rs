//! `GET /skill-packages/:id` and `POST /skill-packages` (contract §5.2): the HTTP half of
//! `crate::skills`. Both do blocking file I/O (hashing up to 64 MiB), so they run on the
//! blocking pool.

use serde_json::json;

use super::error::ApiError;
use super::{ApiResponse, ok};
use crate::app::App;
use crate::skills::{self, SkillError};

/// The HTTP form of a skill error: always 400 (the original's handler failures).
pub fn api_error(e: &SkillError) -> ApiError {
    ApiError::bad_request(e.code(), crate::error_chain(e))
}

/// Whether `id` is a route id (`[a-f0-9]{64}`); anything else is not a route (404).
pub fn is_package_id(id: &str) -> bool {
    skills::bundle::is_hex64(id)
}

pub async fn get(app: &App, id: &str) -> Result<ApiResponse, ApiError> {
    let data = app.data_dir.clone();
    let owned = id.to_owned();
    let found = tokio::task::spawn_blocking(move || skills::lookup(&data, &owned))
        .await
        .map_err(|e| ApiError::bad_request("internal", format!("the skill lookup failed: {e}")))?;
    match found {
        Ok(Some(root)) => ok(json!({"id": id, "root": root.to_string_lossy()})),
        Ok(None) => ok(json!({"id": id})),
        Err(e) => {
            tracing::warn!(event = "skill_package_refused", id, error = %crate::error_chain(&e));
            Err(api_error(&e))
        }
    }
}

pub async fn post(app: &App, body: Vec<u8>) -> Result<ApiResponse, ApiError> {
    let data = app.data_dir.clone();
    let published = tokio::task::spawn_blocking(move || skills::publish(&data, &body))
        .await
        .map_err(|e| ApiError::bad_request("internal", format!("the skill publication failed: {e}")))?;
    match published {
        Ok((id, root)) => ok(json!({"id": id, "root": root.to_string_lossy()})),
        Err(e) => Err(api_error(&e)),
    }
}
