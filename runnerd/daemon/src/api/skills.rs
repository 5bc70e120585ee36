//! `GET /skill-packages/:id` and `POST /skill-packages` (contract §5.2), and our
//! `DELETE /skill-packages/:id` (issue #32): the HTTP half of `crate::skills`. All do
//! blocking file I/O (hashing up to 64 MiB, removing a tree), so they run on the blocking
//! pool.

use serde_json::json;

use super::error::ApiError;
use super::{ApiResponse, ok};
use crate::app::App;
use crate::skills::{self, SkillError};

/// The HTTP form of a skill error: 400 (the original's handler failures), but for our
/// delete's 409 (an execution holds the package) and 404 (no such package).
pub fn api_error(e: &SkillError) -> ApiError {
    let status = match e {
        SkillError::InUse { .. } => 409,
        SkillError::NotPublished(_) => 404,
        _ => 400,
    };
    ApiError::with_status(status, e.code().as_str(), crate::error_chain(e))
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

/// `DELETE /skill-packages/:id`: `{id, deleted: true}`, 409 `skill_package_in_use` while an
/// execution (queued or running) names it, 404 `skill_not_published` when there is none.
pub async fn delete(app: &App, peer: &str, id: &str) -> Result<ApiResponse, ApiError> {
    let data = app.data_dir.clone();
    let in_use = app.skills_in_use.clone();
    let owned = id.to_owned();
    let deleted = tokio::task::spawn_blocking(move || skills::delete(&data, &in_use, &owned))
        .await
        .map_err(|e| ApiError::bad_request("internal", format!("the skill deletion failed: {e}")))?;
    match &deleted {
        Ok(()) => tracing::info!(event = "skill_package_deleted", peer, id),
        Err(e) => {
            tracing::warn!(event = "skill_package_delete_refused", peer, id, error = %crate::error_chain(e))
        }
    }
    deleted.map_err(|e| api_error(&e))?;
    ok(json!({"id": id, "deleted": true}))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_delete_refusal_has_its_own_status_the_originals_stay_400() {
        let cases = [
            (SkillError::InUse { id: "p".into(), executions: 2 }, 409, "skill_package_in_use"),
            (SkillError::NotPublished("p".into()), 404, "skill_not_published"),
            (SkillError::RootInvalid, 400, "skill_root_invalid"),
        ];
        for (e, status, code) in cases {
            let api = api_error(&e);
            assert_eq!((api.status, api.code), (status, code), "{e}");
        }
    }
}
